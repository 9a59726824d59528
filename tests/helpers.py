"""Numeric helpers shared by the tests (imported as `from helpers import ...`)."""

import functools

import numpy as np
import jax
import jax.numpy as jnp


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| in float64; NaN or Inf anywhere fails loudly (returns inf)."""
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return float("inf")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def delta_inputs(key, *, B=2, T=8, HK=2, HV=4, K=32, V=32, kind="gdn", dtype=jnp.float32,
                 with_state=True, l2=True, n_states=None):
    """Fresh random inputs for the delta rule (never zeros). Without L2 norm the keys are scaled
    to unit-ish norm so the recurrence stays stable (beta * |k|^2 < 2)."""
    ks = jax.random.split(key, 6)
    q = jax.random.normal(ks[0], (B, T, HK, K), jnp.float32)
    k = jax.random.normal(ks[1], (B, T, HK, K), jnp.float32)
    if not l2:
        q = q / np.sqrt(K)
        k = k / np.sqrt(K)
    v = jax.random.normal(ks[2], (B, T, HV, V), jnp.float32)
    gshape = (B, T, HV) if kind == "gdn" else (B, T, HV, K)
    g = -jax.nn.softplus(jax.random.normal(ks[3], gshape, jnp.float32) - 1.0)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, HV), jnp.float32))
    n = B if n_states is None else n_states
    h0 = 0.3 * jax.random.normal(ks[5], (n, HV, K, V), jnp.float32) if with_state else None
    cast = lambda x: x.astype(dtype)
    return cast(q), cast(k), cast(v), g, beta, h0


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _apply_block(graphdef, op, static, params, *args):
    from flax import nnx
    return getattr(nnx.merge(graphdef, params), op)(*args, **dict(static))


def jit_block(block, op="__call__", **static):
    """`block.<op>(*args, **static)` as a jitted function of *args (static: hashable keyword
    arguments such as impl): one compiled program per (graph, op, static, shapes) instead of op
    by op dispatch."""
    from flax import nnx
    graphdef, params = nnx.split(block)
    static = tuple(sorted(static.items()))
    return lambda *args: _apply_block(graphdef, op, static, params, *args)


def run_block(block, x, state, impl="auto"):
    """A Flax block's call, jitted once per (graph, shapes, impl): (y, new_state)."""
    return jit_block(block, impl=impl)(x, state)
