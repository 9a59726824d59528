"""Chunked Gated DeltaNet / KDA prefill on tensor cores: Pallas kernels over packed sequences.

Every call is packed: the sequences of a batch lie one after another along the token axis
(q, k [T_total, HK, K]; v [T_total, HV, V]; g, beta [T_total, HV]) and `cu_seqlens` [N + 1]
names where each starts (a dense [B, T] batch is the packing cu_seqlens = 0, T, 2T, ...). No
sequence is padded to another's length; empty and one-token sequences are legal.

The sequences are cut into chunks of C = 64 tokens (the last chunk of a sequence may be
shorter). With G_i the cumulative log decay from the chunk start, beta_i the write strength and
keys already L2-normalised, the chunk's deltas solve a unit lower-triangular system (the WY / UT
form of the delta rule):

    A_ij = beta_i (k_i . k_j) e^{G_i - G_j}  (j < i),   T = (I + A)^-1
    deltas  D = (T beta) (v - (e^G k) S0)          (= U - W S0 with W = T beta e^G k, U = T beta v)
    O = (q e^G) S0 + (q k^T  o  e^{G_i - G_j}, j <= i) D
    S_C = e^{G_C} S0 + (k e^{G_C - G})^T D

1. `_prep_kernel` (one program per chunk and value head, all in parallel) does everything that
   does not depend on the state: gates from raw projections, in-chunk cumulative decay, the
   q/k L2 norms (kept as row factors: q and k are never rewritten), A and its inverse; it writes
   T beta, the masked intra-chunk attention matrix, three row factors (q: norm * scale * e^G;
   k: norm * e^{G_C - G} and norm * e^G) and the chunk's total decay e^{G_C}. With 16-bit
   inputs the prep stores A in fp16 instead of T beta, and `_prep_inverse_kernel`, a launch of
   its own over the same chunks, inverts it with fp16 operands, writes T beta and flags the
   chunks where those did not fit; `_prep_redo_kernel`, a third pass, forms those chunks' T beta
   again in one-pass TF32 from the raw rows (its programs each read the flags of REDO_SLOTS
   chunks at once and stop when none is set).
2. `_scan_kernel` (one program per sequence, value head and block of value columns) walks the
   chunks of its sequence in order with the [K, block_v] state slab in registers: five matrix
   products per chunk on the tensor cores (k S, the deltas, q S, the intra-chunk matrix times
   the deltas, k^T D; the raw q and k rows, the row factors applied to the products), the
   outputs written as it goes, optionally the state after every chunk, and finally the final
   state (or the pool slot it came from, in place). The programs launch sequences longest
   first, so in a packed batch of mixed lengths the longest walks start first.
   The deltas are formed here rather than from W and U stored by the prep: T beta [C, C] is
   half of U's [C, V] fp32 bytes, W is not stored at all (the scan reads k anyway) and the prep
   does no [C, C] x [C, K] products (BENCHMARKS.md, GDN prefill).
   GDN with bf16 inputs and K = 128 may take the scan's Mosaic GPU form instead
   (`PrefillBlockSizes.mosaic_scan`; `gdn_prefill_mgpu`), which keeps the state as the tensor
   cores' accumulator, and then the prep's Mosaic GPU form too (`gdn_prefill_mgpu.prep`: the
   products and the fp16 inverse on wgmma, the q/k L2 norms from the diagonals of its products,
   the per-row values from `_prep_rows_kernel`, outputs laid by chunk slot; `_mosaic_prep`),
   for chunks laid from each sequence's start rounded down to 8 tokens (`chunk_table`'s align:
   the rows before the start are masked like those past the end).

KDA (`per_channel_gate`): the decay is per key channel, e^{G_ic - G_jc}, so A and the intra-chunk
attention matrix cannot be row-scaled products, and the per-channel work runs first in a kernel
of its own, `_kda_intra_kernel`, one program per chunk and value head, block_k key channels at
a time on whole-chunk [C, block_k] tiles. Across a chunk e^{G_ic - G_jc} can exceed fp32, so the
products factor through reference rows of the chunk's two 32-row blocks (SUB): the terms below
the diagonal blocks are one tensor-core product, of rows decayed towards and from the first
block's last row (no exponent above 0); the diagonal blocks are one more product through their
middle rows when the gates allow it (exponents within +-`_diag_exp_limit`), else formed exactly,
column by column (the reference rows go through a small per-program scratch in memory,
`_BlockRowExchange`). Only the lower-bound gate bounds those exponents by its form; for the
other gates the kernel factors every diagonal block and flags the (chunk, head) items whose
exponents went past the limit, and a second launch over the flagged items only forms their
k k^T and q k^T again, exactly where needed (`_intra_diagonal`). The same program writes the
decayed q e^G and k e^{G_C - G} (the scan takes them instead of row factors), e^G k (for W),
the masked k k^T and q k^T (k k^T without beta) and the chunk's total decay per channel. The
prep then loads k k^T, forms A and T beta and stores W = (T beta) (e^G k) and U = (T beta) v,
and the scan takes the deltas as U - W S: with T beta in the Triton scan instead, KDA's scan
would load the e^G k rows besides its decayed q and k rows, and lost more time than its prep
saved (BENCHMARKS.md). With bf16 inputs at K = V = 128 and every sequence starting at a
multiple of CHUNK (`PrefillSpec.aligned_chunks`), W and U come from the Mosaic GPU prep
(`gdn_prefill_mgpu.kda_prep`, `_mosaic_kda_prep`) instead, and the Triton prep, in its
`redo_only` form, forms again only the chunks whose fp16 inverse it flagged. For the Mosaic
GPU KDA scan (`PrefillBlockSizes.mosaic_kda_scan`) the Mosaic prep writes T beta's halves only
and the scan forms the deltas from them, e^G k and v (the redo pass then forms the flagged
chunks' T beta again).

The inverse T = (I + A)^-1 takes one of two forms, neither forming powers of A (a truncated
series I - A + A^2 - ... loses about three digits for repeated keys with beta near 1):
`_invert_unit_lower`, recursive doubling on register tiles (10 full [64, 64] products), or
`_invert_unit_lower_blocked`: the four 16 x 16 diagonal blocks by forward substitution in fp32,
merged pairwise by [[X, 0], [Y, Z]]^-1 = [[X^-1, 0], [-Z^-1 Y X^-1, Z^-1]] to 32 and to 64 rows
(four [16, 16] and two [32, 32] products). Register tiles cannot be sliced, so the blocked form's
blocks pass through global memory, in the chunk's own rows of a [T, HV, 64] fp32 array (GDN: T
beta's, before it is written; KDA: k k^T's, an input the prep aliases as an output), with three
barriers (GDN: one more before T beta is written over them). `PrefillBlockSizes.blocked_inverse`
picks the form; by default (`blocked_inverse_for`) KDA takes the blocked one, GDN the other.

Numerics. Gates are clamped at GATE_FLOOR (e^-88 is below fp32's smallest normal number, so a
clamped decay is still a full reset) so every cumulative sum is finite and a -inf gate cannot
produce -inf - (-inf). The cumulative decay is kept as two sums, of hi = g rounded to a multiple
of 1/16 and lo = g - hi: the hi sums are exact in fp32 (|sum| <= 64 * 88 * 16 < 2^24), so the
pairwise differences G_i - G_j lose no precision however negative the gates before j were.
KDA's intra kernel with 16-bit inputs takes one plain sum instead (`_one_part_gate_sums`):
its decays enter products that round to 11 bits anyway.

Dots: fp32 inputs use three-pass TF32 (fp32 accuracy on tensor cores). With bf16 inputs every
product with a bf16 row operand (raw q and k, v; KDA's stored decayed q, e^G k and W) takes
that operand as it is and splits the fp32 side (state, deltas, KDA's T beta) into two bf16
halves (`_dot_bf16x2`: ~16 significand bits, twice the tensor-core rate of TF32, half the
registers); products between fp32 matrices (KDA's products of decayed rows, GDN's T beta times
v - (e^G k) S, the intra-chunk matrix times the deltas, KDA's block-inverse merges) are one-pass
TF32, except where fp16 operands round as finely and are known to fit fp16's range (twice the
tensor-core rate): GDN's block inverse (`_half_inverse_fits`: checked per chunk, formed again
in TF32 by the redo pass when the chunk's inverse is large) and, with 16-bit inputs, KDA's
products below the diagonal blocks (operands bounded by 1: the L2-normalised rows, or without
the norm rows scaled by powers of two, `_intra_rows_bounded`).
fp16 inputs take one-pass TF32 where bf16 inputs split (fp16 halves cannot hold a state's range).
Between the kernels KDA's decayed q rows are stored in the input dtype, its W and e^G k too, but
for bf16 inputs as two bf16 parts, hi and lo (`_kda_parts`: W S then takes three bf16 products;
a single bf16 part costs the state its digits when the state is large beside the values); T beta, U
and KDA's k k^T in fp32: when a chunk repeats keys with beta near 1 and gates near 0, (I + A) is
near singular, T's entries and U's rows are large and the deltas cancel, so bf16 copies of these
matrices cost the state and the output several times bf16's rounding
(tests/test_prefill_kernels.py, repeated keys). The intra-chunk matrix enters the scan's
products only through one-pass TF32, which rounds it to fp16's 11 significant bits: with q/k L2
norm and 16-bit inputs (`_bounded_by_one`: every entry bounded by 1) it is stored in fp16, which
loses nothing to that rounding and halves the scan's reads of it; otherwise in fp32. KDA's
decayed k rows (which build the state) are stored in fp32 even so: fp16 lacks TF32's exponent
range, and a final state made only of rows decayed below 2^-14 (strong gates after the last
write) lost its digits there.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import gdn_prefill_mgpu as mgpu_scan
from pallas_kernels.gdn_decode import huge_row_factor, tame_huge_rows
from pallas_kernels.tracing import default_config

F32 = jnp.float32
CHUNK = 64
SUB = 32                 # KDA's sub-chunk: blocks of the per-channel intra-chunk products
NUM_SUB = CHUNK // SUB   # (two: the intra kernel is written for two blocks)
INV_SUB = 16             # the blocked inverse's diagonal blocks, formed by substitution
REF_SLOTS = 4            # KDA intra kernel: rows per SUB-row block in each buffer of its scratch
DIAG_EXP_LIMIT = 40.0    # KDA: largest |G - G_mid| for the factored diagonal blocks, any rows
DIAG_EXP_LIMIT_BOUNDED = 80.0   # ... rows bounded by one, single-pass products (`_diag_exp_limit`)
HALF_INVERSE_MAX_A = 4.0     # the fp16 inverse is kept when max |A| and max |T| are within these:
HALF_INVERSE_MAX_T = 128.0   # every fp16 operand then stays below C * 4 * 128 = 32768 < 65504
REDO_SLOTS = 16          # the redo passes over flagged chunks: chunk slots per program
INTRA_REDO_BLOCK_K = 32  # KDA intra kernel's redo pass (exact diagonal blocks): at most this
GATE_FLOOR = -88.0
ONE_PART_GATE_FLOOR = -64.0   # KDA's one-part gate sums: their floor, log2 units
GATE_QUANTUM = 16.0      # hi parts of the gates are multiples of 1 / GATE_QUANTUM
L2NORM_EPS = 1e-6
SOFTPLUS_THRESHOLD = 20.0

__all__ = ["PrefillSpec", "PrefillBlockSizes", "unsupported_reason", "chunk_table", "pool_rows",
           "chunk_prefill", "split_gate", "tame_rows", "tame_rows_if"]


@dataclasses.dataclass(frozen=True)
class PrefillSpec:
    """Static description of one prefill call (validated by the caller)."""
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    scale: float
    use_qk_l2norm: bool = False
    raw_gates: bool = False          # g, beta hold the raw projections a, b; A_log, dt_bias given
    per_channel_gate: bool = False   # KDA: g [T, HV, K], one decay per key channel
    gate_lower_bound: float | None = None  # KDA raw gate: lb * sigmoid(e^A_log (a + dt_bias))
    has_initial_state: bool = False  # initial_state [N, HV, K, V]
    pooled: bool = False             # states live in a pool [P, HV, K, V] named by slots [N]
    output_final_state: bool = True
    boundary_states: bool = False    # also the state after every chunk
    precise: bool = True             # fp32 inputs: three-pass TF32 dots
    # every sequence starts at an even token (a dense batch with T even): what the Mosaic GPU
    # scan's narrow form needs
    even_starts: bool = False
    # every sequence starts at a multiple of CHUNK (a dense batch with T a multiple of 64, or
    # one sequence): chunk slot s then holds tokens 64 s .. 64 s + 63, what the Mosaic GPU KDA
    # prep's bulk copies need (`PrefillBlockSizes.mosaic_kda_prep`)
    aligned_chunks: bool = False


PAIR_GROUP = 8  # the paired products' column group with many pairs; see `_dot_bf16x2`


@dataclasses.dataclass(frozen=True)
class PrefillBlockSizes:
    """Launch shape: the scan kernel's programs each own `block_v` value columns of one head."""
    block_v: int = 64
    num_warps_prep: int = 4
    num_warps_scan: int = 4
    num_stages_scan: int = 2
    block_k: int = 32        # KDA intra kernel: key channels per step of the per-channel products
    num_warps_intra: int = 4
    # KDA prep: W and U formed prep_cols columns at a time (at most K and V): the whole
    # [C, 128] products need 255 registers (two programs per SM), 64 columns 165 (three;
    # BENCHMARKS.md)
    prep_cols: int = 64
    num_stages_intra: int = 1  # KDA intra kernel: 1 only (unsupported_reason says why)
    # GDN scan, 16-bit inputs: each product of rows with the split state as one tensor-core
    # product of twice the width (`_dot_bf16x2`'s paired form): fewer tensor-core passes and
    # waits in the scan's serial chain of small products (the default for GDN; BENCHMARKS.md).
    # pair_group: the halves' columns alternate in groups of this many (1 or 8; see
    # `_dot_bf16x2`): 8 with many (sequence, head) pairs, 1 (slightly faster there) with few.
    paired_halves: bool = False
    pair_group: int = PAIR_GROUP
    # The per-chunk kernels (the prep and KDA's intra kernel) launch a chunk's value
    # heads back to back (True) or a head's chunks (False): with the heads adjacent, the programs
    # that share a key head's q/k rows run together and their [T, HV, ...] stores fill
    # neighbouring pieces of the same token rows. Measured faster for KDA, and for GDN with many
    # (sequence, head) pairs; slower for GDN with few (BENCHMARKS.md).
    heads_fastest: bool = True
    # the Triton prep: (I + A)^-1 by `_invert_unit_lower_blocked` (True) or `_invert_unit_lower`
    # (False); None: blocked for KDA, register-only for GDN (`blocked_inverse_for`). The Mosaic
    # prep (with mosaic_scan) has one form and ignores it
    blocked_inverse: bool | None = None
    # GDN, bf16: the state scan in Mosaic GPU (`gdn_prefill_mgpu`; its module docstring) rather
    # than `_scan_kernel`, and the prep in Mosaic GPU too (`_mosaic_prep`)
    mosaic_scan: bool = False
    # KDA, bf16, K = V = 128, spec.aligned_chunks: W and U in Mosaic GPU
    # (`gdn_prefill_mgpu.kda_prep`: the fp16 doubling inverse and the products on the tensor
    # cores), the chunks whose fp16 inverse may not have held formed again by the Triton prep
    mosaic_kda_prep: bool = False
    # KDA, with mosaic_kda_prep: the state scan in Mosaic GPU (`gdn_prefill_mgpu.kda_scan`: the
    # state as the tensor cores' accumulator, bf16 halves on both sides of every product), the
    # intra kernel then writing k e^{G_C - G} as bf16 halves, the Mosaic prep T beta's halves
    # instead of W and U, and the scan forming the deltas as (T beta)(v - (e^G k) S). The
    # default blocks take it with the Mosaic KDA prep (faster than the Triton scan in both
    # forms, and T beta than W and U by 5-20% of the whole call; BENCHMARKS.md, KDA)
    mosaic_kda_scan: bool = False

    def blocked_inverse_for(self, spec: PrefillSpec) -> bool:
        # Measured on the H200: the blocked inverse makes KDA's prep 7-8% faster and GDN's
        # 12-14% slower (GDN's prep holds the q, k and intra-chunk tiles through it;
        # BENCHMARKS.md).
        if self.blocked_inverse is not None:
            return self.blocked_inverse
        return spec.per_channel_gate

    @staticmethod
    def get_default(spec: PrefillSpec, num_sequences: int, dtype=None) -> "PrefillBlockSizes":
        # Few (sequence, head) pairs: narrower column blocks give the scan enough programs, and
        # software pipelining of the next chunk's loads pays; with many pairs the GPU is full
        # and wider blocks read each chunk's rows fewer times (BENCHMARKS.md, prefill sweep).
        # Pipelined stages hold the chunk's rows in shared memory once per stage: K = 256, and
        # KDA's fp32 rows (W, q e^G, k e^{G_C - G} for fp32 inputs, 304 KiB for 3 stages at
        # K = 128; k e^{G_C - G} and the intra-chunk matrix for 16-bit inputs whose values are
        # not bounded by one, 272 KiB; k e^{G_C - G} alone, always fp32, about 248 KiB), leave
        # room for one stage only on an H200 (two fit for the last, but ran 1.5x slower than
        # one; BENCHMARKS.md, KDA prefill).
        one_stage = spec.head_k_dim > 128 or (spec.per_channel_gate
                                              and (spec.precise or not _bounded_by_one(spec)
                                                   or spec.head_k_dim > 64))
        # KDA's intra kernel: 64 key channels a step with 16-bit inputs, else 32 (fp32 inputs'
        # gate sums come in two parts; BENCHMARKS.md, KDA prefill). Its redo pass, which
        # carries the exact diagonal form, takes at most INTRA_REDO_BLOCK_K.
        block_k = min(64 if not spec.precise else 32, spec.head_k_dim)
        mosaic = mosaic_scan_default(spec, dtype)
        kda_prep = mosaic_kda_prep_default(spec, dtype)
        # KDA's Mosaic scan wherever its prep is Mosaic and the call needs no chunk states
        kda_scan = kda_prep and not spec.boundary_states
        few = num_sequences * spec.num_v_heads < 128
        block_v = min(32 if few else 64, spec.head_v_dim)
        if mosaic or kda_scan:
            # the Mosaic scan's wide form (S^T, 64 columns a program) where it has programs
            # enough for the GPU, else the narrow one (S, 32 columns: twice the programs) where
            # it takes the call, else the Triton scan
            wide = (num_sequences * spec.num_v_heads * (spec.head_v_dim // mgpu_scan.BLOCK_V)
                    >= MOSAIC_WIDE_MIN_PROGRAMS)
            if wide:
                block_v = mgpu_scan.BLOCK_V
            elif _narrow_reason(spec) is None:
                block_v = mgpu_scan.BLOCK_V_NARROW
            else:
                mosaic = kda_scan = False
        if few:
            return PrefillBlockSizes(block_v=block_v,
                                     num_stages_scan=1 if one_stage else 3, block_k=block_k,
                                     paired_halves=not spec.per_channel_gate, pair_group=1,
                                     heads_fastest=spec.per_channel_gate, mosaic_scan=mosaic,
                                     mosaic_kda_prep=kda_prep, mosaic_kda_scan=kda_scan)
        return PrefillBlockSizes(block_v=block_v, num_stages_scan=1,
                                 block_k=block_k, paired_halves=not spec.per_channel_gate,
                                 mosaic_scan=mosaic, mosaic_kda_prep=kda_prep,
                                 mosaic_kda_scan=kda_scan)


# the Mosaic scan's wide form from this many of its programs (an H200 has 132 SMs; measured:
# 128 wide programs beat 256 narrow ones, 64 lose to 128; BENCHMARKS.md, GDN prefill)
MOSAIC_WIDE_MIN_PROGRAMS = 128


def mosaic_scan_default(spec: PrefillSpec, dtype) -> bool:
    """Whether the Mosaic GPU scan takes the call (bf16 inputs and `_mosaic_scan_reason`); the
    default blocks take it then, in the form `get_default` picks, where one of its forms fits
    (faster than the Triton scan at every batch measured; BENCHMARKS.md, GDN prefill)."""
    return _is_bf16(dtype) and _mosaic_scan_reason(spec) is None


def mosaic_kda_prep_default(spec: PrefillSpec, dtype) -> bool:
    """Whether the default blocks take KDA's prep in Mosaic GPU: bf16 inputs and
    `_mosaic_kda_prep_reason` (faster than the Triton prep where measured; BENCHMARKS.md, KDA
    prefill)."""
    return _is_bf16(dtype) and _mosaic_kda_prep_reason(spec) is None


def _is_bf16(dtype) -> bool:
    return dtype is not None and jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16)


def _mosaic_inputs_reason(spec: PrefillSpec, kernel: str) -> str | None:
    """Why the call's head dims or inputs do not suit the Mosaic GPU kernels (None: they do)."""
    why = mgpu_scan.unsupported_reason(head_k_dim=spec.head_k_dim, head_v_dim=spec.head_v_dim,
                                       dtype=jnp.bfloat16)
    if why:
        return why
    if spec.precise:
        return f"the Mosaic GPU {kernel} takes bf16 inputs (spec.precise is for fp32 ones)"
    return None


def _mosaic_kda_prep_reason(spec: PrefillSpec) -> str | None:
    if not spec.per_channel_gate:
        return "the Mosaic GPU KDA prep is KDA's (GDN's Mosaic prep comes with mosaic_scan)"
    why = _mosaic_inputs_reason(spec, "KDA prep")
    if why:
        return why
    if not spec.aligned_chunks:
        return ("the Mosaic GPU KDA prep needs every sequence to start at a multiple of 64 "
                "(spec.aligned_chunks): it reads and writes whole chunks by bulk copy")
    return None


def _narrow_reason(spec: PrefillSpec) -> str | None:
    """Why the Mosaic scan's narrow form cannot take the call (None: it can)."""
    if not (spec.even_starts or spec.aligned_chunks):  # (starts at multiples of 64 are even)
        return ("the narrow form needs every sequence to start at an even token "
                "(spec.even_starts): its output copies read 64-byte rows at 128-byte aligned "
                "addresses")
    return None


def _mosaic_scan_reason(spec: PrefillSpec) -> str | None:
    why = _mosaic_inputs_reason(spec, "scan")
    if why:
        return why
    if spec.per_channel_gate:
        return "the Mosaic GPU scan is GDN's (KDA's per-channel decays are not in it)"
    if spec.boundary_states:
        return "the Mosaic GPU scan writes no chunk-boundary states"
    return None


def _mosaic_kda_scan_reason(spec: PrefillSpec, block: PrefillBlockSizes) -> str | None:
    if not block.mosaic_kda_prep:
        return "the Mosaic GPU KDA scan takes the Mosaic GPU KDA prep's W and U (mosaic_kda_prep)"
    why = _mosaic_kda_prep_reason(spec)
    if why:
        return why
    if spec.boundary_states:
        return "the Mosaic GPU KDA scan writes no chunk-boundary states"
    if block.mosaic_scan:
        return "mosaic_scan is GDN's scan; KDA's is mosaic_kda_scan"
    widths = (mgpu_scan.BLOCK_V, mgpu_scan.BLOCK_V_NARROW)
    if block.block_v not in widths:
        return f"block_v={block.block_v} must be one of {widths} (the wide and narrow forms)"
    return None


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def unsupported_reason(spec: PrefillSpec, block: PrefillBlockSizes | None = None) -> str | None:
    """None when the kernels can take the call, else why not."""
    if not _pow2(spec.head_k_dim) or spec.head_k_dim > 256:
        return f"head_k_dim={spec.head_k_dim} must be a power of two in [16, 256]"
    if not _pow2(spec.head_v_dim) or spec.head_v_dim > 256:
        return f"head_v_dim={spec.head_v_dim} must be a power of two in [16, 256]"
    if block is not None:
        if not _pow2(block.block_v) or spec.head_v_dim % block.block_v:
            return f"block_v={block.block_v} must be a power of two >= 16 dividing V={spec.head_v_dim}"
        if spec.per_channel_gate and (not _pow2(block.block_k) or spec.head_k_dim % block.block_k):
            return (f"block_k={block.block_k} must be a power of two >= 16 dividing "
                    f"K={spec.head_k_dim}")
        if spec.per_channel_gate and not _pow2(block.prep_cols):
            return f"prep_cols={block.prep_cols} must be a power of two >= 16"
        if spec.per_channel_gate and block.num_stages_intra != 1:
            # Triton's software pipelining issues a loop's loads stages ahead and does not order
            # them after the loop's stores to the same memory (a store then a load of one
            # address in a pipelined loop reads stale data: triton-lang/triton issue 8259); the
            # barrier between them names no memory it orders, so it cannot be relied on to hold
            # the loads back
            return (f"num_stages_intra={block.num_stages_intra}: the KDA intra kernel reads "
                    f"back, within each channel step, reference rows it stored in that step "
                    f"(a store, a barrier, loads); pipelined loads could run before the store, "
                    f"so only 1 stage is supported")
        if block.mosaic_kda_prep:
            why = _mosaic_kda_prep_reason(spec)
            if why:
                return f"mosaic_kda_prep: {why}"
        if block.mosaic_kda_scan:
            why = _mosaic_kda_scan_reason(spec, block)
            if why:
                return f"mosaic_kda_scan: {why}"
        if block.pair_group not in (1, PAIR_GROUP):
            return f"pair_group={block.pair_group} must be 1 or {PAIR_GROUP}"
        if spec.per_channel_gate and block.paired_halves:
            return ("paired_halves is for GDN's scan (KDA's was slower with it, and its "
                    "pipelined stages did not fit the H200's shared memory)")
        if block.mosaic_scan:
            why = _mosaic_scan_reason(spec)
            if why:
                return f"mosaic_scan: {why}"
            widths = (mgpu_scan.BLOCK_V, mgpu_scan.BLOCK_V_NARROW)
            if block.block_v not in widths:
                return f"mosaic_scan: block_v={block.block_v} must be one of {widths}"
            if block.block_v == mgpu_scan.BLOCK_V_NARROW:
                why = _narrow_reason(spec)
                if why:
                    return f"mosaic_scan with block_v={block.block_v}: {why}"
        for w in (block.num_warps_prep, block.num_warps_scan, block.num_warps_intra):
            if w not in (1, 2, 4, 8):
                return f"num_warps={w} must be 1, 2, 4 or 8"
    return None


# --------------------------------------------------------------------------- chunk bookkeeping

def chunk_table(cu_seqlens, total_tokens: int, align: int = 1):
    """Chunks of every packed sequence: XLA arrays for traced offsets, numpy arrays (built at
    trace time, constants of the program) for a numpy cu_seqlens.

    Returns (chunk_start [S], chunk_end [S], first_chunk [N], chunk_lead [S]) int32 for
    S = ceil((T_total + (align - 1) N) / C) + N chunk slots, an upper bound of the number of
    chunks: slot s holds rows [chunk_start[s] + chunk_lead[s], chunk_start[s] + chunk_end[s]) of
    one sequence (chunk_end <= C); unused slots have chunk_end 0. Sequence n's chunks are slots
    first_chunk[n], first_chunk[n] + 1, ... in order.

    align > 1 lays a sequence's chunks from its start rounded down to a multiple of align (the
    Mosaic GPU scan's bulk copies take rows in whole 8-row tiles): its first chunk then begins
    with chunk_lead rows of the sequences before it, which the kernels mask like the rows past
    its end. With align = 1 every chunk_lead is 0.

    Loop-free (a scatter and two log-depth prefix sums): `jnp.searchsorted` lowers to a while
    loop, whose trip count an XLA GPU program reads back to the host every iteration."""
    concrete = isinstance(cu_seqlens, np.ndarray)
    xp = np if concrete else jnp
    cu = cu_seqlens.astype(np.int32)
    n = cu.shape[0] - 1
    num_slots = pl.cdiv(total_tokens + (align - 1) * n, CHUNK) + n
    prefix_sum = ((lambda x: np.cumsum(x).astype(np.int32)) if concrete
                  else (lambda x: lax.associative_scan(jnp.add, x)))
    base = cu[:-1] - cu[:-1] % align
    span = xp.where(cu[1:] > cu[:-1], cu[1:] - base, 0)
    nch = (span + CHUNK - 1) // CHUNK
    ends = prefix_sum(nch)
    first = ends - nch
    s = xp.arange(num_slots, dtype=np.int32)
    # seq[s] = #{n : ends[n] <= s}, the sequence slot s belongs to (ends[n] = S lies past every s)
    if concrete:
        ends_at = np.bincount(ends[ends < num_slots], minlength=num_slots)
    else:
        ends_at = jnp.zeros((num_slots,), jnp.int32).at[ends].add(1, mode="drop")
    seq = xp.minimum(prefix_sum(ends_at), n - 1)
    start = base[seq] + (s - first[seq]) * CHUNK
    used = s < ends[-1]
    end = xp.where(used, xp.clip(cu[seq + 1] - start, 0, CHUNK), 0)
    lead = xp.where(used, xp.clip(cu[seq] - start, 0, CHUNK), 0)
    return tuple(x.astype(np.int32) for x in (start, end, first, lead))


# --------------------------------------------------------------------------- in-kernel math

def _dot(a, b, precise, *, trans_a=False, trans_b=False, interpret=False):
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    if a.dtype != F32:  # 16-bit operands: exact products, fp32 accumulation
        prec = None
    elif interpret:
        prec = lax.Precision.HIGHEST
    elif precise:
        prec = lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    else:
        prec = lax.DotAlgorithmPreset.TF32_TF32_F32
    return lax.dot_general(a, b, dims, precision=prec, preferred_element_type=F32)


# fp32 x as hi + lo, both bf16: hi holds x's top 8 significand bits, lo the next 8 (the Mosaic
# GPU scan takes its operands so too)
_split_bf16 = mgpu_scan.split_bf16


def _dot_bf16x2(a, b, *, trans_a=False, paired=0):
    """a @ b for one exact bf16 operand and one fp32 operand, as two bf16 tensor-core products
    (b split by `_split_bf16`) summed in fp32: ~2^-16 relative on the fp32 side where one-pass
    TF32 rounds it to 2^-11, for the tensor-core time of one TF32 pass (bf16 runs at twice TF32's
    rate) and without widening the bf16 operand to fp32 registers.

    paired (the fp32 operand on the right; 0: off): both products as one of twice the width,
    one tensor-core pass and one wait instead of two, for a serial chain of small products (the
    GDN scan; `PrefillBlockSizes.paired_halves`), the halves' columns alternating in groups of
    `paired` columns. With groups of PAIR_GROUP (8), each column's hi and lo results land in the
    same thread (the tensor cores' accumulator gives a thread column pairs 8 apart), where the
    unpaired product would have put them, so summing them moves no data between threads; single
    columns (1) make a result whose every use in that layout shuffles it across threads, and
    measured slightly faster only where the scan has one program an SM."""
    dot = functools.partial(_dot, precise=False, trans_a=trans_a)
    if a.dtype == F32:
        hi, lo = _split_bf16(a)
        return dot(hi, b) + dot(lo, b)
    hi, lo = _split_bf16(b)
    if not paired:
        return dot(a, hi) + dot(a, lo)
    k, n = b.shape
    g = min(paired, n)
    if g == 1:  # Triton's join and split of a last axis of two
        r = dot(a, lax.reshape(jnp.stack((hi, lo), axis=-1), (k, 2 * n)))
        r_hi, r_lo = lax.unstack(lax.reshape(r, (r.shape[0], n, 2)), axis=-1)
        return r_hi + r_lo
    halves = jnp.stack((hi.reshape(k, n // g, g), lo.reshape(k, n // g, g)), axis=-1)
    r = dot(a, jnp.transpose(halves, (0, 1, 3, 2)).reshape(k, 2 * n))
    return jnp.sum(r.reshape(r.shape[0], n // g, 2, g), axis=2).reshape(r.shape[0], n)


def _dot_parts(a, b):
    """a @ b for operands given as tuples of bf16 parts ((hi, lo) from `_split_bf16`, or
    (exact,)): the products of every pair of parts but lo x lo, summed in fp32 (~16 significand
    bits on both sides)."""
    dot = functools.partial(_dot, precise=False)
    out = None
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            if i + j < 2:
                out = dot(x, y) if out is None else out + dot(x, y)
    return out


def _store_parts(ref, at, x, mask):
    """x into ref[p, *at] for each of its parts p: ref's leading axis (`_kda_parts`) holds x
    itself, or (2) its bf16 hi and lo parts."""
    for p, part in enumerate(_split_bf16(x) if ref.shape[0] == 2 else (x,)):
        plgpu.store(ref.at[(jnp.int32(p), *at)], part.astype(ref.dtype), mask=mask)


def _store_split(ref, at, x, mask):
    """x into ref[at], or, where ref has a leading axis of halves (T beta for the Mosaic GPU
    scan, [2, S * C, HV, C] bf16; KDA's k e^{G_C - G} for the Mosaic GPU KDA scan), its bf16
    hi and lo halves (`_store_parts`)."""
    if ref.ndim == 4:
        _store_parts(ref, at, x, mask)
    else:
        plgpu.store(ref.at[at], x.astype(ref.dtype), mask=mask)


def _store_factor(refs, i, tok, h, x, mask):
    """Row factor i (0: q, 1: k, 2: e^G k) of the chunk's tokens into refs[i] [T, HV]."""
    plgpu.store(refs[i].at[tok, h], x.astype(refs[i].dtype), mask=mask)


def _load_parts(load, ref, at, mask):
    """The parts `_store_parts` wrote, a tuple for `_dot_parts`, each read by load(ref, mask)."""
    return tuple(load(ref.at[(jnp.int32(p), *at)], mask) for p in range(ref.shape[0]))


def _kda_parts(rows_dtype) -> int:
    """How many arrays KDA's e^G k rows and W = (T beta)(e^G k) go through memory in: for bf16
    inputs two bf16 parts, hi and lo (the rows are not exact in bf16, and one part rounds them to
    8 bits, which W S carries into every delta: a state large beside the values then loses the
    state's digits, BENCHMARKS.md); otherwise one array (fp32 rows; fp16 for fp16 inputs)."""
    return 2 if rows_dtype == jnp.bfloat16 else 1


def _bf16_rows(*refs) -> bool:
    """Whether the rows these refs hold are bf16, so they enter products as they are
    (`_dot_bf16x2`); fp16 rows are widened to fp32 (fp16 cannot hold a split state's range)."""
    return all(r.dtype == jnp.bfloat16 for r in refs)


def _l2_factor(x, use_qk_l2norm: bool):
    """1 / ||x|| per row of the rows x [C, K] (in fp32), or ones without the L2 norm: the row
    factor that stands for normalising the rows (they stay raw tensor-core operands)."""
    if not use_qk_l2norm:
        return jnp.ones((x.shape[0],), F32)
    x = x.astype(F32)
    return lax.rsqrt(jnp.sum(x * x, axis=1) + L2NORM_EPS)


TAME_PROBE = 2.0 ** -72  # `_row_square_sums`: any finite fp32 row's squares times this**2
                        # stay below overflow, a huge row's above fp32's normal range


def _row_square_sums(x, sums):
    """`sums` (sum x^2, sum (x * TAME_PROBE)^2, max |x|) per row, each [C], updated with the rows
    x [C, n] (fp32): partial sums over a row's columns for `_tamed_l2_factor`."""
    s, s_probe, m = sums
    xp = x * TAME_PROBE
    return (s + jnp.sum(x * x, axis=1), s_probe + jnp.sum(xp * xp, axis=1),
            jnp.maximum(m, jnp.max(jnp.abs(x), axis=1)))


def _tamed_l2_factor(s, s_probe, m):
    """(t, r) per row from `_row_square_sums`: x * t * r is the row as `tame_rows` then the L2
    norm give it, bit for bit. t is the exact power of two `tame_rows` scales a huge row by (1
    elsewhere); its sum of squares is s_probe scaled by an exact power of two (the terms that
    power would scale are the same ones, rounded the same way), so no second pass over the row
    is needed. Ordinary rows: t = 1, r = rsqrt(s + eps) as without the tame."""
    huge, t = huge_row_factor(m)
    up = jnp.where(huge, t * (1.0 / TAME_PROBE), 0.0)   # in [2^-32, 2^46] for a huge row
    return t, lax.rsqrt(jnp.where(huge, s_probe * (up * up), s) + L2NORM_EPS)


LOG2E = 1.4426950408889634


def _approx_op(op: str, x):
    """One PTX `<op>.approx.ftz.f32` a fp32 element (op: ex2, lg2 or rcp), by inline assembly:
    relative error about 2^-22, subnormal inputs and results flushed to zero."""
    [y] = plgpu.elementwise_inline_asm(f"{op}.approx.ftz.f32 $0, $1;", args=[x],
                                       constraints="=f,f", pack=1,
                                       result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, F32)])
    return y


def _operand_exp2(x, *, approx: bool):
    """2^x for the decay factors of tensor-core operands (fp16 or one-pass TF32, rounding to 11
    bits; bf16 halves or parts, 16) and of the decayed rows they are stored as (approx): one
    `ex2.approx`, where a precise exponential takes several instructions (the KDA intra kernel
    runs at its instruction rate). Its relative error, about 2^-22, is far below the operands'
    rounding; results below fp32's normal range flush to zero (terms below 1e-38 of the unit
    diagonal, or of a row's own scale), an exponent of +inf gives +inf. Without approx
    (interpret mode, and fp32 inputs, whose products keep fp32's accuracy): `jnp.exp2`."""
    return _approx_op("ex2", x) if approx else jnp.exp2(x)


def _softplus(x):
    return jnp.where(x > SOFTPLUS_THRESHOLD, x,
                     jnp.log1p(jnp.exp(jnp.minimum(x, SOFTPLUS_THRESHOLD))))


def split_gate(g, floor: float = GATE_FLOOR):
    """A log decay clamped at floor (GATE_FLOOR; in log2 units, GATE_FLOOR * LOG2E), as (hi, lo):
    hi a multiple of 1 / GATE_QUANTUM, lo the small rest. Running sums of hi are exact in fp32;
    see the module docstring."""
    g = jnp.maximum(g, floor)
    hi = jnp.floor(g * GATE_QUANTUM + 0.5) * (1.0 / GATE_QUANTUM)
    return hi, g - hi


def _split_cumsum(g, one_scan: bool = False, floor: float = GATE_FLOOR):
    """In-chunk cumulative log decay as (hi, lo) sums along axis 0. one_scan (a [C, n] tile):
    both parts go through one running sum, side by side in a last axis of two, which pays the
    sum's exchanges across lanes and warps once (`_one_scan_gates` says where that is faster)."""
    hi, lo = split_gate(g, floor)
    if not one_scan:
        return jnp.cumsum(hi, axis=0), jnp.cumsum(lo, axis=0)
    return lax.unstack(jnp.cumsum(jnp.stack((hi, lo), axis=-1), axis=0), axis=-1)


def _gate_diff(x, y):
    """G_x - G_y from two tuples of gate-sum parts (`_kda_gate_sums`: (hi, lo), or one part),
    each part subtracted before the parts are added, so the exact hi sums cancel exactly."""
    return functools.reduce(operator.add, [a - b for a, b in zip(x, y)])


def _kda_gate_sums(g2, spec: PrefillSpec):
    """KDA's in-chunk cumulative decays for the intra kernel, in log2 units from gates g2 in log2
    units, as a tuple of parts whose sum is G: one plain fp32 running sum with 16-bit inputs
    (`_one_part_gate_sums`), of the gates clamped at ONE_PART_GATE_FLOOR (a decay of 2^-64 a
    token: a reset still leaves up to 2^-64 of the state it erases, far below fp32's rounding
    of that state and of any state written after it but a near-zero one, and the sums stay
    within 64 * 64 = 4096, whose rounding is 2^-11), else the
    (hi, lo) parts of `_split_cumsum` of the gates clamped at GATE_FLOOR * LOG2E (the same clamp
    as GDN's; |g2| <= 88 log2 e < 128: the hi sums stay exact). The raw softplus gate is also
    clipped at 0 (`_monotone_gate_sums`)."""
    if _one_part_gate_sums(spec):
        g2 = jnp.maximum(g2, ONE_PART_GATE_FLOOR)
        if spec.raw_gates and spec.gate_lower_bound is None:
            g2 = jnp.minimum(g2, 0.0)
        return (jnp.cumsum(g2, axis=0),)
    return _split_cumsum(g2, _one_scan_gates(spec), GATE_FLOOR * LOG2E)


def _monotone_gate_sums(spec: PrefillSpec) -> bool:
    """Whether KDA's intra kernel's gate sums fall along the chunk by construction, so that a
    32-row block's exponents G_i - G_m lie between those of its first and last rows: one part
    (`_one_part_gate_sums`: no rounding between parts), and raw gates, every one <= 0 as formed
    (the lower-bound form lb * sigmoid; the softplus form -e^A_log softplus, whose PTX
    approximation can round a gate near 0 above it: `_kda_gate_sums` clips those to 0, a change
    of a few 2^-22 e^A_log). Given gates may be positive: no such bound holds for them."""
    return spec.raw_gates and _one_part_gate_sums(spec)


def _one_part_gate_sums(spec: PrefillSpec) -> bool:
    """Whether KDA's intra kernel sums its gates in one plain fp32 part: with 16-bit inputs,
    every gate form; fp32 inputs keep the exact hi and lo parts. A running sum carries an error
    of a few units in the last place of its magnitude. With the raw lower-bound gate (lb >= -5)
    every in-chunk sum stays within CHUNK * |lb| <= 320: 2e-5 at most in an exponent. Other
    gates can take a chunk's sums to -4096 (log2 units, gates at ONE_PART_GATE_FLOOR,
    `_kda_gate_sums`), and a decay that matters there (a difference of two such sums, a short
    stretch of mild gates after strong ones) is off by a few 2^-11 relative: about the fp16 and
    one-pass TF32 roundings of the products that decay enters, in the few chunks whose gates
    sit near the floor. Measured against float64 on such gates and on bounded ones: the same
    errors as with the split sums (BENCHMARKS.md, KDA prefill)."""
    return not spec.precise


def _one_scan_gates(spec: PrefillSpec) -> bool:
    """Whether KDA's intra kernel sums its gates' two parts in one running sum (`_split_cumsum`;
    the same bits either way), where it sums two parts: fp32 inputs (16-bit ones take one part,
    `_one_part_gate_sums`). Measured on the H200 with 16-bit inputs and two parts: the intra
    kernel 5% faster with Kimi Linear's raw softplus gate, 3-5% slower with GLM-5.3-Flash's raw
    lower-bound gate (why the two differ was not worked out); not measured with given gates,
    which keep two sums (BENCHMARKS.md, KDA prefill)."""
    return spec.raw_gates and spec.gate_lower_bound is None


def _invert_unit_lower(A, precise, interpret, *, half=False):
    """(I + A)^-1 for a strictly lower-triangular [C, C] A (fp32, or fp16 with half), by
    recursive doubling of the triangular block inverse: with D the inverse of I + A on the
    diagonal blocks of size b, and L = A's entries below those blocks but inside the diagonal
    blocks of size 2b,
        (I + A)^-1 on the 2b-blocks = D - D L D
    (the block formula [[X, 0], [Y, Z]]^-1 = [[X^-1, 0], [-Z^-1 Y X^-1, Z^-1]] for every 2b-block
    at once). From b = 2 (D = I - A on the 2-blocks) that is two dependent matrix products per
    doubling, 10 for C = 64. This is the standard recursive triangular inversion, with error
    bounds like forward substitution's; it forms no powers of A (a truncated series
    I - A + A^2 - ... loses about three digits for repeated keys with beta near 1, where the
    powers grow to ~C(15, 7) while the inverse stays O(1)).

    half: every product takes fp16 operands (fp32 accumulation), which round to the same 11
    significant bits as one-pass TF32 at twice its tensor-core rate and half its operand
    registers, but hold only |x| < 65504: see `_half_inverse_fits`, which checks that."""
    c = A.shape[0]
    r = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    col = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    dot = functools.partial(_dot, precise=precise, interpret=interpret)
    h = (lambda x: x.astype(jnp.float16)) if half else (lambda x: x)
    D = (r == col).astype(F32) - jnp.where((r // 2 == col // 2) & (r != col), A, 0.0)  # b = 2
    b = 2
    while b < c:
        L = jnp.where(((r // (2 * b)) == (col // (2 * b))) & ((r // b) != (col // b)), A, 0.0)
        D = D - dot(h(D), h(dot(h(L), h(D))))
        b *= 2
    return D


def _half_inverse_fits(A, T):
    """Whether T, `_invert_unit_lower(A, half=True)`, is exact to one-pass TF32's rounding (its
    fp16 operands all held in range); where not, the chunk's inverse is formed again in one-pass
    TF32 (GDN: `_prep_redo_kernel`).

    The doubling's operands are D, L and L D. D holds the inverse's own diagonal blocks (the
    inverse of a block lower-triangular matrix has the blocks' inverses on its diagonal), so
    |D| <= max |T|; |L| <= max |A|; |L D| <= C max |A| max |T|. With max |A| and max |T| within
    HALF_INVERSE_MAX_A and HALF_INVERSE_MAX_T every operand is below 65504. The check runs on the
    fp16 result: an operand that overflowed leaves an inf or NaN in T, which fails it (the
    counts below treat NaN as out of range). Entries below fp16's normal range (6e-5) round to
    absolute steps of 6e-8, below TF32's rounding of T's unit diagonal. q/k L2 norm and beta in
    (0, 1) give |A| < 1; ill-conditioned chunks (T above 128) take the TF32 form. A itself
    reaches the inverse in fp16 (the products round it to fp16 anyway): an entry beyond fp16's
    range arrives as inf and fails the check too."""
    outside = lambda x, bound: jnp.sum(jnp.where(jnp.abs(x) <= bound, 0.0, 1.0))
    return (outside(A, HALF_INVERSE_MAX_A) + outside(T, HALF_INVERSE_MAX_T)) == 0.0


def _barrier(interpret):
    """All threads of the program reach this point, their global-memory writes visible to the
    others (a Triton debug barrier; interpret mode runs a program's ops in order and has none)."""
    if not interpret:
        plgpu.debug_barrier()


def _invert_unit_lower_blocked(A, scratch, t0, h, n, *, precise, interpret):
    """(I + A)^-1 for a strictly lower-triangular [C, C] A whose rows past n are zero, by blocks:
    the inverse's INV_SUB x INV_SUB diagonal blocks by forward substitution, then the block formula
        [[X, 0], [Y, Z]]^-1 = [[X^-1, 0], [-Z^-1 Y X^-1, Z^-1]]
    merging them to 2 INV_SUB and to C rows: each merge is two products of the half size, on the
    merged blocks' rows and columns only (four [16, 16] products to 32 rows and two [32, 32] to
    64, where `_invert_unit_lower` spends ten full [C, C] products). The substitution is plain
    fp32 arithmetic on the CUDA cores and, like the merges, forms no powers of A.

    Register tiles cannot be sliced, so blocks go through `scratch` [T, HV, C] fp32, rows
    t0 .. t0 + n of head h, which this program owns (rows past n belong to another chunk: every
    store and load is masked to rows < n; a live row's inverse needs no dead row). A goes in
    transposed, into the strictly upper triangle, and the inverse's blocks into the lower
    triangle and diagonal, so reads of A never meet writes of the inverse: only the two merge
    levels' results need a barrier before they are read back, three barriers in all. Returns
    the inverse with zero rows past n (I's there, but nothing reads them); `scratch` holds
    both on return, so a caller overwriting it puts a `_barrier` first."""
    C, b = A.shape[0], INV_SUB
    nb = C // b
    dot = functools.partial(_dot, precise=precise, interpret=interpret)
    iota = lambda shape, axis: lax.broadcasted_iota(jnp.int32, shape, axis)

    def put(r, c, x, mask=True):  # scratch[r, c] = x, for chunk-relative row, column arrays
        plgpu.store(scratch.at[t0 + r, h, c], x, mask=mask & (r < n))

    def get(r, c, mask=True):     # scratch[r, c], 0 where masked
        return plgpu.load(scratch.at[t0 + r, h, c], mask=mask & (r < n), other=0)

    i, j = iota((C, C), 0), iota((C, C), 1)
    put(i, j, A.T, j > i)                                          # [x, y] = A[y, x]
    _barrier(interpret)

    # The diagonal blocks, all at once as [nb, b, b] tiles: Ad[a] = A's block a, X[a] its inverse
    # (I + Ad)^-1 by forward substitution, column s of the blocks per step: the rows below s
    # take away A[., s] times row s, which is final by then.
    a3, r3, c3 = iota((nb, b, b), 0), iota((nb, b, b), 1), iota((nb, b, b), 2)
    Ad = get(b * a3 + c3, b * a3 + r3, r3 > c3)

    def substitute(s, X):
        col = jnp.sum(jnp.where(c3 == s, Ad, 0.0), axis=2, keepdims=True)   # Ad[a, :, s]
        row = jnp.sum(jnp.where(r3 == s, X, 0.0), axis=1, keepdims=True)    # X[a, s, :]
        return X - col * row

    X = lax.fori_loop(0, b - 1, substitute, (r3 == c3).astype(F32))
    put(b * a3 + r3, b * a3 + c3, X, r3 >= c3)
    blocks = [jnp.sum(jnp.where(a3 == a, X, 0.0), axis=0) for a in range(nb)]

    w = b
    while w < C:  # merge pairs of w-blocks into 2w-blocks: off-diagonal block -Z^-1 Y X^-1
        r2, c2 = iota((w, w), 0), iota((w, w), 1)
        for p in range(len(blocks) // 2):
            r0 = 2 * w * p
            Yt = get(r0 + r2, r0 + w + c2)                             # Y^T, from A^T
            off = -dot(blocks[2 * p + 1], dot(Yt, blocks[2 * p], trans_a=True))
            put(r0 + w + r2, r0 + c2, off)
        _barrier(interpret)
        w *= 2
        r2, c2 = iota((w, w), 0), iota((w, w), 1)
        blocks = [get(w * p + r2, w * p + c2, r2 >= c2) for p in range(C // w)]
    return blocks[0]


def _bounded_by_one(spec: PrefillSpec) -> bool:
    """Whether every entry of the normalised rows decayed by factors <= 1, and of their products
    (q k^T with the scale), is bounded by 1 in magnitude (q/k L2 norm, scale <= 1), and the
    call's fp32 products are one-pass TF32 (16-bit inputs): fp16 then holds those values with
    the rounding the products give them anyway."""
    return spec.use_qk_l2norm and not spec.precise and spec.scale <= 1.0


def _bounded_dtype(spec: PrefillSpec):
    """The dtype of those bounded values as operands and between the kernels."""
    return jnp.float16 if _bounded_by_one(spec) else F32


def _intra_rows_bounded(spec: PrefillSpec) -> bool:
    """Whether KDA's intra kernel forms its products from rows bounded by one, with one-pass
    products (16-bit inputs, scale <= 1): the L2-normalised rows (`_bounded_by_one`), or
    without the norm each raw row scaled by the power of two that brings its largest entry
    into [0.5, 1) (`_pow2_row_scale`; q then times the scale), the products and decayed rows
    scaled back before they are stored. The scalings are exact, so the results keep the
    rounding of the bounded form relative to the rows' scale, and the kernel takes
    `_diag_exp_limit`'s larger limit and fp16 operands whatever the rows' scale: with the raw
    rows' limit most chunks of a strong gate were flagged and formed again exactly
    (BENCHMARKS.md, KDA prefill)."""
    return not spec.precise and spec.scale <= 1.0


def _pow2_row_scale(m):
    """(scale, unscale) per row from its largest |entry| m (fp32): exact powers of two, inverse
    to each other and both normal numbers, scale bringing a normal m into [0.5, 1) (m below
    2^-125, zero included, below 0.5; m of 2^126 or more into [1, 4), inf and NaN left to
    the row). x * scale * unscale is x bit for bit wherever neither product leaves fp32's
    normal range."""
    biased = (lax.bitcast_convert_type(m, jnp.int32) >> 23) & 0xFF
    e = jnp.clip(biased - 126, -125, 126)          # a normal m lies in [2^(e - 1), 2^e)
    return (lax.bitcast_convert_type((127 - e) << 23, F32),
            lax.bitcast_convert_type((127 + e) << 23, F32))


def _diag_exp_limit(spec: PrefillSpec) -> float:
    """The largest |G_ic - G_mc| (natural units) for which KDA's intra kernel factors its
    diagonal blocks through their middle rows m, e^{G_i - G_m} on one side and e^{G_m - G_j}
    on the other.
    - Rows bounded by one with single-pass products (`_intra_rows_bounded`): DIAG_EXP_LIMIT_BOUNDED
      (80: the lower-bound gate -5 over the 16 rows between a 32-row block's ends and its
      middle). Every factor stays below e^80 < 3e38. A side that drops below fp32's normal
      range (a factor near e^-80 on a channel entry below ~5e-4) can lose a term of at most
      2^-11 of the other row's channel entry: less than the bf16 rounding of such an entry.
    - Otherwise DIAG_EXP_LIMIT (40): a factor times any row that fp32 can square stays finite,
      and no term nears fp32's subnormals (the fp32 inputs' 3-pass products keep 2^-22)."""
    return DIAG_EXP_LIMIT_BOUNDED if _intra_rows_bounded(spec) else DIAG_EXP_LIMIT


def _factored_diagonal_always_safe(spec: PrefillSpec) -> bool:
    """Whether the gate form alone bounds every diagonal-block exponent by `_diag_exp_limit`:
    the lower-bound gate g >= lb spans at most SUB // 2 * |lb| between a row and its block's
    middle row (GLM-5.3-Flash's lb = -5 gives exactly 80, the bound for the kernel's rows with
    16-bit inputs)."""
    return (spec.raw_gates and spec.gate_lower_bound is not None
            and -spec.gate_lower_bound * (SUB // 2) <= _diag_exp_limit(spec))


def _raw_log_decay(x, A_log, dt, spec: PrefillSpec, unit: float = 1.0, approx: bool = False):
    """The log decay from the raw gate projection x (fp32): -e^A_log softplus(x + dt), or with a
    lower bound lb * sigmoid(e^A_log (x + dt)); times unit (LOG2E: in log2 units), folded into
    the per-head factor or the bound (the same bits with unit 1).

    approx (unit LOG2E only; the KDA intra kernel with 16-bit inputs): the sigmoid as
    1 / (1 + 2^(-z log2 e)) and the softplus in log2 units as log2(1 + 2^(y log2 e)), each step
    one PTX approximation (`_approx_op`) where libdevice's exp, log1p and division take a dozen
    instructions or more: an error of at most a few 2^-22 of |lb| (or of e^A_log) a token in the
    log decay, whose sum over a chunk (2e-4 at lb = -5) stays below the products' 2^-11
    rounding. Below y = -17 the softplus's 2^y vanishes beside 1 and the gate becomes 0 (a
    decay off by under e^A_log 2^-24 a token)."""
    y = x + dt
    if approx:
        assert unit == LOG2E, unit
        if spec.gate_lower_bound is None:
            y_cut = jnp.minimum(y, SOFTPLUS_THRESHOLD)
            soft = _approx_op("lg2", 1.0 + _approx_op("ex2", y_cut * LOG2E))
            return -jnp.exp(A_log) * jnp.where(y > SOFTPLUS_THRESHOLD, y * LOG2E, soft)
        z = jnp.exp(A_log) * y
        sigmoid = _approx_op("rcp", 1.0 + _approx_op("ex2", z * -LOG2E))
        return jnp.float32(spec.gate_lower_bound * unit) * sigmoid
    if spec.gate_lower_bound is None:
        return -(jnp.exp(A_log) * unit) * _softplus(y)
    return jnp.float32(spec.gate_lower_bound * unit) * jax.nn.sigmoid(jnp.exp(A_log) * y)


# --------------------------------------------------------------------------- kernel 1: chunk prep

def _chunk_grid(num_slots: int, num_heads: int, heads_fastest: bool):
    """The per-chunk kernels' grid (`PrefillBlockSizes.heads_fastest`)."""
    return (num_heads, num_slots) if heads_fastest else (num_slots, num_heads)


def _slot_and_head(heads_fastest: bool):
    """This program's (chunk slot, value head) in `_chunk_grid`."""
    a, b = pl.program_id(0), pl.program_id(1)
    return (b, a) if heads_fastest else (a, b)


def _chunk_beta(beta_ref, tok, h, rows, spec: PrefillSpec):
    """The chunk's write strengths [C] (sigmoid of the raw projection when spec.raw_gates),
    0 past the chunk; for h a slice of heads, [C, heads] (rows then [C, heads] too)."""
    beta = plgpu.load(beta_ref.at[tok, h], mask=rows, other=0).astype(F32)
    return jnp.where(rows, jax.nn.sigmoid(beta), 0.0) if spec.raw_gates else beta


def _chunk_log_decay(g_ref, A_log_ref, dt_ref, tok, h, rows, spec: PrefillSpec):
    """GDN: the chunk's per-token log decays [C] (from the raw projection when
    spec.raw_gates), 0 past the chunk; for h a slice of heads, [C, heads] (as `_chunk_beta`).
    KDA's per-channel ones are the intra kernel's."""
    g = plgpu.load(g_ref.at[tok, h], mask=rows, other=0).astype(F32)
    if not spec.raw_gates:
        return g
    g = _raw_log_decay(g, A_log_ref[h].astype(F32), dt_ref[h].astype(F32), spec)
    return jnp.where(rows, g, 0.0)


def _chunk_rows(lead, end):
    """The chunk's own rows [C]: from lead (rows of the sequences before it, `chunk_table`) to
    end. Every load and store of a chunk's rows is masked by them: k, q, g and beta 0 on the
    other rows make those rows and columns of A, T beta and the intra-chunk matrix 0."""
    i = lax.broadcasted_iota(jnp.int32, (CHUNK,), 0)
    return (i >= lead) & (i < end)


def _gdn_chunk(k_ref, g_ref, beta_ref, A_log_ref, dt_ref, t0, lead, n, h, hk,
               spec: PrefillSpec, tame: bool = False):
    """What GDN's chunk prep and its TF32 redo both start from: the raw k rows [C, K] (input
    dtype; tame: with their huge rows tamed here, as `tame_rows` does), their L2 norm factors
    rk [C], the cumulative decays (hi, lo) [C], the decays e^{G_i - G_j} [C, C] (0 above the
    diagonal) and beta [C]."""
    C = CHUNK
    rows = _chunk_rows(lead, n)
    tok = pl.ds(t0, C)
    beta = _chunk_beta(beta_ref, tok, h, rows, spec)
    k_in = plgpu.load(k_ref.at[tok, hk, :], mask=rows[:, None], other=0)
    if tame:
        k_in = tame_huge_rows(k_in)
    rk = _l2_factor(k_in, spec.use_qk_l2norm)
    G = _split_cumsum(_chunk_log_decay(g_ref, A_log_ref, dt_ref, tok, h, rows, spec))
    i = lax.broadcasted_iota(jnp.int32, (C, C), 0)
    j = lax.broadcasted_iota(jnp.int32, (C, C), 1)
    seg = (G[0][:, None] - G[0][None, :]) + (G[1][:, None] - G[1][None, :])
    decay = jnp.exp(jnp.where(i >= j, seg, -jnp.inf))                   # e^{G_i - G_j}, j <= i
    return k_in, rk, G, decay, beta


def _gdn_system(k_in, rk, decay, beta, *, precise, interpret):
    """A_ij = beta_i (kn_i . kn_j) e^{G_i - G_j} below the diagonal, 0 elsewhere."""
    C = CHUNK
    i = lax.broadcasted_iota(jnp.int32, (C, C), 0)
    j = lax.broadcasted_iota(jnp.int32, (C, C), 1)
    kk = _dot(k_in, k_in, precise, trans_b=True, interpret=interpret) * (rk[:, None] * rk[None, :])
    return jnp.where(i > j, beta[:, None] * kk * decay, 0.0)


def _half_inverse(spec: PrefillSpec, blocked_inverse: bool) -> bool:
    """Whether (I + A)^-1 is formed with fp16 operands (GDN, 16-bit inputs, the register-tile
    inverse): the prep then stores A in fp16, `_prep_inverse_kernel` inverts it and flags the
    chunks where fp16 did not hold, for `_prep_redo_kernel`. The TF32 fallback runs as a pass
    of its own rather than a branch: a branch's code is allocated registers with the rest of
    the kernel, and the TF32 form's fp32 operands made the prep spill to local memory on every
    chunk (BENCHMARKS.md)."""
    return not spec.per_channel_gate and not spec.precise and not blocked_inverse


def _prep_kernel(start_ref, len_ref, lead_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, A_log_ref,
                 dt_ref, kk_ref, ek_ref, redo_ref, w_in_ref, u_in_ref, tb_ref, w_ref, u_ref,
                 aqk_ref, fq_ref, fk_ref, fw_ref, decay_ref, kk_out_ref, a_ref, *,
                 spec: PrefillSpec, blocked_inverse: bool, prep_cols: int, heads_fastest: bool,
                 redo_only: bool, interpret: bool, kda_t_beta: bool = False):
    # redo_only: W and U as given (aliased by w_ref, u_ref); kda_t_beta: T beta's halves as
    # given (aliased by tb_ref), the flagged chunks' formed again, and no W or U
    del w_in_ref, u_in_ref
    C = CHUNK

    def chunk(s, h):
        hk = h // (spec.num_v_heads // spec.num_k_heads)
        t0, n, lead = start_ref[s], len_ref[s], lead_ref[s]

        @pl.when(n > 0)
        def _():
            rows = _chunk_rows(lead, n)
            rows2 = rows[:, None]
            tok = pl.ds(t0, C)
            load = lambda ref, mask: plgpu.load(ref, mask=mask, other=0).astype(F32)
            store = lambda ref, x, mask: plgpu.store(ref, x.astype(ref.dtype), mask=mask)
            dot = functools.partial(_dot, precise=spec.precise, interpret=interpret)
            i = lax.broadcasted_iota(jnp.int32, (C, C), 0)
            j = lax.broadcasted_iota(jnp.int32, (C, C), 1)

            def invert(A, scratch):
                """T = (I + A)^-1; the blocked form passes its blocks through scratch's rows."""
                if blocked_inverse:
                    return _invert_unit_lower_blocked(A, scratch, t0, h, n, precise=spec.precise,
                                                      interpret=interpret)
                return _invert_unit_lower(A, spec.precise, interpret)

            if spec.per_channel_gate:
                # `_kda_intra_kernel` formed k k^T with the per-channel decays (masked to j < i)
                # and the rows e^G k; what is left is the solve, W = (T beta) (e^G k) and
                # U = (T beta) v.
                beta = _chunk_beta(beta_ref, tok, h, rows, spec)
                if blocked_inverse and not redo_only:
                    # k k^T's buffer is the blocked inverse's scratch (kk_out_ref aliases kk_ref):
                    # read through the ref that is written, below the diagonal only, where the
                    # inverse writes nothing before its first barrier. (redo_only: k k^T may be
                    # fp16, and the scratch is an fp32 buffer of its own)
                    kk = load(kk_out_ref.at[tok, h, :], rows2 & (j < i))
                else:
                    kk = load(kk_ref.at[tok, h, :], rows2)
                Tb = invert(beta[:, None] * kk, kk_out_ref) * beta[None, :]
                if kda_t_beta:
                    # for the Mosaic GPU KDA scan, which forms the deltas from T beta's halves:
                    # every row of the slot's, those past the chunk's end zeros (Tb's are:
                    # beta is zero there), over whatever the fp16 inverse left there
                    _store_split(tb_ref, (tok, h, slice(None)), Tb, None)
                    return
                bf16 = _bf16_rows(ek_ref, v_ref)  # bf16 rows enter the products as they are
                Tb_parts = _split_bf16(Tb) if bf16 else None

                # W and U prep_cols columns at a time: a loop body's registers are reused, so the
                # kernel holds [C, prep_cols] products rather than [C, K] and [C, V] ones
                def w_columns(c, carry):
                    cols = pl.ds(c * prep_cols, prep_cols)
                    ek = _load_parts(lambda ref, mask: plgpu.load(ref, mask=mask, other=0), ek_ref,
                                     (tok, h, cols), rows2)
                    w = _dot_parts(Tb_parts, ek) if bf16 else dot(Tb, ek[0].astype(F32))
                    _store_parts(w_ref, (tok, h, cols), w, rows2)
                    return carry

                def u_columns(c, carry):
                    cols = pl.ds(c * prep_cols, prep_cols)
                    v = plgpu.load(v_ref.at[tok, h, cols], mask=rows2, other=0)
                    u = _dot_bf16x2(Tb, v) if bf16 else dot(Tb, v.astype(F32))
                    plgpu.store(u_ref.at[tok, h, cols], u.astype(u_ref.dtype), mask=rows2)
                    return carry

                lax.fori_loop(0, ek_ref.shape[-1] // prep_cols, w_columns, 0)
                lax.fori_loop(0, v_ref.shape[-1] // prep_cols, u_columns, 0)
            else:
                # GDN: q and k stay raw; their L2 norms and the decays are per-row factors applied
                # to the products (for 16-bit inputs the raw rows are exact tensor-core operands).
                k_in, rk, (G_hi, G_lo), decay, beta = _gdn_chunk(
                    k_ref, g_ref, beta_ref, A_log_ref, dt_ref, t0, lead, n, h, hk, spec)
                q_in = plgpu.load(q_ref.at[tok, hk, :], mask=rows2, other=0)
                rq = _l2_factor(q_in, spec.use_qk_l2norm) * jnp.float32(spec.scale)
                last_hi = jnp.sum(jnp.where(j == C - 1, G_hi[None, :], 0.0), axis=1)  # [C], all G_C
                last_lo = jnp.sum(jnp.where(j == C - 1, G_lo[None, :], 0.0), axis=1)
                eG = jnp.exp(G_hi + G_lo)
                decay_ref[s, h] = jnp.exp(jnp.max(last_hi + last_lo))
                factors = (fq_ref, fk_ref, fw_ref)
                _store_factor(factors, 0, tok, h, rq * eG, rows)
                _store_factor(factors, 1, tok, h, rk * jnp.exp((last_hi - G_hi) + (last_lo - G_lo)),
                              rows)
                _store_factor(factors, 2, tok, h, rk * eG, rows)
                qk = dot(q_in, k_in, trans_b=True) * (rq[:, None] * rk[None, :])
                _store_split(aqk_ref, (tok, h, slice(None)), qk * decay, rows2)
                A = _gdn_system(k_in, rk, decay, beta, precise=spec.precise, interpret=interpret)
                if _half_inverse(spec, blocked_inverse):
                    store(a_ref.at[tok, h, :], A, rows2)  # fp16, for `_prep_inverse_kernel`
                else:
                    # T beta's own rows are the blocked inverse's scratch until T is in registers
                    T = invert(A, tb_ref)
                    if blocked_inverse:  # after every thread's last read of the inverse's blocks
                        _barrier(interpret)
                    store(tb_ref.at[tok, h, :], T * beta[None, :], rows2)

    if redo_only:
        # KDA: the chunks the Mosaic GPU prep flagged; the others' W and U are left as they are
        _each_flagged_chunk(redo_ref, chunk)
    else:
        chunk(*_slot_and_head(heads_fastest))


def _each_flagged_chunk(redo_ref, chunk, plane: int | None = None):
    """chunk(s, h) for each chunk slot s of value head h that redo_ref flags, for the
    REDO_SLOTS slots of this program (grid (cdiv(S, REDO_SLOTS), HV), `_redo_grid`), their
    flags read in one load and walked only in the rare case that one is set: with a program a
    chunk, a pass that usually does nothing spent its time on each program's dependent loads of
    its flag (tens of microseconds at a few thousand chunks).

    redo_ref: [S, HV] (a chunk's flag), or the Mosaic GPU preps' per-row flags [S, HV, C], or
    plane `plane` of [S, HV, P, C]: a chunk is flagged where any of its rows is. Read here
    rather than reduced to [S, HV] by XLA ahead of the launch: one kernel less a call. A flag
    is anything but 0 (NaN included), and chunk(s, h) itself skips empty slots, so the
    unwritten flags of empty slots can cost a walk but never a wrong chunk."""
    blk, h = pl.program_id(0), pl.program_id(1)
    num_slots = redo_ref.shape[0]
    s0 = blk * REDO_SLOTS
    here = s0 + lax.broadcasted_iota(jnp.int32, (REDO_SLOTS,), 0) < num_slots
    per_row = redo_ref.ndim > 2
    at = ((h,) + ((jnp.int32(plane),) if redo_ref.ndim == 4 else ())
          + ((slice(None),) if per_row else ()))

    def any_set(x):
        return (x != 0) if x.ndim == 0 else jnp.max((x != 0).astype(jnp.int32)) != 0

    flags = plgpu.load(redo_ref.at[(pl.ds(s0, REDO_SLOTS),) + at],
                       mask=here[:, None] if per_row else here, other=0)

    @pl.when(any_set(flags))
    def _():
        def slot(i, carry):
            s = jnp.minimum(s0 + i, num_slots - 1)

            @pl.when((s0 + i < num_slots) & any_set(redo_ref[(s,) + at]))
            def _():
                chunk(s, h)
            return carry

        lax.fori_loop(0, REDO_SLOTS, slot, 0)


def _redo_grid(num_slots: int, num_heads: int):
    """The grid of a pass over flagged chunks (`_each_flagged_chunk`)."""
    return (pl.cdiv(num_slots, REDO_SLOTS), num_heads)


def _prep_inverse_kernel(start_ref, len_ref, lead_ref, beta_ref, a_ref, tb_ref, redo_ref, *,
                         spec: PrefillSpec, interpret: bool):
    """T beta = (I + A)^-1 beta with fp16 operands (`_invert_unit_lower(half=True)`) from the
    fp16 A the prep stored, and the chunk's redo flag: 1 where the fp16 form did not fit
    (`_half_inverse_fits`; `_prep_redo_kernel` then forms T beta again in TF32), 0 elsewhere
    and for unused chunk slots. One program per chunk slot and value head, heads fastest.

    A launch of its own rather than the prep's tail: the prep holds q, k and the intra-chunk
    tiles, and with the inverse beside them it ran at the 255-register limit; apart, with A
    passed in fp16 (which the inverse's products round it to anyway), both launches together
    took less time than the one (BENCHMARKS.md, GDN prefill)."""
    s, h = _slot_and_head(True)
    t0, n = start_ref[s], len_ref[s]
    rows = _chunk_rows(lead_ref[s], n)
    tok = pl.ds(t0, CHUNK)
    # A stays fp16 in registers, as the products take it: widened to fp32 it held 32 more
    # registers a thread, and the whole call measured 3% slower (same bits; BENCHMARKS.md)
    A = plgpu.load(a_ref.at[tok, h, :], mask=rows[:, None], other=0)
    T = _invert_unit_lower(A, False, interpret, half=True)
    redo_ref[s, h] = jnp.where(_half_inverse_fits(A, T) | (n == 0), 0, 1).astype(redo_ref.dtype)
    beta = _chunk_beta(beta_ref, tok, h, rows, spec)
    _store_split(tb_ref, (tok, h, slice(None)), T * beta[None, :], rows[:, None])


def _prep_redo_kernel(start_ref, len_ref, lead_ref, k_ref, g_ref, beta_ref, A_log_ref, dt_ref,
                      redo_ref, tb_in_ref, tb_ref, *, spec: PrefillSpec, slot_rows: bool,
                      plane: int | None, interpret: bool):
    """T beta again, with the one-pass TF32 inverse, for the GDN chunks `_prep_inverse_kernel`
    or the Mosaic GPU prep flagged (their fp16 inverse did not fit: `_half_inverse_fits`;
    slot_rows: T beta by chunk slot, as the Mosaic prep lays it, from k rows as given, whose
    huge rows it tames itself with the L2 norm); the other chunks' rows stay
    as they are (tb_ref aliases tb_in_ref). One program per REDO_SLOTS chunk slots of one value
    head (`_each_flagged_chunk`, which reads redo_ref's plane `plane` where it holds per-row
    flags)."""
    del tb_in_ref

    def chunk(s, h):
        hk = h // (spec.num_v_heads // spec.num_k_heads)
        t0, n, lead = start_ref[s], len_ref[s], lead_ref[s]

        @pl.when(n > 0)
        def _():
            k_in, rk, _, decay, beta = _gdn_chunk(
                k_ref, g_ref, beta_ref, A_log_ref, dt_ref, t0, lead, n, h, hk, spec,
                tame=slot_rows and spec.use_qk_l2norm)
            A = _gdn_system(k_in, rk, decay, beta, precise=False, interpret=interpret)
            T = _invert_unit_lower(A, False, interpret)
            rows = _chunk_rows(lead, n)[:, None]
            # T beta's rows by token, or by chunk slot (`gdn_prefill_mgpu.prep`'s)
            at = pl.ds(s * CHUNK if slot_rows else t0, CHUNK)
            _store_split(tb_ref, (at, h, slice(None)), T * beta[None, :], rows)

    _each_flagged_chunk(redo_ref, chunk, plane)


# ---------------------------------------------------------------- KDA: intra-chunk products

def _kda_intra_kernel(start_ref, len_ref, q_ref, k_ref, g_ref, A_log_ref, dt_ref, *refs,
                      spec: PrefillSpec, block_k: int, heads_fastest: bool, zero_tail: bool,
                      diagonal: str, interpret: bool):
    """KDA's per-channel work for chunk slot s, value head h, on whole-chunk [C, block_k] tiles.

    Writes kk_ij = sum_c kn_ic kn_jc e^{G_ic - G_jc} (j < i, zero elsewhere, without beta) and
    aqk_ij = sum_c qn_ic kn_jc e^{G_ic - G_jc} (j <= i, zero above), the decayed rows the scan and
    deltas take (qn e^G, kn e^{G_C - G}, e^G kn) and the chunk's total decay e^{G_C} per channel (kn,
    qn: the L2-normalised rows, qn also scaled).

    e^{G_i - G_j} across a whole chunk can exceed fp32 (a lower-bound gate of -5 spans up to
    320), so the products factor through reference rows of the chunk's two SUB-row blocks, with
    every exponent bounded:
    - j in the first block, i in the second: through l, the first block's last row,
          e^{G_i - G_j} = e^{G_i - G_l} e^{G_l - G_j},   both exponents <= 0;
      one [C, block_k] x [block_k, C] product (the first factor masked to the second block's
      rows, the second to the first block's), whose other entries are zero;
    - i, j in one block: through the block's middle row m, e^{+-(G - G_m)} on the two sides, one
      product for both blocks (its entries across blocks are not kept), when |G_ic - G_mc| <=
      `_diag_exp_limit` for the chunk's rows and the step's channels (always, for the
      lower-bound gate with normalised 16-bit rows: `_factored_diagonal_always_safe`), else
      exactly, column by column (`_exact_diagonal_blocks`).
    A factor that underflows drops only a term far below the unit diagonal (`_diag_exp_limit`).
    Entries above the diagonal may overflow (up to e^160 x the rows' product): the final masks
    select them away, nothing multiplies them.

    The reference rows travel through rows_ref, this program's scratch in global memory
    [2, REF_SLOTS * NUM_SUB, block_k] (two buffers of REF_SLOTS rows per block): a masked store
    of G at the rows that matter, one barrier, then loads of single rows, selected per block
    (and in the exact form, gathers: a row index per tile row). Picking a row out of a register
    tile instead takes a reduction across the tile's rows, which crosses warps (shared memory
    and a barrier each).

    zero_tail (the Mosaic GPU KDA scan's calls, whose sequences all start at multiples of C):
    aqk, fq and fk have their rows rounded up to whole 8-row tiles, and a chunk cut short by the
    end of the tokens also writes its rows past the tokens, as zeros (the rows are zero there:
    no other sequence's rows follow), so that the scan's bulk copies read no unwritten rows.

    diagonal (`_intra_diagonal`), the diagonal blocks' form:
    - "factored": always factored (the gate form bounds every exponent: refs are kk, aqk, fq,
      fk, ek, decay, rows and an unused flag_ref);
    - "flagged": always factored, and flag_ref [S, HV] int32 set to 1 where some
      channel step's exponents exceed the limit (NaN included), 0 elsewhere (empty chunk
      slots included, so the "redo" pass reads the flags as they are): that item's kk and aqk
      may hold overflowed terms and are formed again by the "redo" pass;
    - "redo": for the chunk slots redo_ref [S, HV] flags only (a grid of `_redo_grid`,
      `_each_flagged_chunk`), each channel step's diagonal blocks factored where its exponents
      allow it, else exact (`_exact_diagonal_blocks`); it stores kk and aqk only (refs:
      redo_ref, kk and aqk in, kk and aqk out (aliased), rows)."""
    if diagonal == "redo":
        redo_ref, _, _, kk_ref, aqk_ref, rows_ref = refs
        fq_ref = fk_ref = ek_ref = decay_ref = flag_ref = None
    else:
        kk_ref, aqk_ref, fq_ref, fk_ref, ek_ref, decay_ref, rows_ref, flag_ref = refs
    item = functools.partial(_kda_intra_item, start_ref, len_ref, q_ref, k_ref, g_ref,
                             A_log_ref, dt_ref, kk_ref, aqk_ref, fq_ref, fk_ref, ek_ref,
                             decay_ref, rows_ref, flag_ref, spec=spec, block_k=block_k,
                             zero_tail=zero_tail, diagonal=diagonal, interpret=interpret)
    if diagonal == "redo":
        _each_flagged_chunk(redo_ref, item)
    else:
        item(*_slot_and_head(heads_fastest))


def _kda_intra_item(start_ref, len_ref, q_ref, k_ref, g_ref, A_log_ref, dt_ref, kk_ref,
                    aqk_ref, fq_ref, fk_ref, ek_ref, decay_ref, rows_ref, flag_ref, s, h, *,
                    spec: PrefillSpec, block_k: int, zero_tail: bool, diagonal: str,
                    interpret: bool):
    """`_kda_intra_kernel`'s work for chunk slot s and value head h."""
    hk = h // (spec.num_v_heads // spec.num_k_heads)
    t0, n = start_ref[s], len_ref[s]
    C, K = CHUNK, spec.head_k_dim
    write_rows = diagonal != "redo"

    @pl.when(n > 0)
    def _():
        row = lax.broadcasted_iota(jnp.int32, (C,), 0)
        live = (row < n)[:, None]
        # the rows the scan's arrays take from this chunk (`zero_tail`)
        out_live = (row < aqk_ref.shape[0] - t0)[:, None] if zero_tail else live
        tok = pl.ds(t0, C)
        load = lambda ref: plgpu.load(ref, mask=live, other=0).astype(F32)
        dot = functools.partial(_dot, precise=spec.precise, interpret=interpret, trans_b=True)
        # The products below the diagonal blocks take operands bounded by the rows' scale (the
        # decays there are <= 1): with 16-bit inputs the rows are bounded by one
        # (`_intra_rows_bounded`), and fp16 holds them with one-pass TF32's significand at
        # twice its tensor-core rate. The diagonal blocks' factors e^{+-(G - G_m)} reach e^80,
        # beyond fp16: those stay TF32.
        rows_bounded = _intra_rows_bounded(spec)
        bounded = lambda x: x.astype(jnp.float16 if rows_bounded else F32)
        limit = _diag_exp_limit(spec) * LOG2E
        monotone = _monotone_gate_sums(spec)
        # The gates and their sums run in log2 units: every decay is then one exp2 (those of
        # the products' operands and of the decayed rows one ex2.approx with 16-bit inputs),
        # with no product by log2 e before it; the raw gates take the unit into a constant
        # they have anyway
        approx_math = not interpret and not spec.precise
        operand_exp = functools.partial(_operand_exp2, approx=approx_math)
        exchange = _BlockRowExchange(rows_ref, (s, h), block_k, interpret)

        def gate(cols):
            """The chunk's log decays in the channels cols, [C, block_k] (0 past the chunk)."""
            g = load(g_ref.at[tok, h, cols])
            if not spec.raw_gates:
                return g * LOG2E
            dt = dt_ref[pl.ds(h * K + cols.start, cols.size)][None, :].astype(F32)
            return jnp.where(live, _raw_log_decay(g, A_log_ref[h].astype(F32), dt, spec,
                                                  unit=LOG2E, approx=approx_math), 0.0)

        def row_pass(step, init):
            """step(k, q, acc) over the rows' column blocks, k and q [C, block_k] fp32."""
            def body(c, acc):
                cols = pl.ds(c * block_k, block_k)
                return step(load(k_ref.at[tok, hk, cols]), load(q_ref.at[tok, hk, cols]), acc)
            return lax.fori_loop(0, K // block_k, body, init)

        row_zero = jnp.zeros((C,), F32)
        # The rows the products take are k tk rk and q tq rq. Without the norm rk is 1 and rq
        # the scale; the factors that scale the products and decayed rows back to the raw rows'
        # scale (`raw`) are set only where the kernel scales raw rows by powers of two.
        rk, rq = jnp.ones((C,), F32), jnp.full((C,), spec.scale, F32)
        unscale_k = unscale_q = None
        if spec.use_qk_l2norm:
            # The only kernel that reads KDA's raw q and k rows (the launcher tames no rows for
            # KDA), and it only scales them: huge rows are tamed here (`_tamed_l2_factor`).
            sums = row_pass(lambda k, q, sums: (*_row_square_sums(k, sums[:3]),
                                                *_row_square_sums(q, sums[3:])), (row_zero,) * 6)
            tk, rk = _tamed_l2_factor(*sums[:3])
            tq, rq = _tamed_l2_factor(*sums[3:])
            rq = rq * jnp.float32(spec.scale)
        elif rows_bounded:
            # the raw rows bounded by one (`_intra_rows_bounded`): each scaled by the power of
            # two that brings its largest entry into [0.5, 1), and every product and decayed
            # row scaled back before it is stored
            mk, mq = row_pass(lambda k, q, m: (jnp.maximum(m[0], jnp.max(jnp.abs(k), axis=1)),
                                               jnp.maximum(m[1], jnp.max(jnp.abs(q), axis=1))),
                              (row_zero, row_zero))
            (tk, unscale_k), (tq, unscale_q) = _pow2_row_scale(mk), _pow2_row_scale(mq)
        else:
            tk = tq = jnp.ones((C,), F32)

        def raw(x, row_factor, col_factor=None):
            """x's rows (and columns) at the raw rows' scale: times their `_pow2_row_scale`
            inverses (exact), or x itself where the kernel's rows are the raw ones."""
            if row_factor is None:
                return x
            x = x * row_factor[:, None]
            return x if col_factor is None else x * col_factor[None, :]

        i = lax.broadcasted_iota(jnp.int32, (C, C), 0)
        j = lax.broadcasted_iota(jnp.int32, (C, C), 1)
        same_block = (i // SUB) == (j // SUB)
        second = lax.broadcasted_iota(jnp.int32, (C, 1), 0) >= SUB      # the second block's rows
        # scratch slots of the reference rows: last rows (hi, lo), middle rows (hi, lo)
        LAST, MID = (0, 1), (2, 3)

        def channels(c, acc):
            kk, qk, over = acc
            cols = pl.ds(c * block_k, block_k)
            G = _kda_gate_sums(gate(cols), spec)                           # rows past n add 0
            kn = load(k_ref.at[tok, hk, cols]) * tk[:, None] * rk[:, None]
            qn = load(q_ref.at[tok, hk, cols]) * tq[:, None] * rq[:, None]
            # Step c shares its reference rows through buffer c % 2. Step c + 1 stores into the
            # other buffer, so its stores cannot race this step's loads; the next store into
            # this buffer (step c + 2, or the exact fallback's second column, which alternates
            # buffers too, SUB times: an even count) comes after a barrier of a use in between,
            # which every thread reaches only after issuing this step's loads. So one barrier
            # per use orders both the stores before the loads and the loads before the stores
            # that overwrite them.
            buf = lax.rem(c, 2)
            parts = range(len(G))
            exchange.share(buf, [(G[p], ((SUB - 1, LAST[p]), (SUB // 2, MID[p]))) for p in parts])
            first_last, chunk_last = (tuple(exchange.row(buf, LAST[p], a) for p in parts)
                                      for a in range(NUM_SUB))
            if write_rows:
                # The decayed rows first: their tiles are done with before the products'
                # operands and results are formed, so fewer registers spill (ptxas;
                # BENCHMARKS.md). Their decays too take `operand_exp` (its error and what it
                # flushes: `_operand_exp2`); e^{G_C}, which scales the state, stays precise
                eG = operand_exp(sum(G[1:], G[0]))
                plgpu.store(fq_ref.at[tok, h, cols],
                            raw(qn * eG, unscale_q).astype(fq_ref.dtype), mask=out_live)
                _store_parts(ek_ref, (tok, h, cols), raw(kn * eG, unscale_k), live)
                _store_split(fk_ref, (tok, h, cols),
                             raw(kn * operand_exp(_gate_diff(chunk_last, G)), unscale_k),
                             out_live)
                # the last row is the whole chunk's G_C (its rows past n hold gates of 0)
                decay_ref[s, h, cols] = jnp.exp2(sum(chunk_last[1:], chunk_last[0]))[0]
            # Below the diagonal blocks, through the first block's last row: its rows decay
            # towards it (k e^{G_l - G}), the second block's from it (e^{G - G_l}); G falls
            # along the chunk, so both exponents are <= 0 and one exponential serves both
            to_first_last = _gate_diff(G, first_last)
            e = operand_exp(jnp.where(second, to_first_last, -to_first_last))   # <= 1
            k_first = bounded(jnp.where(second, 0.0, kn * e))
            kk = kk + dot(bounded(jnp.where(second, kn * e, 0.0)), k_first)
            qk = qk + dot(bounded(jnp.where(second, qn * e, 0.0)), k_first)
            # each row's own block's middle row
            mid_rows = tuple((exchange.row(buf, MID[p], 0), exchange.row(buf, MID[p], 1))
                             for p in parts)
            mid = _gate_diff(G, tuple(jnp.where(second, m1, m0) for m0, m1 in mid_rows))

            def factored():
                up, down = operand_exp(mid), kn * operand_exp(-mid)
                return dot(kn * up, down), dot(qn * up, down)

            if diagonal == "redo":
                exact = functools.partial(_exact_diagonal_blocks, kn, qn, G, exchange, 1 - buf)
                kk_d, qk_d = lax.cond(jnp.max(jnp.abs(mid)) <= limit, factored, exact)
            else:
                kk_d, qk_d = factored()
                if diagonal == "flagged" and monotone:
                    # The blocks' exponents from their reference rows alone, a [1, block_k]
                    # reduction instead of a [C, block_k] one: the first block's sums lie
                    # between the chunk's start (G = 0) and its last row's, the second's
                    # between the first block's last row's and the chunk's last row's
                    (m0, m1), = mid_rows
                    l0, l1 = first_last[0], chunk_last[0]
                    span = jnp.maximum(jnp.maximum(-m0, m0 - l0), jnp.maximum(l0 - m1, m1 - l1))
                    over = jnp.maximum(over, jnp.max(span, axis=1))
                elif diagonal == "flagged":
                    # each row's largest exponent, reduced across the tile's rows once after
                    # the last step (a reduction along a row stays inside a warp)
                    over = jnp.maximum(over, jnp.max(jnp.abs(mid), axis=1))
            kk = jnp.where(same_block, kk + kk_d, kk)
            qk = jnp.where(same_block, qk + qk_d, qk)
            return kk, qk, over

        zero = jnp.zeros((C, C), F32)
        kk, qk, over = lax.fori_loop(0, K // block_k, channels,
                                     (zero, zero, jnp.zeros((C,), F32)))
        if diagonal == "flagged":
            # the redo's test, per step there (a NaN fails it)
            flag_ref[s, h] = jnp.where(jnp.max(over) <= limit, 0, 1).astype(flag_ref.dtype)
        kk, qk = raw(kk, unscale_k, unscale_k), raw(qk, unscale_q, unscale_k)
        plgpu.store(kk_ref.at[tok, h, :], jnp.where(j < i, kk, 0.0).astype(kk_ref.dtype),
                    mask=live)
        plgpu.store(aqk_ref.at[tok, h, :], jnp.where(j <= i, qk, 0.0).astype(aqk_ref.dtype),
                    mask=out_live)

    if diagonal == "flagged":
        @pl.when(n == 0)
        def _():
            flag_ref[s, h] = jnp.zeros((), flag_ref.dtype)


class _BlockRowExchange:
    """Rows of [C, n] register tiles, picked per SUB-row block, through a program's scratch in
    global memory, ref[at] [2, REF_SLOTS * (C // SUB), n] fp32 (two buffers; slot k of block a
    is row k * (C // SUB) + a).

    `share` stores the picked rows with one masked store per tile, then waits at a barrier for
    the whole thread block's stores (a CTA barrier orders global memory among its threads; in
    interpret mode the program runs alone and needs none, and the barrier has no interpret
    rule). Its caller alternates buffers from one `share` to the next, so that this barrier
    also orders the loads of the buffer's previous contents before the stores that replace
    them."""

    def __init__(self, ref, at: tuple, n: int, interpret: bool):
        # ref and the program's leading indices at apart: interpret mode cannot index a view
        # of a ref again with index arrays
        self.ref, self.at, self.interpret = ref, at, interpret
        self.nb = CHUNK // SUB
        rows = lax.broadcasted_iota(jnp.int32, (CHUNK, n), 0)
        self.in_block, self.block = rows % SUB, rows // SUB
        self.lane = lax.broadcasted_iota(jnp.int32, (CHUNK, n), 1)

    def share(self, buf, tiles):
        """For each (x, picks) in tiles and (r, slot) in picks (r static or traced): row
        SUB * a + r of x into slot `slot` of block a, in buffer buf, for every block a."""
        end = REF_SLOTS * self.nb
        for x, picks in tiles:
            # rows that are not picked point one past the buffer's rows, and are masked off: no
            # access on the GPU, dropped as out of bounds in interpret mode (a row index shared
            # with a picked row would make the interpreter's scatter write it twice, in no
            # defined order)
            dest = jnp.full(x.shape, end, jnp.int32)
            for r, slot in picks:
                dest = jnp.where(self.in_block == r, slot * self.nb + self.block, dest)
            plgpu.store(self.ref.at[(*self.at, buf, dest, self.lane)], x, mask=dest < end)
        _barrier(self.interpret)

    def row(self, buf, slot, a):
        """Block a's row in slot, [1, n]."""
        # the row index as an array: interpret mode's load takes no Python int beside a slice
        row = jnp.int32(slot * self.nb + a)
        return plgpu.load(self.ref.at[(*self.at, buf, row, slice(None))])[None, :]

    def spread(self, buf, slot):
        """[C, n]: every row holds its own block's row in slot (a gather)."""
        return plgpu.load(self.ref.at[(*self.at, buf, slot * self.nb + self.block, self.lane)])


def _exact_diagonal_blocks(kn, qn, G, exchange, buf):
    """The diagonal SUB x SUB blocks of k k^T and q k^T for a whole chunk, kn, qn, G (its parts,
    `_kda_gate_sums`) [C, n] in log2 units, with every decay 2^{G_ic - G_jc} (j <= i) formed
    exactly: step r forms column r of every block at once, from row r of every block (spread
    over the block by `exchange`, _BlockRowExchange, starting in buffer buf and alternating: SUB
    is even, so the next user finds the buffers alternating still). Entries outside the blocks
    are zero."""
    C = kn.shape[0]
    block = lax.broadcasted_iota(jnp.int32, (C, 1), 0) // SUB
    in_block = lax.broadcasted_iota(jnp.int32, (C, 1), 0) % SUB
    col = lax.broadcasted_iota(jnp.int32, (C, C), 1)

    def column(r, mats):
        kk, qk = mats
        b = lax.rem(buf + r, 2)
        parts = len(G)
        exchange.share(b, [(x, ((r, slot),)) for slot, x in enumerate((*G, kn))])
        *g_r, k_r = (exchange.spread(b, slot) for slot in range(parts + 1))
        e = jnp.exp2(jnp.where(in_block >= r, _gate_diff(G, g_r), -jnp.inf))
        kc = k_r * e
        at = col == block * SUB + r
        return (jnp.where(at, jnp.sum(kn * kc, axis=1, keepdims=True), kk),
                jnp.where(at, jnp.sum(qn * kc, axis=1, keepdims=True), qk))

    zero = jnp.zeros((C, C), F32)
    return lax.fori_loop(0, SUB, column, (zero, zero))


# --------------------------------------------------------------------------- kernel 2: state scan

def _scan_kernel(cu_ref, order_ref, first_ref, slots_ref, q_ref, k_ref, v_ref, tb_ref, w_ref,
                 u_ref, aqk_ref, fq_ref, fk_ref, fw_ref, decay_ref, h0_ref, o_ref, hT_ref, hb_ref,
                 *, spec: PrefillSpec, block_v: int, pair_group: int, interpret: bool):
    # One program per (sequence, value head, column block), launched column blocks fastest, then
    # heads, then sequences longest first (`order_ref`): the GPU starts programs in launch order,
    # so a packed batch's longest walks start in the first wave rather than wait for a late one
    # and run on alone after the rest.
    p, nv = pl.program_id(0), spec.head_v_dim // block_v
    jv, h = p % nv, (p // nv) % spec.num_v_heads
    n = order_ref[p // (nv * spec.num_v_heads)]
    hk = h // (spec.num_v_heads // spec.num_k_heads)
    C, K = CHUNK, spec.head_k_dim
    cols = pl.ds(jv * block_v, block_v)
    bos, eos = cu_ref[n], cu_ref[n + 1]
    num_chunks = (eos - bos + C - 1) // C
    first = first_ref[n]
    dot = functools.partial(_dot, precise=spec.precise, interpret=interpret)

    if spec.pooled:
        slot = slots_ref[n]
        live = (slot >= 0) & (slot < h0_ref.shape[0])
        safe = jnp.where(live, slot, 0)
        S = plgpu.load(h0_ref.at[safe, h, :, cols], mask=jnp.full((K, block_v), live),
                       other=0).astype(F32)
    elif spec.has_initial_state:
        S = h0_ref[n, h, :, cols].astype(F32)
    else:
        S = jnp.zeros((K, block_v), F32)

    # bf16 rows (raw q and k; KDA's W and decayed q, stored in the input dtype) enter the
    # products as they are, against the fp32 state and deltas split in two bf16 halves.
    bf16_rows = _bf16_rows(q_ref, k_ref, v_ref)
    row_dot = functools.partial(_dot_bf16x2, paired=pair_group) if bf16_rows else dot

    def chunk(c, S):
        t0 = bos + c * C
        rows = lax.broadcasted_iota(jnp.int32, (C,), 0) < eos - t0
        rows2 = rows[:, None]
        tok = pl.ds(t0, C)
        load32 = lambda ref, mask: plgpu.load(ref, mask=mask, other=0).astype(F32)
        load = (lambda ref, mask: plgpu.load(ref, mask=mask, other=0)) if bf16_rows else load32
        # Loads in the order of use: the operands of the first product on the state's chain
        # (W S; GDN: k S, then T beta times it) first (measured: KDA's scan took 25% longer at
        # B=8 with W and U loaded last).
        if spec.per_channel_gate:  # decayed, normalised q and k rows come from the prep
            # W in parts (`_kda_parts`): for bf16 inputs W S takes its hi and lo parts against
            # the split state (three bf16 products)
            w = _load_parts(load, w_ref, (tok, h, slice(None)), rows2)
            u, aqk = load32(u_ref.at[tok, h, cols], rows2), load32(aqk_ref.at[tok, h, :], rows2)
            delta = u - (_dot_parts(w, _split_bf16(S)) if bf16_rows else dot(w[0], S))
            q, k = load(fq_ref.at[tok, h, :], rows2), load32(fk_ref.at[tok, h, :], rows2)
            o = row_dot(q, S) + dot(aqk, delta)
            S = S * decay_ref[first + c, h, :][:, None] + dot(k, delta, trans_a=True)
        else:  # raw q and k rows with per-row factors
            q, k = load(q_ref.at[tok, hk, :], rows2), load(k_ref.at[tok, hk, :], rows2)
            fw = load32(fw_ref.at[tok, h], rows)
            tb, aqk = load32(tb_ref.at[tok, h, :], rows2), load32(aqk_ref.at[tok, h, :], rows2)
            # U - W S = (T beta) (v - (e^G k) S): the prep stored T beta, not W and U
            delta = dot(tb, load32(v_ref.at[tok, h, cols], rows2) - row_dot(k, S) * fw[:, None])
            fq, fk = load32(fq_ref.at[tok, h], rows), load32(fk_ref.at[tok, h], rows)
            o = row_dot(q, S) * fq[:, None] + dot(aqk, delta)
            S = S * decay_ref[first + c, h] + row_dot(k, delta * fk[:, None], trans_a=True)
        if spec.pooled:
            o = jnp.where(live, o, 0.0)
        plgpu.store(o_ref.at[tok, h, cols], o.astype(o_ref.dtype), mask=rows2)
        if spec.boundary_states:
            hb_ref[first + c, h, :, cols] = S.astype(hb_ref.dtype)
        return S

    S = lax.fori_loop(0, num_chunks, chunk, S)
    if spec.pooled:
        plgpu.store(hT_ref.at[safe, h, :, cols], S.astype(hT_ref.dtype),
                    mask=jnp.full((K, block_v), live))
    elif spec.output_final_state:
        hT_ref[n, h, :, cols] = S.astype(hT_ref.dtype)


# --------------------------------------------------------------------------- launchers


def _kda_intra(q, k, g, start, length, A_log, dt_bias, *, rows_dtype, spec, block, interpret,
               prep_rows=None):
    """KDA's intra-chunk products and decayed rows: (kk, aqk, fq, fk, ek, decay). With
    prep_rows (for the Mosaic GPU prep), kk and ek, which only the prep reads, have that many
    rows (the rows past the tokens are left unwritten), and kk is stored in fp16 where bounded
    by one (the prep's fp16 inverse rounds A to fp16 anyway); else one row a token, kk fp32.
    With block.mosaic_kda_scan, aqk, fq and fk have prep_rows rows too, those past the tokens
    zeros (`_kda_intra_kernel`'s zero_tail), as the Mosaic GPU KDA scan's bulk copies take them."""
    T_total, HV, K = g.shape
    kk_dtype = F32 if prep_rows is None else _bounded_dtype(spec)
    prep_rows = T_total if prep_rows is None else prep_rows
    # KDA's decayed q rows only feed the output, so for bf16 inputs they are stored in bf16
    # (exact tensor-core operands, half the scan's reads of them; the output is rounded to bf16
    # anyway). The decayed k rows build the state: in bf16 they cost the final state ~5x its
    # error against float64 (BENCHMARKS.md, KDA prefill), and in fp16 (which holds the
    # significand the scan's one-pass TF32 products keep, but not their exponent range) rows
    # decayed below 2^-14 lose digits and below 2^-24 vanish, so a final state made of such
    # rows alone (strong decays after the last write) lost them: they go through memory in
    # fp32. q k^T does in fp16 where bounded by 1 (each output row holds its own token's term,
    # not decayed), else in fp32. e^G k (for W) is stored in the input dtype, for bf16
    # inputs as hi and lo bf16 parts (`_kda_parts`; one bf16 part costs the state its digits
    # when the state is large beside the values, BENCHMARKS.md).
    q_rows_dtype = rows_dtype if rows_dtype == jnp.bfloat16 else F32
    parts = _kda_parts(rows_dtype)
    bounded_dtype = _bounded_dtype(spec)
    # the scan's rows: for the Mosaic GPU KDA scan (whose calls take the Mosaic prep, so
    # prep_rows is aligned) in whole 8-row tiles, the rows past the tokens written as zeros
    zero_tail = block.mosaic_kda_scan
    scan_rows = prep_rows if zero_tail else T_total
    rows = (scan_rows, HV, K)
    num_slots = start.shape[0]
    # (arrays, so that the redo pass's aliased inputs keep their indices)
    A_log = jnp.zeros((HV,), F32) if A_log is None else A_log
    dt_bias = jnp.zeros((HV * K,), F32) if dt_bias is None else dt_bias
    diagonal = _intra_diagonal(spec)
    flagged = diagonal == "flagged"

    def scratch(block_k):
        """Each program's scratch for its reference rows (`_BlockRowExchange`; a quarter of
        k k^T's size at block_k 32), not returned."""
        return jax.ShapeDtypeStruct((num_slots, HV, 2, REF_SLOTS * CHUNK // SUB, block_k), F32)

    kernel = functools.partial(_kda_intra_kernel, spec=spec, heads_fastest=block.heads_fastest,
                               zero_tail=zero_tail, interpret=interpret)
    *outputs, _, flags = pl.pallas_call(
        functools.partial(kernel, block_k=block.block_k, diagonal=diagonal),
        # k k^T e^{G_i - G_j}, j < i
        out_shape=(jax.ShapeDtypeStruct((prep_rows, HV, CHUNK), kk_dtype),
                   # q k^T e^{G_i - G_j}, j <= i
                   jax.ShapeDtypeStruct((scan_rows, HV, CHUNK), bounded_dtype),
                   jax.ShapeDtypeStruct(rows, q_rows_dtype),         # q: norm * scale * e^G
                   # k: norm * e^{G_C - G} (bf16 halves for the Mosaic GPU KDA scan, else
                   # fp32, as said above)
                   jax.ShapeDtypeStruct((2,) + rows, jnp.bfloat16) if block.mosaic_kda_scan
                   else jax.ShapeDtypeStruct(rows, F32),
                   # e^G k: norm * e^G, in parts (`_kda_parts`)
                   jax.ShapeDtypeStruct((parts, prep_rows, HV, K), rows_dtype),
                   jax.ShapeDtypeStruct((num_slots, HV, K), F32),    # e^{G_C}
                   scratch(block.block_k))
        # 1 where the item's exponents exceed the factored form's limit (0 for empty chunk
        # slots), or a placeholder
        + (jax.ShapeDtypeStruct((num_slots, HV) if flagged else (1, 1), jnp.int32),),
        grid=_chunk_grid(num_slots, HV, block.heads_fastest),
        compiler_params=plgpu.CompilerParams(num_warps=block.num_warps_intra,
                                             num_stages=block.num_stages_intra),
        interpret=interpret,
        name="kda_prefill_intra",
    )(start, length, q, k, g, A_log, dt_bias)
    if flagged:
        # the flags are written for every slot: `_each_flagged_chunk` reads them as they are
        redo_block_k = min(block.block_k, INTRA_REDO_BLOCK_K)
        kk, aqk, *rest = outputs
        kk, aqk, _ = pl.pallas_call(
            functools.partial(kernel, block_k=redo_block_k, diagonal="redo"),
            out_shape=(jax.ShapeDtypeStruct(kk.shape, kk.dtype),
                       jax.ShapeDtypeStruct(aqk.shape, aqk.dtype), scratch(redo_block_k)),
            grid=_redo_grid(num_slots, HV),
            input_output_aliases={8: 0, 9: 1},
            compiler_params=plgpu.CompilerParams(num_warps=block.num_warps_intra,
                                                 num_stages=block.num_stages_intra),
            interpret=interpret,
            name="kda_prefill_intra_redo",
        )(start, length, q, k, g, A_log, dt_bias, flags, kk, aqk)
        outputs = (kk, aqk, *rest)
    return tuple(outputs)


def _intra_diagonal(spec: PrefillSpec) -> str:
    """How KDA's intra kernel forms its diagonal blocks (`_kda_intra_kernel`'s diagonal):
    factored only where the gate form bounds their exponents, else factored and flagged where
    they did not fit, the flagged items formed again (exactly where needed) by a second pass.
    With gate sums that fall along the chunk (`_monotone_gate_sums`: the raw gates) the flag
    takes each block's exponents from its reference rows, not from every row.
    A single pass that chose per channel step carried the exact form's code and registers in
    every item, and took 64 key channels a step only at a loss (BENCHMARKS.md, KDA prefill)."""
    return "factored" if _factored_diagonal_always_safe(spec) else "flagged"


def _prep(q, k, v, g, beta, start, length, lead, A_log, dt_bias, *, spec, block, interpret):
    """Everything the scan needs that does not depend on the state:
    (T beta, W, U, aqk, fq, fk, fw, decay), see `_scan_kernel`; (1, 1, 1) placeholders for what
    the gate form does not use (GDN: W, U; KDA: T beta, fw)."""
    T_total, HV, V, K = q.shape[0], v.shape[1], v.shape[2], q.shape[2]
    kda = spec.per_channel_gate
    redo = None
    if kda:
        # the Mosaic prep's bulk copies take kk's and e^G k's rows in whole 8-row tiles
        prep_rows = (pl.cdiv(T_total, mgpu_scan.ALIGN) * mgpu_scan.ALIGN
                     if block.mosaic_kda_prep else None)
        kk, aqk, fq, fk, ek, decay = _kda_intra(q, k, g, start, length, A_log, dt_bias,
                                                rows_dtype=v.dtype, spec=spec, block=block,
                                                interpret=interpret, prep_rows=prep_rows)
        if block.mosaic_kda_prep:
            if v.dtype != jnp.bfloat16:
                raise ValueError(f"mosaic_kda_prep takes bf16 inputs, got v of {v.dtype}")
            redo = _mosaic_kda_prep(v, beta, start, length, kk, ek, spec=spec,
                                    t_beta=block.mosaic_kda_scan, interpret=interpret)
    else:
        kk = ek = jnp.zeros((1, 1, 1), F32)  # unused placeholders
    # GDN stores T beta and the scan forms the deltas (T beta)(v - (e^G k) S): a [C, C] matrix
    # instead of W and U, and no [C, C] x [C, K] products here. KDA keeps W and U: its scan
    # would load e^G k rows besides its decayed q and k, and lost more than its prep gained
    # (BENCHMARKS.md, GDN prefill). T beta, U and the intra-chunk matrix go through memory in
    # fp32, W in the input dtype, in parts (`_kda_parts`; see the module docstring: with 16-bit
    # copies a near-singular chunk loses the output's digits).
    only = lambda cond, shape, dtype=F32: jax.ShapeDtypeStruct(shape if cond else (1, 1, 1),
                                                               dtype)
    # KDA's blocked inverse takes k k^T's rows as its scratch (an output aliasing the input, its
    # contents afterwards unused); GDN's takes T beta's own rows before T beta is written.
    blocked = block.blocked_inverse_for(spec)
    kda_scratch = kda and blocked
    half_inverse = _half_inverse(spec, blocked)
    placeholder = jnp.zeros((1, 1, 1), F32)
    # redo_only: W and U (t_beta: T beta's halves) from the Mosaic prep, the Triton prep
    # writing the flagged chunks' in place (slot rows are token rows for aligned chunks)
    t_beta = redo is not None and block.mosaic_kda_scan
    flags, w_in, u_in = (jnp.zeros((1, 1), jnp.int32), placeholder, placeholder) if redo is None \
        else redo
    aliases = {10: 8} if kda_scratch and redo is None else {}
    if redo is not None:
        aliases.update({13: 0} if t_beta else {13: 1, 14: 2})
    *outs, _, A = pl.pallas_call(
        functools.partial(_prep_kernel, spec=spec, blocked_inverse=blocked,
                          heads_fastest=block.heads_fastest,
                          prep_cols=min(block.prep_cols, K, V), redo_only=redo is not None,
                          kda_t_beta=t_beta, interpret=interpret),
        # T beta = (I + A)^-1 beta (with the fp16 inverse, `_prep_inverse_kernel` forms it;
        # KDA's Mosaic prep with t_beta, its halves)
        out_shape=(jax.ShapeDtypeStruct(w_in.shape, w_in.dtype) if t_beta
                   else only(not kda and not half_inverse, (T_total, HV, CHUNK)),
                   # W, in parts like e^G k
                   only(kda and not t_beta, (_kda_parts(v.dtype), T_total, HV, K), v.dtype)
                   if redo is None or t_beta else jax.ShapeDtypeStruct(w_in.shape, w_in.dtype),
                   only(kda and not t_beta, (T_total, HV, V))    # U
                   if redo is None or t_beta else jax.ShapeDtypeStruct(u_in.shape, u_in.dtype),
                   # q k^T e^{G_i - G_j}
                   only(not kda, (T_total, HV, CHUNK), _bounded_dtype(spec)),
                   only(not kda, (T_total, HV)),                 # q: norm * scale * e^G
                   only(not kda, (T_total, HV)),                 # k: norm * e^{G_C - G}
                   only(not kda, (T_total, HV)),                 # k: norm * e^G
                   only(not kda, (start.shape[0], HV)),          # e^{G_C}
                   only(kda_scratch, kk.shape),                  # k k^T (the inverse's scratch)
                   only(half_inverse, (T_total, HV, CHUNK), jnp.float16)),  # A, for the inverse
        grid=(_chunk_grid(start.shape[0], HV, block.heads_fastest) if redo is None
              else _redo_grid(start.shape[0], HV)),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=block.num_warps_prep, num_stages=1),
        interpret=interpret,
        name="gdn_prefill_prep" if redo is None else "kda_prefill_prep_redo",
    )(start, length, lead, q, k, v, g, beta, A_log, dt_bias, kk, ek, flags, w_in, u_in)
    tb, w, u, *gdn_outputs = outs
    if half_inverse:
        tb, redo = pl.pallas_call(
            functools.partial(_prep_inverse_kernel, spec=spec, interpret=interpret),
            out_shape=(jax.ShapeDtypeStruct((T_total, HV, CHUNK), F32),
                       # 1 where the fp16 inverse did not fit (_half_inverse_fits)
                       jax.ShapeDtypeStruct((start.shape[0], HV), jnp.int32)),
            grid=_chunk_grid(start.shape[0], HV, True),
            compiler_params=plgpu.CompilerParams(num_warps=block.num_warps_prep, num_stages=1),
            interpret=interpret,
            name="gdn_prefill_prep_inverse",
        )(start, length, lead, beta, A)
        tb = _redo(start, length, lead, k, g, beta, A_log, dt_bias, redo, tb, spec=spec,
                   block=block, slot_rows=False, interpret=interpret)
    if not kda:
        aqk, fq, fk, fw, decay = gdn_outputs
    else:
        fw = gdn_outputs[3]
    if t_beta:
        # the Mosaic KDA scan forms the deltas from T beta, e^G k and v (`kda_scan`'s tb)
        w, u = ek, _aligned_rows(v)
    return tb, w, u, aqk, fq, fk, fw, decay


def _mosaic_kda_prep(v, beta, start, length, kk, ek, *, spec, t_beta=False, interpret):
    """KDA's W and U from `gdn_prefill_mgpu.kda_prep` (spec.aligned_chunks: slot s holds tokens
    64 s .., so its rows by slot are its rows by token), and the chunks to form again:
    (its per-row redo flags [S, HV, C] fp32, W [2, S * C, HV, K] bf16, U [S * C, HV, V] fp32)
    for `_prep`'s redo_only pass (`_each_flagged_chunk`); with t_beta, for the Mosaic GPU KDA
    scan (flags, T beta's halves [2, S * C, HV, C] bf16, a placeholder).
    kk, ek: the intra kernel's, with v's rows aligned."""
    C = CHUNK
    i = jnp.arange(C, dtype=jnp.int32)
    at = jnp.clip(start[:, None] + i, 0, beta.shape[0] - 1)                   # [S, C]
    b = beta[at].astype(F32)                                                 # [S, C, HV]
    if spec.raw_gates:
        b = jax.nn.sigmoid(b)
    beta_rows = jnp.where((i < length[:, None])[..., None], b, 0.0).transpose(0, 2, 1)
    # programs taking items in turn, with the next item's k k^T fetched during one, where
    # k k^T is fp16 or nothing else comes in (t_beta); an fp32 k k^T's second buffer beside
    # e^G k and v would leave one program an SM
    turns = t_beta or kk.dtype == jnp.float16
    num_programs = mgpu_scan.PREP_PROGRAMS if turns else None
    at_start = jnp.where(length > 0, start, 0)
    limits = dict(max_a=HALF_INVERSE_MAX_A, max_t=HALF_INVERSE_MAX_T)
    if t_beta:
        tb, flags = mgpu_scan.kda_prep(at_start, length, kk, None, None, beta_rows, **limits,
                                       num_programs=num_programs, t_beta=True,
                                       interpret=interpret)
        outs = (tb, jnp.zeros((1, 1, 1), F32))
    else:
        outs = mgpu_scan.kda_prep(at_start, length, kk, ek, _aligned_rows(v), beta_rows,
                                  **limits, num_programs=num_programs, interpret=interpret)
        *outs, flags = outs
    return (flags, *outs)


def _redo(start, length, lead, k, g, beta, A_log, dt_bias, redo, tb, *, spec, block, slot_rows,
          plane=None, interpret):
    """T beta with the chunks flagged in redo formed again in TF32 (`_prep_redo_kernel`), in
    place. redo: [S, HV], or per-row flags [S, HV, P, C] of which plane `plane` says
    (`_each_flagged_chunk`)."""
    return pl.pallas_call(
        functools.partial(_prep_redo_kernel, spec=spec, slot_rows=slot_rows, plane=plane,
                          interpret=interpret),
        out_shape=jax.ShapeDtypeStruct(tb.shape, tb.dtype),
        grid=_redo_grid(start.shape[0], redo.shape[1]),
        input_output_aliases={9: 0},
        compiler_params=plgpu.CompilerParams(num_warps=block.num_warps_prep, num_stages=1),
        interpret=interpret,
        name="gdn_prefill_prep_tf32",
    )(start, length, lead, k, g, beta, A_log, dt_bias, redo, tb)


def _mosaic_prep(q, k, g, beta, start, length, lead, A_log, dt_bias, *, spec, block,
                 interpret):
    """`_prep`'s results for the Mosaic GPU scan, by chunk slot, and the flag [1] int32 that
    says whether the scan must read tamed copies of q and k (None without the L2 norm): the
    per-row values the Mosaic prep reads (cumulative gates, beta) and the row factors and
    e^{G_C} from `_mosaic_prep_rows`; the products, the L2 factors (applied to the row factors),
    the fp16 inverse and its check from `gdn_prefill_mgpu.prep`; flagged chunks formed again in
    TF32 (`_prep_redo_kernel`). q, k: rows aligned (`_aligned_rows`), as given."""
    HV = g.shape[1]
    rows_in, factors, decay = _mosaic_prep_rows(g, beta, start, length, lead, A_log, dt_bias,
                                                spec=spec, interpret=interpret)
    l2norm = spec.use_qk_l2norm
    out = mgpu_scan.prep(jnp.where(length > 0, start, 0), q, k, rows_in,
                         factors if l2norm else None, num_v_heads=HV,
                         aqk_dtype=_bounded_dtype(spec), max_a=HALF_INVERSE_MAX_A,
                         max_t=HALF_INVERSE_MAX_T, interpret=interpret)
    aqk, tb, flags = out[:3]
    use_tamed = None
    if l2norm:
        factors, use_tamed = out[3:]
    tb = _redo(start, length, lead, k, g, beta, A_log, dt_bias, flags, tb, spec=spec,
               block=block, slot_rows=True, plane=mgpu_scan.UNFIT, interpret=interpret)
    unused = jnp.zeros((1, 1, 1), F32)
    return (tb, unused, unused, aqk, factors, unused, unused, decay), use_tamed


# `_mosaic_prep_rows`: value heads a program (at most; HV's largest power-of-two divisor up to
# this): a [64, 16] fp32 tile reads 64 bytes of each token's g and beta row. One program a head
# was slower at B=8 (BENCHMARKS.md, GDN prefill); other widths were not measured
PREP_ROWS_HEADS = 16


def _prep_rows_kernel(start_ref, len_ref, lead_ref, g_ref, beta_ref, A_log_ref, dt_ref,
                      rows_ref, fac_ref, decay_ref, *, spec: PrefillSpec, block_h: int):
    """`_mosaic_prep_rows` for one chunk slot and block_h value heads, as [C, block_h] tiles
    (g and beta rows are token-major: one load of each takes the chunk's rows of every head in
    the block)."""
    s, hb = pl.program_id(0), pl.program_id(1)
    heads = pl.ds(hb * block_h, block_h)
    t0, n, lead = start_ref[s], len_ref[s], lead_ref[s]
    C = CHUNK
    rows = jnp.broadcast_to(_chunk_rows(lead, n)[:, None], (C, block_h))
    tok = pl.ds(t0, C)
    beta = _chunk_beta(beta_ref, tok, heads, rows, spec)
    G_hi, G_lo = _split_cumsum(_chunk_log_decay(g_ref, A_log_ref, dt_ref, tok, heads, rows, spec))
    rk = jnp.where(rows, 1.0, 0.0)
    rq = rk * jnp.float32(spec.scale)
    for r, x in enumerate((G_hi, G_lo, beta, rq, rk)):
        plgpu.store(rows_ref.at[s, heads, jnp.int32(r), :], x.T)
    last = lax.broadcasted_iota(jnp.int32, (C, block_h), 0) == C - 1
    last_hi = jnp.sum(jnp.where(last, G_hi, 0.0), axis=0, keepdims=True)
    last_lo = jnp.sum(jnp.where(last, G_lo, 0.0), axis=0, keepdims=True)
    eG = jnp.exp(G_hi + G_lo)
    at = pl.ds(s * C, C)
    for f, x in enumerate((rq * eG, rk * jnp.exp((last_hi - G_hi) + (last_lo - G_lo)),
                           rk * eG)):
        plgpu.store(fac_ref.at[jnp.int32(f), heads, at], x.T)
    decay_ref[s, heads] = jnp.exp(last_hi + last_lo)[0]


def _mosaic_prep_rows(g, beta, start, length, lead, A_log, dt_bias, *, spec, interpret=False):
    """`_mosaic_prep`'s per-row part, one small Triton program per chunk slot and block of up to
    PREP_ROWS_HEADS value heads: (the prep's per-row values [S, HV, NUM_ROW_VECTORS, C], 0 on
    the rows that are not the chunk's; the scan's row factors [3, HV, S * C] without the L2
    norm, which the Mosaic prep applies; e^{G_C} [S, HV]). One launch: as XLA's gathers,
    cumulative sums and transposes of these small arrays it took a good part of the prep's time
    (BENCHMARKS.md)."""
    S, HV, C = start.shape[0], g.shape[1], CHUNK
    block_h = math.gcd(HV, PREP_ROWS_HEADS)
    return pl.pallas_call(
        functools.partial(_prep_rows_kernel, spec=spec, block_h=block_h),
        out_shape=(jax.ShapeDtypeStruct((S, HV, mgpu_scan.NUM_ROW_VECTORS, C), F32),
                   jax.ShapeDtypeStruct((3, HV, S * C), F32),
                   jax.ShapeDtypeStruct((S, HV), F32)),
        grid=(S, HV // block_h),
        compiler_params=plgpu.CompilerParams(num_warps=2, num_stages=1),
        interpret=interpret,
        name="gdn_prefill_prep_rows",
    )(start, length, lead, g, beta, A_log, dt_bias)


def _aligned_rows(x):
    """x with its leading (token) axis padded to a multiple of the Mosaic GPU kernels' ALIGN:
    their bulk copies take token axes in whole 8-row tiles."""
    pad = (-x.shape[0]) % mgpu_scan.ALIGN
    return jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)) if pad else x


def pool_rows(pool, slots):
    """(live [N] bool: slots[n] names a slot of pool [P, ...], the named slots' states [N, ...]
    fp32, zero for padding slots (outside [0, P)))."""
    P = pool.shape[0]
    live = (slots >= 0) & (slots < P)
    rows = pool[jnp.clip(slots, 0, P - 1)].astype(F32)
    return live, jnp.where(live.reshape((-1,) + (1,) * (rows.ndim - 1)), rows, 0.0)


def _longest_first(cu):
    """Sequence indices [N] int32 by decreasing length (ties in index order); numpy for a
    numpy cu."""
    lens = cu[1:] - cu[:-1]
    if isinstance(cu, np.ndarray):
        return np.argsort(-lens, kind="stable").astype(np.int32)
    if lens.shape[0] == 1:
        return jnp.zeros((1,), jnp.int32)
    return jnp.argsort(-lens, stable=True).astype(jnp.int32)


TAME_BLOCK_ROWS = 64


def _tame_block(x_ref, o_ref, b, num_rows: int):
    """Rows block b of x [R, K] (TAME_BLOCK_ROWS of them) into o as `gdn_decode.tame_huge_rows`
    leaves them (same bits), in one read and one write (XLA makes it two reads of x: a
    reduction, then a select)."""
    r0 = b * TAME_BLOCK_ROWS
    here = (r0 + lax.broadcasted_iota(jnp.int32, (TAME_BLOCK_ROWS,), 0) < num_rows)[:, None]
    block = pl.ds(r0, TAME_BLOCK_ROWS)
    x = plgpu.load(x_ref.at[block, :], mask=here, other=0)
    plgpu.store(o_ref.at[block, :], tame_huge_rows(x), mask=here)


def _tame_rows_kernel(x_ref, o_ref, *, num_rows: int):
    """One TAME_BLOCK_ROWS block of x [R, K] a program."""
    _tame_block(x_ref, o_ref, pl.program_id(0), num_rows)


TAME_IF_PROGRAMS = 264   # `tame_rows_if`'s programs: in the usual case each reads one flag


def _tame_rows_if_kernel(flag_ref, *refs, num_rows: int):
    """`tame_rows_if`: refs are (x_0, ..., o_0, ...); nothing happens unless flag_ref[0] != 0,
    and then the programs take the blocks of every x in turn."""
    xs, outs = refs[:len(refs) // 2], refs[len(refs) // 2:]
    num_blocks = pl.cdiv(num_rows, TAME_BLOCK_ROWS)
    p, num_programs = pl.program_id(0), pl.num_programs(0)

    @pl.when(flag_ref[0] != 0)
    def _():
        def step(i, carry):
            b = p + i * num_programs
            for x_ref, o_ref in zip(xs, outs):
                _tame_block(x_ref, o_ref, b, num_rows)
            return carry

        lax.fori_loop(0, (num_blocks - p + num_programs - 1) // num_programs, step, 0)


def tame_rows(x, *, interpret: bool = False):
    """x [..., K] with its huge rows tamed as `gdn_decode.tame_huge_rows` does (same bits), as
    one Pallas kernel over the rows."""
    rows = x.reshape(-1, x.shape[-1])
    return pl.pallas_call(
        functools.partial(_tame_rows_kernel, num_rows=rows.shape[0]),
        out_shape=jax.ShapeDtypeStruct(rows.shape, rows.dtype),
        grid=(pl.cdiv(rows.shape[0], TAME_BLOCK_ROWS),),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="tame_huge_rows",
    )(rows).reshape(x.shape)


def tame_rows_if(xs, flag, *, num_programs: int = TAME_IF_PROGRAMS, interpret: bool = False):
    """`tame_rows(x)` for each x of xs (arrays of one shape [..., K]) where flag [1] int32 is not
    0; where it is 0, arrays of that shape left unwritten (their reader must not read them
    then), at the cost of one small launch whose programs read the flag."""
    rows = [x.reshape(-1, x.shape[-1]) for x in xs]
    num_blocks = pl.cdiv(rows[0].shape[0], TAME_BLOCK_ROWS)
    outs = pl.pallas_call(
        functools.partial(_tame_rows_if_kernel, num_rows=rows[0].shape[0]),
        out_shape=tuple(jax.ShapeDtypeStruct(r.shape, r.dtype) for r in rows),
        grid=(min(num_programs, num_blocks),),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="tame_huge_rows_if",
    )(flag, *rows)
    return tuple(o.reshape(x.shape) for o, x in zip(outs, xs))


def _scan(cu, first, slots, q, k, v, tb, w, u, aqk, fq, fk, fw, decay, h0, *, spec, block,
          state_dtype, num_boundary, tamed=None, interpret=False):
    T_total, HV, V = v.shape
    K = q.shape[2]
    N = cu.shape[0] - 1
    if block.mosaic_scan or block.mosaic_kda_scan:
        pool_in = h0
        if v.dtype != jnp.bfloat16:
            raise ValueError(f"the Mosaic GPU scans take bf16 inputs, got v of {v.dtype}")
        live = jnp.ones((N,), jnp.int32)
        if spec.pooled:
            # the named slots' states read here and written back below (a padding slot: zeros
            # in, nothing out, and the kernel stores its sequence's outputs as zeros)
            in_pool, h0 = pool_rows(pool_in, slots)
            live = in_pool.astype(jnp.int32)
        # the Mosaic scan's wide form holds S^T: the states cross its boundary transposed
        narrow = block.block_v == mgpu_scan.BLOCK_V_NARROW
        orient = (lambda x: x) if narrow else (lambda x: jnp.swapaxes(x, -1, -2))
        h0t = (orient(h0).astype(F32) if spec.has_initial_state or spec.pooled
               else jnp.zeros((1, 1, 1, 1), F32))
        if block.mosaic_kda_scan:
            # KDA: the decayed q rows, k e^{G_C - G}'s and e^G k's halves (the intra kernel's,
            # in whole 8-row tiles) and v by token row, T beta's halves (the Mosaic prep's) by
            # slot, which for aligned chunks are token rows (`_prep` hands e^G k and v over as
            # w and u)
            o, final_t = mgpu_scan.kda_scan(cu, _longest_first(cu), first, live, decay,
                                            fq, fk, w, u, tb, aqk, h0t, num_v_heads=HV,
                                            has_initial_state=spec.has_initial_state
                                            or spec.pooled, narrow=narrow,
                                            warp_specialized=not interpret,
                                            interpret=interpret)
        else:
            # (q and k come with their rows aligned, as the Mosaic prep took them)
            o, final_t = mgpu_scan.scan(cu, _longest_first(cu), first, live, decay, q, k,
                                        _aligned_rows(v), tb, aqk, fq, h0t, num_v_heads=HV,
                                        num_k_heads=q.shape[1],
                                        has_initial_state=spec.has_initial_state
                                        or spec.pooled,
                                        narrow=narrow, tamed=tamed,
                                        warp_specialized=not interpret, interpret=interpret)
        o = o[:T_total]
        final = orient(final_t)
        if spec.pooled:
            # in place (the pool is donated); a padding slot's index lies past the pool: dropped
            into = jnp.where(in_pool, slots, pool_in.shape[0])
            final = pool_in.at[into].set(final.astype(pool_in.dtype), mode="drop")
        elif spec.output_final_state:
            final = final.astype(state_dtype)
        else:
            final = jnp.zeros((1, 1, 1, 1), state_dtype)
        return o, final, jnp.zeros((1, 1, 1, 1), F32)
    final_shape = (h0.shape if spec.pooled else (N, HV, K, V) if spec.output_final_state
                   else (1, 1, 1, 1))
    final_dtype = h0.dtype if spec.pooled else state_dtype
    bshape = (num_boundary, HV, K, V) if spec.boundary_states else (1, 1, 1, 1)
    return pl.pallas_call(
        functools.partial(_scan_kernel, spec=spec, block_v=block.block_v,
                          pair_group=block.pair_group if block.paired_halves else 0,
                          interpret=interpret),
        out_shape=(jax.ShapeDtypeStruct((T_total, HV, V), v.dtype),
                   jax.ShapeDtypeStruct(final_shape, final_dtype),
                   jax.ShapeDtypeStruct(bshape, F32)),  # fp32: a prefix continues from it
        grid=(N * HV * (V // block.block_v),),
        input_output_aliases={15: 1} if spec.pooled else {},
        compiler_params=plgpu.CompilerParams(num_warps=block.num_warps_scan,
                                             num_stages=block.num_stages_scan),
        interpret=interpret,
        name="gdn_prefill_scan",
    )(cu, _longest_first(cu), first, slots, q, k, v, tb, w, u, aqk, fq, fk, fw, decay, h0)


@default_config
@functools.partial(jax.jit, static_argnames=("spec", "block", "state_dtype", "dense_len",
                                             "interpret"),
                   donate_argnames=("pool",))
def chunk_prefill(q, k, v, g, beta, cu_seqlens, *, spec: PrefillSpec, block: PrefillBlockSizes,
                  A_log=None, dt_bias=None, initial_state=None, pool=None, slots=None,
                  state_dtype=jnp.float32, dense_len: int | None = None,
                  interpret: bool = False):
    """Run the kernels on packed, validated inputs (the caller checks shapes; see the module
    docstring): prep and scan, KDA's intra-chunk kernel before them, and for GDN the q/k tame
    pass first (with the L2 norm; on the Mosaic GPU path instead a tamed copy for the scan only
    when the prep tamed a row) and the prep's TF32 redo pass between them (16-bit inputs).

    q, k [T, HK, K]; v [T, HV, V]; g [T, HV] (KDA: [T, HV, K]), beta [T, HV] (raw a, b with
    A_log [HV] and dt_bias [HV] (KDA: [HV * K]) when spec.raw_gates); cu_seqlens [N + 1] int32. Pooled: pool [P, HV, K, V] (donated, updated in
    place) and slots [N] int32 (outside [0, P): padding, nothing read or written, zero outputs).
    Returns (o [T, HV, V] in v's dtype, final [N, HV, K, V] or the pool or None,
    boundary [S, HV, K, V] fp32 or None — slot first_chunk[n] + c holds sequence n's state after its
    chunk c — and the chunk table (start, length, first_chunk)).
    dense_len: every sequence is this many tokens long, cu_seqlens = [0, L, 2L, ...] (a dense
    batch): the chunk table and the scan's launch order are then built at trace time, constants
    of the program, rather than by small XLA kernels ahead of the prep in every call."""
    HV = v.shape[1]
    N = cu_seqlens.shape[0] - 1
    if dense_len is not None:
        if N * dense_len != q.shape[0]:
            raise ValueError(f"dense_len={dense_len}: {N} sequences of it are not the "
                             f"{q.shape[0]} rows of q")
        cu = np.arange(N + 1, dtype=np.int32) * np.int32(dense_len)
    else:
        cu = cu_seqlens.astype(jnp.int32)
    tamed = None
    if spec.use_qk_l2norm and not spec.per_channel_gate and not block.mosaic_scan:
        # GDN's raw q, k rows go into dot products and are normalised afterwards, so rows whose
        # squares could overflow are tamed first (KDA's intra kernel tames its rows itself; the
        # Mosaic GPU prep tames the tiles that hold such a row, and the scan then reads tamed
        # copies, below)
        q, k = tame_rows(q, interpret=interpret), tame_rows(k, interpret=interpret)
    # the Mosaic GPU scan reads each sequence's chunks from its start rounded down to ALIGN
    start, length, first, lead = chunk_table(
        cu, q.shape[0], mgpu_scan.ALIGN if block.mosaic_scan else 1)
    A_log = jnp.zeros((HV,), F32) if A_log is None else A_log
    dt_bias = jnp.zeros((HV,), F32) if dt_bias is None else dt_bias
    if block.mosaic_scan:
        # the Mosaic GPU scan takes the Mosaic GPU prep's layouts (`gdn_prefill_mgpu.prep`);
        # both read q and k rows padded once here
        q, k = _aligned_rows(q), _aligned_rows(k)
        mids, use_tamed = _mosaic_prep(q, k, g, beta, start, length, lead, A_log, dt_bias,
                                       spec=spec, block=block, interpret=interpret)
        if use_tamed is not None:
            # the copies are written only when the prep tamed a row
            tamed = (*tame_rows_if((q, k), use_tamed, interpret=interpret), use_tamed)
    else:
        mids = _prep(q, k, v, g, beta, start, length, lead, A_log, dt_bias, spec=spec,
                     block=block, interpret=interpret)
    if spec.pooled:
        h0 = pool
    elif spec.has_initial_state:
        h0 = initial_state
    else:
        h0 = jnp.zeros((1, 1, 1, 1), F32)  # unused placeholder
    slots = jnp.zeros((N,), jnp.int32) if slots is None else slots.astype(jnp.int32)
    o, final, boundary = _scan(cu, first, slots, q, k, v, *mids, h0, spec=spec,
                               block=block, state_dtype=state_dtype,
                               num_boundary=start.shape[0], tamed=tamed, interpret=interpret)
    final = final if (spec.pooled or spec.output_final_state) else None
    boundary = boundary if spec.boundary_states else None
    return o, final, boundary, (start, length, first)
