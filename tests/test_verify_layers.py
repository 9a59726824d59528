"""Speculative verify at the Flax-block level (gdn_jax.layers.speculative).

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

from gdn_jax import verify as vf
from gdn_jax.layers import GDNConfig, KDAConfig, KimiDeltaAttention, Qwen3NextGatedDeltaNet
from gdn_jax.layers import speculative as sp
from gdn_jax.state import GDNState, KDAState
from helpers import rel_err

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


def _oracle_tokens(block, cls, x, rec, conv, slots):
    """Run the block token by token from the slots' states; returns ys [B, T, hidden] and the
    (recurrent, conv) of every row after each token."""
    safe = jnp.where(slots >= 0, slots, 0)
    st = cls(recurrent=rec[safe], conv=conv[safe])
    ys, after = [], []
    for t in range(x.shape[1]):
        y, st = block(x[:, t:t + 1], st, impl="reference")
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
    rec = 0.3 * rng.standard_normal(state.recurrent.shape, dtype=np.float32)
    conv = rng.standard_normal(state.conv.shape, dtype=np.float32)
    return dataclasses.replace(state, recurrent=jnp.asarray(rec).astype(state.recurrent.dtype),
                               conv=jnp.asarray(conv).astype(state.conv.dtype))


@pytest.mark.parametrize("kind,carry,exact,impl", [
    ("gdn", True, True, "reference"),
    ("kda", True, False, "reference"),
    ("gdn", False, True, "reference"),      # declines: intermediate states + commit
    ("kda", True, True, "pallas"),          # kernels (interpret on CPU) through the block
    pytest.param("gdn", True, True, "pallas", marks=pytest.mark.gpu, id="gdn-pallas-gpu"),
])
def test_block_schedule_matches_token_by_token(kind, carry, exact, impl):
    rng = np.random.default_rng(21)
    block, cls = _block(kind)
    spec = sp.Speculative(block, carry=carry, exact=exact, impl=impl,
                          interpret=impl == "pallas" and jax.default_backend() != "gpu")
    S, B, T = 5, 3, 3
    state = _seed_pool(rng, spec.init_state(S))
    rec, conv = jnp.array(state.recurrent, copy=True), jnp.array(state.conv, copy=True)
    assert spec.engages(state, T) == carry
    for r in range(6):
        slots = np.full(B, -1, np.int32)
        n = int(rng.integers(1, B + 1))
        slots[:n] = rng.choice(S, n, replace=False)
        rng.shuffle(slots)
        slots = jnp.asarray(slots)
        if r % 3 == 2:
            x = _x(rng, B, 1)
            y, state = spec.decode(x, state, slots)
            want, after = _oracle_tokens(block, cls, x, rec, conv, slots)
            rec, conv = _commit(rec, conv, after, slots, np.ones(B, int))
        else:
            x = _x(rng, B, T)
            accepted = np.where(np.asarray(slots) >= 0, rng.integers(1, T + 1, B), 0)
            y, state = spec.verify(x, state, slots)
            assert (state.candidates is None) == carry
            state, invalid = spec.accept(state, slots, jnp.asarray(accepted, jnp.int32))
            assert not np.any(np.asarray(invalid))
            want, after = _oracle_tokens(block, cls, x, rec, conv, slots)
            rec, conv = _commit(rec, conv, after, slots, accepted)
        live = np.asarray(slots) >= 0
        assert rel_err(y[live], want[live]) <= TOL, f"round {r}"
        assert np.all(np.asarray(y[~live]) == 0) or not np.any(~live)
    if carry:
        assert np.any(np.asarray(state.delta.pending) > 0)
    state = spec.flush(state)
    assert rel_err(state.recurrent, rec) <= TOL
    assert rel_err(state.conv, conv) <= TOL
    assert not np.any(np.asarray(state.delta.pending)) and not np.any(np.asarray(state.conv_stash.pending))


def test_block_declines_fast_flavour_on_16bit_state_and_stays_correct():
    """fast + bf16 pool: carry declines (the engage table), verify falls back to intermediate
    states, and the result still follows the token-by-token block."""
    rng = np.random.default_rng(5)
    block, cls = _block("gdn")
    spec = sp.Speculative(block, carry=True, exact=False, impl="reference")
    state = _seed_pool(rng, spec.init_state(4, dtype=BF16))
    assert not spec.engages(state, 2)
    slots = jnp.asarray([2, -1, 0], jnp.int32)
    rec, conv = jnp.array(state.recurrent, copy=True), jnp.array(state.conv, copy=True)
    x = _x(rng, 3, 2)
    y, state = spec.verify(x, state, slots)
    assert state.candidates is not None
    with pytest.raises(ValueError, match="unaccepted verify"):
        spec.decode(_x(rng, 3, 1), state, slots)
    state, _ = spec.accept(state, slots, jnp.asarray([2, 0, 1], jnp.int32))
    want, after = _oracle_tokens(block, cls, x, rec, conv, slots)
    rec, conv = _commit(rec, conv, after, slots, [2, 0, 1])
    assert rel_err(y[jnp.asarray([0, 2])], want[jnp.asarray([0, 2])]) <= 1e-2  # bf16 state
    np.testing.assert_array_equal(np.asarray(state.recurrent.astype(F32)), np.asarray(rec.astype(F32)))


def test_block_api_refusals():
    block, _ = _block("kda")
    spec = sp.Speculative(block)
    state = spec.init_state(3)
    with pytest.raises(ValueError, match="^x must be"):
        spec.verify(jnp.ones((2, 3, 31)), state, jnp.asarray([0, 1], jnp.int32))
    with pytest.raises(ValueError, match="^block must be"):
        sp.Speculative(object())
    with pytest.raises(ValueError, match="^impl must be"):
        sp.Speculative(block, impl="triton")
    with pytest.raises(ValueError, match="accepted"):
        x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 2, 32), dtype=np.float32))
        _, st = spec.verify(x, state, jnp.asarray([0, 1], jnp.int32))
        spec.accept(st, jnp.asarray([0, 1], jnp.int32), jnp.asarray([1, 3], jnp.int32), num_tokens=2)
