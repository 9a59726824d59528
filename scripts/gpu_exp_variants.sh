#!/usr/bin/env bash
# One lease: fast carried-verify variants timed (kernel + round) with their error against the
# exact flavour, their registers (ncu launch stats), and the fast-shape GPU tests.
OUT=${OUT:-./gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
V="${VARIANTS:-dot:64:4:ieee dot:64:8:ieee}"
timeout ${EXP_TIMEOUT:-240} python3 scripts/exp_verify_variants.py $V 2>&1 | tee "$OUT/exp.log" \
    | grep -v "Warning\|warn\|return rule"
echo "exp rc=$?"
NCU_TIMEOUT=${NCU_TIMEOUT:-90} bash scripts/gpu_ncu.sh $V
if [ -n "$TESTS" ]; then
  timeout ${TEST_TIMEOUT:-120} python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_verify.py \
      -k "$TESTS" -rA -s 2>&1 | tee "$OUT/pytest.log" | grep -E "relative error|passed|failed|Error" | tail -30
fi
