"""Single-token decode: the public entry points and their kernel family.

    gdn_decode(q, k, v, g, beta, state, ...)            contiguous batch, state [B, HV, K, V]
    gdn_decode_pool(qkv, g, beta, pool, slots, ...)     packed rows + a state pool and slot table
    convert_state(state, dtype)                          fp32 <-> fp16/bf16 state (out of place)

Variants are keyword arguments of the same two functions:
  * raw gates: pass `A_log` and `dt_bias`; `g` and `beta` then hold the raw projections a, b and
    the kernel computes g = -exp(A_log) * softplus(a + dt_bias) (or the lower-bounded KDA form)
    and beta = sigmoid(b);
  * KDA: a per-key-channel gate g [B, HV, K] (gdn_decode) or `per_channel_gate=True` (pool);
  * fused gated RMSNorm: pass `z` and `norm_weight`; the output is normalised per head
    (x * rsqrt(mean(x^2) + eps) * w * act(z)) and written once in `out_dtype` (bf16 default);
  * 16-bit state: give the state (pool) in fp16 or bf16; math is fp32, one RNE rounding per store,
    or with `rounding_key` (a PRNG key; pass a fresh one per step, e.g. fold_in(key, position))
    a stochastic rounding that lets decays below half an ulp act (docs/numerics.md). The same key
    gives the same state for a given implementation; the kernel and the reference draw
    different random numbers (both unbiased).

The state argument is donated: the kernel updates it in place and the caller must use the
returned state (the argument's buffer is invalid afterwards, as for any donated jit argument).

`impl` follows `gdn_jax.dispatch`: every call of every kind runs the one Triton-lowered decode
kernel (`pallas_kernels.gdn_decode`) when it can take the call, so the exact carried verify
(which calls that kernel's per-token function) is bit-identical to what these functions run.
`interpret`: None follows `gdn_jax.interpret()` / GDN_JAX_INTERPRET.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from gdn_jax import dispatch
from gdn_jax import reference as ref
from gdn_jax import validate as chk
from pallas_kernels import gdn_decode as decode_kernel
from pallas_kernels import state_convert as convert_kernel

DECODE_IMPLS = ("auto", "pallas", "reference")

__all__ = ["DecodeCall", "gdn_decode", "gdn_decode_pool", "convert_state", "decode_call",
           "decode_pool_call", "convert_call"]


# --------------------------------------------------------------------------- specs and family

@dataclasses.dataclass(frozen=True)
class DecodeCall:
    """A validated decode call: the kernel's static spec plus what the choice reads."""
    spec: decode_kernel.DecodeSpec
    block: decode_kernel.DecodeBlockSizes
    state_dtype: str
    num_state_elements: int
    batch: int
    out_dtype: str
    float64_arrays: tuple[str, ...] = ()   # arrays JAX holds as float64 (x64 on): no kernel


def _decode_supports(call: DecodeCall):
    return (decode_kernel.unsupported_reason(call.spec, call.block, call.state_dtype)
            or decode_kernel.index_overflow_reason(call.num_state_elements))


@dataclasses.dataclass(frozen=True)
class ConvertCall:
    x_dtype: str
    dtype: str
    size: int


def _convert_supports(call: ConvertCall):
    return convert_kernel.unsupported_reason(call.x_dtype, call.dtype, call.size)


# --------------------------------------------------------------------------- validation

_shape = chk.shape_of
_need = chk.shape


def _check_norm(z, norm_weight, norm_eps, norm_activation, vd):
    if (z is None) != (norm_weight is None):
        raise ValueError("z and norm_weight go together (both for the fused gated RMSNorm, or neither)")
    chk.activation("norm_activation", norm_activation, ("silu", "sigmoid"))
    eps = chk.eps("norm_eps", norm_eps)
    if norm_weight is not None:
        chk.array("norm_weight", norm_weight, floating=True)
        _need("norm_weight", norm_weight, (vd,))
    return eps


def decode_call(q, k, v, g, beta, state, *, scale=None, use_qk_l2norm=False, A_log=None,
                dt_bias=None, lower_bound=None, z=None, norm_weight=None, norm_eps=1e-6,
                norm_activation="silu", out_dtype=None, rounding_key=None,
                block_sizes=None) -> DecodeCall:
    """Validate `gdn_decode`'s arguments (ValueError naming the argument) into a DecodeCall."""
    for name, x, rank in (("q", q, 3), ("k", k, 3), ("v", v, 3), ("beta", beta, 2), ("state", state, 4)):
        chk.array(name, x, rank=rank, floating=True)
    b, hk, kd = q.shape
    _need("k", k, q.shape)
    if v.shape[0] != b:
        raise ValueError(f"v must be [B={b}, HV, V], got {v.shape}")
    hv, vd = v.shape[1:]
    chk.heads(hk, hv, kd, vd)
    chk.array("g", g, floating=True)
    if len(g.shape) not in (2, 3):
        raise ValueError(f"g must be [B, HV] (GDN) or [B, HV, K] (KDA), got {_shape(g)}")
    per_channel = len(g.shape) == 3
    _need("g", g, (b, hv, kd) if per_channel else (b, hv))
    _need("beta", beta, (b, hv))
    _need("state", state, (b, hv, kd, vd))
    chk.state_dtype("state", state.dtype)
    lower_bound = chk.gate_params(A_log, dt_bias, hv, kd, per_channel, lower_bound)
    eps = _check_norm(z, norm_weight, norm_eps, norm_activation, vd)
    if z is not None:
        chk.array("z", z, floating=True)
        _need("z", z, (b, hv, vd))
    out = chk.float_dtype("out_dtype", out_dtype, jnp.bfloat16 if z is not None else q.dtype)
    chk.rounding_key("rounding_key", rounding_key, state.dtype)
    spec = decode_kernel.DecodeSpec(
        num_k_heads=hk, num_v_heads=hv, head_k_dim=kd, head_v_dim=vd, scale=chk.scale(scale, kd),
        raw_gates=A_log is not None, per_channel_gate=per_channel, gate_lower_bound=lower_bound,
        use_qk_l2norm=bool(use_qk_l2norm), fused_norm=z is not None, norm_eps=eps,
        norm_activation=norm_activation, stochastic_rounding=rounding_key is not None)
    block = block_sizes or decode_kernel.default_block_sizes(b, vd, state.dtype, spec.fused_norm)
    wide = chk.float64_arrays(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, z=z,
                              norm_weight=norm_weight, out_dtype=out)
    return DecodeCall(spec, block, str(jnp.dtype(state.dtype)), int(state.size), b, str(out), wide)


def decode_pool_call(qkv, g, beta, pool, slots, *, num_k_heads, num_v_heads, head_k_dim,
                     head_v_dim, g_col=0, beta_col=0, per_channel_gate=False, scale=None,
                     use_qk_l2norm=False, A_log=None, dt_bias=None, lower_bound=None, z=None,
                     z_col=0, norm_weight=None, norm_eps=1e-6, norm_activation="silu",
                     out_dtype=None, rounding_key=None, block_sizes=None) -> DecodeCall:
    """Validate `gdn_decode_pool`'s arguments into a DecodeCall (`pool` is the state array)."""
    hk, hv, kd, vd = (chk.count(n, x) for n, x in (("num_k_heads", num_k_heads),
                                                   ("num_v_heads", num_v_heads),
                                                   ("head_k_dim", head_k_dim),
                                                   ("head_v_dim", head_v_dim)))
    chk.heads(hk, hv, kd, vd)
    g_col, beta_col, z_col = (chk.column(n, x) for n, x in (("g_col", g_col), ("beta_col", beta_col),
                                                             ("z_col", z_col)))
    chk.array("qkv", qkv, rank=2, floating=True)
    b = qkv.shape[0]
    conv_dim = 2 * hk * kd + hv * vd
    if qkv.shape[1] != conv_dim:
        raise ValueError(f"qkv must be [B, conv_dim={conv_dim}] (q | k | v), got {qkv.shape}")
    gk = kd if per_channel_gate else 1
    for name, x, col, width in (("g", g, g_col, hv * gk), ("beta", beta, beta_col, hv)):
        chk.array(name, x, rank=2, floating=True)
        if x.shape[0] != b:
            raise ValueError(f"{name} must be a row array [B={b}, width], got {_shape(x)}")
        if col + width > x.shape[1]:
            raise ValueError(f"{name}: columns {col}..{col + width} fall outside its width {x.shape[1]}")
    chk.array("pool", pool, rank=4, floating=True)
    chk.pool_slots("pool", pool)
    if tuple(pool.shape[1:]) != (hv, kd, vd):
        raise ValueError(f"pool must be [slots, HV={hv}, K={kd}, V={vd}], got {_shape(pool)}")
    chk.state_dtype("pool", pool.dtype)
    chk.slot_table("slots", slots, b, pool.shape[0])
    lower_bound = chk.gate_params(A_log, dt_bias, hv, kd, per_channel_gate, lower_bound)
    eps = _check_norm(z, norm_weight, norm_eps, norm_activation, vd)
    if z is not None:
        chk.array("z", z, rank=2, floating=True)
        if z.shape[0] != b or z_col + hv * vd > z.shape[1]:
            raise ValueError(f"z must be a row array [B={b}, width >= z_col + HV * V = "
                             f"{z_col + hv * vd}], got {_shape(z)}")
    out = chk.float_dtype("out_dtype", out_dtype, jnp.bfloat16 if z is not None else qkv.dtype)
    chk.rounding_key("rounding_key", rounding_key, pool.dtype)
    spec = decode_kernel.DecodeSpec(
        num_k_heads=hk, num_v_heads=hv, head_k_dim=kd, head_v_dim=vd, scale=chk.scale(scale, kd),
        q_col=0, k_col=hk * kd, v_col=2 * hk * kd, g_col=g_col, beta_col=beta_col,
        z_col=z_col, raw_gates=A_log is not None, per_channel_gate=bool(per_channel_gate),
        gate_lower_bound=lower_bound, use_qk_l2norm=bool(use_qk_l2norm), pooled=True,
        fused_norm=z is not None, norm_eps=eps, norm_activation=norm_activation,
        stochastic_rounding=rounding_key is not None)
    block = block_sizes or decode_kernel.default_block_sizes(b, vd, pool.dtype, spec.fused_norm)
    wide = chk.float64_arrays(qkv=qkv, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, z=z,
                              norm_weight=norm_weight, out_dtype=out)
    return DecodeCall(spec, block, str(jnp.dtype(pool.dtype)), int(pool.size), b, str(out), wide)


def _pool_spec_of(qkv, g, beta, pool, slots, **kw):
    from gdn_jax.state import DeltaPool
    return decode_pool_call(qkv, g, beta, pool.states if isinstance(pool, DeltaPool) else pool,
                            slots, **kw)


def convert_call(state, dtype) -> ConvertCall:
    from gdn_jax.state import DeltaPool
    if isinstance(state, DeltaPool):
        state = state.states
    chk.array("state", state, floating=True)
    chk.state_dtype("state", state.dtype)
    d = chk.state_dtype("dtype", dtype)
    return ConvertCall(str(jnp.dtype(state.dtype)), str(d), int(state.size))


dispatch.define("gdn_decode", spec_of=decode_call)
dispatch.register("gdn_decode", dispatch.KernelFamily("triton decode", _decode_supports))
dispatch.define("gdn_decode_pool", spec_of=_pool_spec_of)
dispatch.register("gdn_decode_pool", dispatch.KernelFamily("triton decode", _decode_supports))
dispatch.define("convert_state", spec_of=convert_call)
dispatch.register("convert_state", dispatch.KernelFamily("state convert", _convert_supports))


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
              norm_activation, out_dtype, rounding_key=None):
    """decode_step with the optional fused norm; o in fp32 before the norm (as in the kernel)."""
    o, s = ref.decode_step(q.astype(jnp.float32), k, v, g, beta, state, scale=scale,
                           use_qk_l2norm=use_qk_l2norm, rounding_key=rounding_key)
    if z is not None:
        o = ref.gated_rmsnorm(o, z, norm_weight, eps=norm_eps, activation=norm_activation,
                              out_dtype=out_dtype)
    return o.astype(out_dtype), s


# --------------------------------------------------------------------------- contiguous batch

def gdn_decode(q, k, v, g, beta, state, *, scale=None, use_qk_l2norm=False, A_log=None,
               dt_bias=None, lower_bound=None, z=None, norm_weight=None, norm_eps=1e-6,
               norm_activation="silu", out_dtype=None, rounding_key=None, impl="auto",
               interpret=None, block_sizes: decode_kernel.DecodeBlockSizes | None = None):
    """One decode token for a contiguous batch. Returns (o [B, HV, V], new state [B, HV, K, V]).

    q, k [B, HK, K]; v [B, HV, V]; g [B, HV] (GDN) or [B, HV, K] (KDA) log decay, or the raw `a`
    with A_log [HV] and dt_bias [HV] (KDA: [HV, K]); beta [B, HV] (or raw `b`); state
    [B, HV, K, V] fp32/fp16/bf16, donated. z [B, HV, V] and norm_weight [V] fuse the gated
    RMSNorm. o has out_dtype (a floating dtype; default: q's dtype, bf16 with the fused norm).
    scale: positive finite (default K^-0.5); norm_eps >= 0; lower_bound finite and < 0.
    rounding_key: a PRNG key: the 16-bit state's store rounds stochastically (module docstring)."""
    dispatch.check_impl("gdn_decode", impl)
    call = decode_call(q, k, v, g, beta, state, scale=scale, use_qk_l2norm=use_qk_l2norm,
                       A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, z=z,
                       norm_weight=norm_weight, norm_eps=norm_eps, norm_activation=norm_activation,
                       out_dtype=out_dtype, rounding_key=rounding_key, block_sizes=block_sizes)
    choice = dispatch.select("gdn_decode", call, impl, interpret=interpret)
    return _gdn_decode_jit(q, k, v, g, beta, state, A_log, dt_bias, z, norm_weight, rounding_key,
                           spec=call.spec,
                           block=call.block, out_dtype=jnp.dtype(call.out_dtype), which=choice.impl,
                           interpret=dispatch.interpret_enabled(interpret))


def _gdn_decode_step(q, k, v, g, beta, state, A_log, dt_bias, z, norm_weight, rounding_key, *,
                     spec, block, out_dtype, which, interpret):
    b = q.shape[0]
    if which == "reference":
        gf, bf = _ref_gates(g, beta, A_log, dt_bias, spec.per_channel_gate, spec.gate_lower_bound)
        return _ref_step(q, k, v, gf, bf, state, scale=spec.scale, use_qk_l2norm=spec.use_qk_l2norm,
                         z=z, norm_weight=norm_weight, norm_eps=spec.norm_eps,
                         norm_activation=spec.norm_activation, out_dtype=out_dtype,
                         rounding_key=rounding_key)
    rows = lambda x: None if x is None else x.reshape(b, -1)  # free: row-major views
    o, state = decode_kernel.gdn_decode(
        rows(q), rows(k), rows(v), rows(g), rows(beta), state, spec=spec,
        A_log=None if A_log is None else A_log.reshape(-1),
        dt_bias=None if dt_bias is None else dt_bias.reshape(-1),
        z_rows=rows(z), norm_weight=norm_weight, seed=_seed(rounding_key), out_dtype=out_dtype,
        block=block, interpret=interpret)
    return o.reshape(b, spec.num_v_heads, spec.head_v_dim), state


_DECODE_STATIC = ("spec", "block", "out_dtype", "which", "interpret")
# `gdn_decode` donates its state; the sequence operations' decode family keeps the caller's
# (under the caller's jit the inner donation is void either way, and XLA copies the state into
# the kernel's aliased output only when the caller still holds it).
_gdn_decode_jit = jax.jit(_gdn_decode_step, static_argnames=_DECODE_STATIC,
                          donate_argnames=("state",))
_gdn_decode_keeping_state = jax.jit(_gdn_decode_step, static_argnames=_DECODE_STATIC)


def _seed(rounding_key):
    """The kernel's two-word seed from a PRNG key (any key implementation), or None."""
    return None if rounding_key is None else jax.random.bits(rounding_key, (2,), jnp.uint32)


def _sequence_call(spec, state_dtype=None) -> DecodeCall:
    """The decode call a single-token sequence call (`gdn_jax.ops.DeltaSpec`) makes."""
    dspec = decode_kernel.DecodeSpec(
        num_k_heads=spec.num_k_heads, num_v_heads=spec.num_v_heads, head_k_dim=spec.head_k_dim,
        head_v_dim=spec.head_v_dim, scale=spec.scale, per_channel_gate=spec.kind == "kda",
        use_qk_l2norm=spec.use_qk_l2norm)
    sdt = spec.state_dtype if state_dtype is None else state_dtype
    block = decode_kernel.default_block_sizes(spec.batch, spec.head_v_dim, sdt, False)
    n = spec.batch * spec.num_v_heads * spec.head_k_dim * spec.head_v_dim
    return DecodeCall(dspec, block, str(sdt), n, spec.batch, spec.input_dtype,
                      spec.float64_arrays)


def sequence_step_reason(spec):
    """Why the decode kernel cannot run this single-token sequence call (None when it can)."""
    return _decode_supports(_sequence_call(spec))


def sequence_step(spec, q, k, v, g, beta, state):
    """The decode kernel as the sequence operations' "decode" family: T = 1 of q [B, 1, HK, K]
    ... from `state` (not donated: the caller's stays valid). Returns (o [B, 1, HV, V], new
    state)."""
    call = _sequence_call(spec, jnp.dtype(state.dtype))
    o, s = _gdn_decode_keeping_state(
        q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state, None, None, None, None, None,
        spec=call.spec, block=call.block, out_dtype=jnp.dtype(q.dtype), which="pallas",
        interpret=dispatch.interpret_enabled())
    return o[:, None], s


# --------------------------------------------------------------------------- pool + packed rows

def gdn_decode_pool(qkv, g, beta, pool, slots, *, num_k_heads, num_v_heads, head_k_dim,
                    head_v_dim, g_col=0, beta_col=0, per_channel_gate=False, scale=None,
                    use_qk_l2norm=False, A_log=None, dt_bias=None, lower_bound=None, z=None,
                    z_col=0, norm_weight=None, norm_eps=1e-6, norm_activation="silu",
                    out_dtype=None, rounding_key=None, impl="auto", interpret=None,
                    block_sizes: decode_kernel.DecodeBlockSizes | None = None):
    """One decode token for B sequences whose states live in a pool. Returns (o [B, HV, V], pool).

    qkv [B, conv_dim]: the packed conv output, q | k | v (conv_dim = 2 * HK * K + HV * V); the
    kernel reads each head straight out of it. g, beta: 2-D row arrays [B, width]; head h's gate
    is at column g_col + h (g_col + h * K .. + K with per_channel_gate) and its beta at
    beta_col + h, so a packed gate projection is passed as the same array twice with two
    offsets. With A_log [HV] and dt_bias [HV] (or [HV * K]) they are the raw a, b.
    pool: the state pool [slots, HV, K, V] fp32/fp16/bf16, or a `gdn_jax.DeltaPool` (pool with
    its carried-verify stash), donated; a DeltaPool's pending rows of the named slots are folded
    in first (decode reads H), and its rows awaiting a verdict stay stashed.
    slots [B] int32: the pool row of each sequence, -1 for padding (and any index outside the
    pool: its state is neither read nor written and its output row is zero). Rows not named are
    bit-for-bit untouched. Two sequences must not name one slot.
    z [B, width] (head h at z_col + h * V) and norm_weight [V] fuse the gated RMSNorm.
    rounding_key: a PRNG key: a 16-bit pool's stores round stochastically (module docstring); the
    draw depends on the slot, not the batch row."""
    from gdn_jax.state import DeltaPool
    dispatch.check_impl("gdn_decode_pool", impl)
    carried = isinstance(pool, DeltaPool)
    states = pool.states if carried else pool
    call = decode_pool_call(qkv, g, beta, states, slots, num_k_heads=num_k_heads,
                            num_v_heads=num_v_heads, head_k_dim=head_k_dim, head_v_dim=head_v_dim,
                            g_col=g_col, beta_col=beta_col, per_channel_gate=per_channel_gate,
                            scale=scale, use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias,
                            lower_bound=lower_bound, z=z, z_col=z_col, norm_weight=norm_weight,
                            norm_eps=norm_eps, norm_activation=norm_activation, out_dtype=out_dtype,
                            rounding_key=rounding_key, block_sizes=block_sizes)
    choice = dispatch.select("gdn_decode_pool", call, impl, interpret=interpret)
    slots = slots.astype(jnp.int32)
    if carried:
        from gdn_jax import carry
        from gdn_jax.verify import normalise_slots
        carry.check_delta_pool(pool)
        pool = carry.flush_validated(pool, normalise_slots(slots, states.shape[0]), impl=impl,
                                     interpret=interpret)
        states = pool.states
    o, states = _gdn_decode_pool_jit(qkv, g, beta, states, slots, A_log, dt_bias, z, norm_weight,
                                     rounding_key, spec=call.spec, block=call.block,
                                     out_dtype=jnp.dtype(call.out_dtype), which=choice.impl,
                                     interpret=dispatch.interpret_enabled(interpret))
    return o, (dataclasses.replace(pool, states=states) if carried else states)


@functools.partial(jax.jit, static_argnames=("spec", "block", "out_dtype", "which", "interpret"),
                   donate_argnames=("pool",))
def _gdn_decode_pool_jit(qkv, g, beta, pool, slots, A_log, dt_bias, z, norm_weight, rounding_key,
                         *, spec, block, out_dtype, which, interpret):
    b = qkv.shape[0]
    hk, hv, kd, vd = spec.num_k_heads, spec.num_v_heads, spec.head_k_dim, spec.head_v_dim
    if which == "pallas":
        o, pool = decode_kernel.gdn_decode(
            qkv, qkv, qkv, g, beta, pool, spec=spec, slots=slots,
            A_log=None if A_log is None else A_log.reshape(-1),
            dt_bias=None if dt_bias is None else dt_bias.reshape(-1),
            z_rows=z, norm_weight=norm_weight, seed=_seed(rounding_key), out_dtype=out_dtype,
            block=block, interpret=interpret)
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
                       norm_activation=spec.norm_activation, out_dtype=out_dtype,
                       rounding_key=rounding_key)
    pool = pool.at[jnp.where(valid, slots, pool.shape[0])].set(new, mode="drop")
    return jnp.where(valid[:, None, None], o, jnp.zeros((), o.dtype)), pool


# --------------------------------------------------------------------------- state dtype

def convert_state(state, dtype, *, impl="auto", interpret=None):
    """fp32 <-> fp16/bf16 state conversion, out of place (RNE when narrowing). A new array; the
    argument is not donated. Any shape (a state, a pool). A `gdn_jax.DeltaPool` has its pending
    rows folded in first (the conversion reads H) and comes back as a DeltaPool."""
    from gdn_jax.state import DeltaPool
    dispatch.check_impl("convert_state", impl)
    call = convert_call(state, dtype)
    choice = dispatch.select("convert_state", call, impl, interpret=interpret)
    if isinstance(state, DeltaPool):
        from gdn_jax import carry
        carry.check_delta_pool(state)
        pool = carry.flush_validated(state, jnp.arange(state.num_slots, dtype=jnp.int32),
                                     impl=impl, interpret=interpret)
        return dataclasses.replace(pool, states=_convert(pool.states, dtype, choice, interpret))
    return _convert(state, dtype, choice, interpret)


def _convert(state, dtype, choice, interpret):
    if choice.impl == "pallas":
        return convert_kernel.convert_state(state, dtype, interpret=dispatch.interpret_enabled(interpret))
    if jnp.dtype(dtype).itemsize == 4:
        return ref.state_to_f32(state).astype(dtype)
    return ref.state_to_16bit(state, dtype)
