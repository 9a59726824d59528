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

    Every call into the library's selection functions is in this one function (pure: no device
    work), so a change of the dispatch API changes only this place."""
    import jax.numpy as jnp
    from gdn_jax import ops
    from gdn_jax.decode import select_decode_impl
    from pallas_kernels import gdn_decode as dk

    rows = []
    for kind, t in (("gdn", 8192), ("gdn", 8), ("kda", 8192)):
        fn = "gated_delta_rule" if kind == "gdn" else "kda"
        choice = ops.select_impl("auto", seq_len=t, kind=kind)
        why = (f"T >= {ops.AUTO_CHUNKED_MIN_T}: the pure-JAX WY chunk form" if choice == "chunked"
               else f"T < {ops.AUTO_CHUNKED_MIN_T}: the token-serial scan is as fast and simpler")
        try:
            ops.select_impl("pallas", seq_len=t, kind=kind)
        except ValueError as e:
            why += f"; no kernel: {str(e).split(':', 1)[-1].split('; use')[0].strip()}"
        rows.append({"call": f"{fn}, B=1 T={t} HK=16 HV=32 K=V=128", "choice": choice, "why": why})
    for b, sdt, kd, norm in ((128, jnp.float32, 128, False), (128, jnp.float16, 128, False),
                             (128, jnp.float32, 128, True), (8, jnp.float32, 96, False)):
        spec = dk.DecodeSpec(num_k_heads=16, num_v_heads=32, k_dim=kd, v_dim=128, scale=kd ** -0.5,
                             use_qk_l2norm=True, fused_norm=norm)
        block = dk.default_block_sizes(b, 128, sdt, norm)
        c = select_decode_impl("auto", backend=backend, spec=spec, block=block, state_dtype=sdt,
                               num_state_elements=b * 32 * kd * 128)
        what = f"decode (T=1), B={b} K={kd} V=128, {jnp.dtype(sdt).name} state" + (
            ", fused norm" if norm else "")
        rows.append({"call": what, "choice": c.impl,
                     "why": c.reason or "the Pallas decode kernel takes this call"})
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
        print(f"  {r['call']:<{width}}  -> {r['choice']:<10} {r['why']}")
    if rep["auto_on_gpu"]:
        print('\nand on a GPU would pick:')
        for r in rep["auto_on_gpu"]:
            print(f"  {r['call']:<{width}}  -> {r['choice']:<10} {r['why']}")
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
