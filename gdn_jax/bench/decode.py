"""`gdn-jax bench decode`: the Pallas GDN decode step against flash-linear-attention.

HV = 32, HK = 16, K = V = 128, bf16 q/k/v (unit-norm q, k), fp32 g/beta; each state dtype of
--state-dtypes (fp32, fp16) at each B of --batches (1, 32, 128, 256), plus the fused-norm and
pool (packed rows, slot table) variants at B = 128 and ceiling probes.

Timing. JAX: one jitted program runs `--unroll` decode steps back to back (state chained and
donated, so each step updates it in place), timed as many calls + one block_until_ready
(common.time_jax) and divided by the steps: device time without host dispatch between steps.
The single-call time through the Python entry point is reported too. The peer,
`fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta,
initial_state=h0, output_final_state=True)` (keywords: its positional order is q, k, v, g, gk,
gv, beta), runs in a subprocess (torch and JAX would fight over GPU memory) on the same inputs,
timed with triton.testing.do_bench (CUDA events, median) and do_bench_cudagraph, the faster of
the two; its output and final state are checked against ours in the run. Bytes = state read +
written; % copy is against the device copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Sequence

import numpy as np

from gdn_jax.bench import common

HV, HK, K, V = 32, 16, 128, 128
INTERPRET = False  # --smoke: tiny shapes in interpret mode, to check this script on a CPU
# The project's targets for one step (us, H200): ahead of flash-linear-attention's KDA decode
# at B = 128 (fp32 state), twice that at B = 256, and the 16-bit state near its halved bytes.
TARGETS_US = {("float32", 32): 40.0, ("float32", 128): 135.0, ("float32", 256): 270.0,
              ("float16", 128): 72.0}


# --------------------------------------------------------------------------- peer (subprocess)

def _np_case(seed, b, state_dtype):
    """The inputs of one case, from one seed (the peer regenerates the same)."""
    x = common.np_inputs(seed, b, 1, HK, HV, K, V)
    for n in ("q", "k"):
        x[n] = x[n] / np.linalg.norm(x[n], axis=-1, keepdims=True)
    return x


def _peer_main(cases: list[dict], out_dir: str) -> None:
    """Runs in a subprocess: FLA's fused recurrent GDN step on each case's inputs."""
    import torch
    import triton.testing as tt
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    dev = "cuda"
    x = torch.empty(1024**3 // 4, device=dev)
    y = torch.empty_like(x)
    ms = tt.do_bench(lambda: y.copy_(x), warmup=20, rep=200, return_mode="median")
    copy = {"GBps": 2 * x.numel() * 4 / (ms * 1e-3) / 1e9}
    del x, y

    def run_case(c):
        a = {n: torch.from_numpy(v).to(dev) for n, v in _np_case(c["seed"], c["B"], c["state"]).items()}
        q, k, v = (a[n].to(torch.bfloat16) for n in ("q", "k", "v"))
        g, beta = a["g"], a["beta"]
        h0 = a["h0"].to(getattr(torch, c["state"]))
        # by keyword: the positional order is (q, k, v, g, gk, gv, beta, ...)
        step = lambda h: fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h,
                                                          output_final_state=True)
        o, hf = step(h0.clone())     # the checked call on its own copy of the state
        torch.cuda.synchronize()
        samples = dict(o=o[:, 0].float().cpu().numpy(), state=hf.float().cpu().numpy())
        h_run = h0.clone()
        fn = lambda: step(h_run)
        t_ev = tt.do_bench(fn, warmup=50, rep=300, return_mode="median") * 1e3
        try:
            t_graph = tt.do_bench_cudagraph(fn, rep=300, return_mode="median") * 1e3
        except Exception:  # noqa: BLE001 - the graph timing is a bonus
            t_graph = float("inf")
        return ({"us": min(t_ev, t_graph), "us_events": t_ev, "us_graph": t_graph,
                 "final_state_dtype": str(hf.dtype)}, samples)

    common.peer_cases(cases, out_dir, run_case, tag="fla", res={"torch_copy": copy})


# --------------------------------------------------------------------------- ours

def _inputs(b, state_dtype, seed=0):
    import jax
    import jax.numpy as jnp
    x = _np_case(seed, b, state_dtype)
    q, k, v = (jnp.asarray(x[n][:, 0]).astype(jnp.bfloat16) for n in ("q", "k", "v"))
    g, beta = jnp.asarray(x["g"][:, 0]), jnp.asarray(x["beta"][:, 0])   # [B, HV]: one token
    s = jnp.asarray(x["h0"]).astype(state_dtype)
    # committed to the device, as a step's outputs are: chaining them then hits the same executable
    return tuple(jax.device_put(a, jax.devices()[0]) for a in (q, k, v, g, beta, s))


def _time_steps(step, args, unroll, calls=None, repeats=None):
    """Seconds per decode step: `unroll` chained steps in one jitted program."""
    import jax
    from gdn_jax.bench.common import time_jax

    @functools.partial(jax.jit, donate_argnums=(len(args) - 1,))
    def run(*a):
        *rest, s = a
        for _ in range(unroll):
            o, s = step(*rest, s)
        return o, s

    chain = lambda out, a: tuple(a[:-1]) + (out[1],)
    for _ in range(2):  # the first call can change the tracing context (one retrace): warm both
        args = chain(jax.block_until_ready(run(*args)), args)
    calls = calls or (2 if INTERPRET else 10)
    repeats = repeats or (1 if INTERPRET else 5)
    return time_jax(run, *args, calls=calls, repeats=repeats, chain=chain) / unroll


def _check(b, state_dtype, block):
    """Max relative L2 error of o and state vs the reference on this config (one call)."""
    import jax.numpy as jnp
    from gdn_jax import decode as dec, reference as ref
    q, k, v, g, beta, s = _inputs(b, state_dtype, seed=1)
    ro, rs = ref.decode_step(q.astype(jnp.float32), k, v, g, beta, s)
    o, s2 = dec.gdn_decode(q, k, v, g, beta, s.copy(), impl="pallas", block_sizes=block,
                           interpret=INTERPRET)
    err = common.rel_err
    return max(err(o.astype(jnp.float32), ro), err(s2.astype(jnp.float32), rs.astype(jnp.float32)))


def _sweep_blocks(sdt, b, best_so_far=()):
    """Block shapes to time besides the tuning-table entry: single programs of 32, 64 and 128
    value columns, and 128 columns walked in two tiles of 64 (the table holds the winners of the
    sweeps recorded in BENCHMARKS.md; this list re-times the runners-up). With few programs a
    step is latency-bound, so small batches also try fewer warps per program (fewer reductions
    over K cross warps): one-warp programs of 16 and 32 columns up to B = 16 (at B >= 32, where
    the step streams the state, one warp lost), two-warp programs of 32 and 64 up to B = 32."""
    from pallas_kernels.gdn_decode import DecodeBlockSizes as D
    few = [D(16, num_warps=1), D(32, num_warps=1)] if b <= 16 else []
    two = [D(32, num_warps=2), D(64, num_warps=2)] if b <= 32 else []
    return [D(32), D(64), D(128, 64), D(128)] + few + two


def _probes(args):
    """What bounds the step: the same tiles with no math (Pallas), XLA's in-place scale, and
    the per-step time against the number of steps per jitted call (a per-call cost would show)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
    from gdn_jax import decode as dec

    b, bv, tile = (2, V, V // 2) if INTERPRET else (128, 128, 64)
    s = _inputs(b, jnp.float32)[5]
    nbytes = 2 * s.size * 4

    def rmw_kernel(s_ref, o_ref):
        i, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        for t in range(bv // tile):
            cols = pl.ds(j * bv + t * tile, tile)
            o_ref[i, h, :, cols] = s_ref[i, h, :, cols] * jnp.float32(0.999)

    rmw = pl.pallas_call(rmw_kernel, grid=(b, HV, V // bv), out_shape=jax.ShapeDtypeStruct(s.shape, s.dtype),
                         input_output_aliases={0: 0},
                         compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
                         interpret=INTERPRET)
    t_pallas = _time_steps(lambda s: (s, rmw(s)), (s.copy(),), args.unroll)
    # The barrier keeps XLA from fusing the unrolled scales into one pass (it did: 11.7 us/step).
    t_xla = _time_steps(lambda s: (s, jax.lax.optimization_barrier(s * jnp.float32(0.999))),
                        (s.copy(),), args.unroll)
    q, k, v, g, beta, s = _inputs(b, jnp.float32)
    step = functools.partial(dec.gdn_decode, impl="pallas", interpret=INTERPRET)
    unrolls = (1, 2) if INTERPRET else (1, 5, 20, 60)
    unroll_us = [(u, _time_steps(step, (q, k, v, g, beta, s.copy()), u) * 1e6) for u in unrolls]
    return {"pallas_rmw_us": t_pallas * 1e6, "pallas_rmw_GBps": nbytes / t_pallas / 1e9,
            "xla_rmw_us": t_xla * 1e6, "xla_rmw_GBps": nbytes / t_xla / 1e9, "unroll_us": unroll_us}


def _blk_str(bk: dict) -> str:
    """block_v/tile_v/num_warps, with "sN" when num_stages is not 1."""
    s = f"{bk['block_v']}/{bk['tile_v'] or bk['block_v']}/{bk['num_warps']}"
    return s + (f"s{bk['num_stages']}" if bk.get("num_stages", 1) != 1 else "")


def build_parser() -> argparse.ArgumentParser:
    p = common.make_parser("decode", __doc__, batches="1,32,128,256", seq_lens="1",
                           dtype="bfloat16", peers="fla")
    p.add_argument("--state-dtypes", default="float32,float16",
                   help="recurrent state dtypes, comma-separated (default %(default)s)")
    p.add_argument("--sweep", action="store_true", help="also time other block shapes, keep the best")
    p.add_argument("--unroll", type=int, default=20, help="decode steps chained per jitted call")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = common.parse_here("decode", build_parser(), argv)
    if args is None:
        return 2
    global HV, HK, K, V, INTERPRET
    state_dtypes = [x.strip() for x in args.state_dtypes.split(",") if x.strip()]
    batches = args.batches
    if args.smoke:  # check the script itself on a CPU: tiny heads, interpret mode, no peer
        HV, HK, K, V, INTERPRET = 4, 2, 32, 32, True
        args.unroll, batches = 2, [1, 3]
    cases = [(sdt, b) for sdt in state_dtypes for b in batches]

    import jax
    import jax.numpy as jnp
    from gdn_jax import decode as dec
    from pallas_kernels import gdn_decode as kern

    rep = common.Report("decode", args)
    peers = common.usable_peers(args, rep, supported=("fla",),
                                why_not="this bench times FLA's decode only")
    peer = {}
    if peers:
        rep.progress("running FLA in a subprocess ...")
        peer = common.run_peer("gdn_jax.bench.decode:_peer_main", [
            dict(key=f"{sdt}_B{b}", seed=i, B=b, state=sdt) for i, (sdt, b) in enumerate(cases)],
            progress=rep.progress)
    copy_gbps = common.measure_copy_gbps(1 << 22 if args.smoke else 1 << 30)
    rep.progress(f"device copy bandwidth measured now: {copy_gbps:.0f} GB/s (read + write)")
    rep.meta.update(copy_GBps=copy_gbps, torch_copy_GBps=peer.get("torch_copy", {}).get("GBps"),
                    heads=dict(HK=HK, HV=HV, K=K, V=V), unroll=args.unroll,
                    timing=f"{args.unroll} chained steps per jitted call, state donated")
    rows = []
    for i, (sdt, b) in enumerate(cases):
        state_dtype = jnp.dtype(sdt)
        table = kern.default_block_sizes(b, V, state_dtype, False)
        cands = [table] + ([c for c in _sweep_blocks(sdt, b)
                            if c != table and c.block_v <= V]
                           if args.sweep else [])
        args_b = _inputs(b, state_dtype, seed=i)
        timings = []
        for blk in cands:
            step = functools.partial(dec.gdn_decode, impl="pallas", block_sizes=blk,
                                     interpret=INTERPRET)
            try:
                a = tuple(args_b[:5]) + (args_b[5].copy(),)
                t = _time_steps(step, a, args.unroll, repeats=1 if args.smoke else args.repeats)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
                rep.progress(f"{sdt} B={b} {blk}: failed {type(e).__name__}: {str(e)[:200]}")
                continue
            timings.append((t, blk))
            rep.progress(f"{sdt} B={b} {_blk_str(dataclasses.asdict(blk))}: {t * 1e6:.1f} us (chained)")
        if not timings:
            rep.note(f"{sdt} B={b}: no block shape ran")
            continue
        timings.sort(key=lambda x: x[0])
        t_best, best = timings[0]
        t_table = next((t for t, blk in timings if blk == table), float("nan"))
        err = _check(b, state_dtype, best)
        # the checked output of the same inputs the peer got: one step from the case's state
        o_ours, s_ours = dec.gdn_decode(*args_b[:5], args_b[5].copy(), impl="pallas",
                                        block_sizes=best, interpret=INTERPRET)
        one = functools.partial(dec.gdn_decode, impl="pallas", block_sizes=best, interpret=INTERPRET)
        a = tuple(args_b[:5]) + (args_b[5].copy(),)
        t_call = common.time_jax(one, *a, calls=2 if args.smoke else 20, repeats=1 if args.smoke else 3,
                                 chain=lambda out, a: tuple(a[:-1]) + (out[1],))
        nbytes = 2 * b * HV * K * V * state_dtype.itemsize
        pk = peer.get(f"{sdt}_B{b}", {})
        t_peer = pk.get("us")
        peer_err = None
        if "samples" in pk:
            peer_err = max(common.rel_err(pk["samples"]["o"], np.asarray(o_ours, np.float32)),
                           common.rel_err(pk["samples"]["state"], np.asarray(s_ours, np.float32)))
        if pk:
            rep.progress(f"{sdt} B={b}: FLA {t_peer if t_peer else float('nan'):.1f} us, output vs ours "
                         f"{common.peer_verdict(peer_err)}" + (f" ({pk['error']})" if "error" in pk else ""))
        case = rep.add(state=sdt, B=b, us=t_best * 1e6, us_table=t_table * 1e6,
                       us_python_call=t_call * 1e6, block=dataclasses.asdict(best),
                       GBps=nbytes / t_best / 1e9, pct_copy=100 * nbytes / t_best / 1e9 / copy_gbps,
                       rel_err=err, peer_us=t_peer, peer_GBps=nbytes / t_peer / 1e3 if t_peer else None,
                       peer_rel_err=peer_err, peer_error=pk.get("error"),
                       target_us=None if args.smoke else TARGETS_US.get((sdt, b)), chained=True,
                       sweep=[(t * 1e6, dataclasses.asdict(blk)) for t, blk in timings])
        rows.append(case)

    # Variants at B = 128 (only when 128 is among --batches), fp32 state, tuning-table block
    # sizes: fused norm, pool + packed rows; then the ceiling probes.
    run_variants = args.smoke or 128 in batches
    probes, norm_sweep = {}, []
    if not run_variants:
        rep.note("variants (fused norm, pool) and ceiling probes run at B = 128: not in --batches")
    if run_variants:
        b = 128 if not args.smoke else 4
        q, k, v, g, beta, s = _inputs(b, jnp.float32)
        z = jnp.ones((b, HV, V), jnp.bfloat16) * 0.5
        w = jnp.ones((V,), jnp.float32)
        norm_step = lambda q, k, v, g, beta, s: dec.gdn_decode(q, k, v, g, beta, s, z=z, norm_weight=w,
                                                               impl="pallas", interpret=INTERPRET)
        t_norm = _time_steps(norm_step, (q, k, v, g, beta, s.copy()), args.unroll)
        norm_sweep = []
        if args.sweep:
            D = kern.DecodeBlockSizes
            for blk in (D(V, None, 4), D(V, None, 8), D(V, V // 2, 4), D(V, V // 4, 4),
                        D(V, V // 2, 8)):
                st = lambda q, k, v, g, beta, s, blk=blk: dec.gdn_decode(
                    q, k, v, g, beta, s, z=z, norm_weight=w, impl="pallas", interpret=INTERPRET,
                    block_sizes=blk)
                try:
                    norm_sweep.append((_time_steps(st, (q, k, v, g, beta, s.copy()), args.unroll) * 1e6,
                                       dataclasses.asdict(blk)))
                except Exception as e:  # noqa: BLE001
                    rep.progress(f"norm {blk}: failed {type(e).__name__}: {str(e)[:200]}")
            norm_sweep.sort(key=lambda x: x[0])
        qkv = jnp.concatenate([q.reshape(b, -1), k.reshape(b, -1), v.reshape(b, -1)], axis=1)
        pool = jnp.concatenate([s, s[: b // 2]], axis=0)  # 1.5 x B slots, every other one used
        slots = jnp.arange(b, dtype=jnp.int32) * 3 // 2
        ab = jnp.concatenate([g, beta], axis=1)  # stand-in raw projection row: a | b
        A_log, dt_bias = jnp.zeros((HV,)), jnp.zeros((HV,))
        pool_step = lambda qkv, ab, pool: dec.gdn_decode_pool(
            qkv, ab, ab, pool, slots, num_k_heads=HK, num_v_heads=HV, head_k_dim=K, head_v_dim=V,
            beta_col=HV, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm=True, z=z.reshape(b, -1),
            norm_weight=w, impl="pallas", interpret=INTERPRET)
        t_pool = _time_steps(pool_step, (qkv, ab, pool), args.unroll)
        nb = 2 * b * HV * K * V * 4
        # 16-bit state, round to nearest even vs stochastic rounding (a fresh key per step).
        rounding = {}
        for sdt in ("bfloat16", "float16"):
            s16 = s.astype(sdt)
            key = jax.random.key(0)
            rne_step = functools.partial(dec.gdn_decode, impl="pallas", interpret=INTERPRET)
            steps = iter(range(1 << 30))
            sr_step = lambda q, k, v, g, beta, s: dec.gdn_decode(
                q, k, v, g, beta, s, rounding_key=jax.random.fold_in(key, next(steps)),
                impl="pallas", interpret=INTERPRET)
            rounding[sdt] = tuple(_time_steps(f, (q, k, v, g, beta, s16.copy()), args.unroll) * 1e6
                                  for f in (rne_step, sr_step))
            rep.progress(f"{sdt} state B={b}: RNE {rounding[sdt][0]:.1f} us, stochastic rounding "
                         f"{rounding[sdt][1]:.1f} us (chained)")
        rep.progress("ceiling probes ...")
        probes = _probes(args)
        rep.meta["probes"] = probes
        rep.meta["variants"] = {"rounding_B128_us": rounding, "fused_norm_B128_us": t_norm * 1e6,
                                "pool_packed_raw_l2_norm_B128_us": t_pool * 1e6,
                                "fused_norm_sweep": norm_sweep}

    # ---------------------------------------------------------------- the section
    torch_copy = rep.meta["torch_copy_GBps"]
    lines = [
        f"Device: {rep.meta['device']}; date {rep.meta['date']}; jax {jax.__version__}; "
        f"copy bandwidth measured in this run {copy_gbps:.0f} GB/s (XLA elementwise, read + write)"
        + (f", torch copy_ {torch_copy:.0f} GB/s" if torch_copy else "") + "."
        + (" SMOKE RUN (interpret mode, tiny heads): times mean nothing." if args.smoke else ""),
        f"HV={HV}, HK={HK}, K=V={V}, bf16 q/k/v, fp32 g/beta; bytes = state read + written. Ours: "
        f"{args.unroll} chained, donated steps per jitted call, many calls + one block_until_ready. "
        "FLA `fused_recurrent_gated_delta_rule` in the same run on the same inputs: faster of "
        "do_bench (events) and do_bench_cudagraph, median; its output and final state checked "
        "against ours.",
        "",
        "| state | B | ours (us) | block (block_v/tile/warps) | tuning-table block (us) | FLA (us) | FLA / ours | FLA output vs ours | GB/s | % copy BW | target | rel err vs ref | one Python call (us) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows.sort(key=lambda c: (c["state"] != "float32", c["B"]))
    for c in rows:
        ratio = f"{c['peer_us'] / c['us']:.2f}" if c["peer_us"] else "-"
        peer_s = f"{c['peer_us']:.1f}" if c["peer_us"] else (c["peer_error"] or "-")[:40]
        tgt = c["target_us"]
        if tgt:
            tgt_s = f"<= {tgt:.0f}: " + ("met" if c["us"] <= tgt else
                                          "MISSED by %.0f%%" % (100 * (c["us"] / tgt - 1)))
        elif c["B"] == 1 and c["peer_us"] and not args.smoke:
            tgt_s = "<= FLA: " + ("met" if c["us"] <= c["peer_us"] else "MISSED")
        else:
            tgt_s = "-"
        check = "-" if c["peer_rel_err"] is None else common.peer_verdict(c["peer_rel_err"])
        lines.append(f"| {c['state']} | {c['B']} | {c['us']:.1f} | {_blk_str(c['block'])} | {c['us_table']:.1f} | {peer_s} | {ratio} | {check} | {c['GBps']:.0f} | "
                     f"{c['pct_copy']:.0f} | {tgt_s} | {c['rel_err']:.1e} | {c['us_python_call']:.1f} |")
    if run_variants:
        lines += [
            "",
            f"Variants, B={b}, fp32 state, tuning-table blocks: decode + fused gated RMSNorm (bf16 "
            f"out) {t_norm * 1e6:.1f} us ({nb / t_norm / 1e9:.0f} GB/s); pool with slot table + packed "
            f"qkv row + raw gates + in-kernel L2 norm + fused norm {t_pool * 1e6:.1f} us "
            f"({nb / t_pool / 1e9:.0f} GB/s).",
            "16-bit state, round-to-nearest-even vs stochastic-rounding stores (a fresh key per "
            "step, `rounding_key=fold_in(key, step)`): " + "; ".join(
                f"{sdt} {r:.1f} vs {sr:.1f} us ({100 * (sr / r - 1):+.1f}%)"
                for sdt, (r, sr) in rounding.items()) + ".",
        ]
    if probes:
        lines.append("")
        lines.append(
            "Ceiling probes, fp32 state read + written in place: "
            f"Pallas load/scale/store of the same [K, 64] tiles {probes['pallas_rmw_us']:.1f} us "
            f"({probes['pallas_rmw_GBps']:.0f} GB/s); XLA `s * 0.999` donated "
            f"{probes['xla_rmw_us']:.1f} us ({probes['xla_rmw_GBps']:.0f} GB/s). Decode steps per "
            "jitted call vs us per step: " + ", ".join(f"{u}: {t:.1f}" for u, t in probes["unroll_us"]) + ".")
    if norm_sweep:
        lines.append("Fused-norm block sweep, B=128 fp32 (us): " + ", ".join(
            f"{_blk_str(bk)} {t:.1f}" for t, bk in norm_sweep))
    if args.sweep:
        lines.append("")
        lines.append("Block-shape sweep (us; block_v/tile/warps, sN = N pipeline stages):")
        for c in rows:
            lines.append(f"- {c['state']} B={c['B']}: " + ", ".join(
                f"{_blk_str(bk)} {t:.1f}" for t, bk in c["sweep"]))

    def plot(path):
        series: dict[str, list] = {}
        for c in rows:
            series.setdefault(f"ours, {c['state']} state", []).append((c["B"], c["GBps"]))
            if c["peer_GBps"]:
                series.setdefault(f"FLA, {c['state']} state", []).append((c["B"], c["peer_GBps"]))
        common.line_plot(path, series, xlabel="batch size B", ylabel="GB/s (state read + written)",
                         title=f"GDN decode, HV={HV} K=V={V} ({rep.meta['device']})",
                         hline=(copy_gbps, "copy bandwidth (measured)"))

    return rep.finish("GDN decode (Pallas, single token)", "\n".join(lines), plot)


if __name__ == "__main__":
    raise SystemExit(main())
