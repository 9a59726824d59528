"""Experiment (GPU): would a Mosaic GPU carried verify stream at the decode kernel's rate?

A copy of gdn_decode_mgpu's TMA-ring body doing the carried verify's per-tile work at T=4 with
stand-in operands: fold 4 rank-1 rows into the tile, store it, 2T = 8 column projections over K,
the WY combination of the 4 outputs. Times it against the decode kernel in the same run
(B=128, HV=32, K=V=128, fp32 state). Not library code: a go / no-go probe."""
import functools
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import gdn_decode_mgpu as mg
from gdn_jax.bench.common import time_jax, kernel_times

F32 = jnp.float32


def body(q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, ring, out_ring, q_s, k_s, v_s, o_s,
         ring_bar, in_bar, *, hk, hv, v_dim, block, fold, nproj):
    T, heads = block.tile_v, block.heads
    n_tiles = v_dim // T
    group = hv // hk
    pid = lax.axis_index("blk")
    b = pid // (hv // heads)
    h0 = (pid % (hv // heads)) * heads
    n_steps = heads * n_tiles
    stages = min(block.stages, n_steps)
    wgmma = plgpu.Layout.WGMMA
    rows, cols = wgmma.reduce(1), wgmma.reduce(0)

    def tile(n):
        return s_ref.at[b, h0 + n // n_tiles, :, pl.ds((n % n_tiles) * T, T)]

    plgpu.copy_gmem_to_smem(q_ref.at[b], q_s, in_bar.at[0])
    plgpu.copy_gmem_to_smem(k_ref.at[b], k_s, in_bar.at[0])
    plgpu.copy_gmem_to_smem(v_ref.at[b, pl.ds(h0, heads)], v_s, in_bar.at[0])
    for n in range(stages):
        plgpu.copy_gmem_to_smem(tile(n), ring.at[n], ring_bar.at[n])
    plgpu.barrier_wait(in_bar.at[0])

    def step(n, carry):
        slot = lax.rem(n, stages)
        oslot = lax.rem(n, 2)
        i = n // n_tiles
        c0 = pl.multiple_of((n % n_tiles) * T, T)
        h = h0 + i
        kh = h // group
        kk = plgpu.load(k_s.at[kh], layout=rows).astype(F32)
        qq = plgpu.load(q_s.at[kh], layout=rows).astype(F32)
        vv = plgpu.load(v_s.at[i, pl.ds(c0, T)], layout=cols).astype(F32)
        decay = jnp.exp(g_ref[b, h].astype(F32))
        beta = beta_ref[b, h].astype(F32)
        plgpu.barrier_wait(ring_bar.at[slot])
        S = plgpu.load(ring.at[slot], layout=wgmma).astype(F32)
        S = S * decay
        for r in range(fold):          # pending rows: a_r u_r^T
            S = S + (kk * (1.0 - 0.1 * r))[:, None] * (vv * (0.01 * (r + 1)))[None, :]
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        out_ring[oslot] = S.astype(out_ring.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_ring.at[oslot], tile(n))
        ps = [jnp.sum((kk * (1.0 + 0.01 * r) if r < nproj // 2 else qq * (1.0 + 0.01 * r))[:, None] * S,
                      axis=0) for r in range(nproj)]
        nt = nproj // 2
        z = [vv - ps[t] for t in range(nt)]
        o = jnp.zeros_like(vv)
        for t in range(nt):
            ot = ps[nt + t]
            for l in range(t + 1):
                ot = ot + (beta * (0.5 + 0.1 * l)) * z[l]
            o = o + ot
        o_s[i, pl.ds(c0, T)] = o.astype(o_s.dtype)

        @pl.when(n + stages < n_steps)
        def _():
            plgpu.copy_gmem_to_smem(tile(n + stages), ring.at[slot], ring_bar.at[slot])
        return carry

    lax.fori_loop(0, n_steps, step, 0)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_s, o_ref.at[b, pl.ds(h0, heads)])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("block", "fold", "nproj"), donate_argnums=(5,))
def probe(q, k, v, g, beta, state, *, block, fold, nproj):
    B, HK, K = q.shape
    HV, V = v.shape[1:]
    n_steps = block.heads * (V // block.tile_v)
    stages = min(block.stages, n_steps)
    kern = plgpu.kernel(
        functools.partial(body, hk=HK, hv=HV, v_dim=V, block=block, fold=fold, nproj=nproj),
        out_type=jax.ShapeDtypeStruct((B, HV, V), q.dtype),
        scratch_types=[
            plgpu.SMEM((stages, K, block.tile_v), state.dtype, transforms=block.ring_transforms(4)),
            plgpu.SMEM((2, K, block.tile_v), state.dtype, transforms=block.ring_transforms(4)),
            plgpu.SMEM((HK, K), q.dtype), plgpu.SMEM((HK, K), k.dtype),
            plgpu.SMEM((block.heads, V), v.dtype), plgpu.SMEM((block.heads, V), q.dtype),
            plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_arrivals=3, num_barriers=1)],
        grid=(B * HV // block.heads,), grid_names=("blk",), kernel_name=f"probe_f{fold}_p{nproj}")
    s_ref = jax.new_ref(state)
    o = kern(q, k, v, g, beta, s_ref)
    return o, jax.freeze(s_ref)


def main():
    B, HV, HK, K, V = 128, 32, 16, 128, 128
    ks = jax.random.split(jax.random.PRNGKey(0), 6)
    q = jax.random.normal(ks[0], (B, HK, K), jnp.bfloat16) * 0.1
    k = jax.random.normal(ks[1], (B, HK, K), jnp.bfloat16) * 0.1
    v = jax.random.normal(ks[2], (B, HV, V), jnp.bfloat16)
    g = -jax.nn.softplus(jax.random.normal(ks[3], (B, HV)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, HV)))
    state = 0.1 * jax.random.normal(ks[5], (B, HV, K, V), F32)
    configs = [(0, 2), (4, 2), (4, 8), (0, 8)]
    blocks = [mg.MgpuDecodeBlockSizes(64, 4, 8), mg.MgpuDecodeBlockSizes(64, 3, 4),
              mg.MgpuDecodeBlockSizes(32, 6, 8), mg.MgpuDecodeBlockSizes(32, 3, 4)]
    dec = jax.jit(lambda q, k, v, g, beta, s: mg.gdn_decode_mgpu(q, k, v, g, beta, s), donate_argnums=(5,))
    chain = lambda out, a: (*a[:5], out[1])
    t = time_jax(dec, q, k, v, g, beta, jnp.array(state, copy=True), calls=50, repeats=5, chain=chain)
    print(f"decode mgpu (library): {t * 1e6:.1f} us", flush=True)
    for blk in blocks:
        for fold, nproj in configs:
            f = functools.partial(probe, block=blk, fold=fold, nproj=nproj)
            try:
                t = time_jax(f, q, k, v, g, beta, jnp.array(state, copy=True), calls=50, repeats=5, chain=chain)
                print(f"tile {blk.tile_v} stages {blk.stages} heads {blk.heads}  fold {fold} proj {nproj}: "
                      f"{t * 1e6:.1f} us", flush=True)
            except Exception as e:
                print(f"{blk} fold {fold} proj {nproj}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
