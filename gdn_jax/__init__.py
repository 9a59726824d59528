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

# The Flax blocks pull in flax: import them on first use (gdn_jax.Qwen3NextGatedDeltaNet, ...).
_LAYER_NAMES = ("Qwen3NextGatedDeltaNet", "KimiDeltaAttention", "GDNConfig", "KDAConfig")


def __getattr__(name):
    if name in _LAYER_NAMES:
        from gdn_jax import layers
        return getattr(layers, name)
    raise AttributeError(f"module 'gdn_jax' has no attribute {name!r}")

__all__ = [
    "gated_delta_rule", "kda", "IMPLS",
    "softplus", "l2norm", "gdn_gate", "gdn_beta", "kda_gate", "gated_rmsnorm",
    "causal_conv1d", "causal_conv1d_step", "conv_state_from_hf", "conv_state_to_hf",
    "state_to_16bit", "state_to_f32", "decode_step", "verify_steps",
    "GDNState", "KDAState", *_LAYER_NAMES,
]
