#!/usr/bin/env bash
# Nsight Compute launch statistics and occupancy (registers a thread, blocks an SM) of the
# carried verify at the bench shape (T=4), one launch per block variant given as arguments
# ("exact" or proj:block_v:num_warps, e.g. dot:64:4; default: the fast default).
# Launch stats + occupancy only: a full section set replays ~18 times per kernel and took
# minutes (2026-11-30: a run over three kernels hit its timeout and left the GPU unusable).
OUT=${OUT:-./gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
echo "ncu: ${NCU:-none}"; [ -z "$NCU" ] && exit 0
VARIANTS="${*:-default}"
cat > /tmp/ncu_app.py <<PY
import jax, jax.numpy as jnp
from gdn_jax import verify as vf
from gdn_jax.bench import verify as bv
from pallas_kernels import gdn_verify as kv
B, T = 128, 4
q, k, v, g, beta, pool, slots = bv._inputs(B, T, B, seed=1)
for name in "$VARIANTS".split():
    exact, block = name == "exact", None
    if name not in ("exact", "default"):
        proj, bvv, w = name.split(":")
        block = kv.VerifyBlockSizes(int(bvv), int(w), proj=proj)
    st = vf.DeltaStash.init(B, num_v_heads=bv.HV, num_k_heads=bv.HK, head_k_dim=bv.K,
                        head_v_dim=bv.V)
    o, p, st = vf.carried_verify(q, k, v, g, beta, jnp.array(pool, copy=True), st, slots, exact=exact,
                                 use_qk_l2norm=True, impl="pallas", block_sizes=block)
    jax.block_until_ready(o); print("ran", name, flush=True)
PY
N=$(echo $VARIANTS | wc -w)
timeout -k 5 ${NCU_TIMEOUT:-100} $NCU --target-processes all -k regex:gdn_carried --launch-count $N \
    --section LaunchStats --section Occupancy python3 /tmp/ncu_app.py > "$OUT/ncu.txt" 2>&1
echo "ncu rc=$?"
grep -E "^ran|gdn_|Registers Per|Theoretical Occupancy|Block Limit Reg|Block Limit Shared|Dynamic Shared" \
    "$OUT/ncu.txt" | cut -c1-110 | head -60
