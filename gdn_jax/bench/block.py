"""`gdn-jax bench block`: the Flax blocks end to end, against the sum of their parts and HF/FLA.

Blocks (random weights, bf16 parameters and compute, fp32 state):
  qwen3_next  Qwen3-Next-80B dims: hidden 2048, HK = 16, HV = 32, K = V = 128
  kimi        Kimi-Linear-48B dims: hidden 2304, 32 heads, K = V = 128 (softplus gate)

Decode (--batches, default 1, 32, 128, 256): one token per sequence through the block's
`__call__` with T = 1 (the one-launch conv + norm + recurrence kernel where the dispatch gives it
the call), `--unroll` chained steps per jitted call with the state donated; and the same step
through the serving path (`decode` on a pool of B slots, slot table 0..B-1, nothing pending: the
fold of pending verify rows is skipped by its gate), serving state donated. Beside them, the sum
of its parts timed the same way: the recurrence kernel alone (`gdn_jax.decode.gdn_decode` on
prepared q, k, v, g, beta, state donated), the one-launch kernel alone (on the block's
prepared projection rows, state and conv windows donated) and the projections alone (input and
output projections of the block, nothing else, `--unroll` steps chained through the output
gate). The block's output is checked against the unfused chain (impl="reference") in the run.

Prefill (--seq-lens, default 4096, 32768; B = 1): the block's `__call__` from a fresh state, one
call per jitted program, against the sequence kernel alone (`gated_delta_rule` / `kda` with
impl="pallas": the chunked prefill kernel) and the projections alone; the table gives the
kernel's share of the block time.

Peers (`--peers fla`): HF's torch module (transformers' Qwen3-Next layer) where transformers is
importable, else FLA's own layer modules (`fla.layers.GatedDeltaNet` / `KimiDeltaAttention`),
in a subprocess, same dims, bf16, random weights (times only: different weights, no output
check). What is missing is printed as one line.

Heads split over devices (`--mesh N`, N > 1; the blocks' `mesh=`, see docs/layers.md): instead
of the above, each block on one device against the same block with its heads split over N
devices, as time per step, tokens/s and the ratio N-device / 1-device throughput:

  serving decode  `block.decode` of B sequences (B slots of a state pool), the pool donated
  call T=1        `block(x, state)` with one token per row (contiguous state: the one-launch
                  kernel), the state donated
  prefill         `block(x)` over T tokens from a fresh state (B = 1)

Both decode forms chain `--unroll` steps per jitted call; the difference between them is the
serving path's own cost (folding pending stash rows, the conv pool's gather and scatter),
the same on one device and on the mesh. Each operation's inputs are placed where the block
wants them before timing (on the mesh: replicated, as the previous layer's all-reduced output
is) and the timed calls run under `jax.transfer_guard("disallow")`, so no input moves between
devices per call. The mesh's outputs are checked against the one-device block's (same weights,
same inputs; bf16, so they differ by the rounding of the partial output projections).
`--smoke --mesh N` runs on N host CPU devices.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
from typing import Sequence

import numpy as np

from gdn_jax.bench import common

BLOCKS = {
    "qwen3_next": dict(hidden=2048, num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128),
    "kimi": dict(hidden=2304, num_k_heads=32, num_v_heads=32, head_k_dim=128, head_v_dim=128),
}
SMOKE = dict(hidden=32, num_k_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16)
SMOKE_T, SMOKE_B = 40, (1, 3)
# --smoke --mesh N: head counts that 2 and 4 devices divide
SMOKE_MESH = dict(hidden=32, num_k_heads=4, num_v_heads=4, head_k_dim=16, head_v_dim=16)


def make_block(name: str, dims: dict, *, mesh=None):
    """A block with random weights at these dims (the same weights for every `mesh`), bf16
    parameters and compute; `mesh`: its heads split over that mesh's "tp" axis."""
    import jax.numpy as jnp
    from flax import nnx
    from gdn_jax.layers import GDNConfig, KDAConfig, KimiDeltaAttention, Qwen3NextGatedDeltaNet
    bf16 = jnp.bfloat16
    if name == "qwen3_next":
        cfg = GDNConfig(hidden_size=dims["hidden"], num_k_heads=dims["num_k_heads"],
                        num_v_heads=dims["num_v_heads"], head_k_dim=dims["head_k_dim"],
                        head_v_dim=dims["head_v_dim"])
        return Qwen3NextGatedDeltaNet(cfg, rngs=nnx.Rngs(0), dtype=bf16, param_dtype=bf16,
                                      mesh=mesh)
    cfg = KDAConfig(hidden_size=dims["hidden"], num_heads=dims["num_k_heads"],
                    head_dim=dims["head_k_dim"], num_v_heads=dims["num_v_heads"],
                    head_v_dim=dims["head_v_dim"])
    return KimiDeltaAttention(cfg, rngs=nnx.Rngs(0), dtype=bf16, param_dtype=bf16, mesh=mesh)


# --------------------------------------------------------------------------- peer (subprocess)

def _peer_module(name: str, dims: dict):
    """HF's torch layer where transformers has it, else FLA's layer module: (module, who)."""
    import torch
    d = dims
    if name == "qwen3_next":
        try:
            from transformers import Qwen3NextConfig
            from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
            cfg = Qwen3NextConfig(hidden_size=d["hidden"], linear_num_key_heads=d["num_k_heads"],
                                  linear_num_value_heads=d["num_v_heads"],
                                  linear_key_head_dim=d["head_k_dim"],
                                  linear_value_head_dim=d["head_v_dim"])
            return Qwen3NextGatedDeltaNet(cfg, layer_idx=0), "HF Qwen3NextGatedDeltaNet"
        except ImportError:
            from fla.layers import GatedDeltaNet
            return (GatedDeltaNet(hidden_size=d["hidden"], head_dim=d["head_k_dim"],
                                  num_heads=d["num_k_heads"], num_v_heads=d["num_v_heads"],
                                  expand_v=d["head_v_dim"] / d["head_k_dim"], mode="chunk"),
                    "FLA layers.GatedDeltaNet")
    from fla.layers import KimiDeltaAttention
    del torch
    return (KimiDeltaAttention(hidden_size=d["hidden"], head_dim=d["head_k_dim"],
                               num_heads=d["num_k_heads"], mode="chunk"),
            "FLA layers.KimiDeltaAttention")


def _torch_peer(cases: list[dict], out_dir: str) -> None:
    """Runs in a subprocess: prefill of the peer module on [1, T, hidden] (decode needs the
    peer's own cache object and is not timed here)."""
    import torch

    modules = {}

    def run_case(c):
        if c["block"] not in modules:
            m, who = _peer_module(c["block"], c["dims"])
            modules[c["block"]] = (m.cuda().to(torch.bfloat16).eval(), who)
        m, who = modules[c["block"]]
        x = torch.randn(1, c["T"], c["dims"]["hidden"], device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            fn = lambda: m(x)
            fn()
            torch.cuda.synchronize()
            us = common.torch_do_bench_us(fn)
        return {"us": us, "who": who}, None

    common.peer_cases(cases, out_dir, run_case, tag="peer")


# --------------------------------------------------------------------------- ours

def build_parser() -> argparse.ArgumentParser:
    p = common.make_parser("block", __doc__, batches="1,32,128,256", seq_lens="4096,32768",
                           dtype="bfloat16", peers="fla")
    p.add_argument("--blocks", default="qwen3_next,kimi",
                   help=f"which blocks, comma-separated from {sorted(BLOCKS)} (default %(default)s)")
    p.add_argument("--unroll", type=int, default=20, help="decode steps chained per jitted call")
    p.add_argument("--no-prefill", action="store_true", help="time decode only")
    p.add_argument("--mesh", type=int, default=1, metavar="N",
                   help="N > 1: each block on 1 device vs its heads split over N devices "
                        "(serving decode, T=1 call, prefill); default 1: one device, the parts")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.mesh < 1:
        raise SystemExit("--mesh must be at least 1")
    if args.mesh > 1 and args.smoke:   # host devices for the CPU pass: only before JAX starts
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = (f"{flags} --xla_force_host_platform_device_count="
                                       f"{args.mesh}").strip()
    if not common.runs_here("block", args):
        return 2
    if args.mesh > 1:
        return mesh_main(args)

    import jax
    import jax.numpy as jnp
    from flax import nnx

    import gdn_jax
    from gdn_jax.decode import gdn_decode

    rep = common.Report("block", args)
    names = [n.strip() for n in args.blocks.split(",") if n.strip()]
    bad = [n for n in names if n not in BLOCKS]
    if bad:
        raise SystemExit(f"--blocks: unknown {bad}; choose from {sorted(BLOCKS)}")
    batches, seq_lens = args.batches, ([] if args.no_prefill else args.seq_lens)
    calls, repeats = (1, 1) if args.smoke else (10, args.repeats)
    if args.smoke:
        batches, seq_lens, args.unroll = list(SMOKE_B), ([] if args.no_prefill else [SMOKE_T]), 2
    interp = jax.default_backend() != "gpu"
    ctx = common.kernel_context
    dtype = jnp.dtype(args.dtype)

    peers = common.usable_peers(args, rep, supported=("fla",),
                                why_not="jax-linear-attention has no block module")
    peer = {}
    if peers and seq_lens:
        cases = [dict(key=f"{n}-p{t}", block=n, T=t, dims=BLOCKS[n]) for n in names for t in seq_lens]
        rep.progress("running the torch peer in a subprocess ...")
        peer = common.run_peer("gdn_jax.bench.block:_torch_peer", cases, progress=rep.progress)
    if peers:
        rep.note("torch peer: prefill only (its decode step needs the peer's own cache object)")

    def timed(fn, *a, chain=None, per=1):
        with ctx():
            return common.time_jax(fn, *a, calls=calls, repeats=repeats, chain=chain) / per * 1e6

    for name in names:
        dims = SMOKE if args.smoke else BLOCKS[name]
        block = make_block(name, dims)
        graphdef, params = nnx.split(block)
        hk, hv, kd, vd = (dims[k] for k in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"))
        kind = "gdn" if name == "qwen3_next" else "kda"
        rng = np.random.default_rng(0)
        unroll = args.unroll

        block_steps = step_program(graphdef, "call T=1", unroll)
        serving_steps = step_program(graphdef, "serving decode", unroll)

        @jax.jit
        def projections(params, x, o):
            blk = nnx.merge(graphdef, params)
            return blk._raw_inputs(x, dtype), blk._project_out(o, dtype)

        @jax.jit
        def projection_steps(params, x):
            # Chained like the block's steps: each step's output projection (of the output
            # gate z, which has o's shape) is the next step's input, so no step can be skipped,
            # and z takes a vanishing term from every other input projection, so none is dropped.
            blk = nnx.merge(graphdef, params)
            for _ in range(unroll):
                mixed, a, b, z = blk._raw_inputs(x, dtype)
                keep = sum(jnp.mean(t, dtype=jnp.float32) for t in (mixed, a, b))
                x = blk._project_out(z + (1e-30 * keep).astype(dtype), dtype)
            return x

        @functools.partial(jax.jit, donate_argnums=5)
        def kernel_steps(q, k, v, g, beta, s):
            for _ in range(unroll):
                o, s = gdn_decode(q, k, v, g, beta, s, use_qk_l2norm=True, impl="pallas",
                                  interpret=interp)
            return o, s

        for b in batches:
            label = f"{name} decode B={b}"
            x = jnp.asarray(rng.standard_normal((b, 1, dims["hidden"]), dtype=np.float32), dtype)
            state = block.init_state(b)
            state = jax.tree.map(lambda a: jnp.asarray(0.1 * rng.standard_normal(a.shape, np.float32), a.dtype),
                                 state)
            with ctx():
                y_fused, _ = block(x, jax.tree.map(jnp.copy, state))
                y_ref, _ = block(x, jax.tree.map(jnp.copy, state), impl="reference")
                path = ("one launch" if block._one_launch(x, state.recurrent, state.conv, None,
                                                          "auto") is not None else "unfused chain")
            err = common.rel_err(y_fused, y_ref)
            us_block = timed(block_steps, params, x, jax.tree.map(jnp.copy, state),
                             chain=lambda out, a: (a[0], a[1], out[1]), per=unroll)
            us_serving = None
            if not args.smoke or b == batches[0]:     # the smoke run checks it once
                serving = block.init_serving_state(b)
                serving = dataclasses.replace(serving, delta=dataclasses.replace(
                    serving.delta, states=jnp.copy(state.recurrent)), conv=dataclasses.replace(
                    serving.conv, windows=jnp.copy(state.conv)))
                us_serving = timed(serving_steps, params, x, serving, jnp.arange(b, dtype=jnp.int32),
                                   chain=lambda out, a: (a[0], a[1], out[1], a[3]), per=unroll)
            t = common.np_inputs(b, b, 1, hk, hv, kd, vd, per_channel=kind == "kda")
            toks = [jnp.asarray(t[n][:, 0]).astype(dtype) for n in ("q", "k", "v")]
            toks += [jnp.asarray(t["g"][:, 0]), jnp.asarray(t["beta"][:, 0]), jnp.asarray(t["h0"])]
            us_kernel = timed(kernel_steps, *toks, chain=lambda out, a: tuple(a[:5]) + (out[1],),
                              per=unroll)
            us_proj = timed(projection_steps, params, x, chain=lambda out, a: (a[0], out),
                            per=unroll)
            us_fused = None
            if path == "one launch":
                with ctx():
                    call, rows, _ = block._one_launch(x, state.recurrent, state.conv, None, "auto")
                us_fused = timed(one_launch_steps(graphdef, call, unroll), params,
                                 jax.tree.map(jnp.copy, state), rows,
                                 chain=lambda out, a: (a[0], out, a[2]), per=unroll)
            nbytes = 2 * b * hv * kd * vd * 4
            rep.add(case=label, mode="decode", block=name, B=b, T=1, who=f"block __call__ T=1 ({path})",
                    us=us_block, GBps=nbytes / us_block / 1e3, chained=True,
                    rel_err_vs_unfused=err, x_kernel=us_block / us_kernel,
                    x_parts=us_block / ((us_fused or us_kernel) + us_proj), path=path)
            if us_serving is not None:
                rep.add(case=label, mode="decode", block=name, B=b, T=1,
                        who="block serving decode (pool, slots; nothing pending)", us=us_serving,
                        GBps=nbytes / us_serving / 1e3, chained=True,
                        x_kernel=us_serving / us_kernel, x_call=us_serving / us_block)
            rep.add(case=label, mode="decode", block=name, B=b, T=1, who="recurrence kernel alone",
                    us=us_kernel, GBps=nbytes / us_kernel / 1e3, chained=True)
            if us_fused is not None:
                rep.add(case=label, mode="decode", block=name, B=b, T=1,
                        who="one-launch kernel alone", us=us_fused,
                        GBps=nbytes / us_fused / 1e3, chained=True, x_kernel=us_fused / us_kernel)
            rep.add(case=label, mode="decode", block=name, B=b, T=1, who="projections alone",
                    us=us_proj, chained=True)
            fused_note = "" if us_fused is None else f", one-launch kernel {us_fused:.1f} us"
            rep.progress(f"{label}: block {us_block:.1f} us = {us_block / us_kernel:.2f}x the "
                         f"kernel alone ({us_kernel:.1f} us){fused_note}, projections "
                         f"{us_proj:.1f} us; output vs unfused chain {err:.1e}")

        for T in seq_lens:
            label = f"{name} prefill B=1 T={T}"
            x = jnp.asarray(rng.standard_normal((1, T, dims["hidden"]), dtype=np.float32), dtype)
            block_call = jax.jit(lambda params, x: nnx.merge(graphdef, params)(x))
            t = common.np_inputs(T, 1, T, hk, hv, kd, vd, per_channel=kind == "kda", state=False)
            seq = [jnp.asarray(t[n]).astype(dtype) for n in ("q", "k", "v")]
            seq += [jnp.asarray(t["g"]), jnp.asarray(t["beta"])]
            op = gdn_jax.gated_delta_rule if kind == "gdn" else gdn_jax.kda
            kernel = jax.jit(functools.partial(op, output_final_state=True, use_qk_l2norm=True,
                                               impl="pallas", interpret=interp))
            try:
                us_block = timed(block_call, params, x)
                us_kernel = timed(kernel, *seq)
                us_proj = timed(projections, params, x, jnp.zeros((1, T, hv, vd), dtype))
            except Exception as e:  # noqa: BLE001 - one line, the other cases still run
                rep.note(f"{label} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            flops = common.chunk_flops(1, T, hv, kd, vd)
            rep.add(case=label, mode="prefill", block=name, B=1, T=T, who="block __call__",
                    us=us_block, TFLOPs=flops / us_block / 1e6, chained=False,
                    kernel_share=us_kernel / us_block, x_parts=us_block / (us_kernel + us_proj))
            rep.add(case=label, mode="prefill", block=name, B=1, T=T, who="prefill kernel alone",
                    us=us_kernel, TFLOPs=flops / us_kernel / 1e6, chained=False)
            rep.add(case=label, mode="prefill", block=name, B=1, T=T, who="projections alone",
                    us=us_proj, chained=False)
            rep.progress(f"{label}: block {us_block:.0f} us, kernel {us_kernel:.0f} us "
                         f"({100 * us_kernel / us_block:.0f}%), projections {us_proj:.0f} us")
            r = peer.get(f"{name}-p{T}")
            if r is not None:
                rep.add(case=label, mode="prefill", block=name, B=1, T=T,
                        who=r.get("who", "torch peer"), us=r.get("us"), error=r.get("error"),
                        chained=False)

    lines = [f"{rep.meta['device']}, {rep.meta['date']}, jax {rep.meta['jax']}; {args.dtype} "
             f"weights and activations, fp32 state. Decode: {args.unroll} chained block steps per "
             f"jitted call (state donated), bytes = state read + written; prefill: one call per "
             f"jitted program, B = 1. 'x kernel' = block / recurrence kernel alone; 'x parts' = "
             f"block / (the kernel it runs alone + projections alone), the kernel being the "
             f"one-launch kernel where the block runs it; 'kernel share' = prefill kernel / block."
             + (" SMOKE RUN: times mean nothing." if args.smoke else ""), "",
             "| case | who | us | GB/s | x kernel | x parts | kernel share | vs unfused |",
             "|---|---|---|---|---|---|---|---|"]
    fmt = lambda x, f: "-" if x is None else format(x, f)
    for r in rep.rows:
        err = r.get("rel_err_vs_unfused")
        lines.append(f"| {r['case']} | {r['who']}{' (' + r['error'][:60] + ')' if r.get('error') else ''} | "
                     f"{fmt(r.get('us'), '.1f')} | {fmt(r.get('GBps'), '.0f')} | "
                     f"{fmt(r.get('x_kernel'), '.2f')} | {fmt(r.get('x_parts'), '.2f')} | "
                     f"{fmt(r.get('kernel_share'), '.0%')} | "
                     f"{'-' if err is None else common.peer_verdict(err)} |")

    def plot(path):
        series: dict[str, list] = {}
        for r in rep.rows:
            if r["mode"] == "decode" and r.get("us"):
                series.setdefault(f"{r['block']}: {r['who']}", []).append((r["B"], r["us"]))
        common.line_plot(path, series, xlabel="batch size B", ylabel="us per decode step",
                         title=f"block decode ({rep.meta['device']})")

    return rep.finish("Blocks end to end", "\n".join(lines), plot)


# --------------------------------------------------------------------------- heads over a mesh

MESH_OPS = ("serving decode", "call T=1", "prefill")


def one_launch_steps(graphdef, call, unroll: int):
    """`unroll` chained one-launch decode kernels on fixed projection rows (mixed, a, b, z), the
    block state (recurrent, conv) donated: the block's decode step without its projections."""
    import jax
    from flax import nnx

    from gdn_jax import conv_decode, dispatch

    def steps(params, state, rows):
        blk = nnx.merge(graphdef, params)
        p = blk._core_params()
        weight, bias = blk._conv_params()
        rec, conv = state.recurrent, state.conv
        for _ in range(unroll):
            _, rec, conv = conv_decode.conv_decode_run(
                call, "pallas", *rows, rec, conv, None, weight, bias, p["A_log"], p["dt_bias"],
                p["norm_weight"], interpret=dispatch.interpret_enabled())
        return dataclasses.replace(state, recurrent=rec, conv=conv)
    return jax.jit(steps, donate_argnums=1)


def step_program(graphdef, op: str, unroll: int):
    """The jitted program one timed call of `op` (one of MESH_OPS) runs, with or without a mesh:
    `unroll` chained steps for the decode forms, the state donated. Each step's output is the
    next step's input, as from one layer to the next: with the same input every step, XLA
    would compute the input projections once and drop all but the last output projection."""
    import jax
    from flax import nnx

    if op == "serving decode":
        def steps(params, x, serving, slots):
            blk = nnx.merge(graphdef, params)
            for _ in range(unroll):
                x, serving = blk.decode(x, serving, slots)
            return x, serving
        return jax.jit(steps, donate_argnums=2)
    if op == "call T=1":
        def steps(params, x, state):
            blk = nnx.merge(graphdef, params)
            for _ in range(unroll):
                x, state = blk(x, state)
            return x, state
        return jax.jit(steps, donate_argnums=2)
    return jax.jit(lambda params, x: nnx.merge(graphdef, params)(x))


def mesh_case(block, op: str, size: int, *, unroll: int, seed: int = 1):
    """(program, args, chain) for one timed case of `op` on `block` (B = size rows for the
    decode forms, T = size tokens for prefill): every argument already lives where the program
    wants it (replicated on the block's mesh, or on the default device), so a call moves no
    input between devices."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

    graphdef, params = nnx.split(block)
    hidden = block.config.hidden_size
    where = (NamedSharding(block.mesh, PartitionSpec()) if block.mesh is not None
             else SingleDeviceSharding(jax.devices()[0]))
    place = lambda a: jax.device_put(a, where)
    rows, tokens = (size, 1) if op != "prefill" else (1, size)
    x = place(jax.random.normal(jax.random.PRNGKey(seed), (rows, tokens, hidden), block.dtype))
    program = step_program(graphdef, op, unroll)
    # On one device the fresh state is committed too: a step's output state is, and a state
    # that changes from uncommitted to committed between the first and second call compiles
    # the program twice.
    fresh = (lambda s: s) if block.mesh is not None else place
    if op == "serving decode":
        return (program, (params, x, fresh(block.init_serving_state(size)),
                          place(jnp.arange(size, dtype=jnp.int32))),
                lambda out, a: (a[0], a[1], out[1], a[3]))
    if op == "call T=1":
        return (program, (params, x, fresh(block.init_state(size))),
                lambda out, a: (a[0], a[1], out[1]))
    return program, (params, x), None


def mesh_main(args) -> int:
    """`bench block --mesh N`: each block on one device against its heads over N devices."""
    import jax
    from jax.sharding import Mesh

    n = args.mesh
    if len(jax.devices()) < n:
        print(f"gdn-jax bench block: --mesh {n} needs {n} devices, this machine has "
              f"{len(jax.devices())}")
        return 2
    rep = common.Report("block", args)
    names = [b.strip() for b in args.blocks.split(",") if b.strip()]
    bad = [b for b in names if b not in BLOCKS]
    if bad:
        raise SystemExit(f"--blocks: unknown {bad}; choose from {sorted(BLOCKS)}")
    if common.peer_list(args):
        rep.note("peers not timed with --mesh")
    batches, seq_lens = args.batches, ([] if args.no_prefill else args.seq_lens)
    calls, repeats, unroll = (10, args.repeats, args.unroll)
    if args.smoke:   # one size of each, one step per call: each case compiles twice, interpreted
        batches, seq_lens = [SMOKE_B[-1]], ([] if args.no_prefill else [SMOKE_T])
        calls, repeats, unroll = 1, 1, 1
    mesh = Mesh(np.array(jax.devices()[:n]), ("tp",))
    rep.meta.update(mesh=n, dtype=args.dtype, unroll=unroll)
    interp = common.kernel_context()

    lines = [f"| block | op | size | 1 device us | {n} devices us | 1 device tok/s | "
             f"{n} devices tok/s | ratio | {n} vs 1 device |", "|---|---|---|---|---|---|---|---|---|"]
    with interp:
        for name in names:
            dims = SMOKE_MESH if args.smoke else BLOCKS[name]
            one, split = make_block(name, dims), make_block(name, dims, mesh=mesh)
            cases = [(op, b) for op in MESH_OPS[:2] for b in batches]
            cases += [("prefill", t) for t in seq_lens]
            for op, size in cases:
                what = f"{'B' if op != 'prefill' else 'T'}={size}"
                rep.progress(f"{name} {op} {what} ...")
                per = unroll if op != "prefill" else 1
                timings, outputs = [], []
                for block in (one, split):
                    program, a, chain = mesh_case(block, op, size, unroll=unroll)
                    # An input moved per call (x on one device while the block wants it
                    # replicated) would be timed as the mesh's cost: the guard makes it an error.
                    with jax.transfer_guard("disallow"):
                        out = program(*a)
                    outputs.append(np.asarray(jax.device_get(out[0][:, -64:]), np.float32))
                    a = a if chain is None else chain(out, a)
                    with jax.transfer_guard("disallow"):
                        sec = common.time_jax(program, *a, calls=calls if per > 1 else
                                              max(1, calls // 5), repeats=repeats, chain=chain)
                    timings.append(sec / per)
                err = common.rel_err(outputs[1], outputs[0])
                row = rep.add(block=name, op=op, size=size, devices=n, us_1=timings[0] * 1e6,
                              us_n=timings[1] * 1e6, tokens_per_s_1=size / timings[0],
                              tokens_per_s_n=size / timings[1], ratio=timings[0] / timings[1],
                              rel_err_vs_1=err)
                lines.append(f"| {name} | {op} | {what} | {row['us_1']:.1f} | {row['us_n']:.1f} | "
                             f"{row['tokens_per_s_1']:,.0f} | {row['tokens_per_s_n']:,.0f} | "
                             f"{row['ratio']:.2f}x | {common.peer_verdict(err)} |")
                rep.progress(f"{name} {op} {what}: {row['us_1']:.1f} us on 1 device, "
                             f"{row['us_n']:.1f} us on {n}: {row['ratio']:.2f}x")
    md = "\n".join(lines) + (
        f"\n\n{rep.meta['device']} x{n}, {rep.meta['date']}, jax {rep.meta['jax']}; {args.dtype} "
        f"weights and activations, fp32 state. Decode forms: {unroll} chained steps per jitted call "
        "(state donated), us per step; prefill: one call per jitted program, B = 1. Inputs placed "
        "on the devices before timing, no transfer per call (checked)."
        + (" SMOKE RUN: times mean nothing." if args.smoke else ""))
    return rep.finish(f"Heads split over {n} devices (bench block --mesh {n})", md)


if __name__ == "__main__":
    raise SystemExit(main())
