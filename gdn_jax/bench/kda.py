"""`gdn-jax bench kda`: Kimi Delta Attention prefill and decode against flash-linear-attention
and jax-linear-attention.

Prefill: B=1, T=8192 (--seq-lens), H = HK = HV = 32, K = V = 128, bf16 q/k/v, fp32 per-channel
gate g [B, T, HV, K] and beta, q/k L2-normed in the call, no initial state:
`gdn_jax.kda(..., impl=...)` for each impl in --impls that can take the call, timed as --calls
(default 20) back-to-back calls and one block_until_ready, against FLA `chunk_kda(q, k, v, g=g,
beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)` and jla's Mosaic GPU KDA
(`jla.ops.mosaic_gpu.kda.kda(q, k, v, g, beta, output_final_state=True, use_qk_l2norm=True)`, in
this process, timed as ours); TFLOP/s from the chunk form's FLOPs against a 790 TFLOP/s bf16
roofline.

Decode: B=128 (--batches), one token, fp32 state [B, HV, K, V]: `gdn_jax.decode.gdn_decode` with
the per-channel gate (the Pallas decode kernel), `--unroll` chained steps per jitted call (state
donated), against FLA `fused_recurrent_kda(q, k, v, g=g, beta=beta, initial_state=h0,
output_final_state=True, use_qk_l2norm_in_kernel=True)` with do_bench; GB/s of state read +
written against the device copy bandwidth measured in the same run.

--short: KDA's token-serial kernel against its chunked kernels on short prompts, as
`bench prefill --short` does for GDN (no peers), beside KDA_SERIAL_PREFILL_TABLE's limits.

Every peer's outputs are checked against ours in the run (relative L2 error; MISMATCH above
2e-2). FLA runs in a subprocess (torch and JAX would compete for GPU memory); jla, a JAX
library, in this one. jla has no KDA decode: the decode rows compare FLA only.
"""

from __future__ import annotations

import argparse
import functools
from typing import Sequence

import numpy as np

from gdn_jax.bench import common

H, K, V = 32, 128, 128
SAMPLE = 256
SMOKE = dict(h=2, k=32, v=32, T=40, B=3)


def _fla_peer(cases: list[dict], out_dir: str) -> None:
    """Runs in a subprocess: FLA's chunk_kda (prefill) / fused_recurrent_kda (decode)."""
    import torch
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    def run_case(c):
        x = common.np_inputs(c["seed"], c["B"], c["T"], c["h"], c["h"], c["k"], c["v"],
                             per_channel=True, state=c["mode"] == "decode")
        dt = getattr(torch, c["dtype"])
        t = {n: torch.from_numpy(a).cuda() for n, a in x.items()}
        q, k, v = (t[n].to(dt) for n in ("q", "k", "v"))
        g, beta = t["g"], t["beta"].to(dt)
        if c["mode"] == "prefill":
            fn = lambda: chunk_kda(q, k, v, g=g, beta=beta, output_final_state=True,
                                   use_qk_l2norm_in_kernel=True)
            o, ht = fn()
            samples = dict(head=o[:, :SAMPLE], tail=o[:, -SAMPLE:], state=ht)
        else:
            # The kernel may update initial_state in place: the checked call gets its own copy.
            o, ht = fused_recurrent_kda(q, k, v, g=g, beta=beta, initial_state=t["h0"].clone(),
                                        output_final_state=True, use_qk_l2norm_in_kernel=True)
            samples = dict(o=o, state=ht)
            h_run = t["h0"].clone()
            fn = lambda: fused_recurrent_kda(q, k, v, g=g, beta=beta, initial_state=h_run,
                                             output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.cuda.synchronize()
        samples = {n: a.float().cpu().numpy() for n, a in samples.items()}
        return {"us": common.torch_do_bench_us(fn)}, samples

    common.peer_cases(cases, out_dir, run_case, tag="fla")


def _jla_call(q, k, v, g, beta, *, use_qk_l2norm: bool):
    """jax-linear-attention's Mosaic GPU KDA (its q/k L2 norm is in its kernels, like ours)."""
    from jla.ops.mosaic_gpu.kda import kda as jla_kda
    return jla_kda(q, k, v, g, beta, output_final_state=True, use_qk_l2norm=use_qk_l2norm)


def _accuracy(args) -> int:
    """--accuracy: ours, FLA's chunk_kda and jla's KDA against the float64 oracle
    (common.run_accuracy)."""
    import jax
    import gdn_jax

    rep = common.Report("kda", args)
    h, kd = (SMOKE["h"], SMOKE["k"]) if args.smoke else (H, K)
    cases = common.accuracy_cases(args, dict(hk=h, hv=h, k=kd), per_channel=True)
    rep.meta.update(heads=dict(H=h, K=kd, V=kd), T=cases[0]["T"], mode="accuracy")
    peers = common.usable_peers(args, rep)
    fla = {}
    if "fla" in peers:
        rep.progress("running FLA in a subprocess ...")
        fla = common.run_peer("gdn_jax.bench.common:fla_accuracy_peer", cases, progress=rep.progress)
    interpret = jax.default_backend() != "gpu"

    def ours(impl, q, k, v, g, beta):
        with gdn_jax.interpret(interpret):
            return gdn_jax.kda(q, k, v, g, beta, output_final_state=True, impl=impl)

    jla = (jax.jit(functools.partial(_jla_call, use_qk_l2norm=False)) if "jla" in peers
           else None)
    md = common.run_accuracy(rep, cases, ours=ours, impls=common.impl_list(args), fla=fla,
                             fla_name="chunk_kda", jla=jla)
    return rep.finish("KDA prefill accuracy against float64: ours, FLA and jla", md)


def build_parser() -> argparse.ArgumentParser:
    p = common.make_parser("kda", __doc__ + "\n" + common.ACCURACY_DESCRIPTION, batches="128",
                           seq_lens="8192", dtype="bfloat16", peers="fla,jla")
    p.add_argument("--impls", default="chunked,pallas",
                   help="our prefill impls, comma-separated (default %(default)s)")
    p.add_argument("--unroll", type=int, default=20, help="decode steps chained per jitted call")
    p.add_argument("--accuracy", action="store_true",
                   help="no timing: ours and the peers against a float64 token loop on a random and an "
                        "ill-conditioned case (see the description)")
    p.add_argument("--short", action="store_true",
                   help="short prompts: KDA's token-serial vs chunked kernel and their crossover "
                        "per batch (as `bench prefill --short`)")
    p.add_argument("--kernels", action="store_true",
                   help="also print each of our prefill calls' device time per kernel (JAX "
                        "profiler)")
    common.add_calls_flag(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = common.parse_here("kda", build_parser(), argv)
    if args is None:
        return 2
    if args.accuracy:
        return _accuracy(args)
    if args.short:
        import sys
        from gdn_jax.bench import prefill as bench_prefill
        return bench_prefill._short(args, sys.argv[1:] if argv is None else argv, per_channel=True,
                                    heads=(H, H, K, V), name="kda")
    prefill_calls = 1 if args.smoke else args.calls

    import jax
    import jax.numpy as jnp
    import gdn_jax
    from gdn_jax.decode import gdn_decode

    rep = common.Report("kda", args)
    h, kd, vd = H, K, V
    seq_lens, batches = args.seq_lens, args.batches
    if args.smoke:
        h, kd, vd = SMOKE["h"], SMOKE["k"], SMOKE["v"]
        seq_lens, batches, args.unroll = [SMOKE["T"]], [SMOKE["B"]], 2
    interp = jax.default_backend() != "gpu"
    peers = common.usable_peers(args, rep)
    copy = common.measure_copy_gbps(1 << 22 if args.smoke else 1 << 30)
    rep.meta.update(copy_GBps=copy, heads=dict(H=h, K=kd, V=vd), dtype=args.dtype)
    rep.progress(f"device copy bandwidth measured now: {copy:.0f} GB/s (read + write)")

    cases = [dict(key=f"p{i}", mode="prefill", seed=i, B=1, T=t) for i, t in enumerate(seq_lens)]
    cases += [dict(key=f"d{i}", mode="decode", seed=100 + i, B=b, T=1) for i, b in enumerate(batches)]
    for c in cases:
        c.update(h=h, k=kd, v=vd, dtype=args.dtype)
    fla = {}
    if "fla" in peers:
        rep.progress("running FLA in a subprocess ...")
        fla = common.run_peer("gdn_jax.bench.kda:_fla_peer", cases, progress=rep.progress)

    def peer_row(c, label, want, flops=None, nbytes=None):
        r = fla.get(c["key"])
        if r is None:
            return
        err = (max(common.rel_err(r["samples"][n], want[n]) for n in want) if "samples" in r else None)
        us = r.get("us")
        rep.add(case=label, mode=c["mode"], B=c["B"], T=c["T"], who=f"FLA {'chunk_kda' if flops else 'fused_recurrent_kda'}",
                us=us, TFLOPs=flops / us / 1e6 if (flops and us) else None,
                GBps=nbytes / us / 1e3 if (nbytes and us) else None, rel_err_vs_ours=err,
                error=r.get("error"), chained=False)
        rep.progress(f"{label}: FLA {us if us is not None else float('nan'):.1f} us, output vs ours "
                     f"{common.peer_verdict(err)}" + (f" ({r['error']})" if "error" in r else ""))

    def jla_row(c, label, q, k, v, g, beta, want, flops):
        fn = jax.jit(functools.partial(_jla_call, use_qk_l2norm=True))
        try:
            jo, js = jax.block_until_ready(fn(q, k, v, g, beta))
            sec = common.time_jax(fn, q, k, v, g, beta, calls=prefill_calls,
                                  repeats=1 if args.smoke else args.repeats)
        except Exception as e:  # noqa: BLE001 - a peer's failure is one line, not a traceback
            rep.note(f"jla failed on {label}: {type(e).__name__}: {str(e)[:200]}")
            return
        err = max(common.rel_err(np.asarray(jo, np.float32), want[0]),
                  common.rel_err(np.asarray(js, np.float32), want[1]))
        rep.add(case=label, mode="prefill", B=1, T=c["T"], who="jla mosaic_gpu kda",
                us=sec * 1e6, TFLOPs=flops / sec / 1e12, rel_err_vs_ours=err, chained=False)
        rep.progress(f"{label}: jla {sec * 1e6:.0f} us, output vs ours {common.peer_verdict(err)}")

    impls = common.impl_list(args)
    for c in cases:
        x = common.np_inputs(c["seed"], c["B"], c["T"], h, h, kd, vd, per_channel=True,
                             state=c["mode"] == "decode")
        q, k, v = (jnp.asarray(x[n]).astype(args.dtype) for n in ("q", "k", "v"))
        g, beta = jnp.asarray(x["g"]), jnp.asarray(x["beta"])
        if c["mode"] == "prefill":
            label = f"prefill B=1 T={c['T']}"
            flops = common.chunk_flops(1, c["T"], h, kd, vd)
            ours = None
            for impl in impls:
                fn = jax.jit(functools.partial(gdn_jax.kda, output_final_state=True,
                                               use_qk_l2norm=True, impl=impl))
                timed = common.time_impl(rep, impl, label, fn, q, k, v, g, beta,
                                         calls=prefill_calls,
                                         repeats=1 if args.smoke else args.repeats, first=ours)
                if timed is None:
                    continue
                out, sec, err = timed
                ours = ours or out
                rep.add(case=label, mode="prefill", B=1, T=c["T"], who=f"ours impl={impl}",
                        us=sec * 1e6, TFLOPs=flops / sec / 1e12, rel_err_vs_first=err, chained=False)
                rep.progress(f"{label}: ours impl={impl} {sec * 1e6:.0f} us")
                if args.kernels:
                    common.report_kernel_times(rep, f"{label} impl={impl}", fn, q, k, v, g, beta,
                                               wall_us=sec * 1e6)
            if ours is not None:
                o, st = (np.asarray(a, np.float32) for a in ours)
                peer_row(c, label, {"head": o[:, :SAMPLE], "tail": o[:, -SAMPLE:], "state": st}, flops=flops)
                if "jla" in peers:
                    jla_row(c, label, q, k, v, g, beta, (o, st), flops)
            continue
        # decode: one token, chained steps in one jitted program, state donated
        b = c["B"]
        label = f"decode B={b}"
        h0 = jnp.asarray(x["h0"])
        o_ref, s_ref = gdn_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], jnp.copy(h0),
                                  use_qk_l2norm=True, impl="pallas", interpret=interp)
        unroll = args.unroll

        @functools.partial(jax.jit, donate_argnums=(5,))
        def run(q, k, v, g, beta, s):
            for _ in range(unroll):
                o, s = gdn_decode(q, k, v, g, beta, s, use_qk_l2norm=True, impl="pallas",
                                  interpret=interp)
            return o, s

        args_d = (q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], jnp.copy(h0))
        sec = common.time_jax(run, *args_d, calls=1 if args.smoke else 10,
                              repeats=1 if args.smoke else args.repeats,
                              chain=lambda out, a: tuple(a[:5]) + (out[1],)) / unroll
        nbytes = 2 * b * h * kd * vd * 4
        rep.add(case=label, mode="decode", B=b, T=1, who="ours gdn_decode (per-channel gate)",
                us=sec * 1e6, GBps=nbytes / sec / 1e9, pct_copy=100 * nbytes / sec / 1e9 / copy,
                chained=True)
        rep.progress(f"{label}: ours {sec * 1e6:.1f} us ({nbytes / sec / 1e9:.0f} GB/s, chained)")
        peer_row(c, label, {"o": np.asarray(o_ref, np.float32)[:, None],
                            "state": np.asarray(s_ref, np.float32)}, nbytes=nbytes)

    lines = [f"{rep.meta['device']}, {rep.meta['date']}, jax {rep.meta['jax']}; H={h}, K=V={kd}, "
             f"{args.dtype} q/k/v, fp32 per-channel gate and beta, in-call q/k L2 norm. Prefill: "
             f"{prefill_calls} back-to-back calls per sync; decode: {args.unroll} chained "
             f"steps per jitted call (state donated), fp32 state, bytes = state read + written. "
             f"FLA by triton do_bench; jla as ours, back-to-back calls. "
             f"Copy bandwidth measured in this run: {copy:.0f} GB/s."
             + (" SMOKE RUN: times mean nothing." if args.smoke else ""), "",
             "| case | who | us | TFLOP/s | GB/s | chained | output vs ours |",
             "|---|---|---|---|---|---|---|"]
    fmt = lambda x, f: "-" if x is None else format(x, f)
    for r in rep.rows:
        check = r.get("rel_err_vs_ours", r.get("rel_err_vs_first"))
        lines.append(f"| {r['case']} | {r['who']} | {fmt(r.get('us'), '.1f')} | "
                     f"{fmt(r.get('TFLOPs'), '.1f')} | {fmt(r.get('GBps'), '.0f')} | "
                     f"{'yes' if r.get('chained') else 'no'} | "
                     f"{'-' if check is None else common.peer_verdict(check)} |")

    def plot(path):
        series: dict[str, list] = {}
        for r in rep.rows:
            if r["mode"] == "decode" and r.get("GBps"):
                series.setdefault(r["who"], []).append((r["B"], r["GBps"]))
        common.line_plot(path, series, xlabel="batch size B", ylabel="GB/s (state read + written)",
                         title=f"KDA decode, H={h} K=V={kd} ({rep.meta['device']})",
                         hline=(copy, "copy bandwidth (measured)"))

    return rep.finish("KDA prefill and decode vs FLA and jla", "\n".join(lines), plot)


if __name__ == "__main__":
    raise SystemExit(main())
