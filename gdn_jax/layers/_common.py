"""Pieces the two blocks share: HF-layout parameters, input/state checks, checkpoint filling.

Parameters keep the PyTorch/HF layout and names (a linear's `weight` is [out, in]; the short
conv's `weight` is [C, W], HF's [C, 1, W] without the singleton), so the NNX path of every
parameter reads like the checkpoint name: `in_proj_qkvz/weight` <-> `in_proj_qkvz.weight`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdn_jax.loading import config_int, config_list

F32 = jnp.float32
DEFAULT_PRECISION = jax.lax.Precision.HIGHEST


def check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_eps(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 < float(value) < 1.0):
        raise ValueError(f"{name} must be a float in (0, 1), got {value!r}")
    return float(value)


def check_conv_activation(cfg: dict) -> None:
    """Both blocks' short conv is followed by SiLU: refuse a config that names another activation."""
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"config hidden_act={act!r}: the block's conv activation must be silu")


def configured_layer_type(cfg: dict, layer_idx: int) -> str | None:
    """Range-check `layer_idx` against num_hidden_layers and layer_types; return
    layer_types[layer_idx], or None when the config has no layer_types list."""
    n = config_int(cfg, "num_hidden_layers", None)
    if n is not None and not 0 <= layer_idx < n:
        raise ValueError(f"layer_idx={layer_idx} out of range for num_hidden_layers={n}")
    types = config_list(cfg, "layer_types", str)
    if types is None:
        return None
    if not 0 <= layer_idx < len(types):
        raise ValueError(f"layer_idx={layer_idx} out of range for layer_types of length {len(types)}")
    return types[layer_idx]


class ParamInit:
    """Random parameter values for a block built from `rngs`.

    With a concrete key (plain construction) the values come from NumPy's generator seeded by
    `rngs.params()`: building a block then compiles nothing (eager jax.random would compile one
    program per parameter shape, seconds on a CPU). Under tracing (`nnx.jit`, `nnx.eval_shape`)
    jax.random is used, so a jitted constructor still gets random weights."""

    def __init__(self, rngs: nnx.Rngs):
        key = rngs.params()
        if isinstance(key, jax.core.Tracer):
            self._key, self._np = key, None
        else:
            self._key, self._np = None, np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel())

    def _next_key(self):
        self._key, sub = jax.random.split(self._key)
        return sub

    def normal(self, shape, std, dtype):
        if self._np is None:
            return (std * jax.random.normal(self._next_key(), shape, F32)).astype(dtype)
        return jnp.asarray((std * self._np.standard_normal(shape)).astype(np.float32), dtype)

    def uniform(self, shape, low, high, dtype):
        if self._np is None:
            return jax.random.uniform(self._next_key(), shape, F32, low, high).astype(dtype)
        return jnp.asarray(self._np.uniform(low, high, shape).astype(np.float32), dtype)


class Linear(nnx.Module):
    """y = x W^T (+ b) with W stored [out, in] as in PyTorch; the matmul runs in `dtype`
    (default: x's dtype), accumulation left to the backend at `precision`."""

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = False,
                 param_dtype=F32, precision=DEFAULT_PRECISION, init: ParamInit):
        self.in_features, self.out_features = in_features, out_features
        self.precision = precision
        self.weight = nnx.Param(init.normal((out_features, in_features), 1.0 / math.sqrt(in_features),
                                            param_dtype))
        self.bias = (nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else None)

    def __call__(self, x: jax.Array, dtype=None) -> jax.Array:
        dtype = x.dtype if dtype is None else dtype
        y = jnp.einsum("...i,oi->...o", x.astype(dtype), self.weight[...].astype(dtype),
                       precision=self.precision)
        if self.bias is not None:
            y = y + self.bias[...].astype(dtype)
        return y


class ShortConv(nnx.Module):
    """Depthwise causal conv weights: weight [C, W] (HF's conv1d.weight [C, 1, W], squeezed);
    optional bias [C]. The math is `gdn_jax.reference.causal_conv1d`."""

    def __init__(self, channels: int, width: int, *, use_bias: bool = False, param_dtype=F32,
                 init: ParamInit):
        self.channels, self.width = channels, width
        self.weight = nnx.Param(init.normal((channels, width), 1.0 / math.sqrt(width), param_dtype))
        self.bias = nnx.Param(jnp.zeros((channels,), param_dtype)) if use_bias else None


class NormWeight(nnx.Module):
    """The per-head gated RMSNorm weight [V], used as stored (no 1 + w offset)."""

    def __init__(self, size: int, *, param_dtype=F32):
        self.weight = nnx.Param(jnp.ones((size,), param_dtype))


def check_hidden(x, hidden_size: int):
    """x must be a float [B, T, hidden]; returns (B, T)."""
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) != 3 or shape[-1] != hidden_size or shape[0] == 0 or shape[1] == 0:
        raise ValueError(f"x must have shape [B, T, hidden_size={hidden_size}] with B, T >= 1, got {shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must be a floating-point array, got dtype {x.dtype}")
    return shape[0], shape[1]


def check_state(state, cls, batch_size: int, recurrent_shape, conv_shape):
    """The state given to a block call must be that block's state class with these shapes."""
    if not isinstance(state, cls):
        raise ValueError(f"state must be a {cls.__name__} (from init_state) or None, got {type(state).__name__}")
    for name, arr, want in (("state.recurrent", state.recurrent, recurrent_shape),
                            ("state.conv", state.conv, conv_shape)):
        if tuple(getattr(arr, "shape", ())) != tuple(want):
            raise ValueError(f"{name} must have shape {tuple(want)} for x with batch {batch_size}, "
                             f"got {getattr(arr, 'shape', None)}")
        if not jnp.issubdtype(arr.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point, got dtype {arr.dtype}")


def _param_at(module, path: str):
    obj = module
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ValueError(f"parameter {path!r} does not exist in {type(module).__name__} "
                             "with this configuration")
    if not isinstance(obj, nnx.Variable):
        raise ValueError(f"{path!r} is not a parameter of {type(module).__name__}")
    return obj


def fill_params(module, tensors: Mapping[str, np.ndarray], *, param_dtype=None, source: str = ""):
    """Write checkpoint arrays into `module`'s parameters (path "a.b" -> module.a.b), checking that
    each has the parameter's shape and that every parameter gets one. Arrays keep their stored
    dtype unless `param_dtype` is given."""
    for path, arr in tensors.items():
        var = _param_at(module, path)
        want = tuple(var.get_value().shape)
        if tuple(arr.shape) != want:
            raise ValueError(f"tensor {source}{path!r} has shape {tuple(arr.shape)}, the block "
                             f"configuration needs {want}")
        var.set_value(jnp.asarray(arr, dtype=param_dtype))
    missing = [".".join(str(p) for p in path) for path, v in nnx.to_flat_state(nnx.state(module))
               if isinstance(v.get_value(), jax.ShapeDtypeStruct)]
    if missing:
        raise ValueError(f"checkpoint is missing tensors for parameters {missing} ({source})")


class DeltaStateMixin:
    """`init_state`, `state_from_hf`, `state_to_hf` of a block whose state class is `STATE_CLS`
    (GDNState / KDAState) and whose `config` names num_v_heads, head_k_dim, head_v_dim, conv_dim
    and conv_kernel_size."""

    STATE_CLS: type

    def init_state(self, batch_size: int, dtype=jnp.float32, conv_dtype=jnp.float32):
        """A fresh (zero) state for `batch_size` sequences; `dtype` is the recurrent state's
        storage dtype (float32, float16 or bfloat16), `conv_dtype` the conv window's."""
        c = self.config
        return self.STATE_CLS.init(check_positive_int("batch_size", batch_size), num_v_heads=c.num_v_heads,
                                   head_k_dim=c.head_k_dim, head_v_dim=c.head_v_dim, conv_dim=c.conv_dim,
                                   conv_width=c.conv_kernel_size, dtype=dtype, conv_dtype=conv_dtype)

    @classmethod
    def state_from_hf(cls, conv_state, recurrent_state):
        """HF cache tensors (conv_states [B, C, W], recurrent_states [B, HV, K, V]) -> the state."""
        from gdn_jax import reference as ref
        conv = jnp.asarray(conv_state)
        rec = jnp.asarray(recurrent_state)
        if conv.ndim != 3 or rec.ndim != 4 or conv.shape[0] != rec.shape[0]:
            raise ValueError(f"conv_state must be [B, C, W] and recurrent_state [B, HV, K, V], got "
                             f"{conv.shape} and {rec.shape}")
        return cls.STATE_CLS(recurrent=rec, conv=ref.conv_state_from_hf(conv))

    @staticmethod
    def state_to_hf(state):
        """The state -> (conv_states [B, C, W], recurrent_states [B, HV, K, V]) as HF's cache keeps
        them; the oldest conv column, which HF never reads again, is zero."""
        from gdn_jax import reference as ref
        return ref.conv_state_to_hf(state.conv), state.recurrent
