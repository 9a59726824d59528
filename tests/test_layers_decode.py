"""A 100-step decode loop of each block under one jax.jit with the state donated: it traces once,
the donated state buffers are consumed, and the step outputs reproduce HF's full-sequence pass."""

import functools
import os

import chex
import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from helpers import rel_err
from gdn_jax.layers import KimiDeltaAttention, Qwen3NextGatedDeltaNet

GOLDEN_DIR = os.path.join(os.path.dirname(__file__), "golden")
STEPS = 100


@pytest.mark.parametrize("cls, folder, golden, y_key", [
    (Qwen3NextGatedDeltaNet, "qwen3_next", "qwen3_next_golden.safetensors", "full.y"),
    (KimiDeltaAttention, "kimi_linear", "kda_golden.safetensors", "kimi.full.y"),
])
def test_jit_decode_loop_traces_once_with_donated_state(cls, folder, golden, y_key):
    block = cls.from_pretrained(os.path.join(GOLDEN_DIR, folder), 1)
    ref = load_file(os.path.join(GOLDEN_DIR, golden))
    graphdef, params = nnx.split(block)
    chex.clear_trace_counter()   # the counter is keyed by the function's code, shared by both params

    @functools.partial(jax.jit, donate_argnums=(2,))
    @chex.assert_max_traces(n=1)
    def step(params, x_t, state):
        return nnx.merge(graphdef, params)(x_t, state)

    # The golden tokens first (checked against HF), then fresh random ones up to STEPS; inputs
    # are sliced on the host so the loop runs no eager device op between steps.
    x_hf = ref["x"]
    extra = np.random.default_rng(0).standard_normal((x_hf.shape[0], STEPS - x_hf.shape[1], x_hf.shape[2]))
    x = np.concatenate([x_hf, extra.astype(np.float32)], axis=1)
    state = block.init_state(x.shape[0])
    ys = []
    for t in range(STEPS):
        previous = state
        y, state = step(params, x[:, t:t + 1], state)
        ys.append(y)
        if t == 0:
            assert previous.recurrent.is_deleted() and previous.conv.is_deleted(), "state was not donated"
    ys = np.concatenate([np.asarray(y) for y in ys], axis=1)
    assert ys.shape == x.shape and np.all(np.isfinite(ys))
    assert rel_err(ys[:, :x_hf.shape[1]], ref[y_key]) <= 1e-5
