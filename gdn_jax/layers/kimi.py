"""Kimi Delta Attention (KDA) block — Kimi Linear and the GLM-5.3-Flash KDA layer — as a Flax NNX module.

    x [B, T, hidden]
      -> q_proj, k_proj [HK*K], v_proj [HV*V]
      -> depthwise causal conv (width W) + SiLU over q|k|v (one conv; the checkpoint may store
         q_conv1d / k_conv1d / v_conv1d, which are concatenated in that order)
      -> L2 norm on q, k only (inside the delta rule)
      -> forget gate: g_raw = f_b_proj(f_a_proj(x)) [HV, K] -> kda_gate (softplus form, or
         lower_bound * sigmoid(...) when the config sets a lower bound)
      -> beta = sigmoid(b_proj(x)) [HV]
      -> KDA recurrence (gdn_jax.ops.kda, `impl` passed through)
      -> sigmoid-gated RMSNorm per head: rmsnorm(o) * o_norm.weight * sigmoid(g_b_proj(g_a_proj(x)))
         (g_b_proj may carry a bias)
      -> o_proj                                                          -> y [B, T, hidden]

Kimi Linear and GLM-5.3-Flash use HK = HV = num_heads and K = V = head_dim; the block also takes
grouped value heads (num_v_heads a multiple of num_heads) and a separate head_v_dim.

State (`gdn_jax.state.KDAState`):
  recurrent [B, HV, K, V]  fp32 by default, K-major S[k, v] (HF's recurrent_states layout)
  conv      [B, W-1, C]    the last W-1 conv inputs, time-major, C = 2*HK*K + HV*V in q | k | v order.
HF's cache keeps conv_states [B, C, W]: `KimiDeltaAttention.state_from_hf` / `state_to_hf` convert.

Checkpoint names (under `model.layers.{i}.self_attn.`, or `model.language_model.layers.{i}.self_attn.`):
  Kimi Linear (moonshotai, config `linear_attn_config`): q_proj, k_proj, v_proj, q_conv1d, k_conv1d,
    v_conv1d ([C, 1, W] each), f_a_proj, f_b_proj, b_proj, g_a_proj, g_b_proj, A_log [1, 1, H, 1],
    dt_bias [H*K], o_norm, o_proj.
  GLM-5.3-Flash / HF-converted (config `linear_num_heads`, `linear_head_dim`,
    `linear_conv_kernel_dim`, `linear_lower_bound`): one conv1d [3P, 1, W] over q|k|v and
    forget_gate.{f_a_proj, f_b_proj, A_log [H], dt_bias [H*K]}; the rest as above.
Either spelling is accepted for either family, tensor by tensor.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdn_jax import reference as ref
from gdn_jax.layers._common import (DEFAULT_PRECISION, DeltaStateMixin, F32, Linear, NormWeight,
                                    ParamInit, ShortConv, check_conv_activation, check_eps,
                                    check_positive_int, configured_layer_type, fill_params)
from gdn_jax.layers.serving import DeltaBlockMixin, DeltaDims
from gdn_jax.layers import tensor_parallel as tp
from gdn_jax.loading import (RowConcat, SafetensorsCheckpoint, TensorReader, config_list,
                             config_object, find_layer_prefix, read_config, text_config)
from gdn_jax.state import KDAState

__all__ = ["KDAConfig", "KimiDeltaAttention"]

_DEFAULT_EPS = 1e-5            # KimiLinearConfig / Glm5NextTextConfig rms_norm_eps default
_DEFAULT_CONV = 4
_GLM_DEFAULT_LOWER_BOUND = -5.0  # Glm5NextTextConfig.linear_lower_bound default ("safe gate")
_GLM_MODEL_TYPES = ("glm5_next", "glm5_next_text")


@dataclasses.dataclass(frozen=True)
class KDAConfig:
    """Static shape of one KDA block. num_v_heads / head_v_dim default to num_heads / head_dim.
    lower_bound None selects the softplus gate; a negative float the bounded sigmoid gate."""
    hidden_size: int
    num_heads: int
    head_dim: int
    num_v_heads: int | None = None
    head_v_dim: int | None = None
    conv_kernel_size: int = _DEFAULT_CONV
    rms_norm_eps: float = _DEFAULT_EPS
    lower_bound: float | None = None
    output_gate_bias: bool = False
    conv_bias: bool = False

    def __post_init__(self):
        if self.num_v_heads is None:
            object.__setattr__(self, "num_v_heads", self.num_heads)
        if self.head_v_dim is None:
            object.__setattr__(self, "head_v_dim", self.head_dim)
        for name in ("hidden_size", "num_heads", "head_dim", "num_v_heads", "head_v_dim",
                     "conv_kernel_size"):
            check_positive_int(name, getattr(self, name))
        if self.num_v_heads % self.num_heads:
            raise ValueError(f"num_v_heads={self.num_v_heads} must be a multiple of num_heads={self.num_heads}")
        check_eps("rms_norm_eps", self.rms_norm_eps)
        if self.lower_bound is not None:
            lb = self.lower_bound
            if isinstance(lb, bool) or not isinstance(lb, (int, float)) or not (math.isfinite(lb) and lb < 0):
                raise ValueError(f"lower_bound must be a finite float < 0 (or None for the softplus "
                                 f"gate), got {lb!r}")
            object.__setattr__(self, "lower_bound", float(lb))

    @property
    def head_k_dim(self) -> int:
        return self.head_dim

    @property
    def key_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def gate_dim(self) -> int:
        """The forget gate's width: one decay per (value head, key channel)."""
        return self.num_v_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @classmethod
    def from_hf(cls, cfg: dict, *, output_gate_bias: bool = False, conv_bias: bool = False) -> "KDAConfig":
        """From a Kimi Linear or GLM-5.3-Flash `config.json` dict.

        Head settings come from `linear_attn_config` {num_heads, head_dim, short_conv_kernel_size,
        gate_lower_bound, safe_gate} where present, else from `linear_num_heads`, `linear_head_dim`,
        `linear_conv_kernel_dim`, `linear_lower_bound` (the precedence HF's configs apply).
        Lower bound: Kimi Linear has none (softplus gate); GLM-5.3-Flash defaults to -5.0 and
        `safe_gate` (default true) forces -5.0 when the bound is null; any other model type uses
        only an explicit `linear_lower_bound` / `gate_lower_bound`."""
        c = text_config(cfg)
        lac = config_object(c, "linear_attn_config")
        num_heads = lac.get("num_heads", c.get("linear_num_heads"))
        head_dim = lac.get("head_dim", c.get("linear_head_dim"))
        missing = [n for n, v in (("hidden_size", c.get("hidden_size")),
                                  ("linear_attn_config.num_heads or linear_num_heads", num_heads),
                                  ("linear_attn_config.head_dim or linear_head_dim", head_dim)) if v is None]
        if missing:
            raise ValueError(f"config.json is missing {missing} (not a Kimi Linear / GLM-5.3-Flash config?)")
        conv = lac.get("short_conv_kernel_size", c.get("linear_conv_kernel_dim", _DEFAULT_CONV))
        model_type = c.get("model_type", "")
        if model_type == "kimi_linear":
            lower_bound = None
        elif model_type in _GLM_MODEL_TYPES:
            lower_bound = c.get("linear_lower_bound", _GLM_DEFAULT_LOWER_BOUND)
            if lac:
                lower_bound = lac.get("gate_lower_bound", lower_bound)
                if lac.get("safe_gate", True) and lower_bound is None:
                    lower_bound = _GLM_DEFAULT_LOWER_BOUND
        else:
            lower_bound = c.get("linear_lower_bound", lac.get("gate_lower_bound"))
        check_conv_activation(c)
        return cls(hidden_size=c["hidden_size"], num_heads=num_heads, head_dim=head_dim,
                   conv_kernel_size=conv, rms_norm_eps=c.get("rms_norm_eps", _DEFAULT_EPS),
                   lower_bound=lower_bound, output_gate_bias=output_gate_bias, conv_bias=conv_bias)


def _check_kda_layer(c: dict, layer_idx: int):
    """Refuse a layer the config marks as full attention (when it says), before touching tensors."""
    kind = configured_layer_type(c, layer_idx)
    lac = config_object(c, "linear_attn_config")
    if kind is not None:
        if kind != "linear_attention":
            raise ValueError(f"layer_idx={layer_idx} is a {kind!r} layer in config.json, "
                             "not a linear_attention (KDA) layer")
    elif "kda_layers" in lac:   # Kimi Linear lists KDA layers 1-indexed
        if layer_idx + 1 not in (config_list(lac, "kda_layers", int) or []):
            raise ValueError(f"layer_idx={layer_idx} is not a KDA layer: linear_attn_config.kda_layers "
                             f"(1-indexed) is {lac['kda_layers']}")


class KimiDeltaAttention(tp.TensorParallelMixin, DeltaBlockMixin, DeltaStateMixin, nnx.Module):
    """Kimi Delta Attention block (see the module docstring for layout, state and names).

    `KimiDeltaAttention(config, rngs=nnx.Rngs(0))` makes random weights;
    `KimiDeltaAttention.from_pretrained(path, layer_idx)` loads an HF checkpoint's layer.
    `dtype` is the projections' compute dtype (None: the input's); gate, beta, norm and state
    math are fp32 regardless. `mesh` (a jax.sharding.Mesh with a "tp" axis) splits the heads over
    its devices (`gdn_jax.layers.tensor_parallel`).
    """

    STATE_CLS = KDAState
    DELTA_OP = "kda"

    def __init__(self, config: KDAConfig, *, rngs: nnx.Rngs, dtype=None, param_dtype=F32,
                 precision=DEFAULT_PRECISION, mesh=None):
        if not isinstance(config, KDAConfig):
            raise ValueError(f"config must be a KDAConfig, got {type(config).__name__}")
        tp.check_mesh(mesh, num_k_heads=config.num_heads, num_v_heads=config.num_v_heads)
        self.config = config
        self.dtype = dtype
        self.mesh = None
        c, h = config, config.hidden_size
        init = ParamInit(rngs)
        lin = lambda i, o, bias=False: Linear(i, o, use_bias=bias, param_dtype=param_dtype,
                                              precision=precision, init=init)
        self.q_proj = lin(h, c.key_dim)
        self.k_proj = lin(h, c.key_dim)
        self.v_proj = lin(h, c.value_dim)
        self.conv1d = ShortConv(c.conv_dim, c.conv_kernel_size, use_bias=c.conv_bias,
                                param_dtype=param_dtype, init=init)
        self.f_a_proj = lin(h, c.head_dim)
        self.f_b_proj = lin(c.head_dim, c.gate_dim)
        self.b_proj = lin(h, c.num_v_heads)
        self.g_a_proj = lin(h, c.head_v_dim)
        self.g_b_proj = lin(c.head_v_dim, c.value_dim, c.output_gate_bias)
        # FLA's initialisation: A uniform in [1, 16] (log stored); dt = exp(U[log 1e-3, log 1e-1])
        # stored as softplus^-1(dt), so softplus(dt_bias) starts at dt.
        self.A_log = nnx.Param(jnp.log(init.uniform((c.num_v_heads,), 1.0, 16.0, F32)).astype(param_dtype))
        dt = jnp.exp(init.uniform((c.gate_dim,), math.log(1e-3), math.log(1e-1), F32))
        self.dt_bias = nnx.Param((dt + jnp.log(-jnp.expm1(-dt))).astype(param_dtype))
        self.o_norm = NormWeight(c.head_v_dim, param_dtype=param_dtype)
        self.o_proj = lin(c.value_dim, h)
        if mesh is not None:
            tp.place_params(self, mesh)

    # init_state / state_from_hf / state_to_hf come from DeltaStateMixin.

    # ------------------------------------------------------------------ forward

    def _dims(self) -> DeltaDims:
        c = self.config
        return DeltaDims(c.num_heads, c.num_v_heads, c.head_dim, c.head_v_dim, True)

    def _shard_layout(self) -> dict[str, str]:
        """How each parameter splits over a mesh's "tp" axis: rows per head; the low-rank
        gate inputs (f_a_proj, g_a_proj) and the norm weight are shared by all heads."""
        return {"q_proj.weight": tp.ROWS, "k_proj.weight": tp.ROWS, "v_proj.weight": tp.ROWS,
                "conv1d.weight": tp.CONV_ROWS, "conv1d.bias": tp.CONV_ROWS,
                "f_a_proj.weight": tp.REPLICATED, "f_b_proj.weight": tp.ROWS,
                "b_proj.weight": tp.ROWS, "g_a_proj.weight": tp.REPLICATED,
                "g_b_proj.weight": tp.ROWS, "g_b_proj.bias": tp.ROWS, "A_log": tp.ROWS,
                "dt_bias": tp.ROWS, "o_norm.weight": tp.REPLICATED, "o_proj.weight": tp.COLUMNS}

    def _raw_inputs(self, x, dtype):
        """-> (mixed [B, T, C] before the conv, raw gate g_raw [B, T, HV, K], raw beta
        b [B, T, HV], output gate z [B, T, HV, V]), all in `dtype`."""
        c = self.config
        bsz, t = x.shape[:2]
        mixed = jnp.concatenate([self.q_proj(x, dtype), self.k_proj(x, dtype), self.v_proj(x, dtype)],
                                axis=-1)
        g_raw = self.f_b_proj(self.f_a_proj(x, dtype), dtype).reshape(bsz, t, c.num_v_heads, c.head_dim)
        z = self.g_b_proj(self.g_a_proj(x, dtype), dtype).reshape(bsz, t, c.num_v_heads, c.head_v_dim)
        return mixed, g_raw, self.b_proj(x, dtype), z

    def _inputs(self, x, dtype):
        """-> (mixed [B, T, C] before the conv, g [B, T, HV, K] fp32, beta [B, T, HV] fp32,
        output gate z [B, T, HV, V])."""
        mixed, g_raw, b, z = self._raw_inputs(x, dtype)
        g = ref.kda_gate(g_raw, self.A_log[...], self.dt_bias[...], lower_bound=self.config.lower_bound)
        return mixed, g, ref.gdn_beta(b), z

    def _core_params(self) -> dict:
        """What the one-launch decode kernel reads besides the projections."""
        c = self.config
        return dict(A_log=self.A_log[...], dt_bias=self.dt_bias[...], lower_bound=c.lower_bound,
                    norm_weight=self.o_norm.weight[...], norm_eps=c.rms_norm_eps,
                    norm_activation="sigmoid")

    def _output(self, o, z, dtype):
        """Sigmoid-gated RMSNorm per value head, then o_proj."""
        c = self.config
        o = ref.gated_rmsnorm(o, z, self.o_norm.weight[...], eps=c.rms_norm_eps,
                              activation="sigmoid", out_dtype=dtype)
        return self._project_out(o, dtype)

    def _project_out(self, o, dtype):
        """The normed o [B, T, HV, V] -> o_proj -> [B, T, hidden]."""
        bsz, t = o.shape[:2]
        return self.o_proj(o.reshape(bsz, t, self.config.value_dim), dtype)

    # __call__ and the serving path (prefill, decode, verify, accept, flush) come from
    # DeltaBlockMixin.

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(cls, path, layer_idx: int, *, dtype=None, param_dtype=None,
                        precision=DEFAULT_PRECISION, prefix: str | None = None, mesh=None):
        """Load KDA layer `layer_idx` of a Kimi Linear or GLM-5.3-Flash-style checkpoint folder
        (`config.json` + `*.safetensors`, single or sharded). Tensors are looked for under
        `model.layers.{i}.self_attn.` / `model.language_model.layers.{i}.self_attn.`, or `prefix`.
        Weights keep their stored dtype unless `param_dtype` is given. With `mesh` (a
        jax.sharding.Mesh with a "tp" axis) the heads are split over its devices and each device
        reads only its slice of every tensor. Raises ValueError naming a missing, duplicated,
        unexpected or misshapen tensor, an inconsistent config or a mesh whose "tp" axis does not
        divide the head counts."""
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, (int, np.integer)) or layer_idx < 0:
            raise ValueError(f"layer_idx must be a non-negative integer, got {layer_idx!r}")
        layer_idx = int(layer_idx)
        raw = read_config(path)
        _check_kda_layer(text_config(raw), layer_idx)
        with SafetensorsCheckpoint(path) as ckpt:
            if prefix is None:
                prefix = find_layer_prefix(ckpt, layer_idx, "self_attn")
            present = {k[len(prefix):] for k in ckpt.keys() if k.startswith(prefix)}
            config = KDAConfig.from_hf(raw, output_gate_bias="g_b_proj.bias" in present,
                                       conv_bias=bool({"conv1d.bias", "q_conv1d.bias"} & present))
            c = config
            tp.check_mesh(mesh, num_k_heads=c.num_heads, num_v_heads=c.num_v_heads)
            used: set[str] = set()

            def pick(*alternatives):
                found = [a for a in alternatives if a in present]
                if len(found) > 1:
                    raise ValueError(f"checkpoint holds both {[prefix + f for f in found]}; "
                                     "expected exactly one spelling")
                if not found:
                    raise ValueError(f"checkpoint is missing tensor {prefix + alternatives[0]} "
                                     f"(also looked for {[prefix + a for a in alternatives[1:]]})")
                used.add(found[0])
                return found[0]

            def get(name, shape, squeeze=()):
                used.add(name)
                return TensorReader(ckpt, prefix + name, shape, squeeze=squeeze)

            h = c.hidden_size
            tensors = {
                "q_proj.weight": get(pick("q_proj.weight"), (c.key_dim, h)),
                "k_proj.weight": get(pick("k_proj.weight"), (c.key_dim, h)),
                "v_proj.weight": get(pick("v_proj.weight"), (c.value_dim, h)),
                "b_proj.weight": get(pick("b_proj.weight"), (c.num_v_heads, h)),
                "g_a_proj.weight": get(pick("g_a_proj.weight"), (c.head_v_dim, h)),
                "g_b_proj.weight": get(pick("g_b_proj.weight"), (c.value_dim, c.head_v_dim)),
                "o_norm.weight": get(pick("o_norm.weight"), (c.head_v_dim,)),
                "o_proj.weight": get(pick("o_proj.weight"), (h, c.value_dim)),
                "f_a_proj.weight": get(pick("f_a_proj.weight", "forget_gate.f_a_proj.weight"),
                                       (c.head_dim, h)),
                "f_b_proj.weight": get(pick("f_b_proj.weight", "forget_gate.f_b_proj.weight"),
                                       (c.gate_dim, c.head_dim)),
                "dt_bias": get(pick("dt_bias", "forget_gate.dt_bias"), (c.gate_dim,)),
            }
            if c.output_gate_bias:
                tensors["g_b_proj.bias"] = get("g_b_proj.bias", (c.value_dim,))
            a_name = pick("A_log", "forget_gate.A_log")
            a_shape = ckpt.shape(prefix + a_name)
            if a_shape not in ((c.num_v_heads,), (1, 1, c.num_v_heads, 1)):
                raise ValueError(f"tensor {prefix + a_name!r} has shape {a_shape}, expected "
                                 f"({c.num_v_heads},) or (1, 1, {c.num_v_heads}, 1)")
            tensors["A_log"] = get(a_name, a_shape, squeeze=(0, 1, 3) if len(a_shape) == 4 else ())
            w = c.conv_kernel_size
            if "conv1d.weight" in present or "q_conv1d.weight" not in present:
                pick("conv1d.weight", "q_conv1d.weight")  # refuses both spellings / neither
                tensors["conv1d.weight"] = get("conv1d.weight", (c.conv_dim, 1, w), squeeze=(1,))
                if c.conv_bias:
                    tensors["conv1d.bias"] = get(pick("conv1d.bias"), (c.conv_dim,))
            else:   # Kimi Linear: one conv per projection, concatenated q | k | v
                parts = [get(pick(f"{p}_conv1d.weight"), (d, 1, w), squeeze=(1,))
                         for p, d in (("q", c.key_dim), ("k", c.key_dim), ("v", c.value_dim))]
                tensors["conv1d.weight"] = RowConcat(parts)
                if c.conv_bias:
                    tensors["conv1d.bias"] = RowConcat(
                        [get(pick(f"{p}_conv1d.bias"), (d,))
                         for p, d in (("q", c.key_dim), ("k", c.key_dim), ("v", c.value_dim))])
            unexpected = sorted(present - used)
            if unexpected:
                raise ValueError(f"unexpected tensors under {prefix!r}: {unexpected} (the block "
                                 "would ignore them)")
            module = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0), dtype=dtype,
                                                precision=precision))
            if mesh is not None:
                return tp.fill_sharded(module, tensors, mesh, param_dtype=param_dtype, source=prefix)
            tensors = {n: r.read() for n, r in tensors.items()}
        fill_params(module, tensors, param_dtype=param_dtype, source=prefix)
        return module
