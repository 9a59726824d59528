"""gdn_jax.loading: config.json reading, single / sharded / scanned safetensors folders, lazy shape
checks, dtype refusal, and no pickle."""

import json
import os
import re
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from gdn_jax.loading import SafetensorsCheckpoint, find_layer_prefix, read_config, text_config


def _folder(tmp_path, files, config=None, index=None):
    for name, tensors in files.items():
        save_file(tensors, str(tmp_path / name))
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    if index is not None:
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    return tmp_path


def test_single_file(tmp_path):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    _folder(tmp_path, {"model.safetensors": {"a": a, "b": np.ones(4, np.float16)}})
    ckpt = SafetensorsCheckpoint(tmp_path)
    assert sorted(ckpt.keys()) == ["a", "b"] and "a" in ckpt and "c" not in ckpt
    assert ckpt.shape("a") == (2, 3)
    np.testing.assert_array_equal(ckpt.get("a", shape=(2, 3)), a)
    assert ckpt.get("b").dtype == np.float16


def test_bf16_tensors_read_through_ml_dtypes(tmp_path):
    w = np.linspace(-1, 1, 8).astype(ml_dtypes.bfloat16)
    _folder(tmp_path, {"model.safetensors": {"w": w}})
    got = SafetensorsCheckpoint(tmp_path).get("w")
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got.astype(np.float32), w.astype(np.float32))


def test_sharded_with_index(tmp_path):
    _folder(tmp_path, {"s1.safetensors": {"a": np.ones(2, np.float32)}, "s2.safetensors": {"b": np.zeros(3, np.float32)}},
            index={"metadata": {}, "weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})
    ckpt = SafetensorsCheckpoint(tmp_path)
    assert ckpt.get("b").shape == (3,) and ckpt.get("a").sum() == 2


def test_scanned_folder_without_index(tmp_path):
    _folder(tmp_path, {"part-a.safetensors": {"a": np.ones(2, np.float32)},
                       "part-b.safetensors": {"b": np.ones(3, np.float32)}})
    assert sorted(SafetensorsCheckpoint(tmp_path).keys()) == ["a", "b"]


@pytest.mark.parametrize("index, word", [
    ({"weight_map": {"a": "missing.safetensors"}}, "missing"),
    ({"weight_map": {"a": "../outside.safetensors"}}, "same folder"),
    ({"weight_map": {}}, "weight_map"),
    ({"metadata": {}}, "weight_map"),
])
def test_bad_index(tmp_path, index, word):
    _folder(tmp_path, {"s1.safetensors": {"a": np.ones(2, np.float32)}}, index=index)
    with pytest.raises(ValueError, match=word):
        SafetensorsCheckpoint(tmp_path)


def test_shape_and_name_errors(tmp_path):
    _folder(tmp_path, {"model.safetensors": {"a": np.ones((2, 3), np.float32), "i": np.ones(2, np.int8)}})
    ckpt = SafetensorsCheckpoint(tmp_path)
    with pytest.raises(ValueError, match="'a' has shape"):
        ckpt.get("a", shape=(3, 2))
    with pytest.raises(ValueError, match="'nope' not found"):
        ckpt.get("nope")
    with pytest.raises(ValueError, match="'i' has dtype"):
        ckpt.get("i")


def test_pickle_checkpoints_are_not_read(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ValueError, match="pickle"):
        SafetensorsCheckpoint(tmp_path)


def test_not_a_folder(tmp_path):
    with pytest.raises(ValueError, match="path"):
        SafetensorsCheckpoint(tmp_path / "absent")
    with pytest.raises(ValueError, match="path"):
        read_config(tmp_path / "absent")


def test_read_config(tmp_path):
    with pytest.raises(ValueError, match="config.json not found"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert read_config(tmp_path) == {"hidden_size": 8}


def test_text_config_merges_nested_settings():
    cfg = {"model_type": "qwen3_5", "rms_norm_eps": 1e-6, "text_config": {"hidden_size": 8, "model_type": "qwen3_5_text"}}
    assert text_config(cfg) == {"model_type": "qwen3_5_text", "rms_norm_eps": 1e-6, "hidden_size": 8}
    assert text_config({"hidden_size": 4}) == {"hidden_size": 4}


def test_find_layer_prefix(tmp_path):
    _folder(tmp_path, {"model.safetensors": {"model.language_model.layers.3.linear_attn.A_log": np.ones(2, np.float32)}})
    ckpt = SafetensorsCheckpoint(tmp_path)
    assert find_layer_prefix(ckpt, 3, "linear_attn") == "model.language_model.layers.3.linear_attn."
    with pytest.raises(ValueError, match="layer_idx=4"):
        find_layer_prefix(ckpt, 4, "linear_attn")
    with pytest.raises(ValueError, match="layer_idx=3"):
        find_layer_prefix(ckpt, 3, "self_attn")


# ------------------------------------------------------------------ damaged files

def _valid_bytes(tmp_path):
    save_file({"a": np.arange(100, dtype=np.float32), "b": np.ones(3, np.float32)},
              str(tmp_path / "src.safetensors"))
    data = (tmp_path / "src.safetensors").read_bytes()
    (tmp_path / "src.safetensors").unlink()
    return data


def _with_header(data, edit):
    n = struct.unpack("<Q", data[:8])[0]
    header = edit(json.loads(data[8:8 + n]))
    hb = json.dumps(header).encode()
    return struct.pack("<Q", len(hb)) + hb + data[8 + n:]


def _offsets_past_end(h):
    h["a"]["data_offsets"] = [0, 10 ** 9]
    return h


DAMAGED = {
    "truncated": lambda d: d[:-50],
    "truncated_header": lambda d: d[:20],
    "shorter_than_length_field": lambda d: d[:4],
    "random_bytes": lambda d: bytes(np.random.default_rng(0).integers(0, 256, 300, np.uint8)),
    "header_declares_2**62_bytes": lambda d: struct.pack("<Q", 2 ** 62) + d[8:],
    "offsets_past_end": lambda d: _with_header(d, _offsets_past_end),
    "empty": lambda d: b"",
}


@pytest.mark.parametrize("damage", list(DAMAGED))
@pytest.mark.parametrize("layout", ["single", "scanned", "indexed"])
def test_damaged_safetensors_raise_value_error_naming_the_file(tmp_path, damage, layout):
    data = DAMAGED[damage](_valid_bytes(tmp_path))
    name = {"single": "model.safetensors", "scanned": "part-1.safetensors",
            "indexed": "model-00001-of-00001.safetensors"}[layout]
    (tmp_path / name).write_bytes(data)
    if layout == "indexed":
        (tmp_path / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"a": name, "b": name}}))
    with pytest.raises(ValueError, match=re.escape(repr(name))):
        ckpt = SafetensorsCheckpoint(tmp_path)
        ckpt.get("a")


@pytest.mark.parametrize("layout", ["single", "scanned", "indexed"])
@pytest.mark.parametrize("kind", ["directory", "symlink_loop", "dangling_symlink"])
def test_shard_names_that_are_not_files(tmp_path, layout, kind):
    name = {"single": "model.safetensors", "scanned": "part-1.safetensors",
            "indexed": "model-00001-of-00001.safetensors"}[layout]
    target = tmp_path / name
    if kind == "directory":
        target.mkdir()
    elif kind == "symlink_loop":
        os.symlink(name, target)
    else:
        os.symlink("nowhere.safetensors", target)
    if layout == "indexed":
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": name}}))
    with pytest.raises(ValueError, match=re.escape(repr(name))):
        SafetensorsCheckpoint(tmp_path).get("a")


def test_non_utf8_json_files(tmp_path):
    (tmp_path / "config.json").write_bytes(b'{"hidden_size": "\xff\xfe"}')
    with pytest.raises(ValueError, match="config.json.*UTF-8"):
        read_config(tmp_path)
    save_file({"a": np.ones(2, np.float32)}, str(tmp_path / "s1.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_bytes(b'{"weight_map": {"a": "\xff"}}')
    with pytest.raises(ValueError, match="index.json.*UTF-8"):
        SafetensorsCheckpoint(tmp_path)


def test_tensor_absent_from_its_indexed_shard(tmp_path):
    _folder(tmp_path, {"s1.safetensors": {"a": np.ones(2, np.float32)}},
            index={"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}})
    ckpt = SafetensorsCheckpoint(tmp_path)
    with pytest.raises(ValueError, match="'b' in 's1.safetensors'"):
        ckpt.get("b")
    with pytest.raises(ValueError, match="'b' in 's1.safetensors'"):
        ckpt.shape("b")


# ------------------------------------------------------------------ config values of the wrong type

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


def _golden_copy(tmp_path, folder, edit):
    out = tmp_path / folder
    shutil.copytree(os.path.join(GOLDEN, folder), out)
    cfg = json.loads((out / "config.json").read_text())
    edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _set(key, value, nested=None):
    def edit(cfg):
        target = cfg[nested] if nested else cfg
        target.pop("layer_types", None) if key == "full_attention_interval" else None
        target[key] = value
    return edit


@pytest.mark.parametrize("folder, edit, key", [
    ("qwen3_next", _set("full_attention_interval", 0), "full_attention_interval"),
    ("qwen3_next", _set("full_attention_interval", "x"), "full_attention_interval"),
    ("qwen3_next", _set("full_attention_interval", None), "full_attention_interval"),
    ("qwen3_next", _set("full_attention_interval", 2.5), "full_attention_interval"),
    ("qwen3_next", _set("layer_types", "linear_attention"), "layer_types"),
    ("qwen3_next", _set("layer_types", [1, 2]), "layer_types"),
    ("qwen3_next", _set("num_hidden_layers", "2"), "num_hidden_layers"),
    ("kimi_linear", _set("linear_attn_config", 5), "linear_attn_config"),
    ("kimi_linear", _set("linear_attn_config", "kda"), "linear_attn_config"),
    ("kimi_linear", _set("layer_types", "linear_attention"), "layer_types"),
    ("glm5_next", _set("layer_types", "linear_attention", nested="text_config"), "layer_types"),
    ("glm5_next", _set("linear_attn_config", 3, nested="text_config"), "linear_attn_config"),
])
def test_config_values_of_the_wrong_type(tmp_path, folder, edit, key):
    from gdn_jax.layers import KimiDeltaAttention, Qwen3NextGatedDeltaNet
    cls = Qwen3NextGatedDeltaNet if folder == "qwen3_next" else KimiDeltaAttention
    path = _golden_copy(tmp_path, folder, edit)
    with pytest.raises(ValueError, match=f"config.json: '{key}'"):
        cls.from_pretrained(path, 1)


def test_kda_layers_must_be_a_list_of_integers(tmp_path):
    from gdn_jax.layers import KimiDeltaAttention

    def edit(cfg):
        cfg["linear_attn_config"]["kda_layers"] = "1,2"
    with pytest.raises(ValueError, match="config.json: 'kda_layers'"):
        KimiDeltaAttention.from_pretrained(_golden_copy(tmp_path, "kimi_linear", edit), 1)
