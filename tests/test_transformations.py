"""JAX transformations through the kernel paths of `gated_delta_rule` and `kda`.

Derivatives: the kernels are forward-only; under jax.grad / jax.jvp the outputs come from the
kernel and the derivatives from the pure-JAX path "auto" falls back to, evaluated at the same
inputs (`gdn_jax.ops._kernel`). So a kernel call differentiates like that path, and a call
that is not differentiated runs the kernel alone.

vmap: the Pallas calls batch over an extra leading axis, and the caller's arrays stay valid.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn_jax
from tests.conftest import KERNEL_MODES, interpret_flag
from tests.helpers import rel_err

F32 = jnp.float32
HK, HV, K = 1, 2, 16


def _inputs(kind, B, T, N=None, seed=0):
    ks = iter(jax.random.split(jax.random.PRNGKey(seed), 10))
    q, k = (jax.random.normal(next(ks), (B, T, HK, K), F32) for _ in range(2))
    v = jax.random.normal(next(ks), (B, T, HV, K), F32)
    gshape = (B, T, HV, K) if kind == "kda" else (B, T, HV)
    g = -0.3 * jnp.abs(jax.random.normal(next(ks), gshape, F32))
    beta = jax.random.uniform(next(ks), (B, T, HV), F32, 0.1, 0.9)
    h0 = 0.3 * jax.random.normal(next(ks), (N or B, HV, K, K), F32)
    w_o = jax.random.normal(next(ks), (B, T, HV, K), F32)
    w_s = jax.random.normal(next(ks), (N or B, HV, K, K), F32)
    return (q, k, v, g, beta, h0), (w_o, w_s)


def _loss(kind, impl, interpret, weights, cu=None):
    fn = gdn_jax.kda if kind == "kda" else gdn_jax.gated_delta_rule

    def loss(q, k, v, g, beta, h0):
        o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                  use_qk_l2norm=True, cu_seqlens=cu, impl=impl, interpret=interpret)
        return jnp.sum(o * weights[0]) + jnp.sum(s * weights[1]), (o, s)
    return loss


@pytest.mark.parametrize("mode", KERNEL_MODES)
@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("T,family,pure", [(1, "decode", "reference"),
                                           (5, "serial prefill", "reference"),
                                           (70, "chunked prefill", "chunked")])
def test_kernel_paths_differentiate_as_the_pure_jax_path(mode, kind, T, family, pure):
    """jax.grad through each kernel family, with respect to every float input and the initial
    state: the pure-JAX path's gradients (fp32, within 1e-5), and the kernel's own outputs."""
    args, weights = _inputs(kind, 2, T, seed=T)
    op = "kda" if kind == "kda" else "gated_delta_rule"
    with gdn_jax.interpret(interpret_flag(mode)):
        assert gdn_jax.explain(op, *args[:5], initial_state=args[5]).family == family
    argnums = tuple(range(6))
    (_, (o, s)), grads = jax.value_and_grad(_loss(kind, "pallas", interpret_flag(mode), weights),
                                            argnums, has_aux=True)(*args)
    (_, _), want = jax.value_and_grad(_loss(kind, pure, None, weights), argnums,
                                      has_aux=True)(*args)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), grads, want):
        assert float(jnp.max(jnp.abs(b))) > 0, name
        assert rel_err(a, b) <= 1e-5, (name, rel_err(a, b))
    # the values are the kernel's, bit for bit
    o2, s2 = _loss(kind, "pallas", interpret_flag(mode), weights)(*args)[1]
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o2))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s2))


def test_packed_kernel_call_differentiates_under_jit():
    """A packed call inside jit (traced cu_seqlens, an empty and a one-token sequence): the
    chunked kernel's gradients are the chunk form's, and jax.jvp's tangents too."""
    lens = [0, 1, 70, 30]
    cu = jnp.array(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    args, weights = _inputs("gdn", 1, sum(lens), N=len(lens), seed=4)

    @jax.jit
    def grads(cu, *args):
        loss = lambda impl, interp: _loss("gdn", impl, interp, weights, cu)
        return (jax.grad(lambda *a: loss("pallas", True)(*a)[0], range(6))(*args),
                jax.grad(lambda *a: loss("chunked", None)(*a)[0], range(6))(*args))

    got, want = grads(cu, *args)
    for a, b in zip(got, want):
        assert rel_err(a, b) <= 1e-5
    tangents = tuple(jax.random.normal(jax.random.PRNGKey(i), x.shape, F32)
                     for i, x in enumerate(args))
    fwd = lambda impl, interp: (lambda *a: _loss("gdn", impl, interp, weights, cu)(*a)[1])
    _, t_got = jax.jvp(fwd("pallas", True), args, tangents)
    _, t_want = jax.jvp(fwd("chunked", None), args, tangents)
    for a, b in zip(jax.tree.leaves(t_got), jax.tree.leaves(t_want)):
        assert rel_err(a, b) <= 1e-5


@pytest.mark.parametrize("mode", KERNEL_MODES)
@pytest.mark.parametrize("kind,T", [("gdn", 1), ("kda", 1), ("kda", 5), ("gdn", 70)])
def test_vmap_over_the_kernel_paths_keeps_the_callers_arrays(mode, kind, T):
    """jax.vmap over an extra leading axis, called eagerly, with each kernel family: the
    reference's results, and the caller's initial_state still valid afterwards (the decode
    family once donated it: under an eager vmap the inner jit's donation is real)."""
    E = 3
    args = [jnp.stack(x) for x in zip(*(_inputs(kind, 2, T, seed=s)[0] for s in range(E)))]
    fn = gdn_jax.kda if kind == "kda" else gdn_jax.gated_delta_rule
    call = lambda impl, interp: jax.vmap(
        lambda q, k, v, g, beta, h0: fn(q, k, v, g, beta, initial_state=h0,
                                        output_final_state=True, use_qk_l2norm=True, impl=impl,
                                        interpret=interp))
    got = call("pallas", interpret_flag(mode))(*args)
    want = call("reference", None)(*args)
    for a, b in zip(got, want):
        assert rel_err(a, b) <= 1e-5
    assert not args[5].is_deleted()
    np.testing.assert_array_equal(np.asarray(args[5][0]), np.asarray(_inputs(kind, 2, T)[0][5]))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_gpu_vmap_of_the_mosaic_prefill_equals_its_calls_one_by_one(kind):
    """The Mosaic GPU prefill (bf16, K = V = 128, whole chunks) under jax.vmap: each slice of
    the batched call equals the unbatched call on that slice, bit for bit."""
    ks = iter(jax.random.split(jax.random.PRNGKey(9), 8))
    E, B, T, hk, hv, kd = 2, 2, 256, 2, 4, 128
    q, k = (jax.random.normal(next(ks), (E, B, T, hk, kd), F32).astype(jnp.bfloat16)
            for _ in range(2))
    v = jax.random.normal(next(ks), (E, B, T, hv, kd), F32).astype(jnp.bfloat16)
    gshape = (E, B, T, hv, kd) if kind == "kda" else (E, B, T, hv)
    g = -0.3 * jnp.abs(jax.random.normal(next(ks), gshape, F32))
    beta = jax.random.uniform(next(ks), (E, B, T, hv), F32)
    h0 = 0.1 * jax.random.normal(next(ks), (E, B, hv, kd, kd), F32)
    fn = gdn_jax.kda if kind == "kda" else gdn_jax.gated_delta_rule
    call = lambda *a: fn(*a[:5], initial_state=a[5], output_final_state=True,
                         use_qk_l2norm=True, impl="pallas")
    batched = jax.jit(jax.vmap(call))(q, k, v, g, beta, h0)
    for e in range(E):
        one = jax.jit(call)(q[e], k[e], v[e], g[e], beta[e], h0[e])
        for a, b in zip(batched, one):
            np.testing.assert_array_equal(np.asarray(a[e]), np.asarray(b))
