"""The kernels under a caller's JAX configuration: 64-bit mode, strict dtype promotion, a default
matmul precision.

The kernels' launchers are traced under JAX's defaults (`pallas_kernels.tracing`), so every
kernel path traces and lowers for CUDA as it does without the caller's settings: with x64 on
for the 16- and 32-bit floats and the int32 or int64 index arrays the kernels take. Under x64 a
float64 array keeps a call off the kernels, and so does interpret mode (JAX's Pallas
interpreter mixes int64 and int32 indices there); both say why.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn_jax
from pallas_kernels import gdn_decode as dec_kern
from pallas_kernels import gdn_prefill as kern
from tests.conftest import KERNEL_MODES, interpret_flag

BF16, F32, F64 = jnp.bfloat16, jnp.float32, jnp.float64
HK, HV, K = 2, 4, 128


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


@pytest.fixture
def fake_gpu(monkeypatch):
    """The dispatch sees a GPU backend (lowering for CUDA needs no device)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")


def _sequence(kind, B, T, dtype, seed=0):
    ks = iter(jax.random.split(jax.random.PRNGKey(seed), 8))
    q, k = (jax.random.normal(next(ks), (B, T, HK, K), F32).astype(dtype) for _ in range(2))
    v = jax.random.normal(next(ks), (B, T, HV, K), F32).astype(dtype)
    gshape = (B, T, HV, K) if kind == "kda" else (B, T, HV)
    g = -0.1 * jnp.abs(jax.random.normal(next(ks), gshape, F32))
    beta = jax.random.uniform(next(ks), (B, T, HV), F32)
    h0 = 0.1 * jax.random.normal(next(ks), (B, HV, K, K), F32)
    return q, k, v, g, beta, h0


def _fn(kind):
    return gdn_jax.kda if kind == "kda" else gdn_jax.gated_delta_rule


def _kernel_calls(hlo: str) -> int:
    return hlo.count("__gpu$xla.gpu.triton") + hlo.count("mosaic_gpu")


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("T,dtype,family", [(1, BF16, "decode"), (8, BF16, "serial prefill"),
                                            (256, BF16, "chunked prefill"),
                                            (256, F32, "chunked prefill")])
def test_kernel_paths_lower_for_cuda_with_x64_on(lower_for_h200, fake_gpu, x64, kind, T, dtype,
                                                 family):
    """Each kernel family of the sequence functions lowers for CUDA inside a jit traced with x64
    on: the decode kernel, the token-serial prefill, and the chunked prefill on its Mosaic GPU
    path (bf16, K = V = 128, whole chunks) and its Triton path (fp32 inputs)."""
    q, k, v, g, beta, h0 = _sequence(kind, 2, T, dtype)
    call = functools.partial(_fn(kind), initial_state=h0, output_final_state=True,
                             use_qk_l2norm=True)
    choice = gdn_jax.explain("kda" if kind == "kda" else "gated_delta_rule", q, k, v, g, beta,
                             initial_state=h0)
    assert (choice.impl, choice.family) == ("pallas", family)
    hlo = jax.jit(lambda *a: call(*a, impl="pallas")).trace(q, k, v, g, beta).lower(
        lowering_platforms=("cuda",)).as_text()
    assert _kernel_calls(hlo) >= 1
    if family == "chunked prefill" and dtype == BF16:
        assert "mosaic_gpu" in hlo


def test_packed_prefill_and_pool_decode_lower_with_int64_indices(lower_for_h200, fake_gpu, x64):
    """Index arrays made under x64 are int64 (cu_seqlens from a list, a slot table): the packed
    chunked prefill takes them concrete (its Mosaic GPU path, starts known to be aligned) and
    traced (its Triton path), the pooled decode takes its slot table, and all lower for CUDA."""
    q, k, v, g, beta, _ = _sequence("gdn", 1, 256, BF16)
    cu = jnp.array([0, 64, 192, 256])
    assert cu.dtype == jnp.int64
    packed = lambda q, k, v, g, beta, cu: gdn_jax.gated_delta_rule(
        q, k, v, g, beta, cu_seqlens=cu, output_final_state=True, use_qk_l2norm=True,
        impl="pallas")
    lower = lambda f, *a: jax.jit(f).trace(*a).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in lower(lambda *a: packed(*a, cu), q, k, v, g, beta)
    assert "xla.gpu.triton" in lower(packed, q, k, v, g, beta, cu)
    from gdn_jax.decode import gdn_decode_pool
    B, S = 3, 5
    qkv = jnp.ones((B, 2 * HK * K + HV * K), BF16)
    slots = jnp.array([4, -1, 0])
    assert slots.dtype == jnp.int64
    pool = jnp.zeros((S, HV, K, K), F32)
    hlo = jax.jit(lambda qkv, g, beta, pool, slots: gdn_decode_pool(
        qkv, g, beta, pool, slots, num_k_heads=HK, num_v_heads=HV, head_k_dim=K, head_v_dim=K,
        impl="pallas")).trace(qkv, -jnp.ones((B, HV), F32), jnp.ones((B, HV), F32) / 2, pool,
                              slots).lower(lowering_platforms=("cuda",)).as_text()
    assert _kernel_calls(hlo) == 1


def test_verify_conv_decode_and_convert_lower_with_x64_on(lower_for_h200, fake_gpu, x64):
    """The other kernel families under x64: the verify (T = 4 tokens, slots int64), the block's
    one-launch conv decode (its inputs fp32 as x64 makes them from float32 data), and the state
    converter."""
    lower = lambda f, *a: jax.jit(f).trace(*a).lower(lowering_platforms=("cuda",)).as_text()
    from gdn_jax.conv_decode import conv_decode
    from gdn_jax.decode import convert_state
    from gdn_jax.verify import verify_states
    q, k, v, g, beta, _ = _sequence("gdn", 2, 4, BF16)
    pool, slots = jnp.zeros((5, HV, K, K), F32), jnp.array([3, 0])
    hlo = lower(lambda *a: verify_states(*a, use_qk_l2norm=True, impl="pallas"),
                q, k, v, g, beta, pool, slots)
    assert _kernel_calls(hlo) >= 1
    B, W, C = 2, 4, 2 * HK * K + HV * K
    mixed, a, b = jnp.ones((B, C), F32), jnp.ones((B, HV), F32), jnp.ones((B, HV), F32)
    z, state, windows = jnp.ones((B, HV, K), F32), pool[:B], jnp.ones((B, W - 1, C), F32)
    params = dict(conv_weight=jnp.ones((C, W), F32), A_log=jnp.zeros(HV, F32),
                  dt_bias=jnp.zeros(HV, F32), norm_weight=jnp.ones(K, F32), num_k_heads=HK,
                  num_v_heads=HV, head_k_dim=K, head_v_dim=K, use_qk_l2norm=True)
    hlo = lower(lambda *x: conv_decode(*x, **params, impl="pallas"),
                mixed, a, b, z, state, windows)
    assert _kernel_calls(hlo) == 1
    hlo = lower(lambda s: convert_state(s, BF16, impl="pallas"), pool)
    assert _kernel_calls(hlo) == 1


@pytest.mark.parametrize("setting", ["matmul bfloat16", "matmul highest", "strict promotion"])
def test_kernel_traces_ignore_matmul_precision_and_promotion(fake_gpu, setting):
    """Under a default matmul precision or strict dtype promotion, the sequence functions'
    kernel paths trace to the same program as under the defaults (without the launchers' own
    context, `jnp.dot` would record the precision in the Mosaic GPU prep's and the TF32 redo's
    products)."""
    context = (jax.numpy_dtype_promotion("strict") if setting == "strict promotion" else
               jax.default_matmul_precision(setting.split()[1]))
    for kind, T, dtype in (("gdn", 256, BF16), ("kda", 256, BF16), ("gdn", 256, F32),
                           ("gdn", 1, BF16), ("kda", 8, BF16)):
        q, k, v, g, beta, h0 = _sequence(kind, 2, T, dtype)
        call = lambda *a: _fn(kind)(*a, initial_state=h0, output_final_state=True,
                                    use_qk_l2norm=True, impl="pallas")
        want = str(jax.make_jaxpr(call)(q, k, v, g, beta))
        with context:
            got = str(jax.make_jaxpr(call)(q, k, v, g, beta))
        assert got == want, (kind, T, dtype)


def test_strict_promotion_runs_the_kernels_in_interpret_mode():
    """The chunked prefill's Triton path at 16-bit inputs (fp16 inverse tiles scaled by fp32
    factors) under strict promotion: the same bits as under the standard one."""
    q, k, v, g, beta, h0 = _sequence("gdn", 1, 70, BF16)
    q, k, v = (x[..., :32] for x in (q, k, v))
    h0 = h0[:, :, :32, :32]
    run = lambda: gdn_jax.gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                           output_final_state=True, use_qk_l2norm=True,
                                           impl="pallas", interpret=True)
    want = run()
    with jax.numpy_dtype_promotion("strict"):
        got = run()
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("which", ["v", "g", "initial_state"])
def test_float64_arrays_take_the_pure_jax_path(fake_gpu, x64, which):
    """With x64 on, a float64 array keeps a call off the kernels ("auto" says why, "pallas"
    raises), where the kernels would narrow it; the sequence functions' pure-JAX paths compute
    in float32 as the kernels do."""
    q, k, v, g, beta, h0 = _sequence("gdn", 2, 256, BF16)
    args = dict(v=v, g=g, initial_state=h0)
    args[which] = args[which].astype(F64)
    choice = gdn_jax.explain("gated_delta_rule", q, k, args["v"], args["g"], beta,
                             initial_state=args["initial_state"])
    assert choice.impl == "chunked" and f"{which} float64" in choice.reason
    with pytest.raises(ValueError, match=f"{which} float64"):
        gdn_jax.gated_delta_rule(q, k, args["v"], args["g"], beta,
                                 initial_state=args["initial_state"], impl="pallas")
    # the single-token decode and the prefill front door say the same
    assert "float64" in gdn_jax.explain("gated_delta_rule", q[:, :1], k[:, :1], args["v"][:, :1],
                                        args["g"][:, :1], beta[:, :1],
                                        initial_state=args["initial_state"]).reason
    from gdn_jax import prefill
    with pytest.raises(ValueError, match="float64"):
        prefill.gdn_prefill(q, k, args["v"], args["g"], beta,
                            initial_state=args["initial_state"], impl="pallas")


def test_float64_numpy_arrays_without_x64_run_the_kernels_as_fp32(fake_gpu):
    """Without x64 JAX narrows a float64 NumPy array to float32 on the way in: the kernels take
    the call, and the chunked prefill treats the inputs as fp32 (its precise products)."""
    assert not jax.config.jax_enable_x64
    q, k, v, g, beta, _ = (np.asarray(x, np.float64) for x in _sequence("gdn", 1, 256, F32))
    choice = gdn_jax.explain("gated_delta_rule", q, k, v, g, beta)
    assert (choice.impl, choice.family) == ("pallas", "chunked prefill")
    from gdn_jax import prefill
    assert prefill.prefill_call(q, v, g).fp32_inputs


def test_interpret_mode_with_x64_takes_the_pure_jax_path(x64):
    """Interpret mode runs no kernel under x64: "auto" gives the pure-JAX result, "pallas"
    raises naming the workaround, and the same call with x64 switched off runs the kernels."""
    q, k, v, g, beta, h0 = _sequence("gdn", 1, 5, F32)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm=True)
    with gdn_jax.interpret():
        choice = gdn_jax.explain("gated_delta_rule", q, k, v, g, beta, initial_state=h0)
        assert choice.impl == "reference" and "jax_enable_x64" in choice.reason
        o, s = gdn_jax.gated_delta_rule(q, k, v, g, beta, **kw)
        with pytest.raises(ValueError, match="jax.enable_x64"):
            gdn_jax.gated_delta_rule(q, k, v, g, beta, impl="pallas", **kw)
        with jax.enable_x64(False):
            o32, s32 = gdn_jax.gated_delta_rule(q, k, v, g, beta, impl="pallas", **kw)
    o_ref, s_ref = gdn_jax.gated_delta_rule(q, k, v, g, beta, impl="reference", **kw)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_ref))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s_ref))
    assert np.max(np.abs(np.asarray(o32) - np.asarray(o_ref))) < 1e-4


@pytest.mark.parametrize("mode", KERNEL_MODES)
def test_launchers_give_the_same_bits_with_x64_on(mode):
    """The launchers themselves, called outside any jit, give the same bits with x64 on as with
    it off: the chunked prefill (its Triton kernels, ragged packing, L2 norm in the kernels) and
    the decode kernel. In interpret mode this also covers the interpreter, which the launcher's
    own x64-off context reaches when it is called outside a jit."""
    T, hv, kd = 70, 2, 32
    ks = iter(jax.random.split(jax.random.PRNGKey(3), 8))
    q, k = (jax.random.normal(next(ks), (T, 1, kd), F32) for _ in range(2))
    v = jax.random.normal(next(ks), (T, hv, kd), F32)
    g = -0.2 * jnp.abs(jax.random.normal(next(ks), (T, hv), F32))
    beta = jax.random.uniform(next(ks), (T, hv), F32)
    cu = np.array([0, 3, T], np.int32)
    spec = kern.PrefillSpec(num_k_heads=1, num_v_heads=hv, head_k_dim=kd, head_v_dim=kd,
                            scale=kd ** -0.5, use_qk_l2norm=True, precise=True)
    block = kern.PrefillBlockSizes.get_default(spec, 2, F32)
    run = functools.partial(kern.chunk_prefill, spec=spec, block=block,
                            interpret=interpret_flag(mode))
    want = run(q, k, v, g, beta, jnp.asarray(cu))
    with jax.enable_x64(True):
        got = run(q, k, v, g, beta, jnp.asarray(cu))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    dspec = dec_kern.DecodeSpec(num_k_heads=1, num_v_heads=hv, head_k_dim=kd, head_v_dim=kd,
                                scale=kd ** -0.5, use_qk_l2norm=True)
    rows = lambda x: x[:3].reshape(3, -1)
    state = 0.1 * jax.random.normal(next(ks), (3, hv, kd, kd), F32)
    step = functools.partial(dec_kern.gdn_decode, rows(q), rows(k), rows(v), rows(g), rows(beta),
                             spec=dspec, interpret=interpret_flag(mode))
    want = step(jnp.copy(state))
    with jax.enable_x64(True):
        got = step(jnp.copy(state))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_gpu_kernels_give_the_same_bits_with_x64_on(kind):
    """Compiled on the GPU, inside a jit traced with x64 on, the default kernel paths give the
    same bits as with it off: decode, token-serial prefill, the chunked prefill (Mosaic GPU for
    bf16; Triton for fp32, and for KDA's second sequence starting off a multiple of 64 at
    T = 300), and a packed call whose cu_seqlens, made from a list, is int64."""
    for T, dtype, lens in ((1, BF16, None), (8, BF16, None), (256, BF16, None),
                           (300, BF16, None), (300, F32, None), (320, BF16, [0, 64, 192, 320])):
        q, k, v, g, beta, h0 = _sequence(kind, 1 if lens else 2, T, dtype, seed=T)
        if lens:
            h0 = 0.1 * jax.random.normal(jax.random.PRNGKey(T), (len(lens) - 1, HV, K, K), F32)

        def run():   # cu_seqlens a concrete constant of the trace, as a serving prefill has it
            cu = None if lens is None else jnp.array(lens)
            call = lambda *a, **kw: _fn(kind)(*a, **kw, cu_seqlens=cu, output_final_state=True,
                                              use_qk_l2norm=True, impl="pallas")
            return cu, jax.jit(lambda q, k, v, g, beta, h0: call(q, k, v, g, beta,
                                                                 initial_state=h0))(
                q, k, v, g, beta, h0)

        _, want = run()
        with jax.enable_x64(True):
            cu, got = run()
        assert lens is None or cu.dtype == jnp.int64
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert a.dtype == b.dtype, (T, dtype)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"T={T} {dtype}")
