"""Pure-JAX references: the oracle every kernel, block and benchmark is checked against.

Everything here is plain `jax.numpy`, float32 math (matmuls at `Precision.HIGHEST`, so a GPU run
does not silently drop to TF32), FLA/HF layout:

    q, k   [B, T, HK, K]        v     [B, T, HV, V]
    g      [B, T, HV] (GDN)     g     [B, T, HV, K] (KDA)      beta [B, T, HV]
    state  [B, HV, K, V]        (K-major: S[k, v])

Value head j reads key head j // (HV // HK) (grouped value heads, "GVA").

Per (sequence, value head), for each token t (see docs/design.md, "Semantics"):

    S <- exp(g_t) * S                 (GDN: scalar g_t; KDA: diag(exp(g_t)), per key channel)
    u_t = beta_t * (v_t - S^T k_t)    (the delta reads the decayed S)
    S <- S + k_t u_t^T
    o_t = S^T (scale * q_t)           (read after the update)

The public, validated entry points (`gated_delta_rule`, `kda`) live in `gdn_jax.ops`; the functions
here trust their inputs' shapes and are what those entry points and the tests call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST
L2NORM_EPS = 1e-6
# Above this max |x| a sum of squares over up to 2**28 elements could overflow fp32: see l2norm.
L2NORM_RESCALE_ABOVE = 2.0 ** 50
SOFTPLUS_THRESHOLD = 20.0

__all__ = [
    "softplus", "l2norm", "gdn_gate", "gdn_beta", "kda_gate", "gated_rmsnorm",
    "causal_conv1d", "causal_conv1d_step", "conv_state_from_hf", "conv_state_to_hf",
    "state_to_16bit", "state_to_f32", "stochastic_round", "expand_kv_heads", "recurrent_delta_rule",
    "chunked_delta_rule", "chunk_log_decay", "decode_step", "verify_steps",
]


# --------------------------------------------------------------------------- elementwise pieces

def softplus(x: jax.Array) -> jax.Array:
    """torch.nn.functional.softplus (beta 1, threshold 20) in fp32: x itself above 20."""
    x = x.astype(F32)
    return jnp.where(x > SOFTPLUS_THRESHOLD, x, jnp.log1p(jnp.exp(jnp.minimum(x, SOFTPLUS_THRESHOLD))))


def l2norm(x: jax.Array, eps: float = L2NORM_EPS) -> jax.Array:
    """x * rsqrt(sum(x^2) + eps) over the last axis, in fp32 (returns fp32), for any finite x.

    Squares of |x| > ~1.8e19 overflow fp32, which would turn the norm into inf and the output into
    zeros. A vector whose max |x| exceeds L2NORM_RESCALE_ABOVE is first divided by 2**e (e the
    exponent of its max, so the division is exact) and eps by 2**(2e), the same function; below
    that (every ordinary input) the computation is the plain formula, bit for bit."""
    x = x.astype(F32)
    m = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    e = jnp.where(m > L2NORM_RESCALE_ABOVE, jnp.frexp(m)[1], 0)
    y = jnp.ldexp(x, -e)
    eps = jnp.ldexp(jnp.full(e.shape, eps, F32), -2 * e)
    return y * lax.rsqrt(jnp.sum(y * y, axis=-1, keepdims=True) + eps)


def gdn_gate(a: jax.Array, A_log: jax.Array, dt_bias: jax.Array) -> jax.Array:
    """GDN log-space decay: g = -exp(A_log) * softplus(a + dt_bias), fp32, shape of `a` ([..., HV])."""
    a = a.astype(F32)
    return -jnp.exp(A_log.astype(F32)) * softplus(a + dt_bias.astype(F32))


def gdn_beta(b: jax.Array) -> jax.Array:
    """beta = sigmoid(b) in fp32."""
    return jax.nn.sigmoid(b.astype(F32))


def kda_gate(g: jax.Array, A_log: jax.Array, dt_bias: jax.Array, *,
             lower_bound: float | None = None) -> jax.Array:
    """KDA per-channel log decay from the raw gate projection, fp32 [..., HV, K].

    g [..., HV, K] raw (f_b(f_a(x)) reshaped); A_log [HV] (any shape with HV elements);
    dt_bias [HV, K] or [HV * K].

    lower_bound None:  g = -exp(A_log[h]) * softplus(g + dt_bias[h, :])
    lower_bound lb<0:  g = lb * sigmoid(exp(A_log[h]) * (g + dt_bias[h, :]))
    """
    if lower_bound is not None and not float(lower_bound) < 0.0:
        raise ValueError(f"lower_bound must be < 0 (or None for the softplus gate), got {lower_bound}")
    hv, kd = g.shape[-2], g.shape[-1]
    if A_log.size != hv:
        raise ValueError(f"A_log must hold HV={hv} values, got shape {A_log.shape}")
    if dt_bias.size != hv * kd:
        raise ValueError(f"dt_bias must hold HV*K={hv * kd} values, got shape {dt_bias.shape}")
    A = jnp.exp(A_log.astype(F32).reshape(hv, 1))
    x = g.astype(F32) + dt_bias.astype(F32).reshape(hv, kd)
    if lower_bound is None:
        return -A * softplus(x)
    return jnp.float32(lower_bound) * jax.nn.sigmoid(A * x)


def gated_rmsnorm(x: jax.Array, z: jax.Array, weight: jax.Array, *, eps: float = 1e-6,
                  activation: str = "silu", out_dtype=None) -> jax.Array:
    """y = x * rsqrt(mean(x^2) + eps) * weight * act(z) over the last axis (one head of size V).

    fp32 math, one rounding to `out_dtype` (default: x's dtype). GDN uses act = SiLU, KDA sigmoid.
    Safe for any finite x: a head whose max |x| exceeds L2NORM_RESCALE_ABOVE is scaled exactly
    first (as in `l2norm`), so its squares cannot overflow.
    """
    if activation not in ("silu", "sigmoid"):
        raise ValueError(f"activation must be 'silu' or 'sigmoid', got {activation!r}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    xf = x.astype(F32)
    zf = z.astype(F32)
    act = jax.nn.silu(zf) if activation == "silu" else jax.nn.sigmoid(zf)
    m = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    e = jnp.where(m > L2NORM_RESCALE_ABOVE, jnp.frexp(m)[1], 0)
    xs = jnp.ldexp(xf, -e)
    eps = jnp.ldexp(jnp.full(e.shape, eps, F32), -2 * e)
    y = xs * lax.rsqrt(jnp.mean(xs * xs, axis=-1, keepdims=True) + eps) * weight.astype(F32) * act
    return y.astype(out_dtype)


# --------------------------------------------------------------------------- short causal conv
# Canonical conv state: the last W-1 *inputs* of the sequence, time-major, [B, W-1, C] (the same
# channel order as the activations). HF keeps W columns channel-major [B, C, W] whose oldest
# column is never read again; vLLM keeps W-1. Convert at the boundary with the helpers below.

def causal_conv1d(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None, *,
                  conv_state: jax.Array | None = None, activation: str | None = "silu"):
    """Depthwise causal conv over time: y_t = act(sum_j w[c, j] x_{t-W+1+j} (+ b[c])), fp32 accumulate.

    x [B, T, C]; weight [C, W]; bias [C] or None; conv_state [B, W-1, C] (the inputs before x;
    zeros when None). Returns (y [B, T, C] in x's dtype, new conv_state [B, W-1, C] in the dtype
    of conv_state, or of x when none was given).
    """
    if activation not in (None, "silu"):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    b, t, c = x.shape
    w = weight.shape[-1]
    state_dtype = x.dtype if conv_state is None else conv_state.dtype
    if conv_state is None:
        conv_state = jnp.zeros((b, w - 1, c), x.dtype)
    xp = jnp.concatenate([conv_state.astype(F32), x.astype(F32)], axis=1)  # [B, T+W-1, C]
    wf = weight.astype(F32)
    y = sum(xp[:, j:j + t, :] * wf[:, j] for j in range(w))
    if bias is not None:
        y = y + bias.astype(F32)
    if activation == "silu":
        y = jax.nn.silu(y)
    new_state = xp[:, xp.shape[1] - (w - 1):, :].astype(state_dtype)
    return y.astype(x.dtype), new_state


def causal_conv1d_step(x: jax.Array, conv_state: jax.Array, weight: jax.Array,
                       bias: jax.Array | None = None, *, activation: str | None = "silu"):
    """One decode step: shift the window left by one, write x last, convolve. x [B, C]."""
    y, new_state = causal_conv1d(x[:, None, :], weight, bias, conv_state=conv_state,
                                 activation=activation)
    return y[:, 0, :], new_state


def conv_state_from_hf(hf_state: jax.Array) -> jax.Array:
    """HF cache conv state [B, C, W] (last W inputs, channel-major) -> canonical [B, W-1, C]."""
    return jnp.swapaxes(hf_state[:, :, 1:], 1, 2)


def conv_state_to_hf(state: jax.Array) -> jax.Array:
    """Canonical [B, W-1, C] -> HF [B, C, W]; the oldest column (never read again) is zero."""
    s = jnp.swapaxes(state, 1, 2)
    return jnp.concatenate([jnp.zeros_like(s[:, :, :1]), s], axis=2)


# --------------------------------------------------------------------------- state dtype

def _check_16bit(dtype, name="dtype"):
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"{name} must be float16 or bfloat16, got {dtype}")


def stochastic_round(x: jax.Array, dtype, key: jax.Array) -> jax.Array:
    """fp32 x -> fp16/bf16, rounding to one of the two neighbours of x with the probabilities that
    make the result unbiased: E[result] = x. Deterministic for a given `key`.

    Round to nearest even turns exp(g) * S back into S whenever |g| is below half an ulp
    (2**-9 for bf16, 2**-12 for fp16), so a 16-bit state whose directions are not rewritten never
    decays; stochastic rounding decays it on average. Values exact in `dtype`, infinities, NaN
    and values that round to nearest to inf are rounded as by round to nearest even.

    r = RNE(x) is one neighbour; the other is one step (one bit pattern) further in x's direction,
    and p = (x - r) / (other - r), exact in fp32 (neighbours differ by a power of two), is the
    chance of taking it, compared with a uniform fp32 draw (granularity 2**-24)."""
    _check_16bit(dtype)
    x = x.astype(F32)
    r = x.astype(dtype)
    r32 = r.astype(F32)
    bits = lax.bitcast_convert_type(r, jnp.uint16)
    away = jnp.abs(x) > jnp.abs(r32)                  # the other neighbour is farther from zero
    exact = x == r32
    other = lax.bitcast_convert_type(
        jnp.where(away, bits + jnp.uint16(1), jnp.where(exact, bits, bits - jnp.uint16(1))), dtype)
    gap = other.astype(F32) - r32
    p = jnp.where(exact | ~jnp.isfinite(gap), 0.0, (x - r32) / jnp.where(exact, 1.0, gap))
    u = jax.random.uniform(key, x.shape, F32)
    return jnp.where(u < p, other, r)


def state_to_16bit(state: jax.Array, dtype=jnp.float16, *, key: jax.Array | None = None) -> jax.Array:
    """fp32 state -> fp16/bf16 (out of place): round to nearest even, or with a PRNG `key`
    stochastic rounding (`stochastic_round`, deterministic for the key)."""
    _check_16bit(dtype)
    if key is not None:
        return stochastic_round(state, dtype, key)
    return state.astype(F32).astype(dtype)


def state_to_f32(state: jax.Array) -> jax.Array:
    """16-bit (or fp32) state -> fp32, exact."""
    return state.astype(F32)


# --------------------------------------------------------------------------- delta rule

def expand_kv_heads(x: jax.Array, num_v_heads: int, axis: int) -> jax.Array:
    """[.., HK, ..] -> [.., HV, ..]: value head j reads key head j // (HV // HK)."""
    hk = x.shape[axis]
    return x if hk == num_v_heads else jnp.repeat(x, num_v_heads // hk, axis=axis)


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm, head_axis):
    """fp32 casts, optional L2 norm, scale folded into q, key heads expanded to value heads."""
    hv = v.shape[head_axis]
    qf = l2norm(q) if use_qk_l2norm else q.astype(F32)
    kf = l2norm(k) if use_qk_l2norm else k.astype(F32)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qf = expand_kv_heads(qf * jnp.float32(scale), hv, head_axis)
    kf = expand_kv_heads(kf, hv, head_axis)
    return qf, kf, v.astype(F32), g.astype(F32), beta.astype(F32)


def _token_update(S, q, k, v, g, beta):
    """One token of the recurrence on fp32 S [..., K, V]; q, k [..., K]; v [..., V];
    g [...] (scalar gate) or [..., K] (per-channel gate); beta [...]. Returns (o [..., V], S)."""
    decay = jnp.exp(g)
    S = S * (decay[..., :, None] if g.ndim == k.ndim else decay[..., None, None])
    u = beta[..., None] * (v - jnp.einsum("...k,...kv->...v", k, S, precision=HIGHEST))
    S = S + k[..., :, None] * u[..., None, :]
    o = jnp.einsum("...k,...kv->...v", q, S, precision=HIGHEST)
    return o, S


def _zero_state(b, hv, kd, vd):
    return jnp.zeros((b, hv, kd, vd), F32)


def recurrent_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None,
                         use_qk_l2norm=False):
    """Token-serial `lax.scan` reference. Returns (o fp32 [B, T, HV, V], final fp32 [B, HV, K, V])."""
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta, scale, use_qk_l2norm, head_axis=2)
    b, _, hv, kd = kf.shape
    S0 = _zero_state(b, hv, kd, vf.shape[-1]) if initial_state is None else initial_state.astype(F32)

    def body(S, xs):
        o, S = _token_update(S, *xs)
        return S, o

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (qf, kf, vf, gf, bf))
    S, o = lax.scan(body, S0, xs)
    return jnp.moveaxis(o, 0, 1), S


# Gate floor of the chunk forms. exp(GATE_FLOOR) = 6e-39 is below fp32's smallest normal, so a
# gate at the floor already erases the state as far as fp32 math can tell; clamping -inf (a reset)
# and gates like -3e38 to it keeps every in-chunk cumulative sum finite (no -inf - -inf).
GATE_FLOOR = -88.0
# Gates split as g = hi + lo with hi on a grid of 1/GATE_HI_SCALE: in-chunk sums of hi are exact
# in fp32 while |sum| * GATE_HI_SCALE < 2**24, which bounds the chunk size (see chunk_log_decay).
GATE_HI_SCALE = 16.0
MAX_CHUNK_SIZE = int(2 ** 24 // (-GATE_FLOOR * GATE_HI_SCALE))


def chunk_log_decay(g: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """In-chunk cumulative log decay of fp32 gates, as an exact part and a small part.

    g holds the gates of one chunk along `axis` (at most MAX_CHUNK_SIZE tokens), any values in
    [-inf, 0]. Each gate is clamped at GATE_FLOOR and split into hi = round(16 g) / 16 and
    lo = g - hi (|lo| <= 1/32; both parts exact). Returns (HI, LO), the inclusive cumulative sums
    along `axis`. HI is exact (multiples of 1/16 below 2**24 / 16 in size), so the log decay
    between tokens j <= i,

        seg_ij = (HI_i - HI_j) + (LO_i - LO_j),

    carries only the rounding of the small LO sums (~1e-7 absolute) however negative the gates
    before j were; a plain cumulative sum G loses ulp(G_i) (3e-5 at |G| = 500) in G_i - G_j.
    """
    g = jnp.maximum(g.astype(F32), jnp.float32(GATE_FLOOR))
    hi = jnp.round(g * jnp.float32(GATE_HI_SCALE)) / jnp.float32(GATE_HI_SCALE)
    return jnp.cumsum(hi, axis=axis), jnp.cumsum(g - hi, axis=axis)


def _quarantine(k, v, g, beta):
    """Tokens whose k, v, beta or gate hold NaN (or k, v, beta an inf) spoil, in the scan, every
    output from that token on (a bad v entry only its value column) and the final state. The chunk
    form mixes a chunk's tokens in matmuls, where a masked-out NaN still gives 0 * NaN = NaN
    for the tokens before it. So: replace bad tokens by neutral ones (k = v = beta = g = 0) and
    return the [B, T, HV, V] mask of outputs the scan makes non-finite, to be set to NaN after."""
    bad_g = jnp.isnan(g) if g.ndim == 3 else jnp.any(jnp.isnan(g), axis=-1)
    bad = bad_g | ~jnp.isfinite(beta) | ~jnp.all(jnp.isfinite(k), axis=-1)       # [B, T, HV]
    bad_v = bad[..., None] | ~jnp.isfinite(v)                                    # [B, T, HV, V]
    spoiled = jnp.cumsum(bad_v.astype(jnp.int32), axis=1) > 0
    k = jnp.where(bad[..., None], 0.0, k)
    v = jnp.where(bad_v, 0.0, v)
    g = jnp.where(bad if g.ndim == 3 else bad[..., None], 0.0, g)
    beta = jnp.where(bad, 0.0, beta)
    return k, v, g, beta, spoiled


def chunked_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None,
                       use_qk_l2norm=False, chunk_size=64):
    """The WY/UT chunk form, pure JAX: same function as `recurrent_delta_rule`, any T, any state,
    any gates in [-inf, 0].

    Within a chunk of C tokens with cumulative log decay G_i (from the chunk start):
        S_i = D(G_i) S_0 + sum_{j<=i} D(G_i - G_j) k_j u_j^T
    so the deltas solve a unit lower-triangular system (I + A) U = beta * (V - (k * e^G) S_0)
    with A_ij = beta_i sum_c k_ic k_jc e^{G_ic - G_jc} (j < i), and
        O = (q * e^G) S_0 + (QK ∘ decay, j <= i) U,   S_C = D(G_C) S_0 + sum_j D(G_C - G_j) k_j u_j^T.
    G comes from `chunk_log_decay` (gates clamped at GATE_FLOOR, exact-plus-small split), so
    pairwise differences are finite and accurate to ~1e-7 for any gates; they are masked before
    exp (every exponent used is <= 0), so no gate size can overflow. Tokens holding NaN are
    quarantined (`_quarantine`): outputs before them are exact, outputs from them on are NaN, as
    in the scan. Chunks run in a `lax.scan`, which keeps the [C, C, K] pairwise decay of the
    per-channel gate to one chunk at a time.
    """
    if not 1 <= chunk_size <= MAX_CHUNK_SIZE:
        raise ValueError(f"chunk_size must be in [1, {MAX_CHUNK_SIZE}], got {chunk_size}")
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta, scale, use_qk_l2norm, head_axis=2)
    kf, vf, gf, bf, spoiled = _quarantine(kf, vf, gf, bf)
    b, t, hv, kd = kf.shape
    vd = vf.shape[-1]
    per_channel = gf.ndim == 4
    c = chunk_size
    nc = -(-t // c)
    pad = nc * c - t
    if pad:  # neutral tokens: g = 0 (no decay), beta = 0 (no write), q = k = v = 0
        padt = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        qf, kf, vf, gf, bf = map(padt, (qf, kf, vf, gf, bf))
    # [B, NC*C, H, ...] -> [NC, B, H, C, ...]
    to_chunks = lambda a: jnp.moveaxis(a.reshape((b, nc, c) + a.shape[2:]), (1, 2), (0, 3)) \
        if a.ndim == 3 else jnp.moveaxis(a.reshape((b, nc, c) + a.shape[2:]), (1, 2, 3), (0, 3, 2))
    qc, kc, vc, gc, bc = map(to_chunks, (qf, kf, vf, gf, bf))
    S0 = _zero_state(b, hv, kd, vd) if initial_state is None else initial_state.astype(F32)
    incl = jnp.tril(jnp.ones((c, c), bool))
    strict = jnp.tril(jnp.ones((c, c), bool), -1)
    eye = jnp.eye(c, dtype=F32)
    ein = lambda s, *a: jnp.einsum(s, *a, precision=HIGHEST)

    def chunk(S, xs):
        qx, kx, vx, gx, bx = xs  # [B,H,C,K], [B,H,C,K], [B,H,C,V], [B,H,C(,K)], [B,H,C]
        HI, LO = chunk_log_decay(gx, axis=2)
        seg_end = (HI[:, :, -1:] - HI) + (LO[:, :, -1:] - LO)                     # G_C - G_j
        eG = jnp.exp(HI + LO)                                                    # e^{G_i}
        if per_channel:
            pair = lambda X: X[:, :, :, None, :] - X[:, :, None, :, :]
            D = jnp.exp(jnp.where(incl[:, :, None], pair(HI) + pair(LO), -jnp.inf))  # [B,H,C,C,K]
            KK = ein("bhic,bhjc,bhijc->bhij", kx, kx, D)
            QK = ein("bhic,bhjc,bhijc->bhij", qx, kx, D)
            k_end = kx * jnp.exp(seg_end)
        else:
            pair = lambda X: X[:, :, :, None] - X[:, :, None, :]
            D = jnp.exp(jnp.where(incl, pair(HI) + pair(LO), -jnp.inf))          # [B,H,C,C]
            KK = ein("bhic,bhjc->bhij", kx, kx) * D
            QK = ein("bhic,bhjc->bhij", qx, kx) * D
            eG = eG[..., None]
            k_end = kx * jnp.exp(seg_end)[..., None]
        state_decay = eG[:, :, -1, :, None]                                      # [B,H,K|1,1]
        A = jnp.where(strict, bx[..., :, None] * KK, 0.0)
        rhs = bx[..., None] * (vx - ein("bhik,bhkv->bhiv", kx * eG, S))
        U = jax.scipy.linalg.solve_triangular(eye + A, rhs, lower=True, unit_diagonal=True)
        O = ein("bhik,bhkv->bhiv", qx * eG, S) + ein("bhij,bhjv->bhiv", QK, U)
        S = S * state_decay + ein("bhjk,bhjv->bhkv", k_end, U)
        return S, O

    S, O = lax.scan(chunk, S0, (qc, kc, vc, gc, bc))
    O = jnp.moveaxis(O, (0, 3), (1, 2)).reshape(b, nc * c, hv, vd)[:, :t]
    O = jnp.where(spoiled, jnp.nan, O)
    S = jnp.where(spoiled[:, -1, :, None, :], jnp.nan, S) if t else S
    return O, S


def decode_step(q, k, v, g, beta, state, *, scale=None, use_qk_l2norm=False, rounding_key=None):
    """One token for a batch: q, k [B, HK, K]; v [B, HV, V]; g [B, HV] (GDN) or [B, HV, K] (KDA);
    beta [B, HV]; state [B, HV, K, V] of any float dtype.

    Returns (o [B, HV, V] in q's dtype, new state in state's dtype: fp32 math, one rounding).
    The rounding is to nearest even; with `rounding_key` (a PRNG key, 16-bit states only) the
    store rounds stochastically (`stochastic_round`), which lets slow decays act on a 16-bit
    state (see docs/numerics.md); the same key gives the same state."""
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta, scale, use_qk_l2norm, head_axis=1)
    o, S = _token_update(state.astype(F32), qf, kf, vf, gf, bf)
    if rounding_key is not None:
        _check_16bit(state.dtype, "state dtype with rounding_key")
        return o.astype(q.dtype), stochastic_round(S, state.dtype, rounding_key)
    return o.astype(q.dtype), S.astype(state.dtype)


def verify_steps(q, k, v, g, beta, state, *, scale=None, use_qk_l2norm=False, rounding_key=None):
    """T draft tokens from a committed state, keeping the state after each token.

    Same layout as the sequence functions ([B, T, ...]). Returns (o [B, T, HV, V] in q's dtype,
    states [B, T, HV, K, V] in state's dtype): states[:, i] is what `decode_step` run i + 1
    times holds — the same per-token math, each token's state rounded to the state dtype as a
    decode store would. (Bitwise equality is a property of kernels, not of two XLA programs.)
    With `rounding_key`, token i's store rounds stochastically with fold_in(rounding_key, i)."""
    def body(S, xs):
        i, *xs = xs
        key = None if rounding_key is None else jax.random.fold_in(rounding_key, i)
        o, S = decode_step(*xs, S, scale=scale, use_qk_l2norm=use_qk_l2norm, rounding_key=key)
        return S, (o, S)

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
    _, (o, states) = lax.scan(body, state, (jnp.arange(q.shape[1]),) + xs)
    return jnp.moveaxis(o, 0, 1), jnp.moveaxis(states, 0, 1)
