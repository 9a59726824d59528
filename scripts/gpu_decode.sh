#!/usr/bin/env bash
# One device call for issue 4: compiled GPU tests of the decode kernels and converters, then the
# decode benchmark against flash-linear-attention. Run from the repo root on the GPU machine,
# with the peer wheels carried in .whl. Logs and results land in $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/smi.txt"
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/test_decode_kernels.py tests/test_state_convert.py -W ignore::DeprecationWarning 2>&1 \
  | tee "$OUT/pytest_gpu.log" | grep -v "^$" | tail -25
echo "pytest rc=$?"
timeout ${BENCH_TIMEOUT:-330} python3 -W ignore::DeprecationWarning -m gdn_jax bench decode \
  ${BENCH_ARGS:---sweep} --md "$OUT/decode_section.md" --json "$OUT/decode.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
grep -v "^  " "$OUT/bench.log" | tail -40
