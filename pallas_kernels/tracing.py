"""The kernels' launchers traced under JAX's default configuration, whatever the caller's.

Three global settings change what a launcher traces to, and the kernels are written for their
defaults:

* `jax_enable_x64`: kernel bodies and launchers do their index arithmetic on int32 program ids
  and mix them with Python ints (`lax.rem(start, 8)`, `pl.ds(row, n)`), and write Python float
  constants into fp32 refs. With x64 on those constants become int64 and float64, which the
  lowerings reject (`lax.rem` of int32 and int64; a float64 value stored to an fp32 ref). The
  launchers take 16- and 32-bit floats; an int64 index array (`cu_seqlens`, a slot table made
  under x64) is taken as int32, which holds every index they accept. A float64 array is no
  launcher's input (gdn_jax keeps such calls on its pure-JAX paths).
* `jax_numpy_dtype_promotion="strict"`: the kernels mix fp16 and fp32 operands on purpose
  (fp16 tiles scaled by fp32 factors) and rely on the standard promotion.
* `jax_default_matmul_precision`: `jnp.dot` records it in the products whose precision the
  kernels leave to the default, which would change their numerics (the TF32 and bf16 passes)
  from the ones the kernels are tested with.

What the caller's settings still reach: the lowering of a launcher called inside the caller's
own `jit` runs after the trace, in the caller's context. Compiled for a GPU that is fine
(checked by lowering the launchers for CUDA under each setting); the Pallas interpreter is not,
with x64 on: its masked loads and stores index with a Python 0 beside the int32 starts, which
becomes int64 there (`lax.dynamic_slice` then fails on mixed index types). A launcher called
outside `jit` is traced, lowered and compiled inside this module's context, so interpret mode
works there.
"""

from __future__ import annotations

import functools

import jax

__all__ = ["default_config"]


def _at_defaults() -> bool:
    return (not jax.config.jax_enable_x64
            and jax.config.jax_numpy_dtype_promotion == "standard"
            and jax.config.jax_default_matmul_precision is None)


def default_config(fn):
    """fn (a launcher, usually a `jax.jit` function) run with x64 off, standard dtype promotion
    and the default matmul precision when the caller has changed any of them; a plain call
    otherwise. A jit function's `trace`, `lower` and `eval_shape` are wrapped the same way, and
    its `clear_cache` is kept."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if _at_defaults():
            return fn(*args, **kwargs)
        with (jax.enable_x64(False), jax.numpy_dtype_promotion("standard"),
              jax.default_matmul_precision(None)):
            return fn(*args, **kwargs)

    for name in ("trace", "lower", "eval_shape"):
        step = getattr(fn, name, None)
        if step is not None:
            setattr(call, name, default_config(step))
    if hasattr(fn, "clear_cache"):
        call.clear_cache = fn.clear_cache
    return call
