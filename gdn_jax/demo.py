"""`gdn-jax demo`: a small tour that checks itself, printed as a table.

1. References: for GDN and KDA, prefill a prompt with the chunk form, continue with single-token
   decode steps from the returned state, and check both against one token-serial pass.
2. Kernels: the Pallas decode kernel (interpret mode on a CPU, compiled on a GPU) against the
   reference step.
3. A block from a checkpoint folder (`--checkpoint DIR --layer N`; without one, a tiny random
   Qwen3-Next checkpoint written to a temporary folder): prefill, then decode token by token,
   against one full pass.

`make_checkpoint(DIR)` (`gdn-jax demo --make-checkpoint DIR`) writes that tiny checkpoint:
`config.json` + `model.safetensors` in Hugging Face's Qwen3-Next naming, one linear-attention
layer (layer 0) with random weights, about 100 KB.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Sequence

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


TINY_CONFIG = {
    "model_type": "qwen3_next",
    "architectures": ["Qwen3NextForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 1,
    "layer_types": ["linear_attention"],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
}


def make_checkpoint(path: str | os.PathLike, *, seed: int = 0) -> str:
    """Write a tiny random Qwen3-Next checkpoint (one Gated DeltaNet layer, index 0) to `path`
    (created if missing): `config.json` and `model.safetensors` under HF's tensor names
    `model.layers.0.linear_attn.*`, fused projection layout. Returns the folder as a string."""
    from safetensors.numpy import save_file
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    c = TINY_CONFIG
    h, hk, hv = c["hidden_size"], c["linear_num_key_heads"], c["linear_num_value_heads"]
    kd, vd, w = c["linear_key_head_dim"], c["linear_value_head_dim"], c["linear_conv_kernel_dim"]
    key_dim, value_dim = hk * kd, hv * vd
    rng = np.random.default_rng(seed)
    normal = lambda shape, std: (std * rng.standard_normal(shape)).astype(np.float32)
    pre = "model.layers.0.linear_attn."
    tensors = {
        pre + "in_proj_qkvz.weight": normal((2 * key_dim + 2 * value_dim, h), h ** -0.5),
        pre + "in_proj_ba.weight": normal((2 * hv, h), h ** -0.5),
        pre + "conv1d.weight": normal((2 * key_dim + value_dim, 1, w), 0.5),
        pre + "dt_bias": normal((hv,), 0.5),
        pre + "A_log": np.log(rng.uniform(0.05, 1.0, hv)).astype(np.float32),
        pre + "norm.weight": (1.0 + normal((vd,), 0.3)).astype(np.float32),
        pre + "out_proj.weight": normal((h, value_dim), value_dim ** -0.5),
    }
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f, indent=1)
    return path


def _reference_rows(B, prompt, steps, HK, HV, D):
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
    return rows


def _kernel_rows(B, HK, HV, D):
    """The Pallas decode kernel (GDN and KDA gates) against the reference step."""
    from gdn_jax.decode import gdn_decode
    on_gpu = jax.default_backend() == "gpu"
    rows = []
    for kind in ("GDN", "KDA"):
        q, k, v, g, beta = _inputs(jax.random.PRNGKey(1), kind.lower(), B, 1, HK, HV, D)
        s0 = 0.1 * jax.random.normal(jax.random.PRNGKey(2), (B, HV, D, D))
        o_ref, s_ref = gdn_jax.decode_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s0,
                                           use_qk_l2norm=True)
        t0 = time.perf_counter()
        o, s = gdn_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], jnp.copy(s0),
                          use_qk_l2norm=True, impl="pallas", interpret=not on_gpu)
        jax.block_until_ready(s)
        mode = "compiled" if on_gpu else "interpret"
        rows.append((kind, f"decode kernel ({mode})", "1 tok", max(_rel(o, o_ref), _rel(s, s_ref)),
                     (time.perf_counter() - t0) * 1e3))
    return rows


def _block_rows(path, layer, B, prompt, steps):
    """Prefill `prompt` tokens, decode `steps` one at a time, against one full pass."""
    from gdn_jax.check import load_block
    block = load_block(path, layer)
    name = "block"
    x = jax.random.normal(jax.random.PRNGKey(3), (B, prompt + steps, block.config.hidden_size))
    y_full, s_full = block(x, impl="reference")
    t0 = time.perf_counter()
    y_pre, state = block(x[:, :prompt])
    jax.block_until_ready(state)
    t_pre = time.perf_counter() - t0
    outs = []
    t0 = time.perf_counter()
    for t in range(prompt, prompt + steps):
        y_t, state = block(x[:, t:t + 1], state)
        outs.append(y_t)
    jax.block_until_ready(state)
    t_dec = (time.perf_counter() - t0) / steps
    return type(block).__name__, [
        (name, "prefill", f"{prompt} tok", _rel(y_pre, y_full[:, :prompt]), t_pre * 1e3),
        (name, "decode step", f"{steps} x 1 tok", _rel(jnp.concatenate(outs, 1), y_full[:, prompt:]),
         t_dec * 1e3),
        (name, "final state", "", _rel(state.recurrent, s_full.recurrent), float("nan")),
    ]


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="gdn-jax demo")
    p.description = ("A small tour that checks itself: the references (prefill + decode vs one "
                     "token-serial pass), the Pallas decode kernel (interpret mode on a CPU), and a "
                     "block from a checkpoint folder (a tiny generated one by default).")
    p.add_argument("--checkpoint", metavar="DIR", default=None,
                   help="HF checkpoint folder whose block to run (default: a tiny random one)")
    p.add_argument("--layer", type=int, default=0, help="layer index in --checkpoint (default 0)")
    p.add_argument("--make-checkpoint", metavar="DIR", default=None,
                   help="only write the tiny random Qwen3-Next checkpoint to DIR and exit")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run(args)


def run(args: argparse.Namespace) -> int:
    if args.make_checkpoint:
        path = make_checkpoint(args.make_checkpoint)
        print(f"wrote a tiny Qwen3-Next checkpoint (one Gated DeltaNet layer, index 0) to {path}")
        return 0
    B, prompt, steps, HK, HV, D = 2, 100, 8, 2, 4, 64
    print(f"gdn_jax {gdn_jax.__version__} on {jax.devices()[0].platform}: B={B}, prompt={prompt}, "
          f"decode steps={steps}, HK={HK}, HV={HV}, K=V={D}\n", flush=True)
    rows = _reference_rows(B, prompt, steps, HK, HV, D)
    rows += _kernel_rows(B, HK, HV, D)
    with tempfile.TemporaryDirectory() as tmp:
        path, layer = (args.checkpoint, args.layer) if args.checkpoint else (make_checkpoint(tmp), 0)
        cls, block_rows = _block_rows(path, layer, B, 24, 4)
    rows += block_rows
    print(f"{'layer':<6}{'what':<26}{'tokens':<12}{'rel err vs scan':>16}{'ms (incl. compile)':>20}")
    for kind, what, tok, err, ms in rows:
        print(f"{kind:<6}{what:<26}{tok:<12}{err:>16.2e}{'' if np.isnan(ms) else f'{ms:.2f}':>20}")
    src = args.checkpoint or "a tiny random checkpoint"
    print(f"\nblock: {cls} layer {layer} of {src}")
    ok = all(r[3] <= 1e-5 for r in rows)
    print("all paths agree with the token-serial reference to <= 1e-5:", "yes" if ok else "NO")
    return 0 if ok else 1
