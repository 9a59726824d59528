"""Carried-state (write-on-accept) verify on a `DeltaPool`: verify, accept, flush.

Writing T states per verify costs T times the state traffic. Instead, per slot a small *stash*
(`gdn_jax.state.DeltaStash`) holds, for each verified token, the rows the recurrence needs to
replay it without reading S^T k again -- the prepared key k_t, the delta
u_t = beta_t (v_t - S^T k_t) (on the decayed S) and the gate g_t -- and a *pending* count of
stashed rows that were accepted but are not yet in H. The pool and its stash travel together as
one pytree, `gdn_jax.state.DeltaPool`:

    o, pool, refused = carried_verify(q, k, v, g, beta, pool, slots)   # T = 1..capacity tokens
    pool, invalid = accept(pool, slots, accepted)                     # accepted [B] in 1..T
    pool = flush(pool)                                                # fold every pending row

A verify reads H, folds the slot's pending rows (S <- exp(g_t) S + k_t u_t^T, in decode's op
order), writes that folded H once, computes the T outputs and stashes the T new rows. After the
verdict `accept` sets pending = accepted. Everything else that reads H folds the pending rows
first: `gdn_decode_pool` and `convert_state` take the DeltaPool and do it themselves; `flush`
does it for an export. The conv window is carried the same way (`gdn_jax.conv_carry`).

Misuse is refused, not silently wrong:
  * a verify on a slot whose last verify has no verdict yet (drafted > 0) raises ValueError when
    the slot table and the stash are concrete; under `jit` that row is treated as padding
    (nothing read or written, zero outputs) and flagged in the returned `refused` mask;
  * `accept` checks 1 <= accepted <= T: on the host when concrete (against `num_tokens` when
    given, else the capacity), and on the device against `drafted` always (a bad row is left
    unchanged and flagged in `invalid`);
  * a slot index outside the pool is padding in every implementation.

Flavours of the carried verify (static `exact`):
  exact=True   the T outputs come from T sequential token updates (each rounding a 16-bit state
               after the token, as decode's store does); outputs and folded states reproduce
               running the single-token decode T times. In the Pallas kernels this is bitwise
               (the kernel calls the decode kernel's own per-token function, with its tile);
               two XLA programs of the same math can differ in FMA contraction, so the pure-JAX
               reference is the same math, not a bitwise promise.
  exact=False  ("fast") the T outputs from one pass over the folded H in the WY form: every
               token's k^T S and q^T S read the same H, the cross-token terms are T x T scalars.
               Same rows stashed, same fold. fp32 state only (<= 1e-6 relative to decode).

The stash is double-banked so a kernel can read the pending rows of one bank while writing the
new rows into the other with no ordering between its programs: `bank[slot]` names the bank that
holds the slot's rows; a verify reads `bank`, writes `1 - bank` and flips it. Counters per slot
(int32): `pending` (rows of the current bank accepted but not yet folded into H) and `drafted`
(rows the last verify stashed that still await their verdict; 0 once accepted).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax import dispatch
from gdn_jax import reference as ref
from gdn_jax import validate as chk
from gdn_jax.state import ConvPool, DeltaPool, DeltaStash
from gdn_jax.verify import (F32, _chain_exact, _chain_wy, _fold_pending, _gather,
                            _live, _mask_rows, _prepare_tokens, _scatter, check_accepted,
                            check_tokens, kernel_reason, normalise_slots, verify_call)

VERIFY_WIDTHS = (2, 3, 4)           # T for which the carried verify engages

__all__ = ["CarryRequest", "carry_engages", "kernel_available", "carried_verify", "accept", "flush",
           "VERIFY_WIDTHS"]


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




def kernel_available(num_tokens, head_k_dim, head_v_dim, state_dtype, *, exact=True,
                     interpret=None) -> bool:
    """Whether the Pallas carried verify can take such a call here (for `CarryRequest`)."""
    from gdn_jax.verify import VerifyCall
    call = VerifyCall("gdn", 1 << 20, int(num_tokens), 1, 1, int(head_k_dim), int(head_v_dim), 1.0,
                      False, bool(exact), str(jnp.dtype(state_dtype)), 1)
    try:
        return dispatch.select("carried_verify", call, "pallas", interpret=interpret).impl == "pallas"
    except ValueError:
        return False


# --------------------------------------------------------------------------- validation

def check_delta_pool(pool, kind=None, num_k_heads=None, name="pool"):
    """A DeltaPool whose stash fits its states (and the tokens' gate kind / key heads)."""
    if not isinstance(pool, DeltaPool):
        raise ValueError(f"{name} must be a gdn_jax.DeltaPool (states + stash), got {type(pool).__name__}")
    states, stash = pool.states, pool.stash
    chk.array(f"{name}.states", states, rank=4)
    chk.pool_slots(f"{name}.states", states)
    chk.state_dtype(f"{name}.states", states.dtype)
    s, hv, kd, vd = states.shape
    if not isinstance(stash, DeltaStash):
        raise ValueError(f"{name}.stash must be a DeltaStash, got {type(stash).__name__}")
    hk = stash.k.shape[2] if num_k_heads is None and len(stash.k.shape) == 5 else num_k_heads
    want_k = (s, 2, hk, stash.capacity, kd)
    if (tuple(stash.k.shape) != want_k or not hk or hv % hk
            or tuple(stash.u.shape) != (s, 2, hv, stash.capacity, vd)
            or tuple(stash.bank.shape) != (s,) or tuple(stash.pending.shape) != (s,)
            or tuple(stash.drafted.shape) != (s,)):
        raise ValueError(f"{name}.stash does not match {name}.states {tuple(states.shape)}: k "
                         f"{tuple(stash.k.shape)}, u {tuple(stash.u.shape)} (want k {want_k}, one "
                         f"row per key head); build both with DeltaPool.init(num_slots={s}, ...)")
    if kind is not None and stash.per_channel_gate != (kind == "kda"):
        raise ValueError(f"{name}.stash holds {'per-channel (KDA)' if stash.per_channel_gate else 'scalar (GDN)'} "
                         f"gates but g is {kind.upper()}'s; init it with per_channel_gate={kind == 'kda'}")


def awaiting_verdict(drafted, slots):
    """Rows whose slot's last verify has no verdict yet (drafted > 0)."""
    live = _live(slots)
    return live & (_gather(drafted, slots) > 0)


def _refuse_pending_verdicts(drafted, host_slots, what):
    """ValueError when the slot table (its host copy) and the counters are concrete and a named
    slot still awaits its verdict; nothing (the device flags it) otherwise."""
    if host_slots is not None and chk.is_concrete(drafted):
        s, d = host_slots, np.asarray(drafted)
        live = s[(s >= 0) & (s < d.shape[0])]
        waiting = live[d[live] > 0]
        if waiting.size:
            raise ValueError(f"slots {waiting.tolist()} have a {what} awaiting its verdict: call "
                             "accept before verifying them again (a second verify would drop the "
                             "first one's tokens)")


def _carried_spec_of(q, k, v, g, beta, pool, slots, *, exact=True, **kw):
    check_delta_pool(pool)
    return verify_call(q, k, v, g, beta, pool.states, slots, exact=exact, **kw)


def _flush_spec_of(pool, slots=None, block_sizes=None):
    check_delta_pool(pool)
    s, hv, kd, vd = pool.states.shape
    from gdn_jax.verify import VerifyCall
    return VerifyCall("kda" if pool.stash.per_channel_gate else "gdn", s, 1, pool.stash.k.shape[2],
                      hv, kd, vd, 1.0, False, True, str(jnp.dtype(pool.states.dtype)),
                      int(pool.states.size), block_sizes)


@dataclasses.dataclass(frozen=True)
class AcceptCall:
    """A validated accept: what the choice reads."""
    batch: int      # rows of the slot table


dispatch.define("carried_verify", spec_of=_carried_spec_of)
dispatch.register("carried_verify", dispatch.KernelFamily("triton verify", kernel_reason))
dispatch.define("flush", spec_of=_flush_spec_of)
dispatch.register("flush", dispatch.KernelFamily("triton verify", kernel_reason))
dispatch.define("accept",
                spec_of=lambda pool, slots, accepted, **kw: AcceptCall(np.shape(slots)[0]))
dispatch.register("accept", dispatch.KernelFamily("triton accept", lambda call: None))

# --------------------------------------------------------------------------- carried state

def carried_verify(q, k, v, g, beta, pool: DeltaPool, slots, *, exact=True, scale=None,
                   use_qk_l2norm=False, impl="auto", interpret=None, block_sizes=None):
    """Carried-state (write-on-accept) verify of T tokens per batch row.

    For each live row: read H = pool.states[slot], fold the slot's pending stash rows, write the
    folded H back (the only state write), compute the T outputs and stash the T new rows (k, u,
    g) in the slot's other bank. Counters after: bank flipped, pending = 0, drafted = T.
    Returns (o [B, T, HV, V] in q's dtype, pool, refused [B] bool); the pool is donated.
    Padding rows (-1, or outside the pool) read and write nothing and give zero outputs; so do
    rows whose slot still awaits the verdict of its last verify (flagged in `refused`; with a
    concrete slot table that raises ValueError instead)."""
    dispatch.check_impl("carried_verify", impl)
    kind, b, t, hk, hv, kd, vd = check_tokens(q, k, v, g, beta)
    check_delta_pool(pool, kind, num_k_heads=hk)
    call = verify_call(q, k, v, g, beta, pool.states, slots, scale=scale, use_qk_l2norm=use_qk_l2norm,
                       exact=exact, block_sizes=block_sizes)
    host_slots = np.asarray(slots) if chk.is_concrete(slots) else None
    stash = pool.stash
    if t > stash.capacity:
        raise ValueError(f"q holds T={t} tokens, more than the stash capacity {stash.capacity}")
    if not exact and jnp.dtype(pool.states.dtype) != jnp.dtype(F32):
        raise ValueError(f"pool.states is {pool.states.dtype}: the fast flavour (exact=False) needs "
                         "an fp32 state; a 16-bit state carries only with exact=True")
    choice = dispatch.select("carried_verify", call, impl, interpret=interpret)
    _refuse_pending_verdicts(stash.drafted, host_slots, "verify")
    slots = normalise_slots(slots, pool.num_slots)
    refused = awaiting_verdict(stash.drafted, slots)
    slots = jnp.where(refused, -1, slots)
    if choice.impl == "pallas":
        o, states, stash = _carried_verify_pallas(
            q, k, v, g, beta, pool.states, stash, slots, exact=call.exact, scale=call.scale,
            use_qk_l2norm=call.use_qk_l2norm, block=block_sizes,
            interpret=dispatch.interpret_enabled(interpret))
    else:
        o, states, stash = _carried_verify_ref(q, k, v, g, beta, pool.states, stash, slots,
                                               exact=call.exact, scale=call.scale,
                                               use_qk_l2norm=call.use_qk_l2norm)
    return o, DeltaPool(states=states, stash=stash), refused


@functools.partial(jax.jit, static_argnames=("exact", "scale", "use_qk_l2norm", "block", "interpret"),
                   donate_argnames=("pool", "stash"))
def _carried_verify_pallas(q, k, v, g, beta, pool, stash, slots, *, exact, scale, use_qk_l2norm,
                           block, interpret):
    from pallas_kernels import gdn_verify as verify_kernel
    o, pool, sk, su, sg, bank, pending, drafted = verify_kernel.carried_verify_launch(
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


def accept(pool, slots, accepted, *, num_tokens=None, impl="auto", interpret=None):
    """The verdict: for each live row, pending[slot] = accepted[b], drafted[slot] = 0.

    `pool` is a DeltaPool or a ConvPool. accepted must lie in 1..drafted[slot] (the width of the
    slot's last verify). When `accepted` and `slots` are concrete a bad value raises ValueError
    (checked against `num_tokens` when given, else the stash capacity); on the device a row
    whose value is out of 1..drafted is left unchanged and flagged. Returns (pool, invalid [B]).
    impl: "pallas" is one small kernel (`gdn_verify.accept_counts`) instead of XLA's gather and
    two scatters; the result is the same."""
    dispatch.check_impl("accept", impl)
    if not isinstance(pool, (DeltaPool, ConvPool)):
        raise ValueError(f"pool must be a gdn_jax.DeltaPool or ConvPool, got {type(pool).__name__}")
    stash = pool.stash
    chk.array("slots", slots, rank=1, integer=True)
    b = slots.shape[0]
    chk.slot_table("slots", slots, b, stash.pending.shape[0])
    upper = stash.capacity
    if num_tokens is not None:
        upper = chk.count("num_tokens", num_tokens)
        if upper > stash.capacity:
            raise ValueError(f"num_tokens must lie in 1..{stash.capacity} (the stash capacity), got {num_tokens}")
    check_accepted(accepted, b, slots, upper)
    choice = dispatch.select("accept", AcceptCall(b), impl, interpret=interpret)
    slots, accepted = normalise_slots(slots, stash.pending.shape[0]), accepted.astype(jnp.int32)
    if choice.impl == "pallas":
        stash, invalid = _accept_pallas(stash, slots, accepted,
                                        interpret=dispatch.interpret_enabled(interpret))
    else:
        stash, invalid = _accept(stash, slots, accepted)
    return dataclasses.replace(pool, stash=stash), invalid


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnames=("stash",))
def _accept_pallas(stash, slots, accepted, *, interpret):
    from pallas_kernels import gdn_verify as verify_kernel
    pending, drafted, invalid = verify_kernel.accept_counts(slots, accepted, stash.pending, stash.drafted,
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


def flush(pool, slots=None, *, impl="auto", interpret=None, block_sizes=None):
    """Fold every pending row into H and set pending = 0; rows awaiting a verdict stay stashed.

    `pool` is a DeltaPool (rounding after each row for a 16-bit state, as decode does) or a
    ConvPool (the pending inputs shifted into the windows). `slots` None flushes the whole pool
    (before an export); with a slot table only those slots (-1 padding). Returns the pool
    (donated)."""
    if isinstance(pool, ConvPool):
        from gdn_jax import conv_carry
        return conv_carry.conv_flush(pool, slots)
    dispatch.check_impl("flush", impl)
    check_delta_pool(pool)
    if slots is None:
        slots = jnp.arange(pool.num_slots, dtype=jnp.int32)
    chk.array("slots", slots, rank=1, integer=True)
    chk.slot_table("slots", slots, slots.shape[0], pool.num_slots)
    return flush_validated(pool, normalise_slots(slots, pool.num_slots), impl=impl,
                           interpret=interpret, block_sizes=block_sizes)


def any_pending(pending, slots):
    """Whether a slot of a normalised table has pending rows (`pending` [slots] int32, a stash
    counter): a bool scalar, read from B counters."""
    return jnp.any(_live(slots) & (_gather(pending, slots) > 0))


# Below this many slot-table rows a traced fold runs unconditionally instead of behind a
# `lax.cond`: XLA on the GPU reads a conditional's predicate on the host (a stream sync, ~16 us
# per step on the H200), which outweighs the fold of a few rows; from here up the fold's
# gather/scatter of B windows costs more than the sync (BENCHMARKS.md, serving decode).
FOLD_GATE_MIN_ROWS = 128


def when_pending(pending, fold, operands, *, rows: int):
    """`fold(*operands)` where the bool scalar `pending` holds, else `operands` unchanged; `rows`
    is the length of the slot table the fold covers.

    A concrete flag is a Python branch. A traced one is one `lax.cond` for tables of at least
    FOLD_GATE_MIN_ROWS rows (the branch not taken passes the buffers through, so a donated pool
    stays in place either way; tests/test_serving_pool.py checks the compiled programs for
    pool-sized copies): the common serving step, nothing pending (decode after decode, or after
    accept and flush), then costs no fold: no flush kernel launch, no conv window gather and
    scatter. Smaller traced tables fold unconditionally (a fold with nothing pending is the
    identity: the flush kernel's programs exit at once and the conv fold shifts by zero)."""
    if chk.is_concrete(pending):
        return fold(*operands) if bool(pending) else operands
    if rows < FOLD_GATE_MIN_ROWS:
        return fold(*operands)
    return jax.lax.cond(pending, lambda ops: fold(*ops), lambda ops: ops, operands)


def flush_validated(pool: DeltaPool, slots, *, impl="auto", interpret=None, block_sizes=None):
    """`flush` for callers that have validated the pool and normalised the slot table (the
    public decode, conversion and block paths), so the table is not read on the host again.
    Runs only when a named slot has pending rows (`when_pending`)."""
    fold = lambda p: (fold_pending(p, slots, impl=impl, interpret=interpret,
                                   block_sizes=block_sizes),)
    return when_pending(any_pending(pool.stash.pending, slots), fold, (pool,),
                        rows=slots.shape[0])[0]


def fold_pending(pool: DeltaPool, slots, *, impl="auto", interpret=None, block_sizes=None):
    """Fold the pending rows of the named slots (normalised table) into H, unconditionally."""
    if slots.shape[0] == 0:
        return pool
    call = _flush_spec_of(pool, slots, block_sizes)
    choice = dispatch.select("flush", call, impl, interpret=interpret)
    if choice.impl == "pallas":
        states, stash = _flush_pallas(pool.states, pool.stash, slots, block=block_sizes,
                                      interpret=dispatch.interpret_enabled(interpret))
    else:
        states, stash = _flush_ref(pool.states, pool.stash, slots)
    return DeltaPool(states=states, stash=stash)


@functools.partial(jax.jit, static_argnames=("block", "interpret"), donate_argnames=("pool", "stash"))
def _flush_pallas(pool, stash, slots, *, block, interpret):
    from pallas_kernels import gdn_verify as verify_kernel
    pool = verify_kernel.flush_launch(pool, stash.k, stash.u, stash.g, stash.bank, stash.pending, slots, block=block,
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
