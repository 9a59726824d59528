"""Layer state as explicit pytrees: frozen, registered dataclasses that jit, donate and shard.

recurrent  [B, HV, K, V]     the delta-rule state S (K-major), fp32 unless a 16-bit dtype is chosen
conv       [B, W-1, C]       the short conv's last W-1 inputs, time-major (see reference.causal_conv1d);
                             C is the conv's channel count (q | k | v for both blocks)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

_STATE_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)


def _check_state_dtype(dtype):
    if jnp.dtype(dtype) not in tuple(map(jnp.dtype, _STATE_DTYPES)):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")


def _init(cls, batch_size, *, num_v_heads, head_k_dim, head_v_dim, conv_dim, conv_width,
          dtype=jnp.float32, conv_dtype=jnp.float32):
    for name, val in (("batch_size", batch_size), ("num_v_heads", num_v_heads),
                      ("head_k_dim", head_k_dim), ("head_v_dim", head_v_dim), ("conv_dim", conv_dim)):
        if int(val) <= 0:
            raise ValueError(f"{name} must be positive, got {val}")
    if int(conv_width) < 1:
        raise ValueError(f"conv_width must be >= 1, got {conv_width}")
    _check_state_dtype(dtype)
    return cls(recurrent=jnp.zeros((batch_size, num_v_heads, head_k_dim, head_v_dim), dtype),
               conv=jnp.zeros((batch_size, conv_width - 1, conv_dim), conv_dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GDNState:
    """State of one Gated DeltaNet layer for a batch of sequences."""
    recurrent: jax.Array
    conv: jax.Array

    init = classmethod(_init)

    @property
    def batch_size(self) -> int:
        return self.recurrent.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KDAState:
    """State of one Kimi Delta Attention layer for a batch of sequences."""
    recurrent: jax.Array
    conv: jax.Array

    init = classmethod(_init)

    @property
    def batch_size(self) -> int:
        return self.recurrent.shape[0]
