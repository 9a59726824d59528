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
  * fused conv:      q, k and v are the *pre-conv* packed row [B, conv_dim] = q | k | v (channel
                     c is column c); the kernel runs the short conv's decode step itself: it
                     reads the window [W-1, channels] of its channels from the conv window array
                     (a pool [slots, W-1, conv_dim] beside the state pool, or [B, W-1, conv_dim]),
                     convolves [window, x] with the depthwise weight [conv_dim, W] (+ bias),
                     applies SiLU, rounds to the row's dtype (as the unfused chain stores it) and
                     writes the shifted window back in place (aliased, like the state). See
                     `_conv_decode` for why a program then owns a whole key-head group.

The per-token math lives in `token_update` (and its helpers `l2_normalize`, `gdn_gate_value`,
`kda_gate_value`): plain jnp on in-register values, so any Pallas kernel
body (the K-token verify in gdn_verify.py) can call them and get bit-identical results, provided
it uses the same tile shape [K, tile_v] and num_warps (Triton's reduction order follows the
layout).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

F32 = jnp.float32
L2NORM_EPS = 1e-6
L2NORM_RESCALE_ABOVE = 2.0 ** 50  # max |x| above which a row's squares may overflow fp32
HUGE_ROW_SCALE = 2.0 ** -100      # exact; brings any finite fp32 row well inside range
SOFTPLUS_THRESHOLD = 20.0
STATE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))

__all__ = [
    "DecodeBlockSizes", "DecodeSpec", "TUNING_TABLE", "default_block_sizes", "unsupported_reason",
    "index_overflow_reason",
    "token_update", "l2_normalize", "softplus_value", "gdn_gate_value", "kda_gate_value",
    "gdn_decode",
]


# --------------------------------------------------------------------------- in-kernel math
# Plain jnp on fp32 values already in registers: callable from any Pallas kernel body (and from
# plain JAX). Keep the operation order fixed: the verify kernel relies on bit-identical results.

def l2_normalize(x: jax.Array, eps: float = L2NORM_EPS) -> jax.Array:
    """x * rsqrt(sum(x^2) + eps) over the last axis, fp32 (the reference's `l2norm`), for any
    finite x: a vector whose max |x| exceeds L2NORM_RESCALE_ABOVE (its squares would overflow)
    is first scaled by an exact power of two (eps then no longer matters); below that the
    plain formula runs, bit for bit."""
    huge = jnp.max(jnp.abs(x), axis=-1, keepdims=True) > L2NORM_RESCALE_ABOVE
    x = x * jnp.where(huge, jnp.float32(HUGE_ROW_SCALE), jnp.float32(1.0))
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True)
                         + jnp.where(huge, jnp.float32(0.0), jnp.float32(eps)))


def tame_huge_rows(x: jax.Array) -> jax.Array:
    """x (any float dtype, rows on the last axis) with every row whose max |x| exceeds
    L2NORM_RESCALE_ABOVE scaled by an exact power of two: the same rows after an L2 norm, and
    their squares no longer overflow. For launchers whose kernels form raw dot products of rows
    that are L2-normalised afterwards (one elementwise XLA pass; ordinary rows are unchanged)."""
    huge = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True) > L2NORM_RESCALE_ABOVE
    return jnp.where(huge, x * jnp.asarray(HUGE_ROW_SCALE, x.dtype), x)


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


def token_update(S: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                 beta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token of the gated delta rule on a state tile. All fp32.

    S [K, BV] (state columns c0..c0+BV of one head, K-major); q [K] (already scaled, and
    L2-normalised if asked); k [K]; v [BV] (the same columns); g: scalar log decay (GDN) or [K]
    (KDA, per key channel); beta: scalar. Returns (o [BV], S_new [K, BV]):

        S <- exp(g) * S ;  u = beta * (v - S^T k) ;  S <- S + k u^T ;  o = S^T q

    Columns are independent, so a head may be split over programs by columns. Bit-identical
    results across kernels need the same tile shape and num_warps (reduction order)."""
    decay = jnp.exp(g)
    S = S * (decay[:, None] if decay.ndim == 1 else decay)
    u = beta * (v - jnp.sum(k[:, None] * S, axis=0))
    S = S + k[:, None] * u[None, :]
    o = jnp.sum(q[:, None] * S, axis=0)
    return o, S


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
# 1.5-21% slower); tiny batches want more, smaller programs to fill the chip. The fused norm
# needs the whole head in one program: two [K, 64] tiles.
TUNING_TABLE: tuple[tuple[int, int, bool, DecodeBlockSizes], ...] = (
    (8, 4, False, DecodeBlockSizes(block_v=32, num_warps=4)),
    (1 << 30, 4, False, DecodeBlockSizes(block_v=64, num_warps=4)),
    (8, 2, False, DecodeBlockSizes(block_v=32, num_warps=4)),
    (1 << 30, 2, False, DecodeBlockSizes(block_v=64, num_warps=4)),
    (1 << 30, 4, True, DecodeBlockSizes(block_v=128, tile_v=64, num_warps=4)),
    (1 << 30, 2, True, DecodeBlockSizes(block_v=128, num_warps=4)),
)


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
    fused_conv: bool = False         # q/k/v rows are pre-conv; conv weight + windows are inputs
    conv_width: int = 0              # W of the fused conv (its windows hold W-1 inputs)
    conv_bias: bool = False          # the fused conv adds a bias [conv_dim]

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim


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
    A_log_ref = dt_bias_ref = slots_ref = z_ref = w_ref = conv = None
    if spec.raw_gates:
        A_log_ref, dt_bias_ref, *rest = rest
    if spec.pooled:
        slots_ref, *rest = rest
    if spec.fused_norm:
        z_ref, w_ref, *rest = rest
    if spec.fused_conv:  # inputs: weight, [bias], windows; the windows' output comes last
        conv_w_ref, *rest = rest
        conv_b_ref = None
        if spec.conv_bias:
            conv_b_ref, *rest = rest
        win_in_ref, *rest = rest
        conv = _ConvRefs(conv_w_ref, conv_b_ref, win_in_ref, rest.pop())
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

    def key_operands():
        """q (normalised if asked, scaled) and k of key head kh, fp32; with the fused conv also
        their new window rows."""
        windows = []
        if conv is None:
            q = q_ref[b, pl.ds(spec.q_col + kh * K, K)].astype(F32)
            k = k_ref[b, pl.ds(spec.k_col + kh * K, K)].astype(F32)
        else:
            q, wq = _conv_decode(conv, q_ref, b, row, spec.q_col + kh * K, K, spec.conv_width)
            k, wk = _conv_decode(conv, k_ref, b, row, spec.k_col + kh * K, K, spec.conv_width)
            windows = [(spec.q_col + kh * K, wq), (spec.k_col + kh * K, wk)]
        if spec.use_qk_l2norm:
            q, k = l2_normalize(q), l2_normalize(k)
        return q * jnp.float32(spec.scale), k, windows

    def gate_operands(h):
        g = (g_ref[b, pl.ds(spec.g_col + h * K, K)] if spec.per_channel_gate
             else g_ref[b, spec.g_col + h]).astype(F32)
        beta = beta_ref[b, spec.beta_col + h].astype(F32)
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
            sumsq = sum(jnp.sum(o * o) for o, _ in outs)
            inv = lax.rsqrt(sumsq / V + jnp.float32(spec.norm_eps))
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
        q, k, windows = key_operands()
        for i, h in enumerate(heads):
            g, beta = gate_operands(h)
            outs = []
            for t in range(n_tiles):
                x = pending
                if t + 1 < n_tiles:
                    pending = fetch(h, t + 1)
                elif i + 1 < len(heads):
                    pending = fetch(heads[i + 1], 0)
                o, S = token_update(x["S"].astype(F32), q, k, x["v"].astype(F32), g, beta)
                state_out_ref[row, h, :, pl.ds(col0 + t * T, T)] = S.astype(state_out_ref.dtype)
                outs.append((o, x.get("z")))
                if conv is not None:
                    windows.append((spec.v_col + h * V + col0 + t * T, x["window"]))
            store_outputs(h, outs)
        for col, rows in windows:  # after every read of this program's window columns
            _store_window(conv, row, col, rows[0].shape[0], rows)

    if valid is None:
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


def _check_vector(name, x, size):
    if getattr(x, "ndim", None) != 1 or x.shape[0] != size:
        raise ValueError(f"{name} must have shape ({size},), got {getattr(x, 'shape', None)}")


def gdn_decode(q_rows, k_rows, v_rows, g_rows, beta_rows, state, *, spec: DecodeSpec,
               A_log=None, dt_bias=None, slots=None, z_rows=None, norm_weight=None,
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
    third output like the state. Shapes are checked here, before any device work.
    """
    K, V, HK, HV = spec.head_k_dim, spec.head_v_dim, spec.num_k_heads, spec.num_v_heads
    batch = q_rows.shape[0] if getattr(q_rows, "ndim", 0) >= 1 else -1
    gk = K if spec.per_channel_gate else 1
    _check_rows("q", q_rows, batch, spec.q_col + HK * K)
    _check_rows("k", k_rows, batch, spec.k_col + HK * K)
    _check_rows("v", v_rows, batch, spec.v_col + HV * V)
    _check_rows("a" if spec.raw_gates else "g", g_rows, batch, spec.g_col + HV * gk)
    _check_rows("b" if spec.raw_gates else "beta", beta_rows, batch, spec.beta_col + HV)
    if spec.raw_gates:
        _check_vector("A_log", A_log, HV)
        _check_vector("dt_bias", dt_bias, HV * gk)
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
    if spec.fused_conv:
        _check_conv(spec, conv_weight, conv_bias, conv_windows, state.shape[0])
    block = block or default_block_sizes(batch, V, state.dtype, spec.fused_norm or spec.fused_conv)
    reason = unsupported_reason(spec, block, state.dtype) or index_overflow_reason(state.size)
    if reason is not None:
        raise ValueError(reason)
    out_dtype = jnp.dtype(out_dtype or (jnp.bfloat16 if spec.fused_norm else q_rows.dtype))
    conv = (conv_weight, conv_bias, conv_windows) if spec.fused_conv else None
    return _launch(q_rows, k_rows, v_rows, g_rows, beta_rows, A_log, dt_bias, slots, z_rows,
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


@functools.partial(jax.jit, static_argnames=("spec", "block", "out_dtype", "interpret"))
def _launch(q_rows, k_rows, v_rows, g_rows, beta_rows, A_log, dt_bias, slots, z_rows, norm_weight,
            state, conv=None, *, spec, block, out_dtype, interpret):
    batch = q_rows.shape[0]
    inputs = [q_rows, k_rows, v_rows, g_rows, beta_rows]
    if spec.raw_gates:
        inputs += [A_log, dt_bias]
    if spec.pooled:
        inputs += [slots.astype(jnp.int32)]
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
