"""Command line: `python -m gdn_jax demo` and `python -m gdn_jax bench <name> [options]`.

Each benchmark lives in `gdn_jax/bench/<name>.py` and exposes `main(argv) -> int`."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys


def _bench_names():
    import gdn_jax.bench as pkg
    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_")
                  and m.name != "common")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m gdn_jax")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("demo", help="small prefill + decode through the references, printing a table")
    b = sub.add_parser("bench", help="GPU benchmarks, results appended to BENCHMARKS.md")
    b.add_argument("name", choices=_bench_names())
    b.add_argument("rest", nargs=argparse.REMAINDER, help="options of that benchmark (--help)")
    args = parser.parse_args(argv)
    if args.cmd == "demo":
        from gdn_jax.demo import main as demo_main
        return demo_main()
    return importlib.import_module(f"gdn_jax.bench.{args.name}").main(args.rest)
