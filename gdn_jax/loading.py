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

Every problem with the folder's files (unreadable, not UTF-8, not JSON, a corrupt or truncated
safetensors file, a header that declares more bytes than the file holds, tensor offsets past its
end, a directory or a symlink loop named like a shard) and every config value of the wrong type
raises ValueError naming the file and, where there is one, the key.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

__all__ = ["read_config", "text_config", "config_int", "config_object", "config_list",
           "SafetensorsCheckpoint", "TensorReader", "RowConcat", "find_layer_prefix"]

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Storage dtypes a block accepts; quantised checkpoints (fp8 with scales, int4 ...) need their
# own dequantisation and are refused by name rather than misread.
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
_NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}


def _check_dir(path) -> str:
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"path must be a checkpoint folder (config.json + *.safetensors), got {path!r}")
    return path


def _read_json(path: str, name: str):
    """Parse the JSON file `name` of folder `path`; ValueError naming the file on any problem."""
    file = os.path.join(path, name)
    try:
        with open(file, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{name} in {path!r} cannot be read: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{name} in {path!r} is not UTF-8 text (byte {e.start}); JSON files "
                         "must be UTF-8") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} in {path!r} is not valid JSON: {e}") from None


def read_config(path) -> dict:
    """The parsed `config.json` of a checkpoint folder (the full file, nesting kept)."""
    path = _check_dir(path)
    if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
        raise ValueError(f"config.json not found in checkpoint folder {path!r}")
    cfg = _read_json(path, CONFIG_FILE)
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


_MISSING = object()


def config_int(cfg: Mapping, key: str, default=_MISSING, *, minimum: int = 1) -> int:
    """cfg[key] as an int >= minimum; `default` when the key is absent (an explicit null is an
    error). ValueError naming config.json and the key for a value of another type (bools and
    floats included) or out of range."""
    if key not in cfg and default is not _MISSING:
        return default
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"config.json: {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def config_object(cfg: Mapping, key: str) -> dict:
    """cfg[key] as a dict; {} when absent or null. ValueError naming config.json and the key for
    any other type."""
    value = cfg.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"config.json: {key!r} must be an object, got {type(value).__name__} "
                         f"{value!r}")
    return dict(value)


def config_list(cfg: Mapping, key: str, item_type: type) -> list | None:
    """cfg[key] as a list of `item_type`; None when absent or null. ValueError naming config.json
    and the key for a string, a number or items of another type."""
    value = cfg.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(
            isinstance(x, item_type) and not isinstance(x, bool) for x in value):
        raise ValueError(f"config.json: {key!r} must be a list of {item_type.__name__}, got "
                         f"{value!r}")
    return value


class SafetensorsCheckpoint:
    """Name -> tensor access over the safetensors files of one checkpoint folder."""

    def __init__(self, path):
        self.path = _check_dir(path)
        self._handles: dict[str, object] = {}
        self._file_of = self._map_names()          # tensor name -> file name (relative to path)

    def _map_names(self) -> dict[str, str]:
        index = os.path.join(self.path, INDEX_FILE)
        if os.path.isfile(index):
            parsed = _read_json(self.path, INDEX_FILE)
            weight_map = parsed.get("weight_map") if isinstance(parsed, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{INDEX_FILE} in {self.path!r} has no 'weight_map' object")
            for name, file in weight_map.items():
                if not isinstance(file, str) or os.path.basename(file) != file or not file.endswith(".safetensors"):
                    raise ValueError(f"{INDEX_FILE}: tensor {name!r} maps to {file!r}, "
                                     "expected a .safetensors file name in the same folder")
                if not os.path.lexists(os.path.join(self.path, file)):
                    raise ValueError(f"{INDEX_FILE}: shard {file!r} (holding {name!r}) is missing "
                                     f"from {self.path!r}")
                self._check_file(file)
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
            for name in self._handle(file).keys():
                names.setdefault(name, file)
        return names

    def _check_file(self, file):
        """A shard must be a regular file (following links): not a directory, a dangling link or
        a symlink loop that merely carries a shard's name."""
        full = os.path.join(self.path, file)
        if not os.path.isfile(full):
            what = ("a directory" if os.path.isdir(full) else
                    "a broken or looping symlink" if os.path.islink(full) else "not a regular file")
            raise ValueError(f"{file!r} in checkpoint {self.path!r} is {what}, not a safetensors file")

    def _handle(self, file):
        h = self._handles.get(file)
        if h is None:
            self._check_file(file)
            try:
                h = safe_open(os.path.join(self.path, file), framework="numpy")
            except (SafetensorError, OSError) as e:
                raise ValueError(f"{file!r} in checkpoint {self.path!r} is not a valid safetensors "
                                 f"file (corrupt or truncated?): {e}") from None
            self._handles[file] = h
        return h

    def keys(self) -> list[str]:
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape from the file header, without reading the data."""
        file = self._file(name)
        try:
            return tuple(self._handle(file).get_slice(name).get_shape())
        except SafetensorError as e:
            raise ValueError(f"tensor {name!r} in {file!r} cannot be read: {e}") from None

    def _file(self, name):
        try:
            return self._file_of[name]
        except KeyError:
            raise ValueError(f"tensor {name!r} not found in checkpoint {self.path!r}") from None

    def _checked_slice(self, name: str, shape: Iterable[int] | None):
        """(file, safetensors slice) of tensor `name` after the header checks: a float dtype and,
        with `shape`, that shape (ValueError naming the tensor, before any data is read)."""
        file = self._file(name)
        h = self._handle(file)
        try:
            sl = h.get_slice(name)
            dtype = sl.get_dtype()
        except SafetensorError as e:
            raise ValueError(f"tensor {name!r} in {file!r} cannot be read: {e}") from None
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {dtype}; only float32/float16/bfloat16 "
                             "checkpoints are supported (quantised weights need dequantising first)")
        if shape is not None:
            want, got = tuple(int(s) for s in shape), tuple(sl.get_shape())
            if got != want:
                raise ValueError(f"tensor {name!r} has shape {got}, expected {want}")
        return file, sl

    def dtype(self, name: str) -> np.dtype:
        """The stored dtype (NumPy; bf16 through ml_dtypes), from the file header."""
        _, sl = self._checked_slice(name, None)
        return np.dtype(_NUMPY_DTYPES[sl.get_dtype()])

    def get(self, name: str, shape: Iterable[int] | None = None) -> np.ndarray:
        """The tensor `name` as a NumPy array; with `shape`, a wrong shape raises ValueError naming
        the tensor before its data is read."""
        file, _ = self._checked_slice(name, shape)
        try:
            return self._handle(file).get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"tensor {name!r} in {file!r} cannot be read: {e}") from None

    def get_slice(self, name: str, index: tuple, shape: Iterable[int] | None = None) -> np.ndarray:
        """The sub-block `index` (a tuple of slices, one per axis) of tensor `name`, reading only
        those bytes from disk (a device's shard of a layer split over a mesh). Same checks as
        `get`."""
        file, sl = self._checked_slice(name, shape)
        try:
            return np.asarray(sl[tuple(index)])
        except (SafetensorError, OSError) as e:
            raise ValueError(f"tensor {name!r} in {file!r} cannot be read: {e}") from None

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


class TensorReader:
    """Lazy access to one checkpoint tensor as a block parameter: `read(index)` reads only the
    sub-block `index` (a tuple of slices, one per parameter axis; None: all of it) from disk.
    `squeeze` names stored axes of size 1 that the parameter drops (HF's conv weight [C, 1, W]
    -> [C, W]; Kimi Linear's A_log [1, 1, H, 1] -> [H]). The name, dtype and stored shape are
    checked on construction, from the header."""

    def __init__(self, ckpt: SafetensorsCheckpoint, name: str, stored_shape: Iterable[int],
                 squeeze: tuple[int, ...] = ()):
        self.stored_shape = tuple(int(s) for s in stored_shape)
        ckpt._checked_slice(name, self.stored_shape)
        self.ckpt, self.name, self.squeeze = ckpt, name, tuple(squeeze)
        self.dtype = ckpt.dtype(name)
        self.shape = tuple(s for i, s in enumerate(self.stored_shape) if i not in self.squeeze)

    def read(self, index: tuple | None = None) -> np.ndarray:
        index = tuple(index or ()) + (slice(None),) * (len(self.shape) - len(index or ()))
        parts = iter(index)
        stored = tuple(slice(0, 1) if i in self.squeeze else next(parts)
                       for i in range(len(self.stored_shape)))
        arr = self.ckpt.get_slice(self.name, stored)
        return arr.reshape(tuple(n for i, n in enumerate(arr.shape) if i not in self.squeeze))


class RowConcat:
    """Readers of tensors concatenated along axis 0, read as one (Kimi Linear's q_conv1d,
    k_conv1d, v_conv1d as one q | k | v conv weight); a row range reads only the parts it
    covers."""

    def __init__(self, parts: list):
        self.parts = list(parts)
        self.dtype = np.result_type(*(p.dtype for p in self.parts))
        self.shape = (sum(p.shape[0] for p in self.parts),) + tuple(self.parts[0].shape[1:])

    def read(self, index: tuple | None = None) -> np.ndarray:
        index = tuple(index or ())
        start, stop, _ = (index[0] if index else slice(None)).indices(self.shape[0])
        rest, pieces, offset = index[1:], [], 0
        for p in self.parts:
            lo, hi = max(start, offset), min(stop, offset + p.shape[0])
            if lo < hi:
                pieces.append(p.read((slice(lo - offset, hi - offset),) + rest).astype(self.dtype))
            offset += p.shape[0]
        return np.concatenate(pieces, axis=0)
