"""`python -m gdn_jax demo`: a small prefill + decode through the references, printed as a table.

For GDN and KDA: prefill a prompt with the chunk form, continue with single-token decode steps
from the returned state, and check both against one token-serial pass over the whole sequence."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import gdn_jax


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _inputs(key, kind, B, T, HK, HV, D):
    ks = jax.random.split(key, 5)
    q = jax.random.normal(ks[0], (B, T, HK, D))
    k = jax.random.normal(ks[1], (B, T, HK, D))
    v = jax.random.normal(ks[2], (B, T, HV, D))
    if kind == "gdn":
        g = gdn_jax.gdn_gate(jax.random.normal(ks[3], (B, T, HV)), jnp.zeros(HV), jnp.zeros(HV))
    else:
        g = gdn_jax.kda_gate(jax.random.normal(ks[3], (B, T, HV, D)), jnp.zeros(HV),
                             jnp.zeros((HV, D)), lower_bound=-5.0)
    beta = gdn_jax.gdn_beta(jax.random.normal(ks[4], (B, T, HV)))
    return q, k, v, g, beta


def main() -> int:
    B, prompt, steps, HK, HV, D = 2, 100, 8, 2, 4, 64
    print(f"gdn_jax {gdn_jax.__version__} on {jax.devices()[0].platform}: B={B}, prompt={prompt}, "
          f"decode steps={steps}, HK={HK}, HV={HV}, K=V={D}\n")
    rows = []
    for kind, fn in (("GDN", gdn_jax.gated_delta_rule), ("KDA", gdn_jax.kda)):
        q, k, v, g, beta = _inputs(jax.random.PRNGKey(0), kind.lower(), B, prompt + steps, HK, HV, D)
        kw = dict(use_qk_l2norm=True, output_final_state=True)
        o_full, s_full = fn(q, k, v, g, beta, impl="reference", **kw)
        t0 = time.perf_counter()
        o_pre, state = fn(*(x[:, :prompt] for x in (q, k, v, g, beta)), impl="chunked", **kw)
        jax.block_until_ready(state)
        t_pre = time.perf_counter() - t0
        step = jax.jit(lambda *a: gdn_jax.decode_step(*a, use_qk_l2norm=True), donate_argnums=5)
        outs = []
        t0 = time.perf_counter()
        for t in range(prompt, prompt + steps):
            o_t, state = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
            outs.append(o_t)
        jax.block_until_ready(state)
        t_dec = (time.perf_counter() - t0) / steps
        rows.append((kind, "prefill (chunked)", f"{prompt} tok", _rel(o_pre, o_full[:, :prompt]), t_pre * 1e3))
        rows.append((kind, "decode step", f"{steps} x 1 tok", _rel(jnp.stack(outs, 1), o_full[:, prompt:]),
                     t_dec * 1e3))
        rows.append((kind, "final state", "", _rel(state, s_full), float("nan")))
    print(f"{'layer':<6}{'what':<20}{'tokens':<12}{'rel err vs scan':>16}{'ms (incl. compile)':>20}")
    for kind, what, tok, err, ms in rows:
        print(f"{kind:<6}{what:<20}{tok:<12}{err:>16.2e}{'' if np.isnan(ms) else f'{ms:.2f}':>20}")
    ok = all(r[3] <= 1e-5 for r in rows)
    print("\nall paths agree with the token-serial reference to <= 1e-5:", "yes" if ok else "NO")
    return 0 if ok else 1
