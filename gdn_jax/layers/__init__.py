"""Flax NNX blocks: the Qwen3-Next / Qwen3.5 Gated DeltaNet layer and the Kimi Delta Attention
layer (Kimi Linear, GLM-5.3-Flash), with HF checkpoint loading and explicit pytree state.

Both blocks: `init_state(batch_size, dtype=...)`, `__call__(x, state=None, *, impl="auto") ->
(y, new_state)`, `from_pretrained(path, layer_idx)`.
"""

from gdn_jax.layers.qwen3_next import GDNConfig, Qwen3NextGatedDeltaNet
from gdn_jax.layers.kimi import KDAConfig, KimiDeltaAttention

__all__ = ["GDNConfig", "Qwen3NextGatedDeltaNet", "KDAConfig", "KimiDeltaAttention"]
