"""gdn_jax.loading: config.json reading, single / sharded / scanned safetensors folders, lazy shape
checks, dtype refusal, and no pickle."""

import json

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
