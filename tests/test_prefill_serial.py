"""Token-serial prefill (the decode kernel body in `tokens` mode) vs a float64 oracle, the
"auto" rule that picks it, and the states after requested token counts (`states_after`).

Every numeric test runs in Pallas interpret mode on the CPU ("interpret") and compiled on the
GPU ("gpu", marked `gpu`). Inputs are fresh random draws (never zeros). Interpret mode starts
every kernel output as NaN (Pallas's uninitialised value; `test_interpret_outputs_start_poisoned`
holds it to that), so an output element the kernel forgets to write fails the finite check in
`rel_err`; pools carry 1e30 sentinels so a write to a slot that was not named shows.
"""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import gdn_jax
from gdn_jax import prefill as pf
from gdn_jax import reference as ref
from conftest import FULL
from helpers import rel_err
from pallas_kernels import gdn_decode as dk
from test_reference import numpy_delta_rule

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
MODES = [pytest.param("interpret", id="interpret"),
         pytest.param("gpu", id="gpu", marks=pytest.mark.gpu)]


def _inputs(seed, lens, *, HK, HV, K, dtype=F32, gate="normal", kda=False, dense=False):
    """Packed inputs [1, T_total, ...] (or [B, T, ...] with dense=True and equal lengths),
    float32 gates, an initial state per sequence and cu_seqlens."""
    rng = np.random.default_rng(seed)
    T = int(sum(lens))
    n = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
    gshape = (T, HV, K) if kda else (T, HV)
    q, k, v = n(T, HK, K), n(T, HK, K), n(T, HV, K)
    g = -np.logaddexp(0.0, n(*gshape) - 1.0)
    if gate == "extreme":  # resets, huge and near-zero decays mixed in every sequence
        pick = rng.integers(0, 5, gshape)
        g = np.select([pick == 0, pick == 1, pick == 2, pick == 3],
                      [-np.inf, -1e-6 * rng.random(gshape), -3e38, -1e4], g)
    beta = 1.0 / (1.0 + np.exp(-n(T, HV)))
    h0 = 0.3 * n(len(lens), HV, K, K)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    shape = (len(lens), lens[0]) if dense else (1, T)
    lay = lambda x, d=F32: jnp.asarray(x.reshape(shape + x.shape[1:])).astype(d)
    return (lay(q, dtype), lay(k, dtype), lay(v, dtype), lay(g.astype(np.float32)), lay(beta),
            jnp.asarray(h0), None if dense else jnp.asarray(cu))


def _oracle(q, k, v, g, beta, h0, cu, *, l2=True):
    """float64 token loop per sequence: (o like v, states [N, HV, K, V])."""
    if cu is None:
        return numpy_delta_rule(q, k, v, g, beta, h0, l2=l2)
    cu = np.asarray(cu)
    outs, states = [], []
    for i in range(len(cu) - 1):
        a, b = cu[i], cu[i + 1]
        s0 = None if h0 is None else np.asarray(h0[i:i + 1], np.float64)
        if a == b:
            outs.append(np.zeros((0,) + v.shape[2:]))
            states.append(np.zeros((v.shape[2], q.shape[3], v.shape[3])) if s0 is None else s0[0])
            continue
        o, s = numpy_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], s0,
                                l2=l2)
        outs.append(o[0])
        states.append(s[0])
    return np.concatenate(outs)[None], np.stack(states)


def _kernel(mode):
    return dict(kernel="serial", impl="pallas", interpret=mode == "interpret")


# --------------------------------------------------------------------------- against float64

CASES = [  # lens, HK, HV, K (= V), initial state, dense [B, T] layout
    ([1], 1, 1, 32, True, True),                   # T = 1, B = 1
    ([2, 2, 2], 2, 2, 32, False, True),            # B = 3, T = 2, no initial state
    ([17] * 7, 1, 2, 32, True, True),              # B = 7, T = 17, GVA 2x
    ([63], 1, 4, 64, True, True),                  # T = 63, GVA 4x, K = 64
    ([65, 65, 65], 2, 4, 32, True, True),          # B = 3, T = 65
    ([0, 1, 0, 17, 2, 65], 1, 2, 64, True, False),  # packed: empty and one-token sequences
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lens,HK,HV,K,init,dense", CASES)
def test_serial_matches_float64(mode, lens, HK, HV, K, init, dense):
    q, k, v, g, beta, h0, cu = _inputs(1, lens, HK=HK, HV=HV, K=K, dense=dense)
    h0 = h0 if init else None
    o, hT, chunks = pf.gdn_prefill(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True,
                                   cu_seqlens=cu, **_kernel(mode))
    ro, rs = _oracle(q, k, v, g, beta, h0, cu)
    assert chunks is None and o.shape == v.shape and hT.dtype == F32
    assert rel_err(o, ro) <= 1e-5
    assert rel_err(hT, rs) <= 1e-5
    if h0 is not None:
        assert np.all(np.isfinite(np.asarray(h0)))  # the initial states were only read


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kda", [False, True])
def test_bf16_inputs_against_float64(mode, kda):
    q, k, v, g, beta, h0, cu = _inputs(2, [5, 0, 30, 1], HK=2, HV=4, K=32, dtype=BF16, kda=kda)
    o, hT, _ = pf.gdn_prefill(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True,
                              cu_seqlens=cu, **_kernel(mode))
    assert o.dtype == BF16
    ro, rs = _oracle(q, k, v, g, beta, h0, cu)
    assert rel_err(o, ro) <= 5e-3
    assert rel_err(hT, rs) <= 5e-3


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kda", [False, True])
def test_extreme_gates_no_nan(mode, kda):
    """-inf (a reset), -3e38, -1e4 and near-zero gates: finite, and exact against float64."""
    q, k, v, g, beta, h0, cu = _inputs(3, [40, 25], HK=1, HV=2, K=32, gate="extreme", kda=kda)
    o, hT, _ = pf.gdn_prefill(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True,
                              cu_seqlens=cu, **_kernel(mode))
    assert np.all(np.isfinite(np.asarray(o))) and np.all(np.isfinite(np.asarray(hT)))
    ro, rs = _oracle(q, k, v, g, beta, h0, cu)
    assert rel_err(o, ro) <= 1e-5
    assert rel_err(hT, rs) <= 1e-5


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kda,lower_bound", [(False, None), (True, None), (True, -5.0)])
def test_raw_gates_in_kernel(mode, kda, lower_bound):
    HV, K = 2, 32
    q, k, v, _, _, h0, cu = _inputs(4, [9, 20], HK=1, HV=HV, K=K, kda=kda)
    rng = np.random.default_rng(5)
    a = jnp.asarray(2 * rng.standard_normal((1, 29, HV) + ((K,) if kda else ())), F32)
    b = jnp.asarray(rng.standard_normal((1, 29, HV)), F32)
    A_log = jnp.asarray(rng.standard_normal(HV), F32)
    dt_bias = jnp.asarray(rng.standard_normal(HV * K if kda else HV), F32)
    o, hT, _ = pf.gdn_prefill(q, k, v, a, b, initial_state=h0, use_qk_l2norm=True, cu_seqlens=cu,
                              A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                              **_kernel(mode))
    g = (ref.kda_gate(a, A_log, dt_bias.reshape(HV, K), lower_bound=lower_bound) if kda
         else ref.gdn_gate(a, A_log, dt_bias))
    ro, rs = _oracle(q, k, v, g, ref.gdn_beta(b), h0, cu)
    assert rel_err(o, ro) <= 1e-5
    assert rel_err(hT, rs) <= 1e-5


@pytest.mark.parametrize("mode", MODES)
def test_without_qk_norm_and_custom_scale(mode):
    q, k, v, g, beta, h0, _ = _inputs(6, [12, 12], HK=1, HV=1, K=32, dense=True)
    q, k = q / np.sqrt(32), k / np.sqrt(32)
    o, hT, _ = pf.gdn_prefill(q, k, v, g, beta, initial_state=h0, scale=0.5, **_kernel(mode))
    ro, rs = numpy_delta_rule(q, k, v, g, beta, h0, scale=0.5)
    assert rel_err(o, ro) <= 1e-5 and rel_err(hT, rs) <= 1e-5


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("state_dtype,tol", [(BF16, 5e-3), (F16, 1e-3)])
def test_16bit_initial_state(mode, state_dtype, tol):
    """A 16-bit initial state: math in fp32, the final state rounded once to its dtype."""
    q, k, v, g, beta, h0, _ = _inputs(7, [20, 20], HK=1, HV=2, K=32, dense=True)
    h0 = h0.astype(state_dtype)
    o, hT, _ = pf.gdn_prefill(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True,
                              **_kernel(mode))
    ro, rs = numpy_delta_rule(q, k, v, g, beta, h0, l2=True)
    assert hT.dtype == state_dtype
    assert rel_err(o, ro) <= 1e-5
    assert rel_err(hT, rs) <= tol


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pool_dtype,tol", [(F32, 1e-5), (BF16, 5e-3)])
def test_pool_slots_in_place(mode, pool_dtype, tol):
    """States from and to the named slots; -1 and past-the-pool slots are padding (nothing read
    or written, outputs zero); unnamed slots keep their bits (1e30 sentinels)."""
    lens = [7, 3, 0, 12, 1]
    HK, HV, K = 1, 2, 32
    q, k, v, g, beta, h0, cu = _inputs(8, lens, HK=HK, HV=HV, K=K)
    P = 7
    pool = np.full((P, HV, K, K), 1e30, np.float32)
    slots = np.array([4, -1, 0, 9, 2], np.int32)
    for n, s in enumerate(slots):
        if 0 <= s < P:
            pool[s] = np.asarray(h0[n])
    pool = np.asarray(jnp.asarray(pool).astype(pool_dtype))
    before = pool.copy()
    o, new = pf.gdn_prefill_pool(q, k, v, g, beta, jnp.asarray(pool), jnp.asarray(slots),
                                 cu_seqlens=cu, use_qk_l2norm=True, **_kernel(mode))
    o, new = np.asarray(o), np.asarray(new)
    assert new.dtype == pool_dtype
    cu_np = np.asarray(cu)
    for n, s in enumerate(slots):
        a, b = cu_np[n], cu_np[n + 1]
        if not 0 <= s < P:
            assert np.all(o[:, a:b] == 0)
            continue
        ro, rs = numpy_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                  before[s][None], l2=True)
        if b > a:
            assert rel_err(o[:, a:b], ro) <= 1e-5
        assert rel_err(new[s], rs[0]) <= tol
    untouched = [s for s in range(P) if s not in (4, 0, 2)]
    assert np.array_equal(new[untouched].view(np.uint8), before[untouched].view(np.uint8))


def test_interpret_outputs_start_poisoned():
    """The premise of the poisoned-output checks: a Pallas output the kernel never writes comes
    back as NaN in interpret mode."""
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        pass

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((4,), F32), interpret=True)(
        jnp.ones(4))
    assert np.all(np.isnan(np.asarray(out)))


# --------------------------------------------------------------------------- the "auto" rule

def test_auto_rule_is_a_table(monkeypatch):
    """gated_delta_rule / kda / gdn_prefill pick the token-serial kernel by SERIAL_PREFILL_TABLE
    on (number of sequences, longest sequence); explain shows the choice and the row."""
    sds = lambda *s: jax.ShapeDtypeStruct(s, F32)

    def why(B, T, op="gated_delta_rule", interpret=True, **kw):
        g = sds(B, T, 2) if op != "kda" else sds(B, T, 2, 16)
        return gdn_jax.explain(op, sds(B, T, 1, 16), sds(B, T, 1, 16), sds(B, T, 2, 16), g,
                               sds(B, T, 2), interpret=interpret, **kw)

    limit = pf.serial_prefill_limit(1)
    assert why(1, limit).family == "serial prefill"
    assert "SERIAL_PREFILL_TABLE" in why(1, limit).detail
    assert why(1, limit + 1).family == "chunked prefill"
    assert "SERIAL_PREFILL_TABLE" in why(1, limit + 1).detail
    assert why(1, 1).family == "decode"
    assert why(3, 2, op="kda").family == "serial prefill"
    # KDA reads its own table (its chunked kernels cost more): a length past GDN's limit.
    kda_limit = pf.serial_prefill_limit(1, per_channel_gate=True)
    assert kda_limit > limit
    assert why(1, kda_limit, op="kda").family == "serial prefill"
    assert "KDA_SERIAL_PREFILL_TABLE" in why(1, kda_limit, op="kda").detail
    assert why(1, kda_limit + 1, op="kda").family == "chunked prefill"
    # Packed: the longest sequence decides when the offsets are concrete; traced offsets count T.
    limit2 = pf.serial_prefill_limit(2)                   # two packed sequences
    cu = np.array([0, 3, limit2 + 3], np.int32)
    assert why(1, limit2 + 3, cu_seqlens=cu).family == "serial prefill"
    assert why(1, limit2 + 3, cu_seqlens=np.array([0, 1, limit2 + 3], np.int32)).family == \
        "chunked prefill"
    # gdn_prefill: chunk states and kernel= steer it too.
    assert why(2, 8, op="gdn_prefill").family == "serial prefill"
    assert why(2, 8, op="gdn_prefill", chunk_states=True).family == "chunked prefill"
    assert why(2, 8, op="gdn_prefill", kernel="chunked").family == "chunked prefill"
    assert why(2, 500, op="gdn_prefill", kernel="serial").family == "serial prefill"
    # The table is the only place the crossover lives: a different table, different choices.
    monkeypatch.setattr(pf, "SERIAL_PREFILL_TABLE", ((4, 10), (1 << 30, 3)))
    assert why(4, 10).family == "serial prefill" and why(4, 11).family == "chunked prefill"
    assert why(5, 3).family == "serial prefill" and why(5, 4).family == "chunked prefill"
    assert "> 3 tokens for N=5" in why(5, 4).detail
    # Head dims the token-serial kernel cannot tile: say why, under "pallas" too.
    odd = gdn_jax.explain("gdn_prefill", sds(1, 4, 1, 24), sds(1, 4, 1, 24), sds(1, 4, 1, 24),
                          sds(1, 4, 1), sds(1, 4, 1), interpret=True)
    assert odd.impl == "reference" and "K=24" in odd.reason
    off = why(1, 4, interpret=False)
    if jax.default_backend() != "gpu":
        assert off.impl == "reference" and "GPU" in off.reason


def test_gated_delta_rule_auto_runs_the_serial_kernel():
    q, k, v, g, beta, h0, _ = _inputs(9, [6, 6], HK=1, HV=2, K=16, dense=True)
    with gdn_jax.interpret():
        assert gdn_jax.explain("gated_delta_rule", q, k, v, g, beta).family == "serial prefill"
        o, hT = gdn_jax.gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                         output_final_state=True, use_qk_l2norm=True)
    ro, rs = numpy_delta_rule(q, k, v, g, beta, h0, l2=True)
    assert rel_err(o, ro) <= 1e-5 and rel_err(hT, rs) <= 1e-5
    assert np.all(np.isfinite(np.asarray(h0)))


def test_bad_kernel_argument():
    q, k, v, g, beta, _, _ = _inputs(10, [4], HK=1, HV=1, K=16, dense=True)
    with pytest.raises(ValueError, match="kernel must be"):
        pf.gdn_prefill(q, k, v, g, beta, kernel="fast", interpret=True)
    with pytest.raises(ValueError, match="kernel='serial'.*chunk_states"):
        pf.gdn_prefill(q, k, v, g, beta, kernel="serial", chunk_states=True, interpret=True)


# --------------------------------------------------------------------------- states at positions

def _split_states(q, k, v, g, beta, h0, cu, positions):
    """float64 final states of calls cut after each requested count: [N, P, HV, K, V]."""
    N, P = positions.shape
    out = np.zeros((N, P, v.shape[2], q.shape[3], v.shape[3]))
    for n in range(N):
        s0 = None if h0 is None else np.asarray(jnp.asarray(h0[n:n + 1], F32), np.float64)
        for i in range(P):
            p = int(positions[n, i])
            if p == 0:
                out[n, i] = 0 if s0 is None else s0[0]
                continue
            start = 0 if cu is None else int(np.asarray(cu)[n])
            rows = slice(n, n + 1) if cu is None else slice(0, 1)
            cut = [x[rows, start:start + p] for x in (q, k, v, g, beta)]
            _, s = numpy_delta_rule(*cut, s0, l2=True)
            out[n, i] = s[0]
    return out


@pytest.mark.parametrize("mode", MODES)
# the chunked kernel's states_after in the default run: the packed test below
@pytest.mark.parametrize("kernel", ["serial", pytest.param("chunked", marks=FULL)])
def test_states_after_equal_split_calls_dense(mode, kernel):
    """Positions shared by every row and per row; 0, chunk boundaries and T included."""
    B, T = 2, 70
    q, k, v, g, beta, h0, _ = _inputs(11, [T] * B, HK=1, HV=2, K=16, dense=True)
    shared = np.array([0, 5, 64, 70], np.int32)
    per_row = np.array([[1, 63, 65], [70, 0, 67]], np.int32)
    for positions in (shared, per_row):
        o, hT, _, at = pf.gdn_prefill(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True,
                                      states_after=positions, kernel=kernel, impl="pallas",
                                      interpret=mode == "interpret")
        want = _split_states(q, k, v, g, beta, h0, None,
                             np.broadcast_to(positions, (B, positions.shape[-1])))
        assert at.shape == want.shape and at.dtype == F32
        assert rel_err(at, want) <= 1e-5
    ro, rs = numpy_delta_rule(q, k, v, g, beta, h0, l2=True)
    assert rel_err(o, ro) <= 1e-5 and rel_err(hT, rs) <= 1e-5


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kernel,init", [("chunked", True), ("chunked", False), ("serial", False)])
def test_states_after_equal_split_calls_packed(mode, kernel, init):
    lens = [70, 0, 1, 130]
    q, k, v, g, beta, h0, cu = _inputs(12, lens, HK=2, HV=4, K=16)
    h0 = h0 if init else None
    positions = np.array([[3, 64, 70], [0, 0, 0], [1, 0, 1], [128, 129, 65]], np.int32)
    _, _, _, at = pf.gdn_prefill(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True,
                                 cu_seqlens=cu, states_after=positions, kernel=kernel,
                                 impl="pallas", interpret=mode == "interpret")
    want = _split_states(q, k, v, g, beta, h0, cu, positions)
    assert rel_err(at, want) <= 1e-5


def test_states_after_reference_path_and_bf16_state():
    """impl="reference" gives the same states (pure JAX); a 16-bit initial state gives them in
    its dtype, rounded once."""
    q, k, v, g, beta, h0, cu = _inputs(13, [20, 9], HK=1, HV=1, K=16)
    positions = np.array([4, 9], np.int32)
    _, _, _, at = pf.gdn_prefill(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True,
                                 cu_seqlens=cu, states_after=positions, impl="reference")
    want = _split_states(q, k, v, g, beta, h0, cu, np.broadcast_to(positions, (2, 2)))
    assert rel_err(at, want) <= 1e-5
    hb = h0.astype(BF16)
    _, _, _, got = pf.gdn_prefill(q, k, v, g, beta, initial_state=hb, use_qk_l2norm=True,
                                  cu_seqlens=cu, states_after=positions, impl="pallas",
                                  kernel="chunked", interpret=True)
    want = _split_states(q, k, v, g, beta, hb, cu, np.broadcast_to(positions, (2, 2)))
    assert got.dtype == BF16 and rel_err(got, want) <= 5e-3


def test_states_after_bad_values_name_the_argument():
    q, k, v, g, beta, _, cu = _inputs(14, [5, 3], HK=1, HV=1, K=16)
    call = lambda pos, **kw: pf.gdn_prefill(q, k, v, g, beta, cu_seqlens=cu, states_after=pos,
                                            interpret=True, **kw)
    with pytest.raises(ValueError, match="states_after.*sequence 1 has 3 tokens"):
        call(np.array([4]))
    with pytest.raises(ValueError, match="states_after"):
        call(np.array([-1]))
    with pytest.raises(ValueError, match="states_after"):
        call(np.array([1.0]))
    with pytest.raises(ValueError, match="states_after.*N=2"):
        call(np.zeros((3, 1), np.int32))
    with pytest.raises(ValueError, match="states_after"):
        call(np.zeros((0,), np.int32))


# --------------------------------------------------------------------------- Triton lowering on CPU

@pytest.mark.parametrize("variant", [dict(), dict(pooled=True),
                                     dict(reads_state=False, per_channel_gate=True,
                                          raw_gates=True, gate_lower_bound=-5.0),
                                     dict(token_outputs=False)])
def test_serial_variants_lower_to_triton_ir(lower_for_h200, variant):
    """The token-serial variants lower to Triton IR for an H200 without a GPU."""
    T, HK, HV, K = 40, 2, 4, 128
    spec = dk.DecodeSpec(num_k_heads=HK, num_v_heads=HV, head_k_dim=K, head_v_dim=K, scale=0.1,
                         use_qk_l2norm=True, tokens=True, **variant)
    x, y = jnp.ones((T, HK * K), BF16), jnp.ones((T, HV * K), BF16)
    g = jnp.ones((T, HV * K)) if spec.per_channel_gate else jnp.ones((T, HV))
    state = None
    if spec.reads_state:
        state = jnp.ones((5, HV, K, K)) if spec.pooled else jnp.ones((2, HV, K, K))
    slots = jnp.array([1, -1], jnp.int32) if spec.pooled else None
    A_log, dt = (jnp.ones(HV), jnp.ones(HV * K)) if spec.raw_gates else (None, None)
    text = dk._launch_serial.trace(
        x, x, y, g, jnp.ones((T, HV)), A_log, dt, slots, jnp.array([0, 20], jnp.int32),
        jnp.array([20, 40], jnp.int32), state, spec=spec,
        block=dk.default_serial_block_sizes(2, HV, K, K), out_dtype=jnp.dtype(BF16),
        state_dtype=jnp.dtype(F32), interpret=False).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("K", [16, 64, 128, 256])
@pytest.mark.parametrize("num_seqs", [1, 8, 128])
def test_serial_block_sizes_keep_the_slab_in_registers(K, num_seqs):
    """The token-serial tuning table's one-warp shapes take more warps at a large K, so that the
    [K, block_v] fp32 slab never asks more than SERIAL_VALUES_PER_THREAD values of a thread."""
    block = dk.default_serial_block_sizes(num_seqs, 32, K, K)
    assert block.block_v <= K and K % block.block_v == 0
    assert K * block.block_v <= dk.SERIAL_VALUES_PER_THREAD * 32 * block.num_warps
    if K <= 128:  # the table's own shape where it fits
        want = next(bs for n, bs in dk.SERIAL_TUNING_TABLE if num_seqs * 32 <= n)
        assert block.num_warps == want.num_warps and block.num_stages == want.num_stages


@pytest.mark.gpu
@pytest.mark.parametrize("K", [128, 256])
@pytest.mark.parametrize("lens", [[13], [12] * 16], ids=["few_pairs", "many_pairs"])
def test_serial_default_blocks_at_production_head_dims(K, lens):
    """The token-serial kernel's default launch shapes (one warp at K = 128, more at K = 256),
    compiled at the production head dims, on both sides of the tuning table's pair bound."""
    q, k, v, g, beta, h0, cu = _inputs(5, lens, HK=4, HV=8, K=K, dtype=BF16)
    o, hT, _ = pf.gdn_prefill(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True,
                              cu_seqlens=cu, kernel="serial", impl="pallas")
    ro, rs = _oracle(q, k, v, g, beta, h0, cu)
    assert rel_err(o, ro) <= 5e-3
    assert rel_err(hT, rs) <= 5e-3
