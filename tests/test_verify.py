"""Speculative verify (gdn_jax.verify, gdn_jax.carry, gdn_jax.conv_carry, pallas_kernels/gdn_verify.py)
against plain decode.

The oracle is always plain sequential decode of the accepted tokens on the same pool:
`verify.pool_decode_reference` for the pure-JAX paths, the decode *kernel*
(`gdn_jax.decode.gdn_decode_pool`) for the Pallas paths. Randomized schedules mix verify /
accept / decode rounds over many slots (random accepted counts, padding rows, slots touched at
random so they differ in age and in what is pending), and must end in the same pool and produce
the same outputs: bitwise for the exact flavour, <= 1e-6 relative for the fast one.

Bitwise on the CPU: XLA contracts a product and an add into an FMA differently in different
programs, so every schedule step is compiled with fusion disabled there (`NO_FUSION`); the
Pallas kernels on the GPU are compiled by Triton and compared as they are.
"""

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FULL, MODES, ON_GPU
from gdn_jax import carry
from gdn_jax import conv_carry
from gdn_jax import decode as dec
from gdn_jax import verify as vf
from gdn_jax.state import ConvPool, ConvStash, DeltaPool, DeltaStash
from helpers import rel_err
from pallas_kernels import gdn_verify as kv

F32, F16, BF16 = jnp.float32, jnp.float16, jnp.bfloat16
NO_FUSION = {"xla_disable_hlo_passes": "fusion", "xla_backend_optimization_level": 0}
SENTINEL = 1e30


def _jit(f, mode="reference", **kw):
    """Compiled Triton kernels are compared as they are; XLA programs (the references, and the
    interpret-mode kernels) are compiled without fusion so that no FMA contraction differs."""
    return jax.jit(f, compiler_options=None if mode == "gpu" else NO_FUSION, **kw)


def _impl(mode):
    return ("reference", False) if mode == "reference" else ("pallas", not ON_GPU)


# --------------------------------------------------------------------------- random inputs

def _tokens(rng, *, B, T, HK, HV, K, V, kind, dtype=F32):
    """Fresh random verify tokens (never zeros), numpy-drawn (no per-shape compile)."""
    n = lambda *s: rng.standard_normal(s, dtype=np.float32)
    g = -np.logaddexp(0.0, n(*((B, T, HV) if kind == "gdn" else (B, T, HV, K))) - 1.0)
    beta = 1.0 / (1.0 + np.exp(-n(B, T, HV)))
    cast = lambda x: jnp.asarray(x).astype(dtype)
    return (cast(n(B, T, HK, K)), cast(n(B, T, HK, K)), cast(n(B, T, HV, V)),
            jnp.asarray(g, F32), jnp.asarray(beta, F32))


def _pool(rng, *, S, HV, K, V, dtype, sentinels):
    """Slots at different scales (different 'ages'); the last `sentinels` slots hold 1e30 and
    are never named: they must come out bit-for-bit unchanged."""
    scale = rng.uniform(0.05, 0.6, size=(S, 1, 1, 1)).astype(np.float32)
    p = scale * rng.standard_normal((S, HV, K, V), dtype=np.float32)
    p[S - sentinels:] = SENTINEL
    return jnp.asarray(p).astype(dtype)


def _slot_table(rng, B, used):
    n_live = int(rng.integers(1, B + 1))
    table = np.full(B, -1, np.int32)
    table[:n_live] = rng.choice(used, size=min(n_live, used), replace=False)
    rng.shuffle(table)
    return jnp.asarray(table)


# --------------------------------------------------------------------------- the two paths

@dataclasses.dataclass(frozen=True)
class Case:
    kind: str = "gdn"
    B: int = 4
    HK: int = 1
    HV: int = 2
    K: int = 16
    V: int = 16
    S: int = 7            # pool slots; the last `sentinels` are never named
    sentinels: int = 2
    state_dtype: object = F32
    in_dtype: object = F32
    exact: bool = True

    @property
    def used(self):
        return self.S - self.sentinels


def _decode_fn(mode, case):
    """Plain single-token decode on a pool: the oracle (and the carried path's consumer)."""
    if mode == "reference":
        return lambda q, k, v, g, b, pool, slots: vf.pool_decode_reference(
            q, k, v, g, b, pool, slots, use_qk_l2norm=True)
    B = case.B

    def kernel_decode(q, k, v, g, b, pool, slots):
        qkv = jnp.concatenate([q.reshape(B, -1), k.reshape(B, -1), v.reshape(B, -1)], axis=1)
        return dec.gdn_decode_pool(qkv, g.reshape(B, -1), b, pool, slots, num_k_heads=case.HK,
                                   num_v_heads=case.HV, head_k_dim=case.K, head_v_dim=case.V,
                                   per_channel_gate=case.kind == "kda", use_qk_l2norm=True,
                                   impl="pallas", interpret=not ON_GPU)
    return kernel_decode


class Schedule:
    """Compiled round functions for one case and mode (compiled once, reused every round)."""

    def __init__(self, mode, case, path="carried"):
        impl, interp = _impl(mode)
        decode = _decode_fn(mode, case)
        exact = case.exact

        def carried_round(q, k, v, g, b, pool, stash, slots, accepted):
            o, dp, refused = carry.carried_verify(q, k, v, g, b, DeltaPool(pool, stash), slots,
                                                  exact=exact, use_qk_l2norm=True, impl=impl,
                                                  interpret=interp)
            dp, bad = carry.accept(dp, slots, accepted, impl=impl, interpret=interp)
            return o, dp.states, dp.stash, bad | refused

        def states_round(q, k, v, g, b, pool, slots, accepted):
            o, states = vf.verify_states(q, k, v, g, b, pool, slots, use_qk_l2norm=True, impl=impl,
                                         interpret=interp)
            pool, bad = vf.commit_states(pool, states, slots, accepted)
            return o, pool, bad

        def carried_decode(q, k, v, g, b, pool, stash, slots):
            dp = carry.flush(DeltaPool(pool, stash), slots, impl=impl, interpret=interp)
            o, pool = decode(q, k, v, g, b, dp.states, slots)
            return o, pool, dp.stash

        def oracle_round(q, k, v, g, b, pool, slots, accepted):
            """T decode steps (one compiled step, scanned); the pool keeps each row's state
            after its last accepted token."""
            def step(cur, tok):
                o, cur = decode(*tok, cur, slots)
                return cur, (o, cur)
            toks = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, b))
            _, (outs, pools) = jax.lax.scan(step, pool, toks)          # pools [T, S, HV, K, V]
            live = slots >= 0
            chosen = pools[jnp.clip(accepted - 1, 0, q.shape[1] - 1), jnp.where(live, slots, 0)]
            pool = pool.at[jnp.where(live, slots, pool.shape[0])].set(chosen, mode="drop")
            return jnp.moveaxis(outs, 0, 1), pool

        # One compiled program per round kind, holding both the path under test and the oracle
        # (compiles dominate the CPU time of these tests).
        def verify_both(toks, pool, stash, oracle, slots, accepted):
            want = oracle_round(*toks, oracle, slots, accepted)
            if path == "carried":
                o, pool, stash, bad = carried_round(*toks, pool, stash, slots, accepted)
            else:
                o, pool, bad = states_round(*toks, pool, slots, accepted)
            return (o, pool, stash, bad), want

        def decode_both(toks, pool, stash, oracle, slots):
            want = decode(*toks, oracle, slots)
            if path == "carried":
                return carried_decode(*toks, pool, stash, slots), want
            o, pool = decode(*toks, pool, slots)
            return (o, pool, stash), want

        def flush_all(pool, stash):
            dp = carry.flush(DeltaPool(pool, stash), impl=impl, interpret=interp)
            return dp.states, dp.stash

        self.verify_both = _jit(verify_both, mode)
        self.decode_both = _jit(decode_both, mode)
        self.flush_all = _jit(flush_all, mode)
        self.oracle_round = _jit(oracle_round, mode)


def _compare(got, want, exact, what):
    if exact:
        np.testing.assert_array_equal(np.asarray(got.astype(F32)), np.asarray(want.astype(F32)),
                                      err_msg=f"{what}: not bit-identical to plain decode")
    else:
        err = rel_err(got, want)
        assert err <= 1e-6, f"{what}: relative error {err:.3g} > 1e-6"


def run_schedule(mode, case, *, seed, rounds, widths=(3,), path="carried", decode_every=3):
    """Random verify/accept/decode rounds on the carried (or intermediate-state) path and on the
    oracle; every output compared as it comes, the pools at the end (after a full flush)."""
    rng = np.random.default_rng(seed)
    sched = Schedule(mode, case, path)
    pool0 = _pool(rng, S=case.S, HV=case.HV, K=case.K, V=case.V, dtype=case.state_dtype,
                  sentinels=case.sentinels)
    pool, oracle = jnp.array(pool0, copy=True), jnp.array(pool0, copy=True)
    stash = DeltaStash.init(case.S, num_v_heads=case.HV, num_k_heads=case.HK, head_k_dim=case.K,
                               head_v_dim=case.V,
                               per_channel_gate=case.kind == "kda")
    dims = dict(HK=case.HK, HV=case.HV, K=case.K, V=case.V, kind=case.kind, dtype=case.in_dtype)
    n_verify = 0
    for r in range(rounds):
        slots = _slot_table(rng, case.B, case.used)
        if r % decode_every == decode_every - 1:
            toks = tuple(x[:, 0] for x in _tokens(rng, B=case.B, T=1, **dims))
            (o, pool, stash), (want_o, oracle) = sched.decode_both(toks, pool, stash, oracle, slots)
            _compare(o, want_o, case.exact, f"round {r} decode")
            continue
        T = widths[n_verify % len(widths)]
        n_verify += 1
        toks = _tokens(rng, B=case.B, T=T, **dims)
        accepted = jnp.asarray(np.where(np.asarray(slots) >= 0, rng.integers(1, T + 1, case.B), 0),
                               jnp.int32)
        (o, pool, stash, bad), (want_o, oracle) = sched.verify_both(toks, pool, stash, oracle, slots,
                                                                   accepted)
        assert not np.any(np.asarray(bad)), f"round {r}: valid accepted counts were flagged"
        _compare(o, want_o, case.exact, f"round {r} verify outputs (T={T})")
    if path == "carried":
        assert np.any(np.asarray(stash.pending) > 0), "schedule ended with nothing pending: weak test"
        pool, stash = sched.flush_all(pool, stash)
        assert not np.any(np.asarray(stash.pending)), "flush left rows pending"
    _compare(pool[:case.used], oracle[:case.used], case.exact, "final pool")
    np.testing.assert_array_equal(np.asarray(pool[case.used:].astype(F32)),
                                  np.asarray(pool0[case.used:].astype(F32)),
                                  err_msg="a sentinel (never named) slot was touched")
    assert np.all(np.asarray(pool0[case.used:].astype(F32)) > 1e29)
    return pool


# --------------------------------------------------------------------------- schedules

SCHEDULES = [
    # id, case, widths, modes (CPU time is compile-bound: the pure-JAX reference runs the
    # flavour/dtype corners, interpret mode every kernel variant, the GPU all of them)
    ("gdn-f32-exact", Case(), (2, 4), ("reference", "interpret")),
    ("kda-f32-exact", Case(kind="kda", HK=2, HV=4), (4,), ("interpret",)),
    ("gdn-bf16-exact", Case(state_dtype=BF16, in_dtype=BF16), (3,), ("interpret",)),
    ("kda-f16-exact", Case(kind="kda", state_dtype=F16), (2,), ("reference", "interpret")),
    ("gdn-f32-fast", Case(exact=False), (4,), ("interpret",)),
    # fast: fp32 outputs (a 1e-7 difference may flip the rounding of a 16-bit output)
    ("kda-f32-fast", Case(kind="kda", exact=False), (3,), ("reference", "interpret")),
]
_GPU = pytest.mark.gpu
# In the full CPU matrix only: each family, flavour, state dtype and mode keeps a default case
# (the fast GDN flavour also in test_fast_flavour_matches_reference_interpret).
SCHEDULES_FULL = {"gdn-f32-exact-reference", "kda-f16-exact-reference", "gdn-f32-fast-interpret",
                  "kda-f32-exact-interpret"}


def _schedule_params():
    for name, case, widths, modes in SCHEDULES:
        for mode in (*modes, "gpu"):
            case_id = f"{name}-{mode}"
            marks = (_GPU,) if mode == "gpu" else (FULL,) if case_id in SCHEDULES_FULL else ()
            yield pytest.param(mode, case, widths, id=case_id, marks=marks)


@pytest.mark.parametrize("mode,case,widths", list(_schedule_params()))
def test_carried_schedule_matches_sequential_decode(mode, case, widths, request):
    if mode == "gpu":  # B > 8: the decode table's large-batch tile, as in the benchmark
        case = dataclasses.replace(case, B=12, S=19, K=128, V=128, HV=case.HV * 2)
    run_schedule(mode, case, seed=zlib.crc32(request.node.callspec.id.encode()),
                 rounds=10 if mode == "interpret" else 16, widths=widths)


@pytest.mark.parametrize("mode,kind,sdt", [pytest.param("reference", "gdn", F32, marks=FULL),
                                           ("interpret", "kda", BF16),
                                           pytest.param("gpu", "gdn", F32, marks=_GPU),
                                           pytest.param("gpu", "kda", BF16, marks=_GPU)])
def test_intermediate_states_schedule_matches_sequential_decode(mode, kind, sdt):
    case = Case(kind=kind, state_dtype=sdt)
    if mode == "gpu":
        case = dataclasses.replace(case, B=12, S=19, K=128, V=128)
    run_schedule(mode, case, seed=7, rounds=8, widths=(4, 2), path="intermediate")


# --------------------------------------------------------------------------- engage decision

GO = carry.CarryRequest(requested=True, num_tokens=2, state_dtype=F32, head_k_dim=128, head_v_dim=128,
                     exact=False, kernel_available=True, stash_capacity=4)

ENGAGE_TABLE = [
    # (change to GO, engages)
    ({}, True),
    ({"num_tokens": 3}, True),
    ({"num_tokens": 4}, True),
    ({"requested": False}, False),
    ({"num_tokens": 1}, False),
    ({"num_tokens": 5}, False),
    ({"state_dtype": F16}, False),                      # fast flavour cannot carry 16-bit
    ({"state_dtype": BF16}, False),
    ({"state_dtype": F16, "exact": True}, True),        # the exact flavour rounds like decode
    ({"state_dtype": BF16, "exact": True}, True),
    ({"state_dtype": jnp.float64, "exact": True}, False),
    ({"head_k_dim": 96}, False),
    ({"head_v_dim": 512}, False),
    ({"head_k_dim": 64, "head_v_dim": 256}, True),
    ({"kernel_available": False}, False),
    ({"stash_capacity": 0}, False),                     # no stash bound
    ({"num_tokens": 4, "stash_capacity": 3}, False),    # stash too small for this width
    ({"num_tokens": 3, "stash_capacity": 3}, True),
]


@pytest.mark.parametrize("change,engages", ENGAGE_TABLE, ids=[str(c) for c, _ in ENGAGE_TABLE])
def test_carry_engage_decision_table(change, engages):
    assert carry.carry_engages(dataclasses.replace(GO, **change)) is engages


def test_kernel_available_reflects_backend_and_shapes():
    assert carry.kernel_available(4, 128, 128, F32, interpret=True)
    assert carry.kernel_available(4, 128, 128, BF16, exact=True, interpret=True)
    assert not carry.kernel_available(4, 128, 128, BF16, exact=False, interpret=True)
    assert not carry.kernel_available(5, 128, 128, F32, interpret=True)
    assert not carry.kernel_available(2, 96, 128, F32, interpret=True)
    assert carry.kernel_available(2, 128, 128, F32) == ON_GPU


# --------------------------------------------------------------------------- refusals

def _small(seed=0, *, B=3, T=3, kind="gdn", S=5, sdt=F32):
    rng = np.random.default_rng(seed)
    toks = _tokens(rng, B=B, T=T, HK=1, HV=2, K=16, V=16, kind=kind)
    pool = _pool(rng, S=S, HV=2, K=16, V=16, dtype=sdt, sentinels=0)
    stash = DeltaStash.init(S, num_v_heads=2, num_k_heads=1, head_k_dim=16, head_v_dim=16,
                               per_channel_gate=kind == "kda")
    return toks, pool, stash


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "fast"])
def test_kernel_writes_the_counters_of_its_slots_only(exact):
    """The carried-verify kernel updates the named slots' counters in the same launch (bank
    flipped, pending 0, drafted T) and leaves every other slot's, padding included, as it was."""
    toks, pool, stash = _small(7, B=3, T=3, S=6)
    stash = dataclasses.replace(stash, bank=jnp.asarray([1, 0, 1, 1, 0, 1], jnp.int32),
                                pending=jnp.asarray([2, 1, 3, 0, 2, 1], jnp.int32),
                                drafted=jnp.asarray([0, 3, 0, 2, 0, 0], jnp.int32))  # 4, 0: verdicts given
    slots = jnp.asarray([4, -1, 0], jnp.int32)
    got = carry.carried_verify(*toks, DeltaPool(jnp.array(pool, copy=True), stash), slots,
                               exact=exact, impl="pallas", interpret=True)[1].stash
    for name, want in (("bank", [0, 0, 1, 1, 1, 1]), ("pending", [0, 1, 3, 0, 0, 1]),
                       ("drafted", [3, 3, 0, 2, 3, 0])):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), want, err_msg=name)


@pytest.mark.parametrize("bad", [0, 4, -1, 9])
def test_accept_refuses_bad_counts_on_host(bad):
    toks, pool, stash = _small()
    slots = jnp.asarray([2, -1, 0], jnp.int32)
    o, dp, _ = carry.carried_verify(*toks, DeltaPool(pool, stash), slots, impl="reference")
    with pytest.raises(ValueError, match="accepted"):
        carry.accept(dp, slots, jnp.asarray([bad, 0, 1], jnp.int32), num_tokens=3)
    # the padding row's value is ignored; 1..T is fine
    dp, invalid = carry.accept(dp, slots, jnp.asarray([3, 77, 1], jnp.int32), num_tokens=3)
    stash = dp.stash
    assert not np.any(np.asarray(invalid))
    np.testing.assert_array_equal(np.asarray(stash.pending)[[2, 0]], [3, 1])
    np.testing.assert_array_equal(np.asarray(stash.drafted)[[2, 0]], [0, 0])


@pytest.mark.parametrize("mode", MODES)
def test_accept_traced_bad_counts_are_masked_no_ops_and_flagged(mode):
    impl, interp = _impl(mode)
    toks, pool, stash = _small()
    slots = jnp.asarray([2, 4, 0], jnp.int32)
    o, dp, _ = carry.carried_verify(*toks, DeltaPool(pool, stash), slots, impl="reference")
    before = jax.tree.map(np.asarray, dp.stash)
    accept = jax.jit(lambda s, sl, a: carry.accept(DeltaPool(dp.states, s), sl, a, impl=impl,
                                                   interpret=interp)[::-1])
    # 4 > drafted (3), 0 < 1: both rows left as they were and flagged; row 1 is fine.
    invalid, pool2 = accept(jax.tree.map(jnp.asarray, before), slots, jnp.asarray([4, 2, 0], jnp.int32))
    stash2 = pool2.stash
    np.testing.assert_array_equal(np.asarray(invalid), [True, False, True])
    pend, drafted = np.asarray(stash2.pending), np.asarray(stash2.drafted)
    np.testing.assert_array_equal(pend[[2, 4, 0]], [before.pending[2], 2, before.pending[0]])
    np.testing.assert_array_equal(drafted[[2, 4, 0]], [3, 0, 3])
    # a second verdict for slot 4 (nothing drafted any more) is refused on the device too
    invalid, _ = accept(stash2, slots, jnp.asarray([1, 1, 1], jnp.int32))
    np.testing.assert_array_equal(np.asarray(invalid), [False, True, False])


@pytest.mark.parametrize("mode", MODES)
def test_accept_kernel_matches_reference_on_a_large_batch(mode):
    """A large batch (one program per row): random distinct slots with padding
    rows, random traced verdicts (some invalid); counters and flags as XLA's."""
    impl, interp = _impl(mode)
    if impl == "reference":
        pytest.skip("compares the kernel with the reference")
    rng = np.random.default_rng(5)
    S, B = 400, 173
    slots = rng.permutation(S)[:B].astype(np.int32)
    slots[rng.random(B) < 0.1] = -1
    stash = DeltaStash.init(S, num_v_heads=1, head_k_dim=16, head_v_dim=16)
    states = jnp.zeros((S, 1, 16, 16), F32)
    stash = dataclasses.replace(stash, pending=jnp.asarray(rng.integers(0, 4, S), jnp.int32),
                                drafted=jnp.asarray(rng.integers(0, 5, S), jnp.int32))
    accepted = jnp.asarray(rng.integers(-1, 6, B), jnp.int32)
    run = lambda i, it: jax.jit(lambda st, sl, a: carry.accept(DeltaPool(states, st), sl, a, impl=i,
                                                               interpret=it))(
        jax.tree.map(jnp.copy, stash), jnp.asarray(slots), accepted)      # traced: masked, flagged
    got, inv = run(impl, interp)
    want, inv_w = run("reference", False)
    got, want = got.stash, want.stash
    np.testing.assert_array_equal(np.asarray(inv), np.asarray(inv_w))
    assert np.asarray(inv).any() and not np.asarray(inv).all()
    for name in ("pending", "drafted", "bank"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)))


def test_commit_states_refuses_bad_counts():
    toks, pool, _ = _small()
    slots = jnp.asarray([1, 3, -1], jnp.int32)
    o, states = vf.verify_states(*toks, pool, slots, impl="reference")
    with pytest.raises(ValueError, match="accepted"):
        vf.commit_states(jnp.array(pool, copy=True), states, slots, jnp.asarray([1, 4, 0], jnp.int32))
    commit = jax.jit(vf.commit_states)
    kept = np.asarray(pool)
    new, invalid = commit(jnp.array(pool, copy=True), states, slots, jnp.asarray([0, 2, 5], jnp.int32))
    np.testing.assert_array_equal(np.asarray(invalid), [True, False, False])
    np.testing.assert_array_equal(np.asarray(new[1]), kept[1])           # flagged row: no-op
    np.testing.assert_array_equal(np.asarray(new[3]), np.asarray(states[1, 1]))


def test_bad_inputs_raise_value_error_naming_the_argument():
    (q, k, v, g, beta), pool, stash = _small()
    ok = jnp.asarray([0, 1, -1], jnp.int32)
    dp = DeltaPool(pool, stash)
    call = lambda **kw: carry.carried_verify(**{**dict(q=q, k=k, v=v, g=g, beta=beta, pool=dp,
                                                       slots=ok, impl="reference"), **kw})
    with pytest.raises(ValueError, match="^slots must name slots"):
        call(slots=jnp.asarray([0, 5, -1], jnp.int32))
    with pytest.raises(ValueError, match="^slots names a slot twice"):
        call(slots=jnp.asarray([1, 1, -1], jnp.int32))
    with pytest.raises(ValueError, match="^slots must have shape"):
        call(slots=jnp.asarray([0, 1], jnp.int32))
    with pytest.raises(ValueError, match="^pool.stash does not match"):
        call(pool=DeltaPool(pool[:, :1], stash))
    with pytest.raises(ValueError, match="^pool must be a gdn_jax.DeltaPool"):
        call(pool=pool)
    with pytest.raises(ValueError, match="^g must have shape"):
        call(g=g[..., :1])
    with pytest.raises(ValueError, match="^pool.stash holds scalar"):
        call(g=jnp.broadcast_to(g[..., None], g.shape + (16,)))
    with pytest.raises(ValueError, match="stash capacity"):
        small = DeltaStash.init(5, num_v_heads=2, num_k_heads=1, head_k_dim=16, head_v_dim=16,
                                capacity=2)
        call(pool=DeltaPool(pool, small))
    with pytest.raises(ValueError, match="^pool.stash does not match.*one row per key head"):
        per_value_head = DeltaStash.init(5, num_v_heads=2, head_k_dim=16, head_v_dim=16)
        call(pool=DeltaPool(pool, per_value_head))  # k rows for 2 heads, the tokens have 1 key head
    with pytest.raises(ValueError, match="^num_v_heads=3 must be a multiple of num_k_heads=2"):
        DeltaStash.init(5, num_v_heads=3, num_k_heads=2, head_k_dim=16, head_v_dim=16)
    with pytest.raises(ValueError, match="^pool.states is bfloat16: the fast flavour"):
        call(pool=DeltaPool(pool.astype(BF16), stash), exact=False)
    with pytest.raises(ValueError, match="^impl must be one of"):
        call(impl="triton")
    with pytest.raises(ValueError, match="^impl must be one of.*no chunk form"):
        call(impl="chunked")
    for bad_scale in (0.0, -1.0, float("nan"), float("inf"), "0.5", True):
        with pytest.raises(ValueError, match="^scale must"):
            call(scale=bad_scale)
    if not ON_GPU:
        with pytest.raises(ValueError, match=r"^carried_verify\(impl='pallas'\): the Pallas kernels need a GPU"):
            call(impl="pallas", interpret=False)
    with pytest.raises(ValueError, match="^num_tokens must lie"):
        carry.accept(dp, ok, jnp.asarray([1, 1, 0], jnp.int32), num_tokens=7)
    with pytest.raises(ValueError, match="^pool must be a gdn_jax.DeltaPool"):
        carry.flush({"k": 1})
    with pytest.raises(ValueError, match="^pool must be a gdn_jax.DeltaPool or ConvPool"):
        carry.accept(stash, ok, jnp.asarray([1, 1, 0], jnp.int32))
    with pytest.raises(ValueError, match="^pool.states must be a floating dtype"):
        carry.flush(DeltaPool(pool.astype(jnp.int32), stash))
    with pytest.raises(ValueError, match="^states must be a floating dtype"):
        o, states = vf.verify_states(q, k, v, g, beta, pool, ok, impl="reference")
        vf.commit_states(pool, states.astype(jnp.int32), ok, jnp.asarray([1, 1, 0], jnp.int32))
    with pytest.raises(AssertionError, match="^num_tokens=5 exceeds the stash capacity"):  # launcher
        q5 = jnp.concatenate([q, q[:, :2]], 1)
        kv.carried_verify_launch(q5, q5, jnp.concatenate([v, v[:, :2]], 1), jnp.concatenate([g, g[:, :2]], 1),
                          jnp.concatenate([beta, beta[:, :2]], 1), pool, stash.k, stash.u, stash.g,
                          stash.bank, stash.pending, stash.drafted, ok, interpret=True)


@pytest.mark.parametrize("mode", ["reference", "interpret"])
def test_slot_outside_the_pool_is_padding_in_every_implementation(mode):
    """Under jit the host cannot see the slot table: an index past the pool must read and write
    nothing and give zero outputs, in the reference as in the kernels."""
    impl, interp = _impl(mode)
    (q, k, v, g, beta), pool, stash = _small(4, sdt=F32)
    pool = pool.at[-1].set(SENTINEL)
    slots = jnp.asarray([9, 0, -1], jnp.int32)

    @jax.jit
    def run(pool, stash, slots):
        o, dp, refused = carry.carried_verify(q, k, v, g, beta, DeltaPool(pool, stash), slots,
                                              use_qk_l2norm=True, impl=impl, interpret=interp)
        o2, _ = vf.verify_states(q, k, v, g, beta, dp.states, slots, use_qk_l2norm=True,
                                 impl=impl, interpret=interp)
        return o, o2, dp, refused

    kept = np.asarray(pool)
    o, o2, dp, refused = run(jnp.array(pool, copy=True), stash, slots)
    assert np.all(np.asarray(o[0]) == 0) and np.all(np.asarray(o2[0]) == 0)
    assert np.all(np.isfinite(np.asarray(o))) and np.any(np.asarray(o[1]) != 0)
    np.testing.assert_array_equal(np.asarray(dp.states)[1:], kept[1:])
    assert not np.any(np.asarray(refused))


def test_decode_and_convert_of_a_pool_with_pending_rows_fold_them_first():
    """Decoding or converting a DeltaPool whose stash holds accepted-but-unfolded rows gives
    what a flush followed by the plain operation gives (it used to read a stale H)."""
    (q, k, v, g, beta), pool, stash = _small(9, T=3)
    slots = jnp.asarray([0, 2, -1], jnp.int32)
    o, dp, _ = carry.carried_verify(q, k, v, g, beta, DeltaPool(pool, stash), slots,
                                    use_qk_l2norm=True, impl="reference")
    dp, _ = carry.accept(dp, slots, jnp.asarray([2, 3, 0], jnp.int32))
    assert np.any(np.asarray(dp.stash.pending) > 0)
    copy = lambda: jax.tree.map(jnp.copy, dp)
    B = 3
    toks = tuple(x[:, 0] for x in (q, k, v, g, beta))
    qkv = jnp.concatenate([toks[0].reshape(B, -1), toks[1].reshape(B, -1), toks[2].reshape(B, -1)], 1)
    kw = dict(num_k_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16, use_qk_l2norm=True,
              impl="reference")
    got_o, got = dec.gdn_decode_pool(qkv, toks[3], toks[4], copy(), slots, **kw)
    flushed = carry.flush(copy())
    want_o, want = dec.gdn_decode_pool(qkv, toks[3], toks[4], flushed.states, slots, **kw)
    np.testing.assert_array_equal(np.asarray(got_o), np.asarray(want_o))
    np.testing.assert_array_equal(np.asarray(got.states), np.asarray(want))
    stale_o, _ = dec.gdn_decode_pool(qkv, toks[3], toks[4], jnp.copy(dp.states), slots, **kw)
    assert rel_err(stale_o[:2], want_o[:2]) > 1e-3          # the stale read this guards against
    conv = dec.convert_state(copy(), BF16, impl="reference")
    assert isinstance(conv, DeltaPool) and not np.any(np.asarray(conv.stash.pending))
    np.testing.assert_array_equal(np.asarray(conv.states.astype(F32)),
                                  np.asarray(carry.flush(copy()).states.astype(BF16).astype(F32)))
    with pytest.raises(ValueError, match="^state must be a floating-point array"):
        dec.convert_state(jnp.zeros((4, 16), jnp.int32), F16)
    with pytest.raises(ValueError, match="^state must be float32, float16 or bfloat16"):
        dec.convert_state(jnp.zeros((4, 16), jnp.float64) if jax.config.jax_enable_x64 else
                          jnp.zeros((4, 16), jnp.float8_e4m3fn), F16)


# --------------------------------------------------------------------------- conv carry

@pytest.mark.parametrize("conv_dtype,x_dtype", [pytest.param(F32, BF16, marks=FULL), (BF16, BF16)])
def test_conv_carry_schedule_matches_sequential_conv_steps(conv_dtype, x_dtype):
    rng = np.random.default_rng(3)
    B, S, C, W, rounds = 4, 6, 24, 4, 12
    weight = jnp.asarray(rng.standard_normal((C, W), dtype=np.float32) / 2)
    bias = jnp.asarray(rng.standard_normal(C, dtype=np.float32))
    pool0 = jnp.asarray(rng.standard_normal((S, W - 1, C), dtype=np.float32)).astype(conv_dtype)
    pool0 = pool0.at[S - 1].set(SENTINEL)
    oracle = jnp.array(pool0, copy=True)
    cp = ConvPool(jnp.array(pool0, copy=True), ConvStash.init(S, conv_dim=C, dtype=conv_dtype))

    def plain_step(x, p, s):
        """The oracle: the plain conv step on a window pool, nothing carried."""
        y, window = ref_step(x, p[jnp.where(s >= 0, s, 0)], weight, bias)
        return (jnp.where((s >= 0)[:, None], y, 0).astype(y.dtype),
                p.at[jnp.where(s >= 0, s, p.shape[0])].set(window, mode="drop"))

    from gdn_jax.reference import causal_conv1d_step as ref_step
    step = _jit(plain_step)

    def verify_fn(x, cp, s, a):
        y, cp, refused = conv_carry.conv_carried_verify(x, cp, s, weight, bias)
        return y, carry.accept(cp, s, a)[0], refused

    verify = _jit(verify_fn)
    conv_step = _jit(lambda x, cp, s: conv_carry.conv_step(x, cp, s, weight, bias))
    for r in range(rounds):
        slots = _slot_table(rng, B, S - 1)
        if r % 4 == 3:
            x = jnp.asarray(rng.standard_normal((B, C), dtype=np.float32)).astype(x_dtype)
            want, oracle = step(x, oracle, slots)
            got, cp = conv_step(x, cp, slots)          # folds the pending inputs itself
            np.testing.assert_array_equal(np.asarray(got.astype(F32)), np.asarray(want.astype(F32)))
            continue
        T = int(rng.integers(2, 5))
        x = jnp.asarray(rng.standard_normal((B, T, C), dtype=np.float32)).astype(x_dtype)
        acc = np.where(np.asarray(slots) >= 0, rng.integers(1, T + 1, B), 0)
        ys, pools = [], []
        cur = oracle
        for t in range(T):
            y, cur = step(x[:, t], cur, slots)
            ys.append(y)
            pools.append(cur)
        for b, s in enumerate(np.asarray(slots)):
            if s >= 0:
                oracle = oracle.at[s].set(pools[acc[b] - 1][s])
        got, cp, refused = verify(x, cp, slots, jnp.asarray(acc, jnp.int32))
        assert not np.any(np.asarray(refused))
        np.testing.assert_array_equal(np.asarray(got.astype(F32)), np.asarray(jnp.stack(ys, 1).astype(F32)))
    cp = conv_carry.conv_flush(cp)
    np.testing.assert_array_equal(np.asarray(cp.windows.astype(F32)), np.asarray(oracle.astype(F32)))
    np.testing.assert_array_equal(np.asarray(cp.windows[S - 1].astype(F32)), np.asarray(pool0[S - 1].astype(F32)))
    assert np.all(np.asarray(pool0[S - 1].astype(F32)) > 1e29)


def test_conv_pool_and_stash_sizes_are_checked():
    """A conv stash with fewer (or more) slots than the conv pool is refused (pending inputs of
    one slot used to be written into slots that were never named)."""
    C, W = 8, 4
    weight = jnp.ones((C, W), F32)
    bad = ConvPool(jnp.zeros((4, W - 1, C), F32), ConvStash.init(2, conv_dim=C))
    x = jnp.ones((2, 2, C), F32)
    slots = jnp.asarray([0, 1], jnp.int32)
    for fn in (lambda: conv_carry.conv_carried_verify(x, bad, slots, weight),
               lambda: conv_carry.conv_flush(bad),
               lambda: conv_carry.conv_step(x[:, 0], bad, slots, weight)):
        with pytest.raises(ValueError, match="^conv_pool.stash.x must be"):
            fn()
    good = ConvPool.init(4, conv_dim=C, conv_width=W)
    with pytest.raises(ValueError, match="^conv_pool.windows must be"):
        conv_carry.conv_carried_verify(x, good, slots, jnp.ones((C, W + 1), F32))
    _, good, _ = conv_carry.conv_carried_verify(x, good, slots, weight)
    with pytest.raises(ValueError, match="awaiting its verdict"):
        conv_carry.conv_carried_verify(x, good, slots, weight)


# --------------------------------------------------------------------------- jit behaviour

def test_carried_loop_does_not_retrace_and_donates():
    (q, k, v, g, beta), pool, stash = _small(T=2)
    slots = jnp.asarray([0, 3, -1], jnp.int32)
    acc = jnp.asarray([2, 1, 0], jnp.int32)
    traces = []

    @jax.jit
    def step(q, k, v, g, beta, dp):
        traces.append(1)
        o, dp, _ = carry.carried_verify(q, k, v, g, beta, dp, slots, impl="reference")
        dp, _ = carry.accept(dp, slots, acc)
        return o, dp

    dp = DeltaPool(pool, stash)
    for _ in range(4):
        o, dp = step(q, k, v, g, beta, dp)
    assert len(traces) == 1
    # the public entry point donates the pool (states and stash)
    dp2 = jax.tree.map(jnp.copy, carry.flush(dp))
    carry.carried_verify(q, k, v, g, beta, dp2, slots, impl="reference")
    assert dp2.states.is_deleted() and dp2.stash.k.is_deleted()


# --------------------------------------------------------------------------- Triton lowering

@pytest.mark.parametrize("per_channel,sdt,exact", [
    (False, F32, True), (False, F32, False), (True, BF16, True), (True, F32, False)])
def test_kernels_lower_to_triton_ir(lower_for_h200, per_channel, sdt, exact):
    """The three kernels lower to Triton IR for an H200 without a GPU (only PTX needs one)."""
    B, T, HK, HV, K, S, C = 4, 4, 2, 4, 128, 6, 4
    q, v = jnp.ones((B, T, HK, K), BF16), jnp.ones((B, T, HV, K), BF16)
    g = jnp.ones((B, T, HV, K) if per_channel else (B, T, HV))
    pool = jax.ShapeDtypeStruct((S, HV, K, K), sdt)
    sk, su = jnp.ones((S, 2, HK, C, K)), jnp.ones((S, 2, HV, C, K))
    sg = jnp.ones((S, 2, HV, C, K) if per_channel else (S, 2, HV, C))
    ints, slots = jnp.zeros(S, jnp.int32), jnp.zeros(B, jnp.int32)
    spec = kv._spec_from(q, v, g, scale=None, use_qk_l2norm=True, exact=exact)
    block = kv.default_block_sizes(B, K, sdt, exact)
    lower = lambda f, *a, **kw: f.trace(*a, block=block, interpret=False, **kw).lower(
        lowering_platforms=("cuda",)).as_text()
    hlo = lower(kv._carried_launch, q, q, v, g, jnp.ones((B, T, HV)), pool, sk, su, sg, ints, ints,
                ints, slots, spec=spec)
    assert "__gpu$xla.gpu.triton" in hlo and "output_operand_aliases" in hlo
    hlo = lower(kv._verify_states_launch, q, q, v, g, jnp.ones((B, T, HV)), pool, slots, spec=spec)
    assert "__gpu$xla.gpu.triton" in hlo
    fspec = dataclasses.replace(spec, num_tokens=1)
    hlo = lower(kv._flush_launch, pool, sk, su, sg, ints, ints, slots, spec=fspec)
    assert "__gpu$xla.gpu.triton" in hlo and "output_operand_aliases" in hlo


# --------------------------------------------------------------------------- GPU only

# --------------------------------------------------------------------------- fast flavour shapes

def _fast_variant_rounds(case, block, *, seed, rounds=3, widths=None):
    """Carried fast verify with an explicit block shape against the pure-JAX fast reference:
    `rounds` verify/accept rounds (random accepted counts, so later rounds fold 1..T pending
    rows), then a flush. T is drawn from 2..4 per round, or taken from `widths` in turn (each
    distinct T compiles the kernel and the reference once more). Returns the worst relative
    error of outputs and the final pool."""
    rng = np.random.default_rng(seed)
    pool0 = _pool(rng, S=case.S, HV=case.HV, K=case.K, V=case.V, dtype=F32, sentinels=case.sentinels)
    kind = case.kind
    mk = lambda: DeltaPool(jnp.array(pool0, copy=True), DeltaStash.init(
        case.S, num_v_heads=case.HV, num_k_heads=case.HK, head_k_dim=case.K, head_v_dim=case.V,
        per_channel_gate=kind == "kda"))
    got, want = mk(), mk()
    worst = 0.0
    for r in range(rounds):
        slots = _slot_table(rng, case.B, case.used)
        T = int(rng.integers(2, 5)) if widths is None else widths[r % len(widths)]
        toks = _tokens(rng, B=case.B, T=T, HK=case.HK, HV=case.HV, K=case.K, V=case.V, kind=kind)
        acc = jnp.asarray(np.where(np.asarray(slots) >= 0, rng.integers(1, T + 1, case.B), 0), jnp.int32)
        o, got, _ = carry.carried_verify(*toks, got, slots, exact=False, use_qk_l2norm=True,
                                         impl="pallas", interpret=not ON_GPU, block_sizes=block)
        ow, want, _ = carry.carried_verify(*toks, want, slots, exact=False, use_qk_l2norm=True,
                                           impl="reference")
        worst = max(worst, rel_err(o, ow))
        got, _ = carry.accept(got, slots, acc)
        want, _ = carry.accept(want, slots, acc)
    pg = carry.flush(got, impl="reference").states
    pw = carry.flush(want, impl="reference").states
    worst = max(worst, rel_err(pg[:case.used], pw[:case.used]))
    np.testing.assert_array_equal(np.asarray(pg[case.used:]), np.asarray(pool0[case.used:]))
    return worst


# KDA's fast flavour in the default run: test_carried_schedule_matches_sequential_decode
@pytest.mark.parametrize("kind", ["gdn", pytest.param("kda", marks=FULL)])
def test_fast_flavour_matches_reference_interpret(kind):
    """The fast kernel (GDN: WY scalars solved in the kernel; KDA: from the XLA prelude) in
    interpret mode against the pure-JAX fast reference. Two widths (compiles dominate here):
    the T = 2 round after a T = 4 round folds up to 4 pending rows, more than it drafts."""
    if ON_GPU:
        pytest.skip("the GPU variant below covers the compiled kernels")
    case = Case(kind=kind, exact=False, K=32, V=32)
    err = _fast_variant_rounds(case, kv.VerifyBlockSizes(16, 4), seed=11, widths=(4, 2, 4))
    assert err <= 1e-6, f"relative error {err:.3g} > 1e-6"


@pytest.mark.gpu
@pytest.mark.parametrize("kind,bv,w", [
    ("gdn", 64, 4), ("gdn", 32, 4), ("gdn", 64, 8), ("gdn", 128, 8), ("gdn", 16, 2),
    ("kda", 64, 4), ("kda", 32, 4)])
def test_gpu_fast_shapes_match_reference(kind, bv, w):
    """Fast kernel launch shapes, compiled, against the fp32 reference."""
    case = Case(kind=kind, exact=False, B=12, S=19, HK=2, HV=4, K=128, V=128)
    err = _fast_variant_rounds(case, kv.VerifyBlockSizes(bv, w), seed=bv * 10 + w)
    print(f"{kind} bv{bv}w{w}: relative error {err:.3g}")
    assert err <= 1e-6, f"bv{bv}w{w}: relative error {err:.3g} > 1e-6"
