"""The blocks' serving path (prefill, decode, verify, accept, flush; gdn_jax.layers.serving).

Oracle: the block's own `__call__`, one token at a time, on per-sequence states gathered from
the pool (plain decode of the accepted tokens). Randomized verify / accept / decode rounds over
a pool with padding rows must give the same outputs and end in the same pools. The projections
run as a [B*T] matmul in verify and a [B] matmul token by token, so the comparison is to fp32
matmul rounding (<= 1e-5 relative), not bitwise (the kernel-level tests pin bitwise exactness).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import gdn_jax
from gdn_jax.layers import GDNConfig, KDAConfig, KimiDeltaAttention, Qwen3NextGatedDeltaNet
from gdn_jax.state import GDNState, KDAState, ServingState
from conftest import FULL
from helpers import jit_block, rel_err

F32, BF16 = jnp.float32, jnp.bfloat16
TOL = 1e-5


def _block(kind):
    if kind == "gdn":
        cfg = GDNConfig(hidden_size=32, num_k_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16)
        return Qwen3NextGatedDeltaNet(cfg, rngs=nnx.Rngs(0)), GDNState
    cfg = KDAConfig(hidden_size=32, num_heads=2, head_dim=16, num_v_heads=2, head_v_dim=16,
                    lower_bound=-5.0)
    return KimiDeltaAttention(cfg, rngs=nnx.Rngs(1)), KDAState


def _x(rng, B, T, hidden=32):
    return jnp.asarray(rng.standard_normal((B, T, hidden), dtype=np.float32))


def _reference_step(block):
    """The oracle's step: the block's `__call__` (impl="reference") on one token, as one jitted
    program (`helpers.jit_block`), compiled once per test instead of dispatched op by op for
    every token (most of this file's CPU time). The serving calls under test run as a caller
    writes them."""
    return jit_block(block, impl="reference")


def _oracle_tokens(step, cls, x, rec, conv, slots):
    """Run the block (its `_reference_step`) token by token from the slots' states; returns ys
    [B, T, hidden] and the (recurrent, conv) of every row after each token."""
    safe = jnp.where(slots >= 0, slots, 0)
    st = cls(recurrent=rec[safe], conv=conv[safe])
    ys, after = [], []
    for t in range(x.shape[1]):
        y, st = step(x[:, t:t + 1], st)
        ys.append(y)
        after.append(st)
    return jnp.concatenate(ys, 1), after


def _commit(rec, conv, after, slots, accepted):
    for b, s in enumerate(np.asarray(slots)):
        if s >= 0:
            a = int(accepted[b]) - 1
            rec = rec.at[s].set(after[a].recurrent[b])
            conv = conv.at[s].set(after[a].conv[b])
    return rec, conv


def _seed_pool(rng, state):
    """Non-zero starting pools (sequences of different 'ages')."""
    rec = 0.3 * rng.standard_normal(state.delta.states.shape, dtype=np.float32)
    conv = rng.standard_normal(state.conv.windows.shape, dtype=np.float32)
    return ServingState(
        delta=dataclasses.replace(state.delta, states=jnp.asarray(rec).astype(state.delta.states.dtype)),
        conv=dataclasses.replace(state.conv, windows=jnp.asarray(conv).astype(state.conv.windows.dtype)))


@pytest.mark.parametrize("kind,carry,exact,impl", [
    ("gdn", True, True, "reference"),
    pytest.param("kda", True, False, "reference", marks=FULL),
    ("gdn", False, True, "reference"),      # declines: intermediate states + commit
    ("kda", True, True, "pallas"),          # kernels (interpret on CPU) through the block
    pytest.param("gdn", True, True, "pallas", marks=pytest.mark.gpu, id="gdn-pallas-gpu"),
])
def test_block_schedule_matches_token_by_token(kind, carry, exact, impl):
    with gdn_jax.interpret(impl == "pallas" and jax.default_backend() != "gpu"):
        _block_schedule(kind, carry, exact, impl)


def _block_schedule(kind, carry, exact, impl):
    rng = np.random.default_rng(21)
    block, cls = _block(kind)
    step = _reference_step(block)
    S, B, T = 5, 3, 3
    state = _seed_pool(rng, block.init_serving_state(S))
    rec, conv = jnp.array(state.delta.states, copy=True), jnp.array(state.conv.windows, copy=True)
    assert block.carry_engages(state, T, carry=carry, exact=exact, impl=impl) == carry
    for r in range(6):
        slots = np.full(B, -1, np.int32)
        n = int(rng.integers(1, B + 1))
        slots[:n] = rng.choice(S, n, replace=False)
        rng.shuffle(slots)
        slots = jnp.asarray(slots)
        if r % 3 == 2:
            x = _x(rng, B, 1)
            y, state = block.decode(x, state, slots, impl=impl)
            want, after = _oracle_tokens(step, cls, x, rec, conv, slots)
            rec, conv = _commit(rec, conv, after, slots, np.ones(B, int))
        else:
            x = _x(rng, B, T)
            accepted = np.where(np.asarray(slots) >= 0, rng.integers(1, T + 1, B), 0)
            y, state, refused = block.verify(x, state, slots, carry=carry, exact=exact, impl=impl)
            assert not np.any(np.asarray(refused))
            assert (state.candidates is None) == carry
            state, invalid = block.accept(state, slots, jnp.asarray(accepted, jnp.int32))
            assert not np.any(np.asarray(invalid))
            want, after = _oracle_tokens(step, cls, x, rec, conv, slots)
            rec, conv = _commit(rec, conv, after, slots, accepted)
        live = np.asarray(slots) >= 0
        assert rel_err(y[live], want[live]) <= TOL, f"round {r}"
        assert np.all(np.asarray(y[~live]) == 0) or not np.any(~live)
    if carry:
        assert np.any(np.asarray(state.delta.stash.pending) > 0)
    state = block.flush(state, impl=impl)
    assert rel_err(state.delta.states, rec) <= TOL
    assert rel_err(state.conv.windows, conv) <= TOL
    assert not np.any(np.asarray(state.delta.stash.pending))
    assert not np.any(np.asarray(state.conv.stash.pending))


def test_block_declines_fast_flavour_on_16bit_state_and_stays_correct():
    """fast + bf16 pool: carry declines (the engage table), verify falls back to intermediate
    states, and the result still follows the token-by-token block."""
    rng = np.random.default_rng(5)
    block, cls = _block("gdn")
    kw = dict(carry=True, exact=False, impl="reference")
    state = _seed_pool(rng, block.init_serving_state(4, dtype=BF16))
    assert not block.carry_engages(state, 2, **kw)
    slots = jnp.asarray([2, -1, 0], jnp.int32)
    rec, conv = jnp.array(state.delta.states, copy=True), jnp.array(state.conv.windows, copy=True)
    x = _x(rng, 3, 2)
    y, state, _ = block.verify(x, state, slots, **kw)
    assert state.candidates is not None
    with pytest.raises(ValueError, match="awaiting its verdict"):
        block.decode(_x(rng, 3, 1), state, slots)
    state, _ = block.accept(state, slots, jnp.asarray([2, 0, 1], jnp.int32))
    want, after = _oracle_tokens(_reference_step(block), cls, x, rec, conv, slots)
    rec, conv = _commit(rec, conv, after, slots, [2, 0, 1])
    assert rel_err(y[jnp.asarray([0, 2])], want[jnp.asarray([0, 2])]) <= 1e-2  # bf16 state
    np.testing.assert_array_equal(np.asarray(state.delta.states.astype(F32)), np.asarray(rec.astype(F32)))


def test_block_api_refusals():
    block, _ = _block("kda")
    state = block.init_serving_state(3)
    slots = jnp.asarray([0, 1], jnp.int32)
    with pytest.raises(ValueError, match="^x must"):
        block.verify(jnp.ones((2, 3, 31)), state, slots)
    with pytest.raises(ValueError, match="^x must"):        # a verify of T = 0
        block.verify(jnp.ones((2, 0, 32)), state, slots)
    with pytest.raises(ValueError, match="^impl must be"):
        block.verify(jnp.ones((2, 2, 32)), state, slots, impl="triton")
    with pytest.raises(ValueError, match="^serving must be"):
        block.verify(jnp.ones((2, 2, 32)), object(), slots)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 2, 32), dtype=np.float32))
    _, st, _ = block.verify(x, state, slots)
    with pytest.raises(ValueError, match="accepted"):
        block.accept(st, slots, jnp.asarray([1, 3], jnp.int32), num_tokens=2)


def test_block_prefill_into_slots_matches_call_and_continues():
    """prefill into pool slots (fresh and continued) equals the block's __call__ on the
    gathered states, leaves the other slots untouched, and a decode continues it."""
    rng = np.random.default_rng(3)
    for kind in ("gdn", "kda"):
        block, cls = _block(kind)
        state = _seed_pool(rng, block.init_serving_state(4))
        rec, conv = np.asarray(state.delta.states), np.asarray(state.conv.windows)
        slots = jnp.asarray([3, -1, 1], jnp.int32)
        x = _x(rng, 3, 5)
        y, state = block.prefill(x, state, slots, impl="reference")
        want, st = block(x, cls(recurrent=jnp.asarray(rec[[3, 0, 1]]), conv=jnp.asarray(conv[[3, 0, 1]])),
                         impl="reference")
        assert rel_err(y[jnp.asarray([0, 2])], want[jnp.asarray([0, 2])]) <= TOL
        assert np.all(np.asarray(y[1]) == 0)
        got = np.asarray(state.delta.states)
        np.testing.assert_array_equal(got[[0, 2]], rec[[0, 2]])           # untouched
        assert rel_err(got[[3, 1]], st.recurrent[jnp.asarray([0, 2])]) <= TOL
        y, fresh = block.prefill(x, state, slots, fresh=True, impl="reference")
        want, _ = block(x, impl="reference")
        assert rel_err(y[jnp.asarray([0, 2])], want[jnp.asarray([0, 2])]) <= TOL


def test_block_verify_twice_without_verdict_is_refused():
    """A second verify on a slot before its accept: ValueError with a concrete slot table;
    under jit the row is padding (nothing touched) and flagged."""
    block, _ = _block("gdn")
    rng = np.random.default_rng(8)
    state = _seed_pool(rng, block.init_serving_state(3))
    slots = jnp.asarray([0, 2], jnp.int32)
    _, state, _ = block.verify(_x(rng, 2, 2), state, slots, impl="reference")
    with pytest.raises(ValueError, match="awaiting its verdict"):
        block.verify(_x(rng, 2, 2), state, slots, impl="reference")
    second = jit_block(block, "verify", impl="reference")
    before = np.asarray(state.delta.states)
    stash_u = np.asarray(state.delta.stash.u)
    y, after, refused = second(_x(rng, 2, 2), state, jnp.asarray([2, 1], jnp.int32))
    np.testing.assert_array_equal(np.asarray(refused), [True, False])
    assert np.all(np.asarray(y[0]) == 0) and np.any(np.asarray(y[1]) != 0)
    np.testing.assert_array_equal(np.asarray(after.delta.states)[2], before[2])
    np.testing.assert_array_equal(np.asarray(after.delta.stash.u)[2], stash_u[2])
