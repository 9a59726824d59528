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
