"""Chunked prefill kernels (pallas_kernels/gdn_prefill.py) vs a float64 oracle and the references.

Every test runs in Pallas interpret mode on the CPU ("interpret") and compiled on the GPU ("gpu",
marked `gpu`). Inputs are fresh random draws (never zeros); pools carry 1e30 sentinels so a
write to a slot that was not named, or a read of padding, shows.
"""

import dataclasses
import functools
import itertools

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from conftest import FULL
from gdn_jax import reference as ref
from helpers import rel_err
from pallas_kernels import gdn_prefill as kern
from test_reference import numpy_delta_rule

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
MODES = [pytest.param("interpret", id="interpret"),
         pytest.param("gpu", id="gpu", marks=pytest.mark.gpu)]


def _packed_inputs(seed, lens, *, HK, HV, K, V, dtype=F32, gate="normal"):
    rng = np.random.default_rng(seed)
    T = int(sum(lens))
    n = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
    q, k, v = n(T, HK, K), n(T, HK, K), n(T, HV, V)
    if gate == "normal":
        g = -np.logaddexp(0.0, n(T, HV) - 1.0)
    elif gate == "extreme":  # resets, near-zero decays and huge decays mixed within chunks
        choice = rng.integers(0, 5, (T, HV))
        g = np.select([choice == 0, choice == 1, choice == 2, choice == 3],
                      [-np.inf, -1e-6 * rng.random((T, HV)), -1e4, -3e38],
                      -np.logaddexp(0.0, n(T, HV)))
        g = g.astype(np.float32)
    beta = 1.0 / (1.0 + np.exp(-n(T, HV)))
    h0 = 0.3 * n(len(lens), HV, K, V)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    cast = lambda x: jnp.asarray(x).astype(dtype)
    return (cast(q), cast(k), cast(v), jnp.asarray(g, F32), jnp.asarray(beta, F32),
            jnp.asarray(h0), jnp.asarray(cu))


def _spec(HK, HV, K, V, **kw):
    kw.setdefault("use_qk_l2norm", True)
    kw.setdefault("precise", True)
    return kern.PrefillSpec(num_k_heads=HK, num_v_heads=HV, head_k_dim=K, head_v_dim=V,
                            scale=K ** -0.5, **kw)


def _run(mode, q, k, v, g, beta, cu, spec, *, block_v=16, paired_halves=None, pair_group=8,
         heads_fastest=True, **kw):
    # block_k = prep_cols = 16: the KDA intra kernel's channel loop and the KDA prep's column
    # loops take several steps at every tested K (but K = 16). GDN's scan takes its products
    # with the split state paired (its default) unless told otherwise.
    if paired_halves is None:
        paired_halves = not spec.per_channel_gate
    block = kern.PrefillBlockSizes(block_v=min(block_v, spec.head_v_dim), block_k=16,
                                   prep_cols=16, paired_halves=paired_halves, pair_group=pair_group,
                                   heads_fastest=heads_fastest)
    return kern.chunk_prefill(q, k, v, g, beta, cu, spec=spec, block=block,
                              interpret=mode == "interpret", **kw)


def _oracle(q, k, v, g, beta, h0, cu, *, l2=True):
    """float64 token loop per packed sequence: (o [T, HV, V], states [N, HV, K, V])."""
    outs, states = [], []
    cu = np.asarray(cu)
    for n in range(len(cu) - 1):
        a, b = cu[n], cu[n + 1]
        s0 = None if h0 is None else h0[n:n + 1]
        if a == b:
            outs.append(np.zeros((0,) + v.shape[1:]))
            states.append(np.asarray(h0[n]) if h0 is not None else
                          np.zeros((v.shape[1], q.shape[2], v.shape[2])))
            continue
        o, s = numpy_delta_rule(q[None, a:b], k[None, a:b], v[None, a:b], g[None, a:b],
                                beta[None, a:b], s0, l2=l2)
        outs.append(o[0])
        states.append(s[0])
    return np.concatenate(outs), np.stack(states)


# --------------------------------------------------------------------------- against float64

CASES = [  # lens, HK, HV, K (= V), initial state
    ([1, 2, 17, 63, 64, 65, 300], 1, 1, 64, True),  # every awkward T in one packed call
    ([65, 65, 65], 2, 4, 32, False),                # B = 3 dense, GVA 2x, no initial state
    ([17] * 7, 1, 4, 64, True),                     # B = 7, GVA 4x
    ([0, 1, 0, 130, 1], 2, 2, 128, True),           # empty and one-token sequences, K = 128
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lens,HK,HV,K,init", CASES)
def test_prefill_matches_float64(mode, lens, HK, HV, K, init):
    q, k, v, g, beta, h0, cu = _packed_inputs(1, lens, HK=HK, HV=HV, K=K, V=K)
    spec = _spec(HK, HV, K, K, has_initial_state=init)
    o, hT, _, _ = _run(mode, q, k, v, g, beta, cu, spec, initial_state=h0 if init else None)
    ro, rs = _oracle(q, k, v, g, beta, h0 if init else None, cu)
    assert rel_err(o, ro) <= 1e-5
    assert rel_err(hT, rs) <= 1e-5


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("paired,group", [(True, 8), (True, 1),
                                          pytest.param(False, 8, marks=FULL)],
                         ids=["paired8", "paired1", "unpaired"])
def test_bf16_inputs_against_float64(mode, paired, group):
    """bf16 rows against the split state: every form of the scan's products
    (`PrefillBlockSizes.paired_halves`, `pair_group`)."""
    lens = [200, 37]
    q, k, v, g, beta, h0, cu = _packed_inputs(2, lens, HK=2, HV=4, K=64, V=64, dtype=BF16)
    spec = _spec(2, 4, 64, 64, has_initial_state=True, precise=False)
    o, hT, _, _ = _run(mode, q, k, v, g, beta, cu, spec, initial_state=h0, paired_halves=paired,
                       pair_group=group)
    assert o.dtype == BF16
    ro, rs = _oracle(q, k, v, g, beta, h0, cu)
    assert rel_err(o, ro) <= 5e-3
    assert rel_err(hT, rs) <= 5e-3


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kda", [False, pytest.param(True, marks=FULL)], ids=["gdn", "kda"])
def test_chunk_kernels_launch_order_keeps_the_bits(mode, kda):
    """`PrefillBlockSizes.heads_fastest` only orders the per-chunk programs (the prep, KDA's
    intra kernel): both orders give the same bits, through a packed batch with raw gates."""
    lens, HK, HV, K = [70, 1, 130], 1, 2, 32
    q, k, v, g, beta, h0, cu = _packed_inputs(31, lens, HK=HK, HV=HV, K=K, V=K, dtype=BF16)
    if kda:
        g = jnp.asarray(np.random.default_rng(32).standard_normal((q.shape[0], HV, K)), F32)
    spec = _spec(HK, HV, K, K, precise=False, raw_gates=True, per_channel_gate=kda,
                 gate_lower_bound=-5.0 if kda else None, has_initial_state=True)
    raw = dict(A_log=jnp.asarray([0.3, -0.2], F32),
               dt_bias=jnp.asarray(np.linspace(-0.5, 0.5, HV * K if kda else HV), F32))
    runs = [_run(mode, q, k, v, g, beta, cu, spec, heads_fastest=order, initial_state=h0, **raw)
            for order in (True, False)]
    (o1, s1, _, _), (o2, s2, _, _) = runs
    assert np.all(np.isfinite(np.asarray(o1, np.float32)))
    np.testing.assert_array_equal(np.asarray(o1, np.float32), np.asarray(o2, np.float32))
    np.testing.assert_array_equal(np.asarray(s1), np.asarray(s2))


# fp32 rows in the full matrix (the default run tames fp32 rows in
# test_tame_rows_kernel_is_tame_huge_rows_bit_for_bit)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [pytest.param(F32, marks=FULL), BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_huge_rows_equal_rows_tamed_before_the_call(mode, dtype, kda):
    """q/k rows far above the L2-norm overflow bound (squares overflow fp32), mixed with ordinary
    rows in every chunk: finite, the same bits as rows passed through `tame_huge_rows` before
    the call (the launcher tames them; a kernel change that tamed them elsewhere must keep the
    bits), and the ordinary-scale rows' results within the dtype's rounding."""
    from pallas_kernels.gdn_decode import tame_huge_rows
    lens, HK, HV, K = [70, 33], 1, 2, 32
    q, k, v, g, beta, h0, cu = _packed_inputs(4, lens, HK=HK, HV=HV, K=K, V=K, dtype=dtype)
    if kda:
        g = -jax.nn.softplus(jax.random.normal(jax.random.PRNGKey(4), (sum(lens), HV, K)))
    sizes = np.resize(np.asarray([3e38 / 4.0, 1.0, 2.0 ** 55, 1e20, 1.0], np.float32), sum(lens))
    big = jnp.asarray(sizes)[:, None, None].astype(dtype)
    spec = _spec(HK, HV, K, K, has_initial_state=True, precise=dtype == F32, per_channel_gate=kda)
    run = lambda q, k: _run(mode, q, k, v, g, beta, cu, spec, initial_state=h0)[:2]
    o, hT = run(q * big, k * big)
    assert np.all(np.isfinite(np.asarray(o, np.float32))) and np.all(np.isfinite(np.asarray(hT)))
    want_o, want_s = run(tame_huge_rows(q * big), tame_huge_rows(k * big))
    np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(want_o, np.float32))
    np.testing.assert_array_equal(np.asarray(hT), np.asarray(want_s))
    plain_o, plain_s = run(q, k)
    tol = 1e-5 if dtype == F32 else 1e-2
    assert rel_err(o, plain_o) <= tol and rel_err(hT, plain_s) <= tol

@pytest.mark.parametrize("mode", MODES)
def test_mosaic_huge_rows_equal_rows_tamed_before_the_call(mode):
    """The Mosaic GPU kernels read q and k as given, and the launcher's tamed copy
    (`tame_rows_if`, written only then) in a call that holds a huge row; the TF32 redo pass
    tames the k rows it reads itself. q/k rows far above the bound mixed with ordinary ones in
    every chunk, and value head 0 with one key direction, beta 3 and no decay (its fp16
    inverses do not hold: those chunks go through the redo pass): finite, and the same bits as
    rows tamed before the call (a call without a huge row, which reads the rows as given)."""
    from pallas_kernels.gdn_decode import tame_huge_rows
    lens, HK, HV, K = [70, 33], 1, 2, 128
    q, k, v, g, beta, h0, cu = _packed_inputs(4, lens, HK=HK, HV=HV, K=K, V=K, dtype=BF16)
    g, beta = np.array(g), np.array(beta)
    g[:, 0], beta[:, 0] = 0.0, 3.0
    k = jnp.broadcast_to(k[:1], k.shape)
    sizes = np.resize(np.asarray([3e38 / 4.0, 1.0, 2.0 ** 55, 1e20, 1.0], np.float32), sum(lens))
    big = jnp.asarray(sizes)[:, None, None].astype(BF16)
    spec = _spec(HK, HV, K, K, has_initial_state=True, precise=False)
    block = kern.PrefillBlockSizes(mosaic_scan=True, block_v=64)
    assert kern.unsupported_reason(spec, block) is None
    run = lambda q, k: kern.chunk_prefill(q, k, v, g, beta, cu, spec=spec, block=block,
                                          initial_state=h0, interpret=mode == "interpret")[:2]
    o, hT = run(q * big, k * big)
    assert np.all(np.isfinite(np.asarray(o, np.float32))) and np.all(np.isfinite(np.asarray(hT)))
    want_o, want_s = run(tame_huge_rows(q * big), tame_huge_rows(k * big))
    np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(want_o, np.float32))
    np.testing.assert_array_equal(np.asarray(hT), np.asarray(want_s))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [F32, BF16, jnp.float16], ids=["fp32", "bf16", "fp16"])
def test_tame_rows_kernel_is_tame_huge_rows_bit_for_bit(mode, dtype):
    """The launcher's one-pass Pallas tame equals `tame_huge_rows` (XLA) bit for bit on rows of
    every size class: ordinary, at and just above the 2**50 bound, squares overflowing fp32,
    the largest finite values, zeros, subnormal, and rows holding inf or NaN; a row count that
    is not a multiple of the kernel's block."""
    from pallas_kernels.gdn_decode import tame_huge_rows
    rng = np.random.default_rng(5)
    R, K = 203, 32
    finfo = jnp.finfo(dtype)
    sizes = np.array([1.0, 2.0 ** 50, 2.0 ** 50 * 1.01, 1e20, 3e38 / 4, 0.0, 1e-40, 1.0, 1.0],
                     np.float64)
    if mode == "interpret":
        # XLA's CPU backend at the suite's optimisation level 0 (conftest) flushes subnormal bf16
        # values that pass through the interpreted kernel's select; the GPU run keeps the row
        sizes[6] = 1e-30
    x = rng.standard_normal((R, K)) * np.resize(sizes, R)[:, None]
    x = np.clip(x, float(finfo.min), float(finfo.max))
    x[7, 3], x[8, 5], x[9, 0] = np.inf, np.nan, float(finfo.max)
    x = jnp.asarray(x, F32).astype(dtype).reshape(R, 1, K)
    got = kern.tame_rows(x, interpret=mode == "interpret")
    want = tame_huge_rows(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got.view(jnp.uint16 if dtype != F32 else jnp.uint32)),
                                  np.asarray(want.view(jnp.uint16 if dtype != F32 else jnp.uint32)))
    if dtype != jnp.float16:  # fp16 cannot hold a row above the bound
        assert not np.array_equal(np.asarray(got, np.float32), np.asarray(x, np.float32))
    # the Mosaic path's copy, written only when asked: three programs for the four blocks of
    # rows (one takes two in turn)
    bits = lambda a: np.asarray(a.view(jnp.uint16 if dtype != F32 else jnp.uint32))
    tamed = kern.tame_rows_if((x, -x), jnp.ones((1,), jnp.int32), num_programs=3,
                              interpret=mode == "interpret")
    np.testing.assert_array_equal(bits(tamed[0]), bits(want))
    np.testing.assert_array_equal(bits(tamed[1]), bits(tame_huge_rows(-x)))

@pytest.mark.parametrize("mode", MODES)
def test_extreme_gates_no_nan(mode):
    """-inf (a reset), -3e38, -1e4 and near-zero gates mixed inside chunks: finite and exact."""
    lens = [150, 70]
    q, k, v, g, beta, h0, cu = _packed_inputs(3, lens, HK=1, HV=2, K=32, V=32, gate="extreme")
    spec = _spec(1, 2, 32, 32, has_initial_state=True)
    o, hT, _, _ = _run(mode, q, k, v, g, beta, cu, spec, initial_state=h0)
    assert np.all(np.isfinite(np.asarray(o))) and np.all(np.isfinite(np.asarray(hT)))
    ro, rs = _oracle(q, k, v, g, beta, h0, cu)
    assert rel_err(o, ro) <= 1e-5
    assert rel_err(hT, rs) <= 1e-5


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [pytest.param(F32, marks=FULL), BF16], ids=["fp32", "bf16"])
def test_repeated_keys_with_beta_near_one(mode, dtype):
    """A prompt that repeats a few tokens: near-equal keys, beta ~ 1, gates ~ 0. The chunk's
    (I + A) is then near singular along the repeats and a series in A's powers loses digits;
    the block inverse must not."""
    lens = [130, 64]
    q, _, v, _, _, h0, cu = _packed_inputs(4, lens, HK=1, HV=2, K=32, V=32)
    rng = np.random.default_rng(4)
    base = rng.standard_normal((3, 1, 32)).astype(np.float32)
    k = base[rng.integers(0, 3, sum(lens))] + 1e-3 * rng.standard_normal((sum(lens), 1, 32))
    k = jnp.asarray(k, F32)
    g = jnp.full((sum(lens), 2), -1e-4, F32)
    beta = jnp.full((sum(lens), 2), 0.999, F32)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    spec = _spec(1, 2, 32, 32, has_initial_state=True, precise=dtype == F32)
    o, hT, _, _ = _run(mode, q, k, v, g, beta, cu, spec, initial_state=h0)
    ro, rs = _oracle(q, k, v, g, beta, h0, cu)
    tol = 1e-5 if dtype == F32 else 5e-3
    assert rel_err(o, ro) <= tol
    assert rel_err(hT, rs) <= tol


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_large_state_overwritten_and_read_back(mode, kda):
    """An initial state 20x larger than the values, overwritten (beta ~ 1, gates ~ 0) and read
    on the keys just written (q = k). Each output is then a small difference of large terms
    (the old memory read from the state, the overwrite's correction from the chunk), and each
    delta subtracts a large read of the state: a product that rounds the state, the deltas or
    KDA's W to bf16 loses digits. bf16 inputs: <= 5e-3 against float64 (KDA's output, whose
    decayed q rows are single bf16s, from a 5x state: docs/prefill.md)."""
    lens = [130, 64]
    _, k, v, g, beta, h0, cu = _packed_inputs(5, lens, HK=1, HV=2, K=32, V=32)
    q = k = k.astype(BF16)
    v = v.astype(BF16)
    g = jnp.full(g.shape + ((32,) if kda else ()), -1e-3, F32)
    beta = jnp.full_like(beta, 0.999)
    spec = _spec(1, 2, 32, 32, has_initial_state=True, precise=False, per_channel_gate=kda)
    for scale in ((5.0, 20.0) if kda else (20.0,)):
        o, hT, _, _ = _run(mode, q, k, v, g, beta, cu, spec, initial_state=scale * h0)
        ro, rs = _oracle(q, k, v, g, beta, scale * h0, cu)
        assert rel_err(hT, rs) <= 5e-3
        if not kda or scale == 5.0:
            assert rel_err(o, ro) <= 5e-3
    if kda:  # the state's error at 20x: 5.3e-3 with W in one bf16 part
        assert rel_err(hT, rs) <= 2e-3


def _both_inverses(lens, As, scratch, *, interpret):
    """One program per entry of lens: (blocked inverse, register-only inverse, scratch after)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
    C = kern.CHUNK

    def kernel(n_ref, a_ref, _, blocked_ref, plain_ref, scratch_ref):
        p = pl.program_id(0)
        n = n_ref[p]  # a loaded row count, as in the prep (a select of two Python ints here
                      # does not lower through Triton)
        blocked_ref[p] = kern._invert_unit_lower_blocked(a_ref[p], scratch_ref, p * C, 0, n,
                                                         precise=True, interpret=interpret)
        plain_ref[p] = kern._invert_unit_lower(a_ref[p], True, interpret)

    tiles = jax.ShapeDtypeStruct(As.shape, F32)
    return pl.pallas_call(
        kernel, out_shape=(tiles, tiles, jax.ShapeDtypeStruct(scratch.shape, F32)),
        grid=(len(lens),), input_output_aliases={2: 2}, interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1))(
            jnp.asarray(lens, jnp.int32), As, scratch)


def test_blocked_inverse_harness_lowers_to_triton_ir(lower_for_h200):
    C = kern.CHUNK
    jax.jit(functools.partial(_both_inverses, (64, 37), interpret=False)).trace(
        jnp.zeros((2, C, C), F32), jnp.zeros((2 * C + 5, 1, C), F32)).lower(
            lowering_platforms=("cuda",))


@pytest.mark.parametrize("mode", MODES)
def test_blocked_inverse_against_float64(mode):
    """`_invert_unit_lower_blocked` (and `_invert_unit_lower`, the register-only form) on a hard
    A alone: keys that repeat three directions with beta 0.999, as in the test above. Two
    programs: a whole chunk, and one of 37 rows whose scratch rows past 37 hold 1e30 sentinels,
    standing for the next chunk's rows, that must keep their bits."""
    C, lens = kern.CHUNK, (64, 37)
    rng = np.random.default_rng(8)
    base = rng.standard_normal((3, 32))
    k = base[rng.integers(0, 3, C)] + 1e-3 * rng.standard_normal((C, 32))
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    A = np.tril(0.999 * (k @ k.T), -1).astype(np.float32)
    As = np.stack([np.where(np.arange(C)[:, None] < n, A, 0.0) for n in lens]).astype(np.float32)
    interpret = mode == "interpret"
    scratch = jnp.full((2 * C + 5, 1, C), 1e30, F32)
    blocked, plain, scratch = (np.asarray(x) for x in _both_inverses(lens, As, scratch,
                                                                    interpret=interpret))
    tol = 1e-6 if interpret else 1e-5  # three-pass TF32 merges round a little above fp32
    for p, n in enumerate(lens):
        want = np.linalg.inv(np.eye(n) + As[p, :n, :n].astype(np.float64))
        errs = [rel_err(got[:n, :n], want) for got in (blocked[p], plain[p])]
        assert max(errs) <= tol, (p, errs)
        for got in (blocked[p], plain[p]):
            assert np.all(got[:n, n:] == 0), (p, np.abs(got[:n, n:]).max())
    assert np.all(scratch[C + lens[1]:] == 1e30), np.argwhere(scratch[C + lens[1]:] != 1e30)[:5]


def _half_inverses(As, *, interpret):
    """One program per A: (`_half_inverse_fits` of its fp16 inverse, that inverse, the one-pass
    TF32 inverse)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    def kernel(a_ref, fits_ref, half_ref, tf32_ref):
        p = pl.program_id(0)
        A = a_ref[p]
        half = kern._invert_unit_lower(A, False, interpret, half=True)
        fits_ref[p] = jnp.where(kern._half_inverse_fits(A, half), 1, 0).astype(jnp.int32)
        half_ref[p] = half
        tf32_ref[p] = kern._invert_unit_lower(A, False, interpret)

    tiles = jax.ShapeDtypeStruct(As.shape, F32)
    return pl.pallas_call(
        kernel, out_shape=(jax.ShapeDtypeStruct(As.shape[:1], jnp.int32), tiles, tiles),
        grid=(As.shape[0],), interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1))(As)


@pytest.mark.parametrize("mode", MODES)
def test_half_inverse_falls_back_where_fp16_cannot_hold_it(mode):
    """The check on the fp16 block inverse passes exactly where its operands fit fp16, and the
    inverse it keeps (fp16 where it passes, one-pass TF32 elsewhere) is within 2e-3 of float64:
    a chunk of L2-normalised keys with beta in (0, 1) and decays (kept), the repeated keys with
    beta 0.999 (kept), an entry of A above HALF_INVERSE_MAX_A with a small inverse (TF32), and a
    subdiagonal of -2, whose inverse holds 2^(i - j) up to 2^63 and overflows fp16 (TF32)."""
    C = kern.CHUNK
    rng = np.random.default_rng(9)
    lower = np.tril(np.ones((C, C)), -1)
    k = rng.standard_normal((C, 32))
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    G = np.cumsum(-np.logaddexp(0.0, rng.standard_normal(C) - 2.0))
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal(C)))
    typical = lower * beta[:, None] * (k @ k.T) * np.exp(G[:, None] - G[None, :])
    base = rng.standard_normal((3, 32))
    kr = base[rng.integers(0, 3, C)] + 1e-3 * rng.standard_normal((C, 32))
    kr /= np.linalg.norm(kr, axis=1, keepdims=True)
    repeated = lower * 0.999 * (kr @ kr.T)
    one_large = np.zeros((C, C))
    one_large[40, 3] = 2 * kern.HALF_INVERSE_MAX_A
    growing = -2.0 * np.eye(C, k=-1)
    As = np.stack([typical, repeated, one_large, growing]).astype(np.float32)
    fits, half, tf32 = (np.asarray(x) for x in _half_inverses(As, interpret=mode == "interpret"))
    assert fits.tolist() == [1, 1, 0, 0], fits
    for p in range(len(As)):
        checked = half[p] if fits[p] else tf32[p]
        assert np.all(np.isfinite(checked)), p
        want = np.linalg.inv(np.eye(C) + As[p].astype(np.float64))
        assert rel_err(checked, want) <= 2e-3, (p, rel_err(checked, want))
    assert not np.all(np.isfinite(half[3]))  # the fp16 form alone overflows there


def _chunk_t_beta_float64(k, g, beta, rows, h):
    """float64 (I + A)^-1 beta of one chunk's rows (a slice of tokens) and value head h, from
    the key rows k [T, 1, K] (one key head, no L2 norm)."""
    b = beta[rows, h].astype(np.float64)
    G = np.cumsum(g[rows, h].astype(np.float64))
    kr = np.asarray(k[rows, 0], np.float64)
    A = np.tril(b[:, None] * (kr @ kr.T) * np.exp(G[:, None] - G[None, :]), -1)
    return np.linalg.inv(np.eye(len(b)) + A) * b[None, :]


def _prep_t_beta_against_float64(mode, q, k, v, g, beta, cu):
    """GDN's prep (16-bit rows, no L2 norm: the fp16 inverse with its TF32 redo) on one key head
    (k [T, 1, K]): every chunk's T beta [T, HV, 64] (float64 numpy) checked finite and within
    2e-3 of float64's (I + A)^-1 beta; returns it."""
    T_total, HV, K = v.shape[0], v.shape[1], k.shape[2]
    spec = _spec(1, HV, K, K, use_qk_l2norm=False, precise=False)
    block = kern.PrefillBlockSizes(block_v=16)
    assert kern._half_inverse(spec, block.blocked_inverse_for(spec))
    start, length, _, lead = kern.chunk_table(cu, T_total)
    tb = kern._prep(q, k, v, jnp.asarray(g), jnp.asarray(beta), start, length, lead,
                    jnp.zeros((HV,), F32), jnp.zeros((HV,), F32), spec=spec, block=block,
                    interpret=mode == "interpret")[0]
    tb, kf = np.asarray(tb, np.float64), np.asarray(k, np.float32)
    for t0, n in zip(np.asarray(start), np.asarray(length)):
        if n == 0:
            continue
        for h in range(HV):
            rows = slice(t0, t0 + n)
            want = _chunk_t_beta_float64(kf, g, beta, rows, h)
            got = tb[rows, h, :n]
            assert np.all(np.isfinite(got)), (t0, h)
            assert rel_err(got, want) <= 2e-3, (t0, h, rel_err(got, want))
    return tb


def _repeated_key_inputs(lens, K):
    """Packed inputs (HK = 1, HV = 2; q, k, v, g, beta, cu) whose value head 0 sees one key
    repeated with beta |k|^2 = 3 and no decay, and value head 1 the same key with typical gates
    and beta below 1/4."""
    q, _, v, g, beta, _, cu = _packed_inputs(12, lens, HK=1, HV=2, K=K, V=K, dtype=BF16)
    g, beta = np.array(g), np.array(beta)
    g[:, 0], beta[:, 0] = 0.0, 0.75
    beta[:, 1] *= 0.25
    k = np.zeros((sum(lens), 1, K), np.float32)
    k[:, :, :4] = 1.0                                      # |k|^2 = 4: beta |k|^2 = 3 in head 0
    return q, jnp.asarray(k, BF16), v, g, beta, cu


@pytest.mark.parametrize("mode", MODES)
def test_prep_redoes_the_chunks_whose_fp16_inverse_overflows(mode):
    """The TF32 redo pass (`_prep_redo_kernel`) replaces T beta where the fp16 inverse did
    not fit, and leaves the rest: value head 0 sees one key repeated with beta |k|^2 = 3 and no
    decay, so (I + A)^-1 holds (-2)^(i - j) up to 2^63 (fp16's range ends at 2^16; A = 3 and
    the powers of two are exact in TF32, so the ill-conditioning costs no accuracy there); value
    head 1 sees the same key with typical gates and beta below 1/4 (|A| < 1: fp16 holds its
    inverse). Every chunk's T beta against float64; more chunk slots than one redo program
    takes (`REDO_SLOTS`), so flagged chunks lie in a full and in a partial block of slots."""
    lens = [64, 100, 1100]
    assert sum(-(-n // kern.CHUNK) for n in lens) > kern.REDO_SLOTS
    q, k, v, g, beta, cu = _repeated_key_inputs(lens, 32)
    tb = _prep_t_beta_against_float64(mode, q, k, v, g, beta, cu)
    assert np.abs(tb[:64, 0, :64]).max() > 2.0 ** 60   # the inverse that fp16 cannot hold


@pytest.mark.parametrize("mode", MODES)
def test_mosaic_prep_redoes_the_chunks_whose_fp16_inverse_overflows(mode):
    """The Mosaic GPU prep (`gdn_prefill_mgpu.prep`, through `_mosaic_prep`) flags the rows
    where its fp16 inverse may not have held, and the TF32 pass forms those chunks' T beta
    again in their slots' rows: value head 0 sees one key repeated with beta |k|^2 = 3 and no
    decay ((I + A)^-1 holds (-2)^(i - j) up to 2^63), value head 1 the same key with typical
    gates and beta below 1/4 (fp16 holds its inverse). Every chunk's T beta (hi + lo halves, by
    chunk slot) against float64; the second sequence starts off the 8-row tiles, so its chunks'
    windows hold rows of the sequences around it."""
    lens, HK, HV, K = [64, 100, 300], 1, 2, 128
    T_total = sum(lens)
    q, k, v, g, beta, cu = _repeated_key_inputs(lens, K)
    kf = np.asarray(k, np.float32)
    spec = _spec(HK, HV, K, K, use_qk_l2norm=False, precise=False)
    block = kern.PrefillBlockSizes(mosaic_scan=True, block_v=64)
    assert kern.unsupported_reason(spec, block) is None
    start, length, _, lead = kern.chunk_table(cu, T_total, kern.mgpu_scan.ALIGN)
    tb = kern._mosaic_prep(q, k, jnp.asarray(g), jnp.asarray(beta), start, length, lead,
                           jnp.zeros((HV,), F32), jnp.zeros((HV,), F32), spec=spec,
                           block=block, interpret=mode == "interpret")[0][0]
    tb = np.asarray(tb[0], np.float64) + np.asarray(tb[1], np.float64)   # [S * C, HV, C]
    C = kern.CHUNK
    for s, (t0, a, n) in enumerate(zip(np.asarray(start), np.asarray(lead), np.asarray(length))):
        if n == 0:
            continue
        for h in range(HV):
            want = _chunk_t_beta_float64(kf, g, beta, slice(t0 + a, t0 + n), h)
            got = tb[s * C + a:s * C + n, h, a:n]
            assert np.all(np.isfinite(got)), (s, h)
            assert rel_err(got, want) <= 2e-3, (s, h, rel_err(got, want))
    assert np.abs(tb[:64, 0, :64]).max() > 2.0 ** 60   # the inverse that fp16 cannot hold


@pytest.mark.parametrize("mode", MODES)
def test_mosaic_prep_programs_take_items_in_turn(mode):
    """The Mosaic GPU prep with fewer programs than (chunk slot, value head) items, each taking
    several in turn with the next one's rows fetched into its other buffers, writes what one
    program an item does, bit for bit (a chunk slot's rows from any start, GVA 2x)."""
    from pallas_kernels import gdn_prefill_mgpu as mgpu
    T, HK, HV, S = 320, 1, 2, 5
    kq, kk, kr = jax.random.split(jax.random.PRNGKey(5), 3)
    q = jax.random.normal(kq, (T, HK, 128), F32).astype(BF16)
    k = jax.random.normal(kk, (T, HK, 128), F32).astype(BF16)
    rows = 0.1 * jax.random.uniform(kr, (S, HV, mgpu.NUM_ROW_VECTORS, 64), F32)
    start = jnp.array([0, 64, 136, 200, 256], jnp.int32)
    factors = jax.random.uniform(kr, (3, HV, S * 64), F32)   # with the L2 norm, and without
    for fac in (factors, None):
        prep = functools.partial(mgpu.prep, start, q, k, rows, fac, num_v_heads=HV,
                                 aqk_dtype=F32, max_a=kern.HALF_INVERSE_MAX_A,
                                 max_t=kern.HALF_INVERSE_MAX_T, interpret=mode == "interpret")
        one_each, in_turn = prep(num_programs=None), prep(num_programs=3)
        assert len(one_each) == (3 if fac is None else 5)
        for a, b in zip(one_each, in_turn):
            assert np.all(np.isfinite(np.asarray(a, F32)))
            assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("mode", MODES)
def test_mosaic_prep_second_launch_forms_items_with_the_same_bits(mode, monkeypatch):
    """With the L2 norm the Mosaic GPU prep's first launch flags the items whose sums of squares
    may hide a huge row, and a second launch forms those again with the look at their tiles,
    in place. Every item forced through it (every row's sum of squares taken as suspect): the
    same bits as the first launch alone gives where no row is huge, and the [HUGE] flags
    written again by it (all 0: it formed every item); programs taking items in turn. The
    count of flagged rows that sends items to the second launch comes last: 0, then every row
    of every item."""
    from pallas_kernels import gdn_prefill_mgpu as mgpu
    T, HK, HV, S = 320, 1, 2, 5
    kq, kk, kr, kf = jax.random.split(jax.random.PRNGKey(12), 4)
    q = jax.random.normal(kq, (T, HK, 128), F32).astype(BF16)
    k = jax.random.normal(kk, (T, HK, 128), F32).astype(BF16)
    rows = 0.1 * jax.random.uniform(kr, (S, HV, mgpu.NUM_ROW_VECTORS, 64), F32)
    start = jnp.array([0, 64, 136, 200, 256], jnp.int32)
    factors = jax.random.uniform(kf, (3, HV, S * 64), F32) + 0.5
    prep = functools.partial(mgpu.prep, start, q, k, rows, factors, num_v_heads=HV,
                             aqk_dtype=F32, max_a=kern.HALF_INVERSE_MAX_A,
                             max_t=kern.HALF_INVERSE_MAX_T, num_programs=3,
                             interpret=mode == "interpret")
    usual = prep()
    monkeypatch.setattr(mgpu, "SUSPECT_SQUARES", 0.0)
    redone = prep()
    assert not np.any(np.asarray(usual[2][:, :, mgpu.HUGE]))
    assert int(usual[-1][0]) == 0 and int(redone[-1][0]) == S * HV * 64
    for a, b in zip(usual[:-1], redone[:-1]):
        assert np.all(np.isfinite(np.asarray(a, F32)))
        assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("mode", MODES)
def test_mosaic_prep_under_vmap_equals_its_calls_one_by_one(mode):
    """Batched, the Mosaic GPU prep with the L2 norm runs one launch that looks for huge rows in
    every item (its second launch writes in place, which `jax.vmap` cannot batch): each slice
    equals the unbatched two launches on it, bit for bit, with a huge k row in one slice; the
    count that sends the scan to tamed copies is set for that slice alone."""
    from pallas_kernels import gdn_prefill_mgpu as mgpu
    E, T, HK, HV, S = 2, 256, 1, 2, 4
    kq, kk, kr, kf = jax.random.split(jax.random.PRNGKey(13), 4)
    q = jax.random.normal(kq, (E, T, HK, 128), F32).astype(BF16)
    k = jax.random.normal(kk, (E, T, HK, 128), F32).at[1, 100].multiply(2.0 ** 60).astype(BF16)
    rows = 0.1 * jax.random.uniform(kr, (E, S, HV, mgpu.NUM_ROW_VECTORS, 64), F32)
    factors = jax.random.uniform(kf, (E, 3, HV, S * 64), F32) + 0.5
    start = jnp.array([0, 64, 128, 192], jnp.int32)
    prep = lambda q, k, rows, factors: mgpu.prep(
        start, q, k, rows, factors, num_v_heads=HV, aqk_dtype=F32, max_a=kern.HALF_INVERSE_MAX_A,
        max_t=kern.HALF_INVERSE_MAX_T, num_programs=3, interpret=mode == "interpret")
    batched = jax.jit(jax.vmap(prep))(q, k, rows, factors)
    assert np.asarray(batched[2][1, 1, :, mgpu.HUGE]).sum() == HV     # row 100: slot 1, row 36
    for e in range(E):
        one = jax.jit(prep)(q[e], k[e], rows[e], factors[e])
        for a, b in zip(batched, one):
            assert np.all(np.isfinite(np.asarray(b, F32)))
            assert np.array_equal(np.asarray(a[e]), np.asarray(b))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("launches", [1, 2])
def test_mosaic_prep_applies_the_l2_norm_and_flags_huge_rows(mode, launches):
    """With the row factors given, the Mosaic GPU prep returns them times q's and k's L2 factors
    (FQ by q's, FK and FW by k's), from the rows as `tame_rows` leaves them, and flags [HUGE]
    exactly the rows above the tame bound of each item's window (one huge k row, one huge q row
    and a row of squares above 2**100 whose entries are below the bound, which is not huge);
    its q and k are left as they were. In two launches (the second forming the items whose sums
    of squares may hide a huge row), and in the one that looks in every item (under vmap)."""
    from pallas_kernels import gdn_prefill_mgpu as mgpu
    from pallas_kernels.gdn_decode import tame_huge_rows
    T, HK, HV, S = 256, 1, 2, 3
    kq, kk, kr, kf = jax.random.split(jax.random.PRNGKey(11), 4)
    q = np.array(jax.random.normal(kq, (T, HK, 128), F32))
    k = np.array(jax.random.normal(kk, (T, HK, 128), F32))
    k[70] *= 2.0 ** 60                      # huge: item slot 1 (rows 64..127)
    q[150] *= 2.0 ** 58                     # huge: slot 2 (rows 136..199)
    k[10] = 2.0 ** 48                       # squares sum to 2**103, max below 2**50
    q, k = jnp.asarray(q, BF16), jnp.asarray(k, BF16)
    q_before, k_before = np.asarray(q).copy(), np.asarray(k).copy()
    start = jnp.array([0, 64, 136], jnp.int32)
    rows = 0.1 * jax.random.uniform(kr, (S, HV, mgpu.NUM_ROW_VECTORS, 64), F32)
    factors = jax.random.uniform(kf, (3, HV, S * 64), F32) + 0.5
    prep = lambda q, k: mgpu.prep(start, q, k, rows, factors, num_v_heads=HV, aqk_dtype=F32,
                                  max_a=kern.HALF_INVERSE_MAX_A, max_t=kern.HALF_INVERSE_MAX_T,
                                  num_programs=2, interpret=mode == "interpret")
    if launches == 2:
        aqk, tb, flags, got, tamed = prep(q, k)
    else:   # a batch of one
        aqk, tb, flags, got, tamed = (x[0] for x in jax.vmap(prep)(q[None], k[None]))
    assert int(tamed[0]) != 0
    assert np.array_equal(np.asarray(q), q_before) and np.array_equal(np.asarray(k), k_before)
    norm = lambda x: 1.0 / np.sqrt(np.sum(np.square(np.asarray(tame_huge_rows(x), np.float64)),
                                          -1)[:, 0] + kern.L2NORM_EPS)
    nq, nk = norm(q), norm(k)
    for s, t0 in enumerate(np.asarray(start)):
        window = slice(t0, t0 + 64)
        for h in range(HV):
            at = slice(s * 64, (s + 1) * 64)
            for f, n in ((mgpu.FQ, nq), (mgpu.FK, nk), (mgpu.FW, nk)):
                want = np.asarray(factors[f, h, at], np.float64) * n[window]
                np.testing.assert_allclose(np.asarray(got[f, h, at]), want, rtol=2e-6)
            huge = np.zeros(64)
            huge[[r - t0 for r in (70, 150) if t0 <= r < t0 + 64]] = 1.0
            np.testing.assert_array_equal(np.asarray(flags[s, h, mgpu.HUGE]), huge)
    for x in (aqk, tb):
        assert np.all(np.isfinite(np.asarray(x, F32)))


@pytest.mark.parametrize("mode", MODES)
def test_prep_redoes_the_chunks_whose_A_exceeds_fp16(mode):
    """A goes from the prep to `_prep_inverse_kernel` in fp16: without the L2 norm its entries
    can pass fp16's 65504 (here beta |k|^2 = 2^17 between the tokens of 2- and 3-token chunks,
    whose inverses fp32 holds), and those chunks must come out of the TF32 redo pass finite and
    right, not as inf or NaN; head 1 (beta |k|^2 = 2^-15) stays on the fp16 path."""
    lens, HK, HV, K = [2, 3, 70], 1, 2, 16
    q, k, v, g, beta, _, cu = _packed_inputs(13, lens, HK=HK, HV=HV, K=K, V=K, dtype=BF16)
    T_total = sum(lens)
    k = np.zeros((T_total, HK, K), np.float32)
    k[:, :, 0] = 256.0                                    # |k|^2 = 2^16
    k[5:, :, 0] = 1.0                                     # the 70-token sequence: |k|^2 = 1
    k = jnp.asarray(k, BF16)
    g, beta = np.zeros((T_total, HV), np.float32), np.full((T_total, HV), 2.0, np.float32)
    beta[:, 1] = 2.0 ** -31
    beta[5:, 0] = 0.5
    tb = _prep_t_beta_against_float64(mode, q, k, v, g, beta, cu)
    assert np.abs(tb[:2, 0, :2]).max() > 2.0 ** 17        # A = 2^17 there: beyond fp16


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_unnormalised_rows_beyond_fp16_range(mode, kda):
    """Without the q/k L2 norm nothing bounds the rows: keys of entries ~1e5 (beta ~ 1 / |k|^2
    keeps the recurrence tame) give q k^T and decayed k rows far beyond fp16's 65504, so the
    intermediates that go through memory in fp16 under the norm must stay fp32 here, and GDN's
    block inverse must keep its operands in range. bf16 inputs against float64."""
    lens, HK, HV, K = [90, 41], 1, 2, 32
    if kda:
        q, k, v, g, _, h0, cu = _kda_inputs(31, lens, HK=HK, HV=HV, K=K)
    else:
        q, k, v, g, _, h0, cu = _packed_inputs(31, lens, HK=HK, HV=HV, K=K, V=K)
    k = (1e5 * k).astype(BF16)
    q, v = q.astype(BF16), v.astype(BF16)
    k_sq = jnp.sum(jnp.asarray(k, F32) ** 2, axis=-1)                     # [T, HK]
    beta = jnp.repeat(0.5 / k_sq, HV // HK, axis=1)
    spec = _spec(HK, HV, K, K, has_initial_state=True, per_channel_gate=kda,
                 use_qk_l2norm=False, precise=False)
    assert not kern._bounded_by_one(spec)
    o, hT, _, _ = _run(mode, q, k, v, g, beta, cu, spec, initial_state=h0)
    assert np.all(np.isfinite(np.asarray(o, F32))) and np.all(np.isfinite(np.asarray(hT)))
    ro, rs = _oracle(q, k, v, g, beta, h0, cu, l2=False)
    assert rel_err(o, ro) <= 5e-3
    assert rel_err(hT, rs) <= 5e-3


@pytest.mark.parametrize("mode", MODES)
def test_raw_gates_in_kernel(mode):
    lens = [90, 40]
    HK, HV, K = 1, 2, 32
    q, k, v, a, b, h0, cu = _packed_inputs(4, lens, HK=HK, HV=HV, K=K, V=K)
    rng = np.random.default_rng(5)
    a = jnp.asarray(rng.standard_normal(a.shape) * 2, F32)
    b = jnp.asarray(rng.standard_normal(b.shape), F32)
    A_log = jnp.asarray(rng.standard_normal(HV), F32)
    dt_bias = jnp.asarray(rng.standard_normal(HV), F32)
    spec = _spec(HK, HV, K, K, has_initial_state=True, raw_gates=True)
    o, hT, _, _ = _run(mode, q, k, v, a, b, cu, spec, initial_state=h0, A_log=A_log,
                       dt_bias=dt_bias)
    g, beta = ref.gdn_gate(a, A_log, dt_bias), ref.gdn_beta(b)
    ro, rs = _oracle(q, k, v, g, beta, h0, cu)
    assert rel_err(o, ro) <= 1e-5
    assert rel_err(hT, rs) <= 1e-5


@pytest.mark.parametrize("mode", MODES)
def test_boundary_states_equal_split_calls(mode):
    """The state after every chunk equals the final state of a call that stops there."""
    lens = [150, 64, 10]
    HK, HV, K = 1, 2, 32
    q, k, v, g, beta, h0, cu = _packed_inputs(6, lens, HK=HK, HV=HV, K=K, V=K)
    spec = _spec(HK, HV, K, K, has_initial_state=True, boundary_states=True)
    _, hT, hb, (_, _, first) = _run(mode, q, k, v, g, beta, cu, spec, initial_state=h0)
    cu_np = np.asarray(cu)
    for n, length in enumerate(lens):
        for c in range(-(-length // kern.CHUNK)):
            end = min((c + 1) * kern.CHUNK, length)
            a = cu_np[n]
            _, want = numpy_delta_rule(q[None, a:a + end], k[None, a:a + end], v[None, a:a + end],
                                       g[None, a:a + end], beta[None, a:a + end], h0[n:n + 1],
                                       l2=True)
            assert rel_err(hb[int(first[n]) + c], want[0]) <= 1e-5, (n, c)
        assert np.array_equal(np.asarray(hb[int(first[n]) + c]), np.asarray(hT[n]))


@pytest.mark.parametrize("mode", MODES)
def test_pool_slots_in_place(mode):
    """Initial states come from the named pool slots and the final states land there; padding
    (-1, or past the pool) reads nothing, writes nothing and outputs zeros; other slots keep
    their bits."""
    lens = [70, 5, 33, 20]
    HK, HV, K = 1, 2, 32
    q, k, v, g, beta, h0, cu = _packed_inputs(7, lens, HK=HK, HV=HV, K=K, V=K)
    P = 6
    pool = np.full((P, HV, K, K), 1e30, np.float32)
    slots = np.array([4, -1, 1, 9], np.int32)
    pool[4], pool[1] = h0[0], h0[2]
    before = pool.copy()
    spec = _spec(HK, HV, K, K, pooled=True)
    o, new_pool, _, _ = _run(mode, q, k, v, g, beta, cu, spec, pool=jnp.asarray(pool),
                             slots=jnp.asarray(slots))
    new_pool, o = np.asarray(new_pool), np.asarray(o)
    cu_np = np.asarray(cu)
    for n, slot in enumerate(slots):
        a, b = cu_np[n], cu_np[n + 1]
        if 0 <= slot < P:
            ro, rs = numpy_delta_rule(q[None, a:b], k[None, a:b], v[None, a:b], g[None, a:b],
                                      beta[None, a:b], h0[n:n + 1], l2=True)
            assert rel_err(o[a:b], ro[0]) <= 1e-5
            assert rel_err(new_pool[slot], rs[0]) <= 1e-5
        else:
            assert np.all(o[a:b] == 0)
    untouched = [s for s in range(P) if s not in (4, 1)]
    assert np.array_equal(new_pool[untouched], before[untouched])


# --------------------------------------------------------------------------- Mosaic GPU scan

MOSAIC_CASES = [  # lens, HK, HV, V, initial state, gate, L2 norm
    # starts at multiples of 8: partial chunks, an empty and an 8-token sequence, a one-token
    # one last, GVA 2x
    ([72, 8, 0, 136, 1], 1, 2, 64, True, "normal", True),
    # starts off the 8-row tiles (37, 38, 138, 141; odd ones: the wide form only): first chunks
    # that begin with the previous sequences' rows, a one-token sequence inside one tile, an empty one, a 63-token one that
    # spans two chunks from its rounded-down start
    ([37, 1, 100, 0, 3, 63], 1, 2, 64, True, "normal", True),
    # B = 3 dense, whole chunks; rows normalised beforehand (the intra-chunk matrix in fp32)
    ([64, 64, 64], 2, 4, 128, False, "normal", False),
    ([24] * 7, 1, 4, 64, True, "extreme", True),            # B = 7, GVA 4x, resets, huge decays
]


def test_bf16_halves_hold_16_bits():
    """The kernels' fp32 operands as two bf16 halves: hi is x with its low 16 bits cleared (so
    exact in bf16, never above |x|, never inf), and hi + lo holds x to 2^-16 relative. Values
    over fp32's normal range, signs, zeros and the largest finite values."""
    from pallas_kernels import gdn_prefill_mgpu as mgpu
    rng = np.random.default_rng(7)
    mags = np.exp(rng.uniform(np.log(1e-30), np.log(1e30), 20000))
    x = np.concatenate([mags * rng.choice([-1.0, 1.0], mags.shape), [0.0, -0.0, 3.4e38, -3.4e38,
                                                                     1.0, -1.5]]).astype(np.float32)
    hi, lo = (np.asarray(h.astype(F32), np.float64) for h in mgpu.split_bf16(x))
    bits = x.view(np.uint32)
    assert np.array_equal(np.asarray(hi, np.float32).view(np.uint32), bits & np.uint32(0xFFFF0000))
    assert np.all(np.isfinite(hi)) and np.all(np.isfinite(lo))
    x64 = x.astype(np.float64)
    assert np.all(np.abs(hi + lo - x64) <= 2.0 ** -16 * np.abs(x64))


def _even_starts(lens) -> bool:
    """Whether every sequence of lengths lens starts at an even token (the narrow form's need)."""
    return not (np.cumsum([0] + list(lens))[:-1] % 2).any()


# the wide form on every case, the narrow one on the even-start cases (on a CPU by default the
# wide form on the second and third and the narrow one on the first: the rest are `full`)
MOSAIC_FORMS = ([pytest.param(64, *case, id=f"wide-{i}", marks=[] if i in (1, 2) else [FULL])
                 for i, case in enumerate(MOSAIC_CASES)]
                + [pytest.param(32, *case, id=f"narrow-{i}", marks=[FULL] if i else [])
                   for i, case in enumerate(MOSAIC_CASES)
                   if _even_starts(case[0])])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("block_v,lens,HK,HV,V,init,gate,l2", MOSAIC_FORMS)
def test_mosaic_scan_against_float64(mode, block_v, lens, HK, HV, V, init, gate, l2):
    """The Mosaic GPU scan (`PrefillBlockSizes.mosaic_scan`, both forms: S^T [64, K] and
    S [K, 32]; compiled: three warpgroups, interpreted: one, with plain dots) through
    `chunk_prefill`, bf16 inputs against float64.
    Its output is a fresh buffer: a row it failed to write holds what the memory held before
    (on the GPU, earlier calls' data), which the finiteness and error checks catch."""
    even = _even_starts(lens)
    q, k, v, g, beta, h0, cu = _packed_inputs(3, lens, HK=HK, HV=HV, K=128, V=V, dtype=BF16,
                                              gate=gate)
    if not l2:
        unit = lambda x: (x / jnp.linalg.norm(x.astype(F32), axis=-1, keepdims=True)).astype(BF16)
        q, k = unit(q), unit(k)
    spec = _spec(HK, HV, 128, V, has_initial_state=init, precise=False, use_qk_l2norm=l2,
                 even_starts=even)
    block = kern.PrefillBlockSizes(mosaic_scan=True, block_v=block_v)
    assert kern.unsupported_reason(spec, block) is None
    o, hT, _, _ = kern.chunk_prefill(q, k, v, g, beta, cu, spec=spec, block=block,
                                     initial_state=h0 if init else None,
                                     interpret=mode == "interpret")
    ro, rs = _oracle(q, k, v, g, beta, h0 if init else None, cu, l2=l2)
    assert o.dtype == BF16 and hT.dtype == F32
    assert np.isfinite(np.asarray(o, np.float32)).all()
    assert rel_err(o, ro) <= 5e-3
    assert rel_err(hT, rs) <= 5e-5


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("block_v", [64, 32])
def test_mosaic_scan_nan_in_one_sequence_leaves_the_others_bit_identical(mode, block_v):
    """Packed sequences share the Mosaic prep's and scan's chunk windows (a chunk starts at its
    sequence's start rounded down to 8 rows and runs on past its end): NaN in q or k rows of
    one sequence inside another's windows (its last rows before the next start, the next
    sequence's first row) leaves the other sequences' outputs and final states bit-identical,
    in both scan forms. (Zero factors on those rows would keep a NaN in a product.)"""
    lens = [38, 62, 50]                      # the second sequence's windows hold rows of both
    q, k, v, g, beta, h0, cu = _packed_inputs(13, lens, HK=1, HV=2, K=128, V=64, dtype=BF16)
    spec = _spec(1, 2, 128, 64, has_initial_state=True, precise=False,
                 even_starts=_even_starts(lens))
    block = kern.PrefillBlockSizes(mosaic_scan=True, block_v=block_v)
    assert kern.unsupported_reason(spec, block) is None

    def call(q, k):
        o, hT, _, _ = kern.chunk_prefill(q, k, v, g, beta, cu, spec=spec, block=block,
                                         initial_state=h0, interpret=mode == "interpret")
        return np.asarray(o, np.float32), np.asarray(hT)

    o, hT = call(q, k)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(hT))
    second = slice(38, 100)
    for name, row in (("k", 35), ("k", 100), ("q", 37), ("q", 100)):
        x = (q if name == "q" else k).at[row, 0, 5].set(jnp.nan)
        o_nan, hT_nan = call(x, k) if name == "q" else call(q, x)
        np.testing.assert_array_equal(o_nan[second], o[second], err_msg=f"{name} row {row}")
        np.testing.assert_array_equal(hT_nan[1], hT[1], err_msg=f"{name} row {row}")


@pytest.mark.parametrize("mode", MODES)
def test_front_door_batch_rows_stay_apart_with_nan(mode):
    """A dense bf16 batch at K = 128 (the Mosaic prefill by default on the GPU), T not a
    multiple of 8: NaN in one batch row's last or first k row leaves the other rows' outputs
    and final states bit-identical."""
    import gdn_jax
    B, T, HK, HV, K = 3, 50, 1, 2, 128
    ks = jax.random.split(jax.random.PRNGKey(17), 5)
    q, k = (jax.random.normal(x, (B, T, HK, K), BF16) for x in ks[:2])
    v = jax.random.normal(ks[2], (B, T, HV, K), BF16)
    g = jax.nn.log_sigmoid(jax.random.normal(ks[3], (B, T, HV)) + 3.0)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, HV)))

    def call(k):
        o, s = gdn_jax.gated_delta_rule(q, k, v, g, beta, output_final_state=True,
                                        use_qk_l2norm=True, impl="pallas",
                                        interpret=mode == "interpret")
        return np.asarray(o, np.float32), np.asarray(s)

    o, s = call(k)
    for row_of_batch, t in ((0, T - 1), (2, 0)):
        o_nan, s_nan = call(k.at[row_of_batch, t, 0, 3].set(jnp.nan))
        np.testing.assert_array_equal(o_nan[1], o[1])
        np.testing.assert_array_equal(s_nan[1], s[1])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("block_v,pool_dtype,lens", [
    pytest.param(64, F32, [70, 5, 33, 20], id="wide-f32"),
    pytest.param(64, BF16, [70, 5, 33, 20], id="wide-bf16", marks=FULL),
    # the narrow form takes even starts
    pytest.param(32, F32, [70, 6, 32, 21], id="narrow-f32", marks=FULL)])
def test_mosaic_scan_pool_slots_in_place(mode, block_v, pool_dtype, lens):
    """The Mosaic GPU scan (both forms) with a pool: initial states from the named slots, final
    states into them (one rounding to the pool's dtype); padding slots (-1, or past the pool)
    read and write nothing and their sequences' outputs are zeros; other slots keep their
    bits."""
    HK, HV, V = 1, 2, 64
    q, k, v, g, beta, h0, cu = _packed_inputs(7, lens, HK=HK, HV=HV, K=128, V=V, dtype=BF16)
    P = 6
    pool = np.full((P, HV, 128, V), 1e30, np.float32)
    slots = np.array([4, -1, 1, 9], np.int32)
    pool[4], pool[1] = h0[0], h0[2]
    pool = jnp.asarray(pool).astype(pool_dtype)
    before = np.asarray(pool.astype(F32))  # (the pool is donated to the call)
    h0_used = before[[4, 4, 1, 1]]  # the initial states as the pool holds them
    even = _even_starts(lens)
    spec = _spec(HK, HV, 128, V, pooled=True, precise=False, even_starts=even)
    block = kern.PrefillBlockSizes(mosaic_scan=True, block_v=block_v)
    assert kern.unsupported_reason(spec, block) is None
    o, new_pool, _, _ = kern.chunk_prefill(q, k, v, g, beta, cu, spec=spec, block=block,
                                           pool=pool, slots=jnp.asarray(slots),
                                           interpret=mode == "interpret")
    assert new_pool.dtype == pool_dtype
    ro, rs = _oracle(q, k, v, g, beta, h0_used, cu)
    new_pool, o = np.asarray(new_pool.astype(F32)), np.asarray(o, np.float32)
    cu_np = np.asarray(cu)
    for n, slot in enumerate(slots):
        a, b = cu_np[n], cu_np[n + 1]
        if 0 <= slot < P:
            assert rel_err(o[a:b], ro[a:b]) <= 5e-3
            assert rel_err(new_pool[slot], rs[n]) <= (5e-5 if pool_dtype == F32 else 5e-3)
        else:
            assert np.all(o[a:b] == 0)
    untouched = [s for s in range(P) if s not in (4, 1)]
    assert np.array_equal(new_pool[untouched], before[untouched])


# Mosaic GPU's interpreter runs a kernel's warpgroups as threads, each blocking one of XLA's CPU
# client threads while it waits at a barrier: the client needs a thread for every simulated
# warpgroup (and the bulk copies') or the run stalls. NPROC sets that count; it is read once, when
# the client starts, hence a process of its own.
_WARPGROUP_THREADS = "16"


def _scans_with_their_warpgroups():
    """Run by `test_mosaic_scans_with_their_warpgroups_in_the_interpreter`, in a process of its
    own: each form of the Mosaic scans through `chunk_prefill` in the interpreter, once with the
    warpgroups the GPU runs and once with one; prints a line a form."""
    from pallas_kernels import gdn_prefill_mgpu as mgpu
    launchers = {name: getattr(mgpu, name) for name in ("scan", "kda_scan")}
    warp_specialized = [False]

    def launcher(name):
        def launch(*args, **kw):
            return launchers[name](*args, **{**kw, "warp_specialized": warp_specialized[0]})
        return launch

    for name in launchers:
        setattr(mgpu, name, launcher(name))
    # three chunks in the first sequence (the copy warpgroup waits on a stage's release from
    # the third), an empty one (a program with no chunk), cut chunks; GDN's narrow form takes
    # even starts, KDA's scan starts at whole chunks
    for kind, block_v, lens in (("gdn", 64, [150, 0, 70, 2]), ("gdn", 32, [150, 0, 70, 2]),
                                ("kda", 64, [128, 0, 70]), ("kda", 32, [128, 0, 70])):
        if kind == "gdn":
            q, k, v, g, beta, h0, cu = _packed_inputs(3, lens, HK=1, HV=2, K=128, V=128,
                                                      dtype=BF16)
            spec = _spec(1, 2, 128, 128, has_initial_state=True, precise=False,
                         even_starts=_even_starts(lens))
            block = kern.PrefillBlockSizes(mosaic_scan=True, block_v=block_v)
        else:
            q, k, v, g, beta, h0, cu = _kda_inputs(5, lens, HK=1, HV=2, K=128, dtype=BF16)
            spec = _spec(1, 2, 128, 128, has_initial_state=True, per_channel_gate=True,
                         precise=False, aligned_chunks=True)
            block = kern.PrefillBlockSizes(block_v=block_v, block_k=32, mosaic_kda_prep=True,
                                           mosaic_kda_scan=True)
        assert kern.unsupported_reason(spec, block) is None
        runs = []
        for ws in (False, True):
            warp_specialized[0] = ws
            o, hT, _, _ = kern.chunk_prefill(q, k, v, g, beta, cu, spec=spec, block=block,
                                             initial_state=h0, interpret=True)
            runs.append((np.asarray(o, F32), np.asarray(hT)))
        (o1, s1), (o, s) = runs
        ro, rs = _oracle(q, k, v, g, beta, h0, cu)
        np.testing.assert_array_equal(o, o1)
        np.testing.assert_array_equal(s, s1)
        assert rel_err(o, ro) <= 5e-3 and rel_err(s, rs) <= 5e-5
        print(f"form {kind} block_v={block_v}: bit-identical, o {rel_err(o, ro):.1e}, "
              f"state {rel_err(s, rs):.1e} from float64", flush=True)


def test_mosaic_scans_with_their_warpgroups_in_the_interpreter():
    """The Mosaic scans as the GPU runs them, their warpgroups concurrent in Mosaic GPU's
    interpreter (GDN's chain, output and copy warpgroups, KDA's chain and output; both forms of
    each), on packed sequences with an empty one, cut chunks and initial states: outputs and
    final states bit-identical to the one-warpgroup form's (which the other interpret-mode
    tests check), within bf16 bounds of float64. The interpreter checks the barrier protocol
    as it runs: every phase of a barrier waited on by each warpgroup that waits on it, no
    arrival pending at the end; a deadlock fails by the timeout. (Its race detector is off:
    it reports a write through one view of the output staging against a bulk store's read
    through the other view of the other buffer, as it compares a union's views whole, and it
    asks for a proxy fence between the output warpgroup's reads of a stage and the bulk copy
    that refills it once the stage's barrier releases it.)"""
    import os
    import subprocess
    import sys
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "NPROC": _WARPGROUP_THREADS, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([tests, os.path.dirname(tests),
                                          os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-c",
         "import test_prefill_kernels as t; t._scans_with_their_warpgroups()"],
        cwd=tests, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-8000:]
    assert run.stdout.count("bit-identical") == 4, run.stdout


def test_mosaic_scan_lowers_for_hopper():
    """Both forms of the Mosaic GPU scan (wide and narrow), with three warpgroups and with one,
    and the Mosaic GPU prep lower through Mosaic GPU (layout inference included) for CUDA
    without a GPU; only the compile to machine code needs the device."""
    from pallas_kernels import gdn_prefill_mgpu as mgpu
    T, HK, HV, K, V = 200, 2, 4, 128, 128
    x, y = jnp.ones((T, HK, K), BF16), jnp.ones((T, HV, V), BF16)
    S = 5                                  # chunk slots: the prep's rows are by slot
    halves = jnp.ones((2, S * 64, HV, 64), BF16)
    aqk = jnp.ones((S * 64, HV, 64), jnp.float16)
    cu = jnp.array([0, 64, T], jnp.int32)
    for ws, narrow in itertools.product((False, True), (False, True)):
        f = jax.jit(functools.partial(mgpu.scan, num_v_heads=HV, num_k_heads=HK,
                                      has_initial_state=True, narrow=narrow, warp_specialized=ws))
        exported = jax.export.export(f, platforms=["cuda"])(
            cu, jnp.array([1, 0], jnp.int32), jnp.array([0, 1], jnp.int32),
            jnp.array([1, 0], jnp.int32), jnp.ones((S, HV)),
            x, x, y, halves, aqk, jnp.ones((3, HV, S * 64)), jnp.ones((2, HV, V, K)))
        assert "mosaic_gpu" in exported.mlir_module()
    # the prep with and without the L2 norm (the row factors it applies the norm to)
    for aqk_dtype, factors in ((jnp.float16, jnp.ones((3, HV, S * 64))), (F32, None)):
        f = jax.jit(functools.partial(mgpu.prep, num_v_heads=HV, aqk_dtype=aqk_dtype,
                                      max_a=kern.HALF_INVERSE_MAX_A,
                                      max_t=kern.HALF_INVERSE_MAX_T))
        exported = jax.export.export(f, platforms=["cuda"])(
            jnp.zeros((S,), jnp.int32), x, x, jnp.ones((S, HV, mgpu.NUM_ROW_VECTORS, 64)),
            factors)
        assert "mosaic_gpu" in exported.mlir_module()
    # KDA's prep with W and U (token rows a multiple of 8, as its launcher gives them), k k^T
    # fp32 or fp16 (one item a program, and programs taking several items in turn)
    for kk_dtype, num_programs in itertools.product((F32, F16), (None, 3)):
        f = jax.jit(functools.partial(mgpu.kda_prep, max_a=kern.HALF_INVERSE_MAX_A,
                                      max_t=kern.HALF_INVERSE_MAX_T, num_programs=num_programs))
        exported = jax.export.export(f, platforms=["cuda"])(
            jnp.zeros((S,), jnp.int32), jnp.full((S,), 64, jnp.int32),
            jnp.ones((T, HV, 64), kk_dtype), jnp.ones((2, T, HV, K), BF16), y,
            jnp.ones((S, HV, 64)))
        assert "mosaic_gpu" in exported.mlir_module()
    # ... and its T beta form (only k k^T and beta in), k k^T fp32 with programs in turn
    f = jax.jit(functools.partial(mgpu.kda_prep, max_a=kern.HALF_INVERSE_MAX_A,
                                  max_t=kern.HALF_INVERSE_MAX_T, num_programs=3, t_beta=True))
    exported = jax.export.export(f, platforms=["cuda"])(
        jnp.zeros((S,), jnp.int32), jnp.full((S,), 64, jnp.int32), jnp.ones((T, HV, 64), F32),
        None, None, jnp.ones((S, HV, 64)))
    assert "mosaic_gpu" in exported.mlir_module()
    # KDA's scan (rows by token, T beta by slot, starts multiples of 64), both forms, aqk fp16
    # or fp32, with and without an initial state
    for narrow, aqk_dtype, init in ((False, F16, True), (True, F32, False), (False, F32, False),
                                    (True, F16, True)):
        f = jax.jit(functools.partial(mgpu.kda_scan, num_v_heads=HV, has_initial_state=init,
                                      narrow=narrow))
        exported = jax.export.export(f, platforms=["cuda"])(
            jnp.array([0, 128, T], jnp.int32), jnp.array([0, 1], jnp.int32),
            jnp.array([0, 2], jnp.int32), jnp.ones((2,), jnp.int32), jnp.ones((S, HV, K)),
            jnp.ones((T, HV, K), BF16), jnp.ones((2, T, HV, K), BF16),
            jnp.ones((2, T, HV, K), BF16), y, halves, jnp.ones((T, HV, 64), aqk_dtype),
            jnp.ones((2, HV, V, K)))   # (V = K)
        assert "mosaic_gpu" in exported.mlir_module()


def test_mosaic_scan_dispatch_rule():
    """Where the default blocks take the Mosaic GPU scan, and why not elsewhere."""
    gdn = _spec(16, 32, 128, 128, precise=False)
    pick = lambda spec, n, dtype=BF16: kern.PrefillBlockSizes.get_default(spec, n, dtype).mosaic_scan
    width = lambda spec, n: kern.PrefillBlockSizes.get_default(spec, n, BF16).block_v
    # the wide form (64 columns) from MOSAIC_WIDE_MIN_PROGRAMS of its programs, else the narrow
    # one where the starts are even, else the Triton scan
    n_wide = kern.MOSAIC_WIDE_MIN_PROGRAMS // (32 * 2)  # HV = 32, V = 128: 2 programs a pair
    even = _spec(16, 32, 128, 128, precise=False, even_starts=True)
    assert pick(even, 1) and pick(even, n_wide) and pick(gdn, n_wide) and pick(gdn, 64)
    assert (width(even, 1), width(even, n_wide - 1), width(even, n_wide)) == (32, 32, 64)
    assert not pick(gdn, n_wide - 1)
    pooled = _spec(16, 32, 128, 128, precise=False, even_starts=True, pooled=True)
    assert (width(pooled, 1), width(pooled, n_wide)) == (32, 64) and pick(pooled, 1)
    narrow = kern.PrefillBlockSizes(mosaic_scan=True, block_v=32)
    assert "even_starts" in kern.unsupported_reason(gdn, narrow)
    assert kern.unsupported_reason(pooled, narrow) is None
    assert kern.unsupported_reason(even, narrow) is None
    assert kern.unsupported_reason(gdn, kern.PrefillBlockSizes(mosaic_scan=True, block_v=16))
    assert not pick(gdn, 8, jnp.float16) and not pick(gdn, 8, None)
    for spec, word in ((_spec(16, 32, 64, 64, precise=False), "head_k_dim"),
                       (_spec(16, 32, 128, 128, precise=False, per_channel_gate=True), "KDA"),
                       (_spec(16, 32, 128, 128, precise=False, boundary_states=True),
                        "boundary"),
                       (_spec(16, 32, 128, 128), "bf16")):
        assert not pick(spec, 8)
        assert word in kern.unsupported_reason(spec, kern.PrefillBlockSizes(mosaic_scan=True))
    # the Mosaic GPU prep has one inverse: the Triton prep's choice of form does not apply
    assert kern.unsupported_reason(
        gdn, kern.PrefillBlockSizes(mosaic_scan=True, blocked_inverse=True)) is None


def _aligned(lens) -> bool:
    """Whether every sequence of a packed call starts at a multiple of the chunk."""
    return all(int(x) % kern.CHUNK == 0 for x in np.cumsum([0] + list(lens))[:-1])


def _aligned_kda_inputs(seed, lens, HK, HV, gate, K=128):
    """KDA bf16 inputs for calls whose sequences start at multiples of 64: (q, k, v, g, b, h0,
    cu) as `_kda_inputs` gives them, then the raw gate's keywords (A_log, dt_bias; none for g
    given), its lower bound, and the gates and beta the float64 oracle takes. gate: None (g
    given), "softplus" or a lower bound (g and b then hold raw projections)."""
    q, k, v, g, b, h0, cu = _kda_inputs(seed, lens, HK=HK, HV=HV, K=K, dtype=BF16)
    assert _aligned(lens)
    if gate is None:
        return q, k, v, g, b, h0, cu, {}, None, g, b
    rng = np.random.default_rng(seed + 1)
    g = jnp.asarray(2 * rng.standard_normal((sum(lens), HV, K)), F32)
    kw = dict(A_log=jnp.asarray(rng.standard_normal(HV), F32),
              dt_bias=jnp.asarray(rng.standard_normal(HV * K), F32))
    lb = None if gate == "softplus" else gate
    gates = ref.kda_gate(g, kw["A_log"], kw["dt_bias"].reshape(HV, K), lower_bound=lb)
    return q, k, v, g, b, h0, cu, kw, lb, gates, ref.gdn_beta(b)


def _aligned_kda_calls(mode, seed, lens, HK, HV, gate, init, blocks):
    """The KDA call on `_aligned_kda_inputs(seed, ...)` (bf16, K = V = 128, every start a
    multiple of 64; with an initial state where init) with each of blocks, each first checked
    by `unsupported_reason`, and the float64 oracle's: ([(o, final state) a block], (o, final
    states))."""
    K = 128
    q, k, v, g, b, h0, cu, kw, lb, gates, beta = _aligned_kda_inputs(seed, lens, HK, HV, gate)
    spec = _spec(HK, HV, K, K, has_initial_state=init, per_channel_gate=True, precise=False,
                 raw_gates=gate is not None, gate_lower_bound=lb, aligned_chunks=True)
    h0 = h0 if init else None
    outs = []
    for block in blocks:
        assert kern.unsupported_reason(spec, block) is None
        outs.append(kern.chunk_prefill(q, k, v, g, b, cu, spec=spec, block=block,
                                       initial_state=h0, interpret=mode == "interpret",
                                       **kw)[:2])
    return outs, _oracle(q, k, v, gates, beta, h0, cu)


# KDA's prep in Mosaic GPU: lens (every start a multiple of 64: a last chunk short of the
# arrays' rows, an empty sequence), HK, HV, gate form (None: g given; "softplus" or a lower
# bound: raw projections)
MOSAIC_KDA_PREP_CASES = [
    pytest.param([300], 1, 2, None, marks=FULL),
    ([64, 0, 64, 100], 2, 4, "softplus"),
    pytest.param([128, 70], 1, 2, -5.0, marks=FULL),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lens,HK,HV,gate", MOSAIC_KDA_PREP_CASES)
def test_mosaic_kda_prep_against_float64(mode, lens, HK, HV, gate):
    """KDA with W and U from the Mosaic GPU prep (`PrefillBlockSizes.mosaic_kda_prep`): bf16
    inputs against float64 within 5e-3, and within 1e-3 (output) of the Triton prep's call,
    for g given and for both raw gate forms, GVA, an initial state."""
    blocks = [kern.PrefillBlockSizes(block_v=32, block_k=32, mosaic_kda_prep=mosaic)
              for mosaic in (True, False)]
    ((o, hT), triton), (ro, rs) = _aligned_kda_calls(mode, 51, lens, HK, HV, gate, True, blocks)
    assert np.all(np.isfinite(np.asarray(o, F32))) and np.all(np.isfinite(np.asarray(hT)))
    assert rel_err(o, ro) <= 5e-3
    assert rel_err(hT, rs) <= 5e-4
    assert rel_err(o, triton[0]) <= 1e-3
    assert rel_err(hT, triton[1]) <= 1e-4


# KDA's scan in Mosaic GPU: lens (starts multiples of 64; a partial last chunk, empty and
# one-token sequences), HK, HV, gate form as above, initial state, block_v (64: the wide form,
# 32: the narrow one; the pool test below takes the wide form)
MOSAIC_KDA_SCAN_CASES = [
    ([64, 0, 64, 100], 2, 4, "softplus", True, 32),
    ([128, 70], 1, 2, -5.0, True, 64),
    pytest.param([64, 0, 100], 1, 2, "softplus", False, 64, marks=FULL),
    pytest.param([128, 70], 1, 2, -5.0, False, 64, marks=FULL),
    pytest.param([64, 1], 1, 1, None, True, 64, marks=FULL),
    pytest.param([64, 1], 1, 1, None, False, 32, marks=FULL),
    pytest.param([128, 70], 1, 2, -5.0, True, 32, marks=FULL),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lens,HK,HV,gate,init,block_v", MOSAIC_KDA_SCAN_CASES)
def test_mosaic_kda_scan_against_float64(mode, lens, HK, HV, gate, init, block_v):
    """KDA's state scan in Mosaic GPU (`PrefillBlockSizes.mosaic_kda_scan`, after the Mosaic
    prep's T beta), both forms: bf16 inputs against float64, the output within 5e-3 and the
    final state within 5e-5 (bf16 halves on both sides of every product; compiled on the H200
    it came within 1.4e-5 to 2.2e-5, interpret mode within 1.3e-5; the Triton scan's
    k e^{G_C - G} in fp16 and one-pass TF32 leave up to ~2e-4), and the output within 1e-3 of
    the Triton scan's call."""
    blocks = [kern.PrefillBlockSizes(block_v=block_v, block_k=32, mosaic_kda_prep=True,
                                     mosaic_kda_scan=mosaic)
              for mosaic in (True, False)]
    ((o, hT), triton), (ro, rs) = _aligned_kda_calls(mode, 53, lens, HK, HV, gate, init, blocks)
    assert o.dtype == BF16 and hT.dtype == F32
    assert np.all(np.isfinite(np.asarray(o, F32))) and np.all(np.isfinite(np.asarray(hT)))
    assert rel_err(o, ro) <= 5e-3
    assert rel_err(hT, rs) <= 5e-5
    assert rel_err(o, triton[0]) <= 1e-3


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("narrow", [False, True])
def test_mosaic_kda_scan_rows_past_the_tokens_may_hold_anything(mode, narrow):
    """The Mosaic KDA scan's e^G k and v rows past the last token (the array's rows rounded up
    to whole 8-row tiles; the intra kernel leaves e^G k's there unwritten) may hold anything:
    with NaN there the outputs and final states are bit-identical to those with zeros there,
    in both forms (0 x NaN in a product would be NaN)."""
    from pallas_kernels import gdn_prefill_mgpu as mgpu
    HV, K, C = 2, 128, 64
    cu = np.array([0, 64, 164], np.int32)          # the second sequence ends 36 rows into a chunk
    T, rows = int(cu[-1]), 168                      # 168: whole 8-row tiles
    slots = 1 + 2                                   # chunk slots: one, then two
    ks = iter(jax.random.split(jax.random.PRNGKey(61), 12))
    normal = lambda shape, s=1.0: s * jax.random.normal(next(ks), shape, F32)
    halves = lambda x: jnp.stack(mgpu.split_bf16(x))
    qd = normal((rows, HV, K), 0.1).astype(BF16)
    kd = halves(normal((rows, HV, K), 0.1))
    ek = halves(normal((rows, HV, K), 0.1))
    v = normal((rows, HV, K)).astype(BF16)
    # T beta lower-triangular per chunk slot, by slot rows [slots * C, HV, C]
    tb = halves(jnp.tril(normal((slots, HV, C, C), 0.1)).transpose(0, 2, 1, 3).reshape(
        slots * C, HV, C))
    aqk = normal((rows, HV, C), 0.1).astype(jnp.float16)
    decay = jax.nn.sigmoid(normal((slots, HV, K)) + 3.0)
    h0 = normal((2, HV, K, K))
    past = (jnp.arange(rows) >= T)[:, None, None]
    # the other rows past the tokens, as the intra kernel writes them: zeros
    qd, kd, aqk = (jnp.where(past, 0, x).astype(x.dtype) for x in (qd, kd, aqk))

    def call(fill):
        ek_f = jnp.where(past[None], fill, ek).astype(BF16)
        v_f = jnp.where(past, fill, v).astype(BF16)
        return mgpu.kda_scan(jnp.asarray(cu), jnp.array([1, 0], jnp.int32),
                             jnp.array([0, 1], jnp.int32), jnp.ones((2,), jnp.int32), decay,
                             qd, kd, ek_f, v_f, tb, aqk, h0, num_v_heads=HV,
                             has_initial_state=True, narrow=narrow,
                             warp_specialized=mode != "interpret",
                             interpret=mode == "interpret")

    (o, hT), (o_nan, hT_nan) = call(0.0), call(jnp.nan)
    assert np.all(np.isfinite(np.asarray(o[:T], F32))) and np.all(np.isfinite(np.asarray(hT)))
    np.testing.assert_array_equal(np.asarray(o_nan[:T], F32), np.asarray(o[:T], F32))
    np.testing.assert_array_equal(np.asarray(hT_nan), np.asarray(hT))


@pytest.mark.parametrize("mode", MODES)
def test_mosaic_kda_scan_pool_slots_in_place(mode):
    """The Mosaic GPU KDA scan with a pool: initial states from the named slots, final states
    into them; a padding slot (-1) reads and writes nothing and its sequence's outputs are
    zeros; slots not named keep their bits. Final states within 5e-5 of float64, as in the
    test above."""
    HK, HV, K = 1, 2, 128
    lens = [64, 64, 40]
    q, k, v, g, beta, h0, cu = _kda_inputs(55, lens, HK=HK, HV=HV, K=K, dtype=BF16)
    P = 5
    pool = np.full((P, HV, K, K), 1e30, np.float32)
    slots = np.array([3, -1, 0], np.int32)
    pool[3], pool[0] = h0[0], h0[2]
    before = pool.copy()
    spec = _spec(HK, HV, K, K, pooled=True, per_channel_gate=True, precise=False,
                 aligned_chunks=True)
    block = kern.PrefillBlockSizes(block_v=64, block_k=32, mosaic_kda_prep=True,
                                   mosaic_kda_scan=True)
    assert kern.unsupported_reason(spec, block) is None
    o, new_pool, _, _ = kern.chunk_prefill(q, k, v, g, beta, cu, spec=spec, block=block,
                                           pool=jnp.asarray(pool), slots=jnp.asarray(slots),
                                           interpret=mode == "interpret")
    o, new_pool = np.asarray(o, F32), np.asarray(new_pool)
    ro, rs = _oracle(q, k, v, g, beta, before[[3, 3, 0]], cu)
    for n, slot in enumerate(slots):
        a, b = int(cu[n]), int(cu[n + 1])
        if slot >= 0:
            assert rel_err(o[a:b], ro[a:b]) <= 5e-3
            assert rel_err(new_pool[slot], rs[n]) <= 5e-5
        else:
            assert np.all(o[a:b] == 0)
    untouched = [s for s in range(P) if s not in (3, 0)]
    assert np.array_equal(new_pool[untouched], before[untouched])


def test_mosaic_kda_scan_dispatch_rule():
    """The default blocks take the Mosaic GPU KDA scan with the Mosaic KDA prep (bf16 inputs,
    chunks aligned), wide from 128 programs and narrow below, and the Triton scan for chunk
    states or fp32 inputs; it says why it cannot take a call: it needs the Mosaic KDA prep's T
    beta, and writes no chunk states."""
    spec = _spec(16, 32, 128, 128, per_channel_gate=True, precise=False, aligned_chunks=True)
    for n, block_v in ((8, 64), (2, 64), (1, 32)):
        block = kern.PrefillBlockSizes.get_default(spec, n, BF16)
        assert block.mosaic_kda_prep and block.mosaic_kda_scan and not block.mosaic_scan
        assert block.block_v == block_v and kern.unsupported_reason(spec, block) is None
    for sp, dtype in ((_spec(16, 32, 128, 128, per_channel_gate=True, precise=False,
                             aligned_chunks=True, boundary_states=True), BF16),
                      (_spec(16, 32, 128, 128, per_channel_gate=True, aligned_chunks=True),
                       F32),
                      (_spec(16, 32, 128, 128, per_channel_gate=True, precise=False), BF16)):
        block = kern.PrefillBlockSizes.get_default(sp, 8, dtype)
        assert not block.mosaic_kda_scan and kern.unsupported_reason(sp, block) is None
    both = kern.PrefillBlockSizes(block_v=64, mosaic_kda_prep=True, mosaic_kda_scan=True)
    assert kern.unsupported_reason(spec, both) is None
    for sp, block, word in (
            (spec, kern.PrefillBlockSizes(block_v=64, mosaic_kda_scan=True), "mosaic_kda_prep"),
            (_spec(16, 32, 128, 128, per_channel_gate=True, precise=False, aligned_chunks=True,
                   boundary_states=True), both, "chunk-boundary"),
            (_spec(16, 32, 128, 128, per_channel_gate=True, precise=False), both,
             "aligned_chunks")):
        assert word in kern.unsupported_reason(sp, block)


def _kda_redo_inputs():
    """KDA per-channel inputs whose value head 0 overflows the fp16 inverse (a key repeated
    with beta |k|^2 = 3 and no decay) and head 1 does not (`_repeated_key_inputs`), sequences
    of 64 and 100 tokens: (q, k, v, g, beta, cu, spec, (start, length, lead), T)."""
    lens, HK, HV, K = [64, 100], 1, 2, 128
    q, k, v, g1, beta, cu = _repeated_key_inputs(lens, K)
    g = np.repeat(np.asarray(g1)[:, :, None], K, axis=2) / K    # per channel; head 0: no decay
    spec = _spec(HK, HV, K, K, use_qk_l2norm=False, precise=False, per_channel_gate=True,
                 aligned_chunks=True)
    start, length, _, lead = kern.chunk_table(cu, sum(lens))
    return (q, k, v, jnp.asarray(g, F32), jnp.asarray(beta, F32), cu, spec,
            (start, length, lead), sum(lens))


@pytest.mark.parametrize("mode", MODES)
def test_mosaic_kda_prep_redoes_the_chunks_whose_fp16_inverse_overflows(mode):
    """The Mosaic GPU KDA prep flags the chunks where its fp16 inverse may not have held and
    the Triton prep forms their W and U again, in place: value head 0 sees one key repeated
    with beta |k|^2 = 3 and no decay ((I + A)^-1 holds (-2)^(i - j), beyond fp16), value head 1
    the same key with typical gates and beta below 1/4. Head 0's W and U are the Triton prep's
    bit for bit, head 1's (the fp16 inverse's) close to them."""
    HV, K = 2, 128
    q, k, v, g, beta, cu, spec, (start, length, lead), T_total = _kda_redo_inputs()
    zeros = jnp.zeros((HV * K,), F32)
    got = {}
    for mosaic in (True, False):
        block = kern.PrefillBlockSizes(block_v=32, block_k=32, mosaic_kda_prep=mosaic)
        got[mosaic] = kern._prep(q, k, v, g, beta, start, length, lead, jnp.zeros((HV,), F32),
                                 zeros, spec=spec, block=block,
                                 interpret=mode == "interpret")[1:3]
    rows = np.arange(T_total)
    for a, b in zip(got[True], got[False]):
        a, b = np.asarray(a, F32)[..., rows, :, :], np.asarray(b, F32)
        assert np.all(np.isfinite(a))
        assert np.array_equal(a[..., 0, :], b[..., 0, :])
        assert 0 < rel_err(a[..., 1, :], b[..., 1, :]) <= 2e-3
    assert np.abs(np.asarray(got[False][1][:64, 0], F32)).max() > 2.0 ** 40
    # the flags themselves: head 0's chunks, not head 1's
    kk, _, _, _, ek, _ = kern._kda_intra(q, k, g, start, length, jnp.zeros((HV,), F32), zeros,
                                         rows_dtype=BF16, spec=spec,
                                         block=kern.PrefillBlockSizes(block_k=32),
                                         interpret=mode == "interpret",
                                         prep_rows=kern._aligned_rows(v).shape[0])
    # (per row; the redo pass reads them as they are, and skips empty slots itself)
    flags = np.asarray(kern._mosaic_kda_prep(v, beta, start, length, kk, ek, spec=spec,
                                             interpret=mode == "interpret")[0])
    used = np.asarray(length) > 0
    flagged = np.max(flags, axis=2) != 0
    assert np.all(flagged[used, 0]) and not np.any(flagged[used, 1])


@pytest.mark.parametrize("mode", MODES)
def test_mosaic_kda_t_beta_redoes_the_chunks_whose_fp16_inverse_overflows(mode):
    """For the Mosaic GPU KDA scan the Mosaic KDA prep writes T beta's halves, and the Triton
    pass forms the flagged chunks' again (in one-pass TF32), in place: on the inputs above
    (value head 0's T beta holds (-2)^(i - j) times beta, beyond fp16; head 1's fits) both
    heads' T beta come within 2e-3 of float64's, from the same k k^T, and zero past the
    chunk's end; the scan's other rows are e^G k's halves and the values themselves. The
    whole call's output is within 1e-3 of the Triton scan's (W and U), its state within 5e-4
    (the Triton scan's own, its k e^{G_C - G} in fp16 and one-pass TF32, reach ~2e-4 against
    float64; compiled on the H200 the two states differed by 2.2e-4)."""
    HV, K = 2, 128
    q, k, v, g, beta, cu, spec, (start, length, lead), T_total = _kda_redo_inputs()
    zeros = jnp.zeros((HV * K,), F32)
    interpret = mode == "interpret"
    block = kern.PrefillBlockSizes(block_v=64, block_k=32, mosaic_kda_prep=True,
                                   mosaic_kda_scan=True)
    tb, ek_rows, v_rows = kern._prep(q, k, v, g, beta, start, length, lead,
                                     jnp.zeros((HV,), F32), zeros, spec=spec, block=block,
                                     interpret=interpret)[:3]
    prep_rows = kern._aligned_rows(v).shape[0]
    kk, _, _, _, ek, _ = kern._kda_intra(q, k, g, start, length, jnp.zeros((HV,), F32), zeros,
                                         rows_dtype=BF16, spec=spec, block=block,
                                         interpret=interpret, prep_rows=prep_rows)
    assert np.array_equal(np.asarray(ek_rows, F32)[:, :T_total], np.asarray(ek, F32)[:, :T_total])
    assert np.array_equal(np.asarray(v_rows, F32)[:T_total], np.asarray(v, F32))
    tb = np.asarray(tb, np.float64)
    tb = tb[0] + tb[1]                                   # [S * C, HV, C], by chunk slot
    kk64, beta64 = np.asarray(kk, np.float64), np.asarray(beta, np.float64)
    C = kern.CHUNK
    for s_, h in itertools.product(range(start.shape[0]), range(HV)):
        n, t0 = int(length[s_]), int(start[s_])
        if n == 0:
            continue
        b = beta64[t0:t0 + n, h]
        A = np.tril(b[:, None] * kk64[t0:t0 + n, h, :n], -1)
        want = np.linalg.inv(np.eye(n) + A) * b[None, :]
        got = tb[s_ * C:(s_ + 1) * C, h]
        assert rel_err(got[:n, :n], want) <= 2e-3, (s_, h)
        assert np.all(got[n:] == 0) and np.all(got[:, n:] == 0)
        if h == 0:
            assert np.abs(got).max() > 2.0 ** 20         # redone: beyond the fp16 inverse
    outs = {}
    for mosaic_scan in (True, False):
        outs[mosaic_scan] = kern.chunk_prefill(
            q, k, v, g, beta, cu, spec=spec,
            block=dataclasses.replace(block, mosaic_kda_scan=mosaic_scan), interpret=interpret,
            state_dtype=F32)[:2]
    (o, hT), (o_wu, hT_wu) = outs[True], outs[False]
    assert np.all(np.isfinite(np.asarray(o, F32))) and np.all(np.isfinite(np.asarray(hT)))
    assert rel_err(o, o_wu) <= 1e-3 and rel_err(hT, hT_wu) <= 5e-4


@pytest.mark.parametrize("mode", MODES)
def test_kda_intra_rows_for_the_mosaic_scan_end_in_zeros(mode):
    """For the Mosaic GPU KDA scan the intra kernel gives q k^T and the decayed q and k rows in
    whole 8-row tiles (what the scan's bulk copies take, so they are not padded by a copy):
    198 tokens come as 200 rows, the last two zeros (written: on a GPU unwritten rows hold
    whatever the buffer held), the others those of the call for the Triton scan (bit for bit
    but the decayed k rows, there one fp16 row, here bf16 halves)."""
    lens, HK, HV, K = [128, 70], 1, 2, 128
    q, k, v, g, b, h0, cu, kw, lb, gates, beta = _aligned_kda_inputs(57, lens, HK, HV, None)
    spec = _spec(HK, HV, K, K, per_channel_gate=True, precise=False, aligned_chunks=True)
    T_total = sum(lens)
    start, length, _, _ = kern.chunk_table(cu, T_total)
    prep_rows = kern._aligned_rows(v).shape[0]
    assert prep_rows == 200
    got = {}
    for scan in (True, False):
        block = kern.PrefillBlockSizes(block_k=32, mosaic_kda_prep=True, mosaic_kda_scan=scan)
        _, aqk, fq, fk, _, _ = kern._kda_intra(q, k, g, start, length, None, None,
                                               rows_dtype=BF16, spec=spec, block=block,
                                               interpret=mode == "interpret",
                                               prep_rows=prep_rows)
        got[scan] = [np.asarray(x, F32) for x in (aqk, fq, fk)]
    (aqk, fq, fk), (aqk0, fq0, fk0) = got[True], got[False]
    fk = fk[0] + fk[1]      # its bf16 halves (the Triton scan's: one fp16 row, bounded by one)
    for a, b in ((aqk, aqk0), (fq, fq0), (fk, fk0)):
        assert a.shape[0] == prep_rows and b.shape[0] == T_total
        assert np.all(a[T_total:] == 0) and np.all(np.isfinite(a))
    assert np.array_equal(aqk[:T_total], aqk0) and np.array_equal(fq[:T_total], fq0)
    assert rel_err(fk[:T_total], fk0) <= 1e-3


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("t_beta", [False, True])
def test_mosaic_kda_prep_items_in_turn_keep_the_bits(mode, t_beta):
    """KDA's Mosaic GPU prep with programs that take several items in turn (the next item's
    k k^T and beta fetched while one is formed) gives the bits of one item a program: fresh
    random rows, a partial last chunk, an empty slot, unfit chunks among fitting ones; W and U,
    or T beta's halves (t_beta), which on the fitting chunks are within 2e-3 of float64's and
    zero past each chunk's length."""
    from pallas_kernels import gdn_prefill_mgpu as mgpu
    C, HV, K = 64, 3, 128
    length = jnp.array([64, 64, 0, 64, 37], jnp.int32)
    S = length.shape[0]
    start = jnp.arange(S, dtype=jnp.int32) * C
    T = S * C
    ks = jax.random.split(jax.random.PRNGKey(7), 5)
    lower = np.tril(np.ones((C, C), np.float32), -1)[None, :, None, :]
    kk = jax.random.uniform(ks[0], (S, C, HV, C), F32, -0.1, 0.1) * lower
    kk = kk.at[1, :, 2].multiply(400.0)                  # a chunk whose fp16 inverse fails
    kk = kk.reshape(T, HV, C).astype(jnp.float16)
    ek = jnp.stack(mgpu.split_bf16(jax.random.normal(ks[1], (T, HV, K), F32)))
    v = jax.random.normal(ks[2], (T, HV, K), F32).astype(BF16)
    beta = jax.nn.sigmoid(jax.random.normal(ks[3], (S, HV, C), F32))
    beta = jnp.where(jnp.arange(C)[None, None, :] < length[:, None, None], beta, 0.0)
    run = lambda n: mgpu.kda_prep(start, length, kk, ek, v, beta,
                                  max_a=kern.HALF_INVERSE_MAX_A, max_t=kern.HALF_INVERSE_MAX_T,
                                  num_programs=n, t_beta=t_beta, interpret=mode == "interpret")
    one, turns = run(None), run(4)
    fitting = np.ones((S * C, HV), bool)
    fitting[C:2 * C, 2] = False                          # (the flagged chunk: its caller redoes it)
    for a, b in zip(turns, one):
        a, b = np.asarray(a, F32), np.asarray(b, F32)
        assert np.array_equal(a, b, equal_nan=True)
        if a.shape[0] != S:                              # by chunk slot
            assert np.all(np.isfinite(a[..., fitting, :]))
    flags = np.asarray(one[-1])
    assert flags[1, 2].max() == 1 and flags[0].max() == 0 and flags[3].max() == 0
    if t_beta:
        tb = np.asarray(one[0], np.float64)
        tb = (tb[0] + tb[1]).reshape(S, C, HV, C)
        kk64, beta64 = np.asarray(kk, np.float64).reshape(S, C, HV, C), np.asarray(beta, np.float64)
        for s_, h in itertools.product(range(S), range(HV)):
            n = int(length[s_])
            if (s_, h) == (1, 2):
                continue
            A = np.tril(beta64[s_, h][:, None] * kk64[s_, :, h], -1)[:n, :n]
            want = np.linalg.inv(np.eye(n) + A) * beta64[s_, h][None, :n]
            got = tb[s_, :, h]
            assert rel_err(got[:n, :n], want) <= 2e-3
            assert np.all(got[n:] == 0) and np.all(got[:, n:] == 0)


def test_mosaic_kda_prep_dispatch_rule():
    """Where the default blocks take KDA's prep in Mosaic GPU, and why not elsewhere."""
    kda = lambda **kw: _spec(16, 32, 128, 128, per_channel_gate=True,
                             **{"precise": False, **kw})
    pick = lambda spec, dtype=BF16: kern.PrefillBlockSizes.get_default(
        spec, 8, dtype).mosaic_kda_prep
    aligned = kda(aligned_chunks=True)
    assert pick(aligned) and pick(kda(aligned_chunks=True, pooled=True))
    assert not pick(aligned, jnp.float16) and not pick(aligned, None)
    block = kern.PrefillBlockSizes(mosaic_kda_prep=True)
    for spec, word in ((kda(), "aligned_chunks"),
                       (_spec(16, 32, 64, 64, precise=False, per_channel_gate=True,
                              aligned_chunks=True), "head_k_dim"),
                       (kda(aligned_chunks=True, precise=True), "bf16"),
                       (_spec(16, 32, 128, 128, precise=False, aligned_chunks=True), "KDA")):
        assert not pick(spec)
        assert word in kern.unsupported_reason(spec, block)
    assert kern.unsupported_reason(aligned, block) is None


def test_front_door_start_facts():
    """What the front door tells the kernels about where sequences start: the largest of 64, 2
    and 1 dividing every start, from B and T for a dense batch, from concrete cu_seqlens, and 1
    for traced ones; dense_len (the chunk table built at trace time) for a dense batch only."""
    from gdn_jax.prefill import _start_align, _start_facts
    assert _start_align(1, 300, None) == 64            # one sequence starts at 0
    assert _start_align(4, 128, None) == 64
    assert _start_align(2, 300, None) == 2
    assert _start_align(3, 65, None) == 1
    assert _start_align(1, 0, np.array([0, 64, 64, 192, 200])) == 64
    assert _start_align(1, 0, np.array([0, 64, 70, 200])) == 2
    assert _start_align(1, 0, np.array([0, 3, 200])) == 1
    assert jax.jit(lambda cu: jnp.int32(_start_align(1, 0, cu)))(jnp.array([0, 64])) == 1
    assert _start_facts(8, 4096, None) == dict(even_starts=True, aligned_chunks=True,
                                               dense_len=4096)
    assert _start_facts(2, 300, None) == dict(even_starts=True, aligned_chunks=False,
                                              dense_len=300)
    assert _start_facts(1, 0, np.array([0, 64, 128])) == dict(even_starts=True,
                                                              aligned_chunks=True, dense_len=None)


def test_front_door_takes_the_mosaic_kda_prep_for_aligned_calls(monkeypatch):
    """`gdn_prefill` with KDA bf16 inputs at K = V = 128 runs W and U through the Mosaic GPU
    prep when every sequence starts at a multiple of 64, and through the Triton prep when not
    (interpret mode, kernel="chunked")."""
    import gdn_jax
    from gdn_jax.prefill import gdn_prefill
    from pallas_kernels import gdn_prefill_mgpu as mgpu
    calls = []
    real = mgpu.kda_prep
    monkeypatch.setattr(mgpu, "kda_prep", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    jax.clear_caches()   # a call traced before the spy would not reach it
    for lens, want in (([64, 36], 1), ([36, 64], 0)):
        q, k, v, g, beta, _, cu = _kda_inputs(61, lens, HK=1, HV=1, K=128, dtype=BF16)
        with gdn_jax.interpret():
            o, _, _ = gdn_prefill(q[None], k[None], v[None], g[None], beta[None],
                                  cu_seqlens=cu, use_qk_l2norm=True, kernel="chunked")
        assert np.all(np.isfinite(np.asarray(o, F32)))
        assert len(calls) == want, (lens, calls)
        calls.clear()
    jax.clear_caches()


def test_unsupported_shapes_say_why():
    assert "head_k_dim=96" in kern.unsupported_reason(_spec(1, 1, 96, 64))
    assert "block_v" in kern.unsupported_reason(_spec(1, 1, 64, 64),
                                                kern.PrefillBlockSizes(block_v=24))
    assert kern.unsupported_reason(_spec(2, 4, 128, 128, precise=False),
                                   kern.PrefillBlockSizes()) is None
    # fp32 inputs run at every head dim, GDN and KDA (test_default_blocks_fit_the_gpu)
    for K in (64, 128, 256):
        for kda in (False, True):
            spec = _spec(2, 4, K, K, precise=True, per_channel_gate=kda)
            assert kern.unsupported_reason(spec, kern.PrefillBlockSizes.get_default(spec, 1)) is None
    assert "prep_cols" in kern.unsupported_reason(_spec(2, 4, 64, 64, per_channel_gate=True),
                                                  kern.PrefillBlockSizes(prep_cols=24))
    # the KDA intra kernel reads back rows it stored in the same loop step: no pipelining
    kda = _spec(2, 4, 128, 128, precise=False, per_channel_gate=True)
    assert kern.unsupported_reason(kda, kern.PrefillBlockSizes()) is None
    assert "num_stages_intra=2" in kern.unsupported_reason(
        kda, kern.PrefillBlockSizes(num_stages_intra=2))
    # paired products in the scan: GDN's default with few and with many pairs, not KDA's
    assert "paired_halves" in kern.unsupported_reason(kda, kern.PrefillBlockSizes(paired_halves=True))
    few, many = (kern.PrefillBlockSizes.get_default(_spec(2, 4, 128, 128, precise=False), n)
                 for n in (1, 64))
    assert few.paired_halves and many.paired_halves and few.block_v != many.block_v
    assert (few.pair_group, many.pair_group) == (1, 8)
    assert "pair_group" in kern.unsupported_reason(_spec(2, 4, 64, 64), kern.PrefillBlockSizes(pair_group=4))
    assert not any(kern.PrefillBlockSizes.get_default(kda, n).paired_halves for n in (1, 64))
    # the per-chunk kernels' launch order: heads fastest but for GDN with few pairs
    assert (few.heads_fastest, many.heads_fastest) == (False, True)
    assert all(kern.PrefillBlockSizes.get_default(kda, n).heads_fastest for n in (1, 64))


def test_chunk_table_packs_sequences_without_padding():
    cu = jnp.asarray([0, 0, 1, 65, 200, 200], jnp.int32)
    start, length, first, lead = kern.chunk_table(cu, 200)
    used = np.asarray(length) > 0
    assert np.asarray(length)[used].tolist() == [1, 64, 64, 64, 7]
    assert np.asarray(start)[used].tolist() == [0, 1, 65, 129, 193]
    assert np.asarray(first).tolist() == [0, 0, 1, 2, 5]
    assert not np.asarray(lead).any()
    # laid from starts rounded down to 8 (the Mosaic GPU scan's): the chunks of the sequences
    # at 1 and 65 begin one row early, so each needs one more chunk
    start, length, first, lead = kern.chunk_table(cu, 200, align=8)
    used = np.asarray(length) > 0
    assert np.asarray(start)[used].tolist() == [0, 0, 64, 64, 128, 192]
    assert np.asarray(lead)[used].tolist() == [0, 1, 0, 1, 0, 0]
    assert np.asarray(length)[used].tolist() == [1, 64, 1, 64, 64, 8]
    assert np.asarray(first).tolist() == [0, 0, 1, 3, 6]


def _chunk_table_numpy(cu, total, align):
    """The chunk table by walking the sequences one by one, each from its start rounded down
    to a multiple of align."""
    n = len(cu) - 1
    slots = -(-(total + (align - 1) * n) // kern.CHUNK) + n
    start, end, lead, first = (np.zeros(slots, np.int64), np.zeros(slots, np.int64),
                               np.zeros(slots, np.int64), [])
    s = 0
    for a, b in zip(cu[:-1], cu[1:]):
        first.append(s)
        for t in range(a - a % align, b if b > a else a - a % align, kern.CHUNK):
            start[s], end[s], lead[s] = t, min(kern.CHUNK, b - t), max(a - t, 0)
            s += 1
    assert s <= slots
    return start, end, np.asarray(first), lead


@pytest.mark.parametrize("align", [1, 8])
@pytest.mark.parametrize("seed", range(6))
def test_chunk_table_matches_a_walk_over_the_sequences(seed, align):
    """Random packings (empty, one-token, chunk-multiple and ragged lengths; a traced cu under
    jit): every used slot and first chunk as a plain walk gives them, and no while loop in the
    program (a GPU while loop reads its trip count back to the host every iteration)."""
    rng = np.random.default_rng(seed)
    lens = rng.choice([0, 1, 63, 64, 65, 128, 200, 7], size=rng.integers(1, 12))
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    total = int(cu[-1]) + int(rng.integers(0, 70))  # tokens past the last sequence are legal
    table = jax.jit(kern.chunk_table, static_argnums=(1, 2))
    start, end, first, lead = (np.asarray(x) for x in table(jnp.asarray(cu), total, align))
    want_start, want_end, want_first, want_lead = _chunk_table_numpy(cu, total, align)
    np.testing.assert_array_equal(end, want_end)
    np.testing.assert_array_equal(lead, want_lead)
    np.testing.assert_array_equal(start[end > 0], want_start[want_end > 0])
    np.testing.assert_array_equal(first, want_first)
    if align > 1:
        assert not (start[end > 0] % align).any()
    program = table.lower(jnp.asarray(cu), total, align).as_text()
    assert "while" not in program and "scan" not in program
    # built at trace time from a numpy cu (`chunk_prefill`'s dense batches): the same table,
    # as numpy int32 arrays, every slot; the same launch order
    for got, want in zip(kern.chunk_table(cu, total, align), (start, end, first, lead)):
        assert isinstance(got, np.ndarray) and got.dtype == np.int32
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(kern._longest_first(cu),
                                  np.asarray(kern._longest_first(jnp.asarray(cu))))


def _top_level_primitives(fn, *args):
    """The primitives of fn's program outside its kernels (calls followed, kernel bodies not)."""
    names = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            names.add(eqn.primitive.name)
            if eqn.primitive.name == "pallas_call":
                continue
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's jaxpr
                    if hasattr(sub, "eqns"):
                        walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return names


@pytest.mark.parametrize("kda", [False, True])
def test_dense_batch_chunk_table_built_at_trace_time(kda):
    """chunk_prefill(dense_len=T) for a dense batch: the same outputs and final states, bit
    for bit, as from the traced cu_seqlens, and no chunk-table kernels (scatter, sort) left in
    the program; a dense_len that does not tile q is refused."""
    B, T, HK, HV, K = 3, 80, 1, 2, 32
    ks = jax.random.split(jax.random.PRNGKey(7), 6)
    q = jax.random.normal(ks[0], (B * T, HK if not kda else HV, K), F32)
    k = jax.random.normal(ks[1], q.shape, F32)
    v = jax.random.normal(ks[2], (B * T, HV, K), F32)
    g = -0.2 * jax.nn.softplus(jax.random.normal(ks[3], (B * T, HV) + ((K,) if kda else ())))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B * T, HV)))
    h0 = jax.random.normal(ks[5], (B, HV, K, K), F32)
    cu = jnp.arange(B + 1, dtype=jnp.int32) * T
    spec = _spec(q.shape[1], HV, K, K, per_channel_gate=kda, has_initial_state=True)
    block = kern.PrefillBlockSizes.get_default(spec, B, F32)

    def run(q, k, v, g, beta, cu, h0, dense_len):
        return kern.chunk_prefill(q, k, v, g, beta, cu, spec=spec, block=block,
                                  initial_state=h0, dense_len=dense_len, interpret=True)[:2]

    args = (q, k, v, g, beta, cu, h0)
    traced, dense = run(*args, None), run(*args, T)
    for a, b in zip(traced, dense):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.isnan(np.asarray(dense[0])).any()
    with_table = _top_level_primitives(functools.partial(run, dense_len=None), *args)
    without = _top_level_primitives(functools.partial(run, dense_len=T), *args)
    assert {"scatter-add", "sort"} & with_table and not {"scatter-add", "sort"} & without
    with pytest.raises(ValueError, match="dense_len=79"):
        run(*args, T - 1)

# --------------------------------------------------------------------------- Triton lowering on CPU

@pytest.mark.parametrize("HV,raw", [(32, False), (6, True), (1, False)])
def test_mosaic_prep_rows_lowers_to_triton_ir(lower_for_h200, HV, raw):
    """The Mosaic prep's per-row launch, PREP_ROWS_HEADS value heads a program where HV has
    them (else HV's largest power-of-two divisor), lowers to Triton IR for an H200."""
    T = 200
    spec = _spec(2, HV, 128, 128, raw_gates=raw)
    start, length, _, lead = kern.chunk_table(np.array([0, 70, T], np.int32), T, 8)
    gate = jnp.ones((T, HV))
    A_log, dt = (jnp.ones(HV), jnp.ones(HV)) if raw else (jnp.zeros(HV), jnp.zeros(HV))
    hlo = jax.jit(functools.partial(kern._mosaic_prep_rows, spec=spec)).trace(
        gate, gate, start, length, lead, A_log, dt).lower(
        lowering_platforms=("cuda",)).as_text()
    assert hlo.count("gdn_prefill_prep_rows") >= 1


@pytest.mark.parametrize("per_row", [None, 3, 4])
def test_redo_pass_lowers_to_triton_ir_with_each_flag_layout(lower_for_h200, per_row):
    """The TF32 redo pass takes its flags as they come: [S, HV] chunk flags, the Mosaic KDA
    prep's per-row [S, HV, C], or a plane of the Mosaic GDN prep's [S, HV, 2, C]; each lowers
    to Triton IR for an H200 (the per-row ones reduced in the kernel)."""
    T, HK, HV = 200, 2, 4
    spec = _spec(HK, HV, 128, 128)
    start, length, _, lead = kern.chunk_table(np.array([0, 70, T], np.int32), T, 8)
    S, C = start.shape[0], kern.CHUNK
    flags = {None: jnp.zeros((S, HV), jnp.int32), 3: jnp.zeros((S, HV, C), F32),
             4: jnp.zeros((S, HV, 2, C), F32)}[per_row]
    plane = kern.mgpu_scan.UNFIT if per_row == 4 else None
    k = jnp.ones((T, HK, 128), BF16)
    gate = jnp.ones((T, HV))
    tb = jnp.zeros((2, S * C, HV, C), BF16)
    redo = functools.partial(kern._redo, spec=spec, block=kern.PrefillBlockSizes(),
                             slot_rows=True, plane=plane, interpret=False)
    hlo = jax.jit(redo).trace(start, length, lead, k, gate, gate, jnp.zeros(HV), jnp.zeros(HV),
                              flags, tb).lower(lowering_platforms=("cuda",)).as_text()
    assert hlo.count("gdn_prefill_prep_tf32") >= 1


@pytest.mark.parametrize("raw,pooled,boundary,dtype,kda,blocked",
                         [(False, False, False, BF16, False, None),
                          (True, True, True, F32, False, None),
                          (True, False, True, BF16, True, None),
                          (False, True, False, BF16, True, None),
                          (False, False, False, BF16, False, True),
                          (False, True, False, BF16, True, False)])
def test_variants_lower_to_triton_ir(lower_for_h200, raw, pooled, boundary, dtype, kda, blocked):
    """Every kernel lowers to Triton IR for an H200 without a GPU (only PTX needs the device):
    prep and scan, and KDA's intra-chunk kernel before them (and its redo pass where the gate
    form does not bound the diagonal blocks' exponents); the prep with each gate form's default
    inverse (None) and with the other one; GDN's fp16 inverse kernel and the TF32 redo pass
    after it."""
    T, HK, HV, K = 256, 2, 4, 128
    spec = _spec(HK, HV, K, K, raw_gates=raw, pooled=pooled, boundary_states=boundary,
                 precise=dtype == F32, per_channel_gate=kda,
                 gate_lower_bound=-5.0 if kda and raw else None)
    x = jnp.ones((T, HK, K), dtype)
    y = jnp.ones((T, HV, K), dtype)
    gate = jnp.ones((T, HV))
    kw = dict(pool=jnp.ones((5, HV, K, K)), slots=jnp.array([1, -1])) if pooled else {}
    if raw:
        kw.update(A_log=jnp.ones(HV), dt_bias=jnp.ones(HV * K if kda else HV))
    hlo = kern.chunk_prefill.trace(x, x, y, jnp.ones((T, HV, K)) if kda else gate, gate, jnp.array([0, 100, T], jnp.int32),
                                   spec=spec, block=kern.PrefillBlockSizes(blocked_inverse=blocked),
                                   interpret=False,
                                   **kw).lower(lowering_platforms=("cuda",)).as_text()
    # prep, scan, KDA's intra-chunk kernel, GDN's fp16 inverse and its TF32 redo, and for GDN
    # the q/k tame ahead of an in-kernel L2 norm (KDA's intra kernel tames its rows itself)
    half = kern._half_inverse(spec, kern.PrefillBlockSizes(blocked_inverse=blocked)
                              .blocked_inverse_for(spec))
    assert half == (not kda and dtype == BF16 and not blocked)
    intra_redo = kda and kern._intra_diagonal(spec) == "flagged"
    assert hlo.count("__gpu$xla.gpu.triton") == ((3 if kda else 2) + 2 * half + intra_redo
                                                 + 2 * (spec.use_qk_l2norm and not kda))


@pytest.mark.parametrize("K,block_k,l2", [(64, 64, True), (128, 16, True), (256, 32, True),
                                         (256, 64, True), (128, 64, False)])
def test_kda_intra_kernel_lowers_at_every_block_k(lower_for_h200, K, block_k, l2):
    """The KDA intra kernel lowers to Triton IR for the channel steps a tuning sweep tries, at
    the head dims models use (the whole call at the default blocks is the test above): its
    scratch round trip of the reference rows (masked row-index stores, the barrier, gathers),
    in the channel loop, and in the exact diagonal blocks' column loop of its redo pass (a
    second launch: given gates do not bound the exponents); without the L2 norm, with its rows'
    powers of two (`_intra_rows_bounded`)."""
    T, HV = 200, 2
    spec = _spec(1, HV, K, K, per_channel_gate=True, precise=False, use_qk_l2norm=l2)
    assert kern._intra_rows_bounded(spec)
    start, length, _, _ = kern.chunk_table(jnp.array([0, 70, T], jnp.int32), T)
    x = jnp.ones((T, 1, K), BF16)
    hlo = jax.jit(lambda q, k, g, start, length: kern._kda_intra(
        q, k, g, start, length, jnp.zeros(HV), jnp.zeros(HV), rows_dtype=BF16, spec=spec,
        block=kern.PrefillBlockSizes(block_k=block_k), interpret=False)).trace(
            x, x, jnp.ones((T, HV, K)), start, length).lower(
                lowering_platforms=("cuda",)).as_text()
    assert kern._intra_diagonal(spec) == "flagged"
    assert hlo.count("__gpu$xla.gpu.triton") == 2
    # compiled, the scratch's stores and loads are ordered by a barrier (only interpret mode,
    # one program at a time, goes without); its op name shows in the serialized Triton module
    assert "barrier" in hlo


# --------------------------------------------------------------------------- public entry points

@pytest.mark.parametrize("mode", MODES)
def test_gdn_prefill_dense_raw_gates_and_chunk_states(mode):
    """gdn_prefill on a dense [B, T] batch with raw gates equals the reference scan; its chunk
    states equal the final states of calls cut at every chunk boundary."""
    from gdn_jax.prefill import gdn_prefill
    B, T, HK, HV, K = 3, 70, 1, 2, 32
    rng = np.random.default_rng(11)
    n = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32))
    q, k, v = n(B, T, HK, K), n(B, T, HK, K), n(B, T, HV, K)
    a, b, A_log, dt_bias = 2 * n(B, T, HV), n(B, T, HV), n(HV), n(HV)
    h0 = 0.3 * n(B, HV, K, K)
    o, hT, chunks = gdn_prefill(q, k, v, a, b, initial_state=h0, use_qk_l2norm=True,
                                A_log=A_log, dt_bias=dt_bias, chunk_states=True,
                                interpret=mode == "interpret")
    g, beta = ref.gdn_gate(a, A_log, dt_bias), ref.gdn_beta(b)
    ro, rs = numpy_delta_rule(q, k, v, g, beta, h0, l2=True)
    assert rel_err(o, ro) <= 1e-5 and rel_err(hT, rs) <= 1e-5
    assert np.asarray(chunks.count).tolist() == [2, 2, 2]
    _, cut = numpy_delta_rule(q[:, :64], k[:, :64], v[:, :64], g[:, :64], beta[:, :64], h0, l2=True)
    first = np.asarray(chunks.first)
    for bi in range(B):
        assert rel_err(chunks.states[first[bi]], cut[bi]) <= 1e-5
        assert rel_err(chunks.states[first[bi] + 1], rs[bi]) <= 1e-5


@pytest.mark.parametrize("mode", MODES)
def test_gdn_prefill_pool_matches_its_reference(mode):
    from gdn_jax.prefill import gdn_prefill_pool, reference_prefill_pool
    lens = [40, 1, 0, 90]
    HK, HV, K = 2, 4, 32
    q, k, v, g, beta, h0, cu = _packed_inputs(12, lens, HK=HK, HV=HV, K=K, V=K)
    pool = np.full((7, HV, K, K), 1e30, np.float32)
    slots = jnp.asarray([2, 5, 0, -1], jnp.int32)
    pool[2], pool[5], pool[0] = h0[0], h0[1], h0[2]
    args = (q[None], k[None], v[None], g[None], beta[None])
    want_o, want_pool = reference_prefill_pool(*args, jnp.asarray(pool), slots, cu_seqlens=cu,
                                               use_qk_l2norm=True)
    o, got_pool = gdn_prefill_pool(*args, jnp.asarray(pool), slots, cu_seqlens=cu,
                                   use_qk_l2norm=True, interpret=mode == "interpret")
    assert rel_err(o, want_o) <= 1e-5
    live = [2, 5, 0]
    assert rel_err(np.asarray(got_pool)[live], np.asarray(want_pool)[live]) <= 1e-5
    others = [1, 3, 4, 6]
    assert np.array_equal(np.asarray(got_pool)[others], pool[others])


def test_gdn_prefill_pool_bad_arguments():
    from gdn_jax.prefill import gdn_prefill_pool
    q, k, v, g, beta, _, _ = _packed_inputs(13, [8], HK=1, HV=2, K=16, V=16)
    args = (q[None], k[None], v[None], g[None], beta[None])
    with pytest.raises(ValueError, match="pool"):
        gdn_prefill_pool(*args, jnp.zeros((3, 2, 16, 8)), jnp.zeros(1, jnp.int32))
    with pytest.raises(ValueError, match="slots"):
        gdn_prefill_pool(*args, jnp.zeros((3, 2, 16, 16)), jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="A_log"):
        gdn_prefill_pool(*args, jnp.zeros((3, 2, 16, 16)), jnp.zeros(1, jnp.int32),
                         A_log=jnp.zeros(2))


@pytest.mark.parametrize("impl", ["reference", "auto"])
def test_gdn_prefill_validates_at_its_front_door(impl):
    """gdn_prefill and gdn_prefill_pool check their arguments as the sequence functions do,
    before any device work and the same way on every path (the kernels once took an integer q,
    decreasing offsets, a negative scale, a GDN lower bound or a slot named twice silently, and
    failed inside on T = 0 or a rank-3 q)."""
    from gdn_jax import interpret
    from gdn_jax.prefill import gdn_prefill, gdn_prefill_pool
    q, k, v, g, beta, h0, _ = _packed_inputs(14, [5, 5], HK=1, HV=2, K=16, V=16)
    q, k, v, g, beta = (x.reshape((2, 5) + x.shape[1:]) for x in (q, k, v, g, beta))
    pf = functools.partial(gdn_prefill, impl=impl)
    pool = lambda: jnp.asarray(np.asarray(h0))
    cases = [
        ("q must have rank 4", lambda: pf(q[0], k[0], v[0], g[0], beta[0])),
        ("q must be a floating-point array", lambda: pf(q.astype(jnp.int32), k, v, g, beta)),
        ("q must hold at least one token", lambda: pf(*(x[:, :0] for x in (q, k, v, g, beta)))),
        ("g must have shape", lambda: pf(q, k, v, g[:, :3], beta)),
        ("initial_state must have shape", lambda: pf(q, k, v, g, beta, initial_state=h0[:1])),
        ("cu_seqlens must be non-decreasing", lambda: pf(
            *(x.reshape((1, 10) + x.shape[2:]) for x in (q, k, v, g, beta)),
            cu_seqlens=jnp.asarray([0, 7, 3, 10], jnp.int32))),
        ("scale must be > 0", lambda: pf(q, k, v, g, beta, scale=-1.0)),
        ("A_log and dt_bias go together", lambda: pf(q, k, v, g, beta, A_log=jnp.ones(2))),
        ("A_log must hold HV=2 values", lambda: pf(q, k, v, g, beta, A_log=jnp.ones(3),
                                                   dt_bias=jnp.ones(2))),
        ("lower_bound applies to the raw per-channel", lambda: pf(
            q, k, v, g, beta, A_log=jnp.ones(2), dt_bias=jnp.ones(2), lower_bound=-5.0)),
        ("g must have shape", lambda: gdn_prefill_pool(q, k, v, g[:, :3], beta, pool(),
                                                       jnp.asarray([1, 0]), impl=impl)),
        ("slots names a slot twice", lambda: gdn_prefill_pool(q, k, v, g, beta, pool(),
                                                              jnp.asarray([1, 1]), impl=impl)),
    ]
    with interpret():
        for message, fn in cases:
            with pytest.raises(ValueError, match=f"^{message}"):
                fn()
    # explain reads the arguments as the functions do
    from gdn_jax import explain
    with pytest.raises(ValueError, match="^scale must be > 0"):
        explain("gdn_prefill", q, k, v, g, beta, scale=-1.0)
    with pytest.raises(ValueError, match="^pool must have shape"):
        explain("gdn_prefill_pool", q, k, v, g, beta, pool()[:, :1], jnp.asarray([1, 0]))
    assert explain("gdn_prefill_pool", q, k, v, g, beta, pool(), jnp.asarray([1, 0])).op == \
        "gdn_prefill_pool"


def test_gdn_prefill_says_its_kernels_have_no_derivatives():
    """jax.grad through the prefill kernels names what to differentiate instead (without the
    rule it failed on a bare assertion inside Pallas); the pure-JAX path differentiates."""
    from gdn_jax.prefill import gdn_prefill, gdn_prefill_pool
    q, k, v, g, beta, h0, _ = _packed_inputs(15, [70], HK=1, HV=2, K=16, V=16)
    q, k, v, g, beta = (x[None] for x in (q, k, v, g, beta))
    loss = lambda impl: lambda q: jnp.sum(gdn_prefill(q, k, v, g, beta, impl=impl,
                                                      interpret=True)[0] ** 2)
    with pytest.raises(NotImplementedError, match="^gdn_prefill's Pallas kernels run forward only"):
        jax.grad(loss("pallas"))(q)
    with pytest.raises(NotImplementedError, match="^gdn_prefill_pool's Pallas kernels"):
        jax.grad(lambda q: jnp.sum(gdn_prefill_pool(q, k, v, g, beta, jnp.asarray(h0),
                                                    jnp.zeros(1, jnp.int32), impl="pallas",
                                                    interpret=True)[0]))(q)
    assert np.all(np.isfinite(np.asarray(jax.grad(loss("reference"))(q))))


# --------------------------------------------------------------------------- KDA (per-channel gate)

def _kda_inputs(seed, lens, *, HK, HV, K, dtype=F32, spread=False):
    q, k, v, _, beta, h0, cu = _packed_inputs(seed, lens, HK=HK, HV=HV, K=K, V=K, dtype=dtype)
    rng = np.random.default_rng(seed + 100)
    T = int(sum(lens))
    g = -np.logaddexp(0.0, rng.standard_normal((T, HV, K)) - 1.0)
    if spread:  # channels from ~0 to very negative (and resets) inside every chunk
        mag = 10.0 ** rng.uniform(-7, 3, (T, HV, K))
        g = -mag
        g[rng.random((T, HV, K)) < 0.02] = -np.inf
    return q, k, v, jnp.asarray(g, F32), beta, h0, cu


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lens,HK,HV,K,spread", [([1, 2, 17, 65, 130], 1, 2, 32, False),
                                                 ([0, 70, 64], 2, 4, 64, True)])
def test_kda_prefill_matches_float64(mode, lens, HK, HV, K, spread):
    q, k, v, g, beta, h0, cu = _kda_inputs(21, lens, HK=HK, HV=HV, K=K, spread=spread)
    spec = _spec(HK, HV, K, K, has_initial_state=True, per_channel_gate=True)
    o, hT, _, _ = _run(mode, q, k, v, g, beta, cu, spec, initial_state=h0)
    assert np.all(np.isfinite(np.asarray(o))) and np.all(np.isfinite(np.asarray(hT)))
    ro, rs = _oracle(q, k, v, g, beta, h0, cu)
    assert rel_err(o, ro) <= 1e-5
    assert rel_err(hT, rs) <= 1e-5


@pytest.mark.parametrize("mode", MODES)
# Each gate form once in the default run, each in both tests in the full matrix.
@pytest.mark.parametrize("lower_bound", [None, pytest.param(-5.0, marks=FULL)])
def test_kda_raw_gates_bf16_against_float64(mode, lower_bound):
    lens = [100, 30]
    HK, HV, K = 1, 2, 32
    q, k, v, _, b, h0, cu = _kda_inputs(22, lens, HK=HK, HV=HV, K=K, dtype=BF16)
    rng = np.random.default_rng(23)
    a = jnp.asarray(2 * rng.standard_normal((sum(lens), HV, K)), F32)
    A_log = jnp.asarray(rng.standard_normal(HV), F32)
    dt_bias = jnp.asarray(rng.standard_normal(HV * K), F32)
    spec = _spec(HK, HV, K, K, has_initial_state=True, per_channel_gate=True, raw_gates=True,
                 gate_lower_bound=lower_bound, precise=False)
    o, hT, _, _ = _run(mode, q, k, v, a, b, cu, spec, initial_state=h0, A_log=A_log,
                       dt_bias=dt_bias)
    g = ref.kda_gate(a, A_log, dt_bias.reshape(HV, K), lower_bound=lower_bound)
    ro, rs = _oracle(q, k, v, g, ref.gdn_beta(b), h0, cu)
    assert rel_err(o, ro) <= 5e-3
    # The decayed k rows that build the state are never bf16 between the kernels (fp16 here,
    # bounded by 1 under the L2 norm; bf16 copies give the state ~1.5e-3 here).
    assert rel_err(hT, rs) <= 5e-4


@pytest.mark.parametrize("mode", MODES)
def test_kda_intra_gate_sums_in_one_scan_keep_the_bits(mode, monkeypatch):
    """KDA's intra kernel sums its gates' hi and lo parts in one running sum of twice the width
    for some gate forms (`_one_scan_gates`) and in two sums for the others: both ways give the
    same bits, for the raw softplus gate that takes one scan by default and the lower-bound gate
    that takes two (each with the other form forced), gates spanning -88 to ~0. (16-bit inputs sum
    in one plain part by default, `_one_part_gate_sums`: the split parts are forced here.)"""
    monkeypatch.setattr(kern, "_one_part_gate_sums", lambda spec: False)
    lens, HK, HV, K = [100, 30], 1, 2, 32
    q, k, _, _, _, _, cu = _kda_inputs(26, lens, HK=HK, HV=HV, K=K, dtype=BF16)
    rng = np.random.default_rng(27)
    a = jnp.asarray(rng.standard_normal((sum(lens), HV, K)) * np.geomspace(0.01, 30.0, K), F32)
    A_log = jnp.asarray([0.5, 2.0], F32)
    dt_bias = jnp.asarray(rng.standard_normal(HV * K), F32)
    start, length, _, _ = kern.chunk_table(cu, sum(lens))
    for lower_bound in (None, -5.0):
        spec = _spec(HK, HV, K, K, per_channel_gate=True, raw_gates=True,
                     gate_lower_bound=lower_bound, precise=False)
        assert kern._one_scan_gates(spec) == (lower_bound is None)
        got = {}
        for one_scan in (True, False):
            monkeypatch.setattr(kern, "_one_scan_gates", lambda spec, one_scan=one_scan: one_scan)
            got[one_scan] = kern._kda_intra(
                q, k, a, start, length, A_log, dt_bias, rows_dtype=BF16, spec=spec,
                block=kern.PrefillBlockSizes(block_k=16), interpret=mode == "interpret")
        used = np.asarray(length) > 0   # e^{G_C} [S, HV, K] of unused chunk slots: unwritten
        for i, (x, y) in enumerate(zip(got[True], got[False])):
            x, y = np.asarray(x.astype(F32)), np.asarray(y.astype(F32))
            if i == len(got[True]) - 1:
                x, y = x[used], y[used]
            assert np.all(np.isfinite(x)) and np.array_equal(x, y)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reset", [0, 64])
def test_kda_one_part_gate_floor_bounds_what_a_reset_leaves(mode, reset):
    """The limit of the one-part gate sums (16-bit inputs, given or raw softplus gates): a gate
    below the floor acts as a decay of 2^ONE_PART_GATE_FLOOR, so a reset leaves up to that
    share of the state it erases (docs/numerics.md). A -inf gate on every channel at a
    sequence's or a chunk's first token, with nothing written from it on (beta = 0): the exact
    outputs from there and the final state are zero; the kernel's stay within that share of
    the erased state, and the outputs before the reset match float64."""
    T, HK, HV, K = 100, 1, 2, 64
    q, k, v, g, b, h0, cu = _kda_inputs(71, [T], HK=HK, HV=HV, K=K, dtype=BF16)
    after = np.arange(T) >= reset
    g = jnp.where(jnp.asarray(np.arange(T) == reset)[:, None, None], -jnp.inf, g)
    beta = jnp.where(jnp.asarray(after)[:, None], 0.0, b)
    spec = _spec(HK, HV, K, K, per_channel_gate=True, precise=False, has_initial_state=True)
    assert kern._one_part_gate_sums(spec)
    o, hT = (np.asarray(x, np.float64) for x in
             _run(mode, q, k, v, g, beta, cu, spec, initial_state=h0)[:2])
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(hT))
    erased = np.asarray(h0, np.float64)
    if reset:
        ro, _ = _oracle(q, k, v, g, beta, h0, cu)
        assert rel_err(o[:reset], ro[:reset]) <= 5e-3
        _, erased = _oracle(q[:reset], k[:reset], v[:reset], g[:reset], beta[:reset], h0,
                            jnp.array([0, reset], jnp.int32))
    # [HV]: the floor's share of the erased state
    leftover = 2.0 ** kern.ONE_PART_GATE_FLOOR * np.sqrt((erased[0] ** 2).sum(axis=(1, 2)))
    # |o_t| <= scale |q_t| |S_t| (unit q rows after the norm), |S_t| <= leftover for t >= reset
    assert np.all(np.abs(o[after]) <= 1.05 * K ** -0.5 * leftover[None, :, None])
    assert np.all(np.sqrt((hT[0] ** 2).sum(axis=(1, 2))) <= 1.05 * leftover)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("K", [32, 64])
def test_kda_state_of_strongly_decayed_rows_against_float64(mode, K):
    """KDA's Triton chunked path with bf16 inputs: strong per-channel gates (softplus x 30 and
    x 60, down to -150 a token) and nothing written by the last tokens (beta = 0), so the final
    state holds only rows decayed by e^-15 or far less: a tiny state, but every digit of it
    is the rule's. Its rows k e^{G_C - G} went through memory in fp16, where rows below 2^-14
    lose digits and below 2^-24 vanish (state errors 0.08 to 1.0 against float64); in fp32 the
    state is within bf16's bound."""
    T, HK, HV = 64, 1, 2
    for seed, strength in ((0, 30.0), (1, 60.0)):
        q, k, v, g, b, h0, cu = _kda_inputs(80 + seed, [T], HK=HK, HV=HV, K=K, dtype=BF16)
        g = g * strength
        beta = jnp.where(jnp.asarray(np.arange(T) >= T - 3)[:, None], 0.0, b).astype(BF16)
        spec = _spec(HK, HV, K, K, per_channel_gate=True, precise=False,
                     has_initial_state=True)
        o, hT = (np.asarray(x, np.float64) for x in
                 _run(mode, q, k, v, g, beta, cu, spec, initial_state=h0)[:2])
        ro, rs = _oracle(q, k, v, g, beta, h0, cu)
        assert np.abs(rs).max() < 1e-3, "the case must leave a tiny state"
        assert rel_err(o, ro) <= 5e-3
        assert rel_err(hT, rs) <= 5e-3, f"x{strength}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("form", ["lower bound", "given", pytest.param("softplus", marks=FULL)])
def test_kda_one_part_gate_sums_against_float64(mode, form, monkeypatch):
    """With bf16 inputs KDA's intra kernel sums its gates in one plain fp32 part
    (`_one_part_gate_sums`): against a float64 token loop its outputs and final states are as
    close as with the exact hi and lo parts, with an initial state. The raw lower-bound gate:
    gates that put the chunks' sums near their bound (-5 for 40 tokens, then ~0: decays that
    matter, late in chunks whose sums are large) and random ones; given gates: 30 tokens at the
    floor (-88) then mild ones (sums in the thousands before decays near 1), and gates from 1e-7
    to 1e3 with resets; the raw softplus gate: random projections, some channels decaying
    hard."""
    lens, HK, HV, K = [256, 130], 1, 2, 64
    q, k, v, g_spread, b, h0, cu = _kda_inputs(61, lens, HK=HK, HV=HV, K=K, dtype=BF16,
                                                spread=True)
    rng = np.random.default_rng(62)
    T = sum(lens)
    pos = (np.arange(T) % kern.CHUNK)[:, None, None]
    dt_bias = jnp.asarray(rng.standard_normal(HV * K), F32)
    raw = dict(raw_gates=True, gate_lower_bound=-5.0 if form == "lower bound" else None)
    if form == "lower bound":
        cases = {"strong then weak": (np.where(pos < 40, 8.0, -8.0)
                                      + 0.3 * rng.standard_normal((T, HV, K)), np.zeros(HV)),
                 "random": (2 * rng.standard_normal((T, HV, K)), 0.5 * rng.standard_normal(HV))}
    elif form == "softplus":
        cases = {"random": (2 * rng.standard_normal((T, HV, K)), np.asarray([0.5, 2.5]))}
    else:
        raw = {}
        cases = {"floor then mild": np.where(pos < 30, -200.0, -0.01 * rng.random((T, HV, K))),
                 "spread": np.asarray(g_spread)}
    spec = _spec(HK, HV, K, K, per_channel_gate=True, precise=False, has_initial_state=True,
                 **raw)
    assert kern._one_part_gate_sums(spec)
    assert not kern._one_part_gate_sums(dataclasses.replace(spec, precise=True))
    for name, case in cases.items():
        if raw:
            a, A_log = (jnp.asarray(x, F32) for x in case)
            g = ref.kda_gate(a, A_log, dt_bias.reshape(HV, K), lower_bound=raw["gate_lower_bound"])
            beta, extra = jax.nn.sigmoid(b), dict(A_log=A_log, dt_bias=dt_bias)
        else:
            a = g = jnp.asarray(case, F32)
            beta, extra = b, {}
        ro, rs = _oracle(q, k, v, g, beta, h0, cu)
        got = {}
        for one_part in (True, False):
            monkeypatch.setattr(kern, "_one_part_gate_sums", lambda spec, one=one_part: one)
            jax.clear_caches()   # the traced calls do not see the patched rule otherwise
            got[one_part] = _run(mode, q, k, v, a, b, cu, spec, initial_state=h0, **extra)[:2]
        (o1, s1), (o2, s2) = got[True], got[False]
        assert not np.array_equal(np.asarray(s1), np.asarray(s2)), name   # the forms differ
        assert rel_err(o1, ro) <= 5e-3 and rel_err(s1, rs) <= 1e-3, name
        assert rel_err(o1, ro) <= 1.02 * rel_err(o2, ro), name
        # the state: plus the one-part sums' own rounding (sums up to 4096 in log2 units
        # round by 2^-12; in interpret mode no TF32 rounding hides it)
        assert rel_err(s1, rs) <= 1.05 * rel_err(s2, rs) + 2.0 ** -13, name


@pytest.mark.parametrize("mode", MODES)
def test_operand_exp2_against_float64(mode):
    """The decay factors of the KDA intra kernel's tensor-core operands (`_operand_exp2`:
    `ex2.approx` compiled for 16-bit inputs, `jnp.exp2` in interpret mode) within 2^-21 + |x|
    2^-23 of float64 where 2^x is a normal fp32 number (the CPU's exp2 goes through exp and
    loses |x| 2^-24), 0 (or that number's subnormal) below it, and exact at 0, +-inf."""
    from jax.experimental import pallas as pl
    rng = np.random.default_rng(41)
    x = rng.uniform(-135.0, 130.0, (64, 32))
    x[0, :4] = [0.0, -np.inf, np.inf, -125.0]
    x = jnp.asarray(x, F32)

    def kernel(x_ref, o_ref):
        o_ref[...] = kern._operand_exp2(x_ref[...], approx=mode != "interpret")

    got = np.asarray(pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, F32),
                                    interpret=mode == "interpret")(x), np.float64)
    want = np.exp2(np.asarray(x, np.float64))
    tiny, big = np.finfo(np.float32).tiny, np.finfo(np.float32).max
    normal = (want >= tiny) & (want <= big)
    bound = (2.0 ** -21 + np.abs(np.asarray(x, np.float64)) * 2.0 ** -23) * want
    assert np.all(np.abs(got[normal] - want[normal]) <= bound[normal])
    assert np.all(got[want > big] == np.inf)
    below = want < tiny
    assert np.all(got[below] <= tiny) and np.all(got[below] >= 0)
    assert got[0, 0] == 1.0 and got[0, 1] == 0.0 and got[0, 2] == np.inf


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_approx_raw_gates_against_float64(mode, lower_bound):
    """The KDA intra kernel's raw gates in log2 units with 16-bit inputs (`_raw_log_decay`,
    approx: PTX ex2, lg2 and rcp approximations compiled; the precise formula in interpret
    mode) within 2^-20 (1 + |g|) of float64 a token: Kimi Linear's softplus form over the
    softplus threshold and far below it, GLM-5.3-Flash's lower bound at both ends of the
    sigmoid."""
    from jax.experimental import pallas as pl
    rng = np.random.default_rng(43)
    x = rng.uniform(-60.0, 40.0, (64, 32)).astype(np.float32)
    x[0, :6] = [0.0, -1e-3, 20.0, 20.5, -17.0, -88.0]
    dt = rng.uniform(-2.0, 2.0, (1, 32)).astype(np.float32)
    A_log = np.float32(0.7)
    spec = _spec(1, 1, 32, 32, per_channel_gate=True, raw_gates=True,
                 gate_lower_bound=lower_bound, precise=False)

    def kernel(x_ref, dt_ref, o_ref):
        o_ref[...] = kern._raw_log_decay(x_ref[...], A_log, dt_ref[...], spec, unit=kern.LOG2E,
                                         approx=mode != "interpret")

    got = np.asarray(pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, F32),
                                    interpret=mode == "interpret")(x, dt), np.float64)
    y = x.astype(np.float64) + dt
    if lower_bound is None:
        want = -np.exp(np.float64(A_log)) * np.logaddexp(0.0, y) / np.log(2.0)
    else:
        want = lower_bound / np.log(2.0) / (1.0 + np.exp(-np.exp(np.float64(A_log)) * y))
    assert np.all(np.isfinite(got))
    assert np.all(np.abs(got - want) <= 2.0 ** -20 * (1.0 + np.abs(want)))


def _diag_spans(g, cu):
    """Largest |G_ic - G_mc| per (chunk, head) between a row and the middle row m of its
    SUB-row block (float64, gates clamped as the kernel does): the kernel forms all of a chunk's
    diagonal blocks as products when this is <= `_diag_exp_limit`; above, it forms them exactly
    (it decides per chunk and channel step)."""
    g = np.maximum(np.asarray(g, np.float64), kern.GATE_FLOOR)
    cu = np.asarray(cu)
    spans = []
    for n in range(len(cu) - 1):
        for t0 in range(cu[n], cu[n + 1], kern.CHUNK):
            chunk = g[t0:min(t0 + kern.CHUNK, cu[n + 1])]
            chunk = np.concatenate([chunk, np.zeros((kern.CHUNK - len(chunk),) + chunk.shape[1:])])
            G = np.cumsum(chunk, axis=0).reshape(-1, kern.SUB, *chunk.shape[1:])
            spans.append(np.abs(G - G[:, kern.SUB // 2:kern.SUB // 2 + 1]).max(axis=(0, 1, 3)))
    return np.concatenate(spans)


def _kda_spanning_raw_inputs(seed, dtype, *, A_log_1):
    """Packed KDA inputs (lengths 150, 64, 9; HK = 1, HV = 2, K = 32) with raw per-channel gate
    projections: head 0's dt_bias mild (uniform in [-3, 1], A_log -2), head 1's spread from
    -30 to 30 over the channels (A_log A_log_1), so that its channels range from no decay to
    the strongest. Returns (q, k, v, a, beta, h0, cu, A_log, dt_bias)."""
    lens, HV, K = [150, 64, 9], 2, 32
    q, k, v, _, b, h0, cu = _kda_inputs(seed, lens, HK=1, HV=HV, K=K, dtype=dtype)
    rng = np.random.default_rng(seed + 1)
    a = jnp.asarray(rng.standard_normal((sum(lens), HV, K)), F32)
    A_log = jnp.asarray([-2.0, A_log_1], F32)
    dt_bias = np.linspace(-30.0, 30.0, K, dtype=np.float32)[None, :].repeat(HV, 0)
    dt_bias[0] = rng.uniform(-3, 1, K)
    return q, k, v, a, b, h0, cu, A_log, jnp.asarray(dt_bias.reshape(-1))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lower_bound", [pytest.param(None, marks=FULL), -5.0])
def test_kda_raw_gates_spanning_orders_of_magnitude(mode, lower_bound):
    """Raw per-channel gates (Kimi Linear's softplus form, GLM-5.3-Flash's lower bound -5), fp32:
    inside every chunk some channels decay by ~1e-9 per token and others sit at the bound (or,
    for softplus, decay by e^-60 per token); head 0's gates are mild."""
    HK, HV, K = 1, 2, 32
    q, k, v, a, b, h0, cu, A_log, dt_bias = _kda_spanning_raw_inputs(24, F32, A_log_1=1.0)
    spec = _spec(HK, HV, K, K, has_initial_state=True, per_channel_gate=True, raw_gates=True,
                 gate_lower_bound=lower_bound)
    o, hT, _, _ = _run(mode, q, k, v, a, b, cu, spec, initial_state=h0, A_log=A_log,
                       dt_bias=dt_bias)
    g = ref.kda_gate(a, A_log, dt_bias.reshape(HV, K), lower_bound=lower_bound)
    limit = kern._diag_exp_limit(spec)   # fp32 inputs: the limit for any rows
    spans = _diag_spans(g, cu).reshape(-1, HV)
    if lower_bound is not None:  # some channels at the bound exactly, others near zero
        assert np.any(np.asarray(g) == lower_bound) and np.any(np.asarray(g) > -1e-6)
        # fp32 inputs check the spans at run time (the bound's 80 is for normalised 16-bit
        # rows): some chunks take the factored diagonal, others the exact one
        assert not kern._factored_diagonal_always_safe(spec)
        assert spans.max() <= -lower_bound * kern.SUB // 2
        assert spans.min() <= limit < spans.max()
    else:  # head 0 takes the factored diagonal, head 1 the exact one
        assert np.all(spans[:, 0] <= limit)
        assert np.all(spans[:, 1] > limit)
    ro, rs = _oracle(q, k, v, g, ref.gdn_beta(b), h0, cu)
    assert rel_err(o, ro) <= 1e-5
    assert rel_err(hT, rs) <= 1e-5


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("exact_only", [False, True])
def test_kda_raw_softplus_gates_bf16_flag_from_reference_rows(mode, exact_only, monkeypatch):
    """Raw softplus gates with bf16 inputs: the intra kernel flags an item for its redo pass from
    each block's reference rows (`_monotone_gate_sums`), not from every row. Head 0's gates are
    mild (its diagonal blocks factored), head 1's span channels near 0 and channels at the gate
    floor (its blocks far past the limit: flagged, formed again exactly); and the same call with
    every item flagged. Equal to float64 within the bf16 bounds, finite."""
    HK, HV, K = 1, 2, 32
    q, k, v, a, b, h0, cu, A_log, dt_bias = _kda_spanning_raw_inputs(28, BF16, A_log_1=2.0)
    spec = _spec(HK, HV, K, K, has_initial_state=True, per_channel_gate=True, raw_gates=True,
                 precise=False)
    assert kern._monotone_gate_sums(spec) and kern._intra_diagonal(spec) == "flagged"
    g = ref.kda_gate(a, A_log, dt_bias.reshape(HV, K))
    spans = _diag_spans(g, cu).reshape(-1, HV)
    limit = kern._diag_exp_limit(spec)
    assert np.all(spans[:, 0] <= limit) and np.all(spans[:, 1] > limit)
    if exact_only:
        monkeypatch.setattr(kern, "_diag_exp_limit", lambda spec: -1.0)
    kern.chunk_prefill.clear_cache()  # the limit is read when the kernel is traced
    try:
        o, hT, _, _ = _run(mode, q, k, v, a, b, cu, spec, initial_state=h0, A_log=A_log,
                           dt_bias=dt_bias)
    finally:
        kern.chunk_prefill.clear_cache()
    assert np.all(np.isfinite(np.asarray(o, F32))) and np.all(np.isfinite(np.asarray(hT)))
    ro, rs = _oracle(q, k, v, g, ref.gdn_beta(b), h0, cu)
    assert rel_err(o, ro) <= 5e-3
    assert rel_err(hT, rs) <= 5e-4


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("exact_only", [False, True])
def test_kda_factored_and_exact_diagonal_blocks(mode, exact_only, monkeypatch):
    """One call whose chunks' diagonal blocks take both forms (mild gates; a stretch of gates
    spanning 1e-7..1e3 with resets), and the same call with the exact form forced everywhere."""
    lens, HK, HV, K = [200, 64], 1, 2, 16
    q, k, v, g, beta, h0, cu = _kda_inputs(26, lens, HK=HK, HV=HV, K=K)
    rng = np.random.default_rng(27)
    g = np.asarray(g).copy()
    g[70:120, 1] = -(10.0 ** rng.uniform(-7, 3, (50, K)))
    g[90, 1, ::3] = -np.inf
    g = jnp.asarray(g)
    spans = _diag_spans(g, cu)
    spec = _spec(HK, HV, K, K, has_initial_state=True, per_channel_gate=True)
    assert spans.min() <= kern._diag_exp_limit(spec) < spans.max()
    if exact_only:
        monkeypatch.setattr(kern, "_diag_exp_limit", lambda spec: -1.0)
    kern.chunk_prefill.clear_cache()  # the limit is read when the kernel is traced
    try:
        o, hT, _, _ = _run(mode, q, k, v, g, beta, cu, spec, initial_state=h0)
    finally:
        kern.chunk_prefill.clear_cache()
    ro, rs = _oracle(q, k, v, g, beta, h0, cu)
    assert rel_err(o, ro) <= 1e-5
    assert rel_err(hT, rs) <= 1e-5


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_kda_large_rows_factored_diagonal(mode, dtype):
    """q, k rows of norm ~6e4 (L2-normalised in the kernel) with every gate at one value, so
    that the factored diagonal blocks run at their limit (`_diag_exp_limit`): fp32 inputs at 40
    (gates -2.5: the lower bound's sigmoid at 0.5), bf16 inputs at 80 (every gate at the bound
    -5). Their entries above the diagonal overflow (up to e^80, e^160 times the rows' product),
    which must stay out of the kept entries; the result equals float64 (fp32 <= 1e-5, bf16
    inputs <= 5e-3 and the state <= 1e-3)."""
    lens, HK, HV, K = [100, 40], 1, 2, 32
    q, k, v, _, b, h0, cu = _kda_inputs(33, lens, HK=HK, HV=HV, K=K, dtype=dtype)
    q, k = ((1e4 * x.astype(F32)).astype(dtype) for x in (q, k))
    precise = dtype == F32
    # sigmoid(e^A_log (a + dt)) = 1/2 (g = -2.5) at a = 0, = 1 (g = -5) at a = 40
    a = jnp.full((sum(lens), HV, K), 0.0 if precise else 40.0, F32)
    A_log, dt_bias = jnp.zeros(HV, F32), jnp.zeros(HV * K, F32)
    spec = _spec(HK, HV, K, K, has_initial_state=True, per_channel_gate=True, raw_gates=True,
                 gate_lower_bound=-5.0, precise=precise)
    g = ref.kda_gate(a, A_log, dt_bias.reshape(HV, K), lower_bound=-5.0)
    assert np.all(np.asarray(g) == (-2.5 if precise else -5.0))
    assert _diag_spans(g, cu).max() == kern._diag_exp_limit(spec)
    assert kern._factored_diagonal_always_safe(spec) != precise   # fp32: checked at run time
    o, hT, _, _ = _run(mode, q, k, v, a, b, cu, spec, initial_state=h0, A_log=A_log,
                       dt_bias=dt_bias)
    ro, rs = _oracle(q, k, v, g, ref.gdn_beta(b), h0, cu)
    assert rel_err(o, ro) <= (1e-5 if precise else 5e-3)
    assert rel_err(hT, rs) <= (1e-5 if precise else 1e-3)


def _kda_intra_oracle(q, k, g, cu, HV, scale, l2=True):
    """float64 intra-chunk products and decayed rows, chunk by chunk: kk (j < i), aqk (j <= i)
    [T, HV, C], q e^G, k e^{G_C - G}, e^G k [T, HV, K] (q, k L2-normalised unless told
    otherwise, q scaled) and the total decay e^{G_C} of every chunk, [chunks, HV, K] in chunk
    order."""
    q, k, g = (np.asarray(jnp.asarray(x, F32), np.float64) for x in (q, k, g))
    g = np.maximum(g, kern.GATE_FLOOR)
    rep = HV // q.shape[1]
    norm = lambda x: np.repeat(x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6) if l2 else x,
                               rep, axis=1)
    qn, kn = norm(q) * scale, norm(k)
    T, K, C = q.shape[0], q.shape[2], kern.CHUNK
    kk, aqk = np.zeros((T, HV, C)), np.zeros((T, HV, C))
    fq, fk, ek, decays = np.zeros((T, HV, K)), np.zeros((T, HV, K)), np.zeros((T, HV, K)), []
    cu = np.asarray(cu)
    for a, b in zip(cu[:-1], cu[1:]):
        for t0 in range(a, b, C):
            rows = slice(t0, min(t0 + C, b))
            n = rows.stop - t0
            G = np.cumsum(g[rows], axis=0)                                     # [n, HV, K]
            e = np.exp(np.where(np.tril(np.ones((n, n)))[:, :, None, None] > 0,
                                G[:, None] - G[None, :], -np.inf))            # [i, j, HV, K]
            kk[rows, :, :n] = np.einsum("ihc,jhc,ijhc->ihj", kn[rows], kn[rows], e)
            kk[rows, :, :n] *= np.tril(np.ones((n, n)), -1)[:, None, :]
            aqk[rows, :, :n] = np.einsum("ihc,jhc,ijhc->ihj", qn[rows], kn[rows], e)
            fq[rows], ek[rows] = qn[rows] * np.exp(G), kn[rows] * np.exp(G)
            fk[rows] = kn[rows] * np.exp(G[-1] - G)
            decays.append(np.exp(G[-1]))
    return kk, aqk, fq, fk, ek, np.stack(decays)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lens,HK,HV,K,block_k,raw", [([100], 1, 2, 256, 64, False),
                                                      ([37, 5, 70], 1, 2, 32, 16, True)],
                         ids=["K256", "ragged_lower_bound"])
def test_kda_intra_kernel_against_float64(mode, lens, HK, HV, K, block_k, raw):
    """The intra-chunk kernel alone: kk, aqk, the decayed rows and the chunk decays equal a
    float64 einsum over every chunk, ragged ones (T not a multiple of 64) included. K = 256:
    head 0's gates are mild (factored diagonal blocks), head 1's span 1e-7..1e3 with resets in
    the first chunk (exact diagonal blocks there) and are mild after; with fp32 inputs the raw
    lower-bound gate's chunks are checked at run time too (`_diag_exp_limit`)."""
    q, k, _, g, _, _, cu = _kda_inputs(41, lens, HK=HK, HV=HV, K=K)
    rng = np.random.default_rng(42)
    A_log = dt_bias = None
    if raw:
        a = jnp.asarray(2 * rng.standard_normal(g.shape), F32)
        A_log = jnp.asarray(rng.standard_normal(HV), F32)
        dt_bias = jnp.asarray(rng.standard_normal(HV * K), F32)
        g_in, g = a, ref.kda_gate(a, A_log, dt_bias.reshape(HV, K), lower_bound=-5.0)
    else:
        g = np.asarray(g).copy()
        g[:64, 1] = -(10.0 ** rng.uniform(-7, 3, (64, K)))
        g[20, 1, ::5] = -np.inf
        g_in = g = jnp.asarray(g)
    spec = _spec(HK, HV, K, K, per_channel_gate=True, raw_gates=raw,
                 gate_lower_bound=-5.0 if raw else None)
    if not raw:
        spans = _diag_spans(g, cu).reshape(-1, HV)
        assert spans[:, 0].max() <= kern._diag_exp_limit(spec) < spans[0, 1]
    start, length, _, _ = kern.chunk_table(cu, q.shape[0])
    A_log = jnp.zeros((HV,), F32) if A_log is None else A_log
    dt_bias = jnp.zeros((HV,), F32) if dt_bias is None else dt_bias
    intra = functools.partial(kern._kda_intra, q, k, g_in, start, length, A_log, dt_bias,
                              spec=spec, block=kern.PrefillBlockSizes(block_k=block_k),
                              interpret=mode == "interpret")
    kk, aqk, fq, fk, ek, decay = (np.asarray(x) for x in intra(rows_dtype=F32))
    assert ek.shape[0] == 1   # fp32 rows: e^G k in one part
    ek = ek[0]
    want = _kda_intra_oracle(q, k, g, cu, HV, spec.scale)
    # bf16 rows (bf16 inputs): e^G k as bf16 hi and lo parts, ~16 bits together
    ek2 = intra(rows_dtype=BF16)[4]
    assert ek2.shape[0] == 2 and ek2.dtype == BF16
    assert rel_err(ek2[0].astype(F32) + ek2[1].astype(F32), want[4]) <= 2e-5
    assert rel_err(ek2[0], want[4]) > 1e-4       # the lo part carries what bf16 alone drops
    decay = decay[np.asarray(length) > 0]  # chunk slots in order; unused slots are not written
    for name, x, y in zip(("kk", "aqk", "fq", "fk", "ek", "decay"),
                          (kk, aqk, fq, fk, ek, decay), want):
        for h in range(HV):
            assert rel_err(x[..., h, :], y[..., h, :]) <= 1e-5, (name, h)
    # the masks are exact zeros: kk strictly below the diagonal, aqk on and below it
    i = np.arange(q.shape[0]) - np.repeat(np.asarray(start)[np.asarray(length) > 0],
                                          np.asarray(length)[np.asarray(length) > 0])
    above = np.arange(kern.CHUNK)[None, :] >= i[:, None]
    assert np.all(kk[:, :, :][above[:, None, :].repeat(HV, 1)] == 0)
    assert np.all(aqk[(above & (np.arange(kern.CHUNK)[None, :] > i[:, None]))[:, None, :]
                      .repeat(HV, 1)] == 0)


@pytest.mark.parametrize("mode", MODES)
def test_kda_intra_kernel_unnormalised_rows_of_every_scale(mode):
    """bf16 inputs without the q/k L2 norm: the intra kernel scales each row by a power of two
    into [0.5, 1) and its products and decayed rows back (`_intra_rows_bounded`), so it takes
    the bounded rows' limit (80) and fp16 operands whatever the rows' scale. Rows from ~2^-40
    to ~2^40 times a normal row, a zero row, and gates whose diagonal-block exponents pass the
    raw rows' limit (40, that of fp32 inputs) without passing 80 (formed factored, not redone):
    every output against a float64 einsum, each entry's error relative to the scale of the
    rows it is made of."""
    lens, HK, HV, K = [100, 37], 1, 2, 32
    q, k, _, g, _, _, cu = _kda_inputs(43, lens, HK=HK, HV=HV, K=K)
    rng = np.random.default_rng(44)
    T = sum(lens)
    scales = 2.0 ** rng.integers(-40, 41, (2, T, HK, 1))
    q, k = ((x * s).astype(BF16) for x, s in zip((q, k), scales))
    k = k.at[5].set(0)
    g = np.asarray(g).copy()
    g[:, 1] = -3.75 + 0.1 * rng.standard_normal((T, K))    # 16 rows span ~60
    g = jnp.asarray(g)
    spec = _spec(HK, HV, K, K, per_channel_gate=True, use_qk_l2norm=False, precise=False)
    spans = _diag_spans(g, cu).reshape(-1, HV)
    assert kern.DIAG_EXP_LIMIT < spans[:, 1].min() and spans.max() <= kern._diag_exp_limit(spec)
    start, length, _, _ = kern.chunk_table(cu, T)
    kk, aqk, fq, fk, ek, decay = kern._kda_intra(
        q, k, g, start, length, jnp.zeros((HV,), F32), jnp.zeros((HV,), F32), rows_dtype=BF16,
        spec=spec, block=kern.PrefillBlockSizes(block_k=16), interpret=mode == "interpret")
    want = _kda_intra_oracle(q, k, g, cu, HV, spec.scale, l2=False)
    ek = np.asarray(ek[0], F32) + np.asarray(ek[1], F32)
    nq, nk = (np.repeat(np.linalg.norm(np.asarray(x, np.float64), axis=-1), HV // HK, axis=1)
              for x in (q, k))                                             # [T, HV]
    i = np.arange(T) - np.repeat(np.asarray(start)[np.asarray(length) > 0],
                                 np.asarray(length)[np.asarray(length) > 0])
    # each chunk's column j is the row start + j of its chunk
    col_rows = (np.arange(T) - i)[:, None] + np.arange(kern.CHUNK)[None, :]
    col_nk = nk[np.minimum(col_rows, T - 1)]                                # [T, C, HV]
    for name, x, y, size in (
            ("kk", kk, want[0], nk[:, :, None] * col_nk.transpose(0, 2, 1)),
            ("aqk", aqk, want[1], spec.scale * nq[:, :, None] * col_nk.transpose(0, 2, 1)),
            ("fq", fq, want[2], spec.scale * nq[:, :, None]),
            ("fk", fk, want[3], nk[:, :, None]), ("ek", ek, want[4], nk[:, :, None])):
        err = np.abs(np.asarray(x, np.float64) - y) / np.maximum(size, 1e-300)
        assert np.all(np.isfinite(np.asarray(x, F32))), name
        # (fq is stored in bf16: 2^-9 of an entry)
        assert err.max() <= (4e-3 if name == "fq" else 2e-3), (name, err.max())
    length = np.asarray(length)
    assert rel_err(np.asarray(decay)[length > 0], want[5]) <= 1e-5


@pytest.mark.parametrize("mode", MODES)
def test_kda_prefill_pool_lower_bound_gate(mode):
    """KDA (GLM-5.3-Flash form: lower-bound raw gate) through gdn_prefill_pool."""
    from gdn_jax.prefill import gdn_prefill_pool, reference_prefill_pool
    lens = [50, 80]
    HK, HV, K = 1, 2, 32
    q, k, v, _, b, h0, cu = _kda_inputs(31, lens, HK=HK, HV=HV, K=K)
    rng = np.random.default_rng(32)
    a = jnp.asarray(2 * rng.standard_normal((1, sum(lens), HV, K)), F32)
    A_log, dt_bias = jnp.asarray(rng.standard_normal(HV), F32), jnp.asarray(rng.standard_normal(HV * K), F32)
    pool_np = np.concatenate([np.asarray(h0), np.full((2, HV, K, K), 1e30, np.float32)])
    pool = jnp.asarray(pool_np)
    slots = jnp.asarray([1, 0], jnp.int32)
    kw = dict(cu_seqlens=cu, use_qk_l2norm=True, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
    args = (q[None], k[None], v[None], a, b[None])
    want_o, want_pool = reference_prefill_pool(*args, pool, slots, **kw)
    o, got = gdn_prefill_pool(*args, pool, slots, interpret=mode == "interpret", **kw)
    assert rel_err(o, want_o) <= 1e-5
    assert rel_err(got[:2], want_pool[:2]) <= 1e-5
    assert np.array_equal(np.asarray(got[2:]), pool_np[2:])  # the argument pool was donated


@pytest.mark.gpu
@pytest.mark.parametrize("kda,dtype,l2", [(False, BF16, True), (False, F32, True), (True, BF16, True),
                                          (True, F32, True), (False, BF16, False),
                                          (True, BF16, False), (False, F16, True),
                                          (True, F16, True)],
                         ids=["gdn", "gdn_fp32", "kda", "kda_fp32", "gdn_no_norm", "kda_no_norm",
                              "gdn_fp16", "kda_fp16"])
@pytest.mark.parametrize("K", [128, 256])
@pytest.mark.parametrize("lens", [[130], [70] * 32], ids=["few_pairs", "many_pairs"])
def test_default_blocks_fit_the_gpu(kda, dtype, l2, K, lens):
    """The default launch shapes compile and run at the production head dims, on both sides of
    the block-size rule (few and many (sequence, head) pairs), with and without the in-kernel
    q/k L2 norm (without it KDA's 16-bit calls carry fp32 intermediates): a shared-memory
    overflow shows only when the kernel is built for a real GPU."""
    HK, HV = 2, 4
    inputs = (_kda_inputs(31, lens, HK=HK, HV=HV, K=K, dtype=dtype) if kda else
              _packed_inputs(31, lens, HK=HK, HV=HV, K=K, V=K, dtype=dtype))
    q, k, v, g, beta, h0, cu = inputs
    if not l2:  # unit rows given, as a caller that normalises q and k itself passes them
        q, k = (ref.l2norm(x).astype(x.dtype) for x in (q, k))
    spec = _spec(HK, HV, K, K, has_initial_state=True, precise=dtype == F32,
                 per_channel_gate=kda, use_qk_l2norm=l2, aligned_chunks=_aligned(lens))
    block = kern.PrefillBlockSizes.get_default(spec, len(lens), dtype)
    assert kern.unsupported_reason(spec, block) is None
    o, hT, _, _ = kern.chunk_prefill(q, k, v, g, beta, cu, spec=spec, block=block,
                                     initial_state=h0)
    ro, rs = _oracle(q, k, v, g, beta, h0, cu, l2=l2)
    tol = 1e-5 if dtype == F32 else 5e-3
    assert rel_err(o, ro) <= tol
    assert rel_err(hT, rs) <= tol


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the no-kernel path is the CPU's")
def test_prefill_entry_points_without_a_kernel():
    """Off a GPU and outside interpret mode: "auto" runs the pure-JAX path, "pallas" and chunk
    states say why they cannot run; `gdn_jax.interpret()` switches the kernels on."""
    import gdn_jax
    from gdn_jax.prefill import gdn_prefill, gdn_prefill_pool, reference_prefill_pool
    q, k, v, g, beta, h0, cu = _packed_inputs(41, [20, 9], HK=1, HV=2, K=16, V=16)
    args = (q[None], k[None], v[None], g[None], beta[None])
    o, hT, chunks = gdn_prefill(*args, cu_seqlens=cu, initial_state=h0, use_qk_l2norm=True)
    ro, rs = _oracle(q, k, v, g, beta, h0, cu)
    assert chunks is None and rel_err(o[0], ro) <= 1e-5 and rel_err(hT, rs) <= 1e-5
    with pytest.raises(ValueError, match="impl='pallas'.*GPU"):
        gdn_prefill(*args, cu_seqlens=cu, impl="pallas")
    with pytest.raises(ValueError, match="chunk_states"):
        gdn_prefill(*args, cu_seqlens=cu, chunk_states=True)
    with pytest.raises(ValueError, match="impl must be one of"):
        gdn_prefill(*args, cu_seqlens=cu, impl="chunked")
    pool, slots = jnp.asarray(np.asarray(h0)), jnp.asarray([1, 0], jnp.int32)
    want = reference_prefill_pool(*args, pool, slots, cu_seqlens=cu)
    got = gdn_prefill_pool(*args, jnp.array(pool, copy=True), slots, cu_seqlens=cu)
    assert rel_err(got[0], want[0]) <= 1e-6 and rel_err(got[1], want[1]) <= 1e-6
    with gdn_jax.interpret():
        _, _, chunks = gdn_prefill(*args, cu_seqlens=cu, chunk_states=True)
    assert np.asarray(chunks.count).tolist() == [1, 1]


def test_front_door_takes_fp32_inputs_at_every_head_dim():
    """The chunked family's support check sees the gate form: fp32 inputs at K = V = 128 and 256
    run for GDN and for KDA (whose prep forms W and U in column blocks and whose scan takes one
    pipeline stage for fp32 rows, so both fit an H200's shared memory), and so do bf16 ones."""
    from gdn_jax.prefill import CHUNKED_FAMILY, prefill_call
    for K in (128, 256):
        q = jnp.zeros((1, 8, 2, K), F32)
        v = jnp.zeros((1, 8, 4, K), F32)
        for g in (jnp.zeros((1, 8, 4)), jnp.zeros((1, 8, 4, K))):
            assert CHUNKED_FAMILY.supports(prefill_call(q, v, g)) is None
            assert CHUNKED_FAMILY.supports(prefill_call(q.astype(BF16), v.astype(BF16), g)) is None
