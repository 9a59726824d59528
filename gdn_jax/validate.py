"""Argument checks shared by the public functions: each raises ValueError naming the argument.

The public functions validate once, before any device work, and hand a frozen spec to the
paths below them, which trust it. Only shapes, dtypes and static values are read here; a
value that lives on the device (a slot table, cu_seqlens) is checked on the host only when it
is concrete (see `gdn_jax.checked` for traced ones).
"""

from __future__ import annotations

import functools
import math
import numbers
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

STATE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


def shape_of(x):
    return tuple(x.shape) if hasattr(x, "shape") else None


def is_concrete(x) -> bool:
    """A value the host can read now (not a tracer, not a ShapeDtypeStruct)."""
    return isinstance(x, (np.ndarray, np.generic, numbers.Number)) or (
        isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer))


def array(name, x, *, rank=None, floating=False, integer=False):
    """x is an array (or ShapeDtypeStruct) of this rank and kind."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    if rank is not None and len(x.shape) != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {shape_of(x)}")
    if floating and not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating-point array, got dtype {x.dtype}")
    if integer and not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array, got dtype {x.dtype}")
    return x


def float64_arrays(**values) -> tuple[str, ...]:
    """The names of `values` (arrays, or dtypes such as an out_dtype; None is skipped) that JAX
    holds as 64-bit floats: only with jax_enable_x64 on (without it a float64 NumPy array becomes
    float32 on the way in). The dispatch keeps such calls off the Pallas kernels."""
    def wide(x):
        d = jnp.dtype(x if isinstance(x, (np.dtype, type, str)) else x.dtype)
        return jnp.issubdtype(d, jnp.floating) and jax.dtypes.canonicalize_dtype(d).itemsize == 8
    return tuple(name for name, x in values.items() if x is not None and wide(x))


def pool_slots(name, x):
    """x [P, ...], a pool that a slot table indexes, holds at least one slot."""
    if x.shape[0] == 0:
        raise ValueError(f"{name} must hold at least one slot, got shape {shape_of(x)}")


def shape(name, x, want):
    if shape_of(x) != tuple(want):
        raise ValueError(f"{name} must have shape {tuple(want)}, got {shape_of(x)}")


def number(name, value, *, positive=False, nonnegative=False, negative=False):
    """A real Python/NumPy number, or a concrete jnp scalar (converted); finite; returns float."""
    if isinstance(value, (bool, np.bool_)) or isinstance(value, str):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if isinstance(value, jax.core.Tracer):
        raise ValueError(f"{name} must be a concrete number (it is static configuration), got a "
                         "traced value; pass a Python float")
    if hasattr(value, "shape"):
        if tuple(value.shape) != () or not jnp.issubdtype(value.dtype, jnp.number) \
                or jnp.issubdtype(value.dtype, jnp.complexfloating):
            raise ValueError(f"{name} must be a real scalar, got shape {shape_of(value)} "
                             f"dtype {getattr(value, 'dtype', None)}")
        value = float(np.asarray(value))
    elif not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    if nonnegative and not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    if negative and not value < 0:
        raise ValueError(f"{name} must be < 0, got {value}")
    return value


def scale(value, head_k_dim: int) -> float:
    """`scale`: None (K^-0.5) or a positive finite number."""
    return float(head_k_dim) ** -0.5 if value is None else number("scale", value, positive=True)


def eps(name, value) -> float:
    return number(name, value, nonnegative=True)


def lower_bound(value):
    """KDA gate `lower_bound`: None (softplus form) or a finite number < 0."""
    return None if value is None else number("lower_bound", value, negative=True)


def gate_params(A_log, dt_bias, hv, kd, per_channel, lower_bound_value):
    """The raw-gate parameters: A_log [HV] and dt_bias [HV] (per channel: HV * K values) given
    together or not at all, and `lower_bound` only with raw per-channel (KDA) gates. Returns
    the lower bound."""
    if (A_log is None) != (dt_bias is None):
        raise ValueError("A_log and dt_bias go together (raw gates), or neither (precomputed g, beta)")
    bound = lower_bound(lower_bound_value)
    if bound is not None and (A_log is None or not per_channel):
        raise ValueError("lower_bound applies to the raw per-channel (KDA) gate only")
    if A_log is not None:
        array("A_log", A_log, floating=True)
        array("dt_bias", dt_bias, floating=True)
        if A_log.size != hv:
            raise ValueError(f"A_log must hold HV={hv} values, got shape {shape_of(A_log)}")
        want = hv * kd if per_channel else hv
        if dt_bias.size != want:
            raise ValueError(f"dt_bias must hold {want} values, got shape {shape_of(dt_bias)}")
    return bound


def float_dtype(name, dtype, default=None):
    """A floating dtype (None: `default`)."""
    if dtype is None:
        return None if default is None else jnp.dtype(default)
    try:
        d = jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"{name} must be a floating dtype, got {dtype!r}") from e
    if not jnp.issubdtype(d, jnp.floating):
        raise ValueError(f"{name} must be a floating dtype, got {d}")
    return d


def state_dtype(name, dtype):
    d = float_dtype(name, dtype)
    if d not in STATE_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {d}")
    return d


def rounding_key(name, key, state_dtype):
    """None, or one PRNG key (`jax.random.key(...)`, or a raw `jax.random.PRNGKey(...)` uint32[2])
    for the stochastic rounding of a float16/bfloat16 state's stores."""
    if key is None:
        return None
    dt = getattr(key, "dtype", None)
    if dt is None or not (
            (jax.dtypes.issubdtype(dt, jax.dtypes.prng_key) and tuple(key.shape) == ())
            or (dt == jnp.uint32 and tuple(key.shape) == (2,))):
        raise ValueError(f"{name} must be one PRNG key (jax.random.key(seed) or "
                         f"jax.random.PRNGKey(seed)), got {type(key).__name__} shape "
                         f"{shape_of(key)} dtype {dt}")
    if jnp.dtype(state_dtype).itemsize != 2:
        raise ValueError(f"{name} asks for stochastic rounding of the state's stores, which needs a "
                         f"float16 or bfloat16 state; the state is {jnp.dtype(state_dtype)}")
    return key


def column(name, value) -> int:
    """A non-negative integer column offset (static)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral, np.integer)):
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if int(value) < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


def count(name, value, *, minimum=1) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral, np.integer)) \
            or int(value) < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def activation(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


def heads(hk: int, hv: int, kd: int, vd: int):
    if hk == 0 or hv % hk:
        raise ValueError(f"v's head count HV={hv} must be a multiple of q/k's head count HK={hk}")
    if kd == 0 or vd == 0:
        raise ValueError(f"head dims must be positive, got K={kd} (q) and V={vd} (v)")


def tokens(q, k, v, beta):
    """q, k [B, T, HK, K], v [B, T, HV, V], beta [B, T, HV] floating, T >= 1, heads that divide;
    returns (B, T, HK, HV, K, V)."""
    for name, x, rank in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("beta", beta, 3)):
        array(name, x, rank=rank, floating=True)
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {q.shape}, got {k.shape}")
    b, t, hk, kd = q.shape
    if v.shape[:2] != (b, t):
        raise ValueError(f"v must be [B={b}, T={t}, HV, V], got {v.shape}")
    hv, vd = v.shape[2], v.shape[3]
    heads(hk, hv, kd, vd)
    if t == 0:
        raise ValueError(f"q must hold at least one token (T >= 1), got shape {q.shape}")
    return b, t, hk, hv, kd, vd


def slot_table(name, slots, batch, num_slots, *, outside_is_padding=False):
    """slots [B] integer; concrete entries in [-1, num_slots) (any entry, with
    `outside_is_padding`: those outside the pool are padding) and no live slot twice. Returns the
    host copy when the table is concrete (one device-to-host read per public call), else None."""
    array(name, slots, rank=1, integer=True)
    if slots.shape[0] != batch:
        raise ValueError(f"{name} must have shape [B={batch}], got {shape_of(slots)}")
    if is_concrete(slots):
        s = np.asarray(slots)
        outside = (s < -1) | (s >= num_slots)
        if np.any(outside) and not outside_is_padding:
            raise ValueError(f"{name} must name slots in [0, {num_slots}) or -1 (padding), got {s.tolist()}")
        live = s[(s >= 0) & (s < num_slots)]
        if np.unique(live).size != live.size:
            raise ValueError(f"{name} names a slot twice (each live slot at most once per batch): {s.tolist()}")
        return s
    return None


# --------------------------------------------------------------------------- checked mode

_checking = threading.local()


def checking() -> bool:
    """Whether the current trace runs under `checked` (device-side checks are added)."""
    return getattr(_checking, "on", False)


def checked(fn):
    """`fn` with the device-side checks switched on: a jitted function that traces `fn` under
    `jax.experimental.checkify` and raises the first failed check as a ValueError.

    What is checked where: everything about shapes, dtypes and static values is checked on the
    host at the public function in every mode; values the host cannot see under `jit` (traced
    `cu_seqlens` that do not start at 0, do not end at T or decrease) are checked on the device
    only inside `checked`. Pass the plain (not yet jitted) function:

        run = gdn_jax.checked(lambda q, k, v, g, beta, cu: gdn_jax.gated_delta_rule(
            q, k, v, g, beta, cu_seqlens=cu))
    """
    def traced(*args, **kwargs):
        prev = checking()
        _checking.on = True
        try:
            return fn(*args, **kwargs)
        finally:
            _checking.on = prev

    run = jax.jit(checkify.checkify(traced, errors=checkify.user_checks))

    @functools.wraps(fn)
    def call(*args, **kwargs):
        err, out = run(*args, **kwargs)
        msg = err.get()
        if msg is not None:
            # checkify appends where the check failed: " (`check` failed)" or, in older
            # releases, " (check failed at ...)"; the message alone is the library's.
            raise ValueError(re.sub(r" \(`?check`? failed.*\)$", "", msg, flags=re.S))
        return out

    return call


def device_check(pred, message: str):
    """A checkify check when running under `checked`; nothing otherwise."""
    if checking():
        checkify.check(pred, message)
