"""One front door per operation: the dispatch (`gdn_jax.dispatch`), validation at the public
functions, the interpret switch, and the exact verify against the public decode on the GPU."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import gdn_jax
from conftest import ON_GPU
from gdn_jax import carry, dispatch
from gdn_jax import decode as dec
from gdn_jax import verify as vf
from gdn_jax.state import DeltaPool, DeltaStash
from helpers import delta_inputs, rel_err

F32, F16, BF16 = jnp.float32, jnp.float16, jnp.bfloat16
sds = lambda *s, d=F32: jax.ShapeDtypeStruct(s, d)


def _step(seed=0, *, B=2, HK=1, HV=2, K=16, V=16, kind="gdn"):
    q, k, v, g, beta, h0 = delta_inputs(jax.random.key(seed), B=B, T=1, HK=HK, HV=HV, K=K, V=V,
                                        kind=kind)
    return q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], h0


# --------------------------------------------------------------------------- one dispatch

def test_every_operation_speaks_one_impl_vocabulary():
    ops = dispatch.operations()
    assert {"gated_delta_rule", "kda", "gdn_decode", "gdn_decode_pool", "convert_state",
            "verify_states", "carried_verify", "flush", "accept"} <= set(ops)
    for op in ops:
        impls = dispatch._operation(op).impls
        assert set(impls) <= set(gdn_jax.IMPLS) and {"auto", "reference", "pallas"} <= set(impls)
        assert ("chunked" in impls) == (op in ("gated_delta_rule", "kda")), op
        with pytest.raises(ValueError, match="^impl must be one of"):
            dispatch.check_impl(op, "triton")


def test_auto_falls_back_the_same_way_everywhere_and_logs_the_reason_once(caplog):
    """K = 48 has no Triton tile: every operation's "auto" falls back with the reason (no
    operation raises), "pallas" raises it, and the log says it once."""
    q, k, v, g, beta, h0 = _step(1, K=48, V=16)
    with gdn_jax.interpret():
        assert gdn_jax.explain("gdn_decode", q, k, v, g, beta, h0).reason.startswith("triton decode: K=48")
        toks = delta_inputs(jax.random.key(2), B=2, T=3, HK=1, HV=2, K=48, V=16)[:5]
        pool = jnp.zeros((3, 2, 48, 16), F32)
        slots = jnp.asarray([0, 2], jnp.int32)
        why = gdn_jax.explain("verify_states", *toks, pool, slots)
        assert why.impl == "reference" and "K=48" in why.reason
        dp = DeltaPool.init(3, num_k_heads=1, num_v_heads=2, head_k_dim=48, head_v_dim=16)
        why = gdn_jax.explain("carried_verify", *toks, dp, slots)
        assert why.impl == "reference" and "K=48" in why.reason
        dispatch._logged.clear()
        with caplog.at_level(logging.INFO, logger="gdn_jax"):
            o, dp2, _ = carry.carried_verify(*toks, dp, slots, use_qk_l2norm=True)   # auto: no raise
            carry.carried_verify(*toks, jax.tree.map(jnp.zeros_like, dp2), slots, use_qk_l2norm=True)
        msgs = [r.getMessage() for r in caplog.records if "K=48" in r.getMessage()]
        assert len(msgs) == 1 and "carried_verify(impl='auto') runs the reference path" in msgs[0]
        with pytest.raises(ValueError, match=r"^carried_verify\(impl='pallas'\): triton verify: K=48"):
            carry.carried_verify(*toks, dp2, slots, impl="pallas")
        with pytest.raises(ValueError, match=r"^gdn_decode\(impl='pallas'\): triton decode: K=48"):
            dec.gdn_decode(q, k, v, g, beta, h0, impl="pallas")


def test_explain_reads_arguments_without_running_and_validates_them():
    with gdn_jax.interpret():
        c = gdn_jax.explain("gdn_decode", sds(4, 1, 16), sds(4, 1, 16), sds(4, 2, 16), sds(4, 2),
                            sds(4, 2), sds(4, 2, 16, 16))
    assert c == gdn_jax.Choice("gdn_decode", "pallas", "triton decode")
    with pytest.raises(ValueError, match="^state must have shape"):
        gdn_jax.explain("gdn_decode", sds(4, 1, 16), sds(4, 1, 16), sds(4, 2, 16), sds(4, 2),
                        sds(4, 2), sds(4, 2, 8, 16))
    with pytest.raises(ValueError, match="^op must be one of"):
        gdn_jax.explain("prefill_kernel_that_does_not_exist")


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_sequences_go_to_the_prefill_kernels(kind):
    """Short prompts (T > 1, or packed input) go to the serial prefill family, longer ones to the
    chunked prefill family (SERIAL_PREFILL_TABLE), T = 1 to the decode family; head dims the
    kernels cannot take make "pallas" raise with the reason and "auto" fall back."""
    fn = gdn_jax.gated_delta_rule if kind == "gdn" else gdn_jax.kda
    op = "gated_delta_rule" if kind == "gdn" else "kda"
    q, k, v, g, beta, h0 = delta_inputs(jax.random.key(3), B=2, T=5, kind=kind)
    assert gdn_jax.explain(op, q, k, v, g, beta, interpret=True).family == "serial prefill"
    long = lambda x: jax.ShapeDtypeStruct((x.shape[0], 1000) + x.shape[2:], x.dtype)
    assert gdn_jax.explain(op, *map(long, (q, k, v, g, beta)),
                           interpret=True).family == "chunked prefill"
    assert gdn_jax.explain(op, q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1],
                           interpret=True).family == "decode"
    o, s = fn(q, k, v, g, beta, initial_state=h0, impl="pallas", interpret=True,
              output_final_state=True, use_qk_l2norm=True)
    want, ws = fn(q, k, v, g, beta, initial_state=h0, impl="reference", output_final_state=True,
                  use_qk_l2norm=True)
    assert rel_err(o, want) <= 1e-5 and rel_err(s, ws) <= 1e-5
    q3, k3, v3, g3, b3, _ = delta_inputs(jax.random.key(4), B=1, T=5, K=24, V=24, kind=kind)
    with pytest.raises(ValueError, match=rf"{op}\(impl='pallas'\).*head_k_dim=24"):
        fn(q3, k3, v3, g3, b3, impl="pallas", interpret=True)
    choice = gdn_jax.explain(op, q3, k3, v3, g3, b3, interpret=True)
    assert choice.impl == "reference" and "head_k_dim=24" in choice.reason


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_mixed_input_dtypes_run_the_kernels_at_the_widest(kind):
    """q and k in fp32 with v in bf16: o comes back in q's dtype at fp32's accuracy (the chunked
    kernel once picked its precision by v's dtype and rounded o to it), and the other mixes
    keep to their tolerance."""
    fn = gdn_jax.gated_delta_rule if kind == "gdn" else gdn_jax.kda
    q, k, v, g, beta, h0 = delta_inputs(jax.random.key(14), B=1, T=70, HK=1, HV=2, K=32, V=32,
                                        kind=kind)
    for dtypes, tol in (((F32, F32, BF16), 1e-5), ((BF16, F32, F32), 1e-5),
                        ((F16, BF16, F32), 2e-3)):
        qd, kd, vd = (x.astype(d) for x, d in zip((q, k, v), dtypes))
        o, s = fn(qd, kd, vd, g, beta, initial_state=h0, output_final_state=True,
                  use_qk_l2norm=True, impl="pallas", interpret=True)
        want, ws = fn(qd, kd, vd, g, beta, initial_state=h0, output_final_state=True,
                      use_qk_l2norm=True, impl="reference")
        assert o.dtype == dtypes[0], dtypes
        assert rel_err(o, want) <= tol and rel_err(s, ws) <= 1e-5, dtypes


# --------------------------------------------------------------------------- interpret switch

def test_interpret_switch_context_and_environment(monkeypatch):
    args = (sds(2, 1, 16), sds(2, 1, 16), sds(2, 2, 16), sds(2, 2), sds(2, 2), sds(2, 2, 16, 16))
    monkeypatch.delenv(dispatch.INTERPRET_ENV, raising=False)
    if not ON_GPU:
        assert gdn_jax.explain("gdn_decode", *args).impl == "reference"
    with gdn_jax.interpret():
        assert gdn_jax.explain("gdn_decode", *args).impl == "pallas"
        assert dispatch.interpret_enabled() and not dispatch.interpret_enabled(False)
        with gdn_jax.interpret(False):
            assert not dispatch.interpret_enabled()
    monkeypatch.setenv(dispatch.INTERPRET_ENV, "1")
    assert dispatch.interpret_enabled() and gdn_jax.explain("gdn_decode", *args).impl == "pallas"
    assert gdn_jax.explain("gdn_decode", *args, interpret=False).impl == ("pallas" if ON_GPU else "reference")


@pytest.mark.skipif(ON_GPU, reason="interpret mode is the CPU path")
def test_public_functions_and_a_block_run_through_the_kernels_in_interpret_mode(monkeypatch):
    """With the switch on, impl="auto" picks the kernels (the launchers are watched) and the
    results match the pure-JAX paths."""
    from pallas_kernels import gdn_decode as dk, gdn_verify as vk, state_convert as ck
    launched = []
    for mod, name in ((dk, "gdn_decode"), (vk, "verify_states_launch"),
                      (vk, "carried_verify_launch"), (vk, "accept_counts"), (vk, "flush_launch"),
                      (ck, "convert_state")):
        orig = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _o=orig, _n=name, **kw: (launched.append(_n), _o(*a, **kw))[1])
    q, k, v, g, beta, h0 = _step(4)
    with gdn_jax.interpret():
        o, s = dec.gdn_decode(q, k, v, g, beta, jnp.copy(h0))
        y16 = dec.convert_state(s, BF16)
        toks = delta_inputs(jax.random.key(5), B=2, T=3, HK=1, HV=2, K=16, V=16)[:5]
        slots = jnp.asarray([1, -1], jnp.int32)
        dp = DeltaPool(jnp.copy(jnp.concatenate([h0, h0])), DeltaStash.init(
            4, num_k_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16))
        ov, states = vf.verify_states(*toks, dp.states, slots)
        oc, dp, _ = carry.carried_verify(*toks, dp, slots)
        dp, _ = carry.accept(dp, slots, jnp.asarray([2, 0], jnp.int32))
        dp = carry.flush(dp)
    ro, rs = dec.gdn_decode(q, k, v, g, beta, jnp.copy(h0), impl="reference")
    assert rel_err(o, ro) <= 1e-6 and rel_err(s, rs) <= 1e-6
    assert y16.dtype == BF16
    assert rel_err(ov, oc) <= 1e-6
    assert rel_err(dp.states[1], states[0, 1]) <= 1e-6
    assert set(launched) == {"gdn_decode", "convert_state", "verify_states_launch",
                             "carried_verify_launch", "accept_counts", "flush_launch"}
    # a Flax block: a single-token call and the serving decode run the decode kernel
    launched.clear()
    from gdn_jax.layers import GDNConfig, Qwen3NextGatedDeltaNet
    block = Qwen3NextGatedDeltaNet(GDNConfig(hidden_size=32, num_k_heads=1, num_v_heads=2,
                                             head_k_dim=16, head_v_dim=16), rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 1, 32)), F32)
    monkeypatch.setenv(dispatch.INTERPRET_ENV, "1")
    y, st = block(x)
    serving = block.init_serving_state(3)
    y2, serving = block.decode(x, serving, jnp.asarray([2, 0], jnp.int32))
    monkeypatch.delenv(dispatch.INTERPRET_ENV)
    yr, _ = block(x, impl="reference")
    # Nothing is pending on a fresh serving state: the gate skips the fold (no flush launch).
    assert launched.count("gdn_decode") == 2 and "flush_launch" not in launched
    assert rel_err(y, yr) <= 1e-5 and rel_err(y2, yr) <= 1e-5


# --------------------------------------------------------------------------- bad input (issue 14)

def test_scale_is_validated_everywhere():
    q, k, v, g, beta, h0 = delta_inputs(jax.random.key(6), B=1, T=2)
    q1, k1, v1, g1, b1, s1 = _step(6)
    fns = [lambda sc: gdn_jax.gated_delta_rule(q, k, v, g, beta, scale=sc),
           lambda sc: gdn_jax.verify_steps(q, k, v, g, beta, h0[:1], scale=sc),
           lambda sc: gdn_jax.decode_step(q1, k1, v1, g1, b1, s1, scale=sc),
           lambda sc: dec.gdn_decode(q1, k1, v1, g1, b1, jnp.copy(s1), scale=sc)]
    for fn in fns:
        for bad in (0, -0.5, float("nan"), float("inf"), "0.25", True, jnp.ones(2)):
            with pytest.raises(ValueError, match="^scale must"):
                fn(bad)
        a = fn(jnp.float32(0.25))[0]          # a concrete jnp scalar is a number
        b = fn(np.float64(0.25))[0]
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="^scale must be a concrete number"):
        jax.jit(lambda sc: gdn_jax.gated_delta_rule(q, k, v, g, beta, scale=sc))(0.25)


def test_bad_dtypes_eps_bounds_and_columns_are_refused():
    q, k, v, g, beta, h0 = _step(7)
    call = lambda **kw: dec.gdn_decode(q, k, v, g, beta, jnp.copy(h0), **kw)
    with pytest.raises(ValueError, match="^out_dtype must be a floating dtype"):
        call(out_dtype=jnp.int32)
    with pytest.raises(ValueError, match="^norm_eps must be >= 0"):
        call(z=v, norm_weight=jnp.ones(16), norm_eps=-1e-6)
    with pytest.raises(ValueError, match="^eps must be >= 0"):
        gdn_jax.l2norm(q, eps=-1e-6)
    with pytest.raises(ValueError, match="^eps must be >= 0"):
        gdn_jax.gated_rmsnorm(v, v, jnp.ones(16), eps=-1.0)
    with pytest.raises(ValueError, match="^out_dtype must be a floating dtype"):
        gdn_jax.gated_rmsnorm(v, v, jnp.ones(16), out_dtype=jnp.int32)
    graw = jnp.ones((2, 2, 16))
    for lb in (-float("inf"), float("nan"), 0.0, 2.0):
        with pytest.raises(ValueError, match="^lower_bound must"):
            gdn_jax.kda_gate(graw, jnp.zeros(2), jnp.zeros((2, 16)), lower_bound=lb)
    assert np.all(np.isfinite(np.asarray(gdn_jax.kda_gate(graw, jnp.zeros(2), jnp.zeros(32),
                                                           lower_bound=-5.0))))
    with pytest.raises(ValueError, match="^lower_bound must"):
        dec.gdn_decode(q, k, v, jnp.ones((2, 2, 16)), beta, jnp.copy(h0), A_log=jnp.zeros(2),
                       dt_bias=jnp.zeros(32), lower_bound=-float("inf"))
    qkv = jnp.concatenate([q.reshape(2, -1), k.reshape(2, -1), v.reshape(2, -1)], 1)
    pool = jnp.zeros((3, 2, 16, 16), F32)
    for col in (0.5, 1.0, -1, "1"):
        with pytest.raises(ValueError, match="^g_col must be a non-negative integer"):
            dec.gdn_decode_pool(qkv, g, beta, pool, jnp.asarray([0, 1], jnp.int32), num_k_heads=1,
                                num_v_heads=2, head_k_dim=16, head_v_dim=16, g_col=col)
    ints = jnp.zeros((2, 2, 16, 16), jnp.int32)
    with pytest.raises(ValueError, match="^state must be a floating-point array"):
        dec.convert_state(ints, F16)
    with pytest.raises(ValueError, match="^state must be a floating-point array"):
        gdn_jax.state_to_16bit(ints, F16)
    with pytest.raises(ValueError, match="^state must be a floating-point array"):
        gdn_jax.state_to_f32(ints)
    with pytest.raises(ValueError, match="^states must be a floating dtype"):
        vf.commit_states(pool, jnp.zeros((2, 2, 2, 16, 16), jnp.int32), jnp.asarray([0, 1], jnp.int32),
                         jnp.asarray([1, 1], jnp.int32))


def test_zero_sizes_and_non_integer_sizes_raise_value_error():
    q, k, v, g, beta, h0 = _step(8)
    with pytest.raises(ValueError, match="head dims must be positive"):
        dec.gdn_decode(q[..., :0], k[..., :0], v, g, beta, h0[:, :, :0])
    with pytest.raises(ValueError, match="^batch_size must be an integer >= 1, got 1.5"):
        gdn_jax.GDNState.init(1.5, num_v_heads=2, head_k_dim=8, head_v_dim=8, conv_dim=24, conv_width=4)
    with pytest.raises(ValueError, match="^num_slots must be an integer"):
        DeltaPool.init(2.5, num_k_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=16)
    empty = [x[:, :0] for x in delta_inputs(jax.random.key(0), B=1, T=1)[:5]]
    with pytest.raises(ValueError, match="^q must hold at least one token"):
        gdn_jax.gated_delta_rule(*empty)


def _empty_batch_calls(B):
    """Every kernel-backed public operation on a batch of B rows (B = 0: an empty batch), as
    (name, op, call(impl) -> outputs, the pools (a pytree) the call must leave as they were)."""
    from gdn_jax import conv_decode as cd, prefill as pf
    HK, HV, K, V, W = 1, 2, 16, 16, 4
    conv_dim = 2 * HK * K + HV * V
    rng = np.random.default_rng(11)
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), F32)

    def tokens(T, kind="gdn"):
        return delta_inputs(jax.random.key(T), B=B, T=T, HK=HK, HV=HV, K=K, V=V, kind=kind)

    slots = jnp.arange(B, dtype=jnp.int32)
    pool, windows = f32(3, HV, K, V), f32(3, W - 1, conv_dim)
    dpool = DeltaPool(pool, DeltaStash.init(3, num_k_heads=HK, num_v_heads=HV, head_k_dim=K,
                                            head_v_dim=V))
    conv_args = lambda: dict(conv_weight=f32(conv_dim, W), A_log=f32(HV), dt_bias=f32(HV),
                             norm_weight=f32(V), num_k_heads=HK, num_v_heads=HV, head_k_dim=K,
                             head_v_dim=V)
    calls = []
    for T in (1, 5, 100):
        calls += [
            (f"gated_delta_rule T={T}", "gated_delta_rule", lambda impl, T=T: gdn_jax.gated_delta_rule(
                *tokens(T)[:5], initial_state=tokens(T)[5], output_final_state=True, impl=impl), ()),
            (f"kda T={T}", "kda", lambda impl, T=T: gdn_jax.kda(
                *tokens(T, "kda")[:5], output_final_state=True, impl=impl), ()),
            (f"gdn_prefill T={T}", "gdn_prefill",
             lambda impl, T=T: pf.gdn_prefill(*tokens(T)[:5], impl=impl), ()),
            (f"gdn_prefill_pool T={T}", "gdn_prefill_pool", lambda impl, T=T: pf.gdn_prefill_pool(
                *tokens(T)[:5], jnp.copy(pool), slots, impl=impl), (pool,)),
        ]
    step = tokens(1)
    calls += [
        ("gdn_decode", "gdn_decode", lambda impl: dec.gdn_decode(
            *(x[:, 0] for x in step[:5]), jnp.copy(step[5]), impl=impl), ()),
        ("gdn_decode_pool", "gdn_decode_pool", lambda impl: dec.gdn_decode_pool(
            f32(B, conv_dim), f32(B, HV), f32(B, HV), jax.tree.map(jnp.copy, dpool), slots,
            num_k_heads=HK, num_v_heads=HV, head_k_dim=K, head_v_dim=V, impl=impl), dpool),
        ("verify_states", "verify_states",
         lambda impl: vf.verify_states(*tokens(3)[:5], pool, slots, impl=impl), (pool,)),
        ("carried_verify", "carried_verify", lambda impl: carry.carried_verify(
            *tokens(3)[:5], jax.tree.map(jnp.copy, dpool), slots, impl=impl), dpool),
        ("accept", "accept", lambda impl: carry.accept(
            jax.tree.map(jnp.copy, dpool), slots, jnp.ones((B,), jnp.int32), impl=impl), dpool),
        ("conv_decode", "conv_decode", lambda impl: cd.conv_decode(
            f32(B, conv_dim), f32(B, HV), f32(B, HV), f32(B, HV, V), f32(B, HV, K, V),
            f32(B, W - 1, conv_dim), impl=impl, **conv_args()), ()),
        ("conv_decode with slots", "conv_decode", lambda impl: cd.conv_decode(
            f32(B, conv_dim), f32(B, HV), f32(B, HV), f32(B, HV, V), jnp.copy(pool),
            jnp.copy(windows), slots, impl=impl, **conv_args()), (pool, windows)),
    ]
    return calls


@pytest.mark.skipif(ON_GPU, reason="interpret mode is the CPU path; the GPU's choice is pinned below")
def test_an_empty_batch_returns_empty_results_through_every_front_door():
    """B = 0 (no sequences, an empty slot table): no kernel launches for it. "auto" returns the
    pure-JAX path's empty results, as "reference" does, and leaves pools as they were; "pallas"
    raises the reason; on a GPU the choice is the same (pinned without one)."""
    for name, op, call, pools in _empty_batch_calls(0):
        kept = [np.asarray(p) for p in jax.tree.leaves(pools)]
        with gdn_jax.interpret():
            got = call("auto")
            with pytest.raises(ValueError, match=rf"^{op}\(impl='pallas'\): the batch is empty"):
                call("pallas")
        want = call("reference")
        assert jax.tree.map(jnp.shape, got) == jax.tree.map(jnp.shape, want), name
        for leaf in jax.tree.leaves(got):
            if leaf.shape[0] == 3:                     # a pool's array, returned as it came
                assert any(np.array_equal(np.asarray(leaf), p) for p in kept), name
            else:
                assert leaf.size == 0, name
    q, k, v, g, beta, h0 = _step(12, B=0)
    spec = dec.decode_call(q, k, v, g, beta, h0)
    choice = dispatch.select("gdn_decode", spec, "auto", backend="gpu", log=False)
    assert choice.impl == "reference" and "batch is empty" in choice.reason
    assert dispatch.select("gdn_decode", dec.decode_call(*_step(12, B=2)), "auto", backend="gpu",
                           log=False).impl == "pallas"


def test_a_pool_without_slots_is_refused_naming_it():
    q, k, v, g, beta, _ = delta_inputs(jax.random.key(13), B=2, T=3, HK=1, HV=2, K=16, V=16)
    none = jnp.zeros((0, 2, 16, 16), F32)
    pad = jnp.asarray([-1, -1], jnp.int32)
    from gdn_jax import conv_decode as cd, prefill as pf
    dp = DeltaPool.init(2, num_k_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16)
    cases = [
        ("pool", lambda: pf.gdn_prefill_pool(q, k, v, g, beta, none, pad)),
        ("pool", lambda: vf.verify_states(q, k, v, g, beta, none, pad)),
        ("pool", lambda: dec.gdn_decode_pool(jnp.zeros((2, 64)), g[:, 0], beta[:, 0], none, pad,
                                             num_k_heads=1, num_v_heads=2, head_k_dim=16,
                                             head_v_dim=16)),
        ("pool.states", lambda: carry.carried_verify(q, k, v, g, beta,
                                                     jax.tree.map(lambda x: x[:0], dp), pad)),
        ("conv_pool.windows", lambda: gdn_jax.conv_step(
            jnp.ones((2, 8)), jax.tree.map(lambda x: x[:0], gdn_jax.ConvPool.init(
                2, conv_dim=8, conv_width=4)), pad, jnp.ones((8, 4)))),
        ("state", lambda: cd.conv_decode(
            jnp.ones((2, 64)), g[:, 0], beta[:, 0], jnp.ones((2, 2, 16)), none,
            jnp.zeros((0, 3, 64)), pad, conv_weight=jnp.ones((64, 4)), A_log=jnp.ones(2),
            dt_bias=jnp.ones(2), norm_weight=jnp.ones(16), num_k_heads=1, num_v_heads=2,
            head_k_dim=16, head_v_dim=16)),
    ]
    for name, fn in cases:
        with pytest.raises(ValueError, match=rf"^{name} must hold at least one slot"):
            fn()


def test_exported_references_raise_value_error_naming_the_argument():
    q, k, v, g, beta, h0 = _step(9)
    cases = [
        ("x", lambda: gdn_jax.softplus("1.0")),
        ("x", lambda: gdn_jax.l2norm(jnp.ones(3, jnp.int32))),
        ("A_log", lambda: gdn_jax.gdn_gate(jnp.ones((2, 4)), jnp.ones(3), jnp.ones(4))),
        ("dt_bias", lambda: gdn_jax.gdn_gate(jnp.ones((2, 4)), jnp.ones(4), jnp.ones(5))),
        ("b", lambda: gdn_jax.gdn_beta([1.0])),
        ("A_log", lambda: gdn_jax.kda_gate(jnp.ones((2, 4, 8)), jnp.ones(3), jnp.ones(32))),
        ("z", lambda: gdn_jax.gated_rmsnorm(v, v[:, :1], jnp.ones(16))),
        ("weight", lambda: gdn_jax.gated_rmsnorm(v, v, jnp.ones(15))),
        ("activation", lambda: gdn_jax.gated_rmsnorm(v, v, jnp.ones(16), activation="relu")),
        ("weight", lambda: gdn_jax.causal_conv1d(jnp.ones((2, 3, 8)), jnp.ones((7, 4)))),
        ("conv_state", lambda: gdn_jax.causal_conv1d(jnp.ones((2, 3, 8)), jnp.ones((8, 4)),
                                                     conv_state=jnp.ones((2, 2, 8)))),
        ("conv_state", lambda: gdn_jax.causal_conv1d_step(jnp.ones((2, 8)), None, jnp.ones((8, 4)))),
        ("hf_state", lambda: gdn_jax.conv_state_from_hf(jnp.ones((2, 8)))),
        ("state", lambda: gdn_jax.conv_state_to_hf(jnp.ones((2, 8)))),
        ("dtype", lambda: gdn_jax.state_to_16bit(h0, jnp.float32)),
        ("state", lambda: gdn_jax.decode_step(q, k, v, g, beta, h0[:1])),
        ("g", lambda: gdn_jax.decode_step(q, k, v, g[:, :1], beta, h0)),
        ("beta", lambda: gdn_jax.verify_steps(q[:, None], k[:, None], v[:, None], g[:, None],
                                              beta, h0)),
        ("q must hold at least one token", lambda: gdn_jax.verify_steps(
            *(x[:, None][:, :0] for x in (q, k, v, g, beta)), h0)),
    ]
    for name, fn in cases:
        with pytest.raises(ValueError, match=f"^{name}"):
            fn()


def test_traced_cu_seqlens_are_checked_in_checked_mode():
    q, k, v, g, beta, _ = delta_inputs(jax.random.key(10), B=1, T=6)
    run = gdn_jax.checked(lambda cu: gdn_jax.gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)[0])
    good = run(jnp.asarray([0, 2, 6], jnp.int32))
    want = gdn_jax.gated_delta_rule(q, k, v, g, beta, cu_seqlens=np.asarray([0, 2, 6], np.int32))[0]
    assert rel_err(good, want) <= 1e-6
    from gdn_jax.prefill import gdn_prefill
    kernel = gdn_jax.checked(lambda cu: gdn_prefill(q, k, v, g, beta, cu_seqlens=cu, impl="pallas",
                                                    interpret=not ON_GPU)[0])
    assert rel_err(kernel(jnp.asarray([0, 2, 6], jnp.int32)), want) <= 1e-5
    for bad in ([0, 4, 2, 6], [0, 3, 5], [1, 2, 6]):
        for fn in (run, kernel):
            with pytest.raises(ValueError, match="^cu_seqlens must start at 0, end at T=6 and "
                                                 "never decrease$"):
                fn(jnp.asarray(bad, jnp.int32))
    # without checked mode the host cannot see them under jit (documented): no error, no check
    jax.jit(lambda cu: gdn_jax.gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)[0])(
        jnp.asarray([0, 4, 2, 6], jnp.int32))


# --------------------------------------------------------------------------- GPU: exact verify vs decode

@pytest.mark.gpu
@pytest.mark.parametrize("B", [4, 128, 256])
@pytest.mark.parametrize("sdt", [F32, BF16])
@pytest.mark.parametrize("rows", ["ordinary", "at the tame bound"])
def test_gpu_exact_carried_verify_is_bitwise_the_public_decode(B, sdt, rows):
    """Through the public entry points at a small and a large batch (the tuning table's fp32
    rows for B <= 16 and above): T = 4 exact carried verify, then accept
    4 and flush, against 4 calls of the public gdn_decode_pool and of gdn_decode (outputs and
    states bit for bit). Also with every q/k row's max |x| in [2**49, 2**50): the largest rows
    the verify launcher's tame leaves alone, normalised by the decode kernel's guarded norm
    (plain branch) and the verify kernel's plain one."""
    HK, HV, K, V, T = 16, 32, 128, 128, 4
    rng = np.random.default_rng(B)
    toks = delta_inputs(jax.random.key(B), B=B, T=T, HK=HK, HV=HV, K=K, V=V, dtype=BF16)[:5]
    if rows != "ordinary":
        exp = lambda x: jnp.frexp(jnp.max(jnp.abs(x.astype(F32)), -1, keepdims=True))[1]
        toks = tuple((x * jnp.ldexp(jnp.ones_like(x, F32), 50 - exp(x))).astype(x.dtype)
                     if i < 2 else x for i, x in enumerate(toks))
    pool0 = jnp.asarray(0.3 * rng.standard_normal((B, HV, K, V), dtype=np.float32)).astype(sdt)
    slots = jnp.arange(B, dtype=jnp.int32)
    dp = DeltaPool(jnp.copy(pool0), DeltaStash.init(B, num_k_heads=HK, num_v_heads=HV, head_k_dim=K,
                                                     head_v_dim=V))
    o, dp, refused = carry.carried_verify(*toks, dp, slots, use_qk_l2norm=True, impl="pallas")
    dp, invalid = carry.accept(dp, slots, jnp.full((B,), T, jnp.int32))
    dp = carry.flush(dp, impl="pallas")
    assert not np.any(np.asarray(refused)) and not np.any(np.asarray(invalid))
    state, pool = jnp.copy(pool0), jnp.copy(pool0)
    q, k, v, g, beta = toks
    for t in range(T):
        o_t, state = dec.gdn_decode(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state,
                                    use_qk_l2norm=True, impl="pallas")
        np.testing.assert_array_equal(np.asarray(o[:, t].astype(F32)), np.asarray(o_t.astype(F32)))
        qkv = jnp.concatenate([q[:, t].reshape(B, -1), k[:, t].reshape(B, -1), v[:, t].reshape(B, -1)], 1)
        op, pool = dec.gdn_decode_pool(qkv, g[:, t], beta[:, t], pool, slots, num_k_heads=HK,
                                       num_v_heads=HV, head_k_dim=K, head_v_dim=V,
                                       use_qk_l2norm=True, impl="pallas")
        np.testing.assert_array_equal(np.asarray(op.astype(F32)), np.asarray(o_t.astype(F32)))
    np.testing.assert_array_equal(np.asarray(dp.states.astype(F32)), np.asarray(state.astype(F32)))
    np.testing.assert_array_equal(np.asarray(pool.astype(F32)), np.asarray(state.astype(F32)))
