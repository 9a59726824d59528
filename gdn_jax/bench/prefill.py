"""`gdn-jax bench prefill`: GDN prefill (`gated_delta_rule`) against flash-linear-attention and
jax-linear-attention, as time and as a share of the tensor-core roofline.

Cases (HK = 16, HV = 32, K = V = 128, bf16 q/k/v, fp32 g/beta, q/k L2-normed in the call, no
initial state): B=1 T=8192; B=8 T=4096; B=1 T=32768 (--batches and --seq-lens pair up when they
have the same length, else every combination); plus a packed batch of 16 random lengths summing
to 32768 (cu_seqlens) against a dense batch of the same total length (B=16, T=2048).

Ours: `gdn_jax.gated_delta_rule(..., impl=...)` for each impl in --impls that can take the call
(an impl that cannot is reported in one line), jitted, timed as --calls (default 20)
back-to-back calls and one block_until_ready, median of --repeats. Peers: FLA
`chunk_gated_delta_rule(q, k, v, g=g, beta=beta, output_final_state=True,
use_qk_l2norm_in_kernel=True, cu_seqlens=...)` with triton.testing.do_bench in a subprocess;
jla `linear_attention("gated_deltanet", q, k, v, g=g, beta=beta, impl="mosaic_gpu",
output_final_state=True)` on L2-normed q/k, timed like ours. Every peer's outputs (first and
last 256 tokens, final states) are checked against ours in the run.

FLOPs: the chunk form's matmuls (gdn_jax.bench.common.chunk_flops, chunk 64); % roofline is
against a dense bf16 peak of 790 TFLOP/s (H200).

--short: short prompts, the token-serial kernel against the chunked kernel (no peers). For B in
{1, 8, 32, 128} and T in {2, 4, 8, 16, 32, 64, 128} (--batches / --seq-lens replace either grid
when given), both run `gdn_prefill_pool(..., kernel=...)` from an fp32 pool of B slots (the
serving prefill): SHORT_STEPS prefills chained in one jitted program (each lands in the pool the
next one reads; the pool donated and chained from call to call), so that the time is the
device's, not a jitted call's host dispatch; their outputs and pools from one shared start are
checked against each other. Printed: the table of times and, per
B, the crossover (the longest T up to which the token-serial kernel is faster) next to today's
`gdn_jax.prefill.SERIAL_PREFILL_TABLE` limit.
"""

from __future__ import annotations

import argparse
import functools
from typing import Sequence

import numpy as np

from gdn_jax.bench import common

HK, HV, K, V = 16, 32, 128, 128
VARLEN_PIECES, VARLEN_TOTAL = 16, 32768
SAMPLE = 256          # tokens at each end of o that a peer returns for the check
SMOKE = dict(hk=2, hv=4, k=32, v=32, cases=((1, 64), (2, 40)), pieces=4, total=96)
SHORT_BATCHES = (1, 8, 32, 128)
SHORT_SEQ_LENS = (2, 4, 8, 16, 32, 64, 128)
SHORT_SMOKE = dict(batches=(1, 2), seq_lens=(3,))
SHORT_STEPS = 10      # prefills chained in one jitted program for --short


def _cases(args, pieces: int, total: int, seed: int = 0):
    """[(label, B, T, cu_seqlens or None)]."""
    bs, ts = args.batches, args.seq_lens
    pairs = list(zip(bs, ts)) if len(bs) == len(ts) else [(b, t) for b in bs for t in ts]
    out = [(f"B={b} T={t}", b, t, None) for b, t in pairs]
    if not args.no_varlen:
        rng = np.random.default_rng(seed)
        cuts = np.sort(rng.choice(np.arange(1, total), pieces - 1, replace=False))
        cu = np.concatenate([[0], cuts, [total]]).astype(np.int32)
        out.append((f"varlen N={pieces} total={total}", 1, total, cu))
        out.append((f"dense B={pieces} T={total // pieces}", pieces, total // pieces, None))
    return out


# --------------------------------------------------------------------------- peers

def _jla_call(q, k, v, g, beta):
    """jax-linear-attention's Mosaic GPU Gated DeltaNet (it has no in-kernel q/k norm: the
    caller passes normalised q and k)."""
    from jla.ops import linear_attention
    return linear_attention("gated_deltanet", q, k, v, g=g, beta=beta, impl="mosaic_gpu",
                            output_final_state=True)


def _fla_peer(cases: list[dict], out_dir: str) -> None:
    """Runs in a subprocess: FLA's chunked GDN on the same inputs; times and output samples."""
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    def run_case(c):
        x = common.np_inputs(c["seed"], c["B"], c["T"], c["hk"], c["hv"], c["k"], c["v"], state=False)
        dt = getattr(torch, c["dtype"])
        t = {n: torch.from_numpy(a).cuda() for n, a in x.items()}
        q, k, v = (t[n].to(dt) for n in ("q", "k", "v"))
        g, beta = t["g"], t["beta"].to(dt)
        cu = None if c["cu"] is None else torch.tensor(c["cu"], dtype=torch.long, device="cuda")
        fn = lambda: chunk_gated_delta_rule(q, k, v, g=g, beta=beta, output_final_state=True,
                                            use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
        o, ht = fn()
        torch.cuda.synchronize()
        us = common.torch_do_bench_us(fn)
        return {"us": us}, dict(head=o[:, :SAMPLE].float().cpu().numpy(),
                                tail=o[:, -SAMPLE:].float().cpu().numpy(),
                                state=ht.float().cpu().numpy())

    common.peer_cases(cases, out_dir, run_case, tag="fla")


def _accuracy(args) -> int:
    """--accuracy: ours, FLA and jla against the float64 oracle (common.run_accuracy)."""
    import jax
    import gdn_jax

    rep = common.Report("prefill", args)
    hk, hv, kd = (SMOKE["hk"], SMOKE["hv"], SMOKE["k"]) if args.smoke else (HK, HV, K)
    cases = common.accuracy_cases(args, dict(hk=hk, hv=hv, k=kd), per_channel=False)
    rep.meta.update(heads=dict(HK=hk, HV=hv, K=kd, V=kd), T=cases[0]["T"], mode="accuracy")
    peers = common.usable_peers(args, rep)
    fla = {}
    if "fla" in peers:
        rep.progress("running FLA in a subprocess ...")
        fla = common.run_peer("gdn_jax.bench.common:fla_accuracy_peer", cases,
                              progress=rep.progress)
    interpret = jax.default_backend() != "gpu"

    def ours(impl, q, k, v, g, beta):
        with gdn_jax.interpret(interpret):
            return gdn_jax.gated_delta_rule(q, k, v, g, beta, output_final_state=True, impl=impl)

    md = common.run_accuracy(rep, cases, ours=ours, impls=common.impl_list(args), fla=fla,
                             fla_name="chunk_gated_delta_rule",
                             jla=jax.jit(_jla_call) if "jla" in peers else None)
    return rep.finish("GDN prefill accuracy against float64: ours, FLA and jla", md)


def build_parser() -> argparse.ArgumentParser:
    p = common.make_parser("prefill", __doc__ + "\n" + common.ACCURACY_DESCRIPTION,
                           batches="1,8,1", seq_lens="8192,4096,32768",
                           dtype="bfloat16", peers="fla,jla")
    p.add_argument("--impls", default="chunked,pallas",
                   help="our impls to time, comma-separated from reference, chunked, pallas, auto "
                        "(default %(default)s)")
    p.add_argument("--no-varlen", action="store_true", help="skip the packed vs dense pair")
    p.add_argument("--accuracy", action="store_true",
                   help="no timing: ours and the peers against a float64 token loop on a random "
                        "and an ill-conditioned case (see the description)")
    p.add_argument("--short", action="store_true",
                   help="short prompts: the token-serial vs the chunked kernel and their "
                        "crossover per batch (see the description)")
    p.add_argument("--kernels", action="store_true",
                   help="also print each of our calls' device time per kernel (JAX profiler)")
    common.add_calls_flag(p)
    return p


def _short(args, argv, *, per_channel: bool = False, heads=(HK, HV, K, V), name="prefill") -> int:
    """--short: the token-serial and the chunked prefill kernels side by side on short prompts
    (GDN; KDA's per-channel gate with `per_channel`, for `bench kda --short`)."""
    import jax
    import jax.numpy as jnp
    from gdn_jax import prefill as pf

    given = lambda flag: any(a == flag or a.startswith(flag + "=") for a in argv or [])
    batches = (args.batches if given("--batches") else
               SHORT_SMOKE["batches"] if args.smoke else SHORT_BATCHES)
    seq_lens = (args.seq_lens if given("--seq-lens") else
                SHORT_SMOKE["seq_lens"] if args.smoke else SHORT_SEQ_LENS)
    hk, hv, kd, vd = (SMOKE["hk"], SMOKE["hv"], SMOKE["k"], SMOKE["v"]) if args.smoke else heads
    rep = common.Report(name, args)
    family = "KDA" if per_channel else "GDN"
    limit = functools.partial(pf.serial_prefill_limit, per_channel_gate=per_channel)
    calls, steps, repeats = (1, 2, 1) if args.smoke else (10, SHORT_STEPS, args.repeats)
    rep.meta.update(heads=dict(HK=hk, HV=hv, K=kd, V=vd), dtype=args.dtype, mode="short",
                    timing=f"{steps} chained prefills per jitted call (pool donated), {calls} "
                           f"calls, one sync, median of {repeats}, per prefill")
    interpret = jax.default_backend() != "gpu"

    def runner(kernel, steps):
        # `steps` prefills chained in one jitted program (each lands in the pool the next reads):
        # short prompts take microseconds, less than a jitted call's host dispatch, so calls
        # timed one per jit would measure the host.
        def call(q, k, v, g, beta, pool, slots):
            def step(_, carry):
                return pf.gdn_prefill_pool(q, k, v, g, beta, carry[1], slots, use_qk_l2norm=True,
                                           kernel=kernel, impl="pallas", interpret=interpret)
            first = step(0, (None, pool))
            return jax.lax.fori_loop(1, steps, step, first) if steps > 1 else first
        return jax.jit(call, donate_argnums=(5,))

    fns = {kern: runner(kern, 1) for kern in ("serial", "chunked")}
    timed = {kern: runner(kern, steps) for kern in ("serial", "chunked")}
    chain = lambda out, a: tuple(a[:5]) + (out[1],) + tuple(a[6:])
    times: dict[tuple[int, int], dict[str, float]] = {}
    for b in batches:
        key = jax.random.PRNGKey(b)
        pool0 = 0.1 * jax.random.normal(key, (b, hv, kd, vd), jnp.float32)
        slots = jnp.arange(b, dtype=jnp.int32)
        for t in seq_lens:
            x = common.np_inputs(b * 1000 + t, b, t, hk, hv, kd, vd, state=False,
                                 per_channel=per_channel)
            q, k, v = (jnp.asarray(x[n]).astype(args.dtype) for n in ("q", "k", "v"))
            g, beta = jnp.asarray(x["g"]), jnp.asarray(x["beta"])
            outs, row = {}, {}
            for kern, fn in fns.items():
                try:
                    o, pool = jax.block_until_ready(fn(q, k, v, g, beta, jnp.copy(pool0), slots))
                    outs[kern] = (np.asarray(o, np.float32), np.asarray(pool))
                    row[kern] = 1e6 * common.time_jax(timed[kern], q, k, v, g, beta,
                                                      jnp.copy(pool0), slots, calls=calls,
                                                      repeats=repeats, chain=chain) / steps
                except Exception as e:  # noqa: BLE001 - one line per failed kernel, keep going
                    rep.note(f"B={b} T={t} kernel={kern} failed: {type(e).__name__}: {str(e)[:200]}")
            err = (max(common.rel_err(outs["serial"][i], outs["chunked"][i]) for i in range(2))
                   if len(outs) == 2 else None)
            times[(b, t)] = row
            rep.add(case=f"B={b} T={t}", B=b, T=t, serial_us=row.get("serial"),
                    chunked_us=row.get("chunked"), rel_err_serial_vs_chunked=err, chained=True)
            rep.progress(f"B={b} T={t}: serial {row.get('serial', float('nan')):.1f} us, chunked "
                         f"{row.get('chunked', float('nan')):.1f} us, outputs and pools agree to "
                         f"{common.peer_verdict(err)}")
    fmt = lambda x: "-" if x is None else f"{x:.1f}"
    lines = [f"{rep.meta['device']}, {rep.meta['date']}, jax {rep.meta['jax']}; {family}, HK={hk}, HV={hv}, "
             f"K=V={kd}, {args.dtype} q/k/v, fp32 g/beta and pool, in-call q/k L2 norm; "
             f"gdn_prefill_pool into B slots, {rep.meta['timing']}."
             + (" SMOKE RUN (interpret mode / tiny shapes): times mean nothing." if args.smoke
                else ""), "",
             "| B | " + " | ".join(f"T={t} serial / chunked us" for t in seq_lens) + " |",
             "|---|" + "---|" * len(seq_lens)]
    for b in batches:
        cells = [f"{fmt(times[(b, t)].get('serial'))} / {fmt(times[(b, t)].get('chunked'))}"
                 for t in seq_lens]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    table = pf.serial_prefill_table(per_channel)[0]
    lines += ["", f"| B | token-serial faster up to T | {table} limit now |",
              "|---|---|---|"]
    for b in batches:
        faster = [t for t in seq_lens if times[(b, t)].get("serial") is not None
                  and times[(b, t)].get("chunked") is not None
                  and times[(b, t)]["serial"] < times[(b, t)]["chunked"]]
        # The crossover: the longest T of the unbroken run of wins from the shortest T.
        upto = 0
        for t in seq_lens:
            if t not in faster:
                break
            upto = t
        rep.meta.setdefault("crossover", {})[b] = upto
        lines.append(f"| {b} | {upto or 'never'} | {limit(b)} |")
        rep.progress(f"B={b}: token-serial faster up to T={upto or 'never'} "
                     f"(table limit now {limit(b)})")
    return rep.finish(f"{family} short-prompt prefill: token-serial vs chunked kernel",
                      "\n".join(lines))


def main(argv: Sequence[str] | None = None) -> int:
    args = common.parse_here("prefill", build_parser(), argv)
    if args is None:
        return 2
    if args.short:
        import sys
        return _short(args, sys.argv[1:] if argv is None else argv)
    if args.accuracy:
        return _accuracy(args)

    import jax
    import jax.numpy as jnp
    import gdn_jax

    rep = common.Report("prefill", args)
    hk, hv, kd, vd = HK, HV, K, V
    pieces, total = VARLEN_PIECES, VARLEN_TOTAL
    if args.smoke:
        hk, hv, kd, vd = SMOKE["hk"], SMOKE["hv"], SMOKE["k"], SMOKE["v"]
        pieces, total = SMOKE["pieces"], SMOKE["total"]
        args.batches, args.seq_lens = [b for b, _ in SMOKE["cases"]], [t for _, t in SMOKE["cases"]]
    impls = common.impl_list(args)
    cases = _cases(args, pieces, total)
    peers = common.usable_peers(args, rep)

    copy = common.measure_copy_gbps(1 << 22 if args.smoke else 1 << 30)
    rep.meta.update(copy_GBps=copy, heads=dict(HK=hk, HV=hv, K=kd, V=vd), dtype=args.dtype,
                    roofline_TFLOPs=common.H200_BF16_TFLOPS, timing="back-to-back calls, one sync")
    rep.progress(f"device copy bandwidth measured now: {copy:.0f} GB/s (read + write)")

    fla = {}
    if "fla" in peers:
        rep.progress("running FLA in a subprocess ...")
        fla = common.run_peer("gdn_jax.bench.prefill:_fla_peer", [
            dict(key=f"c{i}", seed=i, B=b, T=t, hk=hk, hv=hv, k=kd, v=vd, dtype=args.dtype,
                 cu=None if cu is None else cu.tolist()) for i, (_, b, t, cu) in enumerate(cases)],
            progress=rep.progress)

    unavailable: set[tuple[str, bool]] = set()
    calls = 1 if args.smoke else args.calls
    for i, (label, b, t, cu) in enumerate(cases):
        x = common.np_inputs(i, b, t, hk, hv, kd, vd, state=False)
        q, k, v = (jnp.asarray(x[n]).astype(args.dtype) for n in ("q", "k", "v"))
        g, beta = jnp.asarray(x["g"]), jnp.asarray(x["beta"])
        flops = common.chunk_flops(b, t, hv, kd, vd)
        ours = None
        for impl in impls:
            if (impl, cu is None) in unavailable:   # declined once: packed and dense apart
                continue
            fn = jax.jit(functools.partial(gdn_jax.gated_delta_rule, output_final_state=True,
                                           use_qk_l2norm=True, impl=impl,
                                           cu_seqlens=None if cu is None else jnp.asarray(cu)))
            timed = common.time_impl(rep, impl, label, fn, q, k, v, g, beta,
                                     calls=calls if impl != "reference" else 1,
                                     repeats=1 if args.smoke else args.repeats, first=ours,
                                     on_decline=lambda: unavailable.add((impl, cu is None)))
            if timed is None:
                continue
            out, sec, err = timed
            ours = ours or out
            row = rep.add(case=label, B=b, T=t, who=f"ours impl={impl}", us=sec * 1e6,
                          TFLOPs=flops / sec / 1e12, pct_roofline=100 * flops / sec / 1e12 / common.H200_BF16_TFLOPS,
                          rel_err_vs_first=err, chained=False)
            rep.progress(f"{label}: {row['who']} {row['us']:.0f} us, {row['TFLOPs']:.1f} TFLOP/s"
                         + ("" if err is None else f", vs first impl {err:.1e}"))
            if args.kernels:
                common.report_kernel_times(rep, f"{label} impl={impl}", fn, q, k, v, g, beta,
                                           wall_us=sec * 1e6)
        if ours is None:
            continue
        o, st = (np.asarray(a, np.float32) for a in ours)
        want = {"head": o[:, :SAMPLE], "tail": o[:, -SAMPLE:], "state": st}
        r = fla.get(f"c{i}")
        if r is not None:
            err = (max(common.rel_err(r["samples"][n], want[n]) for n in want)
                   if "samples" in r else None)
            rep.add(case=label, B=b, T=t, who="FLA chunk_gated_delta_rule", us=r.get("us"),
                    TFLOPs=flops / r["us"] / 1e6 if r.get("us") else None,
                    pct_roofline=100 * flops / r["us"] / 1e6 / common.H200_BF16_TFLOPS if r.get("us") else None,
                    rel_err_vs_ours=err, error=r.get("error"), chained=False)
            rep.progress(f"{label}: FLA {r.get('us', float('nan')):.0f} us, output vs ours "
                         f"{common.peer_verdict(err)}" + (f" ({r['error']})" if "error" in r else ""))
        if "jla" in peers and cu is None:
            nrm = lambda a: (a.astype(jnp.float32) * jax.lax.rsqrt(
                jnp.sum(jnp.square(a.astype(jnp.float32)), -1, keepdims=True) + 1e-6)).astype(a.dtype)
            qn, kn = nrm(q), nrm(k)
            fn = jax.jit(_jla_call)
            try:
                jo, js = jax.block_until_ready(fn(qn, kn, v, g, beta))
                sec = common.time_jax(fn, qn, kn, v, g, beta, calls=calls, repeats=args.repeats)
                err = max(common.rel_err(np.asarray(jo, np.float32), o),
                          common.rel_err(np.asarray(js, np.float32), st))
                rep.add(case=label, B=b, T=t, who="jla mosaic_gpu", us=sec * 1e6, TFLOPs=flops / sec / 1e12,
                        pct_roofline=100 * flops / sec / 1e12 / common.H200_BF16_TFLOPS,
                        rel_err_vs_ours=err, chained=False)
                rep.progress(f"{label}: jla {sec * 1e6:.0f} us, output vs ours {common.peer_verdict(err)}")
            except Exception as e:  # noqa: BLE001 - a peer's failure is one line, not a traceback
                rep.note(f"jla failed on {label}: {type(e).__name__}: {str(e)[:200]}")
        elif "jla" in peers:
            rep.progress(f"{label}: jla not run (this bench calls it without cu_seqlens)")

    lines = [f"{rep.meta['device']}, {rep.meta['date']}, jax {rep.meta['jax']}; HK={hk}, HV={hv}, "
             f"K=V={kd}, {args.dtype} q/k/v, fp32 g/beta, in-call q/k L2 norm, no initial state. "
             f"Times: {calls} back-to-back calls per sync (not chained), median of "
             f"{args.repeats}; FLA by triton do_bench. TFLOP/s from the chunk form's matmul "
             f"FLOPs; % of a {common.H200_BF16_TFLOPS:.0f} TFLOP/s bf16 roofline. Copy bandwidth "
             f"measured in this run: {copy:.0f} GB/s."
             + (" SMOKE RUN (interpret mode / tiny shapes): times mean nothing."
                if args.smoke else ""), "",
             "| case | who | us | TFLOP/s | % roofline | output vs ours |", "|---|---|---|---|---|---|"]
    for r in rep.rows:
        check = r.get("rel_err_vs_ours", r.get("rel_err_vs_first"))
        us = "-" if r.get("us") is None else f"{r['us']:.0f}"
        tf = "-" if r.get("TFLOPs") is None else f"{r['TFLOPs']:.1f}"
        pct = "-" if r.get("pct_roofline") is None else f"{r['pct_roofline']:.1f}"
        lines.append(f"| {r['case']} | {r['who']} | {us} | {tf} | {pct} | "
                     f"{'-' if check is None else common.peer_verdict(check)} |")

    def plot(path):
        series: dict[str, list] = {}
        for r in rep.rows:
            if r.get("us") and not r["case"].startswith(("varlen", "dense")):
                series.setdefault(r["who"], []).append((r["B"] * r["T"], r["us"] / 1e3))
        common.line_plot(path, series, xlabel="tokens per call (B x T)", ylabel="ms per call",
                         title=f"GDN prefill, HV={hv} K=V={kd}, {args.dtype} ({rep.meta['device']})")

    return rep.finish("GDN prefill (chunked) vs FLA and jla", "\n".join(lines), plot)


if __name__ == "__main__":
    raise SystemExit(main())
