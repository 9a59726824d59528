"""Numerics of the references on hard legal inputs: gates in [-inf, 0] (resets, gates far below
any useful decay, mixes of huge and tiny gates), NaN containment, l2norm of huge vectors, 16-bit
state drift and stochastic rounding, and property-based checks over random shapes and schedules."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_jax import reference as ref
from helpers import rel_err

KEY = jax.random.PRNGKey(14)


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
    o, s = jax.jit(ref.chunked_delta_rule)(q, k, v, g, beta, initial_state=h0)
    assert rel_err(o, want_o) <= 1e-5, rel_err(o, want_o)
    assert rel_err(s, want_s) <= 1e-5, rel_err(s, want_s)
    o_scan, s_scan = jax.jit(ref.recurrent_delta_rule)(q, k, v, g, beta, initial_state=h0)
    assert rel_err(o_scan, want_o) <= 1e-5 and rel_err(s_scan, want_s) <= 1e-5


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("where", ["g", "k", "beta", "v_column"])
def test_nan_token_spoils_only_what_the_scan_spoils(kind, where):
    """A NaN at token 100 (inside the second chunk of 64): outputs 0..99 exact, outputs from 100
    on non-finite, exactly where the scan's are (a NaN in one v entry: only that value column)."""
    q, k, v, g, beta, h0 = _inputs(_key("nan", kind, where), kind, T=160,
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
    o_scan, s_scan = jax.jit(ref.recurrent_delta_rule)(q, k, v, g, beta, initial_state=h0)
    o, s = jax.jit(ref.chunked_delta_rule)(q, k, v, g, beta, initial_state=h0)
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


def test_l2norm_unchanged_bit_for_bit_on_ordinary_inputs():
    x = 100.0 * jax.random.normal(_key("l2 plain"), (8, 128))
    plain = x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + ref.L2NORM_EPS)
    np.testing.assert_array_equal(np.asarray(ref.l2norm(x)), np.asarray(plain))


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
