"""The command line: `gdn-jax` (the same as `python -m gdn_jax`).

    gdn-jax --version
    gdn-jax demo  [--checkpoint DIR --layer N | --make-checkpoint DIR]
    gdn-jax env   [--json PATH]
    gdn-jax check [shapes, dtypes, --checkpoint DIR --layer N, --json PATH]
    gdn-jax bench <name> [shared bench flags]      (names: the modules of gdn_jax/bench/)

Each subcommand has its own `--help`. Heavy imports (JAX, Flax) happen inside the subcommands,
so `--version` and `--help` answer at once.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import pkgutil
import platform
import sys
from typing import Any, Sequence

# Packages `env` reports (installed version or "not installed"), in the order printed.
_CORE_PACKAGES = ("jax", "jaxlib", "flax", "numpy", "safetensors")
_OPTIONAL_PACKAGES = ("jax-cuda13-plugin", "torch", "triton", "flash-linear-attention", "jla",
                      "matplotlib", "chex")


def version() -> str:
    """The installed distribution's version, else the source tree's `gdn_jax.__version__`."""
    try:
        return importlib.metadata.version("gdn_jax")
    except importlib.metadata.PackageNotFoundError:
        import gdn_jax
        return gdn_jax.__version__


def _bench_names() -> list[str]:
    spec = importlib.util.find_spec("gdn_jax.bench")
    return sorted(m.name for m in pkgutil.iter_modules(spec.submodule_search_locations)
                  if not m.name.startswith("_") and m.name != "common")


# --------------------------------------------------------------------------- env

def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        # a source checkout on sys.path (e.g. jla) has no distribution metadata
        module = name.replace("-", "_") if name != "flash-linear-attention" else "fla"
        return "importable (no version metadata)" if importlib.util.find_spec(module) else None


def auto_choices(backend: str) -> list[dict[str, str]]:
    """Which implementation `impl="auto"` picks for typical calls on `backend`, and why.

    Every question to the library's dispatch is in this one function (pure: no device work):
    arguments are `jax.ShapeDtypeStruct`s read by the operation's own argument reader, and
    `gdn_jax.dispatch.select` answers for the named backend."""
    import jax
    import jax.numpy as jnp
    from gdn_jax import dispatch

    f32, bf16 = jnp.float32, jnp.bfloat16
    S = jax.ShapeDtypeStruct
    hk, hv, kd, vd = 16, 32, 128, 128

    def seq_args(b, t, kda, dt):
        g = S((b, t, hv, kd) if kda else (b, t, hv), f32)
        return (S((b, t, hk, kd), dt), S((b, t, hk, kd), dt), S((b, t, hv, vd), dt), g,
                S((b, t, hv), f32))

    calls = []
    for fn, t in (("gated_delta_rule", 8192), ("gated_delta_rule", 64), ("kda", 8192),
                  ("gated_delta_rule", 1)):
        calls.append((fn, f"{fn}, B=1 T={t} HK={hk} HV={hv} K=V={kd}, bf16",
                      seq_args(1, t, fn == "kda", bf16), {}))
    for b, sdt, kdim in ((128, f32, kd), (128, bf16, kd), (8, f32, 96)):
        calls.append(("gdn_decode", f"gdn_decode (T=1), B={b} K={kdim} V={vd}, "
                      f"{jnp.dtype(sdt).name} state",
                      (S((b, hk, kdim), bf16), S((b, hk, kdim), bf16), S((b, hv, vd), bf16),
                       S((b, hv), f32), S((b, hv), f32), S((b, hv, kdim, vd), sdt)), {}))
    rows = []
    for op, what, args, kwargs in calls:
        spec = dispatch._operation(op).spec_of(*args, **kwargs)
        c = dispatch.select(op, spec, "auto", backend=backend, log=False)
        rows.append({"call": what, "choice": c.impl, "family": c.family or "",
                     "why": c.reason or f"the Pallas {c.family} kernel takes this call"})
    return rows


def env_report() -> dict[str, Any]:
    import jax
    backend = jax.default_backend()
    return {
        "gdn_jax": version(),
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "backend": backend,
        "devices": [f"{d.id}: {d.device_kind} ({d.platform})" for d in jax.devices()],
        "packages": {n: _package_version(n) for n in _CORE_PACKAGES},
        "optional": {n: _package_version(n) for n in _OPTIONAL_PACKAGES},
        "kernels": ("compiled (Pallas Triton lowering; deprecated upstream, see docs/backends.md)"
                    if backend == "gpu" else
                    "not compiled on this backend; run in Pallas interpret mode (interpret=True)"),
        "auto": auto_choices(backend),
        "auto_on_gpu": auto_choices("gpu") if backend != "gpu" else None,
    }


def _choice_str(row: dict[str, str]) -> str:
    return row["choice"] + (f" ({row['family']})" if row.get("family") else "")


def _env(args: argparse.Namespace) -> int:
    rep = env_report()
    if args.json:
        text = json.dumps(rep, indent=1)
        if args.json == "-":
            print(text)
            return 0
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(f"gdn_jax   {rep['gdn_jax']}\npython    {rep['python']}\nplatform  {rep['platform']}")
    print(f"backend   {rep['backend']}\ndevices   " + "\n          ".join(rep["devices"]))
    print(f"kernels   {rep['kernels']}")
    print("packages  " + ", ".join(f"{k} {v or 'NOT INSTALLED'}" for k, v in rep["packages"].items()))
    print("optional  " + ", ".join(f"{k} {v or 'not installed'}" for k, v in rep["optional"].items()))
    print('\nimpl="auto" on this backend picks:')
    width = max(len(r["call"]) for r in rep["auto"])
    for r in rep["auto"]:
        print(f"  {r['call']:<{width}}  -> {_choice_str(r):<26} {r['why']}")
    if rep["auto_on_gpu"]:
        print('\nand on a GPU would pick:')
        for r in rep["auto_on_gpu"]:
            print(f"  {r['call']:<{width}}  -> {_choice_str(r):<26} {r['why']}")
    return 0


# --------------------------------------------------------------------------- parser

def build_parser() -> argparse.ArgumentParser:
    from gdn_jax import check as check_mod
    from gdn_jax import demo as demo_mod

    parser = argparse.ArgumentParser(
        prog="gdn-jax", description="Gated DeltaNet / Kimi Delta Attention for JAX: demo, "
        "environment report, equivalence check, benchmarks. `gdn-jax <command> --help` for each.")
    parser.add_argument("--version", action="version", version=f"gdn_jax {version()}")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="command")
    demo_mod.build_parser(sub.add_parser(
        "demo", help="a self-checking tour: references, a kernel, a block from a checkpoint"))
    e = sub.add_parser("env", help="devices, versions, and what impl='auto' picks here and why")
    e.description = ("Devices, package versions (optional peers included), and for typical "
                     "shapes which implementation impl='auto' picks on this backend and why.")
    e.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON ('-': stdout only)")
    check_mod.build_parser(sub.add_parser(
        "check", help="every implementation vs a float64 oracle: a pass/fail table"))
    b = sub.add_parser("bench", help="benchmarks (a GPU; --smoke runs a tiny CPU pass)",
                       description="Benchmarks; `gdn-jax bench <name> --help` lists the shared "
                       "flags. Results go to the terminal, --json PATH, --plot PATH; a markdown "
                       "section is written only with --write-md PATH.")
    b.add_argument("name", choices=_bench_names(), help="which benchmark")
    b.add_argument("rest", nargs=argparse.REMAINDER, help="that benchmark's options (see its --help)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--version"]:           # answer without importing JAX
        print(f"gdn_jax {version()}")
        return 0
    args = build_parser().parse_args(argv)
    if args.cmd == "demo":
        from gdn_jax import demo
        return demo.run(args)
    if args.cmd == "env":
        return _env(args)
    if args.cmd == "check":
        from gdn_jax import check
        return check.run(args)
    return importlib.import_module(f"gdn_jax.bench.{args.name}").main(args.rest)
