"""Builds the notebooks in this folder from the cell lists below and executes them in-process
(no Jupyter kernel needed): each code cell runs in one shared namespace; its printed output and
any matplotlib figure it draws are stored in the notebook (nbformat 4.5, with cell ids).

    .venv/bin/python notebooks/build_notebooks.py            # rebuild both notebooks
    .venv/bin/python notebooks/build_notebooks.py 02         # only those whose name has "02"

tests/test_notebooks.py runs the code cells of the committed notebooks on a CPU.
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import sys

import nbformat

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))   # this checkout's gdn_jax, not another installed copy

REFERENCES = [
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
             "print(f'outputs {rel(o_chk, o_ref):.2e}   final state {rel(s_chk, s_ref):.2e}')\n"
             "assert rel(o_chk, o_ref) < 1e-5 and rel(s_chk, s_ref) < 1e-5"),
    ("md", "Prefill 120 tokens, then decode the last 10 one at a time from the carried state:"),
    ("code", "o_pre, S = gdn_jax.gated_delta_rule(*(x[:, :120] for x in (q, k, v, g, beta)), impl='chunked', **kw)\n"
             "step = jax.jit(lambda *a: gdn_jax.decode_step(*a, use_qk_l2norm=True), donate_argnums=5)\n"
             "outs = []\n"
             "for t in range(120, T):\n"
             "    o_t, S = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S)\n"
             "    outs.append(o_t)\n"
             "print(f'decode outputs {rel(jnp.stack(outs, 1), o_ref[:, 120:]):.2e}   state {rel(S, s_ref):.2e}')\n"
             "assert rel(S, s_ref) < 1e-5"),
    ("md", "A speculative verify of 3 tokens keeps the state after each one; committing 2 accepted "
           "tokens means keeping `states[:, 1]`:"),
    ("code", "_, S0 = gdn_jax.gated_delta_rule(*(x[:, :127] for x in (q, k, v, g, beta)), **kw)\n"
             "o_k, states = gdn_jax.verify_steps(*(x[:, 127:130] for x in (q, k, v, g, beta)), S0, use_qk_l2norm=True)\n"
             "_, s_129 = gdn_jax.gated_delta_rule(*(x[:, :129] for x in (q, k, v, g, beta)), **kw)\n"
             "print(states.shape, f'state after 2 accepted tokens vs prefill of 129: {rel(states[:, 1], s_129):.2e}')\n"
             "assert rel(states[:, 1], s_129) < 1e-5"),
]

BLOCK = [
    ("md", "# A block from a checkpoint: prefill, decode, speculative verify, kernel check, benchmarks\n\n"
           "Loads one Gated DeltaNet layer from a Hugging Face checkpoint folder (`config.json` + "
           "`*.safetensors`). To stay self-contained this notebook writes a tiny random Qwen3-Next "
           "checkpoint first (the same as `gdn-jax demo --make-checkpoint DIR`); point `path` and "
           "`layer` at a real model folder to run it on real weights. Everything runs on a CPU "
           "(the Pallas kernels in interpret mode) and unchanged on a GPU."),
    ("code", "import tempfile\n"
             "import jax, jax.numpy as jnp, numpy as np\n"
             "import gdn_jax\n"
             "from gdn_jax.demo import make_checkpoint\n"
             "from gdn_jax.layers import Qwen3NextGatedDeltaNet\n\n"
             "path, layer = make_checkpoint(tempfile.mkdtemp()), 0\n"
             "block = Qwen3NextGatedDeltaNet.from_pretrained(path, layer_idx=layer)\n"
             "c = block.config\n"
             "rel = lambda a, b: float(jnp.linalg.norm(jnp.asarray(a, jnp.float32) - b) / jnp.linalg.norm(b))\n"
             "print(c)"),
    ("md", "## Prefill, then decode\n\nPrefill 32 tokens from a fresh state (`impl='auto'`: the chunk "
           "form), then feed 4 tokens one at a time; compare with one pass of the token-serial "
           "reference over all 36."),
    ("code", "B, T, P = 2, 36, 32\n"
             "x = jax.random.normal(jax.random.PRNGKey(0), (B, T, c.hidden_size))\n"
             "y_all, s_all = block(x, impl='reference')\n"
             "y_pre, state = block(x[:, :P])\n"
             "ys = [y_pre]\n"
             "for t in range(P, T):\n"
             "    y_t, state = block(x[:, t:t + 1], state)\n"
             "    ys.append(y_t)\n"
             "y_steps = jnp.concatenate(ys, axis=1)\n"
             "print(f'outputs vs one pass {rel(y_steps, y_all):.2e}, state {rel(state.recurrent, s_all.recurrent):.2e}')\n"
             "assert rel(y_steps, y_all) < 1e-5"),
    ("md", "## Speculative verify\n\nThe serving state lives in a pool of slots. After the prefill, "
           "a draft of 3 tokens is verified in one call (the carried-state verify: the state is "
           "written once, the 3 tokens' rows are stashed); the verdict accepts 2 of them; a plain "
           "decode step follows. The outputs must match feeding the same tokens one by one."),
    ("code", "slots = jnp.arange(B, dtype=jnp.int32)\n"
             "serving = block.init_serving_state(B)                             # a pool of B slots\n"
             "y_pre, serving = block.prefill(x[:, :P], serving, slots, fresh=True)\n"
             "y_draft, serving, refused = block.verify(x[:, P:P + 3], serving, slots)  # 3 draft tokens\n"
             "serving, invalid = block.accept(serving, slots, jnp.full((B,), 2, jnp.int32))  # keep 2\n"
             "y_next, serving = block.decode(x[:, P + 2:P + 3], serving, slots)  # the next token\n"
             "assert not refused.any() and not invalid.any()\n"
             "print(f'draft outputs vs one pass {rel(y_draft, y_all[:, P:P + 3]):.2e}; '\n"
             "      f'decode after accepting 2 {rel(y_next, y_all[:, P + 2:P + 3]):.2e}')\n"
             "assert rel(y_draft, y_all[:, P:P + 3]) < 1e-4 and rel(y_next, y_all[:, P + 2:P + 3]) < 1e-4"),
    ("md", "## Kernels against the references\n\n`gdn_jax.check.run_check` is `gdn-jax check` as a "
           "function: each implementation of each operation against a float64 oracle (interpret "
           "mode on a CPU, compiled on a GPU). `run_check(..., checkpoint=path, layer=layer)` adds "
           "the block against its reference composition."),
    ("code", "from gdn_jax.check import Shapes, format_table, run_check\n\n"
             "rows = run_check(Shapes(batch=2, seq_len=20, head_k_dim=32, head_v_dim=32),\n"
             "                 dtypes=['float32'], ops=['decode', 'decode_pool', 'verify'], progress=None)\n"
             "print(format_table(rows))\n"
             "assert not [r for r in rows if r.status == 'FAIL']"),
    ("md", "## Benchmark results\n\nOn a GPU, `gdn-jax bench decode --json decode.json` writes every "
           "number; this cell plots such a file (bandwidth against batch size, the peer alongside). "
           "Without one it makes a tiny CPU run (`--smoke`: interpret mode, so the numbers only "
           "show the plumbing)."),
    ("code", "import json, os\n"
             "import matplotlib\n"
             "matplotlib.use('Agg')\n"
             "import matplotlib.pyplot as plt\n"
             "from gdn_jax.bench import kda as bench_kda\n\n"
             "results = 'decode.json'                   # written by `gdn-jax bench decode --json decode.json`\n"
             "if not os.path.exists(results):\n"
             "    results = os.path.join(tempfile.mkdtemp(), 'kda.json')\n"
             "    bench_kda.main(['--smoke', '--json', results])\n"
             "data = json.load(open(results))\n"
             "rows = [r for r in data['rows'] if r.get('GBps')]\n"
             "fig, ax = plt.subplots(figsize=(5, 3))\n"
             "for who in sorted({r.get('who', 'ours ' + r.get('state', '')) for r in rows}):\n"
             "    pts = sorted((r['B'], r['GBps']) for r in rows if r.get('who', 'ours ' + r.get('state', '')) == who)\n"
             "    ax.plot(*zip(*pts), marker='o', label=who)\n"
             "ax.axhline(data['meta']['copy_GBps'], ls='--', color='gray', label='copy bandwidth (measured)')\n"
             "ax.set_xlabel('batch size B'); ax.set_ylabel('GB/s'); ax.legend(fontsize=7)\n"
             "ax.set_title(data['meta']['device'] + (' (smoke run)' if data['meta']['smoke'] else ''), fontsize=9)\n"
             "plt.show()"),
]

NOTEBOOKS = {"01_references.ipynb": REFERENCES, "02_block_checkpoint.ipynb": BLOCK}


def _figures() -> list:
    """The open matplotlib figures as display_data outputs (PNG), then closed."""
    if "matplotlib.pyplot" not in sys.modules:
        return []
    import matplotlib.pyplot as plt
    outs = []
    for num in plt.get_fignums():
        buf = io.BytesIO()
        plt.figure(num).savefig(buf, format="png", dpi=80)
        outs.append(nbformat.v4.new_output("display_data", data={
            "image/png": base64.b64encode(buf.getvalue()).decode("ascii"), "text/plain": "<Figure>"}))
    plt.close("all")
    return outs


def build(path: str, cells) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                   "language_info": {"name": "python"}}
    ns: dict = {"__name__": "__main__"}
    count = 0
    cwd = os.getcwd()
    with tempfile_dir() as work:
        os.chdir(work)
        try:
            for kind, src in cells:
                if kind == "md":
                    nb.cells.append(nbformat.v4.new_markdown_cell(src))
                    continue
                count += 1
                buf = io.StringIO()
                with contextlib.redirect_stdout(buf):
                    exec(compile(src, f"<{os.path.basename(path)} cell {count}>", "exec"), ns)
                outputs = []
                if buf.getvalue():
                    outputs.append(nbformat.v4.new_output("stream", name="stdout", text=buf.getvalue()))
                outputs += _figures()
                nb.cells.append(nbformat.v4.new_code_cell(src, execution_count=count, outputs=outputs))
        finally:
            os.chdir(cwd)
    nbformat.validate(nb)
    nbformat.write(nb, path)


@contextlib.contextmanager
def tempfile_dir():
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        yield d


if __name__ == "__main__":
    which = sys.argv[1:]
    for name, cells in NOTEBOOKS.items():
        if which and not any(w in name for w in which):
            continue
        build(os.path.join(HERE, name), cells)
        print("wrote", os.path.join(HERE, name))
