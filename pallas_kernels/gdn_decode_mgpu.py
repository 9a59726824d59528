"""Single-token Gated DeltaNet decode on Hopper through Mosaic GPU (experiment).

The plain decode step of `gdn_decode.py` (precomputed g, beta; contiguous batch; fp32 or fp16
state), written for the Mosaic GPU backend of Pallas instead of the Triton lowering: the state
streams through shared memory in bulk-tensor (TMA) copies with a multi-stage ring, instead of
register tiles loaded and stored by every thread.

Per (sequence b, value head h), state S = state[b, h] is [K, V], K-major:

    S <- exp(g) S ;  u = beta (v - S^T k) ;  S <- S + k u^T ;  o = S^T (scale q)

One CUDA block (one warpgroup, 128 threads) owns `heads` consecutive value heads of one sequence
and walks their state in [K, tile_v] tiles, `heads * V / tile_v` steps of a `fori_loop`. A ring
of `stages` shared-memory slots (128-byte swizzled) holds the loads: `stages` tiles are in flight
before the first step, and a slot is refilled at the end of the step that consumed it. The updated
tile goes to one of two store slots and back to the state in place by TMA; a store slot is
reused once the store issued from it two steps earlier has read it, so loads never wait on
stores. q, k (this sequence's key heads) and v (the block's value heads) come in by TMA once per
block; the scalar gates are read straight from global memory; the block's outputs are gathered
in shared memory and stored by one TMA copy at the end. Math: fp32 in the WGMMA register layout,
the two column sums reduced across the warps.

H200, HV=32, K=V=128 (BENCHMARKS.md, "GDN decode (Mosaic GPU experiment)"): 150.5 us at B=128
fp32 (Triton kernel 153.7 us in the same run), 291.1 us at B=256 (300.2); slower at B=32 and for
fp16 states. gdn_jax.decode dispatches the plain fp32 step at B >= 128 here.

The state is updated in place: the launcher passes it as a mutable `jax.Ref`, which Pallas
aliases to the kernel's output (donate the state at the jit boundary).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

F32 = jnp.float32
STATE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16))
SMEM_LIMIT = 227 * 1024  # H100/H200 dynamic shared memory per block

__all__ = ["MgpuDecodeBlockSizes", "default_block_sizes", "unsupported_reason", "gdn_decode_mgpu"]


@dataclasses.dataclass(frozen=True)
class MgpuDecodeBlockSizes:
    """Launch shape: one block owns `heads` value heads of one sequence (grid B * HV / heads),
    walks them in [K, tile_v] state tiles: a ring of `stages` shared-memory slots for the loads
    (`stages` tiles in flight) and two slots for the stores."""
    tile_v: int = 64
    stages: int = 4
    heads: int = 8
    swizzle: bool = True  # ring slots tiled + swizzled (TMA writes them so): no bank conflicts

    def ring_transforms(self, state_itemsize: int) -> tuple:
        if not self.swizzle:
            return ()
        swz = min(128, self.tile_v * state_itemsize)
        return (plgpu.TilingTransform((8, swz // state_itemsize)), plgpu.SwizzleTransform(swz))

    def smem_bytes(self, k_dim: int, v_dim: int, state_itemsize: int, hk: int, in_itemsize: int,
                   out_itemsize: int) -> int:
        return ((self.stages + 2) * k_dim * self.tile_v * state_itemsize + 2 * hk * k_dim * in_itemsize
                + self.heads * v_dim * (in_itemsize + out_itemsize) + 4 * 1024)


def default_block_sizes(batch: int, num_v_heads: int, v_dim: int, state_dtype, *, k_dim: int = 128,
                        num_k_heads: int = 16, in_itemsize: int = 2) -> MgpuDecodeBlockSizes:
    """The launch shape measured best on the H200 (2026-11-30, HV=32, K=V=128, bf16 q/k/v):
    [K, 64] fp32 tiles, 4 loads in flight per block, 8 heads per block at B=128 (150.5 us),
    16 at B=256 (291.1 us); smaller batches want more, smaller blocks. Heads are halved until
    the shared memory fits."""
    itemsize = jnp.dtype(state_dtype).itemsize
    heads = 16 if batch >= 256 else 8 if batch >= 64 else 4 if batch >= 16 else 1
    tile = min(64 if itemsize == 4 else 128, v_dim)
    while heads > 1 and (num_v_heads % heads or MgpuDecodeBlockSizes(tile, 4, heads).smem_bytes(
            k_dim, v_dim, itemsize, num_k_heads, in_itemsize, in_itemsize) > SMEM_LIMIT):
        heads //= 2
    return MgpuDecodeBlockSizes(tile_v=tile, stages=4, heads=heads)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def unsupported_reason(k_dim: int, v_dim: int, num_k_heads: int, num_v_heads: int, state_dtype,
                       block: MgpuDecodeBlockSizes, in_itemsize: int = 4) -> str | None:
    """Why this kernel cannot take the call (None when it can). Pure. `in_itemsize`: bytes per
    element of q, k, v (and of the output, which has q's dtype)."""
    if jnp.dtype(state_dtype) not in STATE_DTYPES:
        return f"state dtype {jnp.dtype(state_dtype)} is not float32/float16 (Mosaic GPU kernel)"
    if k_dim not in (64, 128, 256):
        return f"K={k_dim} must be 64, 128 or 256 (rows of the WGMMA register layout)"
    if not (_pow2(v_dim) and 16 <= v_dim <= 256):
        return f"V={v_dim} must be a power of two in [16, 256]"
    if not (_pow2(block.tile_v) and 16 <= block.tile_v and v_dim % block.tile_v == 0):
        return f"tile_v={block.tile_v} must be a power of two >= 16 dividing V={v_dim}"
    if num_k_heads <= 0 or num_v_heads % num_k_heads:
        return f"HV={num_v_heads} must be a multiple of HK={num_k_heads}"
    if block.heads < 1 or num_v_heads % block.heads:
        return f"heads={block.heads} (per block) must divide HV={num_v_heads}"
    if block.swizzle and block.tile_v * jnp.dtype(state_dtype).itemsize < 32:
        return f"tile_v={block.tile_v} is too narrow to swizzle (needs >= 32 bytes per row)"
    if block.stages < 1:
        return f"stages={block.stages} must be >= 1"
    need = block.smem_bytes(k_dim, v_dim, jnp.dtype(state_dtype).itemsize, num_k_heads, in_itemsize,
                            in_itemsize)
    if need > SMEM_LIMIT:
        return f"{block} needs ~{need} bytes of shared memory (> {SMEM_LIMIT})"
    return None


# --------------------------------------------------------------------------- kernel body

def _decode_body(q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref,
                 ring, out_ring, q_s, k_s, v_s, o_s, ring_bar, in_bar, *,
                 scale: float, hk: int, hv: int, k_dim: int, v_dim: int,
                 block: MgpuDecodeBlockSizes):
    T, heads = block.tile_v, block.heads
    n_tiles = v_dim // T
    group = hv // hk
    pid = lax.axis_index("blk")
    b = pid // (hv // heads)
    h0 = (pid % (hv // heads)) * heads
    n_steps = heads * n_tiles
    stages = min(block.stages, n_steps)
    wgmma = plgpu.Layout.WGMMA
    rows, cols = wgmma.reduce(1), wgmma.reduce(0)  # [K] along rows, [T] along columns

    def tile(n):  # step n: head h0 + n // n_tiles, columns (n % n_tiles) * T ...
        return s_ref.at[b, h0 + n // n_tiles, :, pl.ds((n % n_tiles) * T, T)]

    # Per-block operands: every key head of this sequence, the block's value rows.
    plgpu.copy_gmem_to_smem(q_ref.at[b], q_s, in_bar.at[0])
    plgpu.copy_gmem_to_smem(k_ref.at[b], k_s, in_bar.at[0])
    plgpu.copy_gmem_to_smem(v_ref.at[b, pl.ds(h0, heads)], v_s, in_bar.at[0])
    for n in range(stages):  # fill the ring: `stages` tiles in flight before the first step
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
        qq = plgpu.load(q_s.at[kh], layout=rows).astype(F32) * jnp.float32(scale)
        vv = plgpu.load(v_s.at[i, pl.ds(c0, T)], layout=cols).astype(F32)
        decay = jnp.exp(g_ref[b, h].astype(F32))
        beta = beta_ref[b, h].astype(F32)
        plgpu.barrier_wait(ring_bar.at[slot])
        S = plgpu.load(ring.at[slot], layout=wgmma).astype(F32)
        S = S * decay
        u = beta * (vv - jnp.sum(kk[:, None] * S, axis=0))
        S = S + kk[:, None] * u[None, :]
        o = jnp.sum(qq[:, None] * S, axis=0)
        # The output slot was last stored two steps ago: wait until that store has read it
        # (the store of the previous step may stay in flight).
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        out_ring[oslot] = S.astype(out_ring.dtype)
        o_s[i, pl.ds(c0, T)] = o.astype(o_s.dtype)
        plgpu.commit_smem()  # fence + barrier: every thread is done reading ring[slot] too
        plgpu.copy_smem_to_gmem(out_ring.at[oslot], tile(n))

        @pl.when(n + stages < n_steps)
        def _():  # refill the consumed slot; loads never wait for stores
            plgpu.copy_gmem_to_smem(tile(n + stages), ring.at[slot], ring_bar.at[slot])
        return carry

    lax.fori_loop(0, n_steps, step, 0)
    plgpu.copy_smem_to_gmem(o_s, o_ref.at[b, pl.ds(h0, heads)])
    plgpu.wait_smem_to_gmem(0)


# --------------------------------------------------------------------------- launcher

def gdn_decode_mgpu(q, k, v, g, beta, state, *, scale: float | None = None,
                    block: MgpuDecodeBlockSizes | None = None, interpret: bool = False):
    """One decode token. q, k [B, HK, K]; v [B, HV, V]; g (log decay), beta [B, HV]; state
    [B, HV, K, V] fp32/fp16. Returns (o [B, HV, V] in q's dtype, new state). The state is
    updated in place (donate it at the jit boundary). Shapes are checked here.
    `interpret=True` runs the kernel in the Mosaic GPU interpreter (CPU)."""
    for name, x, rank in (("q", q, 3), ("k", k, 3), ("v", v, 3), ("g", g, 2), ("beta", beta, 2),
                          ("state", state, 4)):
        if getattr(x, "ndim", None) != rank:
            raise ValueError(f"{name} must have rank {rank}, got shape {getattr(x, 'shape', None)}")
    B, HK, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {q.shape}, got {k.shape}")
    if v.shape[0] != B:
        raise ValueError(f"v must be [B={B}, HV, V], got {v.shape}")
    HV, V = v.shape[1:]
    if HK == 0 or HV % HK:
        raise ValueError(f"v's head count HV={HV} must be a multiple of q/k's head count HK={HK}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (B, HV):
            raise ValueError(f"{name} must have shape {(B, HV)}, got {x.shape}")
    if state.shape != (B, HV, K, V):
        raise ValueError(f"state must have shape {(B, HV, K, V)}, got {state.shape}")
    in_itemsize = max(jnp.dtype(x.dtype).itemsize for x in (q, k, v))
    block = block or default_block_sizes(B, HV, V, state.dtype, k_dim=K, num_k_heads=HK,
                                         in_itemsize=in_itemsize)
    reason = unsupported_reason(K, V, HK, HV, state.dtype, block, in_itemsize)
    if reason is not None:
        raise ValueError(reason)
    scale = float(K ** -0.5 if scale is None else scale)
    return _launch(q, k, v, g, beta, state, scale=scale, block=block, interpret=bool(interpret))


@functools.partial(jax.jit, static_argnames=("scale", "block", "interpret"))
def _launch(q, k, v, g, beta, state, *, scale, block, interpret):
    B, HK, K = q.shape
    HV, V = v.shape[1:]
    n_steps = block.heads * (V // block.tile_v)
    stages = min(block.stages, n_steps)
    body = functools.partial(_decode_body, scale=scale, hk=HK, hv=HV, k_dim=K, v_dim=V, block=block)
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((B, HV, V), q.dtype),
        scratch_types=[
            plgpu.SMEM((stages, K, block.tile_v), state.dtype,
                       transforms=block.ring_transforms(state.dtype.itemsize)),
            plgpu.SMEM((2, K, block.tile_v), state.dtype,
                       transforms=block.ring_transforms(state.dtype.itemsize)),
            plgpu.SMEM((HK, K), q.dtype),
            plgpu.SMEM((HK, K), k.dtype),
            plgpu.SMEM((block.heads, V), v.dtype),
            plgpu.SMEM((block.heads, V), q.dtype),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_arrivals=3, num_barriers=1),
        ],
        grid=(B * HV // block.heads,),
        grid_names=("blk",),
        kernel_name="gdn_decode_mgpu",
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    s_ref = jax.new_ref(state)
    o = kernel(q, k, v, g, beta, s_ref)
    return o, jax.freeze(s_ref)
