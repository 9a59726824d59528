"""The blocks' serving path on the pool itself: pool-native prefill and the gated fold of
pending stash rows (gdn_jax.layers.serving, gdn_jax.carry.when_pending).

Oracles: prefill on a pool against the block's own `__call__` (impl="reference") on the
gathered states, scattered back; decode after a carried verify against the unfused chain
(impl="reference"), eagerly and under jit (where the fold is a `lax.cond`). fp32 <= 1e-5
relative; slots not named bit-exact; padding rows zero. The compiled programs of a donated
serving prefill and decode step must hold no copy of a pool-sized buffer.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import gdn_jax
from gdn_jax import carry as carry_ops
from gdn_jax import conv_decode as conv_decode_ops
from gdn_jax.layers import GDNConfig, KDAConfig, KimiDeltaAttention, Qwen3NextGatedDeltaNet
from gdn_jax.state import ServingState
from conftest import FULL
from helpers import rel_err
from test_blocks_fused import _copy, _kernel_ctx, _state_copies

F32 = jnp.float32
TOL = 1e-5
HIDDEN = 32


def _block(name):
    if name in ("qwen3_next", "qwen3_5"):   # fused (Qwen3-Next) / split (Qwen3.5) projections
        cfg = GDNConfig(hidden_size=HIDDEN, num_k_heads=1, num_v_heads=2, head_k_dim=16,
                        head_v_dim=16, layout="fused" if name == "qwen3_next" else "split",
                        conv_bias=name == "qwen3_5")
        return Qwen3NextGatedDeltaNet(cfg, rngs=nnx.Rngs(0))
    cfg = KDAConfig(hidden_size=HIDDEN, num_heads=2, head_dim=16, lower_bound=-5.0)
    return KimiDeltaAttention(cfg, rngs=nnx.Rngs(1))


def _x(seed, B, T):
    return jax.random.normal(jax.random.PRNGKey(seed), (B, T, HIDDEN), F32)


# One pool size and one batch size throughout, so the eager pieces compile once for the file.
SLOTS, B = 5, 3


def _seeded(block, seed):
    """A serving state whose pools hold non-zero states and windows (sequences under way)."""
    s = block.init_serving_state(SLOTS)
    rng = np.random.default_rng(seed)
    rnd = lambda a, std: jnp.asarray(std * rng.standard_normal(a.shape, dtype=np.float32))
    return ServingState(delta=dataclasses.replace(s.delta, states=rnd(s.delta.states, 0.3)),
                        conv=dataclasses.replace(s.conv, windows=rnd(s.conv.windows, 1.0)))


def _impl(mode):
    return "reference" if mode == "reference" else "pallas"


def _call_on_gathered(block, x, serving, slots, *, fresh=False):
    """The oracle: gather the slots' (folded) states, run the block's __call__, return (y, states
    and windows the named slots must hold after)."""
    serving = block.flush(_copy(serving), impl="reference")
    safe = jnp.where(slots >= 0, slots, 0)
    state = None if fresh else block.STATE_CLS(recurrent=serving.delta.states[safe],
                                               conv=serving.conv.windows[safe])
    return block(x, state, impl="reference")


def _check_prefill(block, x, before, after, y, slots, *, fresh=False):
    want_y, want = _call_on_gathered(block, x, before, slots, fresh=fresh)
    s = np.asarray(slots)
    live = np.nonzero(s >= 0)[0]
    assert rel_err(y[live], want_y[live]) <= TOL
    assert bool(jnp.all(y[np.nonzero(s < 0)[0]] == 0))                         # padding rows
    assert rel_err(after.delta.states[s[live]], want.recurrent[live]) <= TOL
    assert rel_err(after.conv.windows[s[live]], want.conv[live]) <= TOL
    for slot in sorted(set(range(before.num_slots)) - set(s[live].tolist())):  # not named
        assert bool(jnp.all(after.delta.states[slot] == before.delta.states[slot]))
        assert bool(jnp.all(after.conv.windows[slot] == before.conv.windows[slot]))
    assert not bool(jnp.any(after.delta.stash.pending[s[live]]))
    assert not bool(jnp.any(after.conv.stash.pending[s[live]]))


def _with_pending(block, serving, slots, seed):
    """A carried verify of 3 tokens on `slots` and its verdict: rows pending in both stashes."""
    _, serving, refused = block.verify(_x(seed, B, 3), serving, slots, impl="reference")
    assert block.carry_engages(serving, 3) and not bool(jnp.any(refused))
    accepted = jnp.where(slots >= 0, 2, 0).astype(jnp.int32)
    serving, _ = block.accept(serving, slots, accepted)
    return serving


# --------------------------------------------------------------------------- pool-native prefill

# The kernels' own tests cover both prefill kernels on pools; through the block the CPU runs one
# interpret case (KDA's per-channel gate, chunked kernel), the GPU both kernels for every block.
PREFILL_CASES = [
    # (Qwen3-Next's reference case in the full matrix: Qwen3.5's runs the same path)
    pytest.param("qwen3_next", "reference", 5, marks=FULL), ("qwen3_5", "reference", 5),
    ("kimi", "interpret", 40),             # chunked kernel (past the short-prompt rule)
    pytest.param("qwen3_next", "gpu", 5, marks=pytest.mark.gpu),     # token-serial kernel
    pytest.param("qwen3_5", "gpu", 70, marks=pytest.mark.gpu),       # chunked, 2 chunks
    pytest.param("kimi", "gpu", 5, marks=pytest.mark.gpu),
    pytest.param("kimi", "gpu", 40, marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("name, mode, T", PREFILL_CASES)
def test_block_prefill_on_pool_equals_gather_call_scatter(name, mode, T):
    """Continued rows (one with rows pending from a carried verify), a padding row, then the
    same slots again with fresh=True."""
    block = _block(name)
    slots = jnp.array([3, -1, 1], jnp.int32)
    serving = _with_pending(block, _seeded(block, 1), jnp.array([3, 0, -1], jnp.int32), 2)
    assert bool(serving.delta.stash.pending[3] > 0)
    x = _x(3, B, T)
    with _kernel_ctx(mode):
        y, after = block.prefill(x, _copy(serving), slots, impl=_impl(mode))
    _check_prefill(block, x, serving, after, y, slots)
    assert bool(after.delta.stash.pending[0] > 0)          # slot 0 was not named: still pending
    # Slot 1 gets a carried verify with no verdict yet: a fresh sequence there drops it.
    _, serving, _ = block.verify(_x(4, B, 3), after, jnp.array([1, -1, -1], jnp.int32),
                                 impl="reference")
    assert bool(serving.delta.stash.drafted[1] > 0)
    with _kernel_ctx(mode):
        y, fresh = block.prefill(x, _copy(serving), slots, fresh=True, impl=_impl(mode))
    _check_prefill(block, x, serving, fresh, y, slots, fresh=True)
    assert not bool(fresh.delta.stash.drafted[1]) and not bool(fresh.conv.stash.drafted[1])
    assert bool(fresh.delta.stash.pending[0] > 0)


def test_block_prefill_16bit_pool_and_chunked_form():
    """A bf16 pool (one rounding at the store) and impl="chunked" (the chunk form on the pool)."""
    block = _block("qwen3_next")
    slots = jnp.array([2, 0, 3], jnp.int32)
    serving = block.init_serving_state(SLOTS, dtype=jnp.bfloat16)
    x = _x(5, B, 5)
    y, after = block.prefill(x, _copy(serving), slots, impl="reference")
    want_y, want = block(x, block.init_state(B, dtype=jnp.bfloat16), impl="reference")
    assert after.delta.states.dtype == jnp.bfloat16
    assert rel_err(y, want_y) <= 5e-3 and rel_err(after.delta.states[slots], want.recurrent) <= 5e-3
    y2, after2 = block.prefill(x, _copy(serving), slots, impl="chunked")
    assert rel_err(y2, y) <= 5e-3 and rel_err(after2.delta.states, after.delta.states) <= 5e-3
    assert bool(jnp.all(after2.delta.states[1] == 0))


# --------------------------------------------------------------------------- gated fold

@pytest.mark.parametrize("mode,gated", [("reference", True), ("reference", False),
                                        ("interpret", True),
                                        pytest.param("gpu", True, marks=pytest.mark.gpu),
                                        pytest.param("gpu", False, marks=pytest.mark.gpu)])
def test_jitted_decode_folds_pending_rows_and_skips_when_none(mode, gated, monkeypatch):
    """Under jit the fold is a lax.cond on "any named slot pending" (gated: slot tables of at
    least FOLD_GATE_MIN_ROWS rows, forced here for a small one) or runs unconditionally: a
    decode after a carried verify + accept (pending) and a decode after that decode (nothing
    pending) both equal the unfused chain run eagerly; the slot table names one pending slot,
    one clean slot and padding."""
    _gate(monkeypatch, gated)
    block = _block("qwen3_next")
    graphdef, params = nnx.split(block)
    impl = "reference" if mode == "reference" else "auto"

    @functools.partial(jax.jit, donate_argnums=2)
    def step(params, x, serving, slots):
        return nnx.merge(graphdef, params).decode(x, serving, slots, impl=impl)

    serving = _with_pending(block, _seeded(block, 6), jnp.array([0, 2, -1], jnp.int32), 7)
    slots = jnp.array([2, -1, 3], jnp.int32)
    for t in range(2):
        x = _x(8 + t, B, 1)
        y0, s0 = block.decode(x, _copy(serving), slots, impl="reference")
        with _kernel_ctx(mode):
            y1, s1 = step(params, x, _copy(serving), slots)
        assert rel_err(y1, y0) <= TOL and bool(jnp.all(y1[1] == 0))
        assert rel_err(s1.delta.states, s0.delta.states) <= TOL
        assert rel_err(s1.conv.windows, s0.conv.windows) <= TOL
        assert bool(jnp.all(s1.delta.stash.pending == s0.delta.stash.pending))
        assert bool(jnp.all(s1.conv.stash.pending == s0.conv.stash.pending))
        # Slot 0 is pending but not named: its state and stash stay as they were.
        assert bool(jnp.all(s1.delta.states[0] == serving.delta.states[0]))
        assert bool(s1.delta.stash.pending[0] > 0)
        serving = s0
    assert not bool(serving.delta.stash.pending[2])


def _gate(monkeypatch, gated):
    """Gated: the fold behind a lax.cond for any slot table; else for none (always folded)."""
    monkeypatch.setattr(carry_ops, "FOLD_GATE_MIN_ROWS", 1 if gated else 1 << 30)


def test_when_pending_branches():
    pool = jnp.arange(4.0)
    fold = lambda p: (p + 1,)
    small, large = 1, carry_ops.FOLD_GATE_MIN_ROWS
    for rows in (small, large):
        assert bool(jnp.all(carry_ops.when_pending(jnp.array(False), fold, (pool,), rows=rows)[0] == pool))
        assert bool(jnp.all(carry_ops.when_pending(jnp.array(True), fold, (pool,), rows=rows)[0] == pool + 1))
    # traced: a conditional from FOLD_GATE_MIN_ROWS rows up, an unconditional fold below
    traced = jax.jit(lambda p, flag: carry_ops.when_pending(flag, fold, (p,), rows=large)[0])
    assert bool(jnp.all(traced(pool, jnp.array(True)) == pool + 1))
    assert bool(jnp.all(traced(pool, jnp.array(False)) == pool))
    assert " conditional(" in traced.lower(pool, jnp.array(True)).compile().as_text()
    always = jax.jit(lambda p, flag: carry_ops.when_pending(flag, fold, (p,), rows=small)[0])
    assert bool(jnp.all(always(pool, jnp.array(False)) == pool + 1))
    assert " conditional(" not in always.lower(pool, jnp.array(True)).compile().as_text()
    pending = jnp.array([0, 2, 0], jnp.int32)
    assert bool(carry_ops.any_pending(pending, jnp.array([1, -1], jnp.int32)))
    assert not bool(carry_ops.any_pending(pending, jnp.array([0, 2, -1], jnp.int32)))


# --------------------------------------------------------------------------- no pool copies

def _serving_step(block, what, impl):
    graphdef, params = nnx.split(block)
    serving = block.init_serving_state(SLOTS)
    slots = jnp.array([1, 3, -1], jnp.int32)
    x = _x(9, B, 1 if what == "decode" else 20)

    @functools.partial(jax.jit, donate_argnums=2)
    def step(params, x, serving):
        blk = nnx.merge(graphdef, params)
        if what == "decode":
            return blk.decode(x, serving, slots, impl=impl)
        return blk.prefill(x, serving, slots, fresh=what == "prefill-fresh", impl=impl)

    hlo = step.lower(params, x, serving).compile().as_text()
    return hlo, [serving.delta.states.shape, serving.conv.windows.shape]


@pytest.mark.parametrize("what,gated", [("decode", True), ("decode", False), ("prefill", True)])
def test_serving_step_copies_no_pool_cpu(what, gated, monkeypatch):
    """The pure-JAX path (impl="reference"): the fold (gated: a conditional in the program; or
    unconditional), the pool prefill and the conv window read/write copy no pool-sized buffer."""
    _gate(monkeypatch, gated)
    hlo, shapes = _serving_step(_block("kimi"), what, "reference")
    for shape in shapes:
        assert _state_copies(hlo, shape) == []
    assert (" conditional(" in hlo) == gated


def test_fused_serving_decode_structure_copies_no_pool_cpu(monkeypatch):
    _gate(monkeypatch, True)
    """The one-launch serving decode's structure on the CPU: the gate around the fold, then the
    in-place pool update. Interpret-mode kernels copy on their own, so the kernel body and the
    fold run their pure-JAX twins here (same operands, same in-place gather/scatter); the GPU
    test below compiles the real kernels."""
    run, fold = conv_decode_ops.conv_decode_run, carry_ops.fold_pending
    monkeypatch.setattr(conv_decode_ops, "conv_decode_run",
                        lambda call, which, *a, **k: run(call, "reference", *a,
                                                         **dict(k, interpret=False)))
    monkeypatch.setattr(carry_ops, "fold_pending", lambda p, s, **k: fold(p, s, impl="reference"))
    block = _block("qwen3_next")
    with gdn_jax.interpret():
        hlo, shapes = _serving_step(block, "decode", "auto")
    for shape in shapes:
        assert _state_copies(hlo, shape) == []
    assert hlo.count(" conditional(") == 1          # one gate for the delta rows and the conv


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3_next", "kimi"])
@pytest.mark.parametrize("what,gated", [("decode", True), ("decode", False), ("prefill", True),
                                        ("prefill-fresh", True)])
def test_serving_step_copies_no_pool_gpu(name, what, gated, monkeypatch):
    """Compiled kernels: the one-launch decode behind the gate or after an unconditional fold,
    the pool prefill kernels."""
    _gate(monkeypatch, gated)
    hlo, shapes = _serving_step(_block(name), what, "auto")
    for shape in shapes:
        assert _state_copies(hlo, shape) == []


# --------------------------------------------------------------------------- states_after on a pool

@pytest.mark.parametrize("mode, T, positions", [
    ("reference", 6, [0, 3, 6]),
    ("interpret", 6, [[0, 6], [2, 5], [6, 1]]),              # token-serial kernel, per sequence
    pytest.param("gpu", 70, [0, 64, 65, 70], marks=pytest.mark.gpu),   # chunked kernel
])
def test_prefill_pool_states_after_equal_cut_calls(mode, T, positions):
    """gdn_prefill_pool(..., states_after=) gives the state of each sequence after each count,
    equal to the pool slot's final state of the call cut there; o and the pool are those of the
    call without it; padding rows' states are zero."""
    from gdn_jax.prefill import gdn_prefill_pool
    from helpers import delta_inputs
    q, k, v, g, beta, h0 = delta_inputs(jax.random.PRNGKey(11), B=3, T=T, HK=1, HV=2, K=16, V=16)
    pool = np.full((5, 2, 16, 16), 1e30, np.float32)
    pool[4], pool[1] = h0[0], h0[2]
    slots = jnp.array([4, -1, 1], jnp.int32)
    kw = dict(use_qk_l2norm=True, impl=_impl(mode))
    with _kernel_ctx(mode):
        o, got_pool, at = gdn_prefill_pool(q, k, v, g, beta, jnp.asarray(pool), slots,
                                           states_after=jnp.asarray(positions, jnp.int32), **kw)
        o_plain, plain_pool = gdn_prefill_pool(q, k, v, g, beta, jnp.asarray(pool), slots, **kw)
    assert rel_err(o, o_plain) <= TOL and rel_err(got_pool, plain_pool) <= 1e-30 + TOL
    pos = np.broadcast_to(np.asarray(positions), (3, np.shape(positions)[-1]))
    assert at.shape == (3, pos.shape[1], 2, 16, 16)
    assert bool(jnp.all(at[1] == 0))
    for n in (0, 2):
        for i, p in enumerate(pos[n]):
            want = _numpy_gdn_state(q[n, :p], k[n, :p], v[n, :p], g[n, :p], beta[n, :p], h0[n])
            assert rel_err(at[n, i], want) <= TOL, (n, p)


def _numpy_gdn_state(q, k, v, g, beta, S):
    """float64 GDN over one sequence (q, k [T, HK, K], L2-normed keys): the final state."""
    q, k, v, g, beta = (np.asarray(a, np.float64) for a in (q, k, v, g, beta))
    S = np.array(S, np.float64)
    r = S.shape[0] // k.shape[1]
    for t in range(k.shape[0]):
        for h in range(S.shape[0]):
            kt = k[t, h // r] / np.linalg.norm(k[t, h // r])
            S[h] *= np.exp(g[t, h])
            S[h] += np.outer(kt, beta[t, h] * (v[t, h] - kt @ S[h]))
    return S
