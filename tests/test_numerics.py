"""Numerics of the references on hard legal inputs: gates in [-inf, 0] (resets, gates far below
any useful decay, mixes of huge and tiny gates), NaN containment, l2norm of huge vectors, 16-bit
state drift and stochastic rounding, and property-based checks over random shapes and schedules."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conftest
from conftest import KERNEL_MODES, interpret_flag
from gdn_jax import reference as ref
from helpers import rel_err

KEY = jax.random.PRNGKey(14)
# Jitted once at module level so every test with the same shapes shares one compilation.
_chunked = jax.jit(ref.chunked_delta_rule, static_argnames=("use_qk_l2norm", "chunk_size"))
_scan = jax.jit(ref.recurrent_delta_rule, static_argnames=("use_qk_l2norm",))
_decode = jax.jit(ref.decode_step, static_argnames=("use_qk_l2norm",))
_verify_steps = jax.jit(ref.verify_steps)


def _key(*ids):
    return jax.random.fold_in(KEY, zlib.crc32(repr(ids).encode()) % (2 ** 31))


# ------------------------------------------------------------------ float64 oracle

def scan_f64(q, k, v, g, beta, h0, scale=None):
    """The recurrence in float64 NumPy, vectorised over batch and heads (q, k already normalised
    and expanded to value heads: [B, T, HV, K]). exp(-inf) = 0 resets, NaN propagates as in IEEE."""
    q, k, v, g, beta, S = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, h0))
    S = S.copy()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    T = q.shape[1]
    o = np.zeros(v.shape)
    with np.errstate(invalid="ignore", over="ignore"):
        for t in range(T):
            d = np.exp(g[:, t])
            S = S * (d[..., :, None] if d.ndim == 3 else d[..., None, None])
            u = beta[:, t, :, None] * (v[:, t] - np.einsum("bhk,bhkv->bhv", k[:, t], S))
            S = S + k[:, t, :, :, None] * u[:, :, None, :]
            o[:, t] = np.einsum("bhk,bhkv->bhv", q[:, t] * scale, S)
    return o, S


def _inputs(key, kind, B=1, T=256, H=2, K=16, V=16, gate=None):
    """Unit-norm q, k (already per value head), random v, beta, initial state; gate from `gate`."""
    ks = jax.random.split(key, 6)
    q = ref.l2norm(jax.random.normal(ks[0], (B, T, H, K)))
    k = ref.l2norm(jax.random.normal(ks[1], (B, T, H, K)))
    v = jax.random.normal(ks[2], (B, T, H, V))
    beta = jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H)))
    h0 = jax.random.normal(ks[4], (B, H, K, V))
    gshape = (B, T, H) if kind == "gdn" else (B, T, H, K)
    g = gate(ks[5], gshape)
    return q, k, v, g, beta, h0


def gate_gdn_normal(key, shape):
    """gdn_gate of a ~ N(0, 8), A = exp(A_log) uniform in [1, 16], dt_bias ~ N(0, 1)."""
    ka, kA, kd = jax.random.split(key, 3)
    a = 8.0 * jax.random.normal(ka, shape)
    A_log = jnp.log(jax.random.uniform(kA, shape[2:3], minval=1.0, maxval=16.0))
    dt_bias = jax.random.normal(kd, shape[2:])
    A_log = A_log.reshape(A_log.shape + (1,) * (len(shape) - 3))
    return ref.gdn_gate(a, A_log, dt_bias)


def gate_bursty(big, small, p=0.1):
    def make(key, shape):
        kb, ks = jax.random.split(key)
        burst = jax.random.bernoulli(kb, p, shape)
        tiny = small * jax.random.uniform(ks, shape, minval=0.5, maxval=1.5)
        return jnp.where(burst, big, tiny).astype(jnp.float32)
    return make


GATE_MIXES = {
    "gdn_gate_N(0,8)": gate_gdn_normal,
    "bursty_-500/-1e-3": gate_bursty(-500.0, -1e-3),
    "bursty_-1e4/-1e-4": gate_bursty(-1e4, -1e-4),
    "bursty_-inf/-1e-3": gate_bursty(-jnp.inf, -1e-3),
    "bursty_-3e38/-1e-2": gate_bursty(-3e38, -1e-2),
    "all_-inf": lambda key, shape: jnp.full(shape, -jnp.inf),
    "tiny_-1e-30": lambda key, shape: jnp.full(shape, -1e-30),
}


# ------------------------------------------------------------------ chunk form on hard gates

@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("mix", list(GATE_MIXES))
def test_chunked_matches_float64_on_hard_gates(kind, mix):
    """The chunk form is as accurate as the scan (<= 1e-5 relative L2 vs float64) for gates from
    -inf to -1e-30, mixed within a chunk, at T = 256, and never NaN."""
    q, k, v, g, beta, h0 = _inputs(_key(kind, mix), kind, gate=GATE_MIXES[mix])
    want_o, want_s = scan_f64(q, k, v, g, beta, h0)
    o, s = _chunked(q, k, v, g, beta, initial_state=h0)
    assert rel_err(o, want_o) <= 1e-5, rel_err(o, want_o)
    assert rel_err(s, want_s) <= 1e-5, rel_err(s, want_s)
    o_scan, s_scan = _scan(q, k, v, g, beta, initial_state=h0)
    assert rel_err(o_scan, want_o) <= 1e-5 and rel_err(s_scan, want_s) <= 1e-5


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("where", ["g", "k", "beta", "v_column"])
def test_nan_token_spoils_only_what_the_scan_spoils(kind, where):
    """A NaN at token 100 (inside the second chunk of 64): outputs 0..99 exact, outputs from 100
    on non-finite, exactly where the scan's are (a NaN in one v entry: only that value column)."""
    q, k, v, g, beta, h0 = _inputs(_key("nan", kind, where), kind,
                                   gate=GATE_MIXES["gdn_gate_N(0,8)"])
    t0 = 100
    if where == "g":
        g = g.at[0, t0, 1].set(jnp.nan)
    elif where == "k":
        k = k.at[0, t0, 0, 3].set(jnp.nan)
    elif where == "beta":
        beta = beta.at[0, t0, 0].set(jnp.nan)
    else:
        v = v.at[0, t0, 1, 5].set(jnp.nan)
    o_scan, s_scan = _scan(q, k, v, g, beta, initial_state=h0)
    o, s = _chunked(q, k, v, g, beta, initial_state=h0)
    want_o, _ = scan_f64(q, k, v, g, beta, h0)
    assert rel_err(o[:, :t0], want_o[:, :t0]) <= 1e-5
    np.testing.assert_array_equal(np.isfinite(o), np.isfinite(o_scan))
    np.testing.assert_array_equal(np.isfinite(s), np.isfinite(s_scan))
    assert not np.all(np.isfinite(o[:, t0:])) and np.all(np.isfinite(o[:, :t0]))
    finite = np.isfinite(np.asarray(o_scan))
    assert rel_err(np.where(finite, o, 0), np.where(finite, want_o, 0)) <= 1e-5


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_public_chunked_path_takes_minus_inf_gates(kind):
    """Through `gated_delta_rule` / `kda` (impl="chunked", packed varlen too): a -inf gate resets
    the state exactly as the scan does."""
    import gdn_jax
    fn = gdn_jax.gated_delta_rule if kind == "gdn" else gdn_jax.kda
    q, k, v, g, beta, h0 = _inputs(_key("public", kind), kind, T=96, gate=gate_bursty(-jnp.inf, -1e-2))
    kw = dict(output_final_state=True)
    o, s = fn(q, k, v, g, beta, initial_state=h0, impl="chunked", **kw)
    want_o, want_s = scan_f64(q, k, v, g, beta, h0)
    assert rel_err(o, want_o) <= 1e-5 and rel_err(s, want_s) <= 1e-5
    cu = jnp.array([0, 40, 96], jnp.int32)
    ov, sv = fn(q, k, v, g, beta, initial_state=jnp.concatenate([h0, h0]), cu_seqlens=cu,
                impl="chunked", **kw)
    o2, s2 = scan_f64(q[:, 40:], k[:, 40:], v[:, 40:], g[:, 40:], beta[:, 40:], h0)
    assert rel_err(ov[:, 40:], o2) <= 1e-5 and rel_err(sv[1:], s2) <= 1e-5


def test_chunk_log_decay_differences_are_exact_for_huge_gates():
    """HI holds exact sums, so a difference after a -500 burst keeps the small gates' size."""
    g = jnp.array([-500.0, -500.0, -1e-3, -2e-3, -jnp.inf, -3e38, -1e-30, -0.7], jnp.float32)
    HI, LO = ref.chunk_log_decay(g, axis=0)
    assert np.all(np.isfinite(HI)) and np.all(np.isfinite(LO))
    seg = (HI[3] - HI[1]) + (LO[3] - LO[1])
    np.testing.assert_allclose(float(seg), -3e-3, rtol=1e-6)
    gd = np.maximum(np.asarray(g, np.float64), ref.GATE_FLOOR)
    np.testing.assert_allclose(np.asarray(HI, np.float64) + np.asarray(LO, np.float64),
                               np.cumsum(gd), rtol=1e-7)
    assert np.all(np.asarray(HI) * ref.GATE_HI_SCALE == np.round(np.asarray(HI) * ref.GATE_HI_SCALE))


# ------------------------------------------------------------------ l2norm

@pytest.mark.parametrize("size", [1.0, 1e19, 1e25, 3e38 / 4])
def test_l2norm_any_finite_size(size):
    """Squares of |x| > 1.8e19 overflow fp32: the norm must still be x / |x| (it used to be 0)."""
    x = jax.random.normal(_key("l2", size), (6, 48))
    xd = np.asarray(x, np.float64) * size
    want = xd / np.sqrt((xd * xd).sum(-1, keepdims=True) + ref.L2NORM_EPS)
    got = jax.jit(ref.l2norm)(x * jnp.float32(size))
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-7)
    got = ref.l2norm(jnp.array([[3.4e38, -3.4e38, 1.0]], jnp.float32))
    np.testing.assert_allclose(np.asarray(got), [[2 ** -0.5, -(2 ** -0.5), 0.0]], atol=1e-7)


# Row sizes for the kernel paths: squares that overflow fp32 (3e38 / 4, 1e30 / 4) and sizes above
# the tame bound L2NORM_RESCALE_ABOVE = 2**50 whose squares do not overflow (2**55, 1e20): a
# launcher that tames those rows must keep eps from swamping them.
HUGE_ROW_SIZES = (3e38 / 4.0, 2.0 ** 55, 1e30 / 4.0, 1e20)


@pytest.mark.parametrize("mode", KERNEL_MODES)
@pytest.mark.parametrize("path", ["prefill", "decode", "carried fast", "carried exact",
                                  "verify states"])
def test_kernels_take_huge_query_and_key_rows(path, mode):
    """q/k rows of any finite size through the kernels with the L2 norm: the same result as the
    rows at an ordinary scale (the norm makes the scale irrelevant). The decode kernel guards its
    norm in the kernel; the verify, prefill and fast launchers tame huge rows before the
    launch."""
    import gdn_jax
    from gdn_jax import carry as cv
    from gdn_jax import verify as vf
    from gdn_jax.state import DeltaPool
    B, T, HK, HV, K = 2, (70 if path == "prefill" else 1 if path == "decode" else 3), 1, 2, 16
    ks = jax.random.split(_key("huge rows", path), 6)
    q, k = (jax.random.normal(x, (B, T, HK, K)) for x in ks[:2])
    v = jax.random.normal(ks[2], (B, T, HV, K))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, HV)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, HV)))
    h0 = jax.random.normal(ks[5], (B, HV, K, K))
    sizes = np.resize(np.asarray(HUGE_ROW_SIZES, np.float32), B * T).reshape(B, T, 1, 1)
    big = jnp.asarray(sizes)
    slots = jnp.arange(B, dtype=jnp.int32)
    interp = interpret_flag(mode)

    def run(q, k):
        if path in ("prefill", "decode"):
            return gdn_jax.gated_delta_rule(q, k, v, g, beta, initial_state=h0, impl="pallas",
                                            use_qk_l2norm=True, output_final_state=True,
                                            interpret=interp)
        if path == "verify states":
            return vf.verify_states(q, k, v, g, beta, h0, slots, use_qk_l2norm=True,
                                    impl="pallas", interpret=interp)
        pool = DeltaPool.init(B, num_k_heads=HK, num_v_heads=HV, head_k_dim=K, head_v_dim=K)
        pool = DeltaPool(jnp.array(h0, copy=True), pool.stash)  # donated
        o, pool, _ = cv.carried_verify(q, k, v, g, beta, pool, slots,
                                       exact=path == "carried exact", use_qk_l2norm=True,
                                       impl="pallas", interpret=interp)
        return o, cv.flush(pool, impl="reference").states

    want_o, want_s = run(q, k)
    o, s = run(q * big, k * big)
    assert np.all(np.isfinite(np.asarray(o))) and np.all(np.isfinite(np.asarray(s)))
    assert rel_err(o, want_o) <= 1e-5 and rel_err(s, want_s) <= 1e-5


def test_tame_huge_rows_scales_exactly_and_only_huge_rows():
    """tame_huge_rows leaves rows with max |x| <= 2**50 bit for bit, and brings every larger row
    (fp32 and bf16) to a max in [2**24, 2**25) by an exact power of two."""
    from pallas_kernels.gdn_decode import L2NORM_RESCALE_ABOVE, tame_huge_rows
    tame = jax.jit(tame_huge_rows)
    x = jax.random.normal(_key("tame"), (8, 32))
    scales = jnp.asarray([1.0, 1e-30, 2.0 ** 40, 2.0 ** 46, 2.0 ** 51, 1e20, 1e30, 3e37],
                         jnp.float32)[:, None]
    for dtype in (jnp.float32, jnp.bfloat16):
        rows = (x * scales).astype(dtype)
        rows = rows.at[3].set(rows[3].at[0].set(L2NORM_RESCALE_ABOVE))  # max exactly at the bound
        got = np.asarray(tame(rows).astype(jnp.float32))
        rows = np.asarray(rows.astype(jnp.float32))
        np.testing.assert_array_equal(got[:4], rows[:4])
        ratio = got[4:] / rows[4:]
        assert np.all(ratio == ratio[:, :1])                                 # one factor per row
        assert np.all(np.log2(ratio[:, 0]) == np.round(np.log2(ratio[:, 0])))  # a power of two
        top = np.abs(got[4:]).max(-1)
        assert np.all((top >= 2.0 ** 24) & (top < 2.0 ** 25))


def test_exact_verify_sees_the_decode_bits_up_to_the_tame_bound():
    """The decode kernel guards its L2 norm in the kernel, the exact carried verify normalises
    rows tamed by its launcher: for rows with max |x| up to 2**50 (tame leaves them alone, and
    the guard's plain branch runs) the two give the same bits (interpret mode; the GPU test in
    test_front_door.py checks the compiled kernels)."""
    from gdn_jax import carry as cv
    from gdn_jax import decode as dec
    from gdn_jax.state import DeltaPool
    B, T, HK, HV, K = 2, 1, 1, 2, 16    # the norm is per token: one token shows the bound
    ks = jax.random.split(_key("tame bound"), 6)
    # every row's max |x| in [2**49, 2**50): the largest rows that tame leaves alone
    to_bound = lambda x: x * 2.0 ** (50 - jnp.frexp(jnp.max(jnp.abs(x), -1, keepdims=True))[1])
    q, k = (to_bound(jax.random.normal(x, (B, T, HK, K))) for x in ks[:2])
    v = jax.random.normal(ks[2], (B, T, HV, K))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, HV)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, HV)))
    h0 = jax.random.normal(ks[5], (B, HV, K, K))
    slots = jnp.arange(B, dtype=jnp.int32)

    def verify(q, k, v, g, beta, h0):
        dp = DeltaPool.init(B, num_k_heads=HK, num_v_heads=HV, head_k_dim=K, head_v_dim=K)
        o, dp, _ = cv.carried_verify(q, k, v, g, beta, DeltaPool(h0, dp.stash), slots,
                                     use_qk_l2norm=True, impl="pallas", interpret=True)
        dp, _ = cv.accept(dp, slots, jnp.full((B,), T, jnp.int32))
        return o, cv.flush(dp, impl="pallas", interpret=True).states

    def decode(q, k, v, g, beta, state):
        outs = []
        for t in range(T):
            o_t, state = dec.gdn_decode(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state,
                                        use_qk_l2norm=True, impl="pallas", interpret=True)
            outs.append(o_t)
        return jnp.stack(outs, 1), state

    # XLA (interpret mode) contracts products and adds into FMAs differently in different
    # programs; without fusion it does not (as tests/test_verify.py compiles its schedules)
    no_fusion = {"xla_disable_hlo_passes": "fusion", "xla_backend_optimization_level": 0}
    o, s = jax.jit(verify, compiler_options=no_fusion)(q, k, v, g, beta, h0)
    want_o, want_s = jax.jit(decode, compiler_options=no_fusion)(q, k, v, g, beta, h0)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(want_o))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(want_s))


def test_l2norm_unchanged_bit_for_bit_on_ordinary_inputs():
    x = 100.0 * jax.random.normal(_key("l2 plain"), (8, 128))
    plain = x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + ref.L2NORM_EPS)
    np.testing.assert_array_equal(np.asarray(ref.l2norm(x)), np.asarray(plain))


@pytest.mark.parametrize("path", ["reference", "decode kernel"])
def test_gated_rmsnorm_of_huge_outputs(path):
    """The gated RMSNorm of a head of any finite size (its mean of squares would overflow fp32
    above ~1.8e19) equals the norm of the head at an ordinary scale: in the reference and in the
    decode kernel's fused norm (a state and values scaled by 2**100: o = S^T q is huge)."""
    from gdn_jax import decode as dec
    B, HK, HV, K = 2, 1, 2, 16
    ks = jax.random.split(_key("rmsnorm huge", path), 6)
    z = jax.random.normal(ks[0], (B, HV, K))
    w = 1.0 + 0.1 * jax.random.normal(ks[1], (K,))
    if path == "reference":
        x = jax.random.normal(ks[2], (B, HV, K))
        want = ref.gated_rmsnorm(x, z, w, out_dtype=jnp.float32)
        got = ref.gated_rmsnorm(x * 1e30, z, w, out_dtype=jnp.float32)
        np.testing.assert_array_equal(np.asarray(ref.gated_rmsnorm(x, z, w)),
                                      np.asarray(x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True)
                                                 + 1e-6) * w * jax.nn.silu(z)))  # plain formula
    else:
        q, k = (jax.random.normal(x, (B, HK, K)) for x in ks[2:4])
        v = jax.random.normal(ks[4], (B, HV, K))
        g, beta = jnp.full((B, HV), -0.1), jnp.full((B, HV), 0.5)
        h0 = jax.random.normal(ks[5], (B, HV, K, K))
        run = lambda s, v, eps: dec.gdn_decode(q, k, v, g, beta, s, z=z, norm_weight=w,
                                               use_qk_l2norm=True, out_dtype=jnp.float32,
                                               norm_eps=eps, impl="pallas", interpret=True)[0]
        # exact scaling by 2**100: the same norm, with eps (1e-6 against mean squares ~1e59)
        # as good as zero
        want = run(jnp.array(h0, copy=True), v, 0.0)
        got = run(h0 * 2.0 ** 100, v * 2.0 ** 100, 1e-6)
    assert np.all(np.isfinite(np.asarray(got)))
    assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_huge_queries_and_keys_through_the_sequence_path(impl):
    import gdn_jax
    q, k, v, g, beta, h0 = _inputs(_key("huge", impl), "gdn", T=20, gate=gate_bursty(-1.0, -1e-2))
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm=True, impl=impl)
    o, s = gdn_jax.gated_delta_rule(q, k, v, g, beta, **kw)
    o_big, s_big = gdn_jax.gated_delta_rule(q * 1e30, k * 3e20, v, g, beta, **kw)
    assert rel_err(o_big, o) <= 1e-5 and rel_err(s_big, s) <= 1e-5
    ob, sb = ref.decode_step(q[:, 0] * 1e30, k[:, 0] * 1e30, v[:, 0], g[:, 0], beta[:, 0], h0,
                             use_qk_l2norm=True)
    o1, s1 = ref.decode_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], h0, use_qk_l2norm=True)
    assert rel_err(ob, o1) <= 1e-5 and rel_err(sb, s1) <= 1e-5


# ------------------------------------------------------------------ carried verify, gate -inf

def _carried_rounds(kind, exact, impl, g_fill):
    """Two carried verify rounds of T = 3 (all accepted, so round two folds three pending rows)
    and a flush; token 1 of each round has the gate g_fill. Returns (outputs, flushed states)."""
    from gdn_jax import carry as cv
    from gdn_jax.state import DeltaPool
    B, HK, HV, K, V, T = 2, 1, 2, 16, 16, 3
    pool = DeltaPool.init(B, num_k_heads=HK, num_v_heads=HV, head_k_dim=K, head_v_dim=V,
                          per_channel_gate=kind == "kda")
    pool = DeltaPool(jax.random.normal(_key("pool"), (B, HV, K, V)), pool.stash)
    slots = jnp.arange(B, dtype=jnp.int32)
    outs = []
    for r in range(2):
        ks = jax.random.split(_key("carried", kind, r), 5)
        q, k = (jax.random.normal(x, (B, T, HK, K)) for x in ks[:2])
        v = jax.random.normal(ks[2], (B, T, HV, V))
        g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, HV) + ((K,) if kind == "kda" else ())))
        g = g.at[:, 1].set(g_fill)
        beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, HV)))
        o, pool, _ = cv.carried_verify(q, k, v, g, beta, pool, slots, exact=exact,
                                       use_qk_l2norm=True, impl=impl, interpret=impl == "pallas")
        pool, _ = cv.accept(pool, slots, jnp.full((B,), T, jnp.int32))
        outs.append(o)
    pool = cv.flush(pool, impl="reference")
    return jnp.stack(outs), pool.states


@pytest.mark.parametrize("impl, kind, g_fill", [("reference", "gdn", -jnp.inf),
                                                 ("pallas", "gdn", -jnp.inf),
                                                 ("pallas", "kda", -3e38)])
def test_fast_carried_verify_takes_minus_inf_gates(impl, kind, g_fill):
    """-inf and -3e38 gates in the fast carried verify (reference and kernel, pending-row fold
    included) equal the exact flavour, token by token."""
    want_o, want_pool = _carried_rounds(kind, True, "reference", g_fill)
    assert np.all(np.isfinite(want_o)) and np.all(np.isfinite(want_pool))
    o, pool = _carried_rounds(kind, False, impl, g_fill)
    assert rel_err(o, want_o) <= 1e-5 and rel_err(pool, want_pool) <= 1e-5


# ------------------------------------------------------------------ 16-bit state: stochastic rounding

DT16 = [jnp.bfloat16, jnp.float16]


@pytest.mark.parametrize("dtype", DT16)
def test_stochastic_round_is_unbiased_and_deterministic(dtype):
    eps = float(jnp.finfo(dtype).eps)
    # 1 + eps/4 rounds up with probability 1/4; -(1 - 0.3 * eps/2) (spacing eps/2 below 1) to -1
    # with probability 0.7.
    x = jnp.concatenate([jnp.full((40000,), 1 + eps / 4), jnp.full((40000,), -(1 - 0.3 * eps / 2))])
    y = np.asarray(ref.stochastic_round(x, dtype, jax.random.PRNGKey(3)).astype(jnp.float32))
    assert set(np.unique(y[:40000])) == {1.0, 1 + eps}
    assert abs(np.mean(y[:40000] > 1) - 0.25) < 0.01
    assert set(np.unique(y[40000:])) == {-1.0, -(1 - eps / 2)}
    assert abs(np.mean(y[40000:] == -1) - 0.7) < 0.01
    again = ref.stochastic_round(x, dtype, jax.random.PRNGKey(3))
    np.testing.assert_array_equal(np.asarray(again.astype(jnp.float32)), y)
    other = ref.stochastic_round(x, dtype, jax.random.PRNGKey(4))
    assert not np.array_equal(np.asarray(other.astype(jnp.float32)), y)
    # Averaged over keys, random values come back (RNE would keep a bias of up to half a step).
    xs = jax.random.uniform(_key("sr mean", str(dtype)), (64,), minval=-3.0, maxval=3.0)
    keys = jax.random.split(jax.random.PRNGKey(5), 4000)
    mean = jax.vmap(lambda k: ref.stochastic_round(xs, dtype, k).astype(jnp.float32))(keys).mean(0)
    step = np.abs(np.asarray(xs)) * eps
    assert np.all(np.abs(np.asarray(mean) - np.asarray(xs)) <= 0.05 * step + 1e-12)


@pytest.mark.parametrize("dtype", DT16)
def test_stochastic_round_special_values(dtype):
    big = float(jnp.finfo(dtype).max)
    over = min(1.5 * big, 3.4e38)                   # rounds to inf in dtype, finite in fp32
    x = jnp.array([0.0, -0.0, 1.0, -2.5, jnp.inf, -jnp.inf, jnp.nan, big, over, -over,
                   big * (1 + float(jnp.finfo(dtype).eps) / 8)], jnp.float32)
    y = ref.stochastic_round(x, dtype, jax.random.PRNGKey(0))
    np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)),
                                  np.asarray(x.astype(dtype).astype(jnp.float32)))
    assert ref.state_to_16bit(x, dtype, key=jax.random.PRNGKey(0)).dtype == dtype


def test_stochastic_rounding_lets_a_16bit_state_decay():
    """bf16 state, no writes (beta = 0), g = -5e-4 below half a bf16 ulp: round to nearest even
    never moves the state (the decay stall); stochastic rounding decays it as exp(g t)."""
    B, HV, K, V, T, g = 1, 2, 16, 16, 1000, -5e-4
    S0 = jax.random.normal(_key("stall"), (B, HV, K, V)).astype(jnp.bfloat16)
    q = jnp.zeros((B, HV, K)) + 0.1
    v = jnp.ones((B, HV, V))
    gs = jnp.full((B, HV), g)
    beta = jnp.zeros((B, HV))

    @jax.jit
    def run(key):
        def body(S, i):
            rk = None if key is None else jax.random.fold_in(key, i)
            _, S = ref.decode_step(q, q, v, gs, beta, S, rounding_key=rk)
            return S, None
        return jax.lax.scan(body, S0, jnp.arange(T))[0]

    f32 = lambda a: np.asarray(a.astype(jnp.float32), np.float64)
    rne = f32(jax.jit(lambda: jax.lax.scan(
        lambda S, _: (ref.decode_step(q, q, v, gs, beta, S)[1], None), S0, None, length=T)[0])())
    np.testing.assert_array_equal(rne, f32(S0))                     # the stall
    sr = f32(run(jax.random.PRNGKey(7)))
    s0 = f32(S0)
    # The mean decay is exp(g T) = 0.61 (the state's projection on itself); each entry carries a
    # random walk of ~10 rounding steps (~4% of its size).
    assert abs(np.sum(sr * s0) / np.sum(s0 * s0) - np.exp(g * T)) < 0.01
    assert np.linalg.norm(sr - s0 * np.exp(g * T)) / np.linalg.norm(s0 * np.exp(g * T)) < 0.1
    np.testing.assert_array_equal(f32(run(jax.random.PRNGKey(7))), sr)   # deterministic per key
    with pytest.raises(ValueError, match="rounding_key"):
        ref.decode_step(q, q, v, gs, beta, S0.astype(jnp.float32), rounding_key=jax.random.PRNGKey(0))


def test_verify_steps_with_rounding_key_match_decode_steps():
    B, HV, K, V, T = 2, 2, 8, 8, 3
    ks = jax.random.split(_key("vsr"), 5)
    q, k = (ref.l2norm(jax.random.normal(x, (B, T, HV, K))) for x in ks[:2])
    v = jax.random.normal(ks[2], (B, T, HV, V))
    g = jnp.full((B, T, HV), -1e-3)
    beta = jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, HV)))
    S = jax.random.normal(ks[4], (B, HV, K, V)).astype(jnp.bfloat16)
    key = jax.random.PRNGKey(11)
    f32 = lambda a: np.asarray(a.astype(jnp.float32))
    _, states = _verify_steps(q, k, v, g, beta, S, rounding_key=key)
    _, again = _verify_steps(q, k, v, g, beta, S, rounding_key=key)
    np.testing.assert_array_equal(f32(again), f32(states))
    _, rne = _verify_steps(q, k, v, g, beta, S)
    assert not np.array_equal(f32(rne), f32(states))
    for t in range(T):
        # Same keys, same probabilities; two XLA programs may differ by an fp32 ulp before the
        # rounding, which can move a draw across its threshold: one bf16 step at most.
        prev = S if t == 0 else states[:, t - 1]
        _, St = _decode(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], prev,
                                rounding_key=jax.random.fold_in(key, t))
        np.testing.assert_allclose(f32(states[:, t]), f32(St), rtol=2 ** -7, atol=2 ** -20)
        assert np.mean(f32(states[:, t]) == f32(St)) > 0.95


# ------------------------------------------------------------------ property-based

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402



def examples(n, full=None):
    """Hypothesis settings: n examples (`full` of them in the full CPU matrix), reproducible
    (derandomised, no example database)."""
    n = full if full is not None and conftest.FULL_RUN else n
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))

GATE_VALUES = np.array([-np.inf, -3e38, -1e4, -88.5, -7.0, -0.3, -1e-3, -1e-30, 0.0], np.float32)


@st.composite
def delta_problems(draw, k_dims=(4, 8, 16), v_dims=(4, 8)):
    """Random small shapes, grouped heads, and gates drawn per token (per channel for KDA) from
    -inf, huge, ordinary and tiny values, mixed with random softplus gates."""
    kind = draw(st.sampled_from(["gdn", "kda"]))
    B = draw(st.sampled_from([1, 2]))
    T = draw(st.sampled_from([1, 3, 17, 40, 70]))
    HK, group = draw(st.sampled_from([(1, 1), (1, 2), (2, 1)]))
    K = draw(st.sampled_from(k_dims))
    V = draw(st.sampled_from(v_dims))
    p_special = draw(st.sampled_from([0.0, 0.1, 0.5, 1.0]))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    HV = HK * group
    q = rng.standard_normal((B, T, HK, K)).astype(np.float32)
    k = rng.standard_normal((B, T, HK, K)).astype(np.float32)
    v = rng.standard_normal((B, T, HV, V)).astype(np.float32)
    gshape = (B, T, HV) if kind == "gdn" else (B, T, HV, K)
    g = -np.log1p(np.exp(rng.standard_normal(gshape) - 1.0)).astype(np.float32)
    special = rng.random(gshape) < p_special
    g = np.where(special, rng.choice(GATE_VALUES, gshape), g).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((B, T, HV))))).astype(np.float32)
    h0 = rng.standard_normal((B, HV, K, V)).astype(np.float32)
    return q, k, v, g, beta, h0


def _f64_problem(q, k, v, g, beta, h0):
    """The float64 oracle on the same problem, with the L2 norm and grouped heads applied."""
    hv = v.shape[2]
    qn = np.asarray(ref.expand_kv_heads(ref.l2norm(jnp.asarray(q)), hv, 2), np.float64)
    kn = np.asarray(ref.expand_kv_heads(ref.l2norm(jnp.asarray(k)), hv, 2), np.float64)
    return scan_f64(qn, kn, v, g, beta, h0)


@examples(4, full=7)
@given(problem=delta_problems(), chunk=st.sampled_from([16, 64]))
def test_property_chunked_and_scan_match_float64(problem, chunk):
    q, k, v, g, beta, h0 = problem
    want_o, want_s = _f64_problem(*problem)
    for o, s in (_chunked(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True, chunk_size=chunk),
                 _scan(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True)):
        assert rel_err(o, want_o) <= 1e-5 and rel_err(s, want_s) <= 1e-5


@examples(3, full=5)
@given(problem=delta_problems(), data=st.data())
def test_property_prefill_decode_schedules(problem, data):
    """Any split of the sequence into prefill pieces (chunk form or scan) and single decode
    steps, carrying the state, gives the one-pass float64 answer."""
    q, k, v, g, beta, h0 = problem
    T = q.shape[1]
    cuts = sorted(data.draw(st.sets(st.integers(1, T - 1), max_size=3)) if T > 1 else set())
    bounds = [0] + cuts + [T]
    want_o, want_s = _f64_problem(*problem)
    S, outs = jnp.asarray(h0), []
    for a, b in zip(bounds[:-1], bounds[1:]):
        how = data.draw(st.sampled_from(["chunked", "scan", "decode"]))
        piece = [x[:, a:b] for x in (q, k, v, g, beta)]
        if how == "decode":
            for t in range(b - a):
                o, S = _decode(*(x[:, t] for x in piece), S, use_qk_l2norm=True)
                outs.append(o[:, None])
        else:
            fn = _chunked if how == "chunked" else _scan
            o, S = fn(*piece, initial_state=S, use_qk_l2norm=True)
            outs.append(o)
    assert rel_err(jnp.concatenate(outs, axis=1), want_o) <= 1e-5
    assert rel_err(S, want_s) <= 1e-5


@examples(30)
@given(seed=st.integers(0, 2 ** 31), e=st.integers(-20, 126), K=st.sampled_from([1, 7, 64]))
def test_property_l2norm_is_scale_free(seed, e, K):
    x = np.random.default_rng(seed).standard_normal((3, K)).astype(np.float32) + 0.5
    y = np.ldexp(x, e).astype(np.float32)
    yd = y.astype(np.float64)
    want = yd / np.sqrt((yd * yd).sum(-1, keepdims=True) + ref.L2NORM_EPS)
    got = np.asarray(ref.l2norm(jnp.asarray(y)), np.float64)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


@examples(30)
@given(xs=st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=32,
                   max_size=32),
       dtype=st.sampled_from(["bfloat16", "float16"]), seed=st.integers(0, 2 ** 31))
def test_property_stochastic_round_gives_a_neighbour(xs, dtype, seed):
    """The result is RNE(x) or the next value on x's other side, never farther."""
    dtype = jnp.dtype(dtype)
    x = jnp.asarray(np.array(xs, np.float32))
    y = ref.stochastic_round(x, dtype, jax.random.PRNGKey(seed))
    r = x.astype(dtype)
    x64, y64, r64 = (np.asarray(a.astype(jnp.float32), np.float64) for a in (x, y, r))
    same = y64 == r64
    yb = np.asarray(jax.lax.bitcast_convert_type(y, jnp.uint16)).astype(np.int64)
    rb = np.asarray(jax.lax.bitcast_convert_type(r, jnp.uint16)).astype(np.int64)
    other_side = (y64 - x64) * (r64 - x64) < 0
    assert np.all(same | ((np.abs(yb - rb) == 1) & other_side))


def test_drift_curves_show_the_stall_and_its_removal():
    """gdn_jax.numerics_drift on a short run: bf16 state, keys on 8 of 32 channels, g = -1e-3.
    Round to nearest even keeps the untouched rows (error grows towards 1 - exp(g t)), stochastic
    rounding follows the fp32 state."""
    from gdn_jax import numerics_drift as nd
    points, curves = nd.drift_curves(400, heads=2, cases=[nd.DriftCase(("bf16", "low", "fast"))])
    assert points[-1] == 400 and set(curves) == {"bf16 8-channel g=-0.001 RNE",
                                                 "bf16 8-channel g=-0.001 SR"}
    rne, sr = curves["bf16 8-channel g=-0.001 RNE"][-1], curves["bf16 8-channel g=-0.001 SR"][-1]
    assert rne > 0.2 and sr < 0.1 and rne > 4 * sr


@examples(4, full=8)
@given(problem=delta_problems(k_dims=(16, 32), v_dims=(16,)), data=st.data())
def test_property_kernels_in_interpret_mode(problem, data):
    """The Pallas kernels (interpret mode) on random problems and schedules: prefill pieces run
    the chunked prefill kernel, single tokens the decode kernel; the carried state gives the
    one-pass float64 answer."""
    import gdn_jax
    q, k, v, g, beta, h0 = problem
    fn = gdn_jax.kda if g.ndim == 4 else gdn_jax.gated_delta_rule
    T = q.shape[1]
    cuts = sorted(data.draw(st.sets(st.integers(1, T - 1), max_size=2)) if T > 1 else set())
    bounds = [0] + cuts + [T]
    want_o, want_s = _f64_problem(*problem)
    S, outs = jnp.asarray(h0), []
    for a, b in zip(bounds[:-1], bounds[1:]):
        o, S = fn(*(jnp.asarray(x[:, a:b]) for x in (q, k, v, g, beta)), initial_state=S,
                  use_qk_l2norm=True, output_final_state=True, impl="pallas", interpret=True)
        outs.append(o)
    assert rel_err(jnp.concatenate(outs, axis=1), want_o) <= 1e-5
    assert rel_err(S, want_s) <= 1e-5
