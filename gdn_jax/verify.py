"""Speculative verify with intermediate states, and the per-token math every verify path shares.

T = 1..4 draft tokens of many sequences whose states live in a pool `[slots, HV, K, V]`, named
per batch row by an int32 slot table (`-1` = padding: nothing read, nothing written, output
rows zero; an index outside the pool is padding too; slots not named are bit-for-bit
untouched):

    verify_states(q, k, v, g, beta, pool, slots)    T outputs and the state after each token,
                                                    [B, T, HV, K, V]; nothing written
    commit_states(pool, states, slots, accepted)    write the state after the last accepted
                                                    token of each row into the pool

This costs T state writes per verify; the carried (write-on-accept) verify in `gdn_jax.carry`
writes H once. Layout (FLA/HF): q, k [B, T, HK, K]; v [B, T, HV, V]; g [B, T, HV] (GDN) or
[B, T, HV, K] (KDA); beta [B, T, HV]; pool fp32, fp16 or bf16 (math fp32).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gdn_jax import dispatch
from gdn_jax import reference as ref
from gdn_jax import validate as chk

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST
MAX_VERIFY_TOKENS = 4

__all__ = ["VerifyCall", "verify_call", "verify_states", "commit_states", "pool_decode_reference"]


# --------------------------------------------------------------------------- validation

@dataclasses.dataclass(frozen=True)
class VerifyCall:
    """A validated verify call: what the kernels' launch and the choice read (static)."""
    kind: str
    batch: int
    num_tokens: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    scale: float
    use_qk_l2norm: bool
    exact: bool
    state_dtype: str
    num_state_elements: int
    block: object = None      # pallas_kernels.gdn_verify.VerifyBlockSizes or None (the default)
    float64_arrays: tuple[str, ...] = ()   # arrays JAX holds as float64 (x64 on): no kernel


def check_tokens(q, k, v, g, beta):
    """Shapes of one verify's tokens; returns (kind, B, T, HK, HV, K, V)."""
    b, t, hk, hv, kd, vd = chk.tokens(q, k, v, beta)
    chk.array("g", g, floating=True)
    if chk.shape_of(g) == (b, t, hv):
        kind = "gdn"
    elif chk.shape_of(g) == (b, t, hv, kd):
        kind = "kda"
    else:
        raise ValueError(f"g must have shape {(b, t, hv)} (GDN) or {(b, t, hv, kd)} (KDA), "
                         f"got {chk.shape_of(g)}")
    chk.shape("beta", beta, (b, t, hv))
    return kind, b, t, hk, hv, kd, vd


def check_pool(pool, hv, kd, vd, name="pool"):
    chk.array(name, pool, rank=4)
    chk.pool_slots(name, pool)
    if tuple(pool.shape[1:]) != (hv, kd, vd):
        raise ValueError(f"{name} must have shape [slots, HV={hv}, K={kd}, V={vd}], got {chk.shape_of(pool)}")
    chk.state_dtype(name, pool.dtype)


def check_accepted(accepted, batch, slots, upper, name="accepted"):
    chk.array(name, accepted, rank=1, integer=True)
    if accepted.shape[0] != batch:
        raise ValueError(f"{name} must have shape [B={batch}], got {chk.shape_of(accepted)}")
    if chk.is_concrete(accepted) and chk.is_concrete(slots):
        a, s = np.asarray(accepted), np.asarray(slots)
        bad = (s >= 0) & ((a < 1) | (a > upper))
        if np.any(bad):
            raise ValueError(f"{name} must lie in 1..{upper} for every live row; rows {np.nonzero(bad)[0].tolist()} "
                             f"have {a[bad].tolist()}")


def verify_call(q, k, v, g, beta, pool, slots, *, scale=None, use_qk_l2norm=False, exact=True,
                block_sizes=None) -> VerifyCall:
    """Validate a verify's token, pool and slot arguments (ValueError naming the argument)."""
    kind, b, t, hk, hv, kd, vd = check_tokens(q, k, v, g, beta)
    check_pool(pool, hv, kd, vd)
    chk.slot_table("slots", slots, b, pool.shape[0])
    return VerifyCall(kind, b, t, hk, hv, kd, vd, chk.scale(scale, kd), bool(use_qk_l2norm),
                      bool(exact), str(jnp.dtype(pool.dtype)), int(pool.size), block_sizes,
                      chk.float64_arrays(q=q, k=k, v=v, g=g, beta=beta))


def kernel_reason(call: VerifyCall):
    """Why the Pallas verify kernels cannot take this call (None when they can)."""
    from pallas_kernels import gdn_decode as decode_kernel
    from pallas_kernels import gdn_verify as verify_kernel
    spec = verify_kernel.VerifySpec(
        num_k_heads=call.num_k_heads, num_v_heads=call.num_v_heads, head_k_dim=call.head_k_dim,
        head_v_dim=call.head_v_dim, num_tokens=call.num_tokens, scale=call.scale,
        per_channel_gate=call.kind == "kda", use_qk_l2norm=call.use_qk_l2norm, exact=call.exact)
    block = call.block or verify_kernel.default_block_sizes(call.batch, call.head_v_dim,
                                                            call.state_dtype, call.exact)
    return (verify_kernel.unsupported_reason(spec, block, call.state_dtype)
            or decode_kernel.index_overflow_reason(call.num_state_elements))


dispatch.define("verify_states", spec_of=lambda q, k, v, g, beta, pool, slots, **kw: verify_call(
    q, k, v, g, beta, pool, slots, exact=True, **kw))
dispatch.register("verify_states", dispatch.KernelFamily("triton verify", kernel_reason))


# --------------------------------------------------------------------------- pool access

def _live(slots):
    return slots >= 0


def normalise_slots(slots, num_slots):
    """int32 slots with every index outside [0, num_slots) made -1: padding in every
    implementation (nothing read, nothing written, output rows zero), traced or not."""
    slots = slots.astype(jnp.int32)
    return jnp.where((slots >= 0) & (slots < num_slots), slots, -1)


def _gather(arr, slots):
    """Rows of a pool for a batch; padding rows read slot 0 and must be masked by the caller."""
    return arr[jnp.where(_live(slots), slots, 0)]


def _scatter(arr, slots, rows):
    """Write rows into their slots; padding rows (-1) are dropped (an index past the end)."""
    idx = jnp.where(_live(slots), slots, arr.shape[0])
    return arr.at[idx].set(rows.astype(arr.dtype), mode="drop")


def _mask_rows(x, live):
    return jnp.where(live.reshape(live.shape + (1,) * (x.ndim - 1)), x, jnp.zeros((), x.dtype))


# --------------------------------------------------------------------------- per-token math

def _prepare_tokens(q, k, v, g, beta, scale, use_qk_l2norm):
    """fp32 tokens with q scaled and key heads expanded: [B, T, HV, ...]."""
    return ref._prepare(q, k, v, g, beta, scale, use_qk_l2norm, head_axis=2)


def _decay(S, g):
    """exp(g) applied to S [..., K, V]: g [...] (scalar) or [..., K] (per channel)."""
    d = jnp.exp(g)
    return S * (d[..., :, None] if g.ndim == S.ndim - 1 else d[..., None, None])


def _token_step(S, q, k, v, g, beta):
    """One token on fp32 S, in the reference's op order (reference._token_update), also returning u."""
    S = _decay(S, g)
    u = beta[..., None] * (v - jnp.einsum("...k,...kv->...v", k, S, precision=HIGHEST))
    S = S + k[..., :, None] * u[..., None, :]
    o = jnp.einsum("...k,...kv->...v", q, S, precision=HIGHEST)
    return o, S, u


def _fold_row(S, k, u, g):
    """Replay one stashed token: the same decay and rank-1 update as `_token_step`."""
    return _decay(S, g) + k[..., :, None] * u[..., None, :]


def _fold_pending(S, k_rows, u_rows, g_rows, count):
    """Fold the first `count[b]` rows of each batch row into S (state dtype, [B, HV, K, V]),
    rounding to the state dtype after each row exactly as decode's store does."""
    for i in range(k_rows.shape[2]):
        Sf = _fold_row(S.astype(F32), k_rows[:, :, i], u_rows[:, :, i], g_rows[:, :, i])
        S = jnp.where((i < count)[:, None, None, None], Sf.astype(S.dtype), S)
    return S


def _chain_exact(S, qf, kf, vf, gf, bf):
    """T sequential token updates from S (state dtype): returns (o [B,T,HV,V] fp32, u [B,T,HV,V])."""
    os, us = [], []
    for t in range(qf.shape[1]):
        o, Sf, u = _token_step(S.astype(F32), qf[:, t], kf[:, t], vf[:, t], gf[:, t], bf[:, t])
        S = Sf.astype(S.dtype)
        os.append(o)
        us.append(u)
    return jnp.stack(os, 1), jnp.stack(us, 1)


def _chain_wy(S, qf, kf, vf, gf, bf):
    """The same T tokens in the WY form from one read of S (fp32 math, no rounding between
    tokens). With G_i the cumulative log decay from S:
        u_i = beta_i (v_i - (k_i e^{G_i})^T S - sum_{j<i} c_ij u_j),  c_ij = sum_c k_ic k_jc e^{G_ic - G_jc}
        o_i = (q_i e^{G_i})^T S + sum_{j<=i} d_ij u_j,                d_ij = sum_c q_ic k_jc e^{G_ic - G_jc}
    Every exponent is <= 0 (cumulative decays formed pairwise, from `reference.chunk_log_decay`),
    so any gate in [-inf, 0] is safe and the differences keep full precision."""
    S = S.astype(F32)
    t = qf.shape[1]
    per_channel = gf.ndim == 4
    HI, LO = ref.chunk_log_decay(gf, axis=1)                     # [B, T, HV(, K)], exact differences
    eG = jnp.exp(HI + LO)
    seg = lambda i, j: jnp.exp((HI[:, i] - HI[:, j]) + (LO[:, i] - LO[:, j]))
    if per_channel:
        kd_ = kf * eG
        qd_ = qf * eG
    else:
        kd_ = kf * eG[..., None]
        qd_ = qf * eG[..., None]
    r = jnp.einsum("bthk,bhkv->bthv", kd_, S, precision=HIGHEST)
    p = jnp.einsum("bthk,bhkv->bthv", qd_, S, precision=HIGHEST)
    us, os = [], []
    for i in range(t):
        acc_u = r[:, i]
        acc_o = p[:, i]
        for j in range(i + 1):
            if per_channel:
                w = seg(i, j)                                     # [B, HV, K]
                c = jnp.sum(kf[:, i] * kf[:, j] * w, -1)
                d = jnp.sum(qf[:, i] * kf[:, j] * w, -1)
            else:
                w = seg(i, j)                                     # [B, HV]
                c = jnp.sum(kf[:, i] * kf[:, j], -1) * w
                d = jnp.sum(qf[:, i] * kf[:, j], -1) * w
            if j < i:
                acc_u = acc_u + c[..., None] * us[j]
                acc_o = acc_o + d[..., None] * us[j]
            else:
                u_i = bf[:, i, :, None] * (vf[:, i] - acc_u)
                acc_o = acc_o + d[..., None] * u_i
        us.append(u_i)
        os.append(acc_o)
    return jnp.stack(os, 1), jnp.stack(us, 1)


# --------------------------------------------------------------------------- intermediate states

def verify_states(q, k, v, g, beta, pool, slots, *, scale=None, use_qk_l2norm=False, impl="auto",
                  interpret=None, block_sizes=None):
    """T tokens per batch row from the committed state of its slot; nothing is written.

    Returns (o [B, T, HV, V] in q's dtype, states [B, T, HV, K, V] in the pool's dtype):
    states[b, i] is the state after token i (each token's state rounded to the pool dtype, as a
    decode store would). Padding rows give zeros."""
    dispatch.check_impl("verify_states", impl)
    call = verify_call(q, k, v, g, beta, pool, slots, scale=scale, use_qk_l2norm=use_qk_l2norm,
                       block_sizes=block_sizes)
    choice = dispatch.select("verify_states", call, impl, interpret=interpret)
    slots = normalise_slots(slots, pool.shape[0])
    if choice.impl == "pallas":
        from pallas_kernels import gdn_verify as verify_kernel
        return verify_kernel.verify_states_launch(q, k, v, g, beta, pool, slots, scale=call.scale,
                                           use_qk_l2norm=call.use_qk_l2norm, block=block_sizes,
                                           interpret=dispatch.interpret_enabled(interpret))
    return _verify_states_ref(q, k, v, g, beta, pool, slots, scale=call.scale,
                              use_qk_l2norm=call.use_qk_l2norm)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm"))
def _verify_states_ref(q, k, v, g, beta, pool, slots, *, scale, use_qk_l2norm):
    live = _live(slots)
    S0 = _mask_rows(_gather(pool, slots), live)
    o, states = ref.verify_steps(q, k, v, g, beta, S0, scale=scale, use_qk_l2norm=use_qk_l2norm)
    return _mask_rows(o, live), _mask_rows(states, live)


def commit_states(pool, states, slots, accepted):
    """Write states[b, accepted[b] - 1] into pool[slots[b]] for every live row.

    Returns (pool, invalid [B] bool). accepted must lie in 1..T: a concrete bad value raises
    ValueError; under jit a bad row is left unchanged and flagged in `invalid`. The pool is donated."""
    chk.array("pool", pool, rank=4)
    chk.state_dtype("pool", pool.dtype)
    chk.array("states", states, rank=5)
    if states.shape[2:] != pool.shape[1:]:
        raise ValueError(f"states must have shape [B, T, {', '.join(map(str, pool.shape[1:]))}], "
                         f"got {chk.shape_of(states)}")
    chk.state_dtype("states", states.dtype)
    b, t = states.shape[:2]
    chk.slot_table("slots", slots, b, pool.shape[0])
    check_accepted(accepted, b, slots, t)
    return _commit_states(pool, states, normalise_slots(slots, pool.shape[0]),
                          accepted.astype(jnp.int32))


@functools.partial(jax.jit, donate_argnames=("pool",))
def _commit_states(pool, states, slots, accepted):
    t = states.shape[1]
    live = _live(slots)
    ok = (accepted >= 1) & (accepted <= t)
    pick = jnp.clip(accepted - 1, 0, t - 1)
    chosen = jnp.take_along_axis(states, pick[:, None, None, None, None], axis=1)[:, 0]
    write = jnp.where(live & ok, slots, -1)
    return _scatter(pool, write, chosen), live & ~ok


# --------------------------------------------------------------------------- oracles on a pool

@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm"), donate_argnames=("pool",))
def pool_decode_reference(q, k, v, g, beta, pool, slots, *, scale=None, use_qk_l2norm=False):
    """Plain single-token decode on a pool (the oracle the verify paths are tested against):
    q, k [B, HK, K]; v [B, HV, V]; g [B, HV] or [B, HV, K]; beta [B, HV]; slots [B] (-1 padding).
    Returns (o [B, HV, V], pool)."""
    slots = normalise_slots(slots, pool.shape[0])
    live = _live(slots)
    o, S = ref.decode_step(q, k, v, g, beta, _gather(pool, slots), scale=scale, use_qk_l2norm=use_qk_l2norm)
    return _mask_rows(o, live), _scatter(pool, jnp.where(live, slots, -1), S)
