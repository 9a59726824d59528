#!/usr/bin/env bash
# Multi-tile fast carried verify on the GPU in one short lease (<= 200 s): the trimmed benchmark
# first (decode + fast T=4/T=2, default vs multi-tile shapes; markdown to
# $OUT/verify_tiles.md), then the multi-tile and default fast GPU tests.
set -o pipefail
OUT=${OUT:-./gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
timeout ${BENCH_S:-110} python3 -m gdn_jax bench verify --fast-only --md-out "$OUT/verify_tiles.md" \
    2>&1 | tee "$OUT/bench.log" | grep -v "Warning\|warn\|return rule"
echo "bench rc=$?"
timeout ${TEST_S:-70} python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_verify.py \
    -k "multi_tile or (fast_shapes and gdn-dot-64-4)" -rA 2>&1 | tee "$OUT/pytest.log" \
    | grep -v "^PASSED\|Warning\|warn" | tail -15
echo "pytest rc=$?"
