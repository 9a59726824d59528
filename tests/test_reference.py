"""The references: token scan vs chunk form vs an independent float64 NumPy oracle, and the pieces."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn_jax
from gdn_jax import reference as ref
from conftest import FULL
from helpers import delta_inputs, rel_err


# ------------------------------------------------------------------ independent float64 oracle

def numpy_delta_rule(q, k, v, g, beta, h0=None, scale=None, l2=False):
    """Token loop in float64, written from docs/design.md's semantics without any gdn_jax code."""
    q, k, v, g, beta = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v, g, beta))
    B, T, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if l2:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    scale = K ** -0.5 if scale is None else scale
    S = np.zeros((B, HV, K, V)) if h0 is None else np.asarray(h0, np.float64).copy()
    o = np.zeros((B, T, HV, V))
    r = HV // HK
    for b in range(B):
        for h in range(HV):
            for t in range(T):
                kt, qt = k[b, t, h // r], q[b, t, h // r] * scale
                decay = np.exp(g[b, t, h])
                S[b, h] = S[b, h] * (decay[:, None] if np.ndim(decay) else decay)
                u = beta[b, t, h] * (v[b, t, h] - kt @ S[b, h])
                S[b, h] += np.outer(kt, u)
                o[b, t, h] = qt @ S[b, h]
    return o, S


KEY = jax.random.PRNGKey(20261130)


def _key(*ids):
    return jax.random.fold_in(KEY, zlib.crc32(repr(ids).encode()) % (2 ** 31))  # stable across runs


# ------------------------------------------------------------------ scan vs chunk form

CASES = [  # (T, HK, HV, K, V, with_state, l2)
    (1, 2, 2, 32, 32, True, True),
    (63, 2, 4, 32, 32, True, False),
    (64, 1, 4, 64, 32, False, True),
    (65, 2, 4, 32, 64, True, True),
    (200, 2, 2, 32, 32, True, True),
    (65, 2, 8, 32, 32, False, False),
    (130, 1, 2, 128, 128, True, True),
]


# Each shape runs with one family by default (alternating), with the other in the full matrix.
@pytest.mark.parametrize("T,HK,HV,K,V,with_state,l2,kind", [
    pytest.param(*case, kind, marks=(FULL,) if (i + (kind == "kda")) % 2 else ())
    for i, case in enumerate(CASES) for kind in ("gdn", "kda")])
def test_scan_equals_chunked(kind, T, HK, HV, K, V, with_state, l2):
    q, k, v, g, beta, h0 = delta_inputs(_key(kind, T, HK, HV, K), B=2, T=T, HK=HK, HV=HV, K=K, V=V,
                                        kind=kind, with_state=with_state, l2=l2)
    fn = gdn_jax.gated_delta_rule if kind == "gdn" else gdn_jax.kda
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm=l2)
    o1, s1 = fn(q, k, v, g, beta, impl="reference", **kw)
    o2, s2 = fn(q, k, v, g, beta, impl="chunked", **kw)
    assert rel_err(o2, o1) <= 1e-5 and rel_err(s2, s1) <= 1e-5
    if T <= 65 and K <= 64:  # the oracle is a Python loop: keep it to small cases
        on, sn = numpy_delta_rule(q, k, v, g, beta, h0, l2=l2)
        assert rel_err(o1, on) <= 1e-5 and rel_err(s1, sn) <= 1e-5


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_custom_scale_and_large_decay(kind):
    """A scale other than K^-0.5 and gates far below zero (a KDA lower-bound-like -5 per token:
    exp(-5 * 64) underflows, so a chunk form that divides by exp(G) would produce inf)."""
    q, k, v, g, beta, h0 = delta_inputs(_key("scale", kind), B=1, T=70, HV=2, HK=2, K=32, V=32, kind=kind)
    g = g * 5.0 - 2.0
    fn = gdn_jax.gated_delta_rule if kind == "gdn" else gdn_jax.kda
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm=True, scale=0.37)
    o1, s1 = fn(q, k, v, g, beta, impl="reference", **kw)
    o2, s2 = fn(q, k, v, g, beta, impl="chunked", **kw)
    on, sn = numpy_delta_rule(q, k, v, g, beta, h0, scale=0.37, l2=True)
    assert np.all(np.isfinite(np.asarray(o2)))
    assert rel_err(o1, on) <= 1e-5 and rel_err(o2, on) <= 1e-5 and rel_err(s2, sn) <= 1e-5


@pytest.mark.parametrize("kind,impl", [("gdn", "reference"), ("kda", "chunked"),
                                       pytest.param("gdn", "chunked", marks=FULL),
                                       pytest.param("kda", "reference", marks=FULL)])
def test_split_prefill_equals_one_pass(impl, kind):
    q, k, v, g, beta, h0 = delta_inputs(_key("split", impl, kind), B=3, T=150, kind=kind)
    fn = gdn_jax.gated_delta_rule if kind == "gdn" else gdn_jax.kda
    kw = dict(output_final_state=True, use_qk_l2norm=True, impl=impl)
    o, s = fn(q, k, v, g, beta, initial_state=h0, **kw)
    cut = 77
    oa, sa = fn(*(x[:, :cut] for x in (q, k, v, g, beta)), initial_state=h0, **kw)
    ob, sb = fn(*(x[:, cut:] for x in (q, k, v, g, beta)), initial_state=sa, **kw)
    assert rel_err(jnp.concatenate([oa, ob], 1), o) <= 1e-5 and rel_err(sb, s) <= 1e-5


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_decode_steps_equal_prefill(kind):
    T = 12
    q, k, v, g, beta, h0 = delta_inputs(_key("decode", kind), B=3, T=T, kind=kind)
    fn = gdn_jax.gated_delta_rule if kind == "gdn" else gdn_jax.kda
    o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True,
              impl="chunked")
    step = jax.jit(lambda *a: gdn_jax.decode_step(*a, use_qk_l2norm=True), donate_argnums=5)
    S, outs = h0 + 0.0, []
    for t in range(T):
        ot, S = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S)
        outs.append(ot)
    assert rel_err(jnp.stack(outs, 1), o) <= 1e-5 and rel_err(S, s) <= 1e-5


@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_verify_steps_keep_every_state(state_dtype):
    q, k, v, g, beta, h0 = delta_inputs(_key("verify", str(state_dtype)), B=3, T=4, kind="gdn")
    h0 = h0.astype(state_dtype)
    o, states = gdn_jax.verify_steps(q, k, v, g, beta, h0, use_qk_l2norm=True)
    assert states.shape == (3, 4) + h0.shape[1:] and states.dtype == h0.dtype
    S = h0
    tol = 1e-6 if state_dtype == jnp.float32 else 1e-3  # a 1-ulp fp32 difference may flip a 16-bit rounding
    for t in range(4):  # the verify is decode_step run t + 1 times, rounding after each token
        ot, S = gdn_jax.decode_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S, use_qk_l2norm=True)
        assert rel_err(states[:, t], S) <= tol and rel_err(o[:, t], ot) <= tol
    if state_dtype != jnp.float32:  # rounding per token differs from one rounding at the end
        _, s_end = gdn_jax.gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                            use_qk_l2norm=True, impl="reference")
        assert not np.array_equal(np.asarray(s_end), np.asarray(states[:, -1]))


# ------------------------------------------------------------------ varlen

@pytest.mark.parametrize("kind,impl", [("gdn", "chunked"), ("kda", "reference"),
                                       pytest.param("gdn", "reference", marks=FULL),
                                       pytest.param("kda", "chunked", marks=FULL)])
def test_varlen_equals_separate_calls(impl, kind):
    cu = np.array([0, 37, 38, 110, 180], np.int32)
    T, N = int(cu[-1]), len(cu) - 1
    q, k, v, g, beta, h0 = delta_inputs(_key("varlen", impl, kind), B=1, T=T, kind=kind, n_states=N)
    fn = gdn_jax.gated_delta_rule if kind == "gdn" else gdn_jax.kda
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm=True, impl=impl)
    o, s = fn(q, k, v, g, beta, cu_seqlens=cu, **kw)
    o_traced, s_traced = jax.jit(lambda c: fn(q, k, v, g, beta, cu_seqlens=c, **kw))(jnp.asarray(cu))
    for n in range(N):
        a, b = cu[n], cu[n + 1]
        on, sn = fn(*(x[:, a:b] for x in (q, k, v, g, beta)), **{**kw, "initial_state": h0[n:n + 1]})
        for oo, ss in ((o, s), (o_traced, s_traced)):
            assert rel_err(oo[:, a:b], on) <= 1e-5 and rel_err(ss[n], sn[0]) <= 1e-5


# ------------------------------------------------------------------ low precision vs float64

@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_bf16_inputs_against_float64(kind, impl):
    q, k, v, g, beta, h0 = delta_inputs(_key("bf16", kind, impl), B=2, T=70, kind=kind,
                                        dtype=jnp.bfloat16)
    fn = gdn_jax.gated_delta_rule if kind == "gdn" else gdn_jax.kda
    o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True, impl=impl)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    on, sn = numpy_delta_rule(q, k, v, g, beta, h0, l2=True)
    assert rel_err(o, on) <= 5e-3 and rel_err(s, sn) <= 5e-3


def test_16bit_initial_state_keeps_its_dtype():
    q, k, v, g, beta, h0 = delta_inputs(_key("f16state"), B=2, T=20)
    o, s = gdn_jax.gated_delta_rule(q, k, v, g, beta, initial_state=h0.astype(jnp.float16),
                                    output_final_state=True, use_qk_l2norm=True)
    assert s.dtype == jnp.float16
    on, sn = numpy_delta_rule(q, k, v, g, beta, h0.astype(jnp.float16), l2=True)
    assert rel_err(o, on) <= 1e-5 and rel_err(s, sn) <= 1e-3


# ------------------------------------------------------------------ gates, norms, conv, converters

def test_gdn_gate_and_softplus_threshold():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(3, 5, 4)).astype(np.float32) * 10
    a[0, 0, 0] = 25.0  # above the softplus threshold: passes through
    A_log = rng.normal(size=4).astype(np.float32)
    dt = rng.normal(size=4).astype(np.float32)
    got = np.asarray(gdn_jax.gdn_gate(jnp.asarray(a), A_log, dt))
    x = a.astype(np.float64) + dt
    sp = np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))
    assert rel_err(got, -np.exp(A_log.astype(np.float64)) * sp) <= 1e-6
    assert float(ref.softplus(jnp.float32(25.0))) == 25.0


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_kda_gate(lower_bound):
    rng = np.random.default_rng(1)
    HV, K = 3, 8
    graw = rng.normal(size=(2, 4, HV, K)).astype(np.float32) * 3
    A_log = rng.normal(size=HV).astype(np.float32)
    dt = rng.normal(size=HV * K).astype(np.float32)
    got = np.asarray(gdn_jax.kda_gate(graw, A_log, dt, lower_bound=lower_bound))
    x = graw.astype(np.float64) + dt.reshape(HV, K)
    A = np.exp(A_log.astype(np.float64))[:, None]
    if lower_bound is None:
        want = -A * np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))
    else:
        want = lower_bound / (1 + np.exp(-A * x))
        assert np.all(got >= lower_bound) and np.all(got <= 0)
    assert rel_err(got, want) <= 1e-6
    # dt_bias as [HV, K] gives the same
    np.testing.assert_array_equal(got, np.asarray(gdn_jax.kda_gate(graw, A_log, dt.reshape(HV, K),
                                                                   lower_bound=lower_bound)))


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
def test_gated_rmsnorm(activation):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, 3, 4, 16)).astype(np.float32)
    z = rng.normal(size=x.shape).astype(np.float32)
    w = rng.normal(size=16).astype(np.float32)
    got = gdn_jax.gated_rmsnorm(jnp.asarray(x), jnp.asarray(z), w, eps=1e-5, activation=activation)
    xd, zd = x.astype(np.float64), z.astype(np.float64)
    sig = 1 / (1 + np.exp(-zd))
    act = zd * sig if activation == "silu" else sig
    want = xd / np.sqrt((xd ** 2).mean(-1, keepdims=True) + 1e-5) * w * act
    assert rel_err(got, want) <= 1e-6
    assert gdn_jax.gated_rmsnorm(jnp.asarray(x, jnp.bfloat16), z, w).dtype == jnp.bfloat16


def numpy_conv(x, w, b, state):
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    W = w.shape[1]
    xp = np.concatenate([np.asarray(state, np.float64), x], axis=1)
    T = x.shape[1]
    y = np.stack([(xp[:, t:t + W, :] * w.T[None]).sum(1) for t in range(T)], 1)
    y = y + (0 if b is None else np.asarray(b, np.float64))
    return y / (1 + np.exp(-y)), xp[:, -(W - 1):]


def test_causal_conv_sequence_and_steps():
    rng = np.random.default_rng(3)
    B, T, C, W = 3, 9, 10, 4
    x = rng.normal(size=(B, T, C)).astype(np.float32)
    w = rng.normal(size=(C, W)).astype(np.float32)
    b = rng.normal(size=C).astype(np.float32)
    s0 = rng.normal(size=(B, W - 1, C)).astype(np.float32)
    y, s = gdn_jax.causal_conv1d(jnp.asarray(x), w, b, conv_state=jnp.asarray(s0))
    yn, sn = numpy_conv(x, w, b, s0)
    assert rel_err(y, yn) <= 1e-6
    np.testing.assert_array_equal(np.asarray(s), sn.astype(np.float32))
    st, ys = jnp.asarray(s0), []
    for t in range(T):  # decode steps reproduce the sequence
        yt, st = gdn_jax.causal_conv1d_step(jnp.asarray(x[:, t]), st, w, b)
        ys.append(yt)
    assert rel_err(jnp.stack(ys, 1), yn) <= 1e-6
    np.testing.assert_array_equal(np.asarray(st), np.asarray(s))
    # short sequence (T < W - 1) keeps the older inputs in the window
    y2, s2 = gdn_jax.causal_conv1d(jnp.asarray(x[:, :2]), w, b, conv_state=jnp.asarray(s0))
    np.testing.assert_array_equal(np.asarray(s2), np.concatenate([s0[:, 2:], x[:, :2]], 1))
    # the HF layout round trip: [B, C, W] with the oldest column dropped
    hf = gdn_jax.conv_state_to_hf(s)
    assert hf.shape == (B, C, W)
    np.testing.assert_array_equal(np.asarray(gdn_jax.conv_state_from_hf(hf)), np.asarray(s))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_state_converters_round_to_nearest_even(dtype):
    rng = np.random.default_rng(4)
    s = rng.normal(size=(2, 3, 8, 8)).astype(np.float32) * 100
    # halfway cases between two fp16 neighbours of 1.0 (spacing 2^-10): ties go to even
    s[0, 0, 0, :4] = [1 + 2 ** -11, 1 + 3 * 2 ** -11, -(1 + 2 ** -11), 2048 + 1]
    got = gdn_jax.state_to_16bit(jnp.asarray(s), dtype)
    want = s.astype(np.float16) if dtype == jnp.float16 else np.asarray(jnp.asarray(s).astype(dtype))
    np.testing.assert_array_equal(np.asarray(got).astype(np.float32), want.astype(np.float32))
    if dtype == jnp.float16:
        assert np.asarray(got)[0, 0, 0, :4].tolist() == [1.0, 1 + 2 ** -9, -1.0, 2048.0]
    back = gdn_jax.state_to_f32(got)
    assert back.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(back), np.asarray(got).astype(np.float32))
    with pytest.raises(ValueError, match="dtype"):
        gdn_jax.state_to_16bit(jnp.asarray(s), jnp.int8)


# ------------------------------------------------------------------ state pytrees

def test_state_pytrees_jit_with_donation():
    st = gdn_jax.GDNState.init(3, num_v_heads=4, head_k_dim=16, head_v_dim=8, conv_dim=40, conv_width=4)
    assert st.recurrent.shape == (3, 4, 16, 8) and st.conv.shape == (3, 3, 40)
    leaves = jax.tree_util.tree_leaves(st)
    assert len(leaves) == 2

    @jax.jit
    def bump(s):
        return gdn_jax.GDNState(recurrent=s.recurrent + 1, conv=s.conv - 1)

    bump_donated = jax.jit(lambda s: bump(s), donate_argnums=0)
    out = bump_donated(bump(st))
    assert isinstance(out, gdn_jax.GDNState) and float(out.recurrent[0, 0, 0, 0]) == 2.0
    kst = gdn_jax.KDAState.init(2, num_v_heads=2, head_k_dim=8, head_v_dim=8, conv_dim=24,
                                conv_width=4, dtype=jnp.bfloat16)
    assert kst.recurrent.dtype == jnp.bfloat16 and kst.batch_size == 2
    with pytest.raises(ValueError, match="dtype"):
        gdn_jax.KDAState.init(2, num_v_heads=2, head_k_dim=8, head_v_dim=8, conv_dim=24,
                              conv_width=4, dtype=jnp.int32)
    with pytest.raises(ValueError, match="batch_size"):
        gdn_jax.GDNState.init(0, num_v_heads=2, head_k_dim=8, head_v_dim=8, conv_dim=24, conv_width=4)


def test_sequence_choice_is_a_table():
    """gated_delta_rule / kda through the one dispatch (explain runs nothing)."""
    sds = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)

    def why(kind, T, impl="auto", interpret=True, **kw):
        g = sds(1, T, 2) if kind == "gdn" else sds(1, T, 2, 16)
        op = "gated_delta_rule" if kind == "gdn" else "kda"
        return gdn_jax.explain(op, sds(1, T, 1, 16), sds(1, T, 1, 16), sds(1, T, 2, 16), g,
                               sds(1, T, 2), impl=impl, interpret=interpret, **kw)

    prefill = gdn_jax.Choice("gated_delta_rule", "pallas", "chunked prefill")
    assert why("gdn", 4096) == prefill and why("gdn", 65) == prefill
    assert why("gdn", 2) == gdn_jax.Choice("gated_delta_rule", "pallas", "serial prefill")
    assert why("kda", 4096).family == "chunked prefill"
    assert why("gdn", 4096, "reference").impl == "reference"
    assert why("gdn", 1, "chunked").impl == "chunked"
    assert why("gdn", 1) == gdn_jax.Choice("gated_delta_rule", "pallas", "decode")
    assert why("kda", 1, "pallas").family == "decode"
    assert why("gdn", 1, cu_seqlens=np.array([0, 1], np.int32)).family == "serial prefill"
    off = why("gdn", 4096, interpret=False)
    if jax.default_backend() != "gpu":
        assert off.impl == "chunked" and "GPU" in off.reason
        assert why("gdn", 4, interpret=False).impl == "reference"     # the scan below 16 tokens

    def odd(T, impl="auto"):  # head dims the kernels cannot take (K = V = 24)
        return gdn_jax.explain("gated_delta_rule", sds(1, T, 1, 24), sds(1, T, 1, 24),
                               sds(1, T, 2, 24), sds(1, T, 2), sds(1, T, 2), impl=impl,
                               interpret=True)
    assert odd(4096).impl == "chunked" and "head_k_dim=24" in odd(4096).reason
    with pytest.raises(ValueError, match="pallas.*head_k_dim=24"):
        odd(2, "pallas")


# ------------------------------------------------------------------ bad input

def _good(kind="gdn"):
    return delta_inputs(_key("bad", kind), B=2, T=5, HK=2, HV=4, K=8, V=8, kind=kind)


BAD = [  # (description, mutate(args dict) , argument name expected in the message)
    ("q rank", lambda a: a.update(q=a["q"][0]), "q"),
    ("k shape", lambda a: a.update(k=a["k"][:, :, :1]), "k"),
    ("v batch", lambda a: a.update(v=a["v"][:1]), "v"),
    ("HV % HK", lambda a: a.update(v=a["v"][:, :, :3], g=a["g"][:, :, :3], beta=a["beta"][:, :, :3],
                                   initial_state=None), "HV"),
    ("g shape", lambda a: a.update(g=a["g"][..., None]), "g"),
    ("beta shape", lambda a: a.update(beta=a["beta"][:, :, :2]), "beta"),
    ("state shape", lambda a: a.update(initial_state=a["initial_state"][:, :, :4]), "initial_state"),
    ("int q", lambda a: a.update(q=a["q"].astype(jnp.int32)), "q"),
    ("impl", lambda a: a.update(impl="triton"), "impl"),
]


@pytest.mark.parametrize("desc,mutate,name", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_value_error_naming_argument(desc, mutate, name):
    q, k, v, g, beta, h0 = _good()
    args = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, impl="auto")
    mutate(args)
    with pytest.raises(ValueError, match=name):
        gdn_jax.gated_delta_rule(**args)


def test_bad_kda_gate_and_cu_seqlens():
    q, k, v, g, beta, h0 = _good("kda")
    with pytest.raises(ValueError, match="g must have shape"):
        gdn_jax.kda(q, k, v, g[..., 0], beta)
    with pytest.raises(ValueError, match="lower_bound"):
        gdn_jax.kda_gate(g, jnp.zeros(4), jnp.zeros((4, 8)), lower_bound=0.0)
    with pytest.raises(ValueError, match="lower_bound"):
        gdn_jax.kda_gate(g, jnp.zeros(4), jnp.zeros((4, 8)), lower_bound=1.5)
    with pytest.raises(ValueError, match="A_log"):
        gdn_jax.kda_gate(g, jnp.zeros(3), jnp.zeros((4, 8)))
    q1, k1, v1, g1, b1 = (x[:1] for x in (q, k, v, g, beta))
    for cu, what in (([0, 3, 2, 5], "non-decreasing"), ([0, 2, 4], "end at"),
                     ([1, 5], "start at"), ([[0, 5]], "1-D")):
        with pytest.raises(ValueError, match=what):
            gdn_jax.kda(q1, k1, v1, g1, b1, cu_seqlens=np.array(cu, np.int32))
    with pytest.raises(ValueError, match="B = 1"):
        gdn_jax.kda(q, k, v, g, beta, cu_seqlens=np.array([0, 5], np.int32))
    with pytest.raises(ValueError, match="initial_state"):  # one state per packed sequence
        gdn_jax.kda(q1, k1, v1, g1, b1, cu_seqlens=np.array([0, 2, 5], np.int32), initial_state=h0[:1])
    with pytest.raises(ValueError, match="pallas"):
        gdn_jax.kda(q, k, v, g, beta, impl="pallas")
    if not any(d.platform == "gpu" for d in jax.devices()):  # one token: the decode kernel says why not
        with pytest.raises(ValueError, match="need a GPU"):
            gdn_jax.kda(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], impl="pallas",
                        interpret=False)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_single_token_auto_goes_through_decode_and_keeps_the_callers_state(kind):
    q, k, v, g, beta, h0 = delta_inputs(_key("t1", kind), B=3, T=1, kind=kind)
    fn = gdn_jax.gated_delta_rule if kind == "gdn" else gdn_jax.kda
    o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True)
    o_ref, s_ref = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True,
                      impl="reference")
    assert o.shape == o_ref.shape and rel_err(o, o_ref) <= 1e-6 and rel_err(s, s_ref) <= 1e-6
    assert np.isfinite(np.asarray(h0)).all()  # still readable: not donated away


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_single_token_pallas_matches_reference_on_gpu(kind):
    q, k, v, g, beta, h0 = delta_inputs(_key("t1gpu", kind), B=7, T=1, HK=2, HV=4, K=128, V=128, kind=kind)
    fn = gdn_jax.gated_delta_rule if kind == "gdn" else gdn_jax.kda
    o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True, impl="pallas")
    on, sn = numpy_delta_rule(q, k, v, g, beta, h0, l2=True)
    assert rel_err(o, on) <= 1e-5 and rel_err(s, sn) <= 1e-5
