"""Write tiny random HF checkpoints and HF transformers' outputs on them, for torch-free parity tests.

Run with a Python that has torch + transformers + safetensors (not the repo venv), from anywhere:

    /root/.pyenv/versions/3.11.7/bin/python -m venv /tmp/hfvenv
    /tmp/hfvenv/bin/pip install torch==2.13.0 transformers safetensors
    /tmp/hfvenv/bin/python tests/golden/make_golden.py

It writes, next to this file:

  qwen3_next/{config.json, model.safetensors}   Qwen3-Next config (2 layers: full, linear) and
                                                layer 1's `linear_attn.*` tensors
  qwen3_next_golden.safetensors                 HF Qwen3NextGatedDeltaNet (layer 1) outputs:
                                                a full pass, and cache-path runs (prefill, multi-token
                                                continuation, single-token decodes) with HF's states
  kimi_linear/{config.json, model.safetensors}  Kimi Linear naming (q/k/v_conv1d, flat f_a_proj ...,
                                                A_log [1, 1, H, 1]), HF KimiLinearDeltaAttention outputs
  glm5_next/{config.json, model.safetensors}    GLM-5.3-Flash naming (one conv1d, forget_gate.*,
                                                A_log [H], lower bound), under model.language_model.
  kda_golden.safetensors                        outputs of both KDA modules

Everything is fp32 and the torch-only code paths run (the script refuses to run with the fla or
causal-conv1d packages importable, whose kernels HF would pick up instead). Keep the sizes small:
the generated files are committed.
"""

from __future__ import annotations

import importlib.util
import json
import os

import torch
from safetensors.torch import save_file

import transformers
from transformers import DynamicCache
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

HERE = os.path.dirname(os.path.abspath(__file__))
SEED = 20250925


def _require_torch_paths():
    for pkg in ("fla", "causal_conv1d"):
        if importlib.util.find_spec(pkg) is not None:
            raise SystemExit(f"{pkg} is importable: HF would use its kernels; run without it")


def _randomise(module: torch.nn.Module, gen: torch.Generator, *, norm_names=("norm.weight", "o_norm.weight")):
    """Unit-scale random weights (HF's init is too small to make a sensitive test): projections
    ~ N(0, 1/fan_in), conv ~ N(0, 1/4), decays moderate, norm weights around 1 (not all ones, so a
    block that ignored the stored weight would fail)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            leaf = name.split(".")[-1]
            if name in norm_names:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif leaf == "A_log":
                p.copy_(torch.log(torch.empty(p.shape).uniform_(0.05, 1.0, generator=gen)))
            elif leaf == "dt_bias":
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif "conv1d" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif leaf == "weight" and p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))


def _np(t):
    return t.detach().to(torch.float32).clone().contiguous()   # the cache updates in place: copy


def _cache_runs(module, config, x, segments, layer_idx, prefix_name, out):
    """Run `module` on consecutive segments of x with one HF cache (the first segment is the
    prefill; length-1 segments take HF's single-token decode path). Stores each segment's output
    and the cache's states after the first and the last segment."""
    cache = DynamicCache(config=config)
    t0, ys = 0, []
    for i, n in enumerate(segments):
        ys.append(module(x[:, t0:t0 + n], cache=cache))
        t0 += n
        if i == 0:
            out[f"{prefix_name}.conv_after_prefill"] = _np(cache.layers[layer_idx].conv_states[0])
            out[f"{prefix_name}.recurrent_after_prefill"] = _np(cache.layers[layer_idx].recurrent_states[0])
    out[f"{prefix_name}.y"] = _np(torch.cat(ys, dim=1))
    out[f"{prefix_name}.conv_final"] = _np(cache.layers[layer_idx].conv_states[0])
    out[f"{prefix_name}.recurrent_final"] = _np(cache.layers[layer_idx].recurrent_states[0])
    out[f"{prefix_name}.segments"] = torch.tensor(segments, dtype=torch.int32)


def make_qwen3_next():
    gen = torch.Generator().manual_seed(SEED)
    config = Qwen3NextConfig(
        hidden_size=64, num_hidden_layers=2, layer_types=["full_attention", "linear_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=32,
        linear_conv_kernel_dim=4, rms_norm_eps=1e-5, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        intermediate_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=2,
        num_experts_per_tok=1, vocab_size=32, dtype="float32")
    folder = os.path.join(HERE, "qwen3_next")
    os.makedirs(folder, exist_ok=True)
    config.save_pretrained(folder)
    layer_idx = 1
    m = Qwen3NextGatedDeltaNet(config, layer_idx).eval()
    _randomise(m, gen)
    tensors = {f"model.layers.{layer_idx}.linear_attn.{name}": _np(p) for name, p in m.state_dict().items()}
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})

    x = torch.randn(2, 72, config.hidden_size, generator=gen)
    out = {"x": x}
    with torch.no_grad():
        out["full.y"] = _np(m(x))                                  # chunked path, 2 chunks of 64
        _cache_runs(m, config, x, [7, 5, 1, 1, 1, 1], layer_idx, "cache_a", out)  # prefill, continue, decode
        _cache_runs(m, config, x, [2, 1, 1, 1], layer_idx, "cache_b", out)       # prefill shorter than W-1
    save_file(out, os.path.join(HERE, "qwen3_next_golden.safetensors"),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__,
                        "layer_idx": str(layer_idx)})


def _kda_config_common():
    return dict(hidden_size=64, num_hidden_layers=2, rms_norm_eps=1e-5, hidden_act="silu")


def make_kda(out):
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextLinearAttention

    gen = torch.Generator().manual_seed(SEED + 1)
    lac = {"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4, "kda_layers": [1, 2],
           "full_attn_layers": []}
    kimi_cfg = KimiLinearConfig(**_kda_config_common(), linear_attn_config=lac,
                                layer_types=["linear_attention"] * 2, vocab_size=32, dtype="float32")
    glm_cfg = Glm5NextTextConfig(**_kda_config_common(), linear_num_heads=4, linear_head_dim=16,
                                 linear_conv_kernel_dim=4, linear_lower_bound=-4.0,
                                 layer_types=["linear_attention"] * 2, vocab_size=32, dtype="float32")
    x = torch.randn(2, 20, 64, generator=gen)
    out["x"] = x
    layer_idx = 1
    for tag, cls, cfg in (("kimi", KimiLinearDeltaAttention, kimi_cfg),
                          ("glm", Glm5NextTextLinearAttention, glm_cfg)):
        m = cls(cfg, layer_idx).eval()
        _randomise(m, gen)
        with torch.no_grad():
            out[f"{tag}.full.y"] = _np(m(x))
            _cache_runs(m, cfg, x, [6, 4, 1, 1], layer_idx, f"{tag}.cache", out)
        sd = {k: _np(v) for k, v in m.state_dict().items()}
        if tag == "kimi":
            # Kimi Linear's own checkpoint names: per-projection convs and the forget gate's
            # tensors directly under self_attn (HF renames them on load; this undoes that).
            p = cfg.linear_num_heads * cfg.linear_head_dim
            conv = sd.pop("conv1d.weight")
            sd["q_conv1d.weight"], sd["k_conv1d.weight"], sd["v_conv1d.weight"] = (
                conv[:p].clone(), conv[p:2 * p].clone(), conv[2 * p:].clone())
            for n in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log"):
                sd[n] = sd.pop(f"forget_gate.{n}")
            prefix = f"model.layers.{layer_idx}.self_attn."
            config_json = {"model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
                           **_kda_config_common(), "linear_attn_config": lac}
        else:
            prefix = f"model.language_model.layers.{layer_idx}.self_attn."
            config_json = {"model_type": "glm5_next", "architectures": ["Glm5NextForConditionalGeneration"],
                           "text_config": {"model_type": "glm5_next_text", **_kda_config_common(),
                                           "linear_num_heads": 4, "linear_head_dim": 16,
                                           "linear_conv_kernel_dim": 4, "linear_lower_bound": -4.0,
                                           "layer_types": ["linear_attention"] * 2}}
        folder = os.path.join(HERE, {"kimi": "kimi_linear", "glm": "glm5_next"}[tag])
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config_json, f, indent=2)
        save_file({prefix + k: v for k, v in sd.items()}, os.path.join(folder, "model.safetensors"),
                  metadata={"format": "pt"})


def main():
    _require_torch_paths()
    torch.set_default_dtype(torch.float32)
    make_qwen3_next()
    kda_out = {}
    make_kda(kda_out)
    save_file(kda_out, os.path.join(HERE, "kda_golden.safetensors"),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__,
                        "layer_idx": "1"})
    print("wrote golden files to", HERE)


if __name__ == "__main__":
    main()
