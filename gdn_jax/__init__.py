"""gdn_jax: Gated DeltaNet and Kimi Delta Attention for JAX.

Pure-JAX references (the oracle), Pallas GPU kernels behind `impl=`, explicit pytree state.
"""

from gdn_jax.ops import gated_delta_rule, kda, IMPLS
from gdn_jax.reference import (
    softplus, l2norm, gdn_gate, gdn_beta, kda_gate, gated_rmsnorm,
    causal_conv1d, causal_conv1d_step, conv_state_from_hf, conv_state_to_hf,
    state_to_16bit, state_to_f32, decode_step, verify_steps,
)
from gdn_jax.state import GDNState, KDAState

__version__ = "0.1.0"

# Imported on first use: the kernels' dispatch (pulls in Pallas) and the Flax blocks (flax).
_LAZY = {
    "gdn_jax.decode": ("gdn_decode", "gdn_decode_pool", "convert_state", "select_decode_impl",
                       "DecodeChoice", "DECODE_IMPLS"),
    "gdn_jax.verify": ("DeltaStash", "ConvStash", "CarryRequest", "carry_engages",
                       "kernel_available", "verify_states", "commit_states", "carried_verify",
                       "accept", "flush", "conv_carried_verify", "conv_flush"),
    "gdn_jax.layers": ("Qwen3NextGatedDeltaNet", "KimiDeltaAttention", "GDNConfig", "KDAConfig"),
    "gdn_jax.layers.speculative": ("Speculative", "SpeculativeState"),
}
_LAZY_NAMES = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name):
    if name in _LAZY_NAMES:
        import importlib
        return getattr(importlib.import_module(_LAZY_NAMES[name]), name)
    raise AttributeError(f"module 'gdn_jax' has no attribute {name!r}")

__all__ = [
    "gated_delta_rule", "kda", "IMPLS",
    "softplus", "l2norm", "gdn_gate", "gdn_beta", "kda_gate", "gated_rmsnorm",
    "causal_conv1d", "causal_conv1d_step", "conv_state_from_hf", "conv_state_to_hf",
    "state_to_16bit", "state_to_f32", "decode_step", "verify_steps",
    "GDNState", "KDAState", *_LAZY_NAMES,
]
