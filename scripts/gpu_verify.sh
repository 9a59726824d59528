#!/usr/bin/env bash
# Speculative verify on the GPU: the compiled-kernel tests, then the benchmark. Logs under $OUT
# (the device tool's output folder; ./gpu_out when unset), short table last.
set -o pipefail
OUT=${OUT:-./gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv 2>&1 | tee "$OUT/gpu.txt"
timeout 220 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_verify.py tests/test_verify_layers.py \
    -rA --durations=15 2>&1 | tee "$OUT/pytest.log" | grep -v "^PASSED\|Warning\|warn" | tail -40
echo "pytest rc=$?"
timeout 160 python3 -m gdn_jax bench verify --no-write --md-out "$OUT/verify_section.md" 2>&1 | tee "$OUT/bench.log" \
    | grep -v "Warning\|warn" | tail -30
echo "bench rc=$?"
