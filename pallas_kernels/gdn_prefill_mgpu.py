"""GDN prefill in Pallas Mosaic GPU: the chunk prep, and the state scan with the state as the
tensor cores' accumulator; and KDA's chunk prep.

The same chunked form as `gdn_prefill` (see that module for the math and the Triton kernels),
for Gated DeltaNet with bf16 inputs and K = 128, written for Hopper's asynchronous tensor-core
products (wgmma) and bulk copies (TMA).

`prep`: one warpgroup per (chunk slot, value head) item forms q k^T and k k^T, the intra-chunk
matrix and A from them with the decays e^{G_i - G_j}, and T = (I + A)^-1 by the recursive
doubling of `gdn_prefill._invert_unit_lower` with fp16 operands, every product a wgmma
(`_inverse_fp16`: D L D as (D A) masked, times D); it flags the rows where fp16 may not have
held, and the launcher forms those chunks again in TF32 (`gdn_prefill._prep_redo_kernel`). Two
programs an SM take the items in turn and fetch the next item's rows while they form one
(`PREP_PROGRAMS`). The per-row values it reads (cumulative gates, beta) and the scan's row
factors come from a small Triton launch before it (`gdn_prefill._prep_rows_kernel`); with the
L2 norm the prep takes the rows' sums of squares from the diagonals of k k^T and of q q^T (a
third product) and applies the L2 factors to its products and to the scan's row factors, so q
and k get no pass of their own. A row too large to square in fp32 is tamed in shared memory
before the products (as `gdn_prefill.tame_rows` does, same bits), and the launcher then gives
the scan tamed copies of q and k. The look for such rows is a second launch, which forms again,
in place, only the items whose sums of squares pass `SUSPECT_SQUARES` (or are NaN); under
`jax.vmap` one launch looks in every item's tiles instead. Its outputs are laid by chunk slot
(row s * CHUNK + i for row i of slot s), so that no two items write the same rows (the chunks
of packed sequences may share token rows), and each is one bulk copy.

`kda_prep`: KDA's T beta, one warpgroup per (chunk slot, value head), from the Triton
intra-chunk kernel's k k^T: the same fp16 inverse as `prep`, written as T beta's bf16 halves
for `kda_scan` (`t_beta=True`); for calls whose sequences all start at multiples of CHUNK, so
that every chunk is one bulk copy of 64 token rows in and out. Without `t_beta` (for the Triton
scan, which takes the deltas as U - W S) it goes on to W = (T beta)(e^G k) and U = (T beta) v
on the tensor cores; k k^T and beta then arrive on a barrier of their own, so the inverse runs
while e^G k and v are still being copied in.

`kda_scan`: KDA's state scan, for calls whose sequences all start at multiples of CHUNK (the
Mosaic KDA prep's), one program per (sequence, value head, BV value columns) and two
warpgroups: the chain walks the state, the output warpgroup forms O = (q e^G) S + aqk D from
the halves of S and of the deltas D the chain publishes. The chain forms the deltas as `scan`
does, X = v - (e^G k) S, then D = (T beta) X. The wide form (BV = 64) holds S^T [BV, K] as the
tensor cores' accumulator, as `scan` does, and keeps every operand of the chain's products in
registers but the rows: -X^T = S^T (e^G k)^T - v^T from -v^T (S^T's halves against e^G k's),
D^T = X^T (T beta)^T, then S^T <- e^{G_C} S^T + D^T (k e^{G_C - G}) (D^T's halves against
k e^{G_C - G}'s), publishing S^T and D^T while the products run. The narrow form (BV = 32)
holds S [K, BV] as two accumulators of 64 key rows: (e^G k) S takes S from shared memory
(published first), X^T's halves go through shared memory for the second product, and the
update takes (k e^{G_C - G})^T by key blocks as register operands. There is no copy warpgroup:
each warpgroup fetches its own operands into a buffer as soon as it has read it (e^G k into
two buffers, the rest one), so the next chunk's rows arrive while the current one is formed
(`PrefillBlockSizes.mosaic_kda_scan`, the default with the Mosaic KDA prep).

`scan`: each program owns one (sequence, value head, block of BV = 64 value columns) and keeps
the transposed state slab S^T [BV, K] in fp32 registers laid out as a wgmma accumulator, so the
chunk's update `e^{G_C} S + k^T (fk D)` accumulates into it on the tensor cores.

Every product of the scan takes its fp32 side as two bf16 halves (`split_bf16`: hi
holds 8 significand bits, cut by a bit mask rather than rounded, so both halves convert in pairs;
lo the next 8, rounded) against exact bf16 rows, and products between two fp32
matrices take hi x hi + hi x lo + lo x hi: about 16 significand bits on each side, at bf16's
tensor-core rate (the Triton scan takes one-pass TF32 there, 11 bits). The prep writes T beta
already split and the row factors in one array (`[3, HV, S * C]`: q, k and e^G k factors), so
every operand arrives by one bulk copy; the intra-chunk matrix comes in fp16 where bounded by
one, and the output warpgroup splits it (half the bytes of stored halves, off the state's
chain).

Three warpgroups a program (`warp_specialized=True`), meeting at barriers in shared memory:
- the *chain* walks the state: (k S)^T = S^T k^T, X^T = v^T - fw (k S)^T, the deltas
  D^T = X^T (T beta)^T, then the update S^T <- e^{G_C} S^T + (fk D)^T k: three wgmma waits a
  chunk. It publishes the chunk's starting state and its deltas (bf16 halves) in shared memory;
- the *output* warpgroup forms O = fq (q S) + aqk D from them, untransposed (every operand from
  shared memory), and stores it by TMA while the chain goes on with the next chunk;
- the *copy* warpgroup streams the next chunks' rows into STAGES buffers.
The *narrow* form (`narrow=True`, for calls with too few (sequence, head) pairs to fill the GPU
with 64-column programs) gives each program BLOCK_V_NARROW = 32 value columns and keeps S
[K, 32] untransposed, as two accumulators of 64 key rows (wgmma's accumulators have 64 rows):
k S, the deltas D = (T beta) X and the output take their right operands (the state's, X's, the
deltas' halves) from shared memory, stored transposed ([32, .] rows of 128 bytes: wgmma takes
both shared-memory operands with one swizzle, k's), and the update S += k^T (fk D) takes k^T
by key blocks as register operands (a transposed left operand from shared memory does not
lower). Its chain publishes the state before `k S` reads it, so the published halves are
double-buffered. Its output rows are 64 bytes, and a bulk copy reads shared memory at 128-byte
aligned addresses: it takes sequences that start at even rows only.
With `warp_specialized=False` one warpgroup does all three in turn (the form the package runs
in interpret mode; with `interpret=True` the products are plain dots, as the interpreter runs no
wgmma with a register operand). The interpreter runs the warp-specialized form too, its
warpgroups concurrent, when XLA's CPU client has a thread for each: the tests run it so, in a
process of its own, and it checks the barriers as it goes. Every warpgroup that waits on a
barrier waits on each of its phases (Pallas's rule): where a warpgroup waits for the chunk
before (a stage's release, the output's read of a published buffer), it waits for the last
ones at its end (`_wait_last_phases`).

Bulk copies into swizzled shared memory take row offsets in whole 8-row tiles (`ALIGN`), so a
sequence's chunks are laid from its start rounded down to a multiple of 8 (the prep's chunk
table does the same: `gdn_prefill.chunk_table(align=ALIGN)`). The rows of a chunk that are not
its sequence's (up to 7 before its start, the next sequence's after its end, or rows past the
array, which the copies fill with zeros) are masked out of X and D; the output of such a chunk
is stored in pieces of 32, 16, ..., 1 rows so that no other sequence's rows are written. A
whole chunk's output is staged in swizzled shared memory for its bulk store, a cut chunk's in a
plain view of the same bytes (`_output_staging`): swizzled tiles give no pieces of rows.

Each kernel's last wait on its bulk stores is for their reads of shared memory only
(`wait_read_only`): the stores to global memory are complete when the kernel ends. (A full wait
also waits for them to land; in the KDA prep's SASS it ended in an L1 invalidation,
`CCTL.IVALL`, where a tenth of the kernel's stall samples sat.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gdn_decode import L2NORM_EPS, huge_rows, scale_huge_rows
from pallas_kernels.tracing import default_config

F32 = jnp.float32
BF16 = jnp.bfloat16
CHUNK = 64
HEAD_K_DIM = 128         # the only K: the state slab S^T [BV, K] and q, k rows of 256 bytes
BLOCK_V = 64             # value columns a program: wgmma's accumulators have 64 rows
BLOCK_V_NARROW = 32      # the narrow form's: S [K, 32] as two accumulators of 64 key rows
ALIGN = 8                # chunks start at multiples of this many rows
STAGES = 2               # chunks in flight in the copy warpgroup's buffers
NUM_FACTORS = 3          # row factors: q (norm * scale * e^G), k (norm * e^{G_C - G}), e^G k
FQ, FK, FW = range(NUM_FACTORS)
_COPIES = 6              # bulk copies a chunk: q, k, v, T beta, aqk, factors

__all__ = ["CHUNK", "HEAD_K_DIM", "BLOCK_V", "ALIGN", "NUM_ROW_VECTORS", "unsupported_reason",
           "scan", "prep", "kda_prep", "kda_scan"]


def unsupported_reason(*, head_k_dim: int, head_v_dim: int, dtype) -> str | None:
    """None when `scan` takes these sizes, else why not."""
    if head_k_dim != HEAD_K_DIM:
        return f"the Mosaic GPU scan takes head_k_dim={HEAD_K_DIM} only (got {head_k_dim})"
    if head_v_dim % BLOCK_V:
        return f"the Mosaic GPU scan takes head_v_dim a multiple of {BLOCK_V} (got {head_v_dim})"
    if jnp.dtype(dtype) != jnp.dtype(BF16):
        return f"the Mosaic GPU scan takes bf16 inputs (got {jnp.dtype(dtype).name})"
    return None


def split_bf16(x):
    """fp32 x as (hi, lo) bf16 halves: hi = x's top 16 bits (a bit mask: rounded toward zero,
    exact in bf16, finite wherever x is), lo = x - hi rounded; hi + lo = x to 2^-16 relative.
    hi's fp32 value is the mask itself, so no fp32 -> bf16 -> fp32 round trip: with one
    (hi = x rounded to bf16, then widened for lo) the compiler formed hi one value at a time
    (`F2F`, a quarter-rate conversion) to widen each back; here both halves convert in pairs."""
    hi = _top_half(x)
    return hi.astype(BF16), (x - hi).astype(BF16)


def _top_half(x):
    """x's top 16 bits as fp32 (`split_bf16`'s hi before its conversion)."""
    return lax.bitcast_convert_type(lax.bitcast_convert_type(x, jnp.int32) & jnp.int32(-65536), F32)


def _split_lazily(x):
    """`split_bf16(x)` as (hi, lo): lo a function that forms it when first called (the same
    value again after), so that a product can be issued on hi before lo is formed."""
    hi = _top_half(x)
    lo = []

    def get_lo():
        if not lo:
            lo.append((x - hi).astype(BF16))
        return lo[0]

    return hi.astype(BF16), get_lo


def _swizzled(shape, dtype=BF16, swizzle=128):
    """Shared memory in wgmma's operand layout: rows of `swizzle` bytes in 8-row tiles (bf16:
    8 x 64 elements for 128 bytes), swizzled."""
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle // 2)),
                                                plgpu.SwizzleTransform(swizzle)))


def _products(groups, shape, init=None, *, interpret, during=None):
    """For each group of terms, init + sum of a @ b over its terms (a: a register bf16 array, a
    function that returns one, called when its product is issued (after the terms before it),
    or a shared-memory ref; b: a shared-memory ref, or ("T", ref) for its transpose), in fp32;
    init: None (from zero) or one array a group. A term may carry a third item, before: called
    just before its product is issued (a store of an operand that this term reads first, made
    once the earlier products are issued). The terms are issued group by group, or, when any
    term carries a before, every group's first term, then every group's second, ... Compiled:
    one wgmma a term, one accumulator a group, then `during()` while they run, then one wait
    for all. Returns ([one array a group], during's result)."""
    if interpret:
        outs = [jnp.zeros(shape, F32) if init is None else init[g] for g in range(len(groups))]
        for g, a, b in _issued_terms(groups):
            a = a if isinstance(a, jax.Array) else a[...]
            b = b[1][...].T if isinstance(b, tuple) else b[...]
            outs[g] = outs[g] + jnp.dot(a.astype(F32), b.astype(F32),
                                        precision=lax.Precision.HIGHEST,
                                        preferred_element_type=F32)
        return outs, (None if during is None else during())

    def issue(*accs):
        for g, a, b in _issued_terms(groups):
            plgpu.wgmma(accs[g], a, b[1].transpose((1, 0)) if isinstance(b, tuple) else b)
        result = None if during is None else during()
        plgpu.wgmma_wait(0)
        return result

    if init is None:
        def scoped(*accs):
            result = issue(*accs)
            return [acc[...] for acc in accs], result
        return pl.run_scoped(scoped, *[plgpu.ACC(shape, F32) for _ in groups])
    # accumulators that start from init are states the products update (`run_state`), whose
    # function returns nothing: during() must not return values
    assert len(init) == len(groups)

    def update(accs):
        assert issue(*accs) is None
    return list(pl.run_state(update)(tuple(plgpu.ACC.init(x) for x in init))), None


def _issued_terms(groups):
    """`_products`' terms as (group, a, b) in issue order (each accumulator's own order kept),
    each term's before() called, and a formed if it is a function, as the term comes up."""
    if any(len(t) == 3 for terms in groups for t in terms):
        longest = max(len(terms) for terms in groups)
        order = [(g, groups[g][n]) for n in range(longest) for g in range(len(groups))
                 if n < len(groups[g])]
    else:
        order = [(g, t) for g, terms in enumerate(groups) for t in terms]
    for g, (a, b, *before) in order:
        if before:
            before[0]()
        yield g, (a() if callable(a) else a), b


def _wait_last_phases(barrier_of, count, num_chunks):
    """Waits on barrier_of(c) for the last min(num_chunks, count) chunks c: the phases that a
    warpgroup which waits on a barrier for the chunks before them would leave unobserved when
    it ends. A warpgroup that waits on any phase of a barrier waits on every one (Pallas's rule
    for barriers, which Mosaic GPU's interpreter checks); at the end of a program these waits
    hold nothing up."""
    def wait(c, carry):
        plgpu.barrier_wait(barrier_of(c))
        return carry

    lax.fori_loop(jnp.maximum(num_chunks - count, 0), num_chunks, wait, 0)


def _store_halves(ref, halves, *, interpret, commit=True, transposed=False):
    """The (hi, lo) halves into ref[0] and ref[1], or a pair of refs (transposed: x [m, n] into
    [n, m]), committed unless told otherwise."""
    for i, x in enumerate(halves):
        _store_tile(ref[i] if isinstance(ref, tuple) else ref.at[i], x, interpret=interpret,
                    transposed=transposed)
    if commit:
        plgpu.commit_smem()


def _store_tile(to, x, *, interpret, transposed=False):
    """x into the shared-memory ref `to` (transposed: x [m, n] into [n, m]), not committed."""
    if not transposed:
        to[...] = x
    elif interpret:
        to[...] = x.T
    else:
        to.transpose((1, 0))[...] = x


def _load(ref, layout, interpret):
    return ref[...] if interpret else plgpu.load(ref, layout=layout)


def _columns(vec, shape, interpret):
    """A vector indexed by the last axis of shape, broadcast over its rows."""
    if not interpret:
        vec = plgpu.layout_cast(vec, plgpu.Layout.WGMMA.reduce(0))
    return lax.broadcast_in_dim(vec, shape, (1,))


def _rows(vec, shape, interpret):
    """A vector indexed by the first axis of shape, broadcast over its columns."""
    if not interpret:
        vec = plgpu.layout_cast(vec, plgpu.Layout.WGMMA.reduce(1))
    return lax.broadcast_in_dim(vec, shape, (0,))


def _spread_vector(ref, axis, shape, interpret):
    """The vector in shared memory ref, broadcast along axis of a [C, C] tile in wgmma's layout:
    loaded in the layout the broadcast takes. Each layout needs its own copy of a vector in
    shared memory (loads of one ref in two layouts leave layout inference without a solution)."""
    layout = None if interpret else plgpu.Layout.WGMMA.reduce(1 - axis)
    x = lax.broadcast_in_dim(_load(ref, layout, interpret), shape, (axis,))
    return x if interpret else plgpu.layout_cast(x, plgpu.Layout.WGMMA)


def _minus_product(x, acc, factor):
    """x - acc * factor, for acc a product's accumulator, as x + acc * (-factor) (the same bits:
    one fma either way). Written as x - acc * factor, LLVM negates acc's registers and may place
    the negation above the product's wait; ptxas then waits for the product there, before the
    loads meant to run under it (BENCHMARKS.md, GDN prefill: the scan's ablations)."""
    return x + acc * (-factor)


def _iota(shape, axis, interpret):
    x = lax.broadcasted_iota(jnp.int32, shape, axis)
    return x if interpret else plgpu.layout_cast(x, plgpu.Layout.WGMMA)


def _copy_rows(refs, use_tamed, at, dst, bar):
    """Bulk copy of the q or k rows refs[.][at] into dst: from the launcher's tamed copy refs[1]
    when the call holds a huge row (use_tamed), else from the rows as given, refs[0] (the tamed
    copy is then left unwritten: the common case reads and writes no copy of q and k)."""
    raw, tamed = refs

    @pl.when(use_tamed)
    def _():
        plgpu.copy_gmem_to_smem(tamed.at[at], dst, bar)

    @pl.when(jnp.logical_not(use_tamed))
    def _():
        plgpu.copy_gmem_to_smem(raw.at[at], dst, bar)


def _tamed_or_given(q, k, tamed):
    """The (q_tamed, k_tamed, use_tamed [1] int32) operands of `scan`: `tamed` as
    the launcher gives it, or the rows themselves with use_tamed 0."""
    return tamed if tamed is not None else (q, k, jnp.zeros((1,), jnp.int32))


def _launch(kernel, *, out_type, scratch, num_programs: int, name: str, interpret: bool,
            num_threads: int = 1, approx_math: bool = False):
    """The call of a kernel of this module: num_programs programs on a 1-D grid "p", each of
    num_threads warpgroups ("wg"), Mosaic GPU's interpreter with interpret; precise math
    unless approx_math (exp as `ex2.approx.ftz` of x log2 e, rsqrt without the subnormal
    path)."""
    extra = {"interpret": plgpu.InterpretGPUParams()} if interpret else {}
    return plgpu.kernel(kernel, out_type=out_type, scratch_types=scratch, grid=(num_programs,),
                        grid_names=("p",), num_threads=num_threads, thread_name="wg",
                        kernel_name=name,
                        compiler_params=plgpu.CompilerParams(approx_math=approx_math),
                        **extra)


def _output_staging(block_v: int):
    """Shared memory for a program's output [2, C, block_v] bf16, in two views of the same
    bytes: swizzled (rows of 2 * block_v bytes, as a bulk copy with that swizzle reads them) and
    plain. Stored from wgmma's layout, a warp's 4-byte pairs share columns, so in the plain view
    they fall on a few banks of the shared memory the chain's products read; the swizzled view
    spreads them (a few percent of the narrow scan's time, none of the wide one's: BENCHMARKS.md).
    A chunk cut by a sequence's end goes out in row pieces, which tiled shared memory cannot
    give: it takes the plain view."""
    return plgpu.RefUnion(_swizzled((2, CHUNK, block_v), swizzle=2 * block_v),
                          plgpu.SMEM((2, CHUNK, block_v), BF16))


def _store_output(o_ref, o_s, o, c, t0, bos, eos, h, cols):
    """o [C, BV] into the output rows of chunk c (from token t0) that are its sequence's
    [bos, eos), through o_s = (swizzled, plain) [2, C, BV] views (`_output_staging`), buffer
    c % 2."""
    C, buf = CHUNK, c % 2
    swizzled, plain = o_s
    plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # this buffer's last store read
    lo, hi = jnp.maximum(bos - t0, 0), jnp.minimum(eos - t0, C)
    num_rows = hi - lo

    @pl.when(num_rows == C)
    def _():
        swizzled[buf] = o
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(swizzled.at[buf], o_ref.at[pl.ds(t0, C), h, cols])

    @pl.when(num_rows < C)
    def _():
        plain[buf] = o
        plgpu.commit_smem()
        # the sequence's own rows only, in pieces of 32, 16, ..., 1 rows (a copy's size is
        # static): the rows before and after them are other sequences'. A bulk copy reads
        # shared memory at 128-byte aligned addresses: the narrow form's rows are 64 bytes,
        # so it takes sequences that start at even rows only (then every piece does)
        done = lo
        size = C // 2
        while size:
            @pl.when(num_rows & size != 0)
            def _(done=done, size=size):
                plgpu.copy_smem_to_gmem(plain.at[buf, pl.ds(done, size)],
                                        o_ref.at[pl.ds(t0 + done, size), h, cols])
            done = done + (num_rows & size)
            size //= 2


class _StateSlab:
    """A program's slab of the state in global memory, through its staging buffer state_s:
    S^T [BV, K] of the transposed states [N, HV, V, K] (wide), or S [K, BV] held as two
    accumulators of K // 2 key rows (narrow)."""

    def __init__(self, h0_ref, hT_ref, state_s, h0_bar, n, h, cols, *, narrow, interpret):
        at = (n, h, slice(None), cols) if narrow else (n, h, cols, slice(None))
        self.initial_gmem, self.final_gmem = h0_ref.at[at], hT_ref.at[at]
        self.state_s, self.h0_bar, self.narrow, self.interpret = state_s, h0_bar, narrow, interpret
        K = HEAD_K_DIM
        self.halves_of_k = (pl.ds(0, K // 2), pl.ds(K // 2, K // 2))
        self.shape = (K // 2, cols.size) if narrow else (cols.size, K)

    def initial(self, has_initial_state: bool, then_commit: bool = False):
        """The state's starting value (zeros without has_initial_state); then_commit: its
        reads of state_s committed before the caller's bulk copies overwrite it."""
        interpret, layout = self.interpret, None if self.interpret else plgpu.Layout.WGMMA
        if not has_initial_state:
            zero = jnp.zeros(self.shape, F32)
            zero = zero if interpret else plgpu.layout_cast(zero, plgpu.Layout.WGMMA)
            return (zero, zero) if self.narrow else zero
        plgpu.copy_gmem_to_smem(self.initial_gmem, self.state_s, self.h0_bar)
        plgpu.barrier_wait(self.h0_bar)
        if self.narrow:
            S = tuple(_load(self.state_s.at[r], layout, interpret) for r in self.halves_of_k)
        else:
            S = _load(self.state_s, layout, interpret)
        if then_commit:
            plgpu.commit_smem()
        return S

    def store_final(self, S):
        if self.narrow:
            for r, Sb in zip(self.halves_of_k, S):
                self.state_s[r] = Sb
        else:
            self.state_s[...] = S
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(self.state_s, self.final_gmem)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _keeper(valid):
    """x -> x where valid, 0 elsewhere (a select, so that NaN outside stays out); the
    identity for valid None (every element kept: no select, no predicates held)."""
    if valid is None:
        return lambda x: x
    return lambda x: jnp.where(valid, x, 0.0)


def _over_chunks(step, carry, num_chunks, unmasked_from, unmasked_to):
    """lax.fori_loop of step(c, carry, masked=...) over chunks 0 .. num_chunks - 1, masked
    statically: the chunks in [unmasked_from, unmasked_to) take the step without masks, the
    others (a sequence's edge chunks, whose windows can hold other rows) the masked one. The
    selects and the predicate bits they keep are a large part of a chain's instructions
    (BENCHMARKS.md, GDN prefill). unmasked_from a Python 0: no loop before (no second copy of
    the masked step)."""
    masked, unmasked = (functools.partial(step, masked=m) for m in (True, False))
    if not (isinstance(unmasked_from, int) and unmasked_from == 0):
        carry = lax.fori_loop(0, unmasked_from, masked, carry)
    carry = lax.fori_loop(unmasked_from, unmasked_to, unmasked, carry)
    return lax.fori_loop(unmasked_to, num_chunks, masked, carry)


def _store_zero_outputs(store_output, num_chunks, shape, dtype, interpret):
    """store_output(c, zeros) for chunks 0 .. num_chunks - 1 (a sequence nobody walks)."""
    zeros = jnp.zeros(shape, dtype)
    if not interpret:
        zeros = plgpu.layout_cast(zeros, plgpu.Layout.WGMMA)

    def step(c, carry):
        store_output(c, zeros)
        return carry

    lax.fori_loop(0, num_chunks, step, 0)


def _kernel(cu_ref, order_ref, first_ref, live_ref, decay_ref, q_ref, k_ref, qt_ref, kt_ref,
            tamed_ref, v_ref, tb_ref, aqk_ref, fac_ref, h0_ref, o_ref, hT_ref, q_s, k_s, v_s,
            tb_s, aqk_s, fac_s, aqk_h, pub, o_s, loaded, consumed, published, out_done, h0_bar,
            *, num_v_heads: int, num_k_heads: int, head_v_dim: int, has_initial_state: bool,
            narrow: bool, warp_specialized: bool, interpret: bool):
    C, K = CHUNK, HEAD_K_DIM
    BV = BLOCK_V_NARROW if narrow else BLOCK_V
    # the state's and deltas' halves for the output warpgroup: double-buffered in the narrow
    # form (its chain publishes the state before `k S` reads it, so with one buffer it would
    # wait there for the output of the chunk before)
    NB = 2 if narrow else 1
    nv = head_v_dim // BV
    p = lax.axis_index("p")
    jv, h = p % nv, (p // nv) % num_v_heads
    n = order_ref[p // (nv * num_v_heads)]
    hk = h // (num_v_heads // num_k_heads)
    bos, eos = cu_ref[n], cu_ref[n + 1]
    # the chunks are laid from the start rounded down to whole 8-row tiles (`ALIGN`)
    base = bos - lax.rem(bos, ALIGN)
    span_chunks = jnp.where(eos > bos, (eos - base + C - 1) // C, 0)
    # a sequence that is not live (a padding pool slot) is walked by no one: its output rows
    # are stored as zeros
    live = live_ref[n] != 0
    num_chunks = jnp.where(live, span_chunks, 0)
    zero_chunks = span_chunks - num_chunks
    first = first_ref[n]
    use_tamed = tamed_ref[0] != 0
    cols = pl.ds(pl.multiple_of(jv * BV, BV), BV)
    if narrow:
        (s_pubs, d_pubs), ((x_pub, u_pub), state_s) = pub
        s_pub, d_pub = (lambda buf: s_pubs.at[buf]), (lambda buf: d_pubs.at[buf])
    else:
        (s_one, d_one), state_s = pub
        s_pub, d_pub = (lambda buf: s_one), (lambda buf: d_one)
    wgmma_layout = None if interpret else plgpu.Layout.WGMMA
    # the token index of the chain's tiles: S^T's form holds tokens on columns, S's on rows
    tok_index = _iota((C, BV), 0, interpret) if narrow else _iota((BV, C), 1, interpret)

    def chunk_start(c):
        return pl.multiple_of(base + c * C, ALIGN)

    def in_sequence(index, c):
        """Whether the rows (or columns) `index` of chunk c's window are this sequence's
        tokens: the window starts at a whole tile, so it may begin before the sequence, and it
        may run past its end into the next one."""
        t0 = chunk_start(c)
        return (index >= bos - t0) & (index < eos - t0)

    def fetch(c):
        """The copy warpgroup's work for chunk c: its rows into stage c % STAGES."""
        slot, t0 = c % STAGES, chunk_start(c)
        tok, bar = pl.ds(t0, C), loaded.at[slot]
        # the prep's rows are by chunk slot (`prep`)
        at = pl.ds(pl.multiple_of((first + c) * C, C), C)
        _copy_rows((k_ref, kt_ref), use_tamed, (tok, hk), k_s.at[slot], bar)
        plgpu.copy_gmem_to_smem(v_ref.at[tok, h, cols], v_s.at[slot], bar)
        plgpu.copy_gmem_to_smem(tb_ref.at[:, at, h, :], tb_s.at[slot], bar)
        plgpu.copy_gmem_to_smem(fac_ref.at[:, h, at], fac_s.at[slot], bar)
        _copy_rows((q_ref, qt_ref), use_tamed, (tok, hk), q_s.at[slot], bar)
        plgpu.copy_gmem_to_smem(aqk_ref.at[at, h, :], aqk_s.at[slot], bar)

    def wait_output_done(c):
        """Before the chain publishes into buffer c % NB: the output warpgroup is done with what
        it read there for chunk c - NB."""
        if warp_specialized:
            @pl.when(c >= NB)
            def _():
                plgpu.barrier_wait(out_done.at[c % NB])

    def chunk_decay(c):
        """e^{G_C} of chunk c: a global load (the slot index clamped into the array, so that
        the load a chunk ahead of the last one stays in bounds)."""
        return decay_ref[jnp.minimum(first + c, decay_ref.shape[0] - 1), h]

    def zero_other_rows(c, slot):
        """The chain's k rows of chunk c that are not its sequence's (the rows before its
        start in the chunk's window, the next sequence's after its end) zeroed in shared memory
        before `k S` and the update read them: they may hold anything, NaN too, which the
        masked X and u (zeros there) would keep in a product. The masked steps' work."""
        rows = _iota((C, K), 0, interpret)
        x = _load(k_s.at[slot], wgmma_layout, interpret)
        k_s.at[slot][...] = jnp.where(in_sequence(rows, c), x, jnp.zeros_like(x))
        plgpu.commit_smem()

    def holds_other_rows(c):
        """Whether chunk c's window holds rows that are not this sequence's. Only the first
        chunk (its window starts at the whole tile below bos) and the last (it may run past
        eos) can."""
        t0 = chunk_start(c)
        return (bos > t0) | (eos < t0 + C)

    def over_chunks(step, carry):
        """`_over_chunks`: the chunks whose windows hold other rows (at most the first and the
        last) take the masked step."""
        front = jnp.where((num_chunks > 0) & holds_other_rows(0), 1, 0)
        last = num_chunks - 1
        back = jnp.where((last >= front) & holds_other_rows(last), last, num_chunks)
        return _over_chunks(step, carry, num_chunks, front, back)

    def chain_step_transposed(c, S, decay, masked):
        """The state's walk over chunk c, S^T [BV, K] (one accumulator), decay its e^{G_C}:
        publishes S and the deltas, returns the next S. masked: the window holds other rows
        (`holds_other_rows`), which the step zeroes and selects away."""
        slot = c % STAGES
        keep = _keeper(in_sequence(tok_index, c) if masked else None)
        fac = fac_s.at[slot]
        if masked:
            zero_other_rows(c, slot)
        # each product's lo halves formed after its hi products are issued (`_split_lazily`)
        s_hi, s_lo = _split_lazily(S)

        def publish_state_and_load():
            # while (k S)^T runs: the chunk's starting state for the output warpgroup (once it
            # is done with the previous chunk's; committed with the deltas, before the output
            # warpgroup is told), and the loads the next steps take
            wait_output_done(c)
            _store_halves(s_pub(0), (s_hi, s_lo()), interpret=interpret, commit=False)
            v_t = _load(v_s.at[slot].transpose((1, 0)) if not interpret else v_s.at[slot],
                        wgmma_layout, interpret)
            fw = _load(fac.at[FW], None, interpret)
            return v_t.T if interpret else v_t, fw

        (ks,), (v_t, fw) = _products([[(s_hi, ("T", k_s.at[slot])),
                                        (s_lo, ("T", k_s.at[slot]))]], (BV, C),
                                      interpret=interpret, during=publish_state_and_load)
        x = keep(_minus_product(v_t.astype(F32), ks, _columns(fw, (BV, C), interpret)))
        x_hi, x_lo = _split_lazily(x)
        tb_hi, tb_lo = ("T", tb_s.at[slot, 0]), ("T", tb_s.at[slot, 1])
        # D^T; while it runs, the k factors and the decayed state the update starts from
        (d,), (fk, S_decayed) = _products([[(x_hi, tb_hi), (x_hi, tb_lo), (x_lo, tb_hi)]],
                                          (BV, C), interpret=interpret,
                                          during=lambda: (_load(fac.at[FK], None, interpret),
                                                          S * decay))
        d = keep(d)
        # selected, not a product with the masked d: the factors past the sequence may be
        # anything
        u_hi, u_lo = _split_lazily(keep(d * _columns(fk, (BV, C), interpret)))

        def publish_deltas():
            # the deltas, while the update runs; then the output warpgroup may start
            _store_halves(d_pub(0), split_bf16(d), interpret=interpret)
            if warp_specialized:
                plgpu.barrier_arrive(published.at[0])

        (S,), _ = _products([[(u_hi, k_s.at[slot]), (u_lo, k_s.at[slot])]], (BV, K),
                            [S_decayed], interpret=interpret, during=publish_deltas)
        return S

    def chain_step_narrow(c, S, decay, masked):
        """The state's walk over chunk c, S [K, BV] as two accumulators of 64 key rows, decay
        its e^{G_C}: publishes S and the deltas, returns the next S. Every right operand goes
        through shared memory transposed ([BV, .] rows of 128 bytes: wgmma takes both
        shared-memory operands with one swizzle, k's). masked: as `chain_step_transposed`."""
        slot, buf = c % STAGES, c % NB
        KB = K // 2
        keep = _keeper(in_sequence(tok_index, c) if masked else None)
        fac = fac_s.at[slot]
        if masked:
            zero_other_rows(c, slot)
        wait_output_done(c)
        for b, Sb in enumerate(S):
            _store_halves(s_pub(buf).at[:, :, pl.ds(b * KB, KB)], split_bf16(Sb),
                          interpret=interpret, commit=False, transposed=True)
        plgpu.commit_smem()

        def loads():
            v = _load(v_s.at[slot], wgmma_layout, interpret)
            return v, _load(fac.at[FW], None, interpret)

        (ks,), (v, fw) = _products([[(k_s.at[slot], ("T", s_pub(buf).at[0])),
                                     (k_s.at[slot], ("T", s_pub(buf).at[1]))]], (C, BV),
                                   interpret=interpret, during=loads)
        x = keep(_minus_product(v.astype(F32), ks, _rows(fw, (C, BV), interpret)))
        _store_halves(x_pub, split_bf16(x), interpret=interpret, transposed=True)

        def work_for_update():
            # k^T by key blocks, as register operands (a transposed left operand from shared
            # memory does not lower), and the decayed state the update starts from
            kt = [_load(k_s.at[slot, :, pl.ds(b * KB, KB)].transpose((1, 0))
                        if not interpret else k_s.at[slot, :, pl.ds(b * KB, KB)],
                        wgmma_layout, interpret) for b in range(2)]
            kt = [t.T for t in kt] if interpret else kt
            return _load(fac.at[FK], None, interpret), kt, [Sb * decay for Sb in S]

        tb_hi, tb_lo = tb_s.at[slot, 0], tb_s.at[slot, 1]
        x_hi, x_lo = ("T", x_pub[0]), ("T", x_pub[1])
        (d,), (fk, kt, S_decayed) = _products([[(tb_hi, x_hi), (tb_hi, x_lo), (tb_lo, x_hi)]],
                                              (C, BV), interpret=interpret,
                                              during=work_for_update)
        d = keep(d)
        u = keep(d * _rows(fk, (C, BV), interpret))
        _store_halves(u_pub, split_bf16(u), interpret=interpret, transposed=True)

        def publish_deltas():
            # the deltas for the output warpgroup while the update runs (off the chain's path)
            _store_halves(d_pub(buf), split_bf16(d), interpret=interpret,
                          transposed=True)
            if warp_specialized:
                plgpu.barrier_arrive(published.at[buf])

        u_hi, u_lo = ("T", u_pub[0]), ("T", u_pub[1])
        S, _ = _products([[(kt[0], u_hi), (kt[0], u_lo)], [(kt[1], u_hi), (kt[1], u_lo)]],
                         (KB, BV), S_decayed, interpret=interpret, during=publish_deltas)
        return tuple(S)

    def chain_step(c, S, decay, masked):
        S = (chain_step_narrow if narrow else chain_step_transposed)(c, S, decay, masked)
        if warp_specialized:
            plgpu.barrier_arrive(consumed.at[c % STAGES])
        return S

    def output_step(c):
        """The output of chunk c from the halves the chain published: O = fq (q S) + aqk D."""
        slot, buf = c % STAGES, c % NB
        # the intra-chunk matrix (fp16 where bounded by one, else fp32: the prep's) as bf16
        # halves, while the chain is still on this chunk's deltas
        aqk = _load(aqk_s.at[slot], wgmma_layout, interpret).astype(F32)
        _store_halves(aqk_h, split_bf16(aqk), interpret=interpret)
        if warp_specialized:
            plgpu.barrier_wait(published.at[buf])
        s_at, d_at = s_pub(buf), d_pub(buf)
        (qs, ad), fq = _products(
            [[(q_s.at[slot], ("T", s_at.at[0])), (q_s.at[slot], ("T", s_at.at[1]))],
             [(aqk_h.at[0], ("T", d_at.at[0])), (aqk_h.at[0], ("T", d_at.at[1])),
              (aqk_h.at[1], ("T", d_at.at[0]))]], (C, BV), interpret=interpret,
            during=lambda: _load(fac_s.at[slot, FQ], None, interpret))
        fq = _rows(fq, (C, BV), interpret)
        if warp_specialized:
            plgpu.barrier_arrive(out_done.at[buf])
            plgpu.barrier_arrive(consumed.at[slot])
        store_output(c, (qs * fq + ad).astype(o_ref.dtype))

    def store_output(c, o):
        _store_output(o_ref, o_s, o, c, chunk_start(c), bos, eos, h, cols)

    slab = _StateSlab(h0_ref, hT_ref, state_s, h0_bar, n, h, cols, narrow=narrow,
                      interpret=interpret)
    initial_state = functools.partial(slab.initial, has_initial_state)
    store_final = slab.store_final

    def store_zeros():
        _store_zero_outputs(store_output, zero_chunks, (C, BV), o_ref.dtype, interpret)

    if not warp_specialized:
        def step(c, S, masked):
            fetch(c)
            plgpu.barrier_wait(loaded.at[c % STAGES])
            S2 = chain_step(c, S, chunk_decay(c), masked)
            output_step(c)
            return S2

        S = over_chunks(step, initial_state())
        store_zeros()
        store_final(S)  # its wait covers the output stores too
        return

    wg = lax.axis_index("wg")

    # registers: the chain and the output warpgroups take what the copy warpgroup does not need
    # (three warpgroups would otherwise get 168 registers a thread each)
    @pl.when(wg == 0)
    def _chain():
        plgpu.set_max_registers(232, action="increase")
        S = initial_state()

        def step(c, carry, masked):
            # e^{G_C} is loaded a chunk ahead: loaded in the chunk that uses it, its latency
            # (an L2 round trip) sat on the chain's path, where the compiler had placed the
            # state's scaling right after the load (BENCHMARKS.md, GDN prefill)
            S, decay = carry
            next_decay = chunk_decay(c + 1)
            plgpu.barrier_wait(loaded.at[c % STAGES])
            return chain_step(c, S, decay, masked), next_decay

        S, _ = over_chunks(step, (S, chunk_decay(0)))
        last_outputs_done = functools.partial(
            _wait_last_phases, lambda c: out_done.at[c % NB], NB, num_chunks)
        if not narrow:
            last_outputs_done()   # the published halves share memory with state_s
        store_final(S)
        if narrow:
            last_outputs_done()   # (after the final state's store, which does not need them)

    @pl.when(wg == 1)
    def _output():
        plgpu.set_max_registers(232, action="increase")
        def step(c, carry):
            plgpu.barrier_wait(loaded.at[c % STAGES])
            output_step(c)
            return carry

        lax.fori_loop(0, num_chunks, step, 0)
        store_zeros()
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @pl.when(wg == 2)
    def _copies():
        plgpu.set_max_registers(40, action="decrease")
        def step(c, carry):
            @pl.when(c >= STAGES)
            def _():
                plgpu.barrier_wait(consumed.at[c % STAGES])
            fetch(c)
            return carry

        lax.fori_loop(0, num_chunks, step, 0)
        _wait_last_phases(lambda c: consumed.at[c % STAGES], STAGES, num_chunks)


@default_config
def scan(cu, order, first, live, decay, q, k, v, tb, aqk, factors, h0, *, num_v_heads: int,
         num_k_heads: int, has_initial_state: bool, narrow: bool = False,
         tamed=None, warp_specialized: bool = True, interpret: bool = False):
    """The scan over packed sequences, each one's chunks from its start rounded down to ALIGN.

    cu [N + 1], order [N] (the sequences' launch order), first [N] (each sequence's first chunk
    slot), live [N] int32 (0: a sequence nobody walks, whose output rows are zeros), decay
    [S, HV] (e^{G_C} per chunk slot); q, k [T, HK, 128], v [T, HV, V] bf16 (T a multiple of
    ALIGN); by chunk slot (row s * CHUNK + i for row i of slot s, as `prep` writes them): tb
    [2, S * C, HV, C] bf16, T beta's halves, aqk [S * C, HV, C] fp16 or fp32, the intra-chunk
    matrix (the output warpgroup splits it), factors [3, HV, S * C] fp32 (FQ, FK, FW).
    narrow: programs of BLOCK_V_NARROW value columns holding S [K, BV] (twice the programs;
    the states h0 [N, HV, K, V] and the final states as they are), else of BLOCK_V holding
    S^T [BV, K] (h0 [N, HV, V, K] and the final states *transposed*); h0 may be a placeholder
    without has_initial_state.
    tamed: (q_tamed, k_tamed, use_tamed [1] int32): q and k with their huge rows tamed, read
    instead of q and k where use_tamed is not 0 (and unread, may be unwritten, where it is 0).
    Returns (o [T, HV, V] bf16, final states [N, HV, K, V] (narrow) or [N, HV, V, K], fp32)."""
    T, HV, V = v.shape
    N = cu.shape[0] - 1
    K = HEAD_K_DIM
    BV = BLOCK_V_NARROW if narrow else BLOCK_V
    nv = V // BV
    stage = lambda *shape: _swizzled((STAGES,) + shape)
    if narrow:
        # S^T and D^T halves in two buffers; X^T and U^T halves (the chain's own), which share
        # memory with the state's staging. Each half of X^T and U^T is a ref of its own: a ref
        # indexed by a constant inside the update (`run_state`) becomes an operand of it, and
        # its lowering fails to return such an operand.
        pair = lambda: (_swizzled((BV, CHUNK)), _swizzled((BV, CHUNK)))
        pub = ((_swizzled((2, 2, BV, K)), _swizzled((2, 2, BV, CHUNK))),
               plgpu.RefUnion((pair(), pair()), plgpu.SMEM((K, BV), F32)))
        v_stage = _swizzled((STAGES, CHUNK, BV), swizzle=64)
    else:
        pub = plgpu.RefUnion(
            (_swizzled((2, BV, K)), _swizzled((2, BV, CHUNK))),  # S^T and D^T halves
            plgpu.SMEM((BV, K), F32))                            # state staging
        v_stage = stage(CHUNK, BV)
    scratch = (stage(CHUNK, K), stage(CHUNK, K), v_stage, stage(2, CHUNK, CHUNK),
               plgpu.SMEM((STAGES, CHUNK, CHUNK), aqk.dtype),
               plgpu.SMEM((STAGES, NUM_FACTORS, CHUNK), F32),
               _swizzled((2, CHUNK, CHUNK)),                           # aqk's halves
               pub,
               _output_staging(BV),
               plgpu.Barrier(num_arrivals=_COPIES, num_barriers=STAGES),
               plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),
               plgpu.Barrier(num_barriers=2 if narrow else 1),        # published
               plgpu.Barrier(num_barriers=2 if narrow else 1),        # out_done
               plgpu.Barrier())
    kernel = functools.partial(_kernel, num_v_heads=HV, num_k_heads=num_k_heads, head_v_dim=V,
                               has_initial_state=has_initial_state, narrow=narrow,
                               warp_specialized=warp_specialized, interpret=interpret)
    state_shape = (N, HV, K, V) if narrow else (N, HV, V, K)
    return _launch(
        kernel,
        out_type=(jax.ShapeDtypeStruct((T, HV, V), v.dtype),
                  jax.ShapeDtypeStruct(state_shape, F32)),
        scratch=scratch, num_programs=N * HV * nv, name="gdn_prefill_mgpu_scan",
        num_threads=3 if warp_specialized else 1, interpret=interpret,
    )(cu, order, first, live, decay, q, k, *_tamed_or_given(q, k, tamed), v, tb, aqk, factors,
      h0)


# --------------------------------------------------------------------------- KDA's state scan

_KDA_SCAN_PUBLISH = 2    # the chain's publications a chunk: S^T's halves, then D^T's


def _kda_scan_kernel(cu_ref, order_ref, first_ref, live_ref, decay_ref, qd_ref, kd_ref, ek_ref,
                     v_ref, tb_ref, aqk_ref, h0_ref, o_ref, hT_ref, ek_union, v_s, kd_s, decay_s,
                     qd_s, aqk_s, s_pub, d_pub, o_s, ek_loaded, v_loaded, kd_loaded, q_loaded,
                     aqk_loaded, published, read, h0_bar, tb_s, tb_loaded, x_pub, *,
                     num_v_heads: int, head_v_dim: int, has_initial_state: bool, narrow: bool,
                     warp_specialized: bool, interpret: bool):
    C, K = CHUNK, HEAD_K_DIM
    BV = BLOCK_V_NARROW if narrow else BLOCK_V
    KB = K // 2      # the narrow form's key blocks: S [K, BV] as two accumulators of 64 rows
    nv = head_v_dim // BV
    p = lax.axis_index("p")
    jv, h = p % nv, (p // nv) % num_v_heads
    n = order_ref[p // (nv * num_v_heads)]
    bos, eos = cu_ref[n], cu_ref[n + 1]
    span_chunks = jnp.where(eos > bos, (eos - bos + C - 1) // C, 0)
    live = live_ref[n] != 0
    num_chunks = jnp.where(live, span_chunks, 0)
    zero_chunks = span_chunks - num_chunks
    first = first_ref[n]
    cols = pl.ds(pl.multiple_of(jv * BV, BV), BV)
    ek_s, state_s = ek_union
    wgmma_layout = None if interpret else plgpu.Layout.WGMMA
    # the token index of the chain's tiles: D^T's form holds tokens on columns, D's on rows
    tok_index = _iota((C, BV), 0, interpret) if narrow else _iota((BV, C), 1, interpret)
    S_PUB, D_PUB = range(_KDA_SCAN_PUBLISH)

    def chunk_start(c):
        # every sequence starts at a multiple of CHUNK (the launcher's condition)
        return pl.multiple_of(bos + c * C, C)

    def over_chunks(step, carry):
        """`_over_chunks`: only the last chunk can run past the sequence's end, and only it
        takes the masked step."""
        last = num_chunks - 1
        back = jnp.where((last >= 0) & (eos < chunk_start(last) + C), last, num_chunks)
        return _over_chunks(step, carry, num_chunks, 0, back)

    def rows(c):
        return pl.ds(chunk_start(c), C)

    # Each warpgroup fetches its own operands, into buffers it has finished reading: the chain
    # e^G k's halves (two buffers: the next chunk's arrive while this one is formed), v, T
    # beta's halves, the decayed k rows' halves and e^{G_C}; the output warpgroup the decayed q
    # rows and the intra-chunk matrix.
    # (one copy a half: a bulk copy takes at most 5 strided dims)
    def fetch_ek(c):
        for part in range(2):
            plgpu.copy_gmem_to_smem(ek_ref.at[part, rows(c), h, :], ek_s.at[c % 2, part],
                                    ek_loaded.at[c % 2])

    def fetch_v(c):
        plgpu.copy_gmem_to_smem(v_ref.at[rows(c), h, cols], v_s, v_loaded)

    def fetch_tb(c):
        plgpu.copy_gmem_to_smem(tb_ref.at[:, rows(c), h, :], tb_s, tb_loaded)

    def fetch_kd(c):
        for part in range(2):
            plgpu.copy_gmem_to_smem(kd_ref.at[part, rows(c), h, :], kd_s.at[part], kd_loaded)
        plgpu.copy_gmem_to_smem(decay_ref.at[first + c, h], decay_s, kd_loaded)

    def fetch_q(c):
        plgpu.copy_gmem_to_smem(qd_ref.at[rows(c), h, :], qd_s, q_loaded)

    def fetch_aqk(c):
        plgpu.copy_gmem_to_smem(aqk_ref.at[rows(c), h, :], aqk_s, aqk_loaded)

    def refill(fetch, c):
        """fetch(c) if chunk c exists, after this warpgroup's reads of the buffer (committed:
        ordered before the bulk copy that overwrites it). The chain refills while a later
        product runs (`_products`' during), off its path: a commit is a fence and a warpgroup
        barrier."""
        if not warp_specialized:
            return
        plgpu.commit_smem()

        @pl.when(c < num_chunks)
        def _():
            fetch(c)

    def wait_read(c, what):
        """Before the chain publishes what for chunk c: the output warpgroup is done with it
        for chunk c - 1."""
        if warp_specialized:
            @pl.when(c >= 1)
            def _():
                plgpu.barrier_wait(read.at[what])

    def publish(what):
        if warp_specialized:
            plgpu.barrier_arrive(published.at[what])

    def traced_halves(c):
        """(0, 1) as traced values: a ref indexed by a constant inside a product that updates an
        accumulator (`_products` with init) becomes an operand of its `run_state`, whose
        lowering fails to return it."""
        lo = c - c + 1
        return lo - 1, lo

    def transposed_tile(ref):
        """ref's [C, BV] tile as a [BV, C] register array."""
        x = _load(ref if interpret else ref.transpose((1, 0)), wgmma_layout, interpret)
        return x.T if interpret else x

    def chain_step_wide(c, S, masked):
        """Chunk c on S^T [BV, K] (one accumulator), every operand of the chain's products in
        registers but the rows: -X^T = S^T (e^G k)^T - v^T from -v^T (S^T's halves against
        e^G k's), D^T = X^T (T beta)^T (X^T's halves against T beta's), then
        S^T <- e^{G_C} S^T + D^T (k e^{G_C - G}) (D^T's halves against k's). S^T's halves and
        D^T's are published while the products run. masked: the chunk runs past the
        sequence's end (`over_chunks`), whose columns are selected away."""
        ebuf = c % 2
        hi, lo = traced_halves(c)
        keep = _keeper(tok_index < eos - chunk_start(c) if masked else None)
        plgpu.barrier_wait(ek_loaded.at[ebuf])
        plgpu.barrier_wait(v_loaded)
        s_hi, s_lo = split_bf16(S)
        neg_v_t = -transposed_tile(v_s).astype(F32)
        wait_read(c, S_PUB)

        def publish_state():
            _store_halves(s_pub, (s_hi, s_lo), interpret=interpret)
            publish(S_PUB)
            refill(fetch_v, c + 1)

        ek_hi, ek_lo = ("T", ek_s.at[ebuf, hi]), ("T", ek_s.at[ebuf, lo])
        (acc,), _ = _products([[(s_hi, ek_hi), (s_lo, ek_hi), (s_hi, ek_lo)]], (BV, C),
                              [neg_v_t], interpret=interpret, during=publish_state)
        x_hi, x_lo = split_bf16(keep(-acc))
        plgpu.barrier_wait(tb_loaded)
        tb_hi, tb_lo = ("T", tb_s.at[0]), ("T", tb_s.at[1])
        (d_t,), _ = _products([[(x_hi, tb_hi), (x_hi, tb_lo), (x_lo, tb_hi)]], (BV, C),
                              interpret=interpret, during=lambda: refill(fetch_ek, c + 2))
        d_hi, d_lo = split_bf16(keep(d_t))
        plgpu.barrier_wait(kd_loaded)
        decay = _columns(_load(decay_s, None, interpret), (BV, K), interpret)
        wait_read(c, D_PUB)

        def publish_deltas():
            _store_halves(d_pub, (d_hi, d_lo), interpret=interpret)
            publish(D_PUB)
            refill(fetch_tb, c + 1)

        (S,), _ = _products([[(d_hi, kd_s.at[hi]), (d_hi, kd_s.at[lo]), (d_lo, kd_s.at[hi])]],
                            (BV, K), [S * decay], interpret=interpret, during=publish_deltas)
        refill(fetch_kd, c + 1)
        return S

    def chain_step_narrow(c, S, masked):
        """Chunk c on S [K, BV] as two accumulators of KB key rows: S^T's halves published
        first ((e^G k) S takes S from shared memory), -X = (e^G k) S - v from -v, X^T's halves
        through shared memory for D = (T beta) X, D^T's halves published, then
        S <- e^{G_C} S + (k e^{G_C - G})^T D, with (k e^{G_C - G})^T by key blocks as register
        operands (a transposed left operand from shared memory does not lower). masked: as
        `chain_step_wide`."""
        ebuf = c % 2
        hi, lo = traced_halves(c)
        keep = _keeper(tok_index < eos - chunk_start(c) if masked else None)
        plgpu.barrier_wait(ek_loaded.at[ebuf])
        plgpu.barrier_wait(v_loaded)
        wait_read(c, S_PUB)
        # each product's right operand published half by half: its lo half formed and stored
        # after the products of its hi half are issued (one more commit a product)
        def half_by_half(tiles, then=None):
            """The stores of tiles [(to, (hi, a function that forms lo))], transposed, as two
            functions to call: every tile's hi half into to(hi), then every lo half into
            to(lo), each committed; then() after the second. (The halves' refs are indexed by
            the traced hi and lo: the stores run inside products.)"""
            def store(half):
                def run():
                    for to, (x_hi, x_lo) in tiles:
                        _store_tile(to((hi, lo)[half]), x_hi if half == 0 else x_lo(),
                                    interpret=interpret, transposed=True)
                    plgpu.commit_smem()
                    if half == 1 and then is not None:
                        then()
                return run
            return store(0), store(1)

        s_tiles = [(lambda part, b=b: s_pub.at[part, :, pl.ds(b * KB, KB)], _split_lazily(Sb))
                   for b, Sb in enumerate(S)]
        s_hi, s_lo = half_by_half(s_tiles, then=lambda: publish(S_PUB))

        neg_v = -_load(v_s, wgmma_layout, interpret).astype(F32)
        ek_hi, ek_lo = ek_s.at[ebuf, hi], ek_s.at[ebuf, lo]
        (acc,), _ = _products([[(ek_hi, ("T", s_pub.at[hi]), s_hi),
                                (ek_hi, ("T", s_pub.at[lo]), s_lo),
                                (ek_lo, ("T", s_pub.at[hi]))]], (C, BV), [neg_v],
                              interpret=interpret, during=lambda: refill(fetch_v, c + 1))
        x_hi, x_lo = half_by_half([(lambda part: x_pub.at[part],
                                    _split_lazily(keep(-acc)))])
        plgpu.barrier_wait(tb_loaded)
        (d,), _ = _products([[(tb_s.at[0], ("T", x_pub.at[0]), x_hi),
                              (tb_s.at[0], ("T", x_pub.at[1]), x_lo),
                              (tb_s.at[1], ("T", x_pub.at[0]))]], (C, BV),
                            interpret=interpret, during=lambda: refill(fetch_ek, c + 2))
        d = keep(d)
        wait_read(c, D_PUB)
        d_hi, d_lo = half_by_half([(lambda part: d_pub.at[part], _split_lazily(d))],
                                  then=lambda: publish(D_PUB))
        plgpu.barrier_wait(kd_loaded)

        def kt(part, b):
            block = kd_s.at[part, :, pl.ds(b * KB, KB)]
            x = _load(block if interpret else block.transpose((1, 0)), wgmma_layout, interpret)
            return x.T if interpret else x

        terms = [[(kt(hi, b), ("T", d_pub.at[hi])) + ((d_hi,) if b == 0 else ()),
                  (kt(hi, b), ("T", d_pub.at[lo])) + ((d_lo,) if b == 0 else ()),
                  (kt(lo, b), ("T", d_pub.at[hi]))] for b in range(2)]
        decays = [_rows(_load(decay_s.at[pl.ds(b * KB, KB)], None, interpret), (KB, BV),
                        interpret) for b in range(2)]

        def refills():
            # k e^{G_C - G} and e^{G_C} are in registers: their buffers too are refilled while
            # the update runs
            refill(fetch_tb, c + 1)
            refill(fetch_kd, c + 1)

        S, _ = _products(terms, (KB, BV), [Sb * d for Sb, d in zip(S, decays)],
                         interpret=interpret, during=refills)
        return tuple(S)

    chain_step = chain_step_narrow if narrow else chain_step_wide

    def output_step(c):
        """O = (q e^G) S + aqk D for chunk c, from the published halves."""
        plgpu.barrier_wait(q_loaded)
        plgpu.barrier_wait(aqk_loaded)
        # the intra-chunk matrix's halves, register operands
        a_hi, a_lo = split_bf16(_load(aqk_s, wgmma_layout, interpret).astype(F32))
        refill(fetch_aqk, c + 1)
        if warp_specialized:
            plgpu.barrier_wait(published.at[S_PUB])
        (qs,), _ = _products([[(qd_s, ("T", s_pub.at[0])), (qd_s, ("T", s_pub.at[1]))]],
                             (C, BV), interpret=interpret)
        if warp_specialized:
            plgpu.barrier_arrive(read.at[S_PUB])
        refill(fetch_q, c + 1)
        if warp_specialized:
            plgpu.barrier_wait(published.at[D_PUB])
        hi, lo = traced_halves(c)
        (o,), _ = _products([[(a_hi, ("T", d_pub.at[hi])), (a_hi, ("T", d_pub.at[lo])),
                              (a_lo, ("T", d_pub.at[hi]))]], (C, BV), [qs],
                            interpret=interpret)
        if warp_specialized:
            plgpu.barrier_arrive(read.at[D_PUB])
        _store_output(o_ref, o_s, o.astype(o_ref.dtype), c, chunk_start(c), bos, eos, h, cols)

    slab = _StateSlab(h0_ref, hT_ref, state_s, h0_bar, n, h, cols, narrow=narrow,
                      interpret=interpret)
    # the starting value read before any e^G k is fetched, and committed: state_s shares their
    # buffers
    initial_state = functools.partial(slab.initial, has_initial_state, then_commit=True)
    store_final = slab.store_final

    def store_zeros():
        _store_zero_outputs(
            lambda c, o: _store_output(o_ref, o_s, o, c, chunk_start(c), bos, eos, h, cols),
            zero_chunks, (C, BV), o_ref.dtype, interpret)

    if not warp_specialized:
        def step(c, S, masked):
            for fetch in (fetch_ek, fetch_v, fetch_tb, fetch_kd, fetch_q, fetch_aqk):
                fetch(c)
            S = chain_step(c, S, masked)
            output_step(c)
            return S

        S = over_chunks(step, initial_state())
        store_zeros()
        store_final(S)
        return

    wg = lax.axis_index("wg")

    @pl.when(wg == 0)
    def _chain():
        S = initial_state()
        for c, fetch in ((0, fetch_ek), (1, fetch_ek), (0, fetch_v), (0, fetch_tb),
                         (0, fetch_kd)):
            @pl.when(c < num_chunks)
            def _(c=c, fetch=fetch):
                fetch(c)

        S = over_chunks(chain_step, S)
        store_final(S)
        # the output warpgroup's last reads of the published halves (after the final state's
        # store, which does not need them)
        for what in (S_PUB, D_PUB):
            _wait_last_phases(lambda c, what=what: read.at[what], 1, num_chunks)

    @pl.when(wg == 1)
    def _output():
        @pl.when(num_chunks > 0)
        def _():
            fetch_q(0)
            fetch_aqk(0)

        def step(c, carry):
            output_step(c)
            return carry

        lax.fori_loop(0, num_chunks, step, 0)
        store_zeros()
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@default_config
def kda_scan(cu, order, first, live, decay, qd, kd, ek, v, tb, aqk, h0, *, num_v_heads: int,
             has_initial_state: bool, narrow: bool = False, warp_specialized: bool = True,
             interpret: bool = False):
    """KDA's state scan over packed sequences that all start at multiples of CHUNK, one program
    per (sequence, value head, BLOCK_V value columns) holding S^T [BV, K] as the tensor cores'
    accumulator: on a chain warpgroup the deltas D = (T beta)(v - (e^G k) S), one product for
    X = v - (e^G k) S and one for D, and S^T <- e^{G_C} S^T + D^T (k e^{G_C - G}); on an output
    warpgroup O = (q e^G) S + aqk D from the halves the chain publishes. Every product takes
    both fp32 sides as bf16 halves (hi x hi + hi x lo + lo x hi).

    cu [N + 1] (starts multiples of CHUNK), order [N], first [N], live [N] as for `scan`; decay
    [S, HV, K] fp32 (e^{G_C} per chunk slot); by token row, T' rows (a multiple of ALIGN; rows
    past the tokens may hold anything: they are masked out of X): qd [T', HV, K] bf16 (q e^G
    with norm and scale), kd [2, T', HV, K] bf16 (k e^{G_C - G}'s halves), ek [2, T', HV, K]
    bf16 (e^G k's halves), v [T', HV, V] bf16, aqk [T', HV, C] fp16 or fp32; by chunk slot
    (slot s's rows 64 s .. are its tokens' rows: the chunks are aligned), S * C rows: tb
    [2, S * C, HV, C] bf16 (T beta's halves, `kda_prep`); h0 [N, HV, V, K] (transposed; a
    placeholder without has_initial_state).
    narrow: programs of BLOCK_V_NARROW value columns holding S [K, BV] as two accumulators of
    64 key rows (twice the programs, for calls with few (sequence, head) pairs), the update
    taking (k e^{G_C - G})^T by key blocks as register operands; h0 and the final states then
    as they are, [N, HV, K, V].
    Returns (o [T', HV, V] bf16, final states [N, HV, V, K] fp32, transposed, or [N, HV, K, V]
    narrow)."""
    T = qd.shape[0]
    HV, V = v.shape[-2:]
    N = cu.shape[0] - 1
    K = HEAD_K_DIM
    BV = BLOCK_V_NARROW if narrow else BLOCK_V
    nv = V // BV
    state = (K, BV) if narrow else (BV, K)
    ek_union = plgpu.RefUnion(_swizzled((2, 2, CHUNK, K)), plgpu.SMEM(state, F32))
    scratch = (ek_union,                                             # e^G k halves (two buffers)
               _swizzled((CHUNK, BV), swizzle=2 * BV),               # v
               _swizzled((2, CHUNK, K)),                             # k e^{G_C - G} halves
               plgpu.SMEM((K,), F32),                                # e^{G_C}
               _swizzled((CHUNK, K)),                                # q e^G
               plgpu.SMEM((CHUNK, CHUNK), aqk.dtype),
               _swizzled((2, BV, K)),                                # S^T halves
               _swizzled((2, BV, CHUNK)),                            # D^T halves
               _output_staging(BV),
               plgpu.Barrier(num_arrivals=2, num_barriers=2),        # e^G k (two buffers)
               plgpu.Barrier(),                                      # v
               plgpu.Barrier(num_arrivals=3),                        # k halves, e^{G_C}
               plgpu.Barrier(), plgpu.Barrier(),                     # q e^G, aqk
               plgpu.Barrier(num_barriers=_KDA_SCAN_PUBLISH),        # published
               plgpu.Barrier(num_barriers=_KDA_SCAN_PUBLISH),        # read
               plgpu.Barrier(),
               _swizzled((2, CHUNK, CHUNK)), plgpu.Barrier(),        # T beta's halves
               # narrow: X^T's halves, the right operand of D = (T beta) X
               _swizzled((2, BV, CHUNK)) if narrow else ())
    kernel = functools.partial(_kda_scan_kernel, num_v_heads=HV, head_v_dim=V,
                               has_initial_state=has_initial_state, narrow=narrow,
                               warp_specialized=warp_specialized, interpret=interpret)
    # o by token row, as qd (an output by chunk slot would cost the caller a copy of its first
    # T' rows where there are more slots than chunks)
    return _launch(
        kernel,
        out_type=(jax.ShapeDtypeStruct((T, HV, V), BF16),
                  jax.ShapeDtypeStruct((N, HV, K, V) if narrow else (N, HV, V, K), F32)),
        scratch=scratch, num_programs=N * HV * nv, name="kda_prefill_mgpu_scan",
        num_threads=2 if warp_specialized else 1, interpret=interpret,
    )(cu, order, first, live, decay, qd, kd, ek, v, tb, aqk, h0)


# --------------------------------------------------------------------------- the chunk prep

NUM_ROW_VECTORS = 5      # the prep's per-row inputs a chunk and value head: see `prep`
G_HI, G_LO, BETA, RQ, RK = range(5)
UNFIT, HUGE = range(2)   # the prep's flags a row: its fp16 inverse may not have held; tamed
F16 = jnp.float16
# the prep's programs: two an SM of an H200 (132 SMs), each taking work items in turn with the
# next item's rows fetched while it forms one (one program an item was 12-17% slower;
# BENCHMARKS.md)
PREP_PROGRAMS = 264
# With the L2 norm, an item whose rows' sums of squares (the diagonals of q q^T and k k^T) are
# all below this holds no row above the tame bound (2**50, whose square is 2**100) and no NaN:
# the first launch forms it without looking at its tiles, and any other item is formed again,
# with the look and the taming, by the second (`prep`).
SUSPECT_SQUARES = 2.0 ** 96


def _items_in_turn(num_items: int, num_programs: int, num_v_heads: int):
    """This program's share of the (chunk slot, value head) work items, heads fastest, which
    num_programs programs take in turn: (how many it takes, it -> (slot, head) of its it-th)."""
    p = lax.axis_index("p")

    def slot_and_head(it):
        w = p + it * num_programs
        return w // num_v_heads, w % num_v_heads

    return (num_items - p + num_programs - 1) // num_programs, slot_and_head


def _prep_kernel(start_ref, q_ref, k_ref, vec_ref, *refs, num_v_heads: int, num_k_heads: int,
                 num_items: int, num_programs: int, max_a: float, max_t: float, l2norm: bool,
                 look: bool, redo: bool, interpret: bool):
    """`prep`'s programs. With the L2 norm, look: every item looks for huge rows in its tiles
    (`_prep_item`); redo (with look): the second launch, over the items whose [HUGE] row flags
    the first launch set (none unless count_ref [1] is not 0), each formed with the look; its
    outputs are the first launch's, written in place."""
    C = CHUNK
    # with the L2 norm: the factors in and out
    fac_ref, *refs = refs if l2norm else (None, *refs)
    count_ref, *refs = refs if redo else (None, *refs)
    aqk_ref, tb_ref, flag_ref, *refs = refs
    fac_out_ref, *refs = refs if l2norm else (None, *refs)
    (q_s, inverse_s, tb_s), k_s, vec_s, fac_s, nrm_s, aqk_o, flag_o, fac_o, bar = refs
    mine, slot_and_head = _items_in_turn(num_items, num_programs, num_v_heads)

    def fetch(it, buf):
        s, h = slot_and_head(it)
        hk = h // (num_v_heads // num_k_heads)
        rows = pl.ds(pl.multiple_of(start_ref[s], ALIGN), C)
        plgpu.copy_gmem_to_smem(k_ref.at[rows, hk], k_s.at[buf], bar.at[buf])
        plgpu.copy_gmem_to_smem(q_ref.at[rows, hk], q_s.at[buf], bar.at[buf])
        for axis in range(2):
            plgpu.copy_gmem_to_smem(vec_ref.at[s, h], vec_s.at[buf, axis], bar.at[buf])
        if l2norm:
            plgpu.copy_gmem_to_smem(fac_ref.at[:, h, pl.ds(pl.multiple_of(s * C, C), C)],
                                    fac_s.at[buf], bar.at[buf])

    def wait_stores_read():
        # an item stores T beta from its q tile's memory, which the next fetch overwrites
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def form(it, buf, during_products=None):
        # the inverse's operand tiles, and then T beta's halves, in the memory of this item's q
        # tile, whose reads are done by then; their index a traced value (a constant index of
        # a ref that a `run_state` update reads becomes an operand of it, which its lowering
        # cannot return)
        zero = buf - buf
        d_s, a_s = inverse_s.at[buf, zero], inverse_s.at[buf, zero + 1]
        _prep_item(*slot_and_head(it), q_s.at[buf], k_s.at[buf], vec_s.at[buf], fac_s.at[buf],
                   nrm_s, d_s, a_s, tb_s.at[buf], aqk_o, flag_o, fac_o, aqk_ref, tb_ref,
                   flag_ref, fac_out_ref, max_a=max_a, max_t=max_t, l2norm=l2norm,
                   look=look, during_products=during_products,
                   interpret=interpret)

    if redo:
        def suspect(s, h):
            """Whether the first launch flagged a row of item (s, h) [HUGE] (its flags read one
            value at a time: only a call with such a row gets here)."""
            x = flag_ref[s, h, HUGE, 0]
            for r in range(1, C):
                x = jnp.maximum(x, flag_ref[s, h, HUGE, r])
            return x != 0

        # rare (a huge or NaN row), so one item at a time: fetch, wait, form
        @pl.when(count_ref[0] != 0)
        def _():
            def step(it, carry):
                @pl.when(suspect(*slot_and_head(it)))
                def _():
                    wait_stores_read()
                    buf = it - it
                    fetch(it, buf)
                    plgpu.barrier_wait(bar.at[buf])
                    form(it, buf)
                return carry

            lax.fori_loop(0, mine, step, 0)
            wait_stores_read()
        return

    # the next item's rows are fetched into the other buffer while this one is formed
    @pl.when(mine > 0)
    def _():
        fetch(0, 0)

    def step(it, carry):
        def prefetch():
            # while this item's products run: the wait for the item before this one's stores,
            # long issued by then, whose buffer the fetch refills
            wait_stores_read()

            @pl.when(it + 1 < mine)
            def _():
                fetch(it + 1, (it + 1) % 2)

        buf = it % 2
        plgpu.barrier_wait(bar.at[buf])
        form(it, buf, during_products=prefetch)
        return carry

    lax.fori_loop(0, mine, step, 0)
    wait_stores_read()


def _huge_flagged_rows(flags):
    """How many rows flags [..., S, HV, 2, CHUNK] flag [HUGE] (the first launch's suspects, or
    the rows the look tamed), int32 [...]."""
    return jnp.sum(flags[..., HUGE, :] != 0, axis=(-3, -2, -1), dtype=jnp.int32)


def _inverse_fp16(A, i, j, d_s, a_s, interpret):
    """(I + A)^-1 for a strictly lower-triangular [C, C] A in registers, by recursive doubling
    with fp16 operands, as `gdn_prefill._invert_unit_lower` (half=True): D the inverse on the
    diagonal blocks of size b, L A's entries below them inside the blocks of size 2b;
    D <- D - (D L) D, each product a wgmma with its right operand from shared memory (the fp16
    tiles d_s and a_s). D is block-diagonal with blocks of size b, so (D L)_ij sums over i's
    block only, where L's mask is the one of (i, j): D L is D A masked, and A goes to shared
    memory once. A doubling then stores D alone, while D A runs, where D (L D) had a store and
    its wait before each of its two products. |D L| has the bound of |L D|
    (`gdn_prefill._half_inverse_fits`). i, j: the tile's row and column indices."""
    C = A.shape[0]
    D = jnp.where(i == j, 1.0, 0.0) - jnp.where((i // 2 == j // 2) & (i != j), A, 0.0)
    a_s[...] = A.astype(F16)
    b = 2
    while b < C:
        d16 = D.astype(F16)

        def store_d(d16=d16):
            d_s[...] = d16
            plgpu.commit_smem()

        if b == 2:
            store_d()   # a_s committed with it, before the first product reads it
        (DA,), _ = _products([[(d16, a_s)]], (C, C), interpret=interpret,
                             during=None if b == 2 else store_d)
        DL = jnp.where((i // (2 * b) == j // (2 * b)) & (i // b != j // b), DA, 0.0)
        (D,), _ = _products([[((-DL).astype(F16), d_s)]], (C, C), [D], interpret=interpret)
        b *= 2
    return D


def _unfit_rows(A, D, max_a, max_t):
    """[C]: 1 on the rows whose fp16 operands may not have held (`gdn_prefill._half_inverse_fits`:
    |A| > max_a or |D| > max_t; NaN fails), 0 elsewhere."""
    fits = (jnp.abs(A) <= max_a) & (jnp.abs(D) <= max_t)
    return jnp.max(jnp.where(fits, 0.0, 1.0), axis=1)


def _prep_item(s, h, q_s, k_s, vec_s, fac_s, nrm_s, d_s, a_s, tb_s, aqk_o, flag_o, fac_o,
               aqk_ref, tb_ref, flag_ref, fac_out_ref, *, max_a: float, max_t: float,
               l2norm: bool, look: bool, during_products=None, interpret: bool):
    """One chunk slot and value head of `prep`, from its rows in q_s, k_s, vec_s (and with the
    L2 norm the scan's row factors without it in fac_s); the inverse's operand tiles d_s, a_s
    and T beta's halves tb_s in the memory of q_s. With the L2 norm, look: look for huge rows in
    the tiles and tame them, flagging them [HUGE]; else flag [HUGE] the rows whose sums of
    squares say they may hold one (`SUSPECT_SQUARES`), for `prep`'s second launch."""
    C = CHUNK
    i, j = _iota((C, C), 0, interpret), _iota((C, C), 1, interpret)
    row_layout = None if interpret else plgpu.Layout.WGMMA.reduce(1)
    if l2norm and look:
        # rows too large to square in fp32 (max |x| > 2**50): tamed in place as `tame_rows`
        # does (same bits), only in a tile that holds one
        tiles = [_load(x_s, None if interpret else plgpu.Layout.WGMMA, interpret)
                 for x_s in (q_s, k_s)]
        marks = [huge_rows(x) for x in tiles]     # (huge [C], factor [C]) a tile
        huge_flags = jnp.where(marks[0][0] | marks[1][0], 1.0, 0.0)
        nrm_s[0] = huge_flags
        plgpu.commit_smem()
        any_huge = nrm_s[0, 0]
        for r in range(1, C):
            any_huge = jnp.maximum(any_huge, nrm_s[0, r])

        @pl.when(any_huge != 0)
        def _():
            for x_s, x, mark in zip((q_s, k_s), tiles, marks):
                x_s[...] = scale_huge_rows(x, *mark)

        plgpu.commit_smem()   # the tamed tiles for the products, and nrm_s read

    def vector(r, axis):
        """Row vector r of the chunk's, broadcast along axis of a [C, C] tile (from the copy of
        the vectors kept for that axis's layout)."""
        return _spread_vector(vec_s.at[axis, r], axis, (C, C), interpret)

    def during():
        # while the products run: e^{G_i - G_j} on and below the diagonal, from the cumulative
        # gates' (hi, lo) parts (the row vectors alone)
        if during_products is not None:
            during_products()
        seg = (vector(G_HI, 0) - vector(G_HI, 1)) + (vector(G_LO, 0) - vector(G_LO, 1))
        return jnp.exp(jnp.where(i >= j, seg, -jnp.inf))

    groups = [[(k_s, ("T", k_s))], [(q_s, ("T", k_s))]]
    if l2norm:
        # the rows' sums of squares: the diagonals of q q^T and k k^T (fp32 sums of exact
        # products)
        (kk, qk, qq), decay = _products(groups + [[(q_s, ("T", q_s))]], (C, C),
                                        interpret=interpret, during=during)
        on_diagonal = i == j
        sq, sk = (jnp.sum(jnp.where(on_diagonal, x, 0.0), axis=1) for x in (qq, kk))
        if not look:
            # (NaN fails the comparisons too)
            huge_flags = jnp.where((sq < SUSPECT_SQUARES) & (sk < SUSPECT_SQUARES), 0.0, 1.0)
        nrm_s[1] = sk    # k's, for the columns' layout
        plgpu.commit_smem()
    else:
        (kk, qk), decay = _products(groups, (C, C), interpret=interpret, during=during)

    rq_rows, rk_rows, rk_cols = vector(RQ, 0), vector(RK, 0), vector(RK, 1)
    # The rows that are not the chunk's (zero row vectors: another sequence's rows in the
    # chunk's window) may hold anything, NaN too, which a product by their zero factors would
    # keep: their rows and columns of the products are selected away, not scaled away.
    own = (rk_rows != 0) & (rk_cols != 0)
    if l2norm:
        # the L2 factors, applied to the products as the given row factors are, and to the
        # scan's row factors
        nq, nk = lax.rsqrt(sq + L2NORM_EPS), lax.rsqrt(sk + L2NORM_EPS)
        col_layout = None if interpret else plgpu.Layout.WGMMA.reduce(0)
        nk_cols = lax.rsqrt(_load(nrm_s.at[1], col_layout, interpret) + L2NORM_EPS)
        rq_rows = rq_rows * _rows(nq, (C, C), interpret)
        rk_rows = rk_rows * _rows(nk, (C, C), interpret)
        rk_cols = rk_cols * _columns(nk_cols, (C, C), interpret)
        for f, n in zip((FQ, FK, FW), (nq, nk, nk)):
            fac_o[f] = _load(fac_s.at[f], row_layout, interpret) * n
    aqk_o[...] = jnp.where(own, qk * (rq_rows * rk_cols) * decay, 0.0).astype(aqk_o.dtype)
    kk = kk * (rk_rows * rk_cols)
    A = jnp.where((i > j) & own, vector(BETA, 0) * kk * decay, 0.0)

    D = _inverse_fp16(A, i, j, d_s, a_s, interpret)
    unfit = _unfit_rows(A, D, max_a, max_t)
    flag_o[UNFIT] = unfit
    flag_o[HUGE] = huge_flags if l2norm else unfit * 0.0  # (zeros by rows)
    # T beta's halves over the inverse's operand tiles (its last product's wait is done)
    tb_hi, tb_lo = split_bf16(D * vector(BETA, 1))
    tb_s[0] = tb_hi
    tb_s[1] = tb_lo
    plgpu.commit_smem()
    at = pl.ds(pl.multiple_of(s * C, C), C)
    plgpu.copy_smem_to_gmem(aqk_o, aqk_ref.at[at, h, :])
    plgpu.copy_smem_to_gmem(tb_s, tb_ref.at[:, at, h, :])
    plgpu.copy_smem_to_gmem(flag_o, flag_ref.at[s, h])
    if l2norm:
        plgpu.copy_smem_to_gmem(fac_o, fac_out_ref.at[:, h, at])


@default_config
def prep(start, q, k, rows, factors=None, *, num_v_heads: int, aqk_dtype, max_a: float,
         max_t: float, num_programs: int | None = PREP_PROGRAMS, interpret: bool = False):
    """What the scan reads of each chunk that does not depend on the state, per (chunk slot,
    value head): the intra-chunk matrix and T beta, by slot (row s * CHUNK + i of chunk slot
    s's row i, so that no two items store the same rows). num_programs programs (None: one an
    item) take the items in turn, heads fastest.

    start [S] (each slot's first token, a multiple of ALIGN); q, k [T, HK, 128] bf16 as given;
    rows [S, HV, NUM_ROW_VECTORS, CHUNK] fp32, each chunk's per-row values: G_HI, G_LO the
    cumulative log decays' parts, BETA, RQ (the scale), RK (1), all 0 on the rows that are not
    the chunk's. factors: None, or the scan's row factors [3, HV, S * CHUNK] fp32 without the
    L2 norm, which the prep then applies: q's and k's L2 factors from the diagonals of q q^T
    and k k^T, of the rows as `tame_rows` leaves them (huge rows tamed in shared memory before
    the products: by a second launch over the items whose sums of squares may hide one, or,
    under `jax.vmap`, by every item).
    Returns (aqk [S * CHUNK, HV, CHUNK] aqk_dtype, q k^T e^{G_i - G_j} scaled on and below the
    diagonal; T beta's bf16 halves [2, S * CHUNK, HV, CHUNK]; flags [S, HV, 2, CHUNK] fp32:
    [UNFIT] 1 on the rows where the fp16 inverse may not have held (|A| > max_a or
    |T| > max_t), [HUGE] 1 on the rows tamed (`scan` must then read tamed copies of q and k)),
    and with factors, the factors with the L2 norm applied and [1] int32, not 0 where the scan
    must read tamed copies of q and k: the count of rows whose sums of squares may hide a huge
    one, which the second launch reads too (a row that is not huge comes through the tamed copy
    unchanged, so a count that no tamed row bears out costs a copy, not a bit); under vmap, of
    the rows tamed."""
    S, HV = start.shape[0], num_v_heads
    C, K = CHUNK, HEAD_K_DIM
    l2norm = factors is not None
    num_items = S * HV
    num_programs = num_items if num_programs is None else min(num_programs, num_items)
    # the inverse's two fp16 operand tiles, and then T beta's bf16 halves, take the memory of
    # the item's q tile, whose reads are done by then (the next item's rows go to the other
    # buffer). Two programs an SM need at most about 113 KiB of shared memory each (the
    # lowering aligns every buffer to 1 KiB and adds 2 KiB for reductions): 84 KiB with a
    # 16-bit intra-chunk matrix, 92 KiB with an fp32 one
    scratch = (plgpu.RefUnion(_swizzled((2, C, K)), _swizzled((2, 2, C, C), F16),
                              _swizzled((2, 2, C, C))),
               _swizzled((2, C, K)),
               plgpu.SMEM((2, 2, NUM_ROW_VECTORS, C), F32),
               plgpu.SMEM((2, NUM_FACTORS, C), F32), plgpu.SMEM((2, C), F32),
               # fp16: swizzled, as the scans' output staging (`_output_staging`)
               _swizzled((C, C), F16) if aqk_dtype == F16 else plgpu.SMEM((C, C), aqk_dtype),
               plgpu.SMEM((2, C), F32), plgpu.SMEM((NUM_FACTORS, C), F32),
               plgpu.Barrier(num_arrivals=5 if l2norm else 4, num_barriers=2))
    kernel = functools.partial(_prep_kernel, num_v_heads=HV, num_k_heads=q.shape[1],
                               num_items=num_items, num_programs=num_programs, max_a=max_a,
                               max_t=max_t, l2norm=l2norm, interpret=interpret)
    out_type = (jax.ShapeDtypeStruct((S * C, HV, C), aqk_dtype),
                jax.ShapeDtypeStruct((2, S * C, HV, C), BF16),
                jax.ShapeDtypeStruct((S, HV, 2, C), F32))
    if l2norm:
        out_type += (jax.ShapeDtypeStruct(factors.shape, F32),)
    # approximate math: the decays e^{G_i - G_j} from `ex2.approx.ftz` (two instructions where
    # libdevice's expf takes eight; relative error within about |G_i - G_j| 2^-24 + 2^-22,
    # far below the fp16 inverse's), and the L2 factors' rsqrt without its subnormal path
    # (the sums of squares plus L2NORM_EPS are normal: the same bits)
    launch = lambda name, out_type, **kw: _launch(
        functools.partial(kernel, **kw), out_type=out_type, scratch=scratch,
        num_programs=num_programs, name=name, interpret=interpret, approx_math=True)
    first = launch("gdn_prefill_mgpu_prep", out_type=out_type, look=False, redo=False)
    if not l2norm:
        return first(start, q, k, rows)
    redo = launch("gdn_prefill_mgpu_prep_redo", out_type=(), look=True, redo=True)
    look_in_every_item = launch("gdn_prefill_mgpu_prep", out_type=out_type, look=True,
                                redo=False)

    @jax.custom_batching.custom_vmap
    def two_launches(start, q, k, rows, factors):
        inputs = (start, q, k, rows, factors)
        outs = first(*inputs)
        # the items whose sums of squares flagged a row, formed again with the look at their
        # tiles (a huge row, NaN); in the usual call none, and the second launch's programs
        # each read the count of flagged rows (one XLA reduction) and end. (The look in every
        # item costs the prep more than this launch does at every size measured; under a
        # branch inside the first launch, more still: BENCHMARKS.md, GDN prefill.)
        count = _huge_flagged_rows(outs[2]).reshape(1)
        # the first launch's outputs as refs, which the second writes in place (`run_state`
        # keeps their state effects inside it: a ref made by `jax.new_ref` would have the whole
        # enclosing jit discharged, and a caller's jit may hold primitives without a discharge
        # rule)
        outs = pl.run_state(lambda refs: redo(*inputs, count, *refs))(outs)
        return (*outs, count)

    @two_launches.def_vmap
    def _(axis_size, in_batched, *args):
        # `run_state` has no batching rule: batched, one launch that looks in every item (the
        # same bits), batched as every kernel here is (a grid axis)
        del axis_size
        outs = jax.vmap(look_in_every_item, in_axes=[0 if b else None for b in in_batched])(
            *args)
        tamed = _huge_flagged_rows(outs[2])[:, None]
        outs = (*outs, tamed)
        return outs, (True,) * len(outs)

    return two_launches(start, q, k, rows, factors)


# --------------------------------------------------------------------------- KDA's chunk prep

def _kda_prep_kernel(start_ref, len_ref, kk_ref, beta_ref, *refs, num_v_heads: int,
                     num_items: int, num_programs: int, max_a: float, max_t: float,
                     t_beta: bool, interpret: bool):
    C = CHUNK
    if t_beta:
        # T beta's halves out, nothing multiplied: no e^G k or v in
        tb_ref, flag_ref, kk_s, union_s, beta_s, flag_o, first_bar = refs
    else:
        (ek_ref, v_ref, w_ref, u_ref, flag_ref, kk_s, union_s, ek_s, v_s, beta_s, flag_o,
         first_bar, second_bar) = refs
    # with two buffers for k k^T and beta, the next item's are fetched while this one is formed
    num_bufs = kk_s.shape[0]
    mine, slot_and_head = _items_in_turn(num_items, num_programs, num_v_heads)
    wgmma_layout = None if interpret else plgpu.Layout.WGMMA
    i, j = _iota((C, C), 0, interpret), _iota((C, C), 1, interpret)

    def rows_in(s):
        return pl.ds(pl.multiple_of(start_ref[s], C), C)

    def fetch_first(it):
        """k k^T and beta, what the inverse needs, on a barrier of their own."""
        s, h = slot_and_head(it)
        buf = it % num_bufs
        plgpu.copy_gmem_to_smem(kk_ref.at[rows_in(s), h], kk_s.at[buf], first_bar.at[buf])
        for axis in range(2):
            plgpu.copy_gmem_to_smem(beta_ref.at[s, h], beta_s.at[buf, axis], first_bar.at[buf])

    @pl.when(mine > 0)
    def _():
        fetch_first(0)

    def step(it, carry):
        s, h = slot_and_head(it)
        buf = it % num_bufs
        # the item before this one stored its outputs from the union (and W from e^G k's
        # tiles) and its flags: their reads first, then this item's rows over them
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        if not t_beta:
            # e^G k and v, waited for only before the products: the inverse runs while they
            # arrive (one copy a part: a bulk copy takes at most 5 strided dims)
            for part in range(2):
                plgpu.copy_gmem_to_smem(ek_ref.at[part, rows_in(s), h], ek_s.at[part],
                                        second_bar)
            plgpu.copy_gmem_to_smem(v_ref.at[rows_in(s), h], v_s, second_bar)
        if num_bufs > 1:
            @pl.when(it + 1 < mine)
            def _():
                fetch_first(it + 1)   # into the buffer the item before this one used

        plgpu.barrier_wait(first_bar.at[buf])
        n = len_ref[s]

        def vector(axis):
            """beta, broadcast along axis of a [C, C] tile (from its copy for that layout)."""
            return _spread_vector(beta_s.at[buf, axis], axis, (C, C), interpret)

        kk = _load(kk_s.at[buf], wgmma_layout, interpret).astype(F32)
        A = jnp.where((i > j) & (i < n), vector(0) * kk, 0.0)
        inverse_s, tb_s = union_s[0], union_s[1]
        zero = buf - buf   # a traced index: see `_prep_kernel`
        D = _inverse_fp16(A, i, j, inverse_s.at[zero], inverse_s.at[zero + 1], interpret)
        flag_o[...] = _unfit_rows(A, D, max_a, max_t)
        rows_out = pl.ds(pl.multiple_of(s * C, C), C)
        # T beta's halves over the inverse's operand tiles (its last product's wait is done);
        # rows and columns past the chunk's end are zeros (so is beta there). Committed here
        # for the bulk store; for the products below, with the rows zeroed there.
        _store_halves(tb_s, split_bf16(D * vector(1)), interpret=interpret, commit=t_beta)
        if t_beta:
            plgpu.copy_smem_to_gmem(tb_s, tb_ref.at[:, rows_out, h])
            plgpu.copy_smem_to_gmem(flag_o, flag_ref.at[s, h])
            return carry
        plgpu.barrier_wait(second_bar)

        @pl.when(n < C)
        def _():
            # the rows past the chunk's end (rows past the arrays, which the copies fill with
            # zeros, or rows the kernels before left unwritten) as zeros: the products below
            # take them times zeros of T beta, and a NaN there would spread
            for x_s in (ek_s.at[0], ek_s.at[1], v_s):
                x = _load(x_s, wgmma_layout, interpret)
                x_s[...] = jnp.where(_iota(x.shape, 0, interpret) < n, x, jnp.zeros_like(x))

        plgpu.commit_smem()   # T beta's halves and the zeroed rows, for the products
        # W = (T beta)(e^G k) from both sides' halves (all pairs but lo x lo, as
        # `gdn_prefill._dot_parts`), U = (T beta) v
        (w, u), _ = _products([[(tb_s.at[0], ek_s.at[0]), (tb_s.at[0], ek_s.at[1]),
                                (tb_s.at[1], ek_s.at[0])],
                               [(tb_s.at[0], v_s), (tb_s.at[1], v_s)]],
                              (C, HEAD_K_DIM), interpret=interpret)
        # W's halves over e^G k's tiles and U over T beta's: the products' reads are done
        u_s = union_s[2]
        _store_halves(ek_s, split_bf16(w), interpret=interpret, commit=False)
        u_s[...] = u
        plgpu.commit_smem()
        for part in range(2):
            plgpu.copy_smem_to_gmem(ek_s.at[part], w_ref.at[part, rows_out, h])
        plgpu.copy_smem_to_gmem(u_s, u_ref.at[rows_out, h])
        plgpu.copy_smem_to_gmem(flag_o, flag_ref.at[s, h])
        return carry

    lax.fori_loop(0, mine, step, 0)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@default_config
def kda_prep(start, length, kk, ek, v, beta, *, max_a: float, max_t: float,
             num_programs: int | None = PREP_PROGRAMS, t_beta: bool = False,
             interpret: bool = False):
    """KDA's T beta, or W and U, per (chunk slot, value head) item, one warpgroup an item;
    num_programs programs (None: one an item) take the items in turn, heads fastest.
    A = beta k k^T from the intra-chunk kernel's k k^T, T = (I + A)^-1 by the fp16 doubling of
    `prep`, then (without t_beta) W = (T beta)(e^G k) and U = (T beta) v on the tensor cores,
    each taking T beta as its bf16 halves against e^G k's hi and lo parts and v's exact rows.

    start [S] (each slot's first token, a multiple of CHUNK: the call's sequences all start at
    multiples of CHUNK, and an unused slot gives any such row), length [S] (its rows: rows past
    it are taken as zeros); kk [T, HV, CHUNK] fp32, or fp16 where bounded (k k^T with the
    per-channel decays, zero on and above the diagonal); ek [2, T, HV, 128] bf16 (e^G k's hi
    and lo parts); v [T, HV, 128] bf16; beta [S, HV, CHUNK] fp32 (zero on the rows that are
    not the chunk's).
    t_beta: T beta's bf16 halves instead of W and U, for `kda_scan`, which forms the deltas
    from them (ek and v are then not read, and may be None).
    Returns (W's halves [2, S * CHUNK, HV, 128] bf16, U [S * CHUNK, HV, 128] fp32, both by
    chunk slot (row s * CHUNK + i of slot s's row i), and flags [S, HV, CHUNK] fp32: 1 on the
    rows where the fp16 inverse may not have held (|A| > max_a or |T| > max_t), whose W and U
    the caller must form again); with t_beta (T beta's halves [2, S * CHUNK, HV, CHUNK] bf16
    by chunk slot, zero on the rows and columns past each chunk's length, flags)."""
    S, HV = beta.shape[:2]
    C, K = CHUNK, HEAD_K_DIM
    num_items = S * HV
    num_programs = num_items if num_programs is None else min(num_programs, num_items)
    # two buffers for k k^T and beta where programs take several items (the next item's fetched
    # while one is formed); k k^T, e^G k's parts and v in, and in one union the inverse's fp16
    # operand tiles, then T beta's halves, then U; W goes out through e^G k's tiles (about
    # 100 KiB with k k^T in fp16: two programs an SM). With t_beta only the first two.
    num_bufs = 2 if num_programs < num_items else 1
    flags = jax.ShapeDtypeStruct((S, HV, C), F32)
    first = (plgpu.SMEM((num_bufs, C, C), kk.dtype),)
    rest = (plgpu.SMEM((num_bufs, 2, C), F32), plgpu.SMEM((C,), F32),
            plgpu.Barrier(num_arrivals=3, num_barriers=num_bufs))
    if t_beta:
        union = plgpu.RefUnion(_swizzled((2, C, C), F16), _swizzled((2, C, C)))
        scratch = first + (union,) + rest
        out_type = (jax.ShapeDtypeStruct((2, S * C, HV, C), BF16), flags)
        operands = (start, length, kk, beta)
    else:
        union = plgpu.RefUnion(_swizzled((2, C, C), F16), _swizzled((2, C, C)),
                               plgpu.SMEM((C, K), F32))
        scratch = (first + (union, _swizzled((2, C, K)), _swizzled((C, K))) + rest
                   + (plgpu.Barrier(num_arrivals=3, num_barriers=1),))
        out_type = (jax.ShapeDtypeStruct((2, S * C, HV, K), BF16),
                    jax.ShapeDtypeStruct((S * C, HV, K), F32), flags)
        operands = (start, length, kk, beta, ek, v)
    return _launch(
        functools.partial(_kda_prep_kernel, num_v_heads=HV, num_items=num_items,
                          num_programs=num_programs, max_a=max_a, max_t=max_t,
                          t_beta=t_beta, interpret=interpret),
        out_type=out_type, scratch=scratch, num_programs=num_programs,
        name="kda_prefill_mgpu_prep", interpret=interpret,
    )(*operands)
