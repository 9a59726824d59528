"""Qwen3NextGatedDeltaNet against HF transformers' Qwen3NextGatedDeltaNet (golden files written by
tests/golden/make_golden.py; no torch needed here), plus Qwen3.5 split projections, sharded
loading, state conversion and input validation.

Every block call goes through one jitted apply (compiled once per block and shape) to keep the
CPU run short."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from helpers import rel_err, run_block as run
from gdn_jax.layers import GDNConfig, Qwen3NextGatedDeltaNet
from gdn_jax.state import GDNState

GOLDEN_DIR = os.path.join(os.path.dirname(__file__), "golden")
CKPT = os.path.join(GOLDEN_DIR, "qwen3_next")
LAYER = 1
PREFIX = f"model.layers.{LAYER}.linear_attn."
TOL = 1e-5


@pytest.fixture(scope="module")
def golden():
    return load_file(os.path.join(GOLDEN_DIR, "qwen3_next_golden.safetensors"))


@pytest.fixture(scope="module")
def block():
    return Qwen3NextGatedDeltaNet.from_pretrained(CKPT, LAYER)


def _copy_ckpt(tmp_path, edit_tensors=None, edit_config=None, name="ckpt"):
    """A copy of the golden checkpoint with tensors and/or config.json edited."""
    out = tmp_path / name
    out.mkdir()
    tensors = load_file(os.path.join(CKPT, "model.safetensors"))
    if edit_tensors:
        tensors = edit_tensors(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    with open(os.path.join(CKPT, "config.json")) as f:
        cfg = json.load(f)
    if edit_config:
        cfg = edit_config(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


# ------------------------------------------------------------------ loading

def test_from_pretrained_reads_config_and_weights(block):
    c = block.config
    assert (c.hidden_size, c.num_k_heads, c.num_v_heads, c.head_k_dim, c.head_v_dim) == (64, 2, 4, 16, 32)
    assert (c.conv_kernel_size, c.rms_norm_eps, c.layout) == (4, 1e-5, "fused")
    raw = load_file(os.path.join(CKPT, "model.safetensors"))
    np.testing.assert_array_equal(np.asarray(block.in_proj_qkvz.weight[...]), raw[PREFIX + "in_proj_qkvz.weight"])
    np.testing.assert_array_equal(np.asarray(block.conv1d.weight[...]), raw[PREFIX + "conv1d.weight"][:, 0])
    np.testing.assert_array_equal(np.asarray(block.norm.weight[...]), raw[PREFIX + "norm.weight"])


def test_sharded_checkpoint_loads_the_same(tmp_path, block):
    tensors = load_file(os.path.join(CKPT, "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    out = tmp_path / "sharded"
    out.mkdir()
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(out / file))
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    shutil.copy(os.path.join(CKPT, "config.json"), out / "config.json")
    sharded = Qwen3NextGatedDeltaNet.from_pretrained(str(out), LAYER)
    for (p1, v1), (p2, v2) in zip(nnx.to_flat_state(nnx.state(block)), nnx.to_flat_state(nnx.state(sharded))):
        assert p1 == p2
        np.testing.assert_array_equal(np.asarray(v1.get_value()), np.asarray(v2.get_value()))


# ------------------------------------------------------------------ HF parity

@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_full_sequence_matches_hf(block, golden, impl):
    x = jnp.asarray(golden["x"])
    y, state = run(block, x, block.init_state(x.shape[0]), impl=impl)
    assert y.shape == x.shape and y.dtype == jnp.float32
    assert rel_err(y, golden["full.y"]) <= TOL


@pytest.mark.parametrize("case", ["cache_a", "cache_b"])
def test_prefill_then_decode_matches_hf_cache_path(block, golden, case):
    """Segments as HF ran them with its cache (prefill, multi-token continuation, single-token
    decodes): outputs, states after the prefill and final states all match, and the outputs equal
    the full-sequence pass."""
    x = jnp.asarray(golden["x"])
    state, ys, t0 = block.init_state(x.shape[0]), [], 0
    for i, n in enumerate(golden[f"{case}.segments"].tolist()):
        y, state = run(block, x[:, t0:t0 + n], state)
        ys.append(y)
        t0 += n
        if i == 0:
            conv_hf, rec_hf = Qwen3NextGatedDeltaNet.state_to_hf(state)
            # HF's oldest conv column is never read again; ours is zero (see state_to_hf).
            assert rel_err(conv_hf[..., 1:], golden[f"{case}.conv_after_prefill"][..., 1:]) <= TOL
            assert rel_err(rec_hf, golden[f"{case}.recurrent_after_prefill"]) <= TOL
    y = jnp.concatenate(ys, axis=1)
    assert rel_err(y, golden[f"{case}.y"]) <= TOL
    assert rel_err(y, golden["full.y"][:, :t0]) <= TOL
    conv_hf, rec_hf = Qwen3NextGatedDeltaNet.state_to_hf(state)
    assert conv_hf.shape == golden[f"{case}.conv_final"].shape
    assert rel_err(conv_hf[..., 1:], golden[f"{case}.conv_final"][..., 1:]) <= TOL
    assert rel_err(rec_hf, golden[f"{case}.recurrent_final"]) <= TOL


def test_continues_from_an_hf_cache_state(block, golden):
    """state_from_hf turns HF's cache tensors into a GDNState that continues HF's sequence."""
    x = jnp.asarray(golden["x"])
    state = Qwen3NextGatedDeltaNet.state_from_hf(golden["cache_a.conv_after_prefill"],
                                                 golden["cache_a.recurrent_after_prefill"])
    segs = golden["cache_a.segments"].tolist()
    t0, ys = segs[0], []
    for n in segs[1:]:
        y, state = run(block, x[:, t0:t0 + n], state)
        ys.append(y)
        t0 += n
    assert rel_err(jnp.concatenate(ys, axis=1), golden["cache_a.y"][:, segs[0]:]) <= TOL
    assert rel_err(state.recurrent, golden["cache_a.recurrent_final"]) <= TOL


def test_state_none_is_a_fresh_state(block, golden):
    x = jnp.asarray(golden["x"][:, :7])
    y_none, s_none = run(block, x, None)
    y_zero, s_zero = run(block, x, block.init_state(2))   # the compile the cache test made
    assert rel_err(y_none, y_zero) <= TOL and rel_err(s_none.recurrent, s_zero.recurrent) <= TOL
    assert s_none.conv.shape == s_zero.conv.shape and s_none.conv.dtype == s_zero.conv.dtype


def _to_qwen35(tensors, cfg_block):
    """De-interleave the fused Qwen3-Next projections into Qwen3.5's split ones (numpy, rows)."""
    hk, hv, kd, vd = cfg_block.num_k_heads, cfg_block.num_v_heads, cfg_block.head_k_dim, cfg_block.head_v_dim
    r = hv // hk
    out = {}
    for name, t in tensors.items():
        rest = name[len(PREFIX):]
        new_prefix = f"model.language_model.layers.{LAYER}.linear_attn."
        if rest == "in_proj_qkvz.weight":
            g = t.reshape(hk, 2 * kd + 2 * r * vd, -1)
            q, k = g[:, :kd], g[:, kd:2 * kd]
            v, z = g[:, 2 * kd:2 * kd + r * vd], g[:, 2 * kd + r * vd:]
            flat = lambda a: a.reshape(-1, a.shape[-1])
            out[new_prefix + "in_proj_qkv.weight"] = np.concatenate([flat(q), flat(k), flat(v)])
            out[new_prefix + "in_proj_z.weight"] = flat(z)
        elif rest == "in_proj_ba.weight":
            g = t.reshape(hk, 2 * r, -1)
            out[new_prefix + "in_proj_b.weight"] = g[:, :r].reshape(hv, -1)
            out[new_prefix + "in_proj_a.weight"] = g[:, r:].reshape(hv, -1)
        else:
            out[new_prefix + rest] = t
    return out


def test_qwen35_split_projections_match_hf(tmp_path, block, golden):
    """A Qwen3.5-style checkpoint (text_config nesting, model.language_model prefix, split
    in_proj_qkv / in_proj_z / in_proj_b / in_proj_a) holding the same layer computes HF's output."""
    path = _copy_ckpt(tmp_path, edit_tensors=lambda t: _to_qwen35(t, block.config),
                      edit_config=lambda c: {"model_type": "qwen3_5", "text_config": c})
    split = Qwen3NextGatedDeltaNet.from_pretrained(path, LAYER)
    assert split.config.layout == "split"
    x = jnp.asarray(golden["x"][:, :12])
    y, _ = run(split, x, split.init_state(2), impl="reference")
    assert rel_err(y, golden["full.y"][:, :12]) <= TOL


def test_bf16_input_and_16bit_state(block, golden):
    """bf16 activations and a bf16 recurrent state: dtypes are kept, values stay near fp32."""
    x = jnp.asarray(golden["x"][:, :7])
    state = block.init_state(2, dtype=jnp.bfloat16, conv_dtype=jnp.bfloat16)
    y, new = run(block, x.astype(jnp.bfloat16), state)
    assert y.dtype == jnp.bfloat16 and new.recurrent.dtype == jnp.bfloat16 and new.conv.dtype == jnp.bfloat16
    assert rel_err(y, golden["full.y"][:, :7]) <= 3e-2


# ------------------------------------------------------------------ validation

@pytest.mark.parametrize("kwargs, word", [
    (dict(num_k_heads=3), "num_v_heads"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(head_k_dim=-2), "head_k_dim"),
    (dict(conv_kernel_size=0), "conv_kernel_size"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps"),
    (dict(layout="interleaved"), "layout"),
])
def test_config_validation(kwargs, word):
    base = dict(hidden_size=64, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=32)
    with pytest.raises(ValueError, match=word):
        GDNConfig(**{**base, **kwargs})


@pytest.mark.parametrize("layer_idx, word", [(0, "full_attention"), (2, "out of range"), (-1, "layer_idx")])
def test_from_pretrained_refuses_non_gdn_layers(layer_idx, word):
    with pytest.raises(ValueError, match=word):
        Qwen3NextGatedDeltaNet.from_pretrained(CKPT, layer_idx)


def _drop(name):
    return lambda t: {k: v for k, v in t.items() if k != PREFIX + name}


def _set(name, value):
    return lambda t: {**t, PREFIX + name: value}


@pytest.mark.parametrize("edit_tensors, edit_config, word", [
    (_drop("out_proj.weight"), None, "out_proj.weight"),
    (_drop("A_log"), None, "A_log"),
    (_set("A_log", np.zeros(5, np.float32)), None, "A_log"),
    (_set("in_proj_ba.weight", np.zeros((8, 63), np.float32)), None, "in_proj_ba.weight"),
    (_set("conv1d.weight", np.zeros((192, 4), np.float32)), None, "conv1d.weight"),
    (_set("extra_proj.weight", np.zeros((2, 2), np.float32)), None, "extra_proj.weight"),
    (_set("A_log", np.zeros(4, np.int32)), None, "A_log"),
    (_drop("in_proj_qkvz.weight"), None, "in_proj_qkvz"),
    (None, lambda c: {**c, "linear_num_value_heads": 3}, "num_v_heads"),
    (None, lambda c: {**c, "linear_value_head_dim": 16}, "shape"),
    (None, lambda c: {k: v for k, v in c.items() if k != "linear_num_key_heads"}, "linear_num_key_heads"),
    (None, lambda c: {**c, "hidden_act": "gelu"}, "hidden_act"),
])
def test_from_pretrained_refuses_bad_checkpoints(tmp_path, edit_tensors, edit_config, word):
    path = _copy_ckpt(tmp_path, edit_tensors, edit_config)
    with pytest.raises(ValueError, match=word):
        Qwen3NextGatedDeltaNet.from_pretrained(path, LAYER)


def test_call_validation(block):
    x = jnp.ones((2, 3, 64), jnp.float32)
    with pytest.raises(ValueError, match="x must"):
        block(jnp.ones((2, 3, 63)))
    with pytest.raises(ValueError, match="x must"):
        block(jnp.ones((2, 64)))
    with pytest.raises(ValueError, match="x must"):
        block(jnp.ones((2, 3, 64), jnp.int32))
    with pytest.raises(ValueError, match="impl"):
        block(x, impl="triton")
    good = block.init_state(2)
    with pytest.raises(ValueError, match="state.recurrent"):
        block(x, block.init_state(3))
    with pytest.raises(ValueError, match="state.conv"):
        block(x, GDNState(recurrent=good.recurrent, conv=jnp.zeros((2, 4, 192))))
    with pytest.raises(ValueError, match="state must"):
        block(x, (good.recurrent, good.conv))
    with pytest.raises(ValueError, match="batch_size"):
        block.init_state(0)
    with pytest.raises(ValueError, match="dtype"):
        block.init_state(2, dtype=jnp.int32)


def test_hf_state_conversion_round_trip(block):
    s = block.init_state(2)
    rng = np.random.default_rng(0)
    s = GDNState(recurrent=jnp.asarray(rng.standard_normal(s.recurrent.shape, np.float32)),
                 conv=jnp.asarray(rng.standard_normal(s.conv.shape, np.float32)))
    conv_hf, rec_hf = Qwen3NextGatedDeltaNet.state_to_hf(s)
    assert conv_hf.shape == (2, 192, 4)
    back = Qwen3NextGatedDeltaNet.state_from_hf(conv_hf, rec_hf)
    np.testing.assert_array_equal(np.asarray(back.conv), np.asarray(s.conv))
    np.testing.assert_array_equal(np.asarray(back.recurrent), np.asarray(s.recurrent))
    with pytest.raises(ValueError, match="conv_state"):
        Qwen3NextGatedDeltaNet.state_from_hf(conv_hf[0], rec_hf)


def test_random_init_block_runs():
    cfg = GDNConfig(hidden_size=32, num_k_heads=1, num_v_heads=2, head_k_dim=8, head_v_dim=8, layout="split")
    blk = Qwen3NextGatedDeltaNet(cfg, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 2, 32), np.float32))
    y, s = run(blk, x, None, impl="reference")
    assert y.shape == (1, 2, 32) and bool(jnp.all(jnp.isfinite(y)))
    assert s.recurrent.shape == (1, 2, 8, 8) and s.conv.shape == (1, 3, 2 * 8 + 16)
