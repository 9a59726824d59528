"""What every benchmark shares: flags, timing, the copy-bandwidth measurement, peers, output.

Flags (`add_shared_flags`): --batches, --seq-lens, --dtype, --peers, --repeats, --smoke, --json,
--plot, --write-md. Results go to the terminal (progress lines and a markdown table), to
`--json PATH` and a PNG at `--plot PATH` (matplotlib, the `bench` extra); a markdown section is
written into a file only with `--write-md PATH` (never into the source tree otherwise).

Timing. JAX: many calls back to back and one `block_until_ready` at the end (a per-call sync
adds ~100 us of host round trip and hides the kernel); "chained" means each call's output state
is the next call's input (donated, updated in place). The median over `repeats` such batches.
Peers (torch): `triton.testing.do_bench` (CUDA events, median), in a subprocess so that torch and
JAX do not compete for GPU memory; the peer reads the same inputs (generated from one NumPy seed
on both sides) and returns a sample of its outputs, which is checked against ours in the run.

This module imports JAX only inside functions: the peer subprocess imports it without JAX.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

import numpy as np

from gdn_jax.check import TOLERANCE, rel_err  # noqa: F401  (the benches' peer checks use the same measure)

# Relative L2 error above which a peer's output is marked as a mismatch: the outputs are bf16
# and the two implementations accumulate in different orders, so a few 1e-3 are expected.
PEER_TOL = 2e-2
# Prefill benches: calls back to back per sync (`--calls`). Each sync costs a fixed fill, the
# first call's dispatch and the final wait, that its calls share: 20 keep it to a few percent of
# a long prefill's time, more bring a call's time closer to its device time (BENCHMARKS.md, KDA
# prefill: where the wall time above the kernels goes).
PREFILL_CALLS = 20
# Dense bf16 tensor-core peak of an H200 (SXM), TFLOP/s: the roofline of the prefill tables.
H200_BF16_TFLOPS = 790.0

PEERS = {
    "fla": ("torch", "triton", "fla"),   # flash-linear-attention
    "jla": ("jla",),                     # jax-linear-attention (runs in this process)
}


# --------------------------------------------------------------------------- --accuracy
# `bench prefill --accuracy` and `bench kda --accuracy`: no timing; ours and the peers against
# the float64 token loop (`gdn_jax.check.oracle_delta_rule`) on the same bf16 values.
ACCURACY_T, ACCURACY_SMOKE_T = 512, 70
ACCURACY_CASES = ("random", "repeated keys")
BF16_BOUND = TOLERANCE["bfloat16"]   # what `gdn-jax check` holds bf16 inputs to against float64
ACCURACY_DESCRIPTION = """\
--accuracy: no timing; ours (each impl of --impls that can take the call) and the peers against
a float64 token loop (`gdn_jax.check.oracle_delta_rule`) on two B=1, T=512 cases at the bench's
head sizes: random inputs, and an ill-conditioned one (three distinct keys, q = k, beta 0.999,
gates -1e-3: a state overwritten again and again and read back on the keys just written). q and k
are L2-normalised and, like v and beta, rounded to bf16 beforehand, so that every implementation
and the oracle take the same values; printed: the output's and the final state's relative L2
error, against the library's bound for bf16 inputs (5e-3)."""


def accuracy_inputs(case: str, t: int, hk: int, hv: int, kd: int, *, per_channel: bool = False):
    """One --accuracy case, B=1, as float64 arrays of values every implementation takes exactly:
    q, k L2-normalised, then q, k, v and beta rounded to bf16; g (one decay per value head, or
    per key channel with per_channel) fp32. Returns (q, k, v, g, beta)."""
    import ml_dtypes
    r = np.random.default_rng(ACCURACY_CASES.index(case))
    q, k = r.standard_normal((1, t, hk, kd)), r.standard_normal((1, t, hk, kd))
    v = r.standard_normal((1, t, hv, kd))
    gate_shape = (1, t, hv, kd) if per_channel else (1, t, hv)
    if case == "repeated keys":
        k = k[:, r.integers(0, 3, t)]
        q = k.copy()
        g, beta = np.full(gate_shape, -1e-3), np.full((1, t, hv), 0.999)
    else:
        g = -0.3 * np.log1p(np.exp(r.standard_normal(gate_shape)))
        beta = 1.0 / (1.0 + np.exp(-r.standard_normal((1, t, hv))))
    bf16 = lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float64)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    return bf16(unit(q)), bf16(unit(k)), bf16(v), g.astype(np.float32).astype(np.float64), bf16(beta)


def accuracy_cases(args, heads: dict[str, int], *, per_channel: bool) -> list[dict]:
    """The --accuracy cases as JSON dicts (what a peer subprocess gets)."""
    t = ACCURACY_SMOKE_T if args.smoke else ACCURACY_T
    return [dict(key=f"a{i}", case=c, T=t, per_channel=per_channel, **heads)
            for i, c in enumerate(ACCURACY_CASES)]


def run_accuracy(rep: "Report", cases: list[dict], *, ours: Callable, impls: Sequence[str],
                 fla: dict, fla_name: str, jla: Callable | None = None) -> str:
    """Ours (`ours(impl, q, k, v, g, beta) -> (o, final)` on bf16 q/k/v and fp32 g, beta, for each
    impl), FLA's outputs (`fla`: run_peer's results for `cases`) and jla (`jla(q, k, v, g, beta)`,
    beta in bf16, or None) against the float64 oracle; one row each. Returns the markdown."""
    import jax.numpy as jnp
    from gdn_jax.check import oracle_delta_rule

    def row(c, who, o, state, want):
        err_o, err_s = rel_err(o, want[0]), rel_err(state, want[1])
        rep.add(case=c["case"], who=who, T=c["T"], rel_err_o=err_o, rel_err_state=err_s,
                within_bound=err_o <= BF16_BOUND)
        rep.progress(f"{c['case']}: {who}: o {err_o:.2e}, state {err_s:.2e} against float64")

    for c in cases:
        x = accuracy_inputs(c["case"], c["T"], c["hk"], c["hv"], c["k"], per_channel=c["per_channel"])
        want = oracle_delta_rule(*x, np.zeros((1, c["hv"], c["k"], c["k"])), use_qk_l2norm=False,
                                 keep_states=False)
        q, k, v = (jnp.asarray(a, jnp.bfloat16) for a in x[:3])
        g, beta = jnp.asarray(x[3], jnp.float32), jnp.asarray(x[4], jnp.float32)
        for impl in impls:
            try:
                row(c, f"ours impl={impl}", *ours(impl, q, k, v, g, beta), want)
            except ValueError as e:   # an impl that cannot take the call: one line
                rep.note(f"{c['case']}: impl={impl} declined: {str(e)[:200]}")
        r = fla.get(c["key"])
        if r is not None and "samples" in r:
            row(c, f"FLA {fla_name}", r["samples"]["o"], r["samples"]["state"], want)
        elif r is not None:
            rep.note(f"{c['case']}: FLA failed: {r.get('error')}")
        if jla is not None:
            try:
                row(c, "jla mosaic_gpu", *jla(q, k, v, g, beta.astype(jnp.bfloat16)), want)
            except Exception as e:  # noqa: BLE001 - a peer's failure is one line, not a traceback
                rep.note(f"{c['case']}: jla failed: {type(e).__name__}: {str(e)[:200]}")
    c = cases[0]
    heads = f"HK={c['hk']}, HV={c['hv']}" if c["hk"] != c["hv"] else f"H={c['hv']}"
    lines = [f"{rep.meta['device']}, {rep.meta['date']}, jax {rep.meta['jax']}; B=1, T={c['T']}, "
             f"{heads}, K=V={c['k']}; q/k L2-normalised and rounded to bf16 beforehand, bf16 v and "
             f"beta, fp32 {'per-channel ' if c['per_channel'] else ''}g, no initial state; relative "
             f"L2 error against a float64 token loop. The library's bound for bf16 inputs: "
             f"{BF16_BOUND:g}." + (" SMOKE RUN (interpret mode / tiny shapes)." if rep.args.smoke
                                    else ""), "",
             "| case | who | o vs float64 | final state vs float64 | o within the bound |",
             "|---|---|---|---|---|"]
    for r in rep.rows:
        lines.append(f"| {r['case']} | {r['who']} | {r['rel_err_o']:.2e} | {r['rel_err_state']:.2e} "
                     f"| {'yes' if r['within_bound'] else 'no'} |")
    return "\n".join(lines)


def fla_accuracy_peer(cases: list[dict], out_dir: str) -> None:
    """Runs in a subprocess (`run_peer`): FLA's chunked kernel (`chunk_kda` for per-channel
    gates, else `chunk_gated_delta_rule`) on the --accuracy cases, q/k/v bf16, g and beta fp32;
    its outputs."""
    def run_case(c):
        import torch
        if c["per_channel"]:
            from fla.ops.kda import chunk_kda as chunk
        else:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as chunk
        x = accuracy_inputs(c["case"], c["T"], c["hk"], c["hv"], c["k"], per_channel=c["per_channel"])
        dev = lambda a, dt: torch.from_numpy(a.astype(np.float32)).to("cuda", dt)
        q, k, v = (dev(a, torch.bfloat16) for a in x[:3])
        o, s = chunk(q, k, v, g=dev(x[3], torch.float32), beta=dev(x[4], torch.float32),
                     output_final_state=True)
        return {}, dict(o=o.float().cpu().numpy(), state=s.float().cpu().numpy())

    peer_cases(cases, out_dir, run_case, tag="fla")

# --------------------------------------------------------------------------- flags

def impl_list(args) -> list[str]:
    """--impls as a list of names."""
    return [x.strip() for x in args.impls.split(",") if x.strip()]


def int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not vals or min(vals) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {n}")
    return n


def add_calls_flag(p: argparse.ArgumentParser) -> None:
    """--calls: the prefill benches' back-to-back calls per sync."""
    p.add_argument("--calls", type=positive_int, default=PREFILL_CALLS,
                   help="prefill calls timed back to back per sync (default %(default)s; 1 with "
                        "--smoke): the sync's fixed cost, the first call's dispatch and the final "
                        "wait, is shared by them, so more calls come closer to a call's device "
                        "time; jla, timed as ours, takes the same count (--short chains its "
                        "prefills instead)")


def add_shared_flags(p: argparse.ArgumentParser, *, batches: str, seq_lens: str, dtype: str,
                     peers: str) -> argparse.ArgumentParser:
    """The flags every benchmark takes (each states its defaults)."""
    p.add_argument("--batches", type=int_list, default=int_list(batches),
                   help=f"batch sizes, comma-separated (default {batches})")
    p.add_argument("--seq-lens", type=int_list, default=int_list(seq_lens),
                   help=f"sequence lengths T, comma-separated (default {seq_lens})")
    p.add_argument("--dtype", default=dtype, choices=("bfloat16", "float16", "float32"),
                   help=f"q/k/v dtype (default {dtype})")
    p.add_argument("--peers", default=peers,
                   help=f"peers to time alongside, comma-separated from {sorted(PEERS)}, or "
                        f"'none' (default {peers})")
    p.add_argument("--repeats", type=positive_int, default=5,
                   help="timed repeats; the median is reported")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes, kernels in interpret mode, no peers: checks the script on a CPU "
                        "(its times mean nothing)")
    p.add_argument("--json", default=None, metavar="PATH", help="write every number to PATH")
    p.add_argument("--plot", default=None, metavar="PATH", help="draw a PNG to PATH (matplotlib)")
    p.add_argument("--write-md", default=None, metavar="PATH",
                   help="replace (or append) this benchmark's section in the markdown file PATH")
    # Older spellings, kept so recorded commands (BENCHMARKS.md, GPU scripts) still run.
    p.add_argument("--md", "--md-out", dest="write_md", help=argparse.SUPPRESS)
    p.add_argument("--no-write", action="store_true", help=argparse.SUPPRESS)   # now the default
    p.add_argument("--no-peer", dest="peers", action="store_const", const="none", help=argparse.SUPPRESS)
    return p


def peer_list(args) -> list[str]:
    if args.smoke or args.peers in ("", "none"):
        return []
    names = [x.strip() for x in args.peers.split(",") if x.strip()]
    bad = [n for n in names if n not in PEERS]
    if bad:
        raise SystemExit(f"--peers: unknown {bad}; choose from {sorted(PEERS)} or 'none'")
    return names


# --------------------------------------------------------------------------- what is missing

def missing_gpu(smoke: bool) -> str | None:
    """One line saying why the benchmark cannot run here (None when it can). The benchmarks' first
    touch of JAX: before the backend starts, JAX's up-front GPU allocation is capped at half the
    memory (unless the environment sets it), leaving room for the torch peers' subprocess."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    import jax
    if smoke or jax.default_backend() == "gpu":
        return None
    return (f"no GPU: JAX's backend is {jax.default_backend()!r} ({jax.devices()[0].device_kind}); "
            "the kernels compile only for a CUDA GPU. Nothing timed; --smoke runs a tiny "
            "interpret-mode pass that checks the script.")


def peer_available(name: str) -> str | None:
    """None when the peer can run, else one line naming what is missing."""
    missing = [m for m in PEERS[name] if importlib.util.find_spec(m) is None]
    if missing:
        what = {"fla": "flash-linear-attention (pip install flash-linear-attention)",
                "jla": "jax-linear-attention (jla; install from its source)"}
        return f"peer {name} skipped: {', '.join(what.get(m, m) for m in missing)} not installed"
    return None


# --------------------------------------------------------------------------- timing

def time_jax(fn: Callable, *args, calls: int = 40, repeats: int = 5,
             chain: Callable | None = None) -> float:
    """Median seconds per call over `repeats` batches of `calls` back-to-back calls.

    `chain(out, args) -> args` feeds a call's output into the next (e.g. a donated state);
    without it the same arguments are reused."""
    import jax
    out = fn(*args)
    jax.block_until_ready(out)
    if chain is not None:
        args = chain(out, args)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
            if chain is not None:
                args = chain(out, args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls)
    return float(np.median(times))


def kernel_context():
    """A fresh context for one use: `gdn_jax.interpret()` (Pallas kernels in interpret mode)
    off a GPU, else a null context. (A generator-based context manager cannot be entered twice.)"""
    import contextlib

    import jax

    import gdn_jax
    return gdn_jax.interpret() if jax.default_backend() != "gpu" else contextlib.nullcontext()


def time_impl(rep: "Report", impl: str, label: str, fn: Callable, *args, calls: int,
              repeats: int, first=None, on_decline: Callable[[], None] | None = None):
    """Run an impl's `fn(*args)` -> (o, state) once and time it (`time_jax`), kernels in
    interpret mode off a GPU. Returns (output, seconds per call, relative L2 error against
    `first`, the first impl's output, or None), or None after one note line: the impl declined
    the call (a ValueError: `on_decline` is told) or failed (any other error), so the other
    impls of a bench still run."""
    import jax
    try:
        with kernel_context():
            out = jax.block_until_ready(fn(*args))
            sec = time_jax(fn, *args, calls=calls, repeats=repeats)
        err = None if first is None else max(rel_err(out[0], first[0]), rel_err(out[1], first[1]))
        return out, sec, err
    except ValueError as e:
        rep.note(f"impl={impl!r} unavailable: {str(e).split(':', 1)[-1].strip()[:200]}")
        if on_decline is not None:
            on_decline()
    except Exception as e:  # noqa: BLE001 - a failing impl is one line, the others still run
        rep.note(f"impl={impl!r} failed on {label}: {type(e).__name__}: {str(e)[:200]}")
    return None


def measure_copy_gbps(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Device copy bandwidth measured now, GB/s of bytes read + written: a jitted elementwise
    `x + 1` over `nbytes` of fp32 (one read and one write per element)."""
    import jax
    import jax.numpy as jnp
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda x: x + 1.0)
    sec = time_jax(f, x, calls=10, repeats=repeats)
    return 2 * x.size * 4 / sec / 1e9


def chunk_flops(batch: int, seq_len: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                chunk: int = 64) -> float:
    """Matmul FLOPs of the chunked (WY/UT) forward, per call: per token and value head
    4CK (q k^T and k k^T in the chunk) + 3CV (the triangular solve and the intra-chunk output)
    + 6KV (k S, q S and the state update), C = chunk size."""
    c, k, v = chunk, head_k_dim, head_v_dim
    return float(batch * seq_len * num_v_heads * (4 * c * k + 3 * c * v + 6 * k * v))


# --------------------------------------------------------------------------- inputs both sides share

def np_inputs(seed: int, batch: int, seq_len: int, hk: int, hv: int, kd: int, vd: int, *,
              per_channel: bool = False, state: bool = True) -> dict[str, np.ndarray]:
    """Float32 NumPy inputs from one seed (the peer subprocess regenerates the same): q, k, v
    normal; g log decay in (-inf, 0): GDN -softplus(n) [B, T, HV], KDA [B, T, HV, K] in
    [-5, 0); beta = sigmoid(n); h0 = 0.1 n [B, HV, K, V] when `state`."""
    rng = np.random.default_rng(seed)
    n = lambda *s: rng.standard_normal(s, dtype=np.float32)
    out = {"q": n(batch, seq_len, hk, kd), "k": n(batch, seq_len, hk, kd),
           "v": n(batch, seq_len, hv, vd)}
    if per_channel:
        out["g"] = (-5.0 / (1.0 + np.exp(-n(batch, seq_len, hv, kd)))).astype(np.float32)
    else:
        out["g"] = (-np.logaddexp(0.0, n(batch, seq_len, hv))).astype(np.float32)
    out["beta"] = (1.0 / (1.0 + np.exp(-n(batch, seq_len, hv)))).astype(np.float32)
    if state:
        out["h0"] = 0.1 * n(batch, hv, kd, vd)
    return out




def peer_verdict(err: float | None) -> str:
    if err is None:
        return "not checked"
    return f"{err:.1e}" + ("" if err <= PEER_TOL else " MISMATCH")


# --------------------------------------------------------------------------- peers in a subprocess

def run_peer(func: str, cases: list[dict], *, timeout: int = 900,
             progress: Callable[[str], Any] = print) -> dict[str, dict]:
    """Run `func` ("module:function", called as function(cases, out_dir)) in a fresh Python.

    Each case is a JSON dict with a "key"; the function writes `result.json` ({key: {"us": ...,
    or "error": ...}}) and, per case, `<key>.npz` with output samples. Returns {key: result},
    with the samples loaded under "samples". A failed subprocess gives {} and one line."""
    module, name = func.split(":")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        code = (f"import sys; sys.path.insert(0, {src!r}); import json; from {module} import {name}; "
                f"{name}(json.load(open({os.path.join(d, 'cases.json')!r})), {d!r})")
        with open(os.path.join(d, "cases.json"), "w") as f:
            json.dump(cases, f)
        try:
            # The peer imports gdn_jax (for the shared inputs) but must leave the GPU to torch.
            env = dict(os.environ, JAX_PLATFORMS="cpu")
            proc = subprocess.run([sys.executable, "-c", code], timeout=timeout, env=env,
                                  capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            progress(f"peer {func} timed out after {timeout} s")
            return {}
        for line in proc.stdout.splitlines():
            progress(line)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
            progress(f"peer {func} failed: {last[:300]}")
            return {}
        with open(os.path.join(d, "result.json")) as f:
            res = json.load(f)
        for key, r in res.items():
            path = os.path.join(d, f"{key}.npz")
            if os.path.exists(path):
                with np.load(path) as z:
                    r["samples"] = {k: z[k] for k in z.files}
        return res


def peer_cases(cases: list[dict], out_dir: str, run_case: Callable[[dict], tuple[dict, dict | None]],
               *, tag: str, res: dict | None = None) -> None:
    """The body of a peer subprocess (see `run_peer`): `run_case(case)` returns (result, samples
    or None) for one case; samples go to `<key>.npz`, results (a failed case as one "error" line,
    the other cases still run) to `result.json`, with any entries already in `res`."""
    res = {} if res is None else res
    for c in cases:
        key = c["key"]
        try:
            r, samples = run_case(c)
            if samples:
                np.savez(os.path.join(out_dir, f"{key}.npz"), **samples)
            res[key] = r
        except Exception as e:  # noqa: BLE001 - one line per failed case, keep going
            res[key] = {"error": f"{type(e).__name__}: {e}"[:300]}
        print(f"{tag} {key}: {res[key]}", flush=True)
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(res, f)


def make_parser(name: str, description: str | None, **shared) -> argparse.ArgumentParser:
    """`gdn-jax bench <name>`'s parser with the shared flags (`add_shared_flags(**shared)`)."""
    p = argparse.ArgumentParser(prog=f"gdn-jax bench {name}", description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shared_flags(p, **shared)
    return p


def parse_here(name: str, parser: argparse.ArgumentParser, argv) -> argparse.Namespace | None:
    """`argv` parsed, or None after one line saying why `gdn-jax bench <name>` cannot run here
    (`parser.parse_args`, then `runs_here`)."""
    args = parser.parse_args(argv)
    return args if runs_here(name, args) else None


def runs_here(name: str, args: argparse.Namespace) -> bool:
    """Whether `gdn-jax bench <name>` with the parsed `args` can run here; if not, one line says
    why. It starts JAX (`missing_gpu`): a benchmark that sets XLA flags from its arguments (bench
    block --mesh: the host device count) parses, sets them, then calls this."""
    why = missing_gpu(args.smoke)
    if why:
        print(f"gdn-jax bench {name}: {why}")
        return False
    return True


def usable_peers(args, rep: "Report", *, supported=tuple(PEERS), why_not: str = "") -> list[str]:
    """The --peers this benchmark can run here, in order; each one left out gets a note in the
    report (not supported by this benchmark: `why_not`; not installed: what is missing)."""
    peers = []
    for name in peer_list(args):
        reason = (f"peer {name} skipped: {why_not}" if name not in supported
                  else peer_available(name))
        if reason:
            rep.note(reason)
        else:
            peers.append(name)
    return peers


def torch_do_bench_us(fn: Callable) -> float:
    """Median microseconds of `fn` by triton.testing.do_bench (CUDA events), in the peer process."""
    import triton.testing as tt
    return float(tt.do_bench(fn, warmup=25, rep=200, return_mode="median")) * 1e3


# --------------------------------------------------------------------------- output

class Report:
    """Progress lines, the result rows and the run's facts; writes --json / --plot / --write-md."""

    def __init__(self, name: str, args):
        import jax
        self.name, self.args = name, args
        d = jax.devices()[0]
        self.meta: dict[str, Any] = {
            "bench": name, "device": f"{d.device_kind} ({d.platform})",
            "date": datetime.date.today().isoformat(), "jax": jax.__version__,
            "smoke": bool(args.smoke), "argv": sys.argv[1:],
        }
        self.rows: list[dict[str, Any]] = []
        self.notes: list[str] = []

    def progress(self, msg: str) -> None:
        print(f"[bench {self.name}] {msg}", flush=True)

    def note(self, msg: str) -> None:
        """A one-line fact for the output (a peer skipped, a kernel unavailable)."""
        self.notes.append(msg)
        self.progress(msg)

    def add(self, **row) -> dict:
        self.rows.append(row)
        return row

    def finish(self, title: str, markdown: str, plot: Callable[[str], None] | None = None) -> int:
        if self.notes:
            markdown = markdown.rstrip() + "\n\n" + "\n".join(f"- {n}" for n in self.notes)
        print("\n" + markdown, flush=True)
        a = self.args
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"meta": self.meta, "rows": self.rows, "notes": self.notes}, f, indent=1,
                          default=_jsonable)
            self.progress(f"wrote {a.json}")
        if a.plot:
            if importlib.util.find_spec("matplotlib") is None:
                self.progress("--plot skipped: matplotlib not installed (pip install 'gdn_jax[bench]')")
            elif plot is not None:
                plot(a.plot)
                self.progress(f"wrote {a.plot}")
        if a.write_md:
            write_section(a.write_md, title, markdown)
            self.progress(f"wrote section '## {title}' of {a.write_md}")
        return 0


def _jsonable(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def write_section(path: str, title: str, markdown: str) -> None:
    """Replace the section `## title` of the markdown file `path` (up to the next `## `), or
    append it; creates the file if missing."""
    head = f"## {title}\n"
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n\n"
    body = head + "\n" + markdown.strip() + "\n\n"
    pat = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = pat.sub(lambda _: body, text) if pat.search(text) else text.rstrip() + "\n\n" + body
    with open(path, "w") as f:
        f.write(text)


def line_plot(path: str, series: dict[str, Sequence[tuple[float, float]]], *, xlabel: str,
              ylabel: str, title: str, logx: bool = True, hline: tuple[float, str] | None = None) -> None:
    """One PNG: a line per series (name -> [(x, y)]), optional horizontal reference line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for name, pts in series.items():
        pts = sorted((x, y) for x, y in pts if y is not None and np.isfinite(y))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    if hline is not None:
        ax.axhline(hline[0], color="gray", linestyle="--", linewidth=1, label=hline[1])
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --------------------------------------------------------------------------- profiler (bench verify --profile)

def kernel_times(fn, *args, calls: int = 5, chain=None, per: int = 1) -> dict[str, float]:
    """Device time per kernel name, in microseconds per `per` units of work (e.g. rounds).

    Runs `fn` `calls` times under the JAX profiler (a perfetto trace in a temporary folder) and
    sums the GPU stream events by kernel name. Tells the Pallas kernel apart from the small XLA
    ops around it, which a wall-clock time of the whole program cannot. Empty off GPU."""
    import glob
    import gzip

    import jax
    out = fn(*args)                       # compiled and warm before the trace starts
    jax.block_until_ready(out)
    if chain is not None:
        args = chain(out, args)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(calls):
                out = fn(*args)
                if chain is not None:
                    args = chain(out, args)
            jax.block_until_ready(out)
        paths = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)
        if not paths:
            return {}
        with gzip.open(paths[0]) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    totals: dict[str, float] = {}
    for e in events:
        if e.get("ph") != "X" or "GPU" not in procs.get(e.get("pid"), ""):
            continue
        if not threads.get((e["pid"], e.get("tid")), "").startswith("Stream"):
            continue
        totals[e["name"]] = totals.get(e["name"], 0.0) + float(e.get("dur", 0.0))
    return {k: v / (calls * per) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def print_kernel_times(label: str, times: dict[str, float], wall_us: float | None = None) -> None:
    total = sum(times.values())
    extra = f", wall {wall_us:.1f} us" if wall_us is not None else ""
    print(f"[profile] {label}: {len(times)} kernels, {total:.1f} us of kernel time{extra}", flush=True)
    for name, us in times.items():
        print(f"[profile]   {us:8.1f} us  {name[:90]}", flush=True)


def report_kernel_times(rep: "Report", label: str, fn, *args, wall_us: float) -> None:
    """`--kernels`: fn's device time per kernel (10 calls under the JAX profiler, after the
    timing) printed beside its wall time and kept in the JSON report's meta["kernels"][label];
    one line saying so where no GPU kernel was traced (off GPU)."""
    times = kernel_times(fn, *args, calls=10)
    rep.meta.setdefault("kernels", {})[label] = times
    if not times:
        rep.progress(f"{label}: no GPU kernels traced (the per-kernel times need a GPU)")
        return
    print_kernel_times(label, times, wall_us=wall_us)
