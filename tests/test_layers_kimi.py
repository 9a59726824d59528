"""KimiDeltaAttention: against an independent float64 NumPy implementation written here (reading the
raw checkpoint tensors), against a composition of gdn_jax.reference pieces, against HF
transformers' KimiLinearDeltaAttention / Glm5NextTextLinearAttention (golden files), and
from_pretrained on checkpoints the tests write in Kimi Linear and GLM-5.3-Flash naming.

Block calls go through one jitted apply (compiled once per block and shape) to keep the CPU run
short."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from helpers import rel_err, run_block as run
from gdn_jax import reference as ref
from gdn_jax.layers import KDAConfig, KimiDeltaAttention
from gdn_jax.state import KDAState

GOLDEN_DIR = os.path.join(os.path.dirname(__file__), "golden")
TOL = 1e-5


# ------------------------------------------------------------------ independent float64 NumPy KDA

def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _softplus(x):
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def kda_numpy(raw, dims, x, *, lower_bound=None, eps=1e-5, conv_state=None, S0=None):
    """The KDA block in float64 from raw Kimi-Linear-named tensors ([out, in] weights, per-projection
    convs [C, 1, W], A_log [1, 1, HV, 1]). dims = (HK, HV, K, V, W).
    Returns (y [B, T, hidden], final S [B, HV, K, V], final conv window [B, W-1, C])."""
    hk, hv, kd, vd, w = dims
    f = lambda n: np.asarray(raw[n], np.float64)
    x = np.asarray(x, np.float64)
    bsz, t, _ = x.shape
    mixed = np.concatenate([x @ f("q_proj.weight").T, x @ f("k_proj.weight").T, x @ f("v_proj.weight").T], -1)
    wconv = np.concatenate([f("q_conv1d.weight"), f("k_conv1d.weight"), f("v_conv1d.weight")])[:, 0, :]
    hist = np.zeros((bsz, w - 1, mixed.shape[-1])) if conv_state is None else np.asarray(conv_state, np.float64)
    xp = np.concatenate([hist, mixed], axis=1)
    pre = np.stack([np.einsum("bjc,cj->bc", xp[:, i:i + w], wconv) for i in range(t)], axis=1)
    act = pre * _sigmoid(pre)
    l2 = lambda a: a / np.sqrt(np.sum(a * a, -1, keepdims=True) + 1e-6)
    q = l2(act[..., :hk * kd].reshape(bsz, t, hk, kd))
    k = l2(act[..., hk * kd:2 * hk * kd].reshape(bsz, t, hk, kd))
    v = act[..., 2 * hk * kd:].reshape(bsz, t, hv, vd)
    head_of = np.arange(hv) // (hv // hk)          # value head j reads key head j // (HV/HK)
    q, k = q[:, :, head_of] * kd ** -0.5, k[:, :, head_of]
    graw = ((x @ f("f_a_proj.weight").T) @ f("f_b_proj.weight").T).reshape(bsz, t, hv, kd)
    graw = graw + f("dt_bias").reshape(hv, kd)
    A = np.exp(f("A_log").reshape(hv))[:, None]
    g = -A * _softplus(graw) if lower_bound is None else lower_bound * _sigmoid(A * graw)
    beta = _sigmoid(x @ f("b_proj.weight").T)
    S = np.zeros((bsz, hv, kd, vd)) if S0 is None else np.array(S0, np.float64)
    o = np.zeros((bsz, t, hv, vd))
    for i in range(t):
        S = S * np.exp(g[:, i])[..., None]
        u = beta[:, i, :, None] * (v[:, i] - np.einsum("bhk,bhkv->bhv", k[:, i], S))
        S = S + k[:, i, :, :, None] * u[:, :, None, :]
        o[:, i] = np.einsum("bhk,bhkv->bhv", q[:, i], S)
    gate = (x @ f("g_a_proj.weight").T) @ f("g_b_proj.weight").T
    if "g_b_proj.bias" in raw:
        gate = gate + f("g_b_proj.bias")
    gate = gate.reshape(bsz, t, hv, vd)
    o = o / np.sqrt(np.mean(o * o, -1, keepdims=True) + eps) * f("o_norm.weight") * _sigmoid(gate)
    y = o.reshape(bsz, t, hv * vd) @ f("o_proj.weight").T
    return y, S, xp[:, xp.shape[1] - (w - 1):]


def random_raw(rng, *, hidden, hk, hv, kd, vd, w, gate_bias=False):
    """Unit-scale random tensors in Kimi Linear's checkpoint names and shapes (fp32)."""
    nrm = lambda *s: rng.standard_normal(s)
    lin = lambda o, i: nrm(o, i) / np.sqrt(i)
    raw = {
        "q_proj.weight": lin(hk * kd, hidden), "k_proj.weight": lin(hk * kd, hidden),
        "v_proj.weight": lin(hv * vd, hidden),
        "q_conv1d.weight": 0.5 * nrm(hk * kd, 1, w), "k_conv1d.weight": 0.5 * nrm(hk * kd, 1, w),
        "v_conv1d.weight": 0.5 * nrm(hv * vd, 1, w),
        "f_a_proj.weight": lin(kd, hidden), "f_b_proj.weight": lin(hv * kd, kd),
        "b_proj.weight": lin(hv, hidden),
        "g_a_proj.weight": lin(vd, hidden), "g_b_proj.weight": lin(hv * vd, vd),
        "A_log": np.log(rng.uniform(0.05, 1.0, (1, 1, hv, 1))), "dt_bias": 0.5 * nrm(hv * kd),
        "o_norm.weight": 1.0 + 0.3 * nrm(vd), "o_proj.weight": lin(hidden, hv * vd),
    }
    if gate_bias:
        raw["g_b_proj.bias"] = 0.3 * nrm(hv * vd)
    return {k: np.asarray(v, np.float32) for k, v in raw.items()}


def to_glm_names(raw):
    """Kimi Linear names -> GLM-5.3-Flash / HF-converted names (one conv1d, forget_gate.*)."""
    out = {k: v for k, v in raw.items() if "conv1d" not in k and k not in
           ("f_a_proj.weight", "f_b_proj.weight", "A_log", "dt_bias")}
    out["conv1d.weight"] = np.concatenate([raw["q_conv1d.weight"], raw["k_conv1d.weight"], raw["v_conv1d.weight"]])
    for n in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias"):
        out["forget_gate." + n] = raw[n]
    out["forget_gate.A_log"] = raw["A_log"].reshape(-1)
    return out


def write_ckpt(folder, tensors, prefix, config):
    os.makedirs(folder, exist_ok=True)
    save_file({prefix + k: v for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


DIMS = dict(hidden=48, hk=4, hv=4, kd=16, vd=16, w=4)
KIMI_CONFIG = {"model_type": "kimi_linear", "hidden_size": 48, "rms_norm_eps": 1e-5, "num_hidden_layers": 3,
               "linear_attn_config": {"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4,
                                      "kda_layers": [1, 3], "full_attn_layers": [2]}}
GLM_CONFIG = {"model_type": "glm5_next", "text_config": {
    "model_type": "glm5_next_text", "hidden_size": 48, "rms_norm_eps": 1e-6, "num_hidden_layers": 3,
    "linear_num_heads": 4, "linear_head_dim": 16, "linear_conv_kernel_dim": 4, "linear_lower_bound": -3.0,
    "layer_types": ["linear_attention", "indexed_attention", "linear_attention"]}}


@pytest.fixture(scope="module")
def raw():
    return random_raw(np.random.default_rng(7), **DIMS)


@pytest.fixture(scope="module")
def x48():
    return np.random.default_rng(8).standard_normal((2, 9, 48)).astype(np.float32)


@pytest.fixture(scope="module")
def kimi_path(tmp_path_factory, raw):
    return write_ckpt(str(tmp_path_factory.mktemp("kimi")), raw, "model.layers.2.self_attn.", KIMI_CONFIG)


# ------------------------------------------------------------------ from_pretrained vs NumPy float64

def test_kimi_checkpoint_matches_numpy_float64(kimi_path, raw, x48):
    block = KimiDeltaAttention.from_pretrained(kimi_path, 2)
    c = block.config
    assert (c.num_heads, c.head_dim, c.conv_kernel_size, c.lower_bound, c.rms_norm_eps) == (4, 16, 4, None, 1e-5)
    y, state = run(block, jnp.asarray(x48), block.init_state(2))
    y_np, S_np, conv_np = kda_numpy(raw, (4, 4, 16, 16, 4), x48)
    assert rel_err(y, y_np) <= TOL
    assert rel_err(state.recurrent, S_np) <= TOL
    assert rel_err(state.conv, conv_np) <= TOL


def test_glm_checkpoint_matches_numpy_float64(tmp_path, raw, x48):
    """GLM-5.3-Flash naming under model.language_model (text_config nesting), with the config's
    lower bound (-3, so a hard-wired -5 would fail) and eps."""
    path = write_ckpt(str(tmp_path / "glm"), to_glm_names(raw), "model.language_model.layers.0.self_attn.",
                      GLM_CONFIG)
    block = KimiDeltaAttention.from_pretrained(path, 0)
    assert (block.config.lower_bound, block.config.rms_norm_eps) == (-3.0, 1e-6)
    y, state = run(block, jnp.asarray(x48), block.init_state(2))
    y_np, S_np, _ = kda_numpy(raw, (4, 4, 16, 16, 4), x48, lower_bound=-3.0, eps=1e-6)
    assert rel_err(y, y_np) <= TOL
    assert rel_err(state.recurrent, S_np) <= TOL


def test_grouped_heads_and_output_gate_bias_match_numpy_float64():
    """A randomly initialised block with grouped value heads (HV = 2 HK), head_v_dim != head_dim,
    a gate bias and a nonzero starting state, continued over several calls."""
    cfg = KDAConfig(hidden_size=32, num_heads=2, head_dim=8, num_v_heads=4, head_v_dim=16,
                    output_gate_bias=True, lower_bound=-2.0)
    block = KimiDeltaAttention(cfg, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(4)
    block.g_b_proj.bias.set_value(jnp.asarray(0.3 * rng.standard_normal(64), jnp.float32))
    block.o_norm.weight.set_value(jnp.asarray(1 + 0.3 * rng.standard_normal(16), jnp.float32))
    p = lambda a: np.asarray(a[...], np.float32)
    conv = p(block.conv1d.weight)[:, None, :]
    raw = {n: p(getattr(block, n.split(".")[0]).weight) for n in (
        "q_proj.weight", "k_proj.weight", "v_proj.weight", "f_a_proj.weight", "f_b_proj.weight",
        "b_proj.weight", "g_a_proj.weight", "g_b_proj.weight", "o_proj.weight", "o_norm.weight")}
    raw.update({"q_conv1d.weight": conv[:16], "k_conv1d.weight": conv[16:32], "v_conv1d.weight": conv[32:],
                "A_log": p(block.A_log), "dt_bias": p(block.dt_bias), "g_b_proj.bias": p(block.g_b_proj.bias)})
    x = rng.standard_normal((2, 5, 32)).astype(np.float32)
    S0 = (0.3 * rng.standard_normal((2, 4, 8, 16))).astype(np.float32)
    conv0 = rng.standard_normal((2, 3, 96)).astype(np.float32)
    state = KDAState(recurrent=jnp.asarray(S0), conv=jnp.asarray(conv0))
    y, state = run(block, jnp.asarray(x), state, impl="reference")
    y_np, S_np, conv_np = kda_numpy(raw, (2, 4, 8, 16, 4), x, lower_bound=-2.0, conv_state=conv0, S0=S0)
    assert rel_err(y, y_np) <= TOL
    assert rel_err(state.recurrent, S_np) <= TOL
    assert rel_err(state.conv, conv_np) <= TOL


# ------------------------------------------------------------------ vs a composition of references

@jax.jit
def _compose_references(raw, x):
    """The block written out from gdn_jax.reference pieces (token-serial recurrence)."""
    hp = jax.lax.Precision.HIGHEST
    lin = lambda a, n: jnp.einsum("...i,oi->...o", a, raw[n], precision=hp)
    bsz, t, _ = x.shape
    mixed = jnp.concatenate([lin(x, "q_proj.weight"), lin(x, "k_proj.weight"), lin(x, "v_proj.weight")], -1)
    wconv = jnp.concatenate([raw["q_conv1d.weight"], raw["k_conv1d.weight"], raw["v_conv1d.weight"]])[:, 0]
    mixed, conv_state = ref.causal_conv1d(mixed, wconv, None, activation="silu")
    q = mixed[..., :64].reshape(bsz, t, 4, 16)
    k = mixed[..., 64:128].reshape(bsz, t, 4, 16)
    v = mixed[..., 128:].reshape(bsz, t, 4, 16)
    g = ref.kda_gate(lin(lin(x, "f_a_proj.weight"), "f_b_proj.weight").reshape(bsz, t, 4, 16),
                     raw["A_log"], raw["dt_bias"])
    beta = ref.gdn_beta(lin(x, "b_proj.weight"))
    o, S = ref.recurrent_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)
    gate = lin(lin(x, "g_a_proj.weight"), "g_b_proj.weight").reshape(bsz, t, 4, 16)
    o = ref.gated_rmsnorm(o, gate, raw["o_norm.weight"], eps=1e-5, activation="sigmoid")
    return lin(o.reshape(bsz, t, 64), "o_proj.weight"), S, conv_state


def test_matches_reference_composition(kimi_path, raw, x48):
    block = KimiDeltaAttention.from_pretrained(kimi_path, 2)
    y, state = run(block, jnp.asarray(x48), block.init_state(2))
    y_ref, S_ref, conv_ref = _compose_references({k: jnp.asarray(v) for k, v in raw.items()}, jnp.asarray(x48))
    assert rel_err(y, y_ref) <= TOL
    assert rel_err(state.recurrent, S_ref) <= TOL
    assert rel_err(state.conv, conv_ref) <= TOL


# ------------------------------------------------------------------ HF transformers parity

@pytest.fixture(scope="module")
def hf():
    return load_file(os.path.join(GOLDEN_DIR, "kda_golden.safetensors"))


@pytest.mark.parametrize("tag, folder, impl", [("kimi", "kimi_linear", "reference"), ("glm", "glm5_next", "chunked")])
def test_matches_hf_modules(hf, tag, folder, impl):
    """HF's KimiLinearDeltaAttention (Kimi names) and Glm5NextTextLinearAttention (GLM names, lower
    bound -4): full pass, and the cache path (prefill, 4-token continuation, single-token decodes)
    with HF's final states."""
    block = KimiDeltaAttention.from_pretrained(os.path.join(GOLDEN_DIR, folder), 1)
    assert block.config.lower_bound == (None if tag == "kimi" else -4.0)
    x = jnp.asarray(hf["x"])
    y, _ = run(block, x, block.init_state(2), impl=impl)
    assert rel_err(y, hf[f"{tag}.full.y"]) <= TOL
    state, ys, t0 = block.init_state(2), [], 0
    for n in hf[f"{tag}.cache.segments"].tolist():
        y, state = run(block, x[:, t0:t0 + n], state)
        ys.append(y)
        t0 += n
    assert rel_err(jnp.concatenate(ys, 1), hf[f"{tag}.cache.y"]) <= TOL
    assert rel_err(jnp.concatenate(ys, 1), hf[f"{tag}.full.y"][:, :t0]) <= TOL
    conv_hf, rec_hf = KimiDeltaAttention.state_to_hf(state)
    assert rel_err(conv_hf[..., 1:], hf[f"{tag}.cache.conv_final"][..., 1:]) <= TOL
    assert rel_err(rec_hf, hf[f"{tag}.cache.recurrent_final"]) <= TOL


# ------------------------------------------------------------------ config and validation

@pytest.mark.parametrize("cfg, lower_bound", [
    (KIMI_CONFIG, None),
    (GLM_CONFIG, -3.0),
    ({"model_type": "glm5_next", "hidden_size": 8, "linear_num_heads": 2, "linear_head_dim": 4}, -5.0),
    ({"model_type": "glm5_next", "hidden_size": 8, "linear_attn_config": {
        "num_heads": 2, "head_dim": 4, "gate_lower_bound": None}}, -5.0),
    ({"model_type": "glm5_next", "hidden_size": 8, "linear_attn_config": {
        "num_heads": 2, "head_dim": 4, "gate_lower_bound": None, "safe_gate": False}}, None),
    ({"model_type": "other", "hidden_size": 8, "linear_num_heads": 2, "linear_head_dim": 4,
      "linear_lower_bound": -1.5}, -1.5),
    ({"model_type": "other", "hidden_size": 8, "linear_num_heads": 2, "linear_head_dim": 4}, None),
])
def test_config_from_hf_lower_bound(cfg, lower_bound):
    assert KDAConfig.from_hf(cfg).lower_bound == lower_bound


@pytest.mark.parametrize("kwargs, word", [
    (dict(num_v_heads=6), "num_v_heads"),
    (dict(lower_bound=0.0), "lower_bound"),
    (dict(lower_bound=1.0), "lower_bound"),
    (dict(head_dim=0), "head_dim"),
    (dict(rms_norm_eps=-1e-5), "rms_norm_eps"),
])
def test_config_validation(kwargs, word):
    with pytest.raises(ValueError, match=word):
        KDAConfig(**{**dict(hidden_size=16, num_heads=4, head_dim=4), **kwargs})


def test_config_from_hf_missing_heads():
    with pytest.raises(ValueError, match="num_heads"):
        KDAConfig.from_hf({"model_type": "kimi_linear", "hidden_size": 8})


def _without(*names):
    return lambda r: {k: v for k, v in r.items() if k not in names}


@pytest.mark.parametrize("edit, word", [
    (_without("f_b_proj.weight"), "f_b_proj.weight"),
    (_without("v_conv1d.weight"), "v_conv1d.weight"),
    (_without("o_norm.weight"), "o_norm.weight"),
    (lambda r: {**r, "dt_bias": r["dt_bias"][:-1]}, "dt_bias"),
    (lambda r: {**r, "A_log": r["A_log"].reshape(2, 2)}, "A_log"),
    (lambda r: {**r, "q_proj.weight": r["q_proj.weight"][:, :-1]}, "q_proj.weight"),
    (lambda r: {**r, "conv1d.weight": to_glm_names(r)["conv1d.weight"]}, "both"),
    (lambda r: {**r, "forget_gate.A_log": r["A_log"].reshape(-1)}, "both"),
    (lambda r: {**r, "rotary.inv_freq": np.zeros(4, np.float32)}, "rotary.inv_freq"),
])
def test_from_pretrained_refuses_bad_tensors(tmp_path, raw, edit, word):
    path = write_ckpt(str(tmp_path / "bad"), edit(raw), "model.layers.0.self_attn.", KIMI_CONFIG)
    with pytest.raises(ValueError, match=word):
        KimiDeltaAttention.from_pretrained(path, 0)


def test_from_pretrained_refuses_non_kda_layers(kimi_path):
    with pytest.raises(ValueError, match="kda_layers"):
        KimiDeltaAttention.from_pretrained(kimi_path, 1)       # layer 2 (1-indexed) is full attention
    with pytest.raises(ValueError, match="out of range"):
        KimiDeltaAttention.from_pretrained(kimi_path, 3)
    with pytest.raises(ValueError, match="no tensors"):
        KimiDeltaAttention.from_pretrained(kimi_path, 0)       # a KDA layer the file does not hold


def test_call_validation(kimi_path):
    block = KimiDeltaAttention.from_pretrained(kimi_path, 2)
    x = jnp.ones((1, 2, 48), jnp.float32)
    with pytest.raises(ValueError, match="x must"):
        block(jnp.ones((1, 2, 47)))
    with pytest.raises(ValueError, match="impl"):
        block(x, impl="fast")
    s = block.init_state(1)
    with pytest.raises(ValueError, match="state.recurrent"):
        block(x, KDAState(recurrent=jnp.zeros((1, 4, 16, 8)), conv=s.conv))
    with pytest.raises(ValueError, match="state.conv"):
        block(x, KDAState(recurrent=s.recurrent, conv=jnp.zeros((1, 3, 191))))
    with pytest.raises(ValueError, match="state must"):
        block(x, {"recurrent": s.recurrent, "conv": s.conv})


def test_bf16_checkpoint_keeps_or_casts_dtype(tmp_path, raw):
    import ml_dtypes
    bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in raw.items()}
    path = write_ckpt(str(tmp_path / "bf16"), bf16, "model.layers.0.self_attn.", KIMI_CONFIG)
    kept = KimiDeltaAttention.from_pretrained(path, 0)
    assert kept.q_proj.weight[...].dtype == jnp.bfloat16 and kept.conv1d.weight[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(kept.conv1d.weight[...][:64], np.float32),
                                  bf16["q_conv1d.weight"][:, 0].astype(np.float32))
    cast = KimiDeltaAttention.from_pretrained(path, 0, param_dtype=jnp.float32)
    assert cast.q_proj.weight[...].dtype == jnp.float32 and cast.A_log[...].dtype == jnp.float32
