#!/usr/bin/env bash
# Measured DRAM bytes (Nsight Compute counters dram__bytes_read/write) of one decode step and of
# one carried fast verify at T=4 that folds 4 pending rows (the bench shape), against the state's
# size: how close a verify round comes to one state read + one write.
OUT=${OUT:-./gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
echo "ncu: ${NCU:-none}"; [ -z "$NCU" ] && exit 0
cat > /tmp/ncu_bytes_app.py <<'PY'
import jax, jax.numpy as jnp
from gdn_jax import decode as dec, verify as vf
from gdn_jax.bench import verify as bv
B, T = 128, 4
q, k, v, g, beta, pool, slots = bv._inputs(B, T, B, seed=1)
print("state bytes", pool.size * 4, flush=True)
st = vf.DeltaStash.init(B, num_v_heads=bv.HV, num_k_heads=bv.HK, head_k_dim=bv.K,
                        head_v_dim=bv.V)
acc = jnp.full((B,), T, jnp.int32)
for r in range(2):            # the second verify folds the 4 rows the first one stashed
    o, pool, st = vf.carried_verify(q, k, v, g, beta, pool, st, slots, exact=False,
                                    use_qk_l2norm=True, impl="pallas")
    st, _ = vf.accept(st, slots, acc)
pool, st = vf.flush(pool, st, slots, impl="pallas")
qkv = jnp.concatenate([q[:, 0].reshape(B, -1), k[:, 0].reshape(B, -1), v[:, 0].reshape(B, -1)], 1)
o, pool = dec.gdn_decode_pool(qkv, g[:, 0], beta[:, 0], pool, slots, num_k_heads=bv.HK,
                              num_v_heads=bv.HV, head_k_dim=bv.K, head_v_dim=bv.V,
                              use_qk_l2norm=True, impl="pallas")
jax.block_until_ready(o); print("ran", flush=True)
PY
timeout -k 5 ${NCU_TIMEOUT:-120} $NCU --target-processes all -k "regex:gdn_carried|gdn_decode" \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \
    python3 /tmp/ncu_bytes_app.py > "$OUT/ncu_bytes.txt" 2>&1
echo "ncu rc=$?"
grep -E "state bytes|gdn_|dram__bytes|gpu__time" "$OUT/ncu_bytes.txt" | cut -c1-110 | head -30
