"""Speculative verify for GDN and KDA on a state pool: what every verify function means.

Two ways to verify T = 2..4 draft tokens of many sequences whose states live in a pool
`[slots, HV, K, V]`, named per batch row by an int32 slot table (`-1` = padding: nothing read,
nothing written; slots not named are bit-for-bit untouched):

1. **Intermediate states** (`verify_states` + `commit_states`): one pass computes the T outputs
   and the state after each token, `[B, T, HV, K, V]`; `commit_states(accepted)` writes the state
   after the last accepted token into the pool. Costs T state writes per verify.

2. **Carried state, write on accept** (`carried_verify` + `accept`, `flush`): per slot a small
   *stash* holds, for each verified token, the rows the recurrence needs to replay it without
   reading S^T k again -- the prepared key k_t, the delta u_t = beta_t (v_t - S^T k_t) (on the
   decayed S) and the gate g_t -- and a *pending* count of stashed rows that were accepted but
   are not yet in H. A verify reads H, folds the slot's pending rows
   (S <- exp(g_t) S + k_t u_t^T, in decode's op order), writes that folded H once, computes the
   T outputs from registers and stashes the T new rows. After the verdict the caller sets
   pending = accepted (`accept`). Anything else that reads H (decode, prefill, export, 16-bit
   conversion) folds the pending rows first (`flush`). The conv window is carried the same way
   (`conv_carried_verify`, `conv_flush`: the stash keeps the T conv inputs, the fold shifts the
   accepted ones into the window).

Flavours of the carried verify (static `exact`):
  exact=True   the T outputs come from T sequential token updates (each rounding a 16-bit state
               after the token, as decode's store does); outputs and folded states reproduce
               running the single-token decode T times. In the Pallas kernels this is bitwise
               (the kernel calls decode's own per-token function); two XLA programs of the same
               math can differ in FMA contraction, so the pure-JAX reference is the same math,
               not a bitwise promise.
  exact=False  ("fast") the T outputs from one pass over the folded H in the WY form: every
               token's k^T S and q^T S read the same H, the cross-token terms are T x T scalars.
               Same rows stashed, same fold. fp32 state only (<= 1e-6 relative to decode).

The stash is double-banked so a kernel can read the pending rows of one bank while writing the
new rows into the other with no ordering between its programs: `bank[slot]` names the bank that
holds the slot's rows; a verify reads `bank`, writes `1 - bank` and flips it.

Counters per slot (int32):
  pending  rows of the current bank accepted but not yet folded into H
  drafted  rows the last verify stashed that still await their verdict (0 once accepted)

Verify width T must be <= the stash capacity (4 by default). `accept` checks 1 <= accepted <= T:
on the host (ValueError) when `accepted` is concrete -- against `num_tokens` when given, else the
capacity -- and on the device against `drafted` always: a row that fails is left unchanged and
flagged in the returned `invalid` mask. `carry_engages` is the one pure function that decides
whether the carried path runs for a call.

Layout (FLA/HF): q, k [B, T, HK, K]; v [B, T, HV, V]; g [B, T, HV] (GDN) or [B, T, HV, K] (KDA);
beta [B, T, HV]; pool [slots, HV, K, V] (fp32, fp16 or bf16; math fp32).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gdn_jax import reference as ref

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST

VERIFY_WIDTHS = (2, 3, 4)           # T for which the carried verify engages
DEFAULT_STASH_CAPACITY = 4
VERIFY_IMPLS = ("auto", "reference", "pallas")

__all__ = [
    "DeltaStash", "ConvStash", "CarryRequest", "carry_engages", "kernel_available", "VERIFY_WIDTHS", "VERIFY_IMPLS",
    "verify_states", "commit_states", "carried_verify", "accept", "flush",
    "conv_carried_verify", "conv_flush", "pool_decode_reference", "pool_conv_step_reference",
]


# --------------------------------------------------------------------------- pytrees

def _positive(name, val):
    if int(val) <= 0:
        raise ValueError(f"{name} must be positive, got {val}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeltaStash:
    """Per-slot stash of the carried-state verify for one delta-rule layer.

    k        [slots, 2, HK, C, K]   prepared keys (L2-normed when asked), fp32, one row per key
                                    head (the HV / HK value heads of a group share it)
    u        [slots, 2, HV, C, V]   deltas beta (v - S^T k) on the decayed S, fp32
    g        [slots, 2, HV, C]      GDN log decays, or [slots, 2, HV, C, K] for KDA, fp32
    bank     [slots] int32          which of the two banks holds the slot's rows
    pending  [slots] int32          accepted rows of that bank not yet folded into H
    drafted  [slots] int32          rows of the last verify awaiting the verdict
    C is the capacity: the largest verify width this stash takes.
    """
    k: jax.Array
    u: jax.Array
    g: jax.Array
    bank: jax.Array
    pending: jax.Array
    drafted: jax.Array

    @classmethod
    def init(cls, num_slots, *, num_v_heads, head_k_dim, head_v_dim, num_k_heads=None,
             capacity=DEFAULT_STASH_CAPACITY, per_channel_gate=False):
        """An empty stash (nothing pending) for a pool of `num_slots` states. `num_k_heads`
        (default: num_v_heads) is the layer's key-head count: the k rows are kept once per key
        head, so grouped value heads (GVA) need it."""
        hk = num_v_heads if num_k_heads is None else num_k_heads
        for name, val in (("num_slots", num_slots), ("num_v_heads", num_v_heads),
                          ("num_k_heads", hk), ("head_k_dim", head_k_dim),
                          ("head_v_dim", head_v_dim), ("capacity", capacity)):
            _positive(name, val)
        if int(num_v_heads) % int(hk):
            raise ValueError(f"num_v_heads={num_v_heads} must be a multiple of num_k_heads={hk}")
        s, hv, c = int(num_slots), int(num_v_heads), int(capacity)
        gshape = (s, 2, hv, c, head_k_dim) if per_channel_gate else (s, 2, hv, c)
        # Separate buffers per counter: a donated pytree must not hold one buffer twice.
        zeros_i = lambda: jnp.zeros((s,), jnp.int32)
        return cls(k=jnp.zeros((s, 2, int(hk), c, head_k_dim), F32), u=jnp.zeros((s, 2, hv, c, head_v_dim), F32),
                   g=jnp.zeros(gshape, F32), bank=zeros_i(), pending=zeros_i(), drafted=zeros_i())

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def per_channel_gate(self) -> bool:
        return self.g.ndim == 5

    @property
    def num_slots(self) -> int:
        return self.k.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ConvStash:
    """Per-slot stash of the carried conv window: the verify's conv inputs.

    x        [slots, C, conv_dim]  the last verify's inputs, in the conv pool's dtype
    pending  [slots] int32         accepted inputs not yet shifted into the window
    drafted  [slots] int32         inputs of the last verify awaiting the verdict
    """
    x: jax.Array
    pending: jax.Array
    drafted: jax.Array

    @classmethod
    def init(cls, num_slots, *, conv_dim, capacity=DEFAULT_STASH_CAPACITY, dtype=jnp.float32):
        for name, val in (("num_slots", num_slots), ("conv_dim", conv_dim), ("capacity", capacity)):
            _positive(name, val)
        return cls(x=jnp.zeros((int(num_slots), int(capacity), int(conv_dim)), dtype),
                   pending=jnp.zeros((int(num_slots),), jnp.int32),
                   drafted=jnp.zeros((int(num_slots),), jnp.int32))

    @property
    def capacity(self) -> int:
        return self.x.shape[1]


# --------------------------------------------------------------------------- engage decision

@dataclasses.dataclass(frozen=True)
class CarryRequest:
    """Everything the engage decision depends on, so it can be pinned without a device.

    requested         the caller asked for write-on-accept (carried) verify
    num_tokens        verify width T
    state_dtype       the pool's dtype
    head_k_dim, head_v_dim
    exact             the exact flavour (the only one a 16-bit state may carry)
    kernel_available  an implementation of the carried verify can take this call
    stash_capacity    capacity of the bound stash; 0 when none is bound
    """
    requested: bool
    num_tokens: int
    state_dtype: Any
    head_k_dim: int
    head_v_dim: int
    exact: bool
    kernel_available: bool
    stash_capacity: int


CARRY_HEAD_DIMS = (16, 32, 64, 128, 256)


def carry_engages(r: CarryRequest) -> bool:
    """The one place that decides whether a carried verify runs. Pure, no device work.

    Declines (the caller then verifies with intermediate states, after a `flush`) unless: carry
    was requested; 2 <= T <= 4; the state is fp32, or fp16/bf16 under the exact flavour (the fast
    flavour's fp32 chain cannot match a decode that rounds after every token); both head dims
    are ones the kernels are built for; an implementation is available; a stash of capacity
    >= T is bound."""
    dt = jnp.dtype(r.state_dtype)
    if dt == jnp.dtype(F32):
        dtype_ok = True
    elif dt in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        dtype_ok = bool(r.exact)
    else:
        dtype_ok = False
    return bool(r.requested and r.num_tokens in VERIFY_WIDTHS and dtype_ok
                and r.head_k_dim in CARRY_HEAD_DIMS and r.head_v_dim in CARRY_HEAD_DIMS
                and r.kernel_available and r.stash_capacity >= r.num_tokens)


# --------------------------------------------------------------------------- validation

def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _check_slots(slots, batch, num_slots, name="slots"):
    if getattr(slots, "ndim", None) != 1 or slots.shape[0] != batch:
        raise ValueError(f"{name} must have shape [B={batch}], got {getattr(slots, 'shape', None)}")
    if not jnp.issubdtype(slots.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array (int32), got dtype {slots.dtype}")
    if _is_concrete(slots):
        s = np.asarray(slots)
        if np.any((s < -1) | (s >= num_slots)):
            raise ValueError(f"{name} must name slots in [0, {num_slots}) or -1 (padding), got {s.tolist()}")
        live = s[s >= 0]
        if np.unique(live).size != live.size:
            raise ValueError(f"{name} names a slot twice (each live slot at most once per batch): {s.tolist()}")


def _check_accepted(accepted, batch, slots, upper, name="accepted"):
    if getattr(accepted, "ndim", None) != 1 or accepted.shape[0] != batch:
        raise ValueError(f"{name} must have shape [B={batch}], got {getattr(accepted, 'shape', None)}")
    if not jnp.issubdtype(accepted.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array, got dtype {accepted.dtype}")
    if _is_concrete(accepted) and _is_concrete(slots):
        a, s = np.asarray(accepted), np.asarray(slots)
        bad = (s >= 0) & ((a < 1) | (a > upper))
        if np.any(bad):
            raise ValueError(f"{name} must lie in 1..{upper} for every live row; rows {np.nonzero(bad)[0].tolist()} "
                             f"have {a[bad].tolist()}")


def _check_tokens(q, k, v, g, beta):
    """Shapes of one verify's tokens; returns (kind, B, T, HK, HV, K, V)."""
    for name, x, rank in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("beta", beta, 3)):
        if getattr(x, "ndim", None) != rank:
            raise ValueError(f"{name} must have rank {rank}, got shape {getattr(x, 'shape', None)}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be a floating-point array, got dtype {x.dtype}")
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {q.shape}, got {k.shape}")
    b, t, hk, kd = q.shape
    if v.shape[:2] != (b, t):
        raise ValueError(f"v must be [B={b}, T={t}, HV, V], got {v.shape}")
    hv, vd = v.shape[2:]
    if hk == 0 or hv % hk:
        raise ValueError(f"v's head count HV={hv} must be a multiple of q/k's head count HK={hk}")
    if t < 1:
        raise ValueError(f"q must hold at least one token (T >= 1), got T={t}")
    if getattr(g, "shape", None) == (b, t, hv):
        kind = "gdn"
    elif getattr(g, "shape", None) == (b, t, hv, kd):
        kind = "kda"
    else:
        raise ValueError(f"g must have shape {(b, t, hv)} (GDN) or {(b, t, hv, kd)} (KDA), "
                         f"got {getattr(g, 'shape', None)}")
    if beta.shape != (b, t, hv):
        raise ValueError(f"beta must have shape {(b, t, hv)}, got {beta.shape}")
    return kind, b, t, hk, hv, kd, vd


def _check_pool(pool, hv, kd, vd, name="pool"):
    if getattr(pool, "ndim", None) != 4 or pool.shape[1:] != (hv, kd, vd):
        raise ValueError(f"{name} must have shape [slots, HV={hv}, K={kd}, V={vd}], got {getattr(pool, 'shape', None)}")
    if jnp.dtype(pool.dtype) not in (jnp.dtype(F32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {pool.dtype}")


def _check_stash(stash, pool, kind, num_k_heads=None, name="stash"):
    """The stash fits the pool (and the tokens' key-head count when given)."""
    if not isinstance(stash, DeltaStash):
        raise ValueError(f"{name} must be a DeltaStash, got {type(stash).__name__}")
    s, hv, kd, vd = pool.shape
    hk = stash.k.shape[2] if num_k_heads is None and stash.k.ndim == 5 else num_k_heads
    want_k = (s, 2, hk, stash.capacity, kd)
    if (stash.k.shape != want_k or not hk or hv % hk
            or stash.u.shape != (s, 2, hv, stash.capacity, vd)):
        raise ValueError(f"{name} does not match the pool {pool.shape}: k {stash.k.shape}, u {stash.u.shape} "
                         f"(want k {want_k}, one row per key head); build it with "
                         f"DeltaStash.init(num_slots={s}, num_k_heads=..., ...)")
    if stash.per_channel_gate != (kind == "kda"):
        raise ValueError(f"{name} holds {'per-channel (KDA)' if stash.per_channel_gate else 'scalar (GDN)'} gates "
                         f"but g is {kind.upper()}'s; init it with per_channel_gate={kind == 'kda'}")


def _resolve_impl(impl, interpret):
    """"pallas" runs the kernels (compiled on a GPU, in interpret mode with interpret=True);
    "reference" the pure-JAX path; "auto" the kernels on a GPU (or when interpreting), else the
    reference."""
    if impl not in VERIFY_IMPLS:
        raise ValueError(f"impl must be one of {VERIFY_IMPLS}, got {impl!r}")
    on_gpu = jax.default_backend() == "gpu"
    if impl == "pallas" and not (on_gpu or interpret):
        raise ValueError(f"impl='pallas': the verify kernels need a GPU (backend is "
                         f"{jax.default_backend()!r}; interpret=True runs them on CPU)")
    if impl == "auto":
        return "pallas" if (on_gpu or interpret) else "reference"
    return impl


def kernel_available(num_tokens, head_k_dim, head_v_dim, state_dtype, *, exact=True,
                     interpret=False) -> bool:
    """Whether the Pallas carried verify can take such a call here (for `CarryRequest`)."""
    if jax.default_backend() != "gpu" and not interpret:
        return False
    from pallas_kernels import gdn_verify as kern
    spec = kern.VerifySpec(num_k_heads=1, num_v_heads=1, k_dim=head_k_dim, v_dim=head_v_dim,
                           num_tokens=num_tokens, scale=1.0, exact=exact)
    block = kern.default_block_sizes(1 << 20, head_v_dim, state_dtype, exact)
    return kern.unsupported_reason(spec, block, state_dtype) is None


# --------------------------------------------------------------------------- pool access

def _live(slots):
    return slots >= 0


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
    """One token on fp32 S, in decode's op order (reference._token_update), also returning u."""
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
    Every exponent is <= 0 (cumulative decays formed pairwise), so no gate size overflows."""
    S = S.astype(F32)
    t = qf.shape[1]
    per_channel = gf.ndim == 4
    G = jnp.cumsum(gf, axis=1)                                   # [B, T, HV(, K)]
    eG = jnp.exp(G)
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
                w = jnp.exp(G[:, i] - G[:, j])                    # [B, HV, K]
                c = jnp.sum(kf[:, i] * kf[:, j] * w, -1)
                d = jnp.sum(qf[:, i] * kf[:, j] * w, -1)
            else:
                w = jnp.exp(G[:, i] - G[:, j])                    # [B, HV]
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
                  interpret=False, block_sizes=None):
    """T tokens per batch row from the committed state of its slot; nothing is written.

    Returns (o [B, T, HV, V] in q's dtype, states [B, T, HV, K, V] in the pool's dtype):
    states[b, i] is the state after token i (each token's state rounded to the pool dtype, as a
    decode store would). Padding rows give zeros."""
    kind, b, t, hk, hv, kd, vd = _check_tokens(q, k, v, g, beta)
    _check_pool(pool, hv, kd, vd)
    _check_slots(slots, b, pool.shape[0])
    if _resolve_impl(impl, interpret) == "pallas":
        from pallas_kernels import gdn_verify as kern
        return kern.verify_states(q, k, v, g, beta, pool, slots.astype(jnp.int32), scale=scale,
                                  use_qk_l2norm=use_qk_l2norm, block=block_sizes, interpret=interpret)
    return _verify_states_ref(q, k, v, g, beta, pool, slots.astype(jnp.int32), scale=scale,
                              use_qk_l2norm=use_qk_l2norm)


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
    if getattr(states, "ndim", None) != 5 or states.shape[2:] != pool.shape[1:]:
        raise ValueError(f"states must have shape [B, T, {', '.join(map(str, pool.shape[1:]))}], "
                         f"got {getattr(states, 'shape', None)}")
    b, t = states.shape[:2]
    _check_slots(slots, b, pool.shape[0])
    _check_accepted(accepted, b, slots, t)
    return _commit_states(pool, states, slots.astype(jnp.int32), accepted.astype(jnp.int32))


@functools.partial(jax.jit, donate_argnames=("pool",))
def _commit_states(pool, states, slots, accepted):
    t = states.shape[1]
    live = _live(slots)
    ok = (accepted >= 1) & (accepted <= t)
    pick = jnp.clip(accepted - 1, 0, t - 1)
    chosen = jnp.take_along_axis(states, pick[:, None, None, None, None], axis=1)[:, 0]
    write = jnp.where(live & ok, slots, -1)
    return _scatter(pool, write, chosen), live & ~ok


# --------------------------------------------------------------------------- carried state

def carried_verify(q, k, v, g, beta, pool, stash, slots, *, exact=True, scale=None,
                   use_qk_l2norm=False, impl="auto", interpret=False, block_sizes=None):
    """Carried-state (write-on-accept) verify of T tokens per batch row.

    For each live row: read H = pool[slot], fold the slot's pending stash rows, write the folded
    H back (the only state write), compute the T outputs and stash the T new rows (k, u, g) in
    the slot's other bank. Counters after: bank flipped, pending = 0, drafted = T.
    Returns (o [B, T, HV, V] in q's dtype, pool, stash); pool and stash are donated.
    Padding rows (-1) read and write nothing and give zero outputs."""
    kind, b, t, hk, hv, kd, vd = _check_tokens(q, k, v, g, beta)
    _check_pool(pool, hv, kd, vd)
    _check_stash(stash, pool, kind, num_k_heads=hk)
    _check_slots(slots, b, pool.shape[0])
    if t > stash.capacity:
        raise ValueError(f"q holds T={t} tokens, more than the stash capacity {stash.capacity}")
    if not exact and jnp.dtype(pool.dtype) != jnp.dtype(F32):
        raise ValueError(f"pool is {pool.dtype}: the fast flavour (exact=False) needs an fp32 state; "
                         "a 16-bit state carries only with exact=True")
    slots = slots.astype(jnp.int32)
    if _resolve_impl(impl, interpret) == "pallas":
        return _carried_verify_pallas(q, k, v, g, beta, pool, stash, slots, exact=exact, scale=scale,
                                      use_qk_l2norm=use_qk_l2norm, block=block_sizes,
                                      interpret=bool(interpret))
    return _carried_verify_ref(q, k, v, g, beta, pool, stash, slots, exact=exact, scale=scale,
                               use_qk_l2norm=use_qk_l2norm)


@functools.partial(jax.jit, static_argnames=("exact", "scale", "use_qk_l2norm", "block", "interpret"),
                   donate_argnames=("pool", "stash"))
def _carried_verify_pallas(q, k, v, g, beta, pool, stash, slots, *, exact, scale, use_qk_l2norm,
                           block, interpret):
    from pallas_kernels import gdn_verify as kern
    o, pool, sk, su, sg, bank, pending, drafted = kern.carried_verify(
        q, k, v, g, beta, pool, stash.k, stash.u, stash.g, stash.bank, stash.pending, stash.drafted,
        slots, exact=exact, scale=scale, use_qk_l2norm=use_qk_l2norm, block=block,
        interpret=interpret)
    return o, pool, dataclasses.replace(stash, k=sk, u=su, g=sg, bank=bank, pending=pending,
                                        drafted=drafted)


@functools.partial(jax.jit, static_argnames=("t",))
def _after_verify(stash, slots, t):
    """Counters after a verify: bank flipped, nothing pending, t rows awaiting the verdict."""
    live = _live(slots)
    flipped = 1 - _gather(stash.bank, slots)
    write = jnp.where(live, slots, -1)
    return dataclasses.replace(
        stash,
        bank=_scatter(stash.bank, write, flipped),
        pending=_scatter(stash.pending, write, jnp.zeros_like(slots)),
        drafted=_scatter(stash.drafted, write, jnp.full_like(slots, t)))


def _bank_rows(stash, slots, bank):
    """The k, u, g rows of bank `bank[b]` of each row's slot: [B, HV, C, ...] (k rows expanded
    from the key heads)."""
    pick = lambda a: jnp.take_along_axis(
        _gather(a, slots), bank.reshape((-1,) + (1,) * (a.ndim - 1)), axis=1)[:, 0]
    hv = stash.u.shape[2]
    return ref.expand_kv_heads(pick(stash.k), hv, 1), pick(stash.u), pick(stash.g)


@functools.partial(jax.jit, static_argnames=("exact", "scale", "use_qk_l2norm"),
                   donate_argnames=("pool", "stash"))
def _carried_verify_ref(q, k, v, g, beta, pool, stash, slots, *, exact, scale, use_qk_l2norm):
    t = q.shape[1]
    live = _live(slots)
    bank = _gather(stash.bank, slots)
    count = jnp.where(live, _gather(stash.pending, slots), 0)
    S = _fold_pending(_gather(pool, slots), *_bank_rows(stash, slots, bank), count)
    qf, kf, vf, gf, bf = _prepare_tokens(q, k, v, g, beta, scale, use_qk_l2norm)
    o, u = (_chain_exact if exact else _chain_wy)(S, qf, kf, vf, gf, bf)
    write = jnp.where(live, slots, -1)
    pool = _scatter(pool, write, S)

    # New rows into the other bank, positions 0..t-1 (the rest of that bank is left as it was).
    other = 1 - bank
    def put(arr, rows):                         # rows [B, T, H, ...] -> arr[slot, other, :, :t]
        rows = jnp.moveaxis(rows, 1, 2)         # [B, HV, T, ...]
        cur = _gather(arr, slots)               # [B, 2, HV, C, ...]
        sel = jnp.take_along_axis(cur, other.reshape((-1,) + (1,) * (cur.ndim - 1)), axis=1)[:, 0]
        sel = sel.at[:, :, :t].set(rows.astype(arr.dtype))
        idx = jnp.where(live, slots, arr.shape[0])
        return arr.at[idx, other].set(sel, mode="drop")
    k_rows = kf[:, :, ::kf.shape[2] // stash.k.shape[2]]        # one row per key head
    stash = dataclasses.replace(stash, k=put(stash.k, k_rows), u=put(stash.u, u), g=put(stash.g, gf))
    return _mask_rows(o, live).astype(q.dtype), pool, _after_verify(stash, slots, t)


def accept(stash, slots, accepted, *, num_tokens=None, impl="auto", interpret=False):
    """The verdict: for each live row, pending[slot] = accepted[b], drafted[slot] = 0.

    Works on a DeltaStash or a ConvStash. accepted must lie in 1..drafted[slot] (the width of the
    slot's last verify). When `accepted` and `slots` are concrete a bad value raises ValueError
    (checked against `num_tokens` when given, else the stash capacity); on the device a row
    whose value is out of 1..drafted is left unchanged and flagged. Returns (stash, invalid [B]).
    impl as for `carried_verify`: on a GPU one small kernel (`gdn_verify.accept_counts`) instead
    of XLA's gather and two scatters (each its own launch); the result is the same."""
    if not isinstance(stash, (DeltaStash, ConvStash)):
        raise ValueError(f"stash must be a DeltaStash or ConvStash, got {type(stash).__name__}")
    b = getattr(slots, "shape", (None,))[0]
    _check_slots(slots, b, stash.pending.shape[0])
    upper = stash.capacity if num_tokens is None else int(num_tokens)
    if num_tokens is not None and not 1 <= upper <= stash.capacity:
        raise ValueError(f"num_tokens must lie in 1..{stash.capacity} (the stash capacity), got {num_tokens}")
    _check_accepted(accepted, b, slots, upper)
    slots, accepted = slots.astype(jnp.int32), accepted.astype(jnp.int32)
    if _resolve_impl(impl, interpret) == "pallas":
        return _accept_pallas(stash, slots, accepted, interpret=bool(interpret))
    return _accept(stash, slots, accepted)


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnames=("stash",))
def _accept_pallas(stash, slots, accepted, *, interpret):
    from pallas_kernels import gdn_verify as kern
    pending, drafted, invalid = kern.accept_counts(slots, accepted, stash.pending, stash.drafted,
                                                   interpret=interpret)
    return dataclasses.replace(stash, pending=pending, drafted=drafted), invalid != 0


@functools.partial(jax.jit, donate_argnames=("stash",))
def _accept(stash, slots, accepted):
    live = _live(slots)
    drafted = _gather(stash.drafted, slots)
    ok = (accepted >= 1) & (accepted <= drafted)
    write = jnp.where(live & ok, slots, -1)
    new = dataclasses.replace(stash, pending=_scatter(stash.pending, write, accepted),
                              drafted=_scatter(stash.drafted, write, jnp.zeros_like(accepted)))
    return new, live & ~ok


def flush(pool, stash, slots=None, *, impl="auto", interpret=False, block_sizes=None):
    """Fold every pending row into H (rounding after each row for a 16-bit pool, as decode
    does) and set pending = 0. `slots` None flushes the whole pool (export, conversion); with a
    slot table only those slots (-1 padding). Rows awaiting a verdict stay stashed.
    Returns (pool, stash); both are donated."""
    if not isinstance(stash, DeltaStash):
        raise ValueError(f"stash must be a DeltaStash, got {type(stash).__name__}")
    if getattr(pool, "ndim", None) != 4:
        raise ValueError(f"pool must have shape [slots, HV, K, V], got {getattr(pool, 'shape', None)}")
    _check_pool(pool, *pool.shape[1:])
    _check_stash(stash, pool, "kda" if stash.per_channel_gate else "gdn")
    if slots is None:
        slots = jnp.arange(pool.shape[0], dtype=jnp.int32)
    _check_slots(slots, slots.shape[0] if hasattr(slots, "shape") else None, pool.shape[0])
    slots = slots.astype(jnp.int32)
    if _resolve_impl(impl, interpret) == "pallas":
        return _flush_pallas(pool, stash, slots, block=block_sizes, interpret=bool(interpret))
    return _flush_ref(pool, stash, slots)


@functools.partial(jax.jit, static_argnames=("block", "interpret"), donate_argnames=("pool", "stash"))
def _flush_pallas(pool, stash, slots, *, block, interpret):
    from pallas_kernels import gdn_verify as kern
    pool = kern.flush(pool, stash.k, stash.u, stash.g, stash.bank, stash.pending, slots, block=block,
                      interpret=interpret)
    return pool, _after_flush(stash, slots)


@jax.jit
def _after_flush(stash, slots):
    write = jnp.where(_live(slots), slots, -1)
    return dataclasses.replace(stash, pending=_scatter(stash.pending, write, jnp.zeros_like(slots)))


@functools.partial(jax.jit, donate_argnames=("pool", "stash"))
def _flush_ref(pool, stash, slots):
    live = _live(slots)
    bank = _gather(stash.bank, slots)
    count = jnp.where(live, _gather(stash.pending, slots), 0)
    S = _fold_pending(_gather(pool, slots), *_bank_rows(stash, slots, bank), count)
    pool = _scatter(pool, jnp.where(live, slots, -1), S)
    return pool, _after_flush(stash, slots)


# --------------------------------------------------------------------------- conv carry

def _check_conv(x, conv_pool, conv_stash, slots, weight):
    if getattr(x, "ndim", None) != 3:
        raise ValueError(f"x must be [B, T, C], got {getattr(x, 'shape', None)}")
    b, t, c = x.shape
    if getattr(weight, "ndim", None) != 2 or weight.shape[0] != c:
        raise ValueError(f"weight must be [C={c}, W], got {getattr(weight, 'shape', None)}")
    w = weight.shape[1]
    if getattr(conv_pool, "ndim", None) != 3 or conv_pool.shape[1:] != (w - 1, c):
        raise ValueError(f"conv_pool must be [slots, W-1={w - 1}, C={c}], got {getattr(conv_pool, 'shape', None)}")
    if not isinstance(conv_stash, ConvStash):
        raise ValueError(f"conv_stash must be a ConvStash, got {type(conv_stash).__name__}")
    if conv_stash.x.shape[0] != conv_pool.shape[0] or conv_stash.x.shape[2] != c:
        raise ValueError(f"conv_stash.x must be [slots={conv_pool.shape[0]}, capacity, C={c}], got {conv_stash.x.shape}")
    if t > conv_stash.capacity:
        raise ValueError(f"x holds T={t} tokens, more than the conv stash capacity {conv_stash.capacity}")
    _check_slots(slots, b, conv_pool.shape[0])


def _fold_window(window, rows, count):
    """Shift the first count[b] stashed inputs into each W-1 window: the last W-1 of
    [window, rows[:count]] (exactly what count decode steps leave)."""
    wm1 = window.shape[1]
    full = jnp.concatenate([window, rows.astype(window.dtype)], axis=1)
    idx = count[:, None] + jnp.arange(wm1, dtype=jnp.int32)[None, :]
    return jnp.take_along_axis(full, idx[:, :, None], axis=1)


def conv_carried_verify(x, conv_pool, conv_stash, slots, weight, bias=None, *, activation="silu"):
    """Carried short conv for T verify tokens: fold the slot's pending inputs into its window,
    write the window once, convolve the T inputs from it and stash them. Counters after:
    pending = 0, drafted = T. Returns (y [B, T, C] in x's dtype, conv_pool, conv_stash), the
    pool and stash donated. Exact against T decode steps when the conv pool's dtype holds x
    exactly (the same dtype, or fp32)."""
    _check_conv(x, conv_pool, conv_stash, slots, weight)
    if bias is not None and getattr(bias, "shape", None) != (x.shape[2],):
        raise ValueError(f"bias must be [C={x.shape[2]}], got {getattr(bias, 'shape', None)}")
    return _conv_carried_verify(x, conv_pool, conv_stash, slots.astype(jnp.int32), weight, bias,
                                activation=activation)


@functools.partial(jax.jit, static_argnames=("activation",), donate_argnames=("conv_pool", "conv_stash"))
def _conv_carried_verify(x, conv_pool, conv_stash, slots, weight, bias, *, activation):
    t = x.shape[1]
    live = _live(slots)
    count = jnp.where(live, _gather(conv_stash.pending, slots), 0)
    window = _fold_window(_gather(conv_pool, slots), _gather(conv_stash.x, slots), count)
    y, _ = ref.causal_conv1d(x, weight, bias, conv_state=window, activation=activation)
    write = jnp.where(live, slots, -1)
    conv_pool = _scatter(conv_pool, write, window)
    rows = _gather(conv_stash.x, slots).at[:, :t].set(x.astype(conv_stash.x.dtype))
    conv_stash = dataclasses.replace(
        conv_stash, x=_scatter(conv_stash.x, write, rows),
        pending=_scatter(conv_stash.pending, write, jnp.zeros_like(slots)),
        drafted=_scatter(conv_stash.drafted, write, jnp.full_like(slots, t)))
    return _mask_rows(y, live), conv_pool, conv_stash


def conv_flush(conv_pool, conv_stash, slots=None):
    """Shift every pending conv input into its window and set pending = 0 (slots None: the
    whole pool). Returns (conv_pool, conv_stash), both donated."""
    if not isinstance(conv_stash, ConvStash):
        raise ValueError(f"conv_stash must be a ConvStash, got {type(conv_stash).__name__}")
    if slots is None:
        slots = jnp.arange(conv_pool.shape[0], dtype=jnp.int32)
    _check_slots(slots, slots.shape[0] if hasattr(slots, "shape") else None, conv_pool.shape[0])
    return _conv_flush(conv_pool, conv_stash, slots.astype(jnp.int32))


@functools.partial(jax.jit, donate_argnames=("conv_pool", "conv_stash"))
def _conv_flush(conv_pool, conv_stash, slots):
    live = _live(slots)
    count = jnp.where(live, _gather(conv_stash.pending, slots), 0)
    window = _fold_window(_gather(conv_pool, slots), _gather(conv_stash.x, slots), count)
    write = jnp.where(live, slots, -1)
    return (_scatter(conv_pool, write, window),
            dataclasses.replace(conv_stash, pending=_scatter(conv_stash.pending, write, jnp.zeros_like(slots))))


# --------------------------------------------------------------------------- oracles on a pool

@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm"), donate_argnames=("pool",))
def pool_decode_reference(q, k, v, g, beta, pool, slots, *, scale=None, use_qk_l2norm=False):
    """Plain single-token decode on a pool (the oracle the verify paths are tested against):
    q, k [B, HK, K]; v [B, HV, V]; g [B, HV] or [B, HV, K]; beta [B, HV]; slots [B] (-1 padding).
    Returns (o [B, HV, V], pool)."""
    live = _live(slots)
    o, S = ref.decode_step(q, k, v, g, beta, _gather(pool, slots), scale=scale, use_qk_l2norm=use_qk_l2norm)
    return _mask_rows(o, live), _scatter(pool, jnp.where(live, slots, -1), S)


@functools.partial(jax.jit, static_argnames=("activation",), donate_argnames=("conv_pool",))
def pool_conv_step_reference(x, conv_pool, slots, weight, bias=None, *, activation="silu"):
    """Plain single-token conv decode on a conv pool: x [B, C]. Returns (y [B, C], conv_pool)."""
    live = _live(slots)
    y, window = ref.causal_conv1d_step(x, _gather(conv_pool, slots), weight, bias, activation=activation)
    return _mask_rows(y, live), _scatter(conv_pool, jnp.where(live, slots, -1), window)
