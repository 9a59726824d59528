"""gdn_jax: Gated DeltaNet and Kimi Delta Attention for JAX.

Pure-JAX references (the oracle), Pallas GPU kernels behind one `impl=` dispatch
(`gdn_jax.dispatch`), explicit pytree state. Every function exported here validates its
arguments once (ValueError naming the argument) before any device work.
"""

from gdn_jax.dispatch import IMPLS, Choice, explain, interpret
from gdn_jax.functional import (
    softplus, l2norm, gdn_gate, gdn_beta, kda_gate, gated_rmsnorm,
    causal_conv1d, causal_conv1d_step, conv_state_from_hf, conv_state_to_hf,
    state_to_16bit, state_to_f32, decode_step, verify_steps,
)
from gdn_jax.ops import gated_delta_rule, kda
from gdn_jax.state import ConvPool, ConvStash, DeltaPool, DeltaStash, GDNState, KDAState
from gdn_jax.validate import checked

__version__ = "0.1.0"

# Imported on first use: the kernels' entry points (pull in Pallas) and the Flax blocks (flax).
_LAZY = {
    "gdn_jax.decode": ("gdn_decode", "gdn_decode_pool", "convert_state"),
    "gdn_jax.verify": ("verify_states", "commit_states"),
    "gdn_jax.carry": ("CarryRequest", "carry_engages", "kernel_available", "carried_verify",
                      "accept", "flush"),
    "gdn_jax.conv_carry": ("conv_carried_verify", "conv_flush", "conv_step"),
    "gdn_jax.layers": ("Qwen3NextGatedDeltaNet", "KimiDeltaAttention", "GDNConfig", "KDAConfig",
                       "ServingState"),
}
_LAZY_NAMES = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name):
    if name in _LAZY_NAMES:
        import importlib
        return getattr(importlib.import_module(_LAZY_NAMES[name]), name)
    raise AttributeError(f"module 'gdn_jax' has no attribute {name!r}")


__all__ = [
    "IMPLS", "Choice", "explain", "interpret", "checked",
    "gated_delta_rule", "kda",
    "softplus", "l2norm", "gdn_gate", "gdn_beta", "kda_gate", "gated_rmsnorm",
    "causal_conv1d", "causal_conv1d_step", "conv_state_from_hf", "conv_state_to_hf",
    "state_to_16bit", "state_to_f32", "decode_step", "verify_steps",
    "GDNState", "KDAState", "DeltaStash", "ConvStash", "DeltaPool", "ConvPool", *_LAZY_NAMES,
]
