"""Reading Hugging Face checkpoint folders: `config.json` plus `*.safetensors` (single or sharded).

Only safetensors are read — never pickle (`*.bin`, `*.pt`): a pickle can run code on load.

A checkpoint folder holds
    config.json
    model.safetensors                                   (one file), or
    model.safetensors.index.json + model-0000i-of-0000n.safetensors   (shards; the index's
                                                        "weight_map" names each tensor's file)
A folder with neither an index nor `model.safetensors` is read by scanning every `*.safetensors`
file in it (what `save_file` into a folder by hand gives).

Tensors come back as NumPy arrays (bf16 through `ml_dtypes`, which JAX already depends on), read
lazily: only the tensors a layer asks for are read from disk, so one layer of a large model loads
in the time its own bytes take.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping

import numpy as np
from safetensors import safe_open

__all__ = ["read_config", "text_config", "SafetensorsCheckpoint", "find_layer_prefix"]

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Storage dtypes a block accepts; quantised checkpoints (fp8 with scales, int4 ...) need their
# own dequantisation and are refused by name rather than misread.
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


def _check_dir(path) -> str:
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"path must be a checkpoint folder (config.json + *.safetensors), got {path!r}")
    return path


def read_config(path) -> dict:
    """The parsed `config.json` of a checkpoint folder (the full file, nesting kept)."""
    path = _check_dir(path)
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"config.json not found in checkpoint folder {path!r}")
    with open(file, encoding="utf-8") as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"config.json in {path!r} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"config.json in {path!r} must hold a JSON object, got {type(cfg).__name__}")
    return cfg


def text_config(cfg: Mapping) -> dict:
    """The language model's settings: vision-language wrappers (Qwen3.5, GLM-5.3-Flash) nest them
    under "text_config"; text-only checkpoints keep them at the top level. Top-level keys fill in
    what the nested dict leaves out (some exporters keep e.g. rms_norm_eps only at the top)."""
    nested = cfg.get("text_config")
    if isinstance(nested, Mapping):
        merged = {k: v for k, v in cfg.items() if k != "text_config"}
        merged.update(nested)
        return merged
    return dict(cfg)


class SafetensorsCheckpoint:
    """Name -> tensor access over the safetensors files of one checkpoint folder."""

    def __init__(self, path):
        self.path = _check_dir(path)
        self._file_of = self._map_names()          # tensor name -> file name (relative to path)
        self._handles: dict[str, object] = {}

    def _map_names(self) -> dict[str, str]:
        index = os.path.join(self.path, INDEX_FILE)
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                try:
                    weight_map = json.load(f).get("weight_map")
                except (json.JSONDecodeError, AttributeError):
                    weight_map = None
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{INDEX_FILE} in {self.path!r} has no 'weight_map' object")
            for name, file in weight_map.items():
                if not isinstance(file, str) or os.path.basename(file) != file or not file.endswith(".safetensors"):
                    raise ValueError(f"{INDEX_FILE}: tensor {name!r} maps to {file!r}, "
                                     "expected a .safetensors file name in the same folder")
                if not os.path.isfile(os.path.join(self.path, file)):
                    raise ValueError(f"{INDEX_FILE}: shard {file!r} (holding {name!r}) is missing "
                                     f"from {self.path!r}")
            return dict(weight_map)
        files = ([SINGLE_FILE] if os.path.isfile(os.path.join(self.path, SINGLE_FILE))
                 else sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors")))
        if not files:
            pickles = [f for f in os.listdir(self.path) if f.endswith((".bin", ".pt", ".pth", ".ckpt"))]
            hint = (f" (found {pickles[:3]}: pickle checkpoints are not read; convert them to "
                    "safetensors)") if pickles else ""
            raise ValueError(f"no *.safetensors files in checkpoint folder {self.path!r}{hint}")
        names: dict[str, str] = {}
        for file in files:
            with safe_open(os.path.join(self.path, file), framework="numpy") as f:
                for name in f.keys():
                    names.setdefault(name, file)
        return names

    def _handle(self, file):
        h = self._handles.get(file)
        if h is None:
            h = self._handles[file] = safe_open(os.path.join(self.path, file), framework="numpy")
        return h

    def keys(self) -> list[str]:
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape from the file header, without reading the data."""
        return tuple(self._handle(self._file(name)).get_slice(name).get_shape())

    def _file(self, name):
        try:
            return self._file_of[name]
        except KeyError:
            raise ValueError(f"tensor {name!r} not found in checkpoint {self.path!r}") from None

    def get(self, name: str, shape: Iterable[int] | None = None) -> np.ndarray:
        """The tensor `name` as a NumPy array; with `shape`, a wrong shape raises ValueError naming
        the tensor before its data is read."""
        h = self._handle(self._file(name))
        sl = h.get_slice(name)
        dtype = sl.get_dtype()
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {dtype}; only float32/float16/bfloat16 "
                             "checkpoints are supported (quantised weights need dequantising first)")
        if shape is not None:
            want, got = tuple(int(s) for s in shape), tuple(sl.get_shape())
            if got != want:
                raise ValueError(f"tensor {name!r} has shape {got}, expected {want}")
        return h.get_tensor(name)

    def close(self):
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def find_layer_prefix(ckpt: SafetensorsCheckpoint, layer_idx: int, module: str,
                      candidates: Iterable[str] = ("model.layers.", "model.language_model.layers.",
                                                   "language_model.model.layers.", "layers.")) -> str:
    """The name prefix `<root>{layer_idx}.{module}.` under which this checkpoint keeps the layer.

    Text models use `model.layers.{i}.`; vision-language wrappers (Qwen3.5, GLM-5.3-Flash) keep the
    language model under `model.language_model.layers.{i}.`. Raises ValueError when no candidate
    has any tensor of the layer."""
    tried = []
    for root in candidates:
        prefix = f"{root}{layer_idx}.{module}."
        tried.append(prefix)
        if any(k.startswith(prefix) for k in ckpt.keys()):
            return prefix
    raise ValueError(f"layer_idx={layer_idx}: checkpoint {ckpt.path!r} has no tensors under any of "
                     f"{tried} (is layer {layer_idx} a {module} layer?)")
