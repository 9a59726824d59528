"""Builds the executed notebooks in this folder from the cell lists below (no Jupyter needed):
each code cell runs in one shared namespace and its printed output is stored in the notebook.

    .venv/bin/python notebooks/build_notebooks.py
"""

import contextlib
import io
import json
import os

CELLS = [
    ("md", "# gdn_jax: the references in five minutes\n\nThe pure-JAX references define what every "
           "kernel and block computes. This notebook runs a GDN prefill with both reference forms, "
           "continues with decode steps, and checks a K-token verify."),
    ("code", "import jax, jax.numpy as jnp, numpy as np\nimport gdn_jax\n"
             "B, T, HK, HV, D = 2, 130, 2, 4, 64\n"
             "ks = jax.random.split(jax.random.PRNGKey(0), 5)\n"
             "q = jax.random.normal(ks[0], (B, T, HK, D)); k = jax.random.normal(ks[1], (B, T, HK, D))\n"
             "v = jax.random.normal(ks[2], (B, T, HV, D))\n"
             "g = gdn_jax.gdn_gate(jax.random.normal(ks[3], (B, T, HV)), jnp.zeros(HV), jnp.zeros(HV))\n"
             "beta = gdn_jax.gdn_beta(jax.random.normal(ks[4], (B, T, HV)))\n"
             "print(q.shape, v.shape, g.dtype, float(g.max()) <= 0)"),
    ("md", "Token-serial scan and the WY/UT chunk form compute the same function:"),
    ("code", "kw = dict(use_qk_l2norm=True, output_final_state=True)\n"
             "o_ref, s_ref = gdn_jax.gated_delta_rule(q, k, v, g, beta, impl='reference', **kw)\n"
             "o_chk, s_chk = gdn_jax.gated_delta_rule(q, k, v, g, beta, impl='chunked', **kw)\n"
             "rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))\n"
             "print(f'outputs {rel(o_chk, o_ref):.2e}   final state {rel(s_chk, s_ref):.2e}')"),
    ("md", "Prefill 120 tokens, then decode the last 10 one at a time from the carried state:"),
    ("code", "o_pre, S = gdn_jax.gated_delta_rule(*(x[:, :120] for x in (q, k, v, g, beta)), impl='chunked', **kw)\n"
             "step = jax.jit(lambda *a: gdn_jax.decode_step(*a, use_qk_l2norm=True), donate_argnums=5)\n"
             "outs = []\n"
             "for t in range(120, T):\n"
             "    o_t, S = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S)\n"
             "    outs.append(o_t)\n"
             "print(f'decode outputs {rel(jnp.stack(outs, 1), o_ref[:, 120:]):.2e}   state {rel(S, s_ref):.2e}')"),
    ("md", "A speculative verify of 3 tokens keeps the state after each one; committing 2 accepted "
           "tokens means keeping `states[:, 1]`:"),
    ("code", "_, S0 = gdn_jax.gated_delta_rule(*(x[:, :127] for x in (q, k, v, g, beta)), **kw)\n"
             "o_k, states = gdn_jax.verify_steps(*(x[:, 127:130] for x in (q, k, v, g, beta)), S0, use_qk_l2norm=True)\n"
             "_, s_129 = gdn_jax.gated_delta_rule(*(x[:, :129] for x in (q, k, v, g, beta)), **kw)\n"
             "print(states.shape, f'state after 2 accepted tokens vs prefill of 129: {rel(states[:, 1], s_129):.2e}')"),
]


def build(path, cells):
    ns, nb_cells, count = {}, [], 0
    for kind, src in cells:
        if kind == "md":
            nb_cells.append({"cell_type": "markdown", "metadata": {}, "source": src.splitlines(True)})
            continue
        count += 1
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(compile(src, f"<cell {count}>", "exec"), ns)
        outputs = [{"output_type": "stream", "name": "stdout", "text": buf.getvalue().splitlines(True)}]
        nb_cells.append({"cell_type": "code", "execution_count": count, "metadata": {},
                         "outputs": outputs, "source": src.splitlines(True)})
    nb = {"cells": nb_cells, "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python",
                                                          "name": "python3"}},
          "nbformat": 4, "nbformat_minor": 5}
    with open(path, "w") as f:
        json.dump(nb, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    build(os.path.join(here, "01_references.ipynb"), CELLS)
    print("wrote", os.path.join(here, "01_references.ipynb"))
