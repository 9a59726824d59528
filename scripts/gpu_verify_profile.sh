#!/usr/bin/env bash
# The verify benchmark with a per-kernel device-time breakdown of every timed round
# (`--profile`): which part of a round is the Pallas kernel and which the XLA ops around it.
set -o pipefail
OUT=${OUT:-./gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv 2>&1 | tee "$OUT/gpu.txt"
timeout ${BENCH_TIMEOUT:-400} python3 -m gdn_jax bench verify --no-write --profile --md-out "$OUT/verify_section.md" "$@" 2>&1 \
    | tee "$OUT/bench.log" | grep -v "Warning\|warn\|return rule" | grep "profile\]\|T=\|bitwise\|Error\|error" | cut -c1-150
echo "bench rc=$?"
