"""Single-token Gated DeltaNet / KDA decode: one Pallas kernel body, variants as static flags.

Per (sequence b, value head h) the state S = state[b, h] is [K, V], K-major (S[k, v]). One
program owns a [K, block_v] column slab of one head's state: it reads the slab once, runs the
token through it in registers and writes it back once, in place (the state is aliased to the
output and donated at the jit boundary). The step is bound by memory bandwidth: every byte of
state is read and written exactly once, everything else (q, k, v, gates, output) is ~1% of it.

Static flags of the one kernel body (`DecodeSpec`):
  * gates:           precomputed (g, beta)  |  raw (a, b, A_log, dt_bias) with the gate math in
                     the kernel: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), or
                     the lower-bounded KDA form g = lb * sigmoid(exp(A_log) * (a + dt_bias)).
  * per-channel g:   KDA gate g[b, h, :] of K values instead of one scalar per head.
  * use_qk_l2norm:   q, k <- x * rsqrt(sum(x^2) + 1e-6) in the kernel.
  * pooled:          state is a pool [slots, HV, K, V] and an int32 table names each row's slot;
                     slot -1 (or any slot outside the pool) is padding: nothing is read or
                     written there and the output row is zero. Slots not named are untouched.
  * fused norm:      the output is normalised per head by the gated RMSNorm
                     x * rsqrt(mean(x^2) + eps) * w * act(z) and stored once in the output dtype
                     (bf16 by default): no fp32 output goes through memory. Needs block_v == V.
  * packed input:    every per-token operand is a 2-D row array [B, width] plus a static column
                     offset, so q, k and v can be read straight out of the packed conv output
                     [B, conv_dim] = q | k | v and the gates out of a packed projection row
                     (the same array passed twice with two offsets); nothing is split or copied.
  * state dtype:     fp32, fp16 or bf16 state; math is fp32, one round-to-nearest-even per store.
  * stochastic rounding (16-bit state): the store rounds each value to one of its two 16-bit
                     neighbours with the probabilities that make it unbiased, drawing from a
                     counter hash of (seed, state row, head, k, column): deterministic for a seed
                     and independent of the launch shape. Removes the decay stall of RNE stores
                     (a |g| below half an ulp never moves the state).
  * fused conv:      q, k and v are the *pre-conv* packed row [B, conv_dim] = q | k | v (channel
                     c is column c); the kernel runs the short conv's decode step itself: it
                     reads the window [W-1, channels] of its channels from the conv window array
                     (a pool [slots, W-1, conv_dim] beside the state pool, or [B, W-1, conv_dim]),
                     convolves [window, x] with the depthwise weight [conv_dim, W] (+ bias),
                     applies SiLU, rounds to the row's dtype (as the unfused chain stores it) and
                     writes the shifted window back in place (aliased, like the state). See
                     `_conv_decode` for why a program then owns a whole key-head group.
  * tokens:          the token-serial (register-resident) prefill, launched by `serial_prefill`:
                     row arrays hold one token per row, the grid's last axis walks sequences
                     (rows seq_start[n] .. seq_end[n] - 1: a dense [B, T] batch or packed
                     sequences), and each program carries its [K, block_v] slab through its
                     sequence's tokens with `token_update` (a `fori_loop` of dynamic length),
                     writing every token's output and the state once at the end. The state is
                     read from initial states, a pool slot or zeros (`reads_state`); outputs
                     may be skipped (`token_outputs`) when only states at positions are wanted.
                     It is a loop around the same per-token step (`token_update`) as the decode.

The per-token math lives in `token_update` (its parts `token_delta` and `token_write`, and the
helpers `l2_normalize`, `gdn_gate_value`, `kda_gate_value`): plain jnp on in-register values,
so any Pallas kernel body (the K-token verify in gdn_verify.py) can call them and get
bit-identical results, provided it uses the same tile shape [K, tile_v] and num_warps (Triton's
reduction order follows the layout).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.tracing import default_config

F32 = jnp.float32
L2NORM_EPS = 1e-6
L2NORM_RESCALE_ABOVE = 2.0 ** 50  # max |x| above which a row's squares may overflow fp32
HUGE_ROW_SCALE = 2.0 ** -100      # exact; brings any finite fp32 row well inside range
TAMED_ROW_EXPONENT = 24           # tame_huge_rows: a huge row's max |x| lands in [2**24, 2**25)
SOFTPLUS_THRESHOLD = 20.0
STATE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))

__all__ = [
    "DecodeBlockSizes", "DecodeSpec", "TUNING_TABLE", "default_block_sizes", "unsupported_reason",
    "index_overflow_reason", "SERIAL_TUNING_TABLE", "default_serial_block_sizes",
    "token_update", "token_delta", "token_write", "l2_normalize", "softplus_value",
    "gdn_gate_value", "kda_gate_value",
    "tame_huge_rows", "huge_rows", "scale_huge_rows", "huge_row_factor", "counter_bits", "stochastic_round_value", "gdn_decode", "serial_prefill",
]


# --------------------------------------------------------------------------- in-kernel math
# Plain jnp on fp32 values already in registers: callable from any Pallas kernel body (and from
# plain JAX). Keep the operation order fixed: the verify kernel relies on bit-identical results.

def l2_normalize(x: jax.Array, eps: float = L2NORM_EPS, *, guard: bool = True) -> jax.Array:
    """x * rsqrt(sum(x^2) + eps) over the last axis of a [K] vector, fp32 (the reference's
    `l2norm`).

    `guard` (static) says who keeps huge rows from overflowing the sum of squares (some |x|
    above ~1.8e19):
      * True: this function, for any finite x. The plain formula runs, bit for bit, unless the
        sum of squares overflowed; only then is the vector scaled by an exact power of two and
        summed again (eps no longer matters at that size). The rare branch is a `lax.cond` on
        the scalar the plain formula needs anyway, so ordinary rows pay one reduction, not two.
        For kernels whose q/k are made inside the kernel or that run one token per launch (the
        decode: a pass over q/k before it would cost a launch).
      * False: the plain formula alone, for rows the launcher passed through `tame_huge_rows`
        (the T-token verify kernels, where the in-kernel branch costs ~8%).
    Both give the same bits for every row with max |x| <= L2NORM_RESCALE_ABOVE (such a row is
    left alone by `tame_huge_rows`, and its sum of squares, at most K * 2**100, does not
    overflow, so the guarded form takes its plain branch)."""
    ss = jnp.sum(x * x, axis=-1, keepdims=True)
    plain = lambda: x * lax.rsqrt(ss + jnp.float32(eps))
    if not guard:
        return plain()
    huge = jnp.max(ss) == jnp.inf

    def rescaled():
        # The factor is data (not a literal 2**-100) on purpose: XLA's simplifier (interpret
        # mode) pulls a constant factor out of the sum as its square, 2**-200 = 0 in fp32.
        y = x * jnp.where(huge, jnp.float32(HUGE_ROW_SCALE), jnp.float32(1.0))
        return y * lax.rsqrt(jnp.sum(y * y, axis=-1, keepdims=True))

    return lax.cond(huge, rescaled, plain)


def tame_huge_rows(x: jax.Array) -> jax.Array:
    """x (any float dtype, rows on the last axis) with every row whose max |x| exceeds
    L2NORM_RESCALE_ABOVE multiplied by the exact power of two that brings its max into
    [2**TAMED_ROW_EXPONENT, 2**(TAMED_ROW_EXPONENT + 1)): the same row after an L2 norm (the
    reference's `l2norm` scales such rows by a power of two too), its squares (<= K * 2**50) cannot
    overflow, and eps (1e-6 against a sum of squares >= 2**48) changes nothing. Ordinary rows
    come back unchanged, bit for bit. For launchers whose kernels normalise q/k without a guard
    (`l2_normalize(guard=False)`) or form raw dot products of rows normalised afterwards; one
    elementwise XLA pass."""
    return scale_huge_rows(x, *huge_rows(x))


def huge_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(huge, factor) [...] for the rows of x [..., K]: `huge_row_factor` of their max |x|."""
    return huge_row_factor(jnp.max(jnp.abs(x.astype(F32)), axis=-1))


def scale_huge_rows(x: jax.Array, huge: jax.Array, factor: jax.Array) -> jax.Array:
    """x [..., K] with the rows that `huge_rows` marks multiplied by their factor, as
    `tame_huge_rows` leaves them (plain jnp and broadcasts, so a Pallas kernel can call it). The
    other rows are kept as they are, not multiplied by 1: a flush-to-zero multiply would lose
    subnormals."""
    on_rows = lambda v: lax.broadcast_in_dim(v, x.shape, tuple(range(v.ndim)))
    return jnp.where(on_rows(huge), x * on_rows(factor).astype(x.dtype), x)


def huge_row_factor(m: jax.Array) -> tuple[jax.Array, jax.Array]:
    """For rows' max |x| m (fp32, any shape): (huge, factor), huge = m > L2NORM_RESCALE_ABOVE
    and factor the exact power of two `tame_huge_rows` scales a huge row by (1 elsewhere).
    Plain jnp on the fp32 exponent bits (no frexp), so a Pallas kernel can call it too."""
    huge = m > L2NORM_RESCALE_ABOVE
    # m in [2**(e-1), 2**e) (frexp's e, which is 0 for inf); for e >= 51 the factor
    # 2**(TAMED_ROW_EXPONENT + 1 - e) lies in [2**-104, 2**-26], a normal number in fp32 and
    # bf16, so the product is exact
    biased = (lax.bitcast_convert_type(m, jnp.int32) >> 23) & 0xFF
    e = jnp.where(biased == 0xFF, 0, biased - 126)
    exponent = jnp.where(huge, TAMED_ROW_EXPONENT + 1 - e, 0)
    return huge, lax.bitcast_convert_type((exponent + 127) << 23, F32)


def softplus_value(x: jax.Array) -> jax.Array:
    """torch softplus (beta 1, threshold 20): x itself above 20, log1p(exp(x)) below."""
    return jnp.where(x > SOFTPLUS_THRESHOLD, x, jnp.log1p(jnp.exp(jnp.minimum(x, SOFTPLUS_THRESHOLD))))


def gdn_gate_value(a: jax.Array, A_log: jax.Array, dt_bias: jax.Array) -> jax.Array:
    """GDN log decay g = -exp(A_log) * softplus(a + dt_bias), fp32 (any broadcastable shapes)."""
    return -jnp.exp(A_log) * softplus_value(a + dt_bias)


def kda_gate_value(a: jax.Array, A_log: jax.Array, dt_bias: jax.Array,
                   lower_bound: float | None) -> jax.Array:
    """KDA per-channel log decay: the GDN form, or lb * sigmoid(exp(A_log) * (a + dt_bias))."""
    if lower_bound is None:
        return gdn_gate_value(a, A_log, dt_bias)
    return jnp.float32(lower_bound) * jax.nn.sigmoid(jnp.exp(A_log) * (a + dt_bias))


def token_delta(S: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                beta: jax.Array) -> jax.Array:
    """u = beta * (v - (exp(g) S)^T k) for one token, read from the undecayed tile S [K, BV]:
    a scalar decay (GDN) scales the column sums, a per-channel one (KDA) the key."""
    decay = jnp.exp(g)
    if decay.ndim == 1:
        return beta * (v - jnp.sum((k * decay)[:, None] * S, axis=0))
    return beta * (v - decay * jnp.sum(k[:, None] * S, axis=0))


def token_write(S: jax.Array, k: jax.Array, u: jax.Array, g: jax.Array) -> jax.Array:
    """The tile after one token: exp(g) S + k u^T. Every kernel that replays a token from its
    delta (the verify's fold) calls this, so the compiler contracts the same product into the
    FMA and the bits agree with `token_update`'s."""
    decay = jnp.exp(g)
    return S * (decay[:, None] if decay.ndim == 1 else decay) + k[:, None] * u[None, :]


def token_update(S: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                 beta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token of the gated delta rule on a state tile. All fp32.

    S [K, BV] (state columns c0..c0+BV of one head, K-major); q [K] (already scaled, and
    L2-normalised if asked); k [K]; v [BV] (the same columns); g: scalar log decay (GDN) or [K]
    (KDA, per key channel); beta: scalar. Returns (o [BV], S_new [K, BV]):

        u = beta * (v - (exp(g) S)^T k) ;  S_new = exp(g) S + k u^T ;
        o = S_new^T q = (exp(g) S)^T q + u (k . q)

    Both column sums over K (the cross-warp reductions) read the tile as loaded, so they run
    back to back and neither waits for the update; the output needs no pass over S_new
    (measured faster than reducing S_new: BENCHMARKS.md, decode).
    Columns are independent, so a head may be split over programs by columns. Bit-identical
    results across kernels need the same tile shape and num_warps (reduction order)."""
    decay = jnp.exp(g)
    u = token_delta(S, k, v, g, beta)
    if decay.ndim == 1:
        read = jnp.sum((q * decay)[:, None] * S, axis=0)
    else:
        read = decay * jnp.sum(q[:, None] * S, axis=0)
    o = read + u * jnp.sum(q * k)
    return o, token_write(S, k, u, g)


# --------------------------------------------------------------------------- stochastic rounding
# A counter-based draw: each state element hashes its own coordinates with the step's seed, so
# the programs need no shared generator state and any tiling draws the same numbers. The store
# is ALU work on every state element of a bandwidth-bound kernel, so both the hash (one
# xor-shift-multiply round) and the rounding (integer add and mask on the fp32 bit pattern, no
# division) are kept to a few operations per element.

def counter_bits(counter: jax.Array, seed0: jax.Array, seed1: jax.Array) -> jax.Array:
    """32 random bits per uint32 counter for a two-word seed: the seeded counter through an
    invertible hash in which every input bit flips about half the output bits (the "lowbias32"
    xor-shift-multiply constants)."""
    x = (counter ^ seed0) * jnp.uint32(0x9E3779B1) + seed1
    x = x ^ (x >> jnp.uint32(16))
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> jnp.uint32(15))
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> jnp.uint32(16))


def stochastic_round_value(x: jax.Array, dtype, bits: jax.Array) -> jax.Array:
    """fp32 x -> fp16/bf16, rounded to one of x's two neighbours so that E[result] = x, from 32
    random bits per element.

    The dtype keeps the top 16 (bf16) or 19 (fp16 normals) bits of the fp32 pattern. Adding a
    random number below 2**drop to the pattern and clearing the dropped bits rounds the magnitude
    up with probability (dropped bits) / 2**drop, i.e. in proportion to x's distance from the
    lower neighbour; the result is exact in the dtype, so the final cast does not round again.
    fp16 below 2**-14 has a fixed step of 2**-24: there |x| * 2**24 is rounded to an integer the
    same way (floor of it plus a uniform draw). Values exact in the dtype come back unchanged;
    NaN, and values whose rounding would leave the dtype's range, round as RNE does (the rule of
    the reference's `stochastic_round`, which draws differently: p = (x - RNE) / gap)."""
    bf16 = jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16)
    drop = 16 if bf16 else 13
    pattern = lax.bitcast_convert_type(x, jnp.uint32)
    kept = (pattern + (bits >> jnp.uint32(32 - drop))) & jnp.uint32(0xFFFFFFFF ^ ((1 << drop) - 1))
    y = lax.bitcast_convert_type(kept, F32)
    if not bf16:
        u = (bits >> jnp.uint32(8)).astype(jnp.int32).astype(F32) * jnp.float32(2.0 ** -24)
        sub = jnp.floor(jnp.abs(x) * jnp.float32(2.0 ** 24) + u) * jnp.float32(2.0 ** -24)
        sub = jnp.where(pattern >= jnp.uint32(0x80000000), -sub, sub)      # sign, -0.0 included
        y = jnp.where(jnp.abs(x) < jnp.float32(2.0 ** -14), sub, y)
    rne = (x != x) | (jnp.abs(y) > jnp.float32(jnp.finfo(dtype).max))
    return jnp.where(rne, x.astype(dtype), y.astype(dtype))


# --------------------------------------------------------------------------- tuning

@dataclasses.dataclass(frozen=True)
class DecodeBlockSizes:
    """Launch shape. A program owns value columns [j * block_v, (j + 1) * block_v) of one value
    head of one sequence; it walks them in static [K, tile_v] register tiles, issuing the next
    tile's loads before the current tile's math (a two-deep pipeline in registers).
    Grid = (V // block_v, HV, B), column block fastest: programs that run side by side stream
    neighbouring bytes of one head's state (see `_launch`)."""
    block_v: int = 32
    tile_v: int | None = None  # None: one tile of block_v columns
    num_warps: int = 4
    num_stages: int = 1

    @property
    def tile(self) -> int:
        return self.block_v if self.tile_v is None else self.tile_v


# (largest batch, state itemsize, fused norm) -> block sizes. First match wins. From the sweeps
# on the H200 (K = V = 128, HV = 32; BENCHMARKS.md): with the column-block-fastest grid, one
# [K, 64] register tile per program with 4 warps is the fastest shape measured from B = 32 up,
# for fp32 and 16-bit states alike (narrower [K, 32] programs and whole-head programs are
# 1.5-21% slower), and for 16-bit states at every batch size. fp32 states up to B = 16 take
# [K, 32] programs (5-8% ahead of [K, 64] at B = 16; below that a step is a few microseconds of
# launch and latency, and [K, 32], [K, 64] and one-warp programs measured within noise of each
# other). The fused norm needs the whole head in one program: two [K, 64] tiles.
TUNING_TABLE: tuple[tuple[int, int, bool, DecodeBlockSizes], ...] = (
    (16, 4, False, DecodeBlockSizes(block_v=32, num_warps=4)),
    (1 << 30, 4, False, DecodeBlockSizes(block_v=64, num_warps=4)),
    (1 << 30, 2, False, DecodeBlockSizes(block_v=64, num_warps=4)),
    (1 << 30, 4, True, DecodeBlockSizes(block_v=128, tile_v=64, num_warps=4)),
    (1 << 30, 2, True, DecodeBlockSizes(block_v=128, num_warps=4)),
)


# Token-serial prefill: (largest number of (sequence, value head) pairs) -> block sizes. First
# match wins. A program walks all of its sequence's tokens with its [K, block_v] state slab in
# registers, so each token costs the latency of its chain of reductions over K, not bandwidth:
# one warp per program keeps every reduction inside the warp (no shared memory, no barriers),
# which the single-token decode, streaming the state, cannot afford. Sweep on the H200
# (K = V = 128, HV = 32; BENCHMARKS.md): one warp is the fastest from 256 pairs up (1.3-2.2x
# the 4-warp shapes), and a narrow block with 2 stages at 32 pairs, where programs are few.
SERIAL_TUNING_TABLE: tuple[tuple[int, DecodeBlockSizes], ...] = (
    (32, DecodeBlockSizes(block_v=16, num_warps=1, num_stages=2)),
    (1 << 30, DecodeBlockSizes(block_v=32, num_warps=1)),
)


# The token-serial slab's fp32 values per thread at most (K * block_v / threads): the table's
# one-warp shapes hold 64-128 at K = 128; a larger K takes more warps rather than spill.
SERIAL_VALUES_PER_THREAD = 128


def default_serial_block_sizes(num_seqs: int, num_v_heads: int, head_v_dim: int,
                               head_k_dim: int) -> DecodeBlockSizes:
    """The token-serial prefill's tuning-table entry for this call, clipped to the head size,
    with enough warps that the state slab fits SERIAL_VALUES_PER_THREAD values per thread."""
    for max_pairs, bs in SERIAL_TUNING_TABLE:
        if num_seqs * num_v_heads <= max_pairs:
            break
    block_v = min(bs.block_v, head_v_dim)
    warps = bs.num_warps
    while head_k_dim * block_v > SERIAL_VALUES_PER_THREAD * 32 * warps and warps < 4:
        warps *= 2
    return dataclasses.replace(bs, block_v=block_v, tile_v=None, num_warps=warps)


def default_block_sizes(batch: int, head_v_dim: int, state_dtype, fused_norm: bool) -> DecodeBlockSizes:
    """The tuning-table entry for this call, clipped to the head size."""
    itemsize = 4 if jnp.dtype(state_dtype).itemsize == 4 else 2
    for max_b, size, norm, bs in TUNING_TABLE:
        if batch <= max_b and size == itemsize and norm == fused_norm:
            break
    block_v = head_v_dim if fused_norm else min(bs.block_v, head_v_dim)
    tile_v = min(bs.tile, block_v)
    return dataclasses.replace(bs, block_v=block_v, tile_v=None if tile_v == block_v else tile_v)


# --------------------------------------------------------------------------- static spec

def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """Static configuration of one decode launch (hashable: it is a jit static argument).

    Column offsets say where each operand starts in its row array; head h of that operand then
    sits at `col + head * size` (q, k: key head h // (HV // HK), size K; v, z, output: value head
    h, size V; g, beta, a, b: value head h, size 1, or K for a per-channel gate)."""
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    scale: float
    q_col: int = 0
    k_col: int = 0
    v_col: int = 0
    g_col: int = 0
    beta_col: int = 0
    z_col: int = 0
    raw_gates: bool = False          # g/beta operands hold a, b; A_log, dt_bias are inputs
    per_channel_gate: bool = False   # KDA: K gate values per head
    gate_lower_bound: float | None = None  # raw KDA gate: lb * sigmoid(...) form
    use_qk_l2norm: bool = False
    pooled: bool = False
    fused_norm: bool = False
    norm_eps: float = 1e-6
    norm_activation: str = "silu"
    stochastic_rounding: bool = False  # 16-bit state stores; a seed [2] uint32 is an input
    fused_conv: bool = False         # q/k/v rows are pre-conv; conv weight + windows are inputs
    conv_width: int = 0              # W of the fused conv (its windows hold W-1 inputs)
    conv_bias: bool = False          # the fused conv adds a bias [conv_dim]

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim
    # Token-serial prefill (`serial_prefill`): row arrays hold tokens, the grid's last axis walks
    # sequences, and each program carries its state slab through its sequence's tokens.
    tokens: bool = False
    reads_state: bool = True         # tokens: start from a state (else from zeros)
    token_outputs: bool = True       # tokens: write each token's output (else only the state)


def unsupported_reason(spec: DecodeSpec, block: DecodeBlockSizes, state_dtype) -> str | None:
    """Why this kernel cannot take the call (None when it can). Pure; no device work."""
    if jnp.dtype(state_dtype) not in STATE_DTYPES:
        return f"state dtype {jnp.dtype(state_dtype)} is not float32/float16/bfloat16"
    if not (_pow2(spec.head_k_dim) and 16 <= spec.head_k_dim <= 256):
        return f"K={spec.head_k_dim} must be a power of two in [16, 256] (Triton tile)"
    if not (_pow2(spec.head_v_dim) and 16 <= spec.head_v_dim <= 256):
        return f"V={spec.head_v_dim} must be a power of two in [16, 256] (Triton tile)"
    if not (_pow2(block.block_v) and spec.head_v_dim % block.block_v == 0):
        return f"block_v={block.block_v} must be a power of two dividing V={spec.head_v_dim}"
    if not (_pow2(block.tile) and block.block_v % block.tile == 0):
        return f"tile_v={block.tile} must be a power of two dividing block_v={block.block_v}"
    if spec.fused_norm and block.block_v != spec.head_v_dim:
        return f"the fused norm needs a whole head per program (block_v={block.block_v} != V={spec.head_v_dim})"
    if spec.stochastic_rounding and jnp.dtype(state_dtype).itemsize != 2:
        return f"stochastic rounding applies to a float16/bfloat16 state, not {jnp.dtype(state_dtype)}"
    if spec.tokens and spec.fused_norm:
        return "the token-serial prefill has no fused norm (normalise its outputs afterwards)"
    if spec.tokens and (spec.fused_conv or spec.stochastic_rounding):
        return "the token-serial prefill has no fused conv and rounds its state store to nearest"
    if spec.norm_activation not in ("silu", "sigmoid"):
        return f"norm_activation must be 'silu' or 'sigmoid', got {spec.norm_activation!r}"
    if spec.num_k_heads <= 0 or spec.num_v_heads % spec.num_k_heads:
        return f"HV={spec.num_v_heads} must be a multiple of HK={spec.num_k_heads}"
    if block.num_warps not in (1, 2, 4, 8, 16):
        return f"num_warps={block.num_warps} must be 1, 2, 4, 8 or 16"
    if spec.fused_conv:
        kd = spec.num_k_heads * spec.head_k_dim
        if (spec.q_col, spec.k_col, spec.v_col) != (0, kd, 2 * kd):
            return ("the fused conv reads the packed pre-conv row q | k | v (q_col=0, "
                    f"k_col={kd}, v_col={2 * kd}), got ({spec.q_col}, {spec.k_col}, {spec.v_col})")
        if spec.conv_width < 2:
            return f"the fused conv needs a width W >= 2, got {spec.conv_width}"
        if block.block_v != spec.head_v_dim:
            return (f"the fused conv needs a whole head per program (block_v={block.block_v} != "
                    f"V={spec.head_v_dim})")
    return None


def index_overflow_reason(num_state_elements: int) -> str | None:
    """The Triton lowering indexes with int32: the state (or pool) must hold < 2**31 elements."""
    if num_state_elements >= 2**31:
        return f"the state holds {num_state_elements} elements; the kernel indexes with int32 (< 2**31)"
    return None


# --------------------------------------------------------------------------- kernel body

@dataclasses.dataclass(frozen=True)
class _ConvRefs:
    """The fused conv's operands: weight [conv_dim, W], bias [conv_dim] or None, and the window
    array [rows, W-1, conv_dim] as read (win_in) and written (win_out, aliased to win_in)."""
    weight: object
    bias: object
    win_in: object
    win_out: object = None


def _conv_decode(conv: _ConvRefs, x_ref, b, row, col, n, width):
    """Short-conv decode step for channels col..col+n of sequence b (window row `row`): returns
    (y [n] fp32, rounded like the unfused chain's stored conv output, new window rows [W-1] of
    [n] fp32) without writing anything. The math is the reference's `causal_conv1d`:
    y = SiLU(sum_j w[c, j] * [window, x][j] (+ b[c])), accumulated in fp32 in the same order.

    Who writes the window: every program that convolves a channel reads its W-1 old inputs, so
    a column written by one program while another still has to read it would be a race (CUDA
    orders no two programs of a grid). With the fused conv a program owns a whole key-head
    group (key head kh and its HV // HK value heads, all V columns each), so the q, k columns of
    kh and the v columns of those value heads are read and written by that one program only."""
    taps = [conv.win_in[row, j, pl.ds(col, n)].astype(F32) for j in range(width - 1)]
    x = x_ref[b, pl.ds(col, n)]
    taps.append(x.astype(F32))
    y = sum(taps[j] * conv.weight[pl.ds(col, n), j].astype(F32) for j in range(width))
    if conv.bias is not None:
        y = y + conv.bias[pl.ds(col, n)].astype(F32)
    y = y * jax.nn.sigmoid(y)
    return y.astype(x.dtype).astype(F32), taps[1:]


def _store_window(conv: _ConvRefs, row, col, n, rows):
    for j, r in enumerate(rows):
        conv.win_out[row, j, pl.ds(col, n)] = r.astype(conv.win_out.dtype)


def _decode_kernel(*refs, spec: DecodeSpec, block: DecodeBlockSizes):
    refs = list(refs)
    q_ref, k_ref, v_ref, g_ref, beta_ref = refs[:5]
    rest = refs[5:]
    A_log_ref = dt_bias_ref = slots_ref = z_ref = w_ref = seed_ref = conv = None
    if spec.raw_gates:
        A_log_ref, dt_bias_ref, *rest = rest
    if spec.pooled:
        slots_ref, *rest = rest
    if spec.stochastic_rounding:
        seed_ref, *rest = rest
    if spec.fused_norm:
        z_ref, w_ref, *rest = rest
    if spec.fused_conv:  # inputs: weight, [bias], windows; the windows' output comes last
        conv_w_ref, *rest = rest
        conv_b_ref = None
        if spec.conv_bias:
            conv_b_ref, *rest = rest
        win_in_ref, *rest = rest
        conv = _ConvRefs(conv_w_ref, conv_b_ref, win_in_ref, rest.pop())
    if spec.tokens:
        seq_start_ref, seq_end_ref, *rest = rest
        if not spec.reads_state:
            rest = [None, *rest]
    state_in_ref, o_ref, state_out_ref = rest

    K, V, T = spec.head_k_dim, spec.head_v_dim, block.tile
    group = spec.num_v_heads // spec.num_k_heads
    b = pl.program_id(2)
    if spec.fused_conv:  # one program per key-head group (see `_conv_decode`); block_v == V
        col0 = 0
        kh = pl.program_id(1)
        heads = [kh * group + j for j in range(group)]
    else:
        col0 = pl.program_id(0) * block.block_v
        heads = [pl.program_id(1)]
        kh = heads[0] // group
    n_tiles = block.block_v // T

    if spec.pooled:
        slot = slots_ref[b]
        # Padding (-1) and anything outside the pool: no state traffic at all.
        valid = (slot >= 0) & (slot < state_in_ref.shape[0])
        row = jnp.where(valid, slot, 0)
    else:
        valid, row = None, b

    def fetch(h, t):
        """Issue every load of one column tile together (one memory latency for all of them)."""
        c = col0 + t * T
        x = {"S": state_in_ref[row, h, :, pl.ds(c, T)]}
        if conv is None:
            x["v"] = v_ref[b, pl.ds(spec.v_col + h * V + c, T)]
        else:
            x["v"], x["window"] = _conv_decode(conv, v_ref, b, row, spec.v_col + h * V + c, T,
                                               spec.conv_width)
        if spec.fused_norm:
            x["z"] = z_ref[b, pl.ds(spec.z_col + h * V + t * T, T)]
        return x

    def store_state(S, h, t):
        """Tile t of the updated state, rounded to the state dtype (RNE, or stochastically)."""
        c = col0 + t * T
        if spec.stochastic_rounding:
            # the element's flat index in its state (or pool) is its counter
            base = ((row * spec.num_v_heads + h) * K) * V + c
            offset = (lax.broadcasted_iota(jnp.int32, (K, T), 0) * V
                      + lax.broadcasted_iota(jnp.int32, (K, T), 1))
            counter = (base + offset).astype(jnp.uint32)
            S = stochastic_round_value(S, state_out_ref.dtype,
                                       counter_bits(counter, seed_ref[0], seed_ref[1]))
        state_out_ref[row, h, :, pl.ds(c, T)] = S.astype(state_out_ref.dtype)

    def key_operands(r):
        """q (normalised if asked, scaled) and k of key head kh from operand row r (sequence b
        in a decode, a token in a prefill), fp32; with the fused conv also their new window
        rows."""
        windows = []
        if conv is None:
            q = q_ref[r, pl.ds(spec.q_col + kh * K, K)].astype(F32)
            k = k_ref[r, pl.ds(spec.k_col + kh * K, K)].astype(F32)
        else:
            q, wq = _conv_decode(conv, q_ref, b, row, spec.q_col + kh * K, K, spec.conv_width)
            k, wk = _conv_decode(conv, k_ref, b, row, spec.k_col + kh * K, K, spec.conv_width)
            windows = [(spec.q_col + kh * K, wq), (spec.k_col + kh * K, wk)]
        if spec.use_qk_l2norm:
            q, k = l2_normalize(q), l2_normalize(k)
        return q * jnp.float32(spec.scale), k, windows

    def gate_operands(h, r):
        g = (g_ref[r, pl.ds(spec.g_col + h * K, K)] if spec.per_channel_gate
             else g_ref[r, spec.g_col + h]).astype(F32)
        beta = beta_ref[r, spec.beta_col + h].astype(F32)
        if spec.raw_gates:
            A_log = A_log_ref[h].astype(F32)
            dt = (dt_bias_ref[pl.ds(h * K, K)] if spec.per_channel_gate
                  else dt_bias_ref[h]).astype(F32)
            g = (kda_gate_value(g, A_log, dt, spec.gate_lower_bound) if spec.per_channel_gate
                 else gdn_gate_value(g, A_log, dt))
            beta = jax.nn.sigmoid(beta)
        return g, beta

    def store_outputs(h, outs):
        if spec.fused_norm:  # block_v == V: this program holds the whole head's output
            # a head whose squares overflowed is scaled exactly and summed again (the rare
            # branch of a scalar lax.cond, as in l2_normalize)
            sumsq = sum(jnp.sum(o * o) for o, _ in outs)
            huge = sumsq == jnp.inf
            shrink = jnp.where(huge, jnp.float32(HUGE_ROW_SCALE), jnp.float32(1.0))
            outs = [(o * shrink, z) for o, z in outs]
            inv = lax.cond(huge, lambda: lax.rsqrt(sum(jnp.sum(o * o) for o, _ in outs) / V),
                           lambda: lax.rsqrt(sumsq / V + jnp.float32(spec.norm_eps)))
            for t, (o, z) in enumerate(outs):
                z = z.astype(F32)
                w = w_ref[pl.ds(t * T, T)].astype(F32)
                act = z * jax.nn.sigmoid(z) if spec.norm_activation == "silu" else jax.nn.sigmoid(z)
                o_ref[b, pl.ds(h * V + t * T, T)] = (o * inv * w * act).astype(o_ref.dtype)
        else:
            for t, (o, _) in enumerate(outs):
                o_ref[b, pl.ds(h * V + col0 + t * T, T)] = o.astype(o_ref.dtype)

    def step():
        # The first tile's state load is issued before the per-head operand math, and each next
        # tile's before the current tile's update, so a program always has a tile in flight.
        pending = fetch(heads[0], 0)
        q, k, windows = key_operands(b)
        for i, h in enumerate(heads):
            g, beta = gate_operands(h, b)
            outs = []
            for t in range(n_tiles):
                x = pending
                if t + 1 < n_tiles:
                    pending = fetch(h, t + 1)
                elif i + 1 < len(heads):
                    pending = fetch(heads[i + 1], 0)
                o, S = token_update(x["S"].astype(F32), q, k, x["v"].astype(F32), g, beta)
                store_state(S, h, t)
                outs.append((o, x.get("z")))
                if conv is not None:
                    windows.append((spec.v_col + h * V + col0 + t * T, x["window"]))
            store_outputs(h, outs)
        for col, rows in windows:  # after every read of this program's window columns
            _store_window(conv, row, col, rows[0].shape[0], rows)

    def walk_tokens():
        """Token-serial prefill: the slab stays in registers (one fp32 tile per column tile)
        while the program walks tokens seq_start[b]..seq_end[b] of the row arrays, each through
        `token_update`; its outputs are written per token and the state once, at the end."""
        first, end = seq_start_ref[b], seq_end_ref[b]
        h = heads[0]
        cols = [pl.ds(col0 + t * T, T) for t in range(n_tiles)]
        if spec.reads_state:
            tiles = tuple(state_in_ref[row, h, :, c].astype(F32) for c in cols)
        else:
            tiles = tuple(jnp.zeros((K, T), F32) for _ in cols)

        def token(r, tiles):
            q, k, _ = key_operands(r)
            g, beta = gate_operands(h, r)
            new = []
            for t in range(n_tiles):
                v = v_ref[r, pl.ds(spec.v_col + h * V + col0 + t * T, T)].astype(F32)
                o, S = token_update(tiles[t], q, k, v, g, beta)
                if spec.token_outputs:
                    o_ref[r, pl.ds(h * V + col0 + t * T, T)] = o.astype(o_ref.dtype)
                new.append(S)
            return tuple(new)

        tiles = lax.fori_loop(first, end, token, tiles)
        for S, c in zip(tiles, cols):
            state_out_ref[row, h, :, c] = S.astype(state_out_ref.dtype)

    if spec.tokens:
        if valid is None:
            walk_tokens()
        else:
            pl.when(valid)(walk_tokens)
            if spec.token_outputs:  # padding: its tokens' outputs are zero
                def zero(r, carry):
                    o_ref[r, pl.ds(heads[0] * V + col0, block.block_v)] = jnp.zeros(
                        (block.block_v,), o_ref.dtype)
                    return carry

                @pl.when(jnp.logical_not(valid))
                def _():
                    lax.fori_loop(seq_start_ref[b], seq_end_ref[b], zero, 0)
    elif valid is None:
        step()
    else:
        pl.when(valid)(step)

        @pl.when(jnp.logical_not(valid))
        def _():
            for h in heads:
                o_ref[b, pl.ds(h * V + col0, block.block_v)] = jnp.zeros((block.block_v,), o_ref.dtype)


# --------------------------------------------------------------------------- launcher

def _check_rows(name, x, batch, min_width):
    if getattr(x, "ndim", None) != 2:
        raise ValueError(f"{name} must be a 2-D row array [B, width], got shape {getattr(x, 'shape', None)}")
    if x.shape[0] != batch:
        raise ValueError(f"{name} must have B={batch} rows, got shape {x.shape}")
    if x.shape[1] < min_width:
        raise ValueError(f"{name} is too narrow: its column offset and heads need {min_width} "
                         f"columns, got shape {x.shape}")


def _check_token_operands(spec, q_rows, k_rows, v_rows, g_rows, beta_rows, A_log, dt_bias, rows):
    """The per-token row arrays (`rows` rows each, wide enough for their column offsets) and the
    raw-gate vectors of a decode or token-serial launch."""
    K, V, HK, HV = spec.head_k_dim, spec.head_v_dim, spec.num_k_heads, spec.num_v_heads
    gk = K if spec.per_channel_gate else 1
    _check_rows("q", q_rows, rows, spec.q_col + HK * K)
    _check_rows("k", k_rows, rows, spec.k_col + HK * K)
    _check_rows("v", v_rows, rows, spec.v_col + HV * V)
    _check_rows("a" if spec.raw_gates else "g", g_rows, rows, spec.g_col + HV * gk)
    _check_rows("b" if spec.raw_gates else "beta", beta_rows, rows, spec.beta_col + HV)
    if spec.raw_gates:
        _check_vector("A_log", A_log, HV)
        _check_vector("dt_bias", dt_bias, HV * gk)


def _check_vector(name, x, size):
    if getattr(x, "ndim", None) != 1 or x.shape[0] != size:
        raise ValueError(f"{name} must have shape ({size},), got {getattr(x, 'shape', None)}")


def gdn_decode(q_rows, k_rows, v_rows, g_rows, beta_rows, state, *, spec: DecodeSpec,
               A_log=None, dt_bias=None, slots=None, z_rows=None, norm_weight=None, seed=None,
               conv_weight=None, conv_bias=None, conv_windows=None,
               out_dtype=None, block: DecodeBlockSizes | None = None, interpret: bool = False):
    """Launch the decode kernel. Returns (o [B, HV * V] in out_dtype, new state), and with
    `spec.fused_conv` (o, new state, new conv windows).

    Row arrays are [B, width]; `spec`'s column offsets place each operand in its row (pass the
    same array several times for packed input). `state` is [B, HV, K, V] (or the pool
    [slots, HV, K, V] with `slots` [B] int32). The state output aliases `state`: donate it at
    the jit boundary to update it in place. With the fused conv, q/k/v rows are the pre-conv
    packed row [B, conv_dim], conv_weight is [conv_dim, W], conv_bias [conv_dim] (with
    spec.conv_bias) and conv_windows [rows, W-1, conv_dim] (rows as the state's), aliased to the
    third output like the state. `seed` [2] uint32 with
    `spec.stochastic_rounding`. Shapes are checked here, before any device work.
    """
    K, V, HK, HV = spec.head_k_dim, spec.head_v_dim, spec.num_k_heads, spec.num_v_heads
    batch = q_rows.shape[0] if getattr(q_rows, "ndim", 0) >= 1 else -1
    _check_token_operands(spec, q_rows, k_rows, v_rows, g_rows, beta_rows, A_log, dt_bias, batch)
    if getattr(state, "ndim", None) != 4 or tuple(state.shape[1:]) != (HV, K, V):
        raise ValueError(f"state must have shape [{'slots' if spec.pooled else 'B'}, HV={HV}, K={K}, "
                         f"V={V}], got {getattr(state, 'shape', None)}")
    if spec.pooled:
        if getattr(slots, "shape", None) != (batch,) or not jnp.issubdtype(slots.dtype, jnp.integer):
            raise ValueError(f"slots must be an int32 array of shape ({batch},), got "
                             f"{getattr(slots, 'shape', None)} {getattr(slots, 'dtype', None)}")
    elif state.shape[0] != batch:
        raise ValueError(f"state must have B={batch} sequences, got shape {state.shape}")
    if spec.fused_norm:
        _check_rows("z", z_rows, batch, spec.z_col + HV * V)
        _check_vector("norm_weight", norm_weight, V)
    if spec.stochastic_rounding and (getattr(seed, "shape", None) != (2,) or seed.dtype != jnp.uint32):
        raise ValueError(f"seed must be a uint32 array of shape (2,), got {getattr(seed, 'shape', None)} "
                         f"{getattr(seed, 'dtype', None)}")
    if spec.fused_conv:
        _check_conv(spec, conv_weight, conv_bias, conv_windows, state.shape[0])
    block = block or default_block_sizes(batch, V, state.dtype, spec.fused_norm or spec.fused_conv)
    reason = unsupported_reason(spec, block, state.dtype) or index_overflow_reason(state.size)
    if reason is not None:
        raise ValueError(reason)
    out_dtype = jnp.dtype(out_dtype or (jnp.bfloat16 if spec.fused_norm else q_rows.dtype))
    conv = (conv_weight, conv_bias, conv_windows) if spec.fused_conv else None
    return _launch(q_rows, k_rows, v_rows, g_rows, beta_rows, A_log, dt_bias, slots, seed, z_rows,
                   norm_weight, state, conv, spec=spec, block=block, out_dtype=out_dtype,
                   interpret=interpret)


def _check_conv(spec, weight, bias, windows, rows):
    c, w = spec.conv_dim, spec.conv_width
    if getattr(weight, "shape", None) != (c, w):
        raise ValueError(f"conv_weight must have shape (conv_dim={c}, W={w}), got "
                         f"{getattr(weight, 'shape', None)}")
    if spec.conv_bias:
        _check_vector("conv_bias", bias, c)
    elif bias is not None:
        raise ValueError("conv_bias was given but spec.conv_bias is False")
    if getattr(windows, "shape", None) != (rows, w - 1, c):
        raise ValueError(f"conv_windows must have shape ({rows}, W-1={w - 1}, conv_dim={c}) (one "
                         f"window per state row), got {getattr(windows, 'shape', None)}")


@default_config
@functools.partial(jax.jit, static_argnames=("spec", "block", "out_dtype", "interpret"))
def _launch(q_rows, k_rows, v_rows, g_rows, beta_rows, A_log, dt_bias, slots, seed, z_rows,
            norm_weight, state, conv=None, *, spec, block, out_dtype, interpret):
    batch = q_rows.shape[0]
    inputs = [q_rows, k_rows, v_rows, g_rows, beta_rows]
    if spec.raw_gates:
        inputs += [A_log, dt_bias]
    if spec.pooled:
        inputs += [slots.astype(jnp.int32)]
    if spec.stochastic_rounding:
        inputs += [seed]
    if spec.fused_norm:
        inputs += [z_rows, norm_weight]
    out_shape = [jax.ShapeDtypeStruct((batch, spec.num_v_heads * spec.head_v_dim), out_dtype),
                 jax.ShapeDtypeStruct(state.shape, state.dtype)]
    aliases = {}
    if spec.fused_conv:
        weight, bias, windows = conv
        inputs += [weight] + ([bias] if spec.conv_bias else []) + [windows]
        aliases[len(inputs) - 1] = 2
        out_shape.append(jax.ShapeDtypeStruct(windows.shape, windows.dtype))
    inputs.append(state)
    aliases[len(inputs) - 1] = 1
    kernel = functools.partial(_decode_kernel, spec=spec, block=block)
    return pl.pallas_call(
        kernel,
        # Column block fastest, then head, then sequence: the GPU starts programs in grid order,
        # so programs resident at the same time stream one contiguous stretch of the state. With
        # the sequence fastest, neighbours are a whole sequence's state apart and a narrow block
        # reads rows of one head whose other columns come much later. The fused conv runs one
        # program per key-head group (see `_conv_decode`).
        grid=((1, spec.num_k_heads, batch) if spec.fused_conv else
              (spec.head_v_dim // block.block_v, spec.num_v_heads, batch)),
        out_shape=tuple(out_shape),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=block.num_warps, num_stages=block.num_stages),
        interpret=interpret,
        name="gdn_decode_conv" if spec.fused_conv else "gdn_decode",
    )(*inputs)


# --------------------------------------------------------------------------- token-serial prefill

def serial_prefill(q_rows, k_rows, v_rows, g_rows, beta_rows, seq_start, seq_end, state=None, *,
                   spec: DecodeSpec, A_log=None, dt_bias=None, slots=None, out_dtype=None,
                   state_dtype=None, block: DecodeBlockSizes | None = None,
                   interpret: bool = False):
    """Launch the decode kernel body in token-serial mode (`spec.tokens`): a prefill whose
    programs each keep one [K, block_v] state slab in registers for a whole sequence.

    Row arrays are [T_total, width], one token per row, operands placed by `spec`'s column
    offsets as for `gdn_decode`. Sequence n is rows seq_start[n] .. seq_end[n] - 1 (int32 [N];
    empty ranges are legal; ranges may overlap when `spec.token_outputs` is False).
    `state`: None (start from zeros; `spec.reads_state` False); the initial states [N, HV, K, V]
    (read only: the final states come back as a new array in `state_dtype`, default the
    state's dtype, fp32 without one); or, with `spec.pooled`, the pool [P, HV, K, V] and `slots`
    [N] int32, read and written in place (aliased: donate it at the jit boundary; a slot outside
    [0, P) is padding: nothing read or written, outputs zero).
    Returns (o [T_total, HV * V] in out_dtype, or None without token outputs; states)."""
    K, V, HK, HV = spec.head_k_dim, spec.head_v_dim, spec.num_k_heads, spec.num_v_heads
    if not spec.tokens:
        raise ValueError("serial_prefill needs a spec with tokens=True")
    rows = q_rows.shape[0] if getattr(q_rows, "ndim", 0) >= 1 else -1
    _check_token_operands(spec, q_rows, k_rows, v_rows, g_rows, beta_rows, A_log, dt_bias, rows)
    n = seq_start.shape[0] if getattr(seq_start, "ndim", None) == 1 else -1
    _check_vector("seq_start", seq_start, n)
    _check_vector("seq_end", seq_end, n)
    if spec.reads_state != (state is not None):
        raise ValueError(f"state must be {'given' if spec.reads_state else 'None'} "
                         f"(spec.reads_state={spec.reads_state})")
    if state is not None:
        if getattr(state, "ndim", None) != 4 or tuple(state.shape[1:]) != (HV, K, V):
            raise ValueError(f"state must have shape [{'P' if spec.pooled else 'N'}, HV={HV}, "
                             f"K={K}, V={V}], got {getattr(state, 'shape', None)}")
        if not spec.pooled and state.shape[0] != n:
            raise ValueError(f"state must hold N={n} initial states, got shape {state.shape}")
    if spec.pooled:
        if state is None or getattr(slots, "shape", None) != (n,):
            raise ValueError(f"a pooled prefill needs the pool and slots of shape ({n},)")
    state_dtype = jnp.dtype(state_dtype or (state.dtype if state is not None else jnp.float32))
    if spec.pooled:
        state_dtype = jnp.dtype(state.dtype)
    block = block or default_serial_block_sizes(n, HV, V, K)
    reason = (unsupported_reason(spec, block, state_dtype)
              or index_overflow_reason(max(n * HV * K * V, 0 if state is None else state.size,
                                           rows * max(HV * V, v_rows.shape[1], q_rows.shape[1]))))
    if reason is not None:
        raise ValueError(reason)
    out_dtype = jnp.dtype(out_dtype or q_rows.dtype)
    return _launch_serial(q_rows, k_rows, v_rows, g_rows, beta_rows, A_log, dt_bias, slots,
                          seq_start.astype(jnp.int32), seq_end.astype(jnp.int32), state,
                          spec=spec, block=block, out_dtype=out_dtype, state_dtype=state_dtype,
                          interpret=interpret)


@default_config
@functools.partial(jax.jit, static_argnames=("spec", "block", "out_dtype", "state_dtype",
                                             "interpret"))
def _launch_serial(q_rows, k_rows, v_rows, g_rows, beta_rows, A_log, dt_bias, slots, seq_start,
                   seq_end, state, *, spec, block, out_dtype, state_dtype, interpret):
    rows, n = q_rows.shape[0], seq_start.shape[0]
    inputs = [q_rows, k_rows, v_rows, g_rows, beta_rows]
    if spec.raw_gates:
        inputs += [A_log, dt_bias]
    if spec.pooled:
        inputs += [slots.astype(jnp.int32)]
    inputs += [seq_start, seq_end]
    if spec.reads_state:
        inputs.append(state)
    out_rows = rows if spec.token_outputs else 1
    state_shape = state.shape if spec.pooled else (n, spec.num_v_heads, spec.head_k_dim,
                                                   spec.head_v_dim)
    o, states = pl.pallas_call(
        functools.partial(_decode_kernel, spec=spec, block=block),
        # As the decode: column block fastest, then head, then sequence.
        grid=(spec.head_v_dim // block.block_v, spec.num_v_heads, n),
        out_shape=(jax.ShapeDtypeStruct((out_rows, spec.num_v_heads * spec.head_v_dim), out_dtype),
                   jax.ShapeDtypeStruct(state_shape, state_dtype)),
        # The pool is updated in place; initial states are only read (the caller keeps them).
        input_output_aliases={len(inputs) - 1: 1} if spec.pooled else {},
        compiler_params=plgpu.CompilerParams(num_warps=block.num_warps, num_stages=block.num_stages),
        interpret=interpret,
        name="gdn_serial_prefill",
    )(*inputs)
    return (o if spec.token_outputs else None), states
