"""Recurrent-state dtype converters fp32 <-> fp16 / bf16 (out of place, round to nearest even).

A flat elementwise kernel: the state is viewed as one row of N elements, each program converts
`block` consecutive elements (a power of two dividing N). Narrowing rounds to nearest even
(Triton's default fp32 -> fp16/bf16 conversion); widening is exact. Out of place: the input is
not aliased, so the converter is a pure function of its argument.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.tracing import default_config

__all__ = ["ConvertBlockSizes", "convert_state", "unsupported_reason", "CONVERT_DTYPES"]

CONVERT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


@dataclasses.dataclass(frozen=True)
class ConvertBlockSizes:
    """Elements per program (a power of two; clipped to the largest power of two dividing N)
    and warps per program. 8192 elements x 4 B = 32 KiB in flight per program."""
    block: int = 8192
    num_warps: int = 8


def _largest_pow2_divisor(n: int, cap: int) -> int:
    d = 1
    while d < cap and n % (2 * d) == 0:
        d *= 2
    return d


def unsupported_reason(x_dtype, dtype, size: int) -> str | None:
    """Why the converter cannot take the call (None when it can). Pure."""
    src, dst = jnp.dtype(x_dtype), jnp.dtype(dtype)
    if src not in CONVERT_DTYPES or dst not in CONVERT_DTYPES:
        return f"converts float32/float16/bfloat16 only, got {src} -> {dst}"
    if (src.itemsize == 4) == (dst.itemsize == 4):
        return f"converts between fp32 and a 16-bit dtype, got {src} -> {dst}"
    if size == 0:
        return "the state is empty"
    if size >= 2**31:
        return f"the state holds {size} elements; the kernel indexes with int32 (< 2**31)"
    if _largest_pow2_divisor(size, 16) < 16:
        return f"the element count {size} must be a multiple of 16"
    return None


def _convert_kernel(x_ref, y_ref):
    y_ref[...] = x_ref[...].astype(y_ref.dtype)


def convert_state(x: jax.Array, dtype, *, block: ConvertBlockSizes | None = None,
                  interpret: bool = False) -> jax.Array:
    """x (any shape) converted to `dtype`, fp32 <-> fp16/bf16, RNE when narrowing. New buffer."""
    reason = unsupported_reason(getattr(x, "dtype", None), dtype, getattr(x, "size", 0))
    if reason is not None:
        raise ValueError(f"x: {reason}")
    block = block or ConvertBlockSizes()
    bs = _largest_pow2_divisor(x.size, block.block)
    return _launch(x, dtype=jnp.dtype(dtype), bs=bs, num_warps=block.num_warps, interpret=interpret)


@default_config
@functools.partial(jax.jit, static_argnames=("dtype", "bs", "num_warps", "interpret"))
def _launch(x, *, dtype, bs, num_warps, interpret):
    flat = x.reshape(-1)
    n = flat.shape[0]
    y = pl.pallas_call(
        _convert_kernel,
        grid=(n // bs,),
        in_specs=[pl.BlockSpec((bs,), lambda i: (i,))],
        out_specs=pl.BlockSpec((bs,), lambda i: (i,)),
        out_shape=jax.ShapeDtypeStruct((n,), dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="state_convert",
    )(flat)
    return y.reshape(x.shape)
