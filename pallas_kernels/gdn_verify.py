"""Speculative verify of T = 1..4 tokens for GDN / KDA on a state pool: four Pallas kernels and
their launchers.

Per (batch row b, value head h) one program owns a [K, block_v] column slab of the state of
slot = slots[b] (columns of the delta rule are independent). Slot -1 (or outside the pool) is
padding: no state or stash traffic at all, output rows zero.

Launchers (the public functions in gdn_jax.verify / gdn_jax.carry validate and call them):

  verify_states_launch   read S once, run the T tokens in registers, write the T outputs and the
                  state after every token ([B, T, HV, K, V]); the pool is only read.
  carried_verify_launch  read S, fold the slot's pending stash rows (S <- exp(g) S + k u^T, one row per
                  accepted token of the previous verify), write the folded S once (only if
                  something was pending), run the T tokens in registers, write the T outputs
                  and stash each token's rows (k, u = beta (v - S^T k), g) in the slot's other
                  bank. Flavours (static): exact -- T calls of the decode kernel's own
                  `token_update` (16-bit state rounded after every token, as decode's store
                  does), so outputs and folded states are bit-identical to T decode launches
                  with the same tile shape and num_warps; fast -- the WY form (fp32 state only):
                  one XLA reduction forms the dot products of the raw q, k rows, each program
                  solves its head's T x T WY scalars from them, folds the pending rows as one
                  rank-C update and forms all 2T projections k^T S, q^T S as one fp32 dot (see
                  "fast flavour" below).
  flush_launch    fold the pending rows of the named slots into H (exact fold).
  accept_counts   the verdict: pending[slot] = accepted, drafted[slot] = 0 (one program per row;
                  one launch instead of XLA's gather and two scatters).

The stash is double-banked (`bank[slot]` holds the slot's rows): a verify reads the pending
rows of one bank and writes the new rows into the other, so its programs need no ordering
between them (g rows are shared by all column programs of a value head, k rows by every value
head of a key head's group: one program writes each).
Counters: the launcher gathers each batch row's bank and pending count before the launch
(`_row_counters`), and the programs read only those copies. So a program's stash address
depends on two loads issued together (slots[b], bank[b]), not on a chain slots[b] ->
bank[slot] -> stash (one memory latency less before the fold and the store, which sit on every
program's critical path), and one program per row can write the slot's new counters (bank
flipped, pending 0, drafted T) in the same launch without a race.

The per-token math is `gdn_decode.token_update` (imported, not copied). The delta u is
recomputed here by the same function on the same values (`token_delta`; the compiler merges
the two), and the fold replays the state update from the stashed u by the same function
(`token_write`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import gdn_decode as dec
from pallas_kernels.gdn_prefill import split_gate
from pallas_kernels.tracing import default_config

F32 = jnp.float32
MAX_TOKENS = 4

__all__ = ["VerifySpec", "VerifyBlockSizes", "TUNING_TABLE", "default_block_sizes",
           "unsupported_reason", "delta_value", "fold_row", "verify_states_launch",
           "carried_verify_launch", "flush_launch",
           "accept_counts"]


# --------------------------------------------------------------------------- in-kernel math

def delta_value(S, k, v, g, beta):
    """u = beta * (v - (exp(g) S)^T k): the delta `token_update` computes for this token, by the
    same function (`token_delta`), so the compiler shares the work and the bits agree."""
    return dec.token_delta(S, k, v, g, beta)


def fold_row(S, k, u, g):
    """Replay one token from its stashed rows: exp(g) S + k u^T by `token_update`'s own update
    (`token_write`: the same expression, so the compiler picks the same FMA and the fold is
    bit-identical to the decode kernel's step)."""
    return dec.token_write(S, k, u, g)


def _round(S, dtype):
    """What a store to a `dtype` state and a reload give (identity for fp32)."""
    return S if jnp.dtype(dtype) == jnp.dtype(F32) else S.astype(dtype).astype(F32)


# --------------------------------------------------------------------------- spec and tuning

@dataclasses.dataclass(frozen=True)
class VerifySpec:
    """Static configuration of one verify launch (a jit static argument)."""
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    num_tokens: int
    scale: float
    per_channel_gate: bool = False
    use_qk_l2norm: bool = False
    exact: bool = True


@dataclasses.dataclass(frozen=True)
class VerifyBlockSizes:
    """A program owns value columns [j * block_v, (j + 1) * block_v) of one (row, head): one
    [K, block_v] register tile. Grid = (B, HV, V // block_v). For the exact flavour to match the
    decode kernel bit for bit, block_v and num_warps must equal the decode launch's."""
    block_v: int = 32
    num_warps: int = 4
    num_stages: int = 1


# (largest batch, fast flavour) -> block sizes for the fast flavour; the exact flavour takes the
# decode kernel's table (gdn_decode.TUNING_TABLE) so the reduction order matches. First match wins.
TUNING_TABLE: tuple[tuple[int, VerifyBlockSizes], ...] = (
    (8, VerifyBlockSizes(block_v=16, num_warps=2)),
    (1 << 30, VerifyBlockSizes(block_v=64, num_warps=4)),
)


def default_block_sizes(batch: int, head_v_dim: int, state_dtype, exact: bool) -> VerifyBlockSizes:
    if exact:
        d = dec.default_block_sizes(batch, head_v_dim, state_dtype, False)
        return VerifyBlockSizes(block_v=d.tile, num_warps=d.num_warps, num_stages=d.num_stages)
    for max_b, bs in TUNING_TABLE:
        if batch <= max_b:
            return dataclasses.replace(bs, block_v=min(bs.block_v, head_v_dim))
    raise AssertionError("unreachable: the last tuning row takes any batch")


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def unsupported_reason(spec: VerifySpec, block: VerifyBlockSizes, state_dtype) -> str | None:
    """Why these kernels cannot take the call (None when they can). Pure; no device work."""
    if jnp.dtype(state_dtype) not in dec.STATE_DTYPES:
        return f"state dtype {jnp.dtype(state_dtype)} is not float32/float16/bfloat16"
    if not spec.exact and jnp.dtype(state_dtype) != jnp.dtype(F32):
        return "the fast flavour needs an fp32 state (a 16-bit state carries with exact=True)"
    if not 1 <= spec.num_tokens <= MAX_TOKENS:
        return f"num_tokens={spec.num_tokens} must lie in 1..{MAX_TOKENS}"
    for name, d in (("K", spec.head_k_dim), ("V", spec.head_v_dim)):
        if not (_pow2(d) and 16 <= d <= 256):
            return f"{name}={d} must be a power of two in [16, 256] (Triton tile)"
    if not (_pow2(block.block_v) and spec.head_v_dim % block.block_v == 0):
        return f"block_v={block.block_v} must be a power of two dividing V={spec.head_v_dim}"
    if spec.num_k_heads <= 0 or spec.num_v_heads % spec.num_k_heads:
        return f"HV={spec.num_v_heads} must be a multiple of HK={spec.num_k_heads}"
    if block.num_warps not in (1, 2, 4, 8, 16):
        return f"num_warps={block.num_warps} must be 1, 2, 4, 8 or 16"
    if not spec.exact and block.block_v < 16:
        return f"the fast flavour needs block_v >= 16 (a Triton dot operand), got {block.block_v}"
    return None


# --------------------------------------------------------------------------- shared kernel pieces

def _program(slots_ref, pool_ref, block):
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = slots_ref[b]
    valid = (slot >= 0) & (slot < pool_ref.shape[0])
    return b, h, j, jnp.where(valid, slot, 0), valid, pl.ds(j * block.block_v, block.block_v)


def _key_head(h, spec):
    """The key head value head h reads (and whose stash k rows it shares)."""
    return h // (spec.num_v_heads // spec.num_k_heads)


def _writes_key_rows(h, j, spec):
    """One program per key head writes its stash k rows: column block 0 of the group's first
    value head (the others read the same rows, never the bank being written)."""
    return (j == 0) & (h % (spec.num_v_heads // spec.num_k_heads) == 0)


def _load_token(q_ref, k_ref, v_ref, g_ref, beta_ref, b, t, h, cols, spec):
    """Token t of row b for head h, prepared exactly as the decode kernel prepares it."""
    kh = _key_head(h, spec)
    q = q_ref[b, t, kh, :].astype(F32)
    k = k_ref[b, t, kh, :].astype(F32)
    if spec.use_qk_l2norm:  # the plain norm: the launcher tamed huge rows (`_tame`)
        q, k = dec.l2_normalize(q, guard=False), dec.l2_normalize(k, guard=False)
    q = q * jnp.float32(spec.scale)
    v = v_ref[b, t, h, cols].astype(F32)
    g = (g_ref[b, t, h, :] if spec.per_channel_gate else g_ref[b, t, h]).astype(F32)
    beta = beta_ref[b, t, h].astype(F32)
    return q, k, v, g, beta


def _fold_pending(S, stash_k_ref, stash_u_ref, stash_g_ref, slot, bank, h, cols, count, dtype,
                  spec):
    """Fold rows 0..count-1 of the slot's bank into the tile, rounding after each row.

    Every row of the bank is loaded up front (one memory latency for all of them, instead of a
    dependent load per loop trip) and folded under a select, so rows past `count` leave the
    tile bit-for-bit as it was whatever they hold."""
    rows, kh = [], _key_head(h, spec)
    for i in range(stash_k_ref.shape[3]):       # static: the stash capacity
        k = stash_k_ref[slot, bank, kh, i, :]
        u = stash_u_ref[slot, bank, h, i, cols]
        g = stash_g_ref[slot, bank, h, i, :] if spec.per_channel_gate else stash_g_ref[slot, bank, h, i]
        rows.append((k, u, g))
    for i, (k, u, g) in enumerate(rows):
        S = jnp.where(i < count, _round(fold_row(S, k, u, g), dtype), S)
    return S


def _chain_exact(S, tokens, dtype):
    """T decode steps in registers; returns per-token (o, u)."""
    outs = []
    for q, k, v, g, beta in tokens:
        u = delta_value(S, k, v, g, beta)
        o, S = dec.token_update(S, q, k, v, g, beta)
        S = _round(S, dtype)
        outs.append((o, u))
    return outs


def _update_counters(bank_ref, bank_out, pending_out, drafted_out, b, h, j, slot, valid, T):
    """The slot's counters after a verify (bank flipped, nothing pending, T drafted), written by
    one program per row. Safe in the same launch: every program reads the per-row copies
    gathered before it (`bank_ref[b]`), never the slot arrays these outputs alias."""
    @pl.when(valid & (h == 0) & (j == 0))
    def _():
        bank_out[slot] = 1 - bank_ref[b]
        pending_out[slot] = jnp.int32(0)
        drafted_out[slot] = jnp.int32(T)


# --------------------------------------------------------------------------- kernel bodies

def _verify_states_kernel(slots_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, pool_ref,
                          o_ref, states_ref, *, spec: VerifySpec, block: VerifyBlockSizes):
    b, h, j, slot, valid, cols = _program(slots_ref, pool_ref, block)
    T, dtype = spec.num_tokens, pool_ref.dtype

    @pl.when(valid)
    def _():
        S = pool_ref[slot, h, :, cols].astype(F32)
        for t in range(T):
            q, k, v, g, beta = _load_token(q_ref, k_ref, v_ref, g_ref, beta_ref, b, t, h, cols, spec)
            o, S = dec.token_update(S, q, k, v, g, beta)
            states_ref[b, t, h, :, cols] = S.astype(states_ref.dtype)
            S = _round(S, dtype)
            o_ref[b, t, h, cols] = o.astype(o_ref.dtype)

    @pl.when(jnp.logical_not(valid))
    def _():
        for t in range(T):
            o_ref[b, t, h, cols] = jnp.zeros((block.block_v,), o_ref.dtype)
            states_ref[b, t, h, :, cols] = jnp.zeros((spec.head_k_dim, block.block_v), states_ref.dtype)


def _carried_verify_kernel(slots_ref, bank_ref, pending_ref, q_ref, k_ref, v_ref, g_ref, beta_ref,
                           pool_ref, stash_k_ref, stash_u_ref, stash_g_ref, _bank, _pending, _drafted,
                           o_ref, pool_out_ref, stash_k_out, stash_u_out, stash_g_out,
                           bank_out, pending_out, drafted_out,
                           *, spec: VerifySpec, block: VerifyBlockSizes):
    b, h, j, slot, valid, cols = _program(slots_ref, pool_ref, block)
    T, dtype = spec.num_tokens, pool_ref.dtype
    _update_counters(bank_ref, bank_out, pending_out, drafted_out, b, h, j, slot, valid, T)

    @pl.when(valid)
    def _():
        bank = bank_ref[b]
        count = pending_ref[b]
        S = pool_ref[slot, h, :, cols].astype(F32)
        tokens = [_load_token(q_ref, k_ref, v_ref, g_ref, beta_ref, b, t, h, cols, spec)
                  for t in range(T)]
        S = _fold_pending(S, stash_k_ref, stash_u_ref, stash_g_ref, slot, bank, h, cols, count,
                          dtype, spec)

        @pl.when(count > 0)             # nothing pending: H is already what the pool holds
        def _():
            pool_out_ref[slot, h, :, cols] = S.astype(pool_out_ref.dtype)

        outs = _chain_exact(S, tokens, dtype)
        other = 1 - bank
        for t, ((o, u), (_, k, _, g, _)) in enumerate(zip(outs, tokens)):
            o_ref[b, t, h, cols] = o.astype(o_ref.dtype)
            stash_u_out[slot, other, h, t, cols] = u

        @pl.when(j == 0)                # g rows belong to the whole head: one writer
        def _():
            for t, (_, _, _, g, _) in enumerate(tokens):
                if spec.per_channel_gate:
                    stash_g_out[slot, other, h, t, :] = g
                else:
                    stash_g_out[slot, other, h, t] = g

        @pl.when(_writes_key_rows(h, j, spec))
        def _():
            for t, (_, k, _, _, _) in enumerate(tokens):
                stash_k_out[slot, other, _key_head(h, spec), t, :] = k

    @pl.when(jnp.logical_not(valid))
    def _():
        for t in range(T):
            o_ref[b, t, h, cols] = jnp.zeros((block.block_v,), o_ref.dtype)


# --------------------------------------------------------------------------- fast flavour (WY)
# The fast flavour keeps cross-thread scalar reductions out of the kernel: the dot products of
# the raw q, k rows (norms included) come from one XLA reduction before the launch (`_raw_gram`);
# each program turns its head's entries into the row factors (L2 norm, scale) and the T x T WY
# matrices with scalar arithmetic (`_wy_scalars`; KDA, whose gate weighs every channel inside
# the Gram sums, takes them from an XLA prelude instead: `_fast_prelude`). Per [K, block_v]
# tile it folds the pending rows as one rank-C update, forms the 2T projections (one fp32 dot,
# or 2T column reductions) and combines them with those scalars. Each XLA kernel before the
# launch costs ~1 us of a ~200 us round (launch gap included): one instead of seven.

def _raw_gram(q, k):
    """The dot products of the raw rows of each key head, fp32: q_i.q_j, k_i.k_j, q_i.k_j, each
    [B, T, T, HK] (norms on the diagonals). Three same-shape sums over K: one XLA reduction
    kernel, q and k read once, no concatenated copy of them."""
    qf, kf = q.astype(F32), k.astype(F32)
    dots = lambda a, c: jnp.sum(a[:, :, None] * c[:, None, :], axis=-1)
    return dots(qf, qf), dots(kf, kf), dots(qf, kf)


def _row_factors(sq_q, sq_k, spec):
    """What the raw q, k rows are multiplied by (L2 norm, scale) from their squared norms."""
    if spec.use_qk_l2norm:
        rq = [jax.lax.rsqrt(x + dec.L2NORM_EPS) * jnp.float32(spec.scale) for x in sq_q]
        rk = [jax.lax.rsqrt(x + dec.L2NORM_EPS) for x in sq_k]
    else:
        rq = [jnp.float32(spec.scale) * jnp.ones_like(x) for x in sq_q]
        rk = [jnp.ones_like(x) for x in sq_k]
    return rq, rk


def _wy_solve(C, D, betas):
    """The WY matrices from the decayed Gram scalars (nested lists, lower triangles; entries are
    scalars in a kernel or arrays in XLA): A = (I + diag(beta) C_strict)^-1 diag(beta) by forward
    substitution, E = D A. Returns A[i][l], E[i][l] for l <= i."""
    T = len(betas)
    A = []
    for i in range(T):
        row = []
        for l in range(i + 1):
            acc = None
            for j in range(l, i):
                term = C[i][j] * A[j][l]
                acc = term if acc is None else acc + term
            row.append(betas[i] if l == i else -(betas[i] * acc))
        A.append(row)
    E = []
    for i in range(T):
        row = []
        for l in range(i + 1):
            acc = None
            for j in range(l, i + 1):
                term = D[i][j] * A[j][l]
                acc = term if acc is None else acc + term
            row.append(acc)
        E.append(row)
    return A, E


def _cumulative_log_decay(gs):
    """Running sums of a list of gates as (HI, LO) lists (gdn_prefill.split_gate): the log decay
    from token j to i is (HI[i] - HI[j]) + (LO[i] - LO[j]), finite and precise for any gate in
    [-inf, 0] (a plain running sum gives -inf - -inf = NaN, and loses precision after a huge
    gate)."""
    HI, LO = [], []
    for g in gs:
        hi, lo = split_gate(g)
        HI.append(hi if not HI else HI[-1] + hi)
        LO.append(lo if not LO else LO[-1] + lo)
    return HI, LO


def _decay_between(HI, LO, i, j):
    return jnp.exp((HI[i] - HI[j]) + (LO[i] - LO[j]))


def _wy_scalars(rq, rk, kk, qk, gs, betas):
    """WY matrices of one (row, head) from the raw Gram entries: rq/rk the row factors
    (`_row_factors`), kk[i][j] = k_i.k_j (j < i), qk[i][j] = q_i.k_j (j <= i), gs the scalar log
    decays, betas. Elementwise: runs on scalars in a kernel or on arrays in XLA."""
    T = len(gs)
    w = _pairwise_decays([jnp.exp(g) for g in gs])
    C = [[kk[i][j] * rk[i] * rk[j] * w[i][j] for j in range(i)] for i in range(T)]
    D = [[qk[i][j] * rq[i] * rk[j] * (w[i][j] if j < i else 1.0) for j in range(i + 1)]
         for i in range(T)]
    return _wy_solve(C, D, betas)


def _decays_to_last(ds):
    """e[j] = d_{j+1} * ... * d_{n-1} for the per-token decays ds (n of them), multiplied from the
    last one backwards; None for j = n - 1 (the empty product, so no multiply by 1)."""
    out = [None] * len(ds)
    for j in range(len(ds) - 2, -1, -1):
        out[j] = ds[j + 1] if out[j + 1] is None else out[j + 1] * ds[j + 1]
    return out


def _pairwise_decays(ds):
    """w[i][j] = exp(G_i - G_j) = d_{j+1} * ... * d_i for j < i, from the per-token decays
    d_t = exp(g_t): any gate in [-inf, 0] (every factor lies in [0, 1]), no cancellation
    however negative the gates before j, one exp per token."""
    return [_decays_to_last(ds[:i + 1])[:i] for i in range(len(ds))]


def _running_products(ds):
    """exp(G_i) = d_0 * ... * d_i."""
    out = []
    for d in ds:
        out.append(d if not out else out[-1] * d)
    return out


def _fast_prelude(q, k, g, beta, spec):
    """Per-row factors and the WY matrices of the fast flavour, in XLA before the launch.

    Returns r ([B, 2T, HK] fp32: the prepared rows are q_t * r[t] (L2 norm and scale) and
    k_t * r[T + t], formed by the kernel from the raw q, k) and AE ([B, HV, 2T, T]: A on rows
    0..T-1, E on rows T..2T-1): with z_j = v_j - (k_j e^{G_j})^T S and G_j the cumulative log
    decay from S,
        u_i = sum_{j<=i} A_ij z_j ,   o_i = (q_i e^{G_i})^T S + sum_{j<=i} E_ij z_j
    (A = (I + diag(beta) C_strict)^-1 diag(beta), E = D A, C and D the decayed Gram scalars of
    gdn_jax.verify._chain_wy). Every exponent is <= 0 (pairwise differences of G). The
    per-channel gate (KDA) weighs each channel inside the Gram sums. (For GDN the kernel can
    solves these itself from `_raw_gram`.)"""
    T, HV, HK = spec.num_tokens, spec.num_v_heads, spec.num_k_heads
    grp = HV // HK
    bt = [beta[:, t].astype(F32) for t in range(T)]                              # [B, HV]
    if spec.per_channel_gate:
        x = jnp.concatenate([q, k], axis=1).astype(F32)                          # [B, 2T, HK, K]
        sq = jnp.sum(x * x, axis=-1)                                             # [B, 2T, HK]
        rq, rk = _row_factors([sq[:, t] for t in range(T)], [sq[:, T + t] for t in range(T)], spec)
        r = jnp.stack(rq + rk, axis=1)                                           # [B, 2T, HK]
        HI, LO = _cumulative_log_decay([g[:, t].astype(F32) for t in range(T)])  # [B, HV, K] each
        xn = jnp.repeat(x * r[..., None], grp, axis=2)                           # [B, 2T, HV, K]
        dot_w = lambda a, c, i, j: jnp.sum(a * c * _decay_between(HI, LO, i, j), axis=-1)
        C = [[dot_w(xn[:, T + i], xn[:, T + j], i, j) for j in range(i)] for i in range(T)]
        D = [[dot_w(xn[:, i], xn[:, T + j], i, j) for j in range(i + 1)] for i in range(T)]
        A, E = _wy_solve(C, D, bt)
    else:
        gram = _raw_gram(q, k)                                                   # [B, T, T, HK]
        rq, rk = _row_factors([gram[0][:, t, t] for t in range(T)],
                              [gram[1][:, t, t] for t in range(T)], spec)
        r = jnp.stack(rq + rk, axis=1)                                           # [B, 2T, HK]
        rep = lambda a: jnp.repeat(a, grp, axis=-1)                              # HK -> HV
        kk, qk = rep(gram[1]), rep(gram[2])                                      # [B, T, T, HV]
        gs = [g[:, t].astype(F32) for t in range(T)]
        A, E = _wy_scalars([rep(x) for x in rq], [rep(x) for x in rk],
                           [[kk[:, i, j] for j in range(i)] for i in range(T)],
                           [[qk[:, i, j] for j in range(i + 1)] for i in range(T)], gs, bt)
    zero = jnp.zeros_like(bt[0])
    rows = [[A[i][l] if l <= i else zero for l in range(T)] for i in range(T)]
    rows += [[E[i][l] if l <= i else zero for l in range(T)] for i in range(T)]
    AE = jnp.stack([jnp.stack(row, axis=-1) for row in rows], axis=-2)           # [B, HV, 2T, T]
    return r, AE


def _fold_pending_fast(S, stash_k_ref, stash_u_ref, stash_g_ref, slot, bank, h, cols, count, spec):
    """Rows 0..count-1 of the slot's bank as one rank-C update (fp32 state):
    S <- e^{G_P} S + sum_i (k_i e^{G_P - G_i}) u_i^T, G_i the cumulative (masked) pending gates.
    Rows past `count` get zero coefficients and zeroed u (no select on the tile)."""
    C = stash_k_ref.shape[3]
    rows, kh = [], _key_head(h, spec)
    for i in range(C):
        k = stash_k_ref[slot, bank, kh, i, :]
        u = stash_u_ref[slot, bank, h, i, cols]
        g = stash_g_ref[slot, bank, h, i, :] if spec.per_channel_gate else stash_g_ref[slot, bank, h, i]
        live = i < count
        rows.append((k, jnp.where(live, u, 0.0), jnp.where(live, g, 0.0), live))
    ds = [jnp.exp(g) for _, _, g, _ in rows]       # masked rows: g = 0, d = 1
    after = _decays_to_last(ds)                       # after[i] = d_{i+1} ... d_{C-1}
    decay = ds[0] if after[0] is None else after[0] * ds[0]
    S = S * (decay[:, None] if spec.per_channel_gate else decay)
    for i, (k, u, _, live) in enumerate(rows):
        a = jnp.where(live, k if after[i] is None else k * after[i], 0.0)
        S = a[:, None] * u[None, :] + S
    return S


def _projections(S, xs):
    """[x^T S for x in xs] ([K] rows, [K, block_v] tile) as one fp32 (IEEE, not tf32) dot of
    the stacked rows."""
    m = max(16, 1 << (len(xs) - 1).bit_length())
    rid = jax.lax.broadcasted_iota(jnp.int32, (m, S.shape[0]), 0)
    X = jnp.zeros((m, S.shape[0]), F32)
    for n, x in enumerate(xs):
        X = jnp.where(rid == n, x[None, :], X)
    R = jnp.dot(X, S, precision=jax.lax.Precision.HIGHEST, preferred_element_type=F32)
    parts = jnp.split(R, m, axis=0)
    return [parts[n].reshape(S.shape[1]) for n in range(len(xs))]


def _wy_in_kernel(spec: VerifySpec) -> bool:
    """GDN's WY scalars are solved per program from the raw Gram entries; KDA's per-channel
    gate weighs every channel inside the Gram sums, so they come from the XLA prelude."""
    return not spec.per_channel_gate


def _carried_fast_kernel(slots_ref, bank_ref, pending_ref, q_ref, k_ref, v_ref, g_ref, *refs,
                         spec: VerifySpec, block: VerifyBlockSizes):
    """After g: with `_wy_in_kernel`, beta [B, T, HV] and the raw Gram blocks qq, kk, qk
    ([B, T, T, HK], `_raw_gram`; the program solves its head's WY scalars), else the prelude's
    r and AE (`_fast_prelude`); then the state and stash arrays and the outputs."""
    n_wy = 4 if _wy_in_kernel(spec) else 2
    wy_refs, refs = refs[:n_wy], refs[n_wy:]
    (pool_ref, stash_k_ref, stash_u_ref, stash_g_ref, _bank, _pending, _drafted,
     o_ref, pool_out_ref, stash_k_out, stash_u_out, stash_g_out,
     bank_out, pending_out, drafted_out) = refs
    b, h, j, slot, valid, cols = _program(slots_ref, pool_ref, block)
    T = spec.num_tokens
    _update_counters(bank_ref, bank_out, pending_out, drafted_out, b, h, j, slot, valid, T)
    kh = _key_head(h, spec)

    @pl.when(valid)
    def _():
        bank = bank_ref[b]
        count = pending_ref[b]
        S = pool_ref[slot, h, :, cols].astype(F32)
        gs = [(g_ref[b, t, h, :] if spec.per_channel_gate else g_ref[b, t, h]).astype(F32)
              for t in range(T)]
        if _wy_in_kernel(spec):             # scalar math on this head's Gram entries
            beta_ref, qq_ref, kk_ref, qk_ref = wy_refs
            rq, rk = _row_factors([qq_ref[b, t, t, kh] for t in range(T)],
                                  [kk_ref[b, t, t, kh] for t in range(T)], spec)
            A, E = _wy_scalars(
                rq, rk, [[kk_ref[b, i, jj, kh] for jj in range(i)] for i in range(T)],
                [[qk_ref[b, i, jj, kh] for jj in range(i + 1)] for i in range(T)],
                gs, [beta_ref[b, t, h].astype(F32) for t in range(T)])
        else:
            r_ref, ae_ref = wy_refs
            rq = [r_ref[b, t, kh] for t in range(T)]
            rk = [r_ref[b, T + t, kh] for t in range(T)]
            A = [[ae_ref[b, h, i, l] for l in range(i + 1)] for i in range(T)]
            E = [[ae_ref[b, h, T + i, l] for l in range(i + 1)] for i in range(T)]
        # raw rows times their factors: L2-normalised (and scaled) as the reference does
        qs = [q_ref[b, t, kh, :].astype(F32) * rq[t] for t in range(T)]
        ks = [k_ref[b, t, kh, :].astype(F32) * rk[t] for t in range(T)]
        vs = [v_ref[b, t, h, cols].astype(F32) for t in range(T)]
        S = _fold_pending_fast(S, stash_k_ref, stash_u_ref, stash_g_ref, slot, bank, h, cols,
                               count, spec)

        @pl.when(count > 0)
        def _():
            pool_out_ref[slot, h, :, cols] = S.astype(pool_out_ref.dtype)

        xs_k, xs_q = [], []
        for q, k, d in zip(qs, ks, _running_products([jnp.exp(g) for g in gs])):
            xs_k.append(k * d)
            xs_q.append(q * d)
        proj = _projections(S, xs_k + xs_q)
        z = [v - r for v, r in zip(vs, proj[:T])]
        other = 1 - bank
        for i in range(T):
            u = A[i][0] * z[0]
            o = proj[T + i] + E[i][0] * z[0]
            for l in range(1, i + 1):
                u = u + A[i][l] * z[l]
                o = o + E[i][l] * z[l]
            o_ref[b, i, h, cols] = o.astype(o_ref.dtype)
            stash_u_out[slot, other, h, i, cols] = u

        @pl.when(j == 0)
        def _():
            for t in range(T):
                if spec.per_channel_gate:
                    stash_g_out[slot, other, h, t, :] = gs[t]
                else:
                    stash_g_out[slot, other, h, t] = gs[t]

        @pl.when(_writes_key_rows(h, j, spec))
        def _():
            for t in range(T):
                stash_k_out[slot, other, kh, t, :] = ks[t]

    @pl.when(jnp.logical_not(valid))
    def _():
        for t in range(T):
            o_ref[b, t, h, cols] = jnp.zeros((block.block_v,), o_ref.dtype)


def _flush_kernel(slots_ref, bank_ref, pending_ref, pool_ref, stash_k_ref, stash_u_ref, stash_g_ref,
                  pool_out_ref, *, spec: VerifySpec, block: VerifyBlockSizes):
    b, h, j, slot, valid, cols = _program(slots_ref, pool_ref, block)
    count = jnp.where(valid, pending_ref[b], 0)

    @pl.when(count > 0)
    def _():
        S = pool_ref[slot, h, :, cols].astype(F32)
        S = _fold_pending(S, stash_k_ref, stash_u_ref, stash_g_ref, slot, bank_ref[b], h, cols,
                          count, pool_ref.dtype, spec)
        pool_out_ref[slot, h, :, cols] = S.astype(pool_out_ref.dtype)


# --------------------------------------------------------------------------- launchers
# The launchers trust their callers (gdn_jax.verify / gdn_jax.carry validate every argument
# once, raising ValueError): what they check here are assertions, a bug in the caller if they fire.

def _need(name, x, shape):
    if getattr(x, "shape", None) != tuple(shape):
        raise AssertionError(f"{name} must have shape {tuple(shape)}, got {getattr(x, 'shape', None)}")


def _spec_from(q, v, g, *, scale, use_qk_l2norm, exact):
    for name, x, rank in (("q", q, 4), ("v", v, 4)):
        if getattr(x, "ndim", None) != rank:
            raise AssertionError(f"{name} must have rank {rank}, got shape {getattr(x, 'shape', None)}")
    b, t, hk, kd = q.shape
    hv, vd = v.shape[2:]
    if g.ndim not in (3, 4):
        raise AssertionError(f"g must be [B, T, HV] (GDN) or [B, T, HV, K] (KDA), got {g.shape}")
    return VerifySpec(num_k_heads=hk, num_v_heads=hv, head_k_dim=kd, head_v_dim=vd, num_tokens=t,
                      scale=float(kd ** -0.5 if scale is None else scale),
                      per_channel_gate=g.ndim == 4, use_qk_l2norm=bool(use_qk_l2norm),
                      exact=bool(exact))


def _check_tokens(spec, q, k, v, g, beta, pool, slots):
    b, t = q.shape[:2]
    hk, hv, kd, vd = spec.num_k_heads, spec.num_v_heads, spec.head_k_dim, spec.head_v_dim
    _need("k", k, q.shape)
    _need("v", v, (b, t, hv, vd))
    _need("g", g, (b, t, hv, kd) if spec.per_channel_gate else (b, t, hv))
    _need("beta", beta, (b, t, hv))
    if getattr(pool, "ndim", None) != 4 or pool.shape[1:] != (hv, kd, vd):
        raise AssertionError(f"pool must be [slots, HV={hv}, K={kd}, V={vd}], got {getattr(pool, 'shape', None)}")
    if getattr(slots, "shape", None) != (b,) or not jnp.issubdtype(slots.dtype, jnp.integer):
        raise AssertionError(f"slots must be an int32 array of shape ({b},), got "
                         f"{getattr(slots, 'shape', None)} {getattr(slots, 'dtype', None)}")


def _check_stash(spec, pool, stash_k, stash_u, stash_g, bank, pending):
    s = pool.shape[0]
    hv, kd, vd = spec.num_v_heads, spec.head_k_dim, spec.head_v_dim
    if getattr(stash_k, "ndim", None) != 5:
        raise AssertionError(f"stash_k must be [slots, 2, HK, C, K], got {getattr(stash_k, 'shape', None)}")
    c = stash_k.shape[3]
    _need("stash_k", stash_k, (s, 2, spec.num_k_heads, c, kd))
    _need("stash_u", stash_u, (s, 2, hv, c, vd))
    _need("stash_g", stash_g, (s, 2, hv, c, kd) if spec.per_channel_gate else (s, 2, hv, c))
    _need("bank", bank, (s,))
    _need("pending", pending, (s,))
    if spec.num_tokens > c:
        raise AssertionError(f"num_tokens={spec.num_tokens} exceeds the stash capacity C={c}")


def _row_counters(bank, pending, slots, num_slots):
    """bank[slots[b]], pending[slots[b]] per batch row (0 for padding rows)."""
    live = (slots >= 0) & (slots < num_slots)
    idx = jnp.where(live, slots, 0)
    return jnp.where(live, bank[idx], 0), jnp.where(live, pending[idx], 0)


def _reason_or_raise(spec, block, pool):
    reason = unsupported_reason(spec, block, pool.dtype) or dec.index_overflow_reason(pool.size)
    if reason is not None:
        raise AssertionError(reason)


def _tame(q, k, spec):
    """q, k with huge rows tamed (`gdn_decode.tame_huge_rows`) when the kernel L2-normalises
    them: the exact flavour and the intermediate-state verify normalise with the plain formula
    (`l2_normalize(guard=False)`), the fast flavour forms raw Gram sums of rows it normalises
    afterwards. One XLA pass before the launch instead of a branch per token in every program.
    Rows with max |x| <= L2NORM_RESCALE_ABOVE pass unchanged, so for them the exact flavour sees
    the bits the decode kernel (which guards in the kernel) sees."""
    if not spec.use_qk_l2norm:
        return q, k
    return dec.tame_huge_rows(q), dec.tame_huge_rows(k)


def _compiler_params(block):
    return plgpu.CompilerParams(num_warps=block.num_warps, num_stages=block.num_stages)


def verify_states_launch(q, k, v, g, beta, pool, slots, *, scale=None, use_qk_l2norm=False,
                  block: VerifyBlockSizes | None = None, interpret=False):
    """T tokens per row from pool[slots[b]], keeping every intermediate state.

    q, k [B, T, HK, K]; v [B, T, HV, V]; g [B, T, HV] or [B, T, HV, K]; beta [B, T, HV];
    pool [slots, HV, K, V] (read only); slots [B] int32. Returns (o [B, T, HV, V] in q's dtype,
    states [B, T, HV, K, V] in the pool's dtype). Uses the decode kernel's tile for its batch."""
    spec = _spec_from(q, v, g, scale=scale, use_qk_l2norm=use_qk_l2norm, exact=True)
    _check_tokens(spec, q, k, v, g, beta, pool, slots)
    block = block or default_block_sizes(q.shape[0], spec.head_v_dim, pool.dtype, True)
    _reason_or_raise(spec, block, pool)
    return _verify_states_launch(q, k, v, g, beta, pool, slots.astype(jnp.int32), spec=spec,
                                 block=block, interpret=bool(interpret))


@default_config
@functools.partial(jax.jit, static_argnames=("spec", "block", "interpret"))
def _verify_states_launch(q, k, v, g, beta, pool, slots, *, spec, block, interpret):
    b, t = q.shape[:2]
    hv, kd, vd = spec.num_v_heads, spec.head_k_dim, spec.head_v_dim
    q, k = _tame(q, k, spec)
    return pl.pallas_call(
        functools.partial(_verify_states_kernel, spec=spec, block=block),
        grid=(b, hv, vd // block.block_v),
        out_shape=(jax.ShapeDtypeStruct((b, t, hv, vd), q.dtype),
                   jax.ShapeDtypeStruct((b, t, hv, kd, vd), pool.dtype)),
        compiler_params=_compiler_params(block),
        interpret=interpret,
        name=f"gdn_verify_states{t}",
    )(slots, q, k, v, g, beta, pool)


def carried_verify_launch(q, k, v, g, beta, pool, stash_k, stash_u, stash_g, bank, pending, drafted, slots,
                   *, exact=True, scale=None, use_qk_l2norm=False,
                   block: VerifyBlockSizes | None = None, interpret=False):
    """Carried-state verify (see the module docstring). Stash arrays as gdn_jax.state.DeltaStash:
    stash_k [slots, 2, HK, C, K] (one row per key head), stash_u [slots, 2, HV, C, V],
    stash_g [slots, 2, HV, C(, K)],
    bank, pending and drafted [slots] int32. Returns (o [B, T, HV, V], pool, stash_k, stash_u,
    stash_g, bank, pending, drafted): every output but o aliases its input (donate them at the jit
    boundary); the named slots' counters come back updated (bank flipped, pending 0, drafted T)."""
    spec = _spec_from(q, v, g, scale=scale, use_qk_l2norm=use_qk_l2norm, exact=exact)
    _check_tokens(spec, q, k, v, g, beta, pool, slots)
    _check_stash(spec, pool, stash_k, stash_u, stash_g, bank, pending)
    _need("drafted", drafted, (pool.shape[0],))
    block = block or default_block_sizes(q.shape[0], spec.head_v_dim, pool.dtype, spec.exact)
    _reason_or_raise(spec, block, pool)
    i32 = lambda x: x.astype(jnp.int32)
    return _carried_launch(q, k, v, g, beta, pool, stash_k, stash_u, stash_g, i32(bank), i32(pending),
                           i32(drafted), i32(slots), spec=spec, block=block, interpret=bool(interpret))


@default_config
@functools.partial(jax.jit, static_argnames=("spec", "block", "interpret"))
def _carried_launch(q, k, v, g, beta, pool, stash_k, stash_u, stash_g, bank, pending, drafted, slots,
                    *, spec, block, interpret):
    b, t = q.shape[:2]
    hv, vd = spec.num_v_heads, spec.head_v_dim
    row_bank, row_pending = _row_counters(bank, pending, slots, pool.shape[0])
    q, k = _tame(q, k, spec)
    if spec.exact:
        kernel = _carried_verify_kernel
        tokens = (q, k, v, g, beta)
    else:
        kernel = _carried_fast_kernel
        if _wy_in_kernel(spec):
            tokens = (q, k, v, g, beta, *_raw_gram(q, k))
        else:
            tokens = (q, k, v, g, *_fast_prelude(q, k, g, beta, spec))
    state = (pool, stash_k, stash_u, stash_g, bank, pending, drafted)
    p0 = 3 + len(tokens)                 # inputs from p0 on alias outputs 1, 2, ...
    aliases = {p0 + d: 1 + d for d in range(len(state))}
    return pl.pallas_call(
        functools.partial(kernel, spec=spec, block=block),
        grid=(b, hv, vd // block.block_v),
        out_shape=(jax.ShapeDtypeStruct((b, t, hv, vd), q.dtype),
                   jax.ShapeDtypeStruct(pool.shape, pool.dtype),
                   jax.ShapeDtypeStruct(stash_k.shape, stash_k.dtype),
                   jax.ShapeDtypeStruct(stash_u.shape, stash_u.dtype),
                   jax.ShapeDtypeStruct(stash_g.shape, stash_g.dtype),
                   *(jax.ShapeDtypeStruct(c.shape, c.dtype) for c in (bank, pending, drafted))),
        input_output_aliases=aliases,
        compiler_params=_compiler_params(block),
        interpret=interpret,
        name=f"gdn_carried_verify{t}_{'exact' if spec.exact else 'fast'}",
    )(slots, row_bank, row_pending, *tokens, *state)


def _accept_kernel(slots_ref, accepted_ref, pending_ref, drafted_ref, pending_out, drafted_out,
                   invalid_out):
    """The verdict of row b: pending[slot] = accepted, drafted[slot] = 0 when accepted lies in
    1..drafted[slot]; otherwise nothing changes and the row is flagged."""
    b = pl.program_id(0)
    slot = slots_ref[b]
    live = (slot >= 0) & (slot < pending_ref.shape[0])
    accepted = accepted_ref[b]
    drafted = drafted_ref[jnp.where(live, slot, 0)]
    ok = (accepted >= 1) & (accepted <= drafted)

    @pl.when(live & ok)
    def _():
        pending_out[slot] = accepted
        drafted_out[slot] = jnp.int32(0)

    invalid_out[b] = (live & jnp.logical_not(ok)).astype(jnp.int32)


def accept_counts(slots, accepted, pending, drafted, *, interpret=False):
    """`gdn_jax.carry.accept`'s counter update as one launch (one program per row): returns
    (pending, drafted, invalid [B] int32); pending and drafted alias their inputs (donate them).
    slots, accepted [B] int32; pending, drafted [slots] int32."""
    for name, x in (("slots", slots), ("accepted", accepted), ("pending", pending),
                    ("drafted", drafted)):
        if getattr(x, "ndim", None) != 1 or not jnp.issubdtype(x.dtype, jnp.integer):
            raise AssertionError(f"{name} must be a 1-D int32 array, got {getattr(x, 'shape', None)}")
    _need("accepted", accepted, slots.shape)
    _need("drafted", drafted, pending.shape)
    i32 = lambda x: x.astype(jnp.int32)
    return _accept_launch(i32(slots), i32(accepted), i32(pending), i32(drafted),
                          interpret=bool(interpret))


@default_config
@functools.partial(jax.jit, static_argnames=("interpret",))
def _accept_launch(slots, accepted, pending, drafted, *, interpret):
    return pl.pallas_call(
        _accept_kernel,
        grid=(slots.shape[0],),
        out_shape=(jax.ShapeDtypeStruct(pending.shape, jnp.int32),
                   jax.ShapeDtypeStruct(drafted.shape, jnp.int32),
                   jax.ShapeDtypeStruct(slots.shape, jnp.int32)),
        input_output_aliases={2: 0, 3: 1},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="gdn_carry_accept",
    )(slots, accepted, pending, drafted)


def flush_launch(pool, stash_k, stash_u, stash_g, bank, pending, slots, *,
          block: VerifyBlockSizes | None = None, interpret=False):
    """Fold the pending rows of the named slots (slots [N] int32, -1 padding) into the pool.
    Returns the pool (aliased to its input: donate it). The caller zeroes pending after."""
    if getattr(pool, "ndim", None) != 4:
        raise AssertionError(f"pool must be [slots, HV, K, V], got {getattr(pool, 'shape', None)}")
    _, hv, kd, vd = pool.shape
    if getattr(slots, "ndim", None) != 1 or not jnp.issubdtype(slots.dtype, jnp.integer):
        raise AssertionError(f"slots must be a 1-D int32 array, got {getattr(slots, 'shape', None)}")
    per_channel = getattr(stash_g, "ndim", None) == 5
    hk = stash_k.shape[2] if getattr(stash_k, "ndim", None) == 5 else hv
    if hk <= 0 or hv % hk:
        raise AssertionError(f"stash_k has {hk} key heads; the pool's HV={hv} must be a multiple")
    spec = VerifySpec(num_k_heads=hk, num_v_heads=hv, head_k_dim=kd, head_v_dim=vd, num_tokens=1, scale=1.0,
                      per_channel_gate=per_channel, exact=True)
    _check_stash(spec, pool, stash_k, stash_u, stash_g, bank, pending)
    block = block or default_block_sizes(slots.shape[0], vd, pool.dtype, True)
    _reason_or_raise(spec, block, pool)
    return _flush_launch(pool, stash_k, stash_u, stash_g, bank.astype(jnp.int32),
                         pending.astype(jnp.int32), slots.astype(jnp.int32), spec=spec, block=block,
                         interpret=bool(interpret))


@default_config
@functools.partial(jax.jit, static_argnames=("spec", "block", "interpret"))
def _flush_launch(pool, stash_k, stash_u, stash_g, bank, pending, slots, *, spec, block, interpret):
    n = slots.shape[0]
    bank, pending = _row_counters(bank, pending, slots, pool.shape[0])
    return pl.pallas_call(
        functools.partial(_flush_kernel, spec=spec, block=block),
        grid=(n, spec.num_v_heads, spec.head_v_dim // block.block_v),
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        input_output_aliases={3: 0},
        compiler_params=_compiler_params(block),
        interpret=interpret,
        name="gdn_carry_flush",
    )(slots, bank, pending, pool, stash_k, stash_u, stash_g)
