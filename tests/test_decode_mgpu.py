"""Mosaic GPU decode kernel (pallas_kernels/gdn_decode_mgpu.py) vs reference.decode_step.

Each case runs in the Mosaic GPU interpreter on the CPU ("interpret") and compiled on the GPU
("gpu", marked `gpu`). Fresh random inputs every case; the output is poisoned (interpret mode
fills uninitialised memory with NaN; on the GPU a freed NaN buffer of the output's size is left
for the allocator to hand out), so an element the kernel does not write fails the comparison.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import KERNEL_MODES as MODES, interpret_flag

from gdn_jax import reference as ref
from helpers import rel_err
from pallas_kernels import gdn_decode_mgpu as mg

F32, F16, BF16 = jnp.float32, jnp.float16, jnp.bfloat16
D = mg.MgpuDecodeBlockSizes


def _inputs(seed, B, HK, HV, K, V, in_dtype=F32, state_dtype=F32):
    rng = np.random.default_rng(seed)
    n = lambda *s: rng.standard_normal(s, dtype=np.float32)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q, k = unit(n(B, HK, K)), unit(n(B, HK, K))
    v = n(B, HV, V)
    g = -np.logaddexp(0.0, n(B, HV) - 1.0)
    beta = 1.0 / (1.0 + np.exp(-n(B, HV)))
    s = 0.3 * n(B, HV, K, V)
    cast = lambda x, d: jnp.asarray(x).astype(d)
    return (cast(q, in_dtype), cast(k, in_dtype), cast(v, in_dtype), cast(g, F32), cast(beta, F32),
            cast(s, state_dtype))


def _run(mode, q, k, v, g, beta, s, block):
    if mode == "gpu":  # poison: leave a freed NaN buffer the size of the output
        jax.block_until_ready(jnp.full(v.shape, jnp.nan, q.dtype)).delete()
    return mg.gdn_decode_mgpu(q, k, v, g, beta, s, block=block, interpret=interpret_flag(mode))


def _check(o, s2, ro, rs, tol_o, tol_s):
    assert rel_err(o, ro) < tol_o, rel_err(o, ro)
    assert rel_err(s2, rs) < tol_s, rel_err(s2, rs)
    assert o.dtype == ro.dtype and s2.dtype == rs.dtype


# (B, HK, HV, K, V, block): batch sizes 1/3/7, GVA 1x/2x/4x, ring shorter and longer than the
# steps, one-slot ring, unswizzled ring, more than one head per block.
CASES = [
    (1, 2, 2, 64, 64, D(tile_v=32, stages=2, heads=1)),
    (3, 1, 4, 64, 64, D(tile_v=32, stages=3, heads=2)),
    (7, 2, 4, 64, 64, D(tile_v=64, stages=2, heads=2)),
    (3, 2, 8, 64, 64, D(tile_v=16, stages=1, heads=4, swizzle=False)),
    (1, 1, 2, 128, 32, D(tile_v=32, stages=4, heads=2)),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("B,HK,HV,K,V,block", CASES)
def test_fp32_state(mode, B, HK, HV, K, V, block):
    q, k, v, g, beta, s = _inputs(B * 100 + HV, B, HK, HV, K, V)
    ro, rs = ref.decode_step(q, k, v, g, beta, s)
    o, s2 = _run(mode, q, k, v, g, beta, s, block)
    _check(o, s2, ro, rs, 1e-5, 1e-6)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("B,HK,HV,block", [(3, 2, 4, D(tile_v=64, stages=2, heads=2)),
                                          (7, 1, 2, D(tile_v=32, stages=3, heads=1))])
def test_fp16_state_bf16_inputs(mode, B, HK, HV, block):
    K = V = 64
    q, k, v, g, beta, s = _inputs(B + 11, B, HK, HV, K, V, in_dtype=BF16, state_dtype=F16)
    ro, rs = ref.decode_step(q, k, v, g, beta, s)
    o, s2 = _run(mode, q, k, v, g, beta, s, block)
    # one fp16 rounding of the state, one bf16 rounding of o (possibly on the other side of a tie)
    _check(o, s2, ro, rs, 1e-2, 1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [F32, F16])
def test_gpu_bench_shape_default_blocks(state_dtype):
    """The benchmark's shape (HV=32, HK=16, K=V=128, bf16 inputs) with the default launch shape."""
    q, k, v, g, beta, s = _inputs(5, 16, 16, 32, 128, 128, in_dtype=BF16, state_dtype=state_dtype)
    ro, rs = ref.decode_step(q, k, v, g, beta, s)
    o, s2 = _run("gpu", q, k, v, g, beta, s, None)
    _check(o, s2, ro, rs, 5e-3, 1e-6 if state_dtype == F32 else 1e-3)


def test_bad_inputs_raise():
    q, k, v, g, beta, s = _inputs(0, 2, 1, 2, 64, 64)
    with pytest.raises(ValueError, match="state"):
        mg.gdn_decode_mgpu(q, k, v, g, beta, s[:, :, :32])
    with pytest.raises(ValueError, match="HV=3"):
        q3, k3, v3, g3, b3, s3 = _inputs(0, 2, 2, 2, 64, 64)
        mg.gdn_decode_mgpu(q3, k3, v3[:, :1].repeat(3, 1), g3, b3, s3)
    with pytest.raises(ValueError, match="g must"):
        mg.gdn_decode_mgpu(q, k, v, g[:, :1], beta, s)
    with pytest.raises(ValueError, match="K=48"):
        q2, k2, v2, g2, b2, s2 = _inputs(0, 2, 1, 2, 48, 64)
        mg.gdn_decode_mgpu(q2, k2, v2, g2, b2, s2)
    with pytest.raises(ValueError, match="state dtype"):
        mg.gdn_decode_mgpu(q, k, v, g, beta, s.astype(BF16))
    with pytest.raises(ValueError, match="heads=3"):
        mg.gdn_decode_mgpu(q, k, v, g, beta, s, block=D(heads=3))
    assert mg.unsupported_reason(128, 128, 16, 32, F32, mg.default_block_sizes(128, 32, 128, F32)) is None
