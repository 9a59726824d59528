"""Flax NNX blocks: the Qwen3-Next / Qwen3.5 Gated DeltaNet layer and the Kimi Delta Attention
layer (Kimi Linear, GLM-5.3-Flash), with HF checkpoint loading and explicit pytree state.

Both blocks: `init_state(batch_size, dtype=...)`, `__call__(x, state=None, *, impl="auto") ->
(y, new_state)`, `from_pretrained(path, layer_idx)`, and the serving path over a pool of
sequences (`init_serving_state`, `prefill`, `decode`, `verify`, `accept`, `flush`; see
`gdn_jax.layers.serving`).
"""

from gdn_jax.layers.qwen3_next import GDNConfig, Qwen3NextGatedDeltaNet
from gdn_jax.layers.kimi import KDAConfig, KimiDeltaAttention
from gdn_jax.state import ServingState

__all__ = ["GDNConfig", "Qwen3NextGatedDeltaNet", "KDAConfig", "KimiDeltaAttention", "ServingState"]
