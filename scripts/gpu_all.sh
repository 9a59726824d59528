#!/usr/bin/env bash
# One device call that checks the integrated checkout on the GPU: every `gpu`-marked test
# (compiled kernels), then the reference and block tests run on the GPU too (fp32 tolerances must
# hold there: the references ask for HIGHEST matmul precision, so no TF32). Logs land in $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/smi.txt"
timeout ${GPU_TIMEOUT:-200} python3 -m pytest -q -m gpu -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" \
  | grep -E "passed|failed|Error|FAILED" | tail -15
echo "gpu-marked tests rc=$?"
timeout ${REF_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -x tests/test_reference.py \
  tests/test_layers_qwen3_next.py 2>&1 | tee "$OUT/pytest_ref_on_gpu.log" | grep -E "passed|failed|Error|FAILED" | tail -10
echo "references-on-gpu rc=$?"
