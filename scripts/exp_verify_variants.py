"""Experiment (GPU): kernel time, registers-free timing and accuracy of fast carried-verify
variants at the bench shape (B=128, HV=32, K=V=128, T=4). Usage:
  python scripts/exp_verify_variants.py dot:64:4:ieee dot:64:8:tf32x3 ...
Prints one line per variant: kernel us (profiler), wall us per round, ratio to the decode
kernel, and the relative L2 error of the outputs against the exact flavour."""
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax import decode as dec
from gdn_jax import verify as vf
from gdn_jax.bench import verify as bv
from gdn_jax.bench.common import kernel_times, time_jax
from pallas_kernels import gdn_verify as kv

import os
SMOKE = bool(os.environ.get("EXP_SMOKE"))      # tiny shapes in interpret mode (CPU check)
if SMOKE:
    bv.B, bv.HV, bv.HK, bv.K, bv.V = 4, 2, 1, 16, 16
B, T = bv.B, 4
HV, HK, K, V = bv.HV, bv.HK, bv.K, bv.V


def timed(round_fn, carry, consts, unroll=8):
    run, chain = bv._program(round_fn, unroll)
    args = (carry, consts)
    for _ in range(2):
        args = chain(jax.block_until_ready(run(*args)), args)
    copy = jax.tree.map(lambda x: x.copy(), args[0])
    times = kernel_times(run, copy, args[1], calls=3, chain=chain, per=unroll)
    wall = time_jax(run, *args, calls=10, repeats=5, chain=chain) / unroll
    return times, wall * 1e6


def main():
    variants = sys.argv[1:] or ["dot:64:4:ieee"]
    q, k, v, g, beta, pool, slots = bv._inputs(B, 1, B)
    qkv = jnp.concatenate([q[:, 0].reshape(B, -1), k[:, 0].reshape(B, -1), v[:, 0].reshape(B, -1)], 1)

    def decode_round(pool, c):
        qkv, g, beta, slots = c
        return dec.gdn_decode_pool(qkv, g, beta, pool, slots, num_k_heads=HK, num_v_heads=HV,
                                   head_k_dim=K, head_v_dim=V, use_qk_l2norm=True, impl="pallas", interpret=SMOKE)[1]

    times, wall = timed(decode_round, pool, (qkv, g[:, 0], beta[:, 0], slots))
    dk = max(times.values()) if times else wall
    print(f"decode: kernel {dk:.1f} us, round {wall:.1f} us", flush=True)

    q, k, v, g, beta, pool, slots = bv._inputs(B, T, B, seed=T)
    acc = jnp.full((B,), T, jnp.int32)
    stash0 = lambda: vf.DeltaStash.init(B, num_v_heads=HV, head_k_dim=K, head_v_dim=V)
    # accuracy: two rounds (the second folds 4 pending rows) against the exact flavour
    def two_rounds(exact, block):
        p, st, outs = jnp.array(pool, copy=True), stash0(), []
        for r in range(2):
            o, p, st = vf.carried_verify(q, k, v, g, beta, p, st, slots, exact=exact, use_qk_l2norm=True,
                                         impl="pallas", block_sizes=block, interpret=SMOKE)
            st, _ = vf.accept(st, slots, acc)
            outs.append(np.asarray(o, np.float64))
        p, _ = vf.flush(p, st, slots, impl="pallas", interpret=SMOKE)
        return np.stack(outs), np.asarray(p, np.float64)
    want = two_rounds(True, None)

    def carried_round(carry, c, block):
        p, st = carry
        o, p, st = vf.carried_verify(*c[:5], p, st, c[5], exact=False, use_qk_l2norm=True,
                                     impl="pallas", block_sizes=block, interpret=SMOKE)
        return p, vf.accept(st, c[5], c[6])[0]

    rows = []
    for spec in variants:
        proj, bvv, w, prec, *extra = spec.split(":")
        fold = extra[0] if extra else "rows"
        evict = len(extra) > 1 and extra[1] == "evict"
        block = kv.VerifyBlockSizes(int(bvv), int(w), proj=proj, dot_precision=prec, fold=fold,
                                    evict_first=evict, wy_in_kernel="prelude" not in extra,
                                    k_rows_per_key_head="kperhk" in extra)
        try:
            got = two_rounds(False, block)
            rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))
            err = max(rel(got[0], want[0]), rel(got[1], want[1]))
            times, wall = timed(functools.partial(carried_round, block=block),
                                (jnp.array(pool, copy=True), stash0()), (q, k, v, g, beta, slots, acc))
            out_dir = os.environ.get("OUT")
            if out_dir and spec == variants[0]:     # the optimized HLO of one round, to read offline
                one = jax.jit(functools.partial(carried_round, block=block))
                txt = one.lower((pool, stash0()), (q, k, v, g, beta, slots, acc)).compile().as_text()
                with open(os.path.join(out_dir, "round_hlo.txt"), "w") as f:
                    f.write(txt)
            kern = max(times.values()) if times else wall
            other = sum(times.values()) - kern
            rows.append((spec, kern, other, wall, kern / dk, err))
            print(f"{spec:22s} kernel {kern:7.1f} us ({kern / dk:.3f}x)  other {other:5.1f}  wall {wall:7.1f}  err {err:.2e}",
                  flush=True)
            print("    others: " + ", ".join(f"{n[:28]} {us:.2f}" for n, us in list(times.items())[1:]),
                  flush=True)
        except Exception as e:
            print(f"{spec}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
    print("\n| variant | kernel us | x decode kernel | other us | round us | err vs exact (bf16 o, fp32 pool) |")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.1f} | {r[4]:.3f} | {r[2]:.1f} | {r[3]:.1f} | {r[5]:.2e} |")


if __name__ == "__main__":
    main()
