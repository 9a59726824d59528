"""The Gated DeltaNet block of Qwen3-Next / Qwen3.5 ("linear_attn" layers) as a Flax NNX module.

    x [B, T, hidden]
      -> projections: q, k [HK*K]; v, z [HV*V]; b, a [HV]
      -> depthwise causal conv (width W) + SiLU over q|k|v
      -> L2 norm on q, k (inside the delta rule); g = -exp(A_log) softplus(a + dt_bias); beta = sigmoid(b)
      -> gated delta rule (gdn_jax.ops.gated_delta_rule, `impl` passed through)
      -> gated RMSNorm per value head: rmsnorm(o) * norm.weight * SiLU(z)    (weight as stored)
      -> out_proj                                                        -> y [B, T, hidden]

Projection layouts (parameter names are the checkpoint's):

* "fused" (Qwen3-Next): `in_proj_qkvz.weight` [HK*(2K + 2rV), hidden] and `in_proj_ba.weight`
  [HK*2r, hidden], r = HV/HK, interleaved *per key-head group*: output rows are HK groups, group
  h holding [q_h (K) | k_h (K) | v of value heads h*r..h*r+r-1 (r*V) | z of the same heads (r*V)],
  and in_proj_ba's group h holds [b (r) | a (r)] of those value heads (HF's
  `fix_query_key_value_ordering`). The block keeps this layout and un-interleaves activations.
* "split" (Qwen3.5): `in_proj_qkv.weight` [2*HK*K + HV*V, hidden] (flat q | k | v),
  `in_proj_z.weight` [HV*V, hidden], `in_proj_b.weight` and `in_proj_a.weight` [HV, hidden].

State (`gdn_jax.state.GDNState`):
  recurrent [B, HV, K, V]  fp32 by default (K-major S[k, v], the layout of HF's recurrent_states)
  conv      [B, W-1, C]    the last W-1 conv *inputs*, time-major, channels C = 2*HK*K + HV*V in
                           flat q | k | v order (q heads, then k heads, then v heads).
HF's cache keeps conv_states [B, C, W] (channel-major, W columns, the oldest never read again):
`Qwen3NextGatedDeltaNet.state_from_hf` / `state_to_hf` convert (the channel order is the same).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdn_jax import reference as ref
from gdn_jax.layers._common import (DEFAULT_PRECISION, DeltaStateMixin, F32, Linear, NormWeight,
                                    ParamInit, ShortConv, check_conv_activation, check_eps,
                                    check_positive_int, configured_layer_type, fill_params)
from gdn_jax.layers.serving import DeltaBlockMixin, DeltaDims
from gdn_jax.layers import tensor_parallel as tp
from gdn_jax.loading import (SafetensorsCheckpoint, TensorReader, config_int, find_layer_prefix,
                             read_config, text_config)
from gdn_jax.state import GDNState

__all__ = ["GDNConfig", "Qwen3NextGatedDeltaNet"]

LAYOUTS = ("fused", "split")
# HF's defaults for keys a config.json may leave out.
_HF_DEFAULT_EPS = 1e-6
_HF_DEFAULT_CONV = 4
_HF_DEFAULT_FULL_ATTENTION_INTERVAL = 4


@dataclasses.dataclass(frozen=True)
class GDNConfig:
    """Static shape of one Gated DeltaNet block. Validated on construction (ValueError naming
    the field)."""
    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel_size: int = _HF_DEFAULT_CONV
    rms_norm_eps: float = _HF_DEFAULT_EPS
    layout: str = "fused"
    conv_bias: bool = False

    def __post_init__(self):
        for name in ("hidden_size", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim",
                     "conv_kernel_size"):
            check_positive_int(name, getattr(self, name))
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"num_v_heads={self.num_v_heads} must be a multiple of "
                             f"num_k_heads={self.num_k_heads}")
        check_eps("rms_norm_eps", self.rms_norm_eps)
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def heads_per_group(self) -> int:
        return self.num_v_heads // self.num_k_heads

    @classmethod
    def from_hf(cls, cfg: dict, *, layout: str = "fused", conv_bias: bool = False) -> "GDNConfig":
        """From a Qwen3-Next / Qwen3.5 `config.json` dict (text_config is looked into)."""
        c = text_config(cfg)
        missing = [k for k in ("hidden_size", "linear_num_key_heads", "linear_num_value_heads",
                               "linear_key_head_dim", "linear_value_head_dim") if k not in c]
        if missing:
            raise ValueError(f"config.json is missing {missing} (not a Qwen3-Next / Qwen3.5 config?)")
        check_conv_activation(c)
        return cls(hidden_size=c["hidden_size"], num_k_heads=c["linear_num_key_heads"],
                   num_v_heads=c["linear_num_value_heads"], head_k_dim=c["linear_key_head_dim"],
                   head_v_dim=c["linear_value_head_dim"],
                   conv_kernel_size=c.get("linear_conv_kernel_dim", _HF_DEFAULT_CONV),
                   rms_norm_eps=c.get("rms_norm_eps", _HF_DEFAULT_EPS), layout=layout,
                   conv_bias=conv_bias)


def _check_linear_layer(c: dict, layer_idx: int):
    """Refuse a layer the config marks as full attention (or out of range) before touching tensors."""
    kind = configured_layer_type(c, layer_idx)
    if kind is None:
        interval = config_int(c, "full_attention_interval", _HF_DEFAULT_FULL_ATTENTION_INTERVAL)
        kind = "full_attention" if (layer_idx + 1) % interval == 0 else "linear_attention"
    if kind != "linear_attention":
        raise ValueError(f"layer_idx={layer_idx} is a {kind!r} layer in config.json, not a "
                         "linear_attention (Gated DeltaNet) layer")


class Qwen3NextGatedDeltaNet(tp.TensorParallelMixin, DeltaBlockMixin, DeltaStateMixin, nnx.Module):
    """Qwen3-Next / Qwen3.5 Gated DeltaNet block (see the module docstring for layout and state).

    `Qwen3NextGatedDeltaNet(config, rngs=nnx.Rngs(0))` makes random weights;
    `Qwen3NextGatedDeltaNet.from_pretrained(path, layer_idx)` loads an HF checkpoint's layer.
    `dtype` is the compute dtype of the projections (None: the input's); gate, beta, norm and
    state math are fp32 regardless. `mesh` (a jax.sharding.Mesh with a "tp" axis) splits the
    heads over its devices (`gdn_jax.layers.tensor_parallel`).
    """

    STATE_CLS = GDNState
    DELTA_OP = "gated_delta_rule"

    def __init__(self, config: GDNConfig, *, rngs: nnx.Rngs, dtype=None, param_dtype=F32,
                 precision=DEFAULT_PRECISION, mesh=None):
        if not isinstance(config, GDNConfig):
            raise ValueError(f"config must be a GDNConfig, got {type(config).__name__}")
        tp.check_mesh(mesh, num_k_heads=config.num_k_heads, num_v_heads=config.num_v_heads)
        self.config = config
        self.dtype = dtype
        self.mesh = None
        c, h = config, config.hidden_size
        init = ParamInit(rngs)
        lin = lambda i, o: Linear(i, o, param_dtype=param_dtype, precision=precision, init=init)
        if c.layout == "fused":
            self.in_proj_qkvz = lin(h, 2 * c.key_dim + 2 * c.value_dim)
            self.in_proj_ba = lin(h, 2 * c.num_v_heads)
        else:
            self.in_proj_qkv = lin(h, c.conv_dim)
            self.in_proj_z = lin(h, c.value_dim)
            self.in_proj_b = lin(h, c.num_v_heads)
            self.in_proj_a = lin(h, c.num_v_heads)
        self.conv1d = ShortConv(c.conv_dim, c.conv_kernel_size, use_bias=c.conv_bias,
                                param_dtype=param_dtype, init=init)
        # HF initialisation: dt_bias ones, A uniform in [1, 16] (log stored), norm weight ones.
        self.dt_bias = nnx.Param(jnp.ones((c.num_v_heads,), param_dtype))
        self.A_log = nnx.Param(jnp.log(init.uniform((c.num_v_heads,), 1.0, 16.0, F32)).astype(param_dtype))
        self.norm = NormWeight(c.head_v_dim, param_dtype=param_dtype)
        self.out_proj = lin(c.value_dim, h)
        if mesh is not None:
            tp.place_params(self, mesh)

    # init_state / state_from_hf / state_to_hf come from DeltaStateMixin.

    # ------------------------------------------------------------------ forward

    def _project(self, x, dtype):
        """-> mixed_qkv [B, T, C] (flat q | k | v), z [B, T, HV, V], b, a [B, T, HV]."""
        c = self.config
        bsz, t = x.shape[:2]
        r = c.heads_per_group
        if c.layout == "split":
            mixed = self.in_proj_qkv(x, dtype)
            z = self.in_proj_z(x, dtype).reshape(bsz, t, c.num_v_heads, c.head_v_dim)
            return mixed, z, self.in_proj_b(x, dtype), self.in_proj_a(x, dtype)
        # Per key-head group h: [q_h | k_h | v (r heads) | z (r heads)] and [b (r) | a (r)].
        qkvz = self.in_proj_qkvz(x, dtype).reshape(bsz, t, c.num_k_heads, -1)
        kd, rv = c.head_k_dim, r * c.head_v_dim
        q, k = qkvz[..., :kd], qkvz[..., kd:2 * kd]
        v, z = qkvz[..., 2 * kd:2 * kd + rv], qkvz[..., 2 * kd + rv:]
        ba = self.in_proj_ba(x, dtype).reshape(bsz, t, c.num_k_heads, 2 * r)
        b = ba[..., :r].reshape(bsz, t, c.num_v_heads)
        a = ba[..., r:].reshape(bsz, t, c.num_v_heads)
        mixed = jnp.concatenate([q.reshape(bsz, t, c.key_dim), k.reshape(bsz, t, c.key_dim),
                                 v.reshape(bsz, t, c.value_dim)], axis=-1)
        return mixed, z.reshape(bsz, t, c.num_v_heads, c.head_v_dim), b, a

    def _dims(self) -> DeltaDims:
        c = self.config
        return DeltaDims(c.num_k_heads, c.num_v_heads, c.head_k_dim, c.head_v_dim, False)

    def _shard_layout(self) -> dict[str, str]:
        """How each parameter splits over a mesh's "tp" axis: by whole key-head groups."""
        layout = {"conv1d.weight": tp.CONV_ROWS, "conv1d.bias": tp.CONV_ROWS, "dt_bias": tp.ROWS,
                  "A_log": tp.ROWS, "norm.weight": tp.REPLICATED, "out_proj.weight": tp.COLUMNS}
        if self.config.layout == "fused":   # rows are key-head groups: a contiguous split
            return layout | {"in_proj_qkvz.weight": tp.ROWS, "in_proj_ba.weight": tp.ROWS}
        return layout | {"in_proj_qkv.weight": tp.CONV_ROWS, "in_proj_z.weight": tp.ROWS,
                         "in_proj_b.weight": tp.ROWS, "in_proj_a.weight": tp.ROWS}

    def _raw_inputs(self, x, dtype):
        """-> (mixed [B, T, C] before the conv, raw gate a [B, T, HV], raw beta b [B, T, HV],
        z [B, T, HV, V]), all in `dtype`."""
        mixed, z, b, a = self._project(x, dtype)
        return mixed, a, b, z

    def _inputs(self, x, dtype):
        """-> (mixed [B, T, C] before the conv, g, beta [B, T, HV] fp32, z [B, T, HV, V])."""
        mixed, a, b, z = self._raw_inputs(x, dtype)
        return mixed, ref.gdn_gate(a, self.A_log[...], self.dt_bias[...]), ref.gdn_beta(b), z

    def _core_params(self) -> dict:
        """What the one-launch decode kernel reads besides the projections."""
        return dict(A_log=self.A_log[...], dt_bias=self.dt_bias[...], lower_bound=None,
                    norm_weight=self.norm.weight[...], norm_eps=self.config.rms_norm_eps,
                    norm_activation="silu")

    def _output(self, o, z, dtype):
        """SiLU-gated RMSNorm per value head, then out_proj."""
        c = self.config
        o = ref.gated_rmsnorm(o, z, self.norm.weight[...], eps=c.rms_norm_eps, activation="silu",
                              out_dtype=dtype)
        return self._project_out(o, dtype)

    def _project_out(self, o, dtype):
        """The normed o [B, T, HV, V] -> out_proj -> [B, T, hidden]."""
        bsz, t = o.shape[:2]
        return self.out_proj(o.reshape(bsz, t, self.config.value_dim), dtype)

    # __call__ and the serving path (prefill, decode, verify, accept, flush) come from
    # DeltaBlockMixin.

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(cls, path, layer_idx: int, *, dtype=None, param_dtype=None,
                        precision=DEFAULT_PRECISION, prefix: str | None = None, mesh=None):
        """Load layer `layer_idx` of an HF Qwen3-Next / Qwen3.5 checkpoint folder.

        Reads `config.json` and the layer's `linear_attn.*` tensors from `*.safetensors` (single
        file or sharded with `model.safetensors.index.json`); tensors are looked for under
        `model.layers.{i}.linear_attn.` (Qwen3-Next) or `model.language_model.layers.{i}.linear_attn.`
        (Qwen3.5), or under `prefix` if given (e.g. "model.layers.3.linear_attn."). The projection
        layout follows the tensors present: `in_proj_qkvz` + `in_proj_ba` (fused) or `in_proj_qkv`,
        `in_proj_z`, `in_proj_b`, `in_proj_a` (split). Weights keep their stored dtype unless
        `param_dtype` is given. With `mesh` (a jax.sharding.Mesh with a "tp" axis) the heads are
        split over its devices and each device reads only its slice of every tensor. Raises
        ValueError naming a missing, unexpected or misshapen tensor, an inconsistent config or a
        mesh whose "tp" axis does not divide the head counts."""
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, (int, np.integer)) or layer_idx < 0:
            raise ValueError(f"layer_idx must be a non-negative integer, got {layer_idx!r}")
        layer_idx = int(layer_idx)
        raw = read_config(path)
        _check_linear_layer(text_config(raw), layer_idx)
        with SafetensorsCheckpoint(path) as ckpt:
            if prefix is None:
                prefix = find_layer_prefix(ckpt, layer_idx, "linear_attn")
            names = sorted(k[len(prefix):] for k in ckpt.keys() if k.startswith(prefix))
            if "in_proj_qkvz.weight" in names:
                layout = "fused"
            elif "in_proj_qkv.weight" in names:
                layout = "split"
            else:
                raise ValueError(f"checkpoint has neither {prefix}in_proj_qkvz.weight (Qwen3-Next) "
                                 f"nor {prefix}in_proj_qkv.weight (Qwen3.5); found {names}")
            config = GDNConfig.from_hf(raw, layout=layout, conv_bias="conv1d.bias" in names)
            tp.check_mesh(mesh, num_k_heads=config.num_k_heads, num_v_heads=config.num_v_heads)
            module = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0), dtype=dtype,
                                                precision=precision))
            expected = {".".join(str(p) for p in path): v.get_value().shape
                        for path, v in nnx.to_flat_state(nnx.state(module))}
            expected["conv1d.weight"] = (config.conv_dim, 1, config.conv_kernel_size)
            unexpected = sorted(set(names) - set(expected))
            if unexpected:
                raise ValueError(f"unexpected tensors under {prefix!r}: {unexpected} (the block "
                                 "would ignore them)")
            missing = sorted(set(expected) - set(names))
            if missing:
                raise ValueError(f"checkpoint is missing tensors {[prefix + m for m in missing]}")
            # conv1d.weight is stored [C, 1, W]; the parameter is [C, W].
            readers = {n: TensorReader(ckpt, prefix + n, expected[n],
                                       squeeze=(1,) if n == "conv1d.weight" else ())
                       for n in sorted(expected)}
            if mesh is not None:
                return tp.fill_sharded(module, readers, mesh, param_dtype=param_dtype, source=prefix)
            tensors = {n: r.read() for n, r in readers.items()}
        fill_params(module, tensors, param_dtype=param_dtype, source=prefix)
        return module
