"""Single-token decode: the public entry points and the choice of kernel.

    gdn_decode(q, k, v, g, beta, state, ...)            contiguous batch, state [B, HV, K, V]
    gdn_decode_pool(qkv, g, beta, pool, slots, ...)     packed rows + a state pool and slot table
    convert_state(state, dtype)                          fp32 <-> fp16/bf16 state (out of place)
    select_decode_impl(...)                              which implementation runs, and why

Variants are keyword arguments of the same two functions:
  * raw gates: pass `A_log` and `dt_bias`; `g` and `beta` then hold the raw projections a, b and
    the kernel computes g = -exp(A_log) * softplus(a + dt_bias) (or the lower-bounded KDA form)
    and beta = sigmoid(b);
  * KDA: a per-key-channel gate g [B, HV, K] (gdn_decode) or `per_channel_gate=True` (pool);
  * fused gated RMSNorm: pass `z` and `norm_weight`; the output is normalised per head
    (x * rsqrt(mean(x^2) + eps) * w * act(z)) and written once in `out_dtype` (bf16 default);
  * 16-bit state: give the state (pool) in fp16 or bf16; math is fp32, one RNE rounding per store.

The state argument is donated: the kernel updates it in place and the caller must use the
returned state (the argument's buffer is invalid afterwards, as for any donated jit argument).

`impl`: "pallas" runs the Pallas kernel (raises ValueError with the reason when it cannot take
the call), "reference" the pure-JAX path, "auto" the kernel when it can, else the reference.
`interpret=True` runs the kernel in Pallas interpret mode (CPU tests).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax import reference as ref
from pallas_kernels import gdn_decode as kern
from pallas_kernels import state_convert as conv_kern

DECODE_IMPLS = ("auto", "pallas", "reference")

__all__ = ["DECODE_IMPLS", "DecodeChoice", "select_decode_impl", "select_convert_impl",
           "gdn_decode", "gdn_decode_pool", "convert_state"]


# --------------------------------------------------------------------------- the choice

@dataclasses.dataclass(frozen=True)
class DecodeChoice:
    impl: str                 # "pallas" or "reference"
    reason: str | None = None  # why the kernel was not taken (None when it was)


def _choose(impl: str, *, backend: str, interpret: bool, what: str, kernel_reason) -> DecodeChoice:
    """The rule both selections share: "reference" when asked; else the kernel unless it needs a
    GPU it does not have or `kernel_reason()` names why it cannot run; then "pallas" raises and
    "auto" falls back to the reference with the reason."""
    if impl not in DECODE_IMPLS:
        raise ValueError(f"impl must be one of {DECODE_IMPLS}, got {impl!r}")
    if impl == "reference":
        return DecodeChoice("reference", "impl='reference' was asked for")
    if backend != "gpu" and not interpret:
        reason = f"the Pallas {what} needs a GPU (backend is {backend!r}; interpret=True runs it on CPU)"
    else:
        reason = kernel_reason()
    if reason is None:
        return DecodeChoice("pallas")
    if impl == "pallas":
        raise ValueError(f"impl='pallas': {reason}")
    return DecodeChoice("reference", reason)


def select_decode_impl(impl: str, *, backend: str, spec: kern.DecodeSpec,
                       block: kern.DecodeBlockSizes, state_dtype, num_state_elements: int,
                       interpret: bool = False) -> DecodeChoice:
    """Which decode implementation runs. Pure (no device work): testable without a GPU.

    impl="pallas" raises ValueError naming the reason when the kernel cannot take the call;
    impl="auto" then falls back to the reference and reports the reason."""
    return _choose(impl, backend=backend, interpret=interpret, what="decode kernel",
                   kernel_reason=lambda: (kern.unsupported_reason(spec, block, state_dtype)
                                          or kern.index_overflow_reason(num_state_elements)))


def select_convert_impl(impl: str, *, backend: str, x_dtype, dtype, size: int,
                        interpret: bool = False) -> DecodeChoice:
    """Which state converter runs (same rules as `select_decode_impl`)."""
    return _choose(impl, backend=backend, interpret=interpret, what="converter",
                   kernel_reason=lambda: conv_kern.unsupported_reason(x_dtype, dtype, size))


# --------------------------------------------------------------------------- validation

def _shape(x):
    return getattr(x, "shape", None)


def _need(name, x, shape):
    if _shape(x) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {_shape(x)}")


def _need_float(name, x):
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating-point array, got dtype {x.dtype}")


def _check_norm(z, norm_weight, b, hv, vd, norm_activation):
    if (z is None) != (norm_weight is None):
        raise ValueError("z and norm_weight go together (both for the fused gated RMSNorm, or neither)")
    if norm_activation not in ("silu", "sigmoid"):
        raise ValueError(f"norm_activation must be 'silu' or 'sigmoid', got {norm_activation!r}")
    if norm_weight is not None:
        _need("norm_weight", norm_weight, (vd,))


def _check_gate_params(A_log, dt_bias, hv, kd, per_channel, lower_bound):
    if (A_log is None) != (dt_bias is None):
        raise ValueError("A_log and dt_bias go together (raw gates), or neither (precomputed g, beta)")
    if lower_bound is not None:
        if A_log is None or not per_channel:
            raise ValueError("lower_bound applies to the raw per-channel (KDA) gate only")
        if not float(lower_bound) < 0.0:
            raise ValueError(f"lower_bound must be < 0, got {lower_bound}")
    if A_log is not None:
        if A_log.size != hv:
            raise ValueError(f"A_log must hold HV={hv} values, got shape {_shape(A_log)}")
        want = hv * kd if per_channel else hv
        if dt_bias.size != want:
            raise ValueError(f"dt_bias must hold {want} values, got shape {_shape(dt_bias)}")


def _scale(scale, kd):
    return float(kd ** -0.5 if scale is None else scale)


# --------------------------------------------------------------------------- reference paths

def _ref_gates(g, beta, A_log, dt_bias, per_channel, lower_bound):
    """(g, beta) in fp32 from precomputed or raw inputs; g [B, HV] or [B, HV, K]."""
    if A_log is None:
        return g.astype(jnp.float32), beta.astype(jnp.float32)
    if per_channel:
        g = ref.kda_gate(g, A_log.reshape(-1), dt_bias.reshape(-1), lower_bound=lower_bound)
    else:
        g = ref.gdn_gate(g, A_log.reshape(-1), dt_bias.reshape(-1))
    return g, ref.gdn_beta(beta)


def _ref_step(q, k, v, g, beta, state, *, scale, use_qk_l2norm, z, norm_weight, norm_eps,
              norm_activation, out_dtype):
    """decode_step with the optional fused norm; o in fp32 before the norm (as in the kernel)."""
    o, s = ref.decode_step(q.astype(jnp.float32), k, v, g, beta, state, scale=scale,
                           use_qk_l2norm=use_qk_l2norm)
    if z is not None:
        o = ref.gated_rmsnorm(o, z, norm_weight, eps=norm_eps, activation=norm_activation,
                              out_dtype=out_dtype)
    return o.astype(out_dtype), s


# --------------------------------------------------------------------------- contiguous batch

def gdn_decode(q, k, v, g, beta, state, *, scale=None, use_qk_l2norm=False, A_log=None,
               dt_bias=None, lower_bound=None, z=None, norm_weight=None, norm_eps=1e-6,
               norm_activation="silu", out_dtype=None, impl="auto", interpret=False,
               block_sizes: kern.DecodeBlockSizes | None = None):
    """One decode token for a contiguous batch. Returns (o [B, HV, V], new state [B, HV, K, V]).

    q, k [B, HK, K]; v [B, HV, V]; g [B, HV] (GDN) or [B, HV, K] (KDA) log decay, or the raw `a`
    with A_log [HV] and dt_bias [HV] (KDA: [HV, K]); beta [B, HV] (or raw `b`); state
    [B, HV, K, V] fp32/fp16/bf16, donated. z [B, HV, V] and norm_weight [V] fuse the gated
    RMSNorm. o has out_dtype (default: q's dtype, bf16 with the fused norm)."""
    for name, x, rank in (("q", q, 3), ("k", k, 3), ("v", v, 3), ("beta", beta, 2), ("state", state, 4)):
        if getattr(x, "ndim", None) != rank:
            raise ValueError(f"{name} must have rank {rank}, got shape {_shape(x)}")
        _need_float(name, x)
    b, hk, kd = q.shape
    _need("k", k, q.shape)
    if v.shape[0] != b:
        raise ValueError(f"v must be [B={b}, HV, V], got {v.shape}")
    hv, vd = v.shape[1:]
    if hk == 0 or hv % hk:
        raise ValueError(f"v's head count HV={hv} must be a multiple of q/k's head count HK={hk}")
    if getattr(g, "ndim", None) not in (2, 3):
        raise ValueError(f"g must be [B, HV] (GDN) or [B, HV, K] (KDA), got {_shape(g)}")
    per_channel = g.ndim == 3
    _need("g", g, (b, hv, kd) if per_channel else (b, hv))
    _need_float("g", g)
    _need("beta", beta, (b, hv))
    _need("state", state, (b, hv, kd, vd))
    _check_gate_params(A_log, dt_bias, hv, kd, per_channel, lower_bound)
    _check_norm(z, norm_weight, b, hv, vd, norm_activation)
    if z is not None:
        _need("z", z, (b, hv, vd))
    out_dtype = jnp.dtype(out_dtype or (jnp.bfloat16 if z is not None else q.dtype))
    spec = kern.DecodeSpec(
        num_k_heads=hk, num_v_heads=hv, k_dim=kd, v_dim=vd, scale=_scale(scale, kd),
        raw_gates=A_log is not None, per_channel_gate=per_channel, gate_lower_bound=lower_bound,
        use_qk_l2norm=bool(use_qk_l2norm), fused_norm=z is not None, norm_eps=float(norm_eps),
        norm_activation=norm_activation)
    block = block_sizes or kern.default_block_sizes(b, vd, state.dtype, spec.fused_norm)
    choice = select_decode_impl(impl, backend=jax.default_backend(), spec=spec, block=block,
                                state_dtype=state.dtype, num_state_elements=state.size,
                                interpret=interpret)
    return _gdn_decode_jit(q, k, v, g, beta, state, A_log, dt_bias, z, norm_weight, spec=spec,
                           block=block, out_dtype=out_dtype, which=choice.impl,
                           interpret=bool(interpret))


@functools.partial(jax.jit, static_argnames=("spec", "block", "out_dtype", "which", "interpret"),
                   donate_argnames=("state",))
def _gdn_decode_jit(q, k, v, g, beta, state, A_log, dt_bias, z, norm_weight, *, spec, block,
                    out_dtype, which, interpret):
    b = q.shape[0]
    if which == "reference":
        gf, bf = _ref_gates(g, beta, A_log, dt_bias, spec.per_channel_gate, spec.gate_lower_bound)
        return _ref_step(q, k, v, gf, bf, state, scale=spec.scale, use_qk_l2norm=spec.use_qk_l2norm,
                         z=z, norm_weight=norm_weight, norm_eps=spec.norm_eps,
                         norm_activation=spec.norm_activation, out_dtype=out_dtype)
    rows = lambda x: None if x is None else x.reshape(b, -1)  # free: row-major views
    o, state = kern.gdn_decode(
        rows(q), rows(k), rows(v), rows(g), rows(beta), state, spec=spec,
        A_log=None if A_log is None else A_log.reshape(-1),
        dt_bias=None if dt_bias is None else dt_bias.reshape(-1),
        z_rows=rows(z), norm_weight=norm_weight, out_dtype=out_dtype, block=block,
        interpret=interpret)
    return o.reshape(b, spec.num_v_heads, spec.v_dim), state


# --------------------------------------------------------------------------- pool + packed rows

def gdn_decode_pool(qkv, g, beta, pool, slots, *, num_k_heads, num_v_heads, head_k_dim,
                    head_v_dim, g_col=0, beta_col=0, per_channel_gate=False, scale=None,
                    use_qk_l2norm=False, A_log=None, dt_bias=None, lower_bound=None, z=None,
                    z_col=0, norm_weight=None, norm_eps=1e-6, norm_activation="silu",
                    out_dtype=None, impl="auto", interpret=False,
                    block_sizes: kern.DecodeBlockSizes | None = None):
    """One decode token for B sequences whose states live in a pool. Returns (o [B, HV, V], pool).

    qkv [B, conv_dim]: the packed conv output, q | k | v (conv_dim = 2 * HK * K + HV * V); the
    kernel reads each head straight out of it. g, beta: 2-D row arrays [B, width]; head h's gate
    is at column g_col + h (g_col + h * K .. + K with per_channel_gate) and its beta at
    beta_col + h, so a packed gate projection is passed as the same array twice with two
    offsets. With A_log [HV] and dt_bias [HV] (or [HV * K]) they are the raw a, b.
    pool [slots, HV, K, V] fp32/fp16/bf16, donated; slots [B] int32: the pool row of each
    sequence, -1 for padding (its state is neither read nor written and its output row is
    zero). Rows not named are bit-for-bit untouched. Two sequences must not name one slot.
    z [B, width] (head h at z_col + h * V) and norm_weight [V] fuse the gated RMSNorm."""
    hk, hv, kd, vd = (int(x) for x in (num_k_heads, num_v_heads, head_k_dim, head_v_dim))
    if min(hk, hv, kd, vd) <= 0 or hv % hk:
        raise ValueError(f"num_v_heads={hv} must be a positive multiple of num_k_heads={hk}, "
                         f"head dims positive (K={kd}, V={vd})")
    if getattr(qkv, "ndim", None) != 2:
        raise ValueError(f"qkv must be the packed conv output [B, conv_dim], got {_shape(qkv)}")
    _need_float("qkv", qkv)
    b = qkv.shape[0]
    conv_dim = 2 * hk * kd + hv * vd
    if qkv.shape[1] != conv_dim:
        raise ValueError(f"qkv must be [B, conv_dim={conv_dim}] (q | k | v), got {qkv.shape}")
    gk = kd if per_channel_gate else 1
    for name, x, col, width in (("g", g, g_col, hv * gk), ("beta", beta, beta_col, hv)):
        if getattr(x, "ndim", None) != 2 or x.shape[0] != b:
            raise ValueError(f"{name} must be a row array [B={b}, width], got {_shape(x)}")
        _need_float(name, x)
        if col < 0 or col + width > x.shape[1]:
            raise ValueError(f"{name}: columns {col}..{col + width} fall outside its width {x.shape[1]}")
    if getattr(pool, "ndim", None) != 4 or tuple(pool.shape[1:]) != (hv, kd, vd):
        raise ValueError(f"pool must be [slots, HV={hv}, K={kd}, V={vd}], got {_shape(pool)}")
    _need_float("pool", pool)
    if _shape(slots) != (b,) or not jnp.issubdtype(slots.dtype, jnp.integer):
        raise ValueError(f"slots must be an int32 array of shape ({b},), got {_shape(slots)} "
                         f"{getattr(slots, 'dtype', None)}")
    if not isinstance(slots, jax.core.Tracer):
        s = np.asarray(slots)
        if np.any((s < -1) | (s >= pool.shape[0])):
            raise ValueError(f"slots must be -1 (padding) or a pool row in [0, {pool.shape[0]}), "
                             f"got {s.tolist()}")
        named = s[s >= 0]
        if np.unique(named).size != named.size:
            raise ValueError(f"slots names a pool row twice: {s.tolist()}")
    _check_gate_params(A_log, dt_bias, hv, kd, per_channel_gate, lower_bound)
    _check_norm(z, norm_weight, b, hv, vd, norm_activation)
    if z is not None:
        if getattr(z, "ndim", None) != 2 or z.shape[0] != b or z_col < 0 or z_col + hv * vd > z.shape[1]:
            raise ValueError(f"z must be a row array [B={b}, width >= z_col + HV * V = "
                             f"{z_col + hv * vd}], got {_shape(z)}")
    out_dtype = jnp.dtype(out_dtype or (jnp.bfloat16 if z is not None else qkv.dtype))
    spec = kern.DecodeSpec(
        num_k_heads=hk, num_v_heads=hv, k_dim=kd, v_dim=vd, scale=_scale(scale, kd),
        q_col=0, k_col=hk * kd, v_col=2 * hk * kd, g_col=int(g_col), beta_col=int(beta_col),
        z_col=int(z_col), raw_gates=A_log is not None, per_channel_gate=bool(per_channel_gate),
        gate_lower_bound=lower_bound, use_qk_l2norm=bool(use_qk_l2norm), pooled=True,
        fused_norm=z is not None, norm_eps=float(norm_eps), norm_activation=norm_activation)
    block = block_sizes or kern.default_block_sizes(b, vd, pool.dtype, spec.fused_norm)
    choice = select_decode_impl(impl, backend=jax.default_backend(), spec=spec, block=block,
                                state_dtype=pool.dtype, num_state_elements=pool.size,
                                interpret=interpret)
    return _gdn_decode_pool_jit(qkv, g, beta, pool, slots.astype(jnp.int32), A_log, dt_bias, z,
                                norm_weight, spec=spec, block=block, out_dtype=out_dtype,
                                which=choice.impl, interpret=bool(interpret))


@functools.partial(jax.jit, static_argnames=("spec", "block", "out_dtype", "which", "interpret"),
                   donate_argnames=("pool",))
def _gdn_decode_pool_jit(qkv, g, beta, pool, slots, A_log, dt_bias, z, norm_weight, *, spec,
                         block, out_dtype, which, interpret):
    b = qkv.shape[0]
    hk, hv, kd, vd = spec.num_k_heads, spec.num_v_heads, spec.k_dim, spec.v_dim
    if which == "pallas":
        o, pool = kern.gdn_decode(
            qkv, qkv, qkv, g, beta, pool, spec=spec, slots=slots,
            A_log=None if A_log is None else A_log.reshape(-1),
            dt_bias=None if dt_bias is None else dt_bias.reshape(-1),
            z_rows=z, norm_weight=norm_weight, out_dtype=out_dtype, block=block,
            interpret=interpret)
        return o.reshape(b, hv, vd), pool
    # Reference: split the packed rows, gather the named states, step, scatter the valid ones.
    q = qkv[:, :hk * kd].reshape(b, hk, kd)
    k = qkv[:, hk * kd:2 * hk * kd].reshape(b, hk, kd)
    v = qkv[:, 2 * hk * kd:].reshape(b, hv, vd)
    gk = kd if spec.per_channel_gate else 1
    gg = g[:, spec.g_col:spec.g_col + hv * gk].reshape((b, hv, kd) if spec.per_channel_gate else (b, hv))
    bb = beta[:, spec.beta_col:spec.beta_col + hv]
    zz = None if z is None else z[:, spec.z_col:spec.z_col + hv * vd].reshape(b, hv, vd)
    gf, bf = _ref_gates(gg, bb, A_log, dt_bias, spec.per_channel_gate, spec.gate_lower_bound)
    valid = (slots >= 0) & (slots < pool.shape[0])
    states = pool[jnp.where(valid, slots, 0)]
    o, new = _ref_step(q, k, v, gf, bf, states, scale=spec.scale, use_qk_l2norm=spec.use_qk_l2norm,
                       z=zz, norm_weight=norm_weight, norm_eps=spec.norm_eps,
                       norm_activation=spec.norm_activation, out_dtype=out_dtype)
    pool = pool.at[jnp.where(valid, slots, pool.shape[0])].set(new, mode="drop")
    return jnp.where(valid[:, None, None], o, jnp.zeros((), o.dtype)), pool


# --------------------------------------------------------------------------- state dtype

def convert_state(state, dtype, *, impl="auto", interpret=False):
    """fp32 <-> fp16/bf16 state conversion, out of place (RNE when narrowing). A new array; the
    argument is not donated. Any shape (a state, a pool)."""
    if not hasattr(state, "dtype"):
        raise ValueError(f"state must be an array, got {type(state).__name__}")
    choice = select_convert_impl(impl, backend=jax.default_backend(), x_dtype=state.dtype,
                                 dtype=dtype, size=state.size, interpret=interpret)
    if choice.impl == "pallas":
        return conv_kern.convert_state(state, dtype, interpret=bool(interpret))
    if jnp.dtype(dtype).itemsize == 4:
        return ref.state_to_f32(state).astype(dtype)
    return ref.state_to_16bit(state, dtype)
