"""`gdn-jax bench verify`: speculative verify vs the plain decode step on an H200.

B = 128 sequences in a pool of 128 slots (slot table = a permutation), HV = 32, HK = 16,
K = V = 128, fp32 state, bf16 q/k/v, T = 2 and 4 draft tokens. Timed, each as a jitted program
of `--unroll` chained rounds with the pool (and stash) donated, divided by the rounds:

  decode        the decode kernel on the pool (gdn_jax.decode.gdn_decode_pool, packed q|k|v)
  states        verify with intermediate states (T outputs, T states written) + commit_states
  carried-exact carried verify (fold pending rows, write H once, T outputs, stash) + accept,
                every row accepting all T tokens (the most rows to fold next round)
  carried-fast  the same with the WY-form outputs (the default and FAST_VARIANTS: block shapes)
  flush         folding T pending rows into H (what a decode that follows a verify pays)

Bytes per round: the state read + written once (+ the T states for `states`), plus the stash
rows, tokens and outputs; reported as achieved GB/s against the measured device copy rate.
Target: carried-exact <= 1.3x decode at T = 4 (no verdict on a --smoke run). The copy rate is
measured in the same run. Peers: none (no library offers a carried-state verify to compare).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Sequence

from gdn_jax.bench import common

B, HV, HK, K, V = 128, 32, 16, 128, 128
FAST_VARIANTS = ((64, 4), (32, 4))  # fast-flavour (block_v, num_warps) timed besides the default


def _inputs(b, t, slots_n, seed=0):
    import jax
    import jax.numpy as jnp
    ks = jax.random.split(jax.random.PRNGKey(seed), 7)
    nrm = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q = nrm(jax.random.normal(ks[0], (b, t, HK, K))).astype(jnp.bfloat16)
    k = nrm(jax.random.normal(ks[1], (b, t, HK, K))).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, t, HV, V)).astype(jnp.bfloat16)
    g = -jax.nn.softplus(jax.random.normal(ks[3], (b, t, HV)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, HV)))
    pool = 0.1 * jax.random.normal(ks[5], (slots_n, HV, K, V), jnp.float32)
    slots = jax.random.permutation(ks[6], slots_n)[:b].astype(jnp.int32)
    dev = jax.devices()[0]
    return tuple(jax.device_put(x, dev) for x in (q, k, v, g, beta, pool, slots))


def _program(round_fn, unroll):
    """`unroll` chained rounds in one jitted program, carry donated; and its chaining rule."""
    import jax

    @functools.partial(jax.jit, donate_argnums=(0,))
    def run(carry, consts):
        for _ in range(unroll):
            carry = round_fn(carry, consts)
        return carry

    return run, (lambda out, a: (out, a[1]))


def _time(round_fn, carry, consts, unroll, calls, repeats, profile=None):
    """Seconds per round. With `profile` (a label), also print the device time of each kernel
    per round (gdn_jax.bench.common.kernel_times)."""
    import jax
    from gdn_jax.bench.common import kernel_times, print_kernel_times, time_jax

    run, chain = _program(round_fn, unroll)
    args = (carry, consts)
    for _ in range(2):
        args = chain(jax.block_until_ready(run(*args)), args)
    if profile:                   # on a copy of the carry: the calls below donate theirs
        copy = jax.tree.map(lambda x: x.copy(), args[0])
        times = kernel_times(run, copy, args[1], calls=3, chain=chain, per=unroll)
    sec = time_jax(run, *args, calls=calls, repeats=repeats, chain=chain) / unroll
    if profile:
        print_kernel_times(profile, times, wall_us=sec * 1e6)
    return sec


def _check_exact(interp) -> bool:
    """One carried round (T = 4, every token accepted) and a flush against four launches of the
    decode kernel at the bench shape: outputs and pools must be bit-identical."""
    import jax.numpy as jnp
    import numpy as np
    from gdn_jax import decode as dec
    from gdn_jax import carry as cv, DeltaPool, DeltaStash
    T = 4
    q, k, v, g, beta, pool, slots = _inputs(B, T, B, seed=99)
    st = DeltaStash.init(B, num_v_heads=HV, num_k_heads=HK, head_k_dim=K, head_v_dim=V)
    o, pc, _ = cv.carried_verify(q, k, v, g, beta, DeltaPool(jnp.array(pool, copy=True), st), slots,
                                 use_qk_l2norm=True, impl="pallas", interpret=interp)
    pc, _ = cv.accept(pc, slots, jnp.full((B,), T, jnp.int32))
    pc = cv.flush(pc, slots, impl="pallas", interpret=interp).states
    pd, outs = jnp.array(pool, copy=True), []
    for t in range(T):
        qkv = jnp.concatenate([q[:, t].reshape(B, -1), k[:, t].reshape(B, -1), v[:, t].reshape(B, -1)], 1)
        od, pd = dec.gdn_decode_pool(qkv, g[:, t], beta[:, t], pd, slots, num_k_heads=HK,
                                     num_v_heads=HV, head_k_dim=K, head_v_dim=V, use_qk_l2norm=True,
                                     impl="pallas", interpret=interp)
        outs.append(od)
    return bool(np.array_equal(np.asarray(o), np.asarray(jnp.stack(outs, 1)))
                and np.array_equal(np.asarray(pc), np.asarray(pd)))


def build_parser() -> argparse.ArgumentParser:
    p = common.make_parser("verify", __doc__, batches="128", seq_lens="2,4",
                           dtype="bfloat16", peers="none")
    p.add_argument("--unroll", type=int, default=8, help="rounds chained in one jitted program")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--tokens", dest="seq_lens", type=common.int_list, help=argparse.SUPPRESS)  # = --seq-lens
    p.add_argument("--profile", action="store_true",
                   help="print each kernel's device time per round (JAX profiler trace)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """--batches takes one B (the pool holds B slots); --seq-lens are the draft widths T
    (T = 4, the target's width, is always timed)."""
    args = common.parse_here("verify", build_parser(), argv)
    if args is None:
        return 2
    if len(args.batches) != 1:
        print(f"gdn-jax bench verify: --batches takes one batch size, got {args.batches}")
        return 2
    if common.peer_list(args):
        print("[bench verify] --peers ignored: no peer offers a carried-state verify")
    args.tokens = ",".join(str(t) for t in args.seq_lens)
    import jax
    import jax.numpy as jnp
    from gdn_jax import decode as dec
    from gdn_jax import verify as vf, carry as cv, DeltaPool, DeltaStash
    from pallas_kernels import gdn_verify as kv

    global B, HV, HK, K, V
    B = args.batches[0]
    interp = args.smoke
    if args.smoke:
        B, HV, HK, K, V = 4, 2, 1, 16, 16
        args.unroll, args.calls, args.repeats = 1, 1, 1
    rep = common.Report("verify", args)
    S = B
    state_bytes = S * HV * K * V * 4
    rows = []        # (name, T, seconds, bytes)

    def add(name, t, sec, nbytes):
        rows.append((name, t, sec, nbytes))
        rep.add(path=name, T=t, us=sec * 1e6, GBps=nbytes / sec / 1e9, chained=True)
        rep.progress(f"{name:34s} T={t}  {sec * 1e6:9.1f} us  {nbytes / sec / 1e9:7.0f} GB/s")

    # ------------------------------------------------------------------ decode (T = 1)
    q, k, v, g, beta, pool, slots = _inputs(B, 1, S)
    qkv = jnp.concatenate([q[:, 0].reshape(B, -1), k[:, 0].reshape(B, -1), v[:, 0].reshape(B, -1)], 1)

    def decode_round(pool, c):
        qkv, g, beta, slots = c
        return dec.gdn_decode_pool(qkv, g, beta, pool, slots, num_k_heads=HK, num_v_heads=HV,
                                   head_k_dim=K, head_v_dim=V, use_qk_l2norm=True, impl="pallas",
                                   interpret=interp)[1]

    tok_bytes = lambda t: B * t * (2 * HK * K * 2 + HV * V * 2 + HV * 8 + HV * V * 2)
    prof = (lambda label: label) if args.profile else (lambda label: None)
    t_decode = _time(decode_round, pool, (qkv, g[:, 0], beta[:, 0], slots), args.unroll, args.calls,
                     args.repeats, profile=prof("decode"))
    add("decode (pool, packed)", 1, t_decode, 2 * state_bytes + tok_bytes(1))

    results = {}
    for T in sorted({int(t) for t in args.tokens.split(',')} | {4}):
        q, k, v, g, beta, pool, slots = _inputs(B, T, S, seed=T)
        toks = (q, k, v, g, beta, slots)
        accepted = jnp.full((B,), T, jnp.int32)

        def states_round(pool, c):
            q, k, v, g, beta, slots, acc = c
            o, states = vf.verify_states(q, k, v, g, beta, pool, slots, use_qk_l2norm=True,
                                         impl="pallas", interpret=interp)
            return vf.commit_states(pool, states, slots, acc)[0]

        sec = _time(states_round, jnp.array(pool, copy=True), (*toks, accepted), args.unroll, args.calls,
                    args.repeats, profile=prof(f"states T={T}"))
        add("states verify + commit", T, sec, (2 + T) * state_bytes + state_bytes + tok_bytes(T))
        results[("states", T)] = sec

        stash_rw = lambda t: B * t * (HK * K + HV * (V + 1)) * 2 * 4   # k rows per key head

        def carried_round(carry, c, exact=True, block=None, accept_impl="auto"):
            pool, stash = carry
            q, k, v, g, beta, slots, acc = c
            o, dp, _ = cv.carried_verify(q, k, v, g, beta, DeltaPool(pool, stash), slots, exact=exact,
                                         use_qk_l2norm=True, impl="pallas", interpret=interp,
                                         block_sizes=block)
            dp = cv.accept(dp, slots, acc, impl=accept_impl, interpret=interp)[0]
            return dp.states, dp.stash

        def fresh_carry():
            st = DeltaStash.init(S, num_v_heads=HV, num_k_heads=HK, head_k_dim=K, head_v_dim=V)
            return (jnp.array(pool, copy=True), st)

        sec = _time(carried_round, fresh_carry(), (*toks, accepted), args.unroll, args.calls,
                    args.repeats, profile=prof(f"carried exact T={T}"))
        add("carried verify exact + accept", T, sec, 2 * state_bytes + stash_rw(T) + tok_bytes(T))
        results[("exact", T)] = sec

        dflt = kv.default_block_sizes(B, V, jnp.float32, False)
        fast_blocks = [None] if args.smoke else [None] + [
            blk for blk in (kv.VerifyBlockSizes(bv, w) for bv, w in FAST_VARIANTS) if blk != dflt]
        best = None
        for blk in fast_blocks:
            fn = functools.partial(carried_round, exact=False, block=blk)
            name = lambda b: f"bv{b.block_v}w{b.num_warps}"
            label = f"default = {name(dflt)}" if blk is None else name(blk)
            try:
                sec = _time(fn, fresh_carry(), (*toks, accepted), args.unroll, args.calls,
                            args.repeats, profile=prof(f"carried fast [{label}] T={T}"))
            except Exception as e:  # a variant that fails to compile must not cost the run
                print(f"fast [{label}] T={T} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            add(f"carried verify fast + accept [{label}]", T, sec, 2 * state_bytes + stash_rw(T) + tok_bytes(T))
            best = sec if best is None else min(best, sec)
        results[("fast", T)] = best
        if not args.smoke:       # the same default round with accept's XLA ops instead of its kernel
            fn = functools.partial(carried_round, exact=False, accept_impl="reference")
            sec = _time(fn, fresh_carry(), (*toks, accepted), args.unroll, args.calls,
                        args.repeats, profile=prof(f"carried fast default, XLA accept T={T}"))
            add("carried verify fast + accept [default, accept in XLA ops]", T, sec,
                2 * state_bytes + stash_rw(T) + tok_bytes(T))

        # flush: T pending rows per slot folded into H (then nothing pending: re-arm each round)
        def flush_round(carry, c):
            pool, stash = carry
            slots, pend = c
            stash = dataclasses.replace(stash, pending=pend)
            dp = cv.flush(DeltaPool(pool, stash), slots, impl="pallas", interpret=interp)
            return dp.states, dp.stash

        pool_s, st = fresh_carry()
        st = dataclasses.replace(st, k=st.k + 0.01, u=st.u + 0.01, g=st.g - 0.01)
        sec = _time(flush_round, (pool_s, st), (slots, jnp.full((S,), T, jnp.int32)), args.unroll,
                    args.calls, args.repeats)
        add("flush (T pending rows)", T, sec, 2 * state_bytes + stash_rw(T) // 2)

    bitwise = _check_exact(interp)
    rep.progress(f"exact carried verify == 4 decode launches, bitwise at the bench shape: {bitwise}")
    copy = common.measure_copy_gbps(1 << 22 if args.smoke else 1 << 29, repeats=3)
    rep.meta.update(copy_GBps=copy, bitwise_exact=bitwise, shape=dict(B=B, HV=HV, HK=HK, K=K, V=V))
    lines = [f"{rep.meta['device']}, {rep.meta['date']}; B={B}, HV={HV}, HK={HK}, K=V={K}, fp32 state "
             f"in a pool of {S} slots, bf16 q/k/v; each time = one round in a jitted program of "
             f"{args.unroll} chained rounds (pool/stash donated), median of {args.repeats}x{args.calls} "
             f"calls. Device copy rate measured in this run: {copy:.0f} GB/s (read + write)."
             + (" SMOKE RUN (interpret mode, tiny shapes): times mean nothing, no target verdict."
                if args.smoke else ""), "",
             "| path | T | us / round | vs decode | achieved GB/s |", "|---|---|---|---|---|"]
    for name, t, sec, nb in rows:
        lines.append(f"| {name} | {t} | {sec * 1e6:.1f} | {sec / t_decode:.2f}x | {nb / sec / 1e9:.0f} |")
    r4 = results[("exact", 4)] / t_decode
    verdict = lambda r: "no verdict (smoke run)" if args.smoke else ("met" if r <= 1.3 else "NOT met")
    lines += ["", f"Carried verify (exact) at T=4: {r4:.2f}x the decode step "
              f"(target <= 1.3x: {verdict(r4)}); fast (best shape): "
              f"{results[('fast', 4)] / t_decode:.2f}x (target <= 1.3x: "
              f"{verdict(results[('fast', 4)] / t_decode)}); intermediate states: "
              f"{results[('states', 4)] / t_decode:.2f}x.",
              f"Exact flavour at this shape (T=4, all accepted, then a flush) vs 4 decode-kernel "
              f"launches: {'bit-identical' if bitwise else 'NOT bit-identical'} (outputs and pool)"
              + (" (interpret mode on a CPU: bitwise equality is a property of the compiled "
                 "kernels, not expected here)." if args.smoke else "."),
              "Bytes counted: state read + written once (intermediate: + T states written and the "
              "commit's copy), the stash rows read and written, tokens and outputs."]

    def plot(path):
        series: dict[str, list] = {}
        for r in rep.rows:
            if r["T"] > 1:
                series.setdefault(r["path"], []).append((r["T"], r["us"]))
        common.line_plot(path, series, xlabel="draft tokens T", ylabel="us per round",
                         title=f"GDN verify, B={B} HV={HV} K=V={K} ({rep.meta['device']})",
                         logx=False, hline=(t_decode * 1e6, "decode step (T = 1)"))

    return rep.finish("Speculative verify (GDN, carried vs intermediate states vs decode)",
                      "\n".join(lines), plot)
