"""The kernels' launchers traced with `jax_enable_x64` off, whatever the caller's setting.

Kernel bodies and launchers do their index arithmetic on int32 program ids and mix them with
Python ints (`lax.rem(start, 8)`, `pl.ds(row, n)`), and write Python float constants into fp32
refs. With x64 on those constants become int64 and float64, which the lowerings reject
(`lax.rem` of int32 and int64; a float64 value stored to an fp32 ref). Tracing a launcher with
x64 off keeps every such constant 32-bit. The launchers take 16- and 32-bit floats; an int64
index array (`cu_seqlens`, a slot table made under x64) is taken as int32, which holds every
index they accept. A float64 array is no launcher's input (gdn_jax keeps such calls on its
pure-JAX paths).

What x64 then still reaches: the lowering of a launcher called inside the caller's own `jit`
runs after the trace, with the caller's setting. Compiled for a GPU that is fine (checked by
lowering the launchers for CUDA with x64 on); the Pallas interpreter is not: its masked loads
and stores index with a Python 0 beside the int32 starts, which becomes int64 there
(`lax.dynamic_slice` then fails on mixed index types). A launcher called outside `jit` is
traced, lowered and compiled inside this module's context, so interpret mode works there.
"""

from __future__ import annotations

import functools

import jax

__all__ = ["without_x64"]


def without_x64(fn):
    """fn (a launcher, usually a `jax.jit` function) run with `jax_enable_x64` off when the
    caller has it on; a plain call otherwise. A jit function's `trace`, `lower` and `eval_shape`
    are wrapped the same way, and its `clear_cache` is kept."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not jax.config.jax_enable_x64:
            return fn(*args, **kwargs)
        with jax.enable_x64(False):
            return fn(*args, **kwargs)

    for name in ("trace", "lower", "eval_shape"):
        step = getattr(fn, name, None)
        if step is not None:
            setattr(call, name, without_x64(step))
    if hasattr(fn, "clear_cache"):
        call.clear_cache = fn.clear_cache
    return call
