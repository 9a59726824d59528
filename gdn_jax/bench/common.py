"""Timing and reporting helpers shared by the benchmarks.

JAX timing: many back-to-back calls, one `block_until_ready` at the end (a per-call sync adds
~100 us of host round trip and hides the kernel). Peers in torch: `triton.testing.do_bench`."""

from __future__ import annotations

import datetime
import os
import re
import time

import jax
import numpy as np

COPY_BANDWIDTH_GBPS = 4243.0  # H200 device-to-device copy, ../shared/ANCHORS.md (re-measured per run)


def time_jax(fn, *args, calls: int = 40, repeats: int = 5, chain=None) -> float:
    """Median seconds per call over `repeats` batches of `calls` back-to-back calls.

    `chain(out, args) -> args` feeds a call's output into the next (e.g. a donated state); without
    it the same arguments are reused."""
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


def device_name() -> str:
    d = jax.devices()[0]
    return f"{d.device_kind} ({d.platform})"


def today() -> str:
    return datetime.date.today().isoformat()


def write_section(title: str, markdown: str, path: str = "BENCHMARKS.md") -> None:
    """Replace (or append) the section `## title` of BENCHMARKS.md with `markdown`."""
    head = f"## {title}\n"
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n\n"
    body = head + markdown.rstrip() + "\n\n"
    pat = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = pat.sub(lambda _: body, text) if pat.search(text) else text.rstrip() + "\n\n" + body
    with open(path, "w") as f:
        f.write(text)


def kernel_times(fn, *args, calls: int = 5, chain=None, per: int = 1) -> dict[str, float]:
    """Device time per kernel name, in microseconds per `per` units of work (e.g. rounds).

    Runs `fn` `calls` times under the JAX profiler (a perfetto trace in a temporary folder) and
    sums the GPU stream events by kernel name. Tells the Pallas kernel apart from the small XLA
    ops around it, which a wall-clock time of the whole program cannot. Empty off GPU."""
    import glob
    import gzip
    import json
    import tempfile

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
