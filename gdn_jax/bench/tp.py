"""bench tp: both blocks with their heads split over N devices (`mesh=`) against one device.

    gdn-jax bench tp --mesh 2                 # on a machine with >= 2 GPUs
    gdn-jax bench tp --mesh 2 --smoke         # tiny shapes on the CPU (2 host devices)

For each block at a real model's dimensions -- Qwen3-Next-80B's Gated DeltaNet (hidden 2048,
HK = 16, HV = 32, K = V = 128) and Kimi-Linear-48B's KDA (hidden 2304, 32 heads, K = V = 128),
bf16 weights and activations, fp32 state -- it times

    decode   one serving decode step (`block.decode`) of B sequences (default 256), the state
             pool donated and chained from step to step
    prefill  one `block(x)` call over T tokens (default 32768) from a fresh state

on one device (no mesh) and on a mesh of N devices, and reports tokens/s and the throughput
ratio N-device / 1-device. Both include the block's projections and, on the mesh, the one
all-reduce of the output. With --smoke (no GPU needed) the shapes are tiny, the kernels run in
Pallas interpret mode and the times mean nothing.
"""

from __future__ import annotations

import argparse
import os
from typing import Sequence

from gdn_jax.bench import common

QWEN3_NEXT_80B = dict(hidden_size=2048, num_k_heads=16, num_v_heads=32, head_k_dim=128,
                      head_v_dim=128)
KIMI_LINEAR_48B = dict(hidden_size=2304, num_heads=32, head_dim=128)
SMOKE = dict(gdn=dict(hidden_size=64, num_k_heads=4, num_v_heads=8, head_k_dim=16, head_v_dim=16),
             kda=dict(hidden_size=64, num_heads=4, head_dim=16), B=4, T=32)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gdn-jax bench tp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_shared_flags(p, batches="256", seq_lens="32768", dtype="bfloat16", peers="none")
    p.add_argument("--mesh", type=int, default=2, help="devices on the 'tp' axis (default 2)")
    p.add_argument("--blocks", default="qwen3_next,kimi_linear",
                   help="which blocks, comma-separated (default %(default)s)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.mesh < 2:
        raise SystemExit("--mesh must be at least 2")
    if args.smoke:   # host devices for the CPU pass; effective only before JAX starts
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.mesh}".strip()
    why = common.missing_gpu(args.smoke)
    if why:
        print(f"gdn-jax bench tp: {why}")
        return 2
    import jax
    if len(jax.devices()) < args.mesh:
        print(f"gdn-jax bench tp: --mesh {args.mesh} needs {args.mesh} devices, this machine has "
              f"{len(jax.devices())}")
        return 2
    import contextlib

    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh

    import gdn_jax
    from gdn_jax.layers import GDNConfig, KDAConfig, KimiDeltaAttention, Qwen3NextGatedDeltaNet

    rep = common.Report("tp", args)
    dtype = jnp.dtype(args.dtype)
    batches, seq_lens = args.batches, args.seq_lens
    gdn_dims, kda_dims = QWEN3_NEXT_80B, KIMI_LINEAR_48B
    if args.smoke:
        gdn_dims, kda_dims = SMOKE["gdn"], SMOKE["kda"]
        batches, seq_lens = [SMOKE["B"]], [SMOKE["T"]]
    blocks = {"qwen3_next": (Qwen3NextGatedDeltaNet, GDNConfig(**gdn_dims)),
              "kimi_linear": (KimiDeltaAttention, KDAConfig(**kda_dims))}
    chosen = [b.strip() for b in args.blocks.split(",") if b.strip()]
    bad = [b for b in chosen if b not in blocks]
    if bad:
        raise SystemExit(f"--blocks: unknown {bad}; choose from {sorted(blocks)}")
    mesh = Mesh(np.array(jax.devices()[:args.mesh]), ("tp",))
    rep.meta.update(mesh=args.mesh, dtype=args.dtype)
    interp = gdn_jax.interpret() if jax.default_backend() != "gpu" else contextlib.nullcontext()
    calls, repeats = (1, 1) if args.smoke else (10, args.repeats)

    def time_block(cls, config, on_mesh, op, size):
        block = cls(config, rngs=nnx.Rngs(0), param_dtype=dtype, mesh=mesh if on_mesh else None)
        graphdef, params = nnx.split(block)
        hidden = config.hidden_size
        if op == "decode":
            serving = block.init_serving_state(size)
            slots = jnp.arange(size, dtype=jnp.int32)
            x = jax.random.normal(jax.random.PRNGKey(1), (size, 1, hidden), dtype)
            step = jax.jit(lambda p, x, s, sl: nnx.merge(graphdef, p).decode(x, s, sl),
                           donate_argnums=2)
            sec = common.time_jax(step, params, x, serving, slots, calls=calls, repeats=repeats,
                                  chain=lambda out, a: (a[0], a[1], out[1], a[3]))
            return size / sec, sec
        x = jax.random.normal(jax.random.PRNGKey(2), (1, size, hidden), dtype)
        fwd = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))
        sec = common.time_jax(fwd, params, x, calls=max(1, calls // 5), repeats=repeats)
        return size / sec, sec

    lines = [f"| block | op | size | 1 device tok/s | {args.mesh} devices tok/s | ratio |",
             "|---|---|---|---|---|---|"]
    with interp:
        for name in chosen:
            cls, config = blocks[name]
            for op, sizes in (("decode", batches), ("prefill", seq_lens)):
                for size in sizes:
                    rep.progress(f"{name} {op} {'B' if op == 'decode' else 'T'}={size} ...")
                    one, one_sec = time_block(cls, config, False, op, size)
                    many, many_sec = time_block(cls, config, True, op, size)
                    row = rep.add(block=name, op=op, size=size, devices=args.mesh,
                                  tokens_per_s_1=one, tokens_per_s_n=many, ms_1=one_sec * 1e3,
                                  ms_n=many_sec * 1e3, ratio=many / one)
                    lines.append(f"| {name} | {op} | {'B' if op == 'decode' else 'T'}={size} | "
                                 f"{one:,.0f} | {many:,.0f} | {row['ratio']:.2f}x |")
    title = f"Heads split over {args.mesh} devices (bench tp)"
    md = "\n".join(lines) + (f"\n\n{rep.meta['device']}, {args.dtype} weights and activations, "
                             "fp32 state." + (" SMOKE RUN: times mean nothing." if args.smoke else ""))
    return rep.finish(title, md)
