#!/usr/bin/env bash
# Fast-flavour carried verify on the GPU in one short lease (<= 240 s): the benchmark first
# (writes the markdown section to $OUT/verify_section.md), then the fast-flavour GPU tests.
set -o pipefail
OUT=${OUT:-./gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv 2>&1 | tee "$OUT/gpu.txt"
timeout 165 python3 -m gdn_jax bench verify --no-write --md-out "$OUT/verify_section.md" 2>&1 | tee "$OUT/bench.log" \
    | grep -v "Warning\|warn\|return rule"
echo "bench rc=$?"
timeout 62 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_verify.py \
    -k "fast_shapes or (schedule and fast)" -rA --durations=8 2>&1 | tee "$OUT/pytest.log" \
    | grep -v "^PASSED\|Warning\|warn" | tail -25
echo "pytest rc=$?"
