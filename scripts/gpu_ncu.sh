#!/usr/bin/env bash
# Nsight Compute launch statistics and occupancy (registers a thread, blocks an SM) of one
# kernel at the bench shape: the carried verify (fast by default; `exact` as $1) at T=4.
# Launch stats + occupancy only: a full section set replays ~18 times per kernel and took
# minutes (2026-11-30: a run over three kernels hit its timeout and left the GPU unusable).
OUT=${OUT:-./gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
echo "ncu: ${NCU:-none}"; [ -z "$NCU" ] && exit 0
FLAVOUR=${1:-fast}
cat > /tmp/ncu_app.py <<PY
import jax, jax.numpy as jnp
from gdn_jax import verify as vf
from gdn_jax.bench import verify as bv
B, T = 128, 4
q, k, v, g, beta, pool, slots = bv._inputs(B, T, B, seed=1)
st = vf.DeltaStash.init(B, num_v_heads=bv.HV, head_k_dim=bv.K, head_v_dim=bv.V)
o, pool, st = vf.carried_verify(q, k, v, g, beta, pool, st, slots, exact="$FLAVOUR" == "exact",
                                use_qk_l2norm=True, impl="pallas")
jax.block_until_ready(o); print("ran")
PY
timeout -k 5 ${NCU_TIMEOUT:-100} $NCU --target-processes all -k regex:gdn_carried --launch-count 1 \
    --section LaunchStats --section Occupancy python3 /tmp/ncu_app.py > "$OUT/ncu.txt" 2>&1
echo "ncu rc=$?"
grep -E "gdn_|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Dynamic Shared" \
    "$OUT/ncu.txt" | cut -c1-110 | head -30
