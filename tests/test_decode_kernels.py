"""Pallas decode kernels (pallas_kernels/gdn_decode.py via gdn_jax.decode) vs the references.

Every test runs twice: in Pallas interpret mode on the CPU ("interpret"), and compiled on the GPU
("gpu", marked `gpu`, skipped without one). Inputs are fresh random draws (never zeros); outputs
are poisoned (NaN) before each kernel run so an element the kernel forgets to write fails.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import KERNEL_MODES, interpret_flag
from conftest import KERNEL_MODES as MODES

from gdn_jax import decode as dec
from gdn_jax import reference as ref
from gdn_jax.ops import gated_delta_rule
from helpers import rel_err
from pallas_kernels import gdn_decode as kern

F32, F16, BF16 = jnp.float32, jnp.float16, jnp.bfloat16


_interp = interpret_flag


def _poison(shape, dtype=F32):
    """Fill and free a NaN buffer the size of the next output: XLA's allocator tends to hand the
    same memory to the kernel's output, so an element it does not write stays NaN. (Interpret
    mode fills uninitialised outputs with NaN itself.)"""
    jax.block_until_ready(jnp.full(shape, jnp.nan, dtype)).delete()


def _rand_inputs(seed, *, B, T, HK, HV, K, V, kind="gdn", dtype=F32, l2=True):
    """Fresh random inputs (never zeros) as in helpers.delta_inputs, drawn with numpy: eager
    jax.random would compile a small program per shape, which dominates interpret-mode tests."""
    rng = np.random.default_rng(seed)
    n = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
    q, k = n(B, T, HK, K), n(B, T, HK, K)
    if not l2:  # unit-ish keys keep the recurrence stable (beta * |k|^2 < 2)
        q, k = q / np.sqrt(K), k / np.sqrt(K)
    v = n(B, T, HV, V)
    g = -np.logaddexp(0.0, n(*((B, T, HV) if kind == "gdn" else (B, T, HV, K))) - 1.0)
    beta = 1.0 / (1.0 + np.exp(-n(B, T, HV)))
    h0 = 0.3 * n(B, HV, K, V)
    cast = lambda x: jnp.asarray(x).astype(dtype)
    return cast(q), cast(k), cast(v), jnp.asarray(g, F32), jnp.asarray(beta, F32), jnp.asarray(h0)


def _normal(rng, shape, dtype=F32, scale=1.0):
    return jnp.asarray(scale * rng.standard_normal(shape, dtype=np.float32)).astype(dtype)


def _step_inputs(seed, *, B, HK, HV, K, V, kind="gdn", dtype=F32, l2=True):
    q, k, v, g, beta, h0 = _rand_inputs(seed, B=B, T=1, HK=HK, HV=HV, K=K, V=V, kind=kind,
                                        dtype=dtype, l2=l2)
    return q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], h0


def _np_decode(q, k, v, g, beta, S, *, scale, l2):
    """float64 numpy oracle of one token (GDN or per-channel gate)."""
    f = lambda x: np.asarray(jnp.asarray(x, F32), np.float64)
    q, k, v, g, beta, S = map(f, (q, k, v, g, beta, S))
    if l2:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    rep = v.shape[1] // q.shape[1]
    q, k = np.repeat(q * scale, rep, axis=1), np.repeat(k, rep, axis=1)
    decay = np.exp(g)
    S = S * (decay[..., None] if g.ndim == 3 else decay[..., None, None])
    u = beta[..., None] * (v - np.einsum("bhk,bhkv->bhv", k, S))
    S = S + k[..., :, None] * u[..., None, :]
    return np.einsum("bhk,bhkv->bhv", q, S), S


# --------------------------------------------------------------------------- contiguous batch

DECODE_CASES = [
    # B, HK, HV, K, state dtype, l2, block sizes (None: tuning table)
    (1, 2, 2, 64, F32, True, None),
    (3, 1, 2, 64, F32, False, None),
    (7, 2, 4, 64, F32, True, kern.DecodeBlockSizes(block_v=16, tile_v=8, num_warps=2)),
    (3, 1, 4, 64, F32, True, kern.DecodeBlockSizes(block_v=32, tile_v=16, num_warps=2)),
    (3, 2, 4, 64, F16, False, kern.DecodeBlockSizes(block_v=64, tile_v=16, num_warps=4)),
    (3, 2, 4, 128, F32, True, None),
    (3, 2, 4, 64, F16, True, None),
    (7, 1, 2, 64, BF16, True, kern.DecodeBlockSizes(block_v=64, tile_v=32, num_warps=4)),
    (1, 2, 4, 128, F16, False, None),
    (3, 2, 4, 128, F16, True, kern.DecodeBlockSizes(block_v=64)),  # the large-batch table shape
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("B,HK,HV,K,sdt,l2,block", DECODE_CASES)
def test_decode_matches_reference(mode, B, HK, HV, K, sdt, l2, block):
    q, k, v, g, beta, h0 = _step_inputs(B * 100 + K + HV, B=B, HK=HK, HV=HV, K=K, V=K, l2=l2)
    h0 = h0.astype(sdt)
    ro, rs = ref.decode_step(q, k, v, g, beta, h0, use_qk_l2norm=l2)
    _poison((B, HV, K))
    o, s = dec.gdn_decode(q, k, v, g, beta, h0.copy(), use_qk_l2norm=l2, impl="pallas",
                          interpret=_interp(mode), block_sizes=block)
    assert o.shape == (B, HV, K) and o.dtype == q.dtype
    assert s.shape == h0.shape and s.dtype == h0.dtype
    assert rel_err(o, ro) <= 1e-5
    # 16-bit states: the kernel and the reference each round an fp32 value that differs in the
    # last fp32 bits, so a few elements may land one 16-bit ulp apart.
    assert rel_err(s, rs) <= (1e-5 if sdt == F32 else 1e-3)
    if sdt != F32:  # and both are within one rounding of the float64 truth
        no, ns = _np_decode(q, k, v, g, beta, h0, scale=K ** -0.5, l2=l2)
        assert rel_err(s, ns) <= (1e-3 if sdt == F16 else 8e-3)
        assert rel_err(o, no) <= 1e-5


@pytest.mark.parametrize("mode", MODES)
def test_decode_bf16_inputs_vs_float64(mode):
    B, HK, HV, K = 3, 2, 4, 64
    q, k, v, g, beta, h0 = _step_inputs(11, B=B, HK=HK, HV=HV, K=K, V=K, dtype=BF16)
    no, ns = _np_decode(q, k, v, g, beta, h0, scale=K ** -0.5, l2=True)
    _poison((B, HV, K), BF16)
    o, s = dec.gdn_decode(q, k, v, g, beta, h0.copy(), use_qk_l2norm=True, impl="pallas",
                          interpret=_interp(mode))
    assert o.dtype == BF16
    assert rel_err(o, no) <= 5e-3 and rel_err(s, ns) <= 5e-3


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("raw,lower_bound", [(False, None), (True, None), (True, -5.0)])
def test_kda_per_channel_gate(mode, raw, lower_bound):
    B, HK, HV, K = 3, 1, 2, 64
    q, k, v, g, beta, h0 = _step_inputs(21, B=B, HK=HK, HV=HV, K=K, V=K, kind="kda")
    A_log = dt_bias = None
    if raw:  # g, beta now hold the raw projections a, b
        rng = np.random.default_rng(22)
        g = _normal(rng, (B, HV, K), scale=2.0)
        beta = _normal(rng, (B, HV))
        A_log = jnp.asarray(rng.uniform(-1.0, 1.0, (HV,)), F32)
        dt_bias = _normal(rng, (HV, K))
        gf = ref.kda_gate(g, A_log, dt_bias, lower_bound=lower_bound)
        bf = ref.gdn_beta(beta)
    else:
        gf, bf = g, beta
    ro, rs = ref.decode_step(q, k, v, gf, bf, h0, use_qk_l2norm=True)
    o, s = dec.gdn_decode(q, k, v, g, beta, h0.copy(), use_qk_l2norm=True, A_log=A_log,
                          dt_bias=dt_bias, lower_bound=lower_bound, impl="pallas",
                          interpret=_interp(mode))
    assert rel_err(o, ro) <= 1e-5 and rel_err(s, rs) <= 1e-5


@pytest.mark.parametrize("mode", MODES)
def test_raw_gdn_gates_in_kernel(mode):
    B, HK, HV, K = 3, 2, 4, 64
    q, k, v, _, _, h0 = _step_inputs(31, B=B, HK=HK, HV=HV, K=K, V=K)
    rng = np.random.default_rng(32)
    a = np.array(_normal(rng, (B, HV), scale=3.0))
    a[0, 1], a[2, 3] = 30.0, 19.5   # softplus pass-through above 20, and just below
    a = jnp.asarray(a)
    b = _normal(rng, (B, HV))
    A_log = jnp.asarray(rng.uniform(-2.0, 0.0, (HV,)), F32)
    dt_bias = _normal(rng, (HV,))
    ro, rs = ref.decode_step(q, k, v, ref.gdn_gate(a, A_log, dt_bias), ref.gdn_beta(b), h0,
                             use_qk_l2norm=True)
    o, s = dec.gdn_decode(q, k, v, a, b, h0.copy(), use_qk_l2norm=True, A_log=A_log,
                          dt_bias=dt_bias, impl="pallas", interpret=_interp(mode))
    assert rel_err(o, ro) <= 1e-5 and rel_err(s, rs) <= 1e-5


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("K,sdt,activation", [(64, F32, "silu"), (128, F16, "silu"),
                                               (64, F32, "sigmoid")])
def test_fused_gated_norm(mode, K, sdt, activation):
    B, HK, HV = 3, 1, 2
    q, k, v, g, beta, h0 = _step_inputs(41 + K, B=B, HK=HK, HV=HV, K=K, V=K, dtype=BF16)
    h0 = h0.astype(sdt)
    rng = np.random.default_rng(42)
    z = _normal(rng, (B, HV, K), BF16)
    w = 1.0 + _normal(rng, (K,), scale=0.1)
    ro, rs = ref.decode_step(q.astype(F32), k, v, g, beta, h0, use_qk_l2norm=True)
    ry = ref.gated_rmsnorm(ro, z, w, eps=1e-6, activation=activation, out_dtype=F32)
    _poison((B, HV, K), BF16)
    y, s = dec.gdn_decode(q, k, v, g, beta, h0.copy(), use_qk_l2norm=True, z=z, norm_weight=w,
                          norm_activation=activation, impl="pallas", interpret=_interp(mode))
    assert y.dtype == BF16 and y.shape == (B, HV, K)
    assert rel_err(y, ry) <= 5e-3  # one bf16 rounding of the fp32 result
    assert rel_err(s, rs) <= (1e-5 if sdt == F32 else 1e-3)


# --------------------------------------------------------------------------- pool + packed rows

def _pool_case(seed, *, B, HK, HV, K, slots, n_slots, sdt, raw, norm, per_channel=False):
    """Packed inputs and a sentinel-filled pool. Returns (kwargs for gdn_decode_pool, expected
    (o, pool), the sentinel value)."""
    kind = "kda" if per_channel else "gdn"
    q, k, v, g, beta, _ = _step_inputs(seed, B=B, HK=HK, HV=HV, K=K, V=K, kind=kind, dtype=BF16)
    rng = np.random.default_rng(seed + 1)
    qkv = jnp.concatenate([q.reshape(B, -1), k.reshape(B, -1), v.reshape(B, -1)], axis=1)
    sentinel = 1e30 if sdt == F32 else float(jnp.finfo(sdt).max)
    pool = np.full((n_slots, HV, K, K), sentinel, np.float32)
    for s in slots:
        if s >= 0:
            pool[s] = 0.3 * rng.standard_normal((HV, K, K), dtype=np.float32)
    pool = jnp.asarray(pool).astype(sdt)
    slots = jnp.asarray(slots, jnp.int32)
    gk = K if per_channel else 1
    kw = dict(num_k_heads=HK, num_v_heads=HV, head_k_dim=K, head_v_dim=K, use_qk_l2norm=True,
              per_channel_gate=per_channel)
    if raw:  # a packed gate projection [B, 5 + HV * gk + HV]: junk | a | b, one array, two offsets
        gates = _normal(rng, (B, 5 + HV * gk + HV), BF16)
        A_log = jnp.asarray(rng.uniform(-1.0, 0.5, (HV,)), F32)
        dt_bias = 0.5 * jnp.ones((HV * gk,))
        a32, b32 = gates[:, 5:5 + HV * gk].astype(F32), gates[:, 5 + HV * gk:].astype(F32)
        a32 = a32.reshape((B, HV, K) if per_channel else (B, HV))
        gf = (ref.kda_gate(a32, A_log, dt_bias) if per_channel else ref.gdn_gate(a32, A_log, dt_bias))
        bf = ref.gdn_beta(b32)
        kw.update(g=gates, beta=gates, g_col=5, beta_col=5 + HV * gk, A_log=A_log, dt_bias=dt_bias)
    else:
        gf, bf = g, beta
        kw.update(g=g.reshape(B, -1), beta=beta)
    valid = np.asarray(slots) >= 0
    states = pool[jnp.where(slots >= 0, slots, 0)]
    ro, rs = ref.decode_step(q.astype(F32), k, v, gf, bf, states, use_qk_l2norm=True)
    if norm:
        z = _normal(rng, (B, 3 + HV * K), BF16)  # z at column 3 of a wider row
        w = 1.0 + _normal(rng, (K,), scale=0.1)
        ro = ref.gated_rmsnorm(ro, z[:, 3:].reshape(B, HV, K), w, out_dtype=F32)
        kw.update(z=z, z_col=3, norm_weight=w)
    ro = jnp.where(jnp.asarray(valid)[:, None, None], ro, 0.0)
    want_pool = np.array(pool)
    for i, s in enumerate(np.asarray(slots)):
        if s >= 0:
            want_pool[s] = np.asarray(rs[i])
    want_pool = jnp.asarray(want_pool)
    return qkv, pool, slots, kw, (ro, want_pool), sentinel


POOL_CASES = [
    # B, HK, HV, K, slots, n_slots, state dtype, raw gates, fused norm, per-channel gate, block
    (5, 2, 4, 64, [4, -1, 0, 7, -1], 9, F32, False, False, False, None),
    (3, 1, 2, 64, [2, 6, -1], 8, F32, True, True, False, None),
    (3, 2, 4, 64, [-1, 1, 3], 5, F16, True, False, False, None),
    (1, 2, 2, 128, [3], 4, BF16, False, True, False, None),
    (3, 1, 2, 64, [1, -1, 0], 3, F32, True, False, True, None),
    (3, 1, 4, 64, [-1, 4, 0], 6, F32, True, True, False,
     kern.DecodeBlockSizes(block_v=64, tile_v=32)),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("B,HK,HV,K,slots,n_slots,sdt,raw,norm,per_channel,block", POOL_CASES)
def test_pool_packed_sentinel(mode, B, HK, HV, K, slots, n_slots, sdt, raw, norm, per_channel,
                              block):
    qkv, pool, slots, kw, (ro, want_pool), sentinel = _pool_case(
        B * 10 + K, B=B, HK=HK, HV=HV, K=K, slots=slots, n_slots=n_slots, sdt=sdt, raw=raw,
        norm=norm, per_channel=per_channel)
    _poison((B, HV, K), BF16)
    o, new_pool = dec.gdn_decode_pool(qkv, pool=pool.copy(), slots=slots, impl="pallas",
                                      interpret=_interp(mode), block_sizes=block, **kw)
    assert new_pool.shape == pool.shape and new_pool.dtype == pool.dtype
    named = set(int(s) for s in np.asarray(slots) if s >= 0)
    untouched = [i for i in range(n_slots) if i not in named]
    # Slots not named (the padding rows name none): bit-for-bit the sentinel.
    np.testing.assert_array_equal(np.asarray(new_pool[np.asarray(untouched)]),
                                  np.asarray(pool[np.asarray(untouched)]))
    assert np.all(np.asarray(new_pool[np.asarray(untouched)], np.float32) == np.float32(sentinel))
    pad = np.asarray(slots) < 0
    if pad.any():  # padding rows: output exactly zero
        assert np.all(np.asarray(o[np.asarray(pad)], np.float32) == 0.0)
    live = np.asarray(sorted(named))
    tol_s = 1e-5 if sdt == F32 else (1e-3 if sdt == F16 else 8e-3)
    assert rel_err(new_pool[live], want_pool[live]) <= tol_s
    assert rel_err(o, ro) <= (5e-3 if norm or o.dtype == BF16 else 1e-5)


def test_pool_reference_fallback_matches():
    """The impl='reference' pool path (gather, step, scatter with padding) is the same function."""
    qkv, pool, slots, kw, (ro, want_pool), _ = _pool_case(
        77, B=5, HK=2, HV=4, K=32, slots=[4, -1, 0, 7, -1], n_slots=9, sdt=F32, raw=True, norm=True)
    o, new_pool = dec.gdn_decode_pool(qkv, pool=pool.copy(), slots=slots, impl="reference", **kw)
    assert rel_err(o, ro) <= 5e-3
    np.testing.assert_array_equal(np.asarray(new_pool[np.asarray([1, 2, 3, 5, 6, 8])]),
                                  np.asarray(pool[np.asarray([1, 2, 3, 5, 6, 8])]))
    assert rel_err(new_pool, want_pool) <= 1e-6


# --------------------------------------------------------------------------- sequences

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_decode_steps_equal_prefill(mode, kind):
    B, T, HK, HV, K = 2, 5, 1, 2, 64
    q, k, v, g, beta, h0 = _rand_inputs(51, B=B, T=T, HK=HK, HV=HV, K=K, V=K, kind=kind)
    from gdn_jax.ops import kda
    seq = gated_delta_rule if kind == "gdn" else kda
    po, ps = seq(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True,
                 impl="reference")
    S, outs = h0.copy(), []
    for t in range(T):
        o, S = dec.gdn_decode(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S,
                              use_qk_l2norm=True, impl="pallas", interpret=_interp(mode))
        outs.append(o)
    assert rel_err(jnp.stack(outs, 1), po) <= 1e-5 and rel_err(S, ps) <= 1e-5


def test_decode_loop_does_not_retrace():
    B, HK, HV, K = 2, 1, 2, 32
    q, k, v, g, beta, h0 = _step_inputs(61, B=B, HK=HK, HV=HV, K=K, V=K)
    dec.gdn_decode(q, k, v, g, beta, h0.copy(), impl="pallas", interpret=True)
    n = dec._gdn_decode_jit._cache_size()
    S = h0.copy()
    for _ in range(3):
        _, S = dec.gdn_decode(q, k, v, g, beta, S, impl="pallas", interpret=True)
    assert dec._gdn_decode_jit._cache_size() == n


# --------------------------------------------------------------------------- choice and errors

def test_decode_choice_is_pure_and_explains():
    """gdn_decode's choice through the one dispatch: pure, with the reason visible."""
    from gdn_jax import dispatch
    spec = kern.DecodeSpec(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, scale=0.1)
    blk = kern.default_block_sizes(128, 128, F32, False)
    call = dec.DecodeCall(spec, blk, "float32", 128 * 32 * 128 * 128, 128, "bfloat16")
    sel = lambda impl, c=call, **kw: dispatch.select("gdn_decode", c, impl, log=False, **kw)
    assert sel("auto", backend="gpu") == dispatch.Choice("gdn_decode", "pallas", "triton decode")
    assert sel("pallas", backend="gpu").impl == "pallas"
    cpu = sel("auto", backend="cpu", interpret=False)
    assert cpu.impl == "reference" and "GPU" in cpu.reason
    assert sel("auto", backend="cpu", interpret=True).impl == "pallas"
    with pytest.raises(ValueError, match="need a GPU"):
        sel("pallas", backend="cpu", interpret=False)
    odd = dataclasses_replace(call, spec=dataclasses_replace(spec, head_k_dim=48))
    got = sel("auto", odd, backend="gpu")
    assert got.impl == "reference" and "K=48" in got.reason
    with pytest.raises(ValueError, match="K=48"):
        sel("pallas", odd, backend="gpu")
    with pytest.raises(ValueError, match="int32"):
        sel("pallas", dataclasses_replace(call, num_state_elements=2**31), backend="gpu")
    with pytest.raises(ValueError, match="float32/float16/bfloat16"):
        sel("pallas", dataclasses_replace(call, state_dtype="int8"), backend="gpu")
    with pytest.raises(ValueError, match="impl must be"):
        sel("triton", backend="gpu")
    with pytest.raises(ValueError, match="no chunk form"):
        sel("chunked", backend="gpu")
    # the fused norm needs a whole head per program
    with pytest.raises(ValueError, match="whole head"):
        sel("pallas", dataclasses_replace(call, spec=dataclasses_replace(spec, fused_norm=True),
                                          block=kern.DecodeBlockSizes(block_v=32)), backend="gpu")
    # explain reads the public function's arguments (ShapeDtypeStructs will do) and runs nothing
    sds = lambda *s, d=F32: jax.ShapeDtypeStruct(s, d)
    args = (sds(4, 2, 48), sds(4, 2, 48), sds(4, 4, 48), sds(4, 4), sds(4, 4), sds(4, 4, 48, 48))
    why = dispatch.explain("gdn_decode", *args, interpret=True)
    assert why.impl == "reference" and "K=48" in why.reason
    # the tuning table answers for every batch size and state dtype
    for b in (1, 8, 9, 16, 17, 128, 4096):
        for sdt in (F32, F16, BF16):
            for norm in (False, True):
                bs = kern.default_block_sizes(b, 128, sdt, norm)
                assert kern.unsupported_reason(dataclasses_replace(spec, fused_norm=norm), bs, sdt) is None


def dataclasses_replace(obj, **kw):
    import dataclasses
    return dataclasses.replace(obj, **kw)


def test_auto_falls_back_to_reference_on_cpu():
    if jax.default_backend() == "gpu":
        pytest.skip("CPU-only behaviour")
    B, HK, HV, K = 2, 1, 2, 48  # K = 48: no Triton tile either
    q, k, v, g, beta, h0 = _step_inputs(71, B=B, HK=HK, HV=HV, K=K, V=K)
    ro, rs = ref.decode_step(q, k, v, g, beta, h0, use_qk_l2norm=True)
    o, s = dec.gdn_decode(q, k, v, g, beta, h0.copy(), use_qk_l2norm=True, impl="auto")
    assert rel_err(o, ro) <= 1e-6 and rel_err(s, rs) <= 1e-6
    with pytest.raises(ValueError, match="K=48"):
        dec.gdn_decode(q, k, v, g, beta, h0.copy(), impl="pallas", interpret=True)


def test_bad_inputs_raise_value_error():
    B, HK, HV, K = 2, 1, 2, 32
    q, k, v, g, beta, h0 = _step_inputs(81, B=B, HK=HK, HV=HV, K=K, V=K)
    call = functools.partial(dec.gdn_decode, impl="pallas", interpret=True)
    with pytest.raises(ValueError, match="q must have rank 3"):
        call(q[None], k, v, g, beta, h0)
    with pytest.raises(ValueError, match="multiple of"):
        call(q[:, [0, 0]], k[:, [0, 0]], v[:, [0, 0, 0]], g, beta, h0)
    with pytest.raises(ValueError, match="^k must"):
        call(q, k[:, :, :16], v, g, beta, h0)
    with pytest.raises(ValueError, match="state must have shape"):
        call(q, k, v, g, beta, h0[:, :, :16])
    with pytest.raises(ValueError, match="^g must"):
        call(q, k, v, g[:, :1], beta, h0)
    with pytest.raises(ValueError, match="^beta must"):
        call(q, k, v, g, beta[:, None], h0)
    with pytest.raises(ValueError, match="A_log and dt_bias"):
        call(q, k, v, g, beta, h0, A_log=jnp.zeros(HV))
    with pytest.raises(ValueError, match="lower_bound"):
        call(q, k, v, g, beta, h0, A_log=jnp.zeros(HV), dt_bias=jnp.zeros(HV), lower_bound=-1.0)
    with pytest.raises(ValueError, match="z and norm_weight"):
        call(q, k, v, g, beta, h0, z=v)
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        call(q, k, v, g, beta, h0, z=v, norm_weight=jnp.ones(K + 1))
    with pytest.raises(ValueError, match="impl must be"):
        dec.gdn_decode(q, k, v, g, beta, h0, impl="cuda")
    # the pool entry point
    qkv = jnp.concatenate([q.reshape(B, -1), k.reshape(B, -1), v.reshape(B, -1)], 1)
    pool = jnp.ones((4, HV, K, K))
    pcall = functools.partial(dec.gdn_decode_pool, num_k_heads=HK, num_v_heads=HV, head_k_dim=K,
                              head_v_dim=K, impl="pallas", interpret=True)
    with pytest.raises(ValueError, match="^slots must name slots"):
        pcall(qkv, g, beta, pool, jnp.asarray([0, 4], jnp.int32))
    with pytest.raises(ValueError, match="^slots must name slots"):
        pcall(qkv, g, beta, pool, jnp.asarray([-2, 1], jnp.int32))
    with pytest.raises(ValueError, match="twice"):
        pcall(qkv, g, beta, pool, jnp.asarray([1, 1], jnp.int32))
    with pytest.raises(ValueError, match="^slots must be an integer array"):
        pcall(qkv, g, beta, pool, jnp.asarray([0.0, 1.0]))
    with pytest.raises(ValueError, match="conv_dim"):
        pcall(qkv[:, 1:], g, beta, pool, jnp.asarray([0, 1], jnp.int32))
    with pytest.raises(ValueError, match="outside its width"):
        pcall(qkv, g, beta, pool, jnp.asarray([0, 1], jnp.int32), g_col=1)
    with pytest.raises(ValueError, match="pool must be"):
        pcall(qkv, g, beta, pool[:, :1], jnp.asarray([0, 1], jnp.int32))
    # the kernel launcher itself checks before any device work
    spec = kern.DecodeSpec(num_k_heads=HK, num_v_heads=HV, head_k_dim=K, head_v_dim=K, scale=0.1)
    with pytest.raises(ValueError, match="^v must have B="):
        kern.gdn_decode(q.reshape(B, -1), k.reshape(B, -1), v.reshape(B - 1, -1)[:1], g, beta, h0,
                        spec=spec)
    with pytest.raises(ValueError, match="too narrow"):
        kern.gdn_decode(q.reshape(B, -1)[:, :8], k.reshape(B, -1), v.reshape(B, -1), g, beta, h0,
                        spec=spec)


# --------------------------------------------------------------------------- stochastic rounding

def _neighbours(x, dtype):
    """(RNE(x), x's other neighbour in dtype) of fp32 x, as fp32 numpy arrays."""
    x = jnp.asarray(x, F32)
    r = x.astype(dtype)
    bits = jax.lax.bitcast_convert_type(r, jnp.uint16)
    r32 = r.astype(F32)
    step = jnp.where(jnp.abs(x) > jnp.abs(r32), 1, jnp.where(x == r32, 0, -1)).astype(jnp.int32)
    other = jax.lax.bitcast_convert_type((bits.astype(jnp.int32) + step).astype(jnp.uint16), dtype)
    return np.asarray(r32), np.asarray(other.astype(F32))


@pytest.mark.parametrize("mode", KERNEL_MODES)
@pytest.mark.parametrize("sdt", [BF16, F16])
def test_stochastic_rounding_store(mode, sdt):
    """Every stored value is one of the two 16-bit neighbours of the fp32 result, the farther one
    as often as unbiasedness asks; the same key gives the same bits whatever the block shape."""
    B, HK, HV, K, V = 3, 1, 2, 32, 64
    q, k, v, g, beta, h0 = _step_inputs(61, B=B, HK=HK, HV=HV, K=K, V=V)
    h16 = h0.astype(sdt)
    blk = kern.DecodeBlockSizes(block_v=32)
    run = functools.partial(dec.gdn_decode, q, k, v, g, beta, use_qk_l2norm=True, impl="pallas",
                            interpret=_interp(mode))
    _, x = run(h16.astype(F32), block_sizes=blk)         # the fp32 values before the store
    key = jax.random.key(5)
    _poison(h16.shape, sdt)
    _, y = run(h16.copy(), rounding_key=key, block_sizes=blk)
    assert y.dtype == sdt
    x, y = np.asarray(x), np.asarray(y.astype(F32))
    rne, other = _neighbours(x, sdt)
    assert np.all((y == rne) | (y == other))
    gap = other - rne
    moved = gap != 0
    p = np.where(moved, (x - rne) / np.where(moved, gap, 1.0), 0.0)
    assert moved.mean() > 0.9
    # the farther neighbour is taken with probability p: mean over ~12k elements
    assert abs(np.mean(y[moved] == other[moved]) - np.mean(p[moved])) < 0.02
    assert abs(np.sum(y - x)) / np.sum(np.abs(gap)) < 0.02          # unbiased in aggregate
    again = np.asarray(run(h16.copy(), rounding_key=key)[1].astype(F32))   # tuning-table block
    np.testing.assert_array_equal(again, y)
    other_key = np.asarray(run(h16.copy(), rounding_key=jax.random.key(6), block_sizes=blk)[1]
                           .astype(F32))
    assert np.mean(other_key != y) > 0.1


@pytest.mark.parametrize("mode", KERNEL_MODES)
def test_stochastic_rounding_kernel_lets_a_16bit_state_decay(mode):
    """bf16 state, no writes (beta = 0), g = -5e-4 (below half an ulp): the RNE store never moves
    the state (the decay stall); stochastic-rounding stores decay it as exp(g t)."""
    B, HK, HV, K, V, T, gval = 1, 1, 2, 16, 16, 1000, -5e-4
    q, k, v, _, _, h0 = _step_inputs(62, B=B, HK=HK, HV=HV, K=K, V=V)
    S0 = h0.astype(BF16)
    g = jnp.full((B, HV), gval)
    beta = jnp.zeros((B, HV))

    @functools.partial(jax.jit, static_argnames="stochastic")
    def run(S, stochastic):
        def body(i, S):
            key = jax.random.fold_in(jax.random.key(7), i) if stochastic else None
            return dec.gdn_decode(q, k, v, g, beta, S, rounding_key=key, impl="pallas",
                                  interpret=_interp(mode))[1]
        return jax.lax.fori_loop(0, T, body, S)

    f64 = lambda a: np.asarray(a.astype(F32), np.float64)
    s0 = f64(S0)
    np.testing.assert_array_equal(f64(run(S0.copy(), False)), s0)          # the stall
    sr = f64(run(S0.copy(), True))
    want = s0 * np.exp(gval * T)
    assert abs(np.sum(sr * s0) / np.sum(s0 * s0) - np.exp(gval * T)) < 0.01
    assert np.linalg.norm(sr - want) / np.linalg.norm(want) < 0.1
    np.testing.assert_array_equal(f64(run(S0.copy(), True)), sr)           # deterministic


@pytest.mark.parametrize("mode", KERNEL_MODES)
def test_stochastic_rounding_pool(mode):
    """Pool + slot table with stochastic rounding: padding rows and unnamed slots untouched, and a
    slot's draw depends on its slot, not its batch row (rows permuted: the same pool)."""
    B, HK, HV, K = 4, 1, 2, 32
    qkv, pool, slots, kw, (ro, want_pool), sentinel = _pool_case(
        63, B=B, HK=HK, HV=HV, K=K, slots=[5, -1, 0, 2], n_slots=7, sdt=BF16, raw=True, norm=False,
        per_channel=False)
    key = jax.random.key(8)
    run = lambda qkv, slots, kw: dec.gdn_decode_pool(qkv, pool=pool.copy(), slots=slots,
                                                     rounding_key=key, impl="pallas",
                                                     interpret=_interp(mode), **kw)
    o, new = run(qkv, slots, kw)
    untouched = np.asarray([1, 3, 4, 6])
    np.testing.assert_array_equal(np.asarray(new[untouched]), np.asarray(pool[untouched]))
    assert np.all(np.asarray(o[1], np.float32) == 0.0)
    live = np.asarray([5, 0, 2])
    assert rel_err(new[live], want_pool[live]) <= 8e-3
    perm = np.asarray([3, 0, 2, 1])
    kw_p = dict(kw, g=kw["g"][perm], beta=kw["beta"][perm])
    _, new_p = run(qkv[perm], slots[perm], kw_p)
    np.testing.assert_array_equal(np.asarray(new_p.astype(F32)), np.asarray(new.astype(F32)))


def test_stochastic_rounding_reference_path_and_errors():
    """impl="reference" rounds as reference.decode_step(rounding_key=...) does; a key with an fp32
    state, or a key that is not one PRNG key, is a ValueError naming rounding_key."""
    q, k, v, g, beta, h0 = _step_inputs(64, B=2, HK=1, HV=2, K=16, V=16)
    h16 = h0.astype(BF16)
    key = jax.random.PRNGKey(9)
    _, s = dec.gdn_decode(q, k, v, g, beta, h16.copy(), use_qk_l2norm=True, rounding_key=key,
                          impl="reference")
    _, want = ref.decode_step(q, k, v, g, beta, h16, use_qk_l2norm=True, rounding_key=key)
    np.testing.assert_array_equal(np.asarray(s.astype(F32)), np.asarray(want.astype(F32)))
    with pytest.raises(ValueError, match="rounding_key.*float16 or bfloat16"):
        dec.gdn_decode(q, k, v, g, beta, h0, rounding_key=key)
    for bad in (jnp.zeros(3, jnp.uint32), jnp.zeros(2, jnp.int32), jax.random.split(key, 2), 7):
        with pytest.raises(ValueError, match="rounding_key must be one PRNG key"):
            dec.gdn_decode(q, k, v, g, beta, h16, rounding_key=bad)
    qkv = jnp.concatenate([q.reshape(2, -1), k.reshape(2, -1), v.reshape(2, -1)], axis=1)
    with pytest.raises(ValueError, match="rounding_key"):
        dec.gdn_decode_pool(qkv, g, beta, h0, jnp.array([0, 1], jnp.int32), num_k_heads=1,
                            num_v_heads=2, head_k_dim=16, head_v_dim=16, rounding_key=key)


# --------------------------------------------------------------------------- Triton lowering on CPU

LOWER_CASES = [  # raw gates, per-channel gate, l2, pooled, fused norm, state dtype, stoch. round
    (False, False, True, False, False, F32, False), (True, False, True, True, True, F32, False),
    (True, True, False, True, False, F16, False), (False, True, True, False, True, BF16, False),
    (True, False, False, False, False, BF16, False), (False, False, True, True, False, F16, False),
    (False, False, True, True, False, BF16, True), (True, True, True, False, True, F16, True),
]


@pytest.mark.parametrize("raw,pc,l2,pooled,norm,sdt,sr", LOWER_CASES)
def test_variants_lower_to_triton_ir(lower_for_h200, raw, pc, l2, pooled, norm, sdt, sr):
    """Every variant lowers to Triton IR for an H200 (sm_90), checked here without a GPU: the
    Pallas -> Triton lowering runs in Python; only the PTX compile needs the device."""
    B, HK, HV, K = 4, 2, 4, 128
    spec = kern.DecodeSpec(num_k_heads=HK, num_v_heads=HV, head_k_dim=K, head_v_dim=K, scale=0.1,
                           k_col=HK * K, v_col=2 * HK * K, raw_gates=raw, per_channel_gate=pc,
                           use_qk_l2norm=l2, pooled=pooled, fused_norm=norm,
                           stochastic_rounding=sr)
    gk = K if pc else 1
    qkv = jnp.ones((B, 2 * HK * K + HV * K), BF16)
    state = jax.ShapeDtypeStruct((6 if pooled else B, HV, K, K), sdt)
    args = (qkv, qkv, qkv, jnp.ones((B, HV * gk)), jnp.ones((B, HV)),
            jnp.ones(HV) if raw else None, jnp.ones(HV * gk) if raw else None,
            jnp.zeros(B, jnp.int32) if pooled else None,
            jnp.ones(2, jnp.uint32) if sr else None, jnp.ones((B, HV * K)) if norm else None,
            jnp.ones(K) if norm else None, state)
    block = kern.default_block_sizes(B, K, sdt, norm)
    if sdt == F16:  # cover the walk over several register tiles too
        block = dataclasses_replace(block, block_v=K, tile_v=K // 4)
    hlo = kern._launch.trace(*args, spec=spec, block=block, out_dtype=jnp.dtype(BF16),
                             interpret=False).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in hlo and "output_operand_aliases" in hlo


# --------------------------------------------------------------------------- GPU only

@pytest.mark.gpu
@pytest.mark.parametrize("B,sdt", [(128, F32), (128, F16), (33, BF16), (1, F32)])
def test_gpu_large_shapes_and_in_place(B, sdt):
    HK, HV, K = 16, 32, 128
    q, k, v, g, beta, h0 = _step_inputs(91 + B, B=B, HK=HK, HV=HV, K=K, V=K, dtype=BF16)
    h0 = h0.astype(sdt)
    ro, rs = ref.decode_step(q, k, v, g, beta, h0, use_qk_l2norm=True)
    ro32, _ = ref.decode_step(q.astype(F32), k, v, g, beta, h0, use_qk_l2norm=True)
    state = h0.copy()
    ptr = state.unsafe_buffer_pointer()
    _poison((B, HV, K), BF16)
    o, s = dec.gdn_decode(q, k, v, g, beta, state, use_qk_l2norm=True, impl="pallas")
    assert s.unsafe_buffer_pointer() == ptr, "the donated state was not updated in place"
    assert rel_err(o, ro32) <= 5e-3
    assert rel_err(s, rs) <= (1e-5 if sdt == F32 else 1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [128, 131])
def test_gpu_kda_large_batch(B):
    """KDA at serving size (HK = HV = 32) with the table's large-batch block, vs the reference."""
    HK = HV = 32
    K = 128
    q, k, v, g, beta, h0 = _step_inputs(95 + B, B=B, HK=HK, HV=HV, K=K, V=K, kind="kda", dtype=BF16)
    ro32, rs = ref.decode_step(q.astype(F32), k, v, g, beta, h0, use_qk_l2norm=True)
    _poison((B, HV, K), BF16)
    o, s = dec.gdn_decode(q, k, v, g, beta, h0.copy(), use_qk_l2norm=True, impl="pallas")
    assert rel_err(o, ro32) <= 5e-3
    assert rel_err(s, rs) <= 1e-5


@pytest.mark.gpu
def test_gpu_large_pool_in_place():
    B, HK, HV, K = 64, 16, 32, 128
    slots = list(range(0, 2 * B, 2))
    slots[5] = -1
    qkv, pool, slots, kw, (ro, want_pool), _ = _pool_case(
        93, B=B, HK=HK, HV=HV, K=K, slots=slots, n_slots=2 * B + 3, sdt=F32, raw=True, norm=True)
    p = pool.copy()
    ptr = p.unsafe_buffer_pointer()
    o, new_pool = dec.gdn_decode_pool(qkv, pool=p, slots=slots, impl="pallas", **kw)
    assert new_pool.unsafe_buffer_pointer() == ptr
    assert rel_err(o, ro) <= 5e-3
    live = np.asarray([s for s in np.asarray(slots) if s >= 0])
    rest = np.asarray(sorted(set(range(pool.shape[0])) - set(live.tolist())))
    assert rel_err(new_pool[live], want_pool[live]) <= 1e-5
    np.testing.assert_array_equal(np.asarray(new_pool[rest]), np.asarray(pool[rest]))
