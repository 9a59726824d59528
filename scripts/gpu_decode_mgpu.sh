#!/usr/bin/env bash
# One device call for the Mosaic GPU decode experiment (pallas_kernels/gdn_decode_mgpu.py):
# compiled GPU tests, then the Mosaic kernel against the Triton-lowered one
# (gdn_jax.decode.gdn_decode(..., impl="pallas")) in the SAME process at B = 32/128/256 fp32 and
# B = 128 fp16, plus a plain copy-bandwidth probe. Run from the repo root on the GPU machine.
# Logs and results land in $OUT; the short table is printed last.
#   MGPU_QUICK=1  fewer block shapes (first look)
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=.:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/smi.txt"

# Copy bandwidth (torch device-to-device copy of 2 x 2 GiB, read + written), before JAX takes the GPU.
# COPY_GBPS=<number> skips the probe (a value measured earlier on the same kind of machine).
[ -n "$COPY_GBPS" ] && echo "{\"copy_GBps\": $COPY_GBPS, \"note\": \"given, not measured in this run\"}" > "$OUT/copy.json" || \
timeout 90 python3 - > "$OUT/copy.json" 2> "$OUT/copy.err" <<'PY'
import json, torch, triton.testing as tt
x = torch.empty(2 * 1024**3 // 4, device="cuda"); y = torch.empty_like(x)
ms = tt.do_bench(lambda: y.copy_(x), warmup=20, rep=200, return_mode="median")
h = torch.randn(128, 32, 128, 128, device="cuda")
ms2 = tt.do_bench(lambda: h.mul_(0.999), warmup=20, rep=200, return_mode="median")
print(json.dumps({"copy_GBps": 2 * x.numel() * 4 / (ms * 1e-3) / 1e9,
                  "inplace_mul_B128_GBps": 2 * h.numel() * 4 / (ms2 * 1e-3) / 1e9}))
PY
echo "copy probe rc=$? $(cat "$OUT/copy.json")"

timeout ${TEST_TIMEOUT:-80} python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_decode_mgpu.py \
  -W ignore::DeprecationWarning 2>&1 | tee "$OUT/pytest_gpu.log" | grep -v "^$" | tail -15
echo "pytest rc=$?"

timeout ${BENCH_TIMEOUT:-150} python3 -W ignore::DeprecationWarning - 2>&1 <<'PY' | tee "$OUT/bench.log"
import dataclasses, functools, json, os, time
import jax, jax.numpy as jnp, numpy as np
from gdn_jax import decode as dec, reference as ref
from gdn_jax.bench import decode as bd
from pallas_kernels import gdn_decode_mgpu as mg

OUT = os.environ.get("OUT", "/tmp/out")
UNROLL = 10
D = mg.MgpuDecodeBlockSizes
quick = os.environ.get("MGPU_QUICK") == "1"
try:
    copy = json.load(open(f"{OUT}/copy.json"))
except Exception:  # noqa: BLE001
    copy = {}
copy_gbps = copy.get("copy_GBps")
if not copy_gbps:  # JAX fallback: x * 1 out of place (read + write)
    x = jnp.ones((2 * 1024**3 // 4,), jnp.float32) * 1.5
    f = jax.jit(lambda x: x * jnp.float32(1.0001))
    jax.block_until_ready(f(x)); t0 = time.perf_counter()
    for _ in range(20):
        y = f(x)
    jax.block_until_ready(y); t = (time.perf_counter() - t0) / 20
    copy_gbps = 2 * x.size * 4 / t / 1e9; del x, y
print(f"copy bandwidth {copy_gbps:.0f} GB/s; in-place mul {copy.get('inplace_mul_B128_GBps', float('nan')):.0f} GB/s", flush=True)

# D(tile_v, stages, heads): stages = tiles of loads in flight per block.
CFG = {
    ("float32", 128): [D(64, 4, 8), D(64, 3, 32), D(32, 6, 8), D(32, 4, 4)],
    ("float32", 32): [D(64, 4, 2), D(32, 6, 4)],
    ("float32", 256): [D(64, 4, 16)],
    ("float16", 128): [D(128, 4, 8)],
}
if quick:
    CFG = {k: v[:2] for k, v in CFG.items()}

def err(a, r):
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64); r = np.asarray(jnp.asarray(r, jnp.float32), np.float64)
    return float(np.linalg.norm(a - r) / np.linalg.norm(r)) if np.all(np.isfinite(a)) else float("inf")

results = {"device": jax.devices()[0].device_kind, "copy": copy, "copy_GBps": copy_gbps, "cases": []}
rows = []
for (sdt, b), cfgs in CFG.items():
    dt = jnp.dtype(sdt)
    args = bd._inputs(b, dt)
    nbytes = 2 * b * bd.HV * bd.K * bd.V * dt.itemsize
    tri = functools.partial(dec.gdn_decode, impl="pallas")
    t_tri = bd._time_steps(tri, tuple(args[:5]) + (args[5].copy(),), UNROLL) * 1e6
    print(f"{sdt} B={b} triton {t_tri:.1f} us", flush=True)
    res = []
    for cfg in cfgs:
        step = functools.partial(mg.gdn_decode_mgpu, block=cfg)
        try:
            t0 = time.perf_counter()
            t = bd._time_steps(step, tuple(args[:5]) + (args[5].copy(),), UNROLL) * 1e6
            res.append((t, cfg))
            print(f"{sdt} B={b} mgpu {cfg}: {t:.1f} us (incl. compile {time.perf_counter() - t0:.0f} s)", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{sdt} B={b} mgpu {cfg}: FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)
    t_tri2 = (bd._time_steps(tri, tuple(args[:5]) + (args[5].copy(),), UNROLL) * 1e6  # spread check
              if (sdt, b) == ("float32", 128) else t_tri)
    case = {"state": sdt, "B": b, "triton_us": t_tri, "triton_us_again": t_tri2,
            "mgpu": [(t, dataclasses.asdict(c)) for t, c in res]}
    if res:
        t_best, best = min(res, key=lambda x: x[0])
        q, k, v, g, beta, s = bd._inputs(b, dt, seed=1)
        ro, rs = ref.decode_step(q.astype(jnp.float32), k, v, g, beta, s)
        o, s2 = mg.gdn_decode_mgpu(q, k, v, g, beta, s.copy(), block=best)
        case.update(best_us=t_best, best=dataclasses.asdict(best),
                    rel_err=max(err(o, ro), err(s2, rs)))
        if (sdt, b) == ("float32", 128):  # does XLA keep the chained state in place?
            hlo = jax.jit(functools.partial(mg.gdn_decode_mgpu, block=best), donate_argnums=5).lower(
                *bd._inputs(b, dt)).compile().as_text()
            case["hlo_copies"] = sum(1 for ln in hlo.splitlines() if " copy(" in ln or "copy-start" in ln)
        print(f"{sdt} B={b}: best mgpu {t_best:.1f} us {best} rel_err {case['rel_err']:.1e}; "
              f"triton {t_tri:.1f}/{t_tri2:.1f} us", flush=True)
    results["cases"].append(case)
    rows.append((sdt, b, t_tri, t_tri2, case.get("best_us"), case.get("best"), nbytes, case.get("rel_err")))
    json.dump(results, open(f"{OUT}/mgpu_bench.json", "w"), indent=1, default=str)

print("\n| state | B | Triton (us) | Mosaic GPU best (us) | block (tile/stages/heads/swz) | Mosaic % copy BW | Triton % copy BW | Mosaic / Triton | rel err |")
print("|---|---|---|---|---|---|---|---|---|")
for sdt, b, tt, tt2, tm, best, nb, e in rows:
    tri = min(tt, tt2)
    if tm is None:
        print(f"| {sdt} | {b} | {tri:.1f} | failed | | | {100 * nb / tri / 1e3 / copy_gbps:.0f} | | |")
        continue
    blk = f"{best['tile_v']}/{best['stages']}/{best['heads']}/{'s' if best['swizzle'] else 'n'}"
    print(f"| {sdt} | {b} | {tri:.1f} | {tm:.1f} | {blk} | {100 * nb / tm / 1e3 / copy_gbps:.0f} | "
          f"{100 * nb / tri / 1e3 / copy_gbps:.0f} | {tm / tri:.3f} | {e:.1e} |")
PY
echo "bench rc=$?"
