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
prepared q, k, v, g, beta, state donated) and the projections alone (input and output
projections of the block, nothing else). The block's output is checked against the unfused
chain (impl="reference") in the run.

Prefill (--seq-lens, default 4096, 32768; B = 1): the block's `__call__` from a fresh state, one
call per jitted program, against the sequence kernel alone (`gated_delta_rule` / `kda` with
impl="pallas": the chunked prefill kernel) and the projections alone; the table gives the
kernel's share of the block time.

Peers (`--peers fla`): HF's torch module (transformers' Qwen3-Next layer) where transformers is
importable, else FLA's own layer modules (`fla.layers.GatedDeltaNet` / `KimiDeltaAttention`),
in a subprocess, same dims, bf16, random weights (times only: different weights, no output
check). What is missing is printed as one line.

`make_block(..., mesh=None)` is the hook point for tensor parallelism: a bench that shards the
blocks over devices (gdn_jax/bench/tp.py) passes its mesh there; this bench runs on one device.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Sequence

import numpy as np

from gdn_jax.bench import common

BLOCKS = {
    "qwen3_next": dict(hidden=2048, num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128),
    "kimi": dict(hidden=2304, num_k_heads=32, num_v_heads=32, head_k_dim=128, head_v_dim=128),
}
SMOKE = dict(hidden=32, num_k_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16)
SMOKE_T, SMOKE_B = 40, (1, 3)


def make_block(name: str, dims: dict, *, mesh=None):
    """A block with random weights at these dims, bf16 parameters and compute. `mesh`: the hook
    where a tensor-parallel bench places the block on its devices (None here: one device)."""
    import jax.numpy as jnp
    from flax import nnx
    from gdn_jax.layers import GDNConfig, KDAConfig, KimiDeltaAttention, Qwen3NextGatedDeltaNet
    if mesh is not None:
        raise ValueError("bench block runs on one device; tensor parallelism is bench tp's")
    bf16 = jnp.bfloat16
    if name == "qwen3_next":
        cfg = GDNConfig(hidden_size=dims["hidden"], num_k_heads=dims["num_k_heads"],
                        num_v_heads=dims["num_v_heads"], head_k_dim=dims["head_k_dim"],
                        head_v_dim=dims["head_v_dim"])
        return Qwen3NextGatedDeltaNet(cfg, rngs=nnx.Rngs(0), dtype=bf16, param_dtype=bf16)
    cfg = KDAConfig(hidden_size=dims["hidden"], num_heads=dims["num_k_heads"],
                    head_dim=dims["head_k_dim"], num_v_heads=dims["num_v_heads"],
                    head_v_dim=dims["head_v_dim"])
    return KimiDeltaAttention(cfg, rngs=nnx.Rngs(0), dtype=bf16, param_dtype=bf16)


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
    import json
    import os

    import torch

    res = {}
    modules = {}
    for c in cases:
        key = c["key"]
        try:
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
            res[key] = {"us": us, "who": who}
        except Exception as e:  # noqa: BLE001 - one line per failed case, keep going
            res[key] = {"error": f"{type(e).__name__}: {e}"[:300]}
        print(f"peer {key}: {res[key]}", flush=True)
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(res, f)


# --------------------------------------------------------------------------- ours

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gdn-jax bench block", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_shared_flags(p, batches="1,32,128,256", seq_lens="4096,32768", dtype="bfloat16",
                            peers="fla")
    p.add_argument("--blocks", default="qwen3_next,kimi",
                   help=f"which blocks, comma-separated from {sorted(BLOCKS)} (default %(default)s)")
    p.add_argument("--unroll", type=int, default=20, help="decode steps chained per jitted call")
    p.add_argument("--no-prefill", action="store_true", help="time decode only")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    why = common.missing_gpu(args.smoke)
    if why:
        print(f"gdn-jax bench block: {why}")
        return 2
    import contextlib

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
    ctx = lambda: gdn_jax.interpret() if interp else contextlib.nullcontext()
    dtype = jnp.dtype(args.dtype)

    peers = [p for p in common.peer_list(args) if p == "fla"]
    if "jla" in common.peer_list(args):
        rep.note("peer jla skipped: jax-linear-attention has no block module")
    for name in list(peers):
        reason = common.peer_available(name)
        if reason:
            rep.note(reason)
            peers.remove(name)
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

        @functools.partial(jax.jit, donate_argnums=2)
        def block_steps(params, x, state):
            blk = nnx.merge(graphdef, params)
            for _ in range(unroll):
                y, state = blk(x, state)
            return y, state

        @functools.partial(jax.jit, donate_argnums=2)
        def serving_steps(params, x, serving, slots):
            blk = nnx.merge(graphdef, params)
            for _ in range(unroll):
                y, serving = blk.decode(x, serving, slots)
            return y, serving

        @jax.jit
        def projections(params, x, o):
            blk = nnx.merge(graphdef, params)
            return blk._raw_inputs(x, dtype), blk._project_out(o, dtype)

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
            o = jnp.zeros((b, 1, hv, vd), dtype)
            us_proj = timed(projections, params, x, o)
            nbytes = 2 * b * hv * kd * vd * 4
            rep.add(case=label, mode="decode", block=name, B=b, T=1, who=f"block __call__ T=1 ({path})",
                    us=us_block, GBps=nbytes / us_block / 1e3, chained=True,
                    rel_err_vs_unfused=err, x_kernel=us_block / us_kernel,
                    x_parts=us_block / (us_kernel + us_proj), path=path)
            if us_serving is not None:
                rep.add(case=label, mode="decode", block=name, B=b, T=1,
                        who="block serving decode (pool, slots; nothing pending)", us=us_serving,
                        GBps=nbytes / us_serving / 1e3, chained=True,
                        x_kernel=us_serving / us_kernel, x_call=us_serving / us_block)
            rep.add(case=label, mode="decode", block=name, B=b, T=1, who="recurrence kernel alone",
                    us=us_kernel, GBps=nbytes / us_kernel / 1e3, chained=True)
            rep.add(case=label, mode="decode", block=name, B=b, T=1, who="projections alone",
                    us=us_proj, chained=False)
            rep.progress(f"{label}: block {us_block:.1f} us = {us_block / us_kernel:.2f}x the "
                         f"kernel alone ({us_kernel:.1f} us), projections {us_proj:.1f} us; output "
                         f"vs unfused chain {err:.1e}")

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
             f"block / (kernel alone + projections alone); 'kernel share' = prefill kernel / block."
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


if __name__ == "__main__":
    raise SystemExit(main())
