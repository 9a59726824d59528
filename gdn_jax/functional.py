"""The reference functions as the package exports them: validated, then the math of
`gdn_jax.reference` unchanged.

Each checks its arguments once (ValueError naming the argument) and calls the reference, which
trusts them. `gdn_jax.reference` itself stays the unchecked oracle the tests and kernels are
compared against.
"""

from __future__ import annotations

import jax.numpy as jnp

from gdn_jax import reference as ref
from gdn_jax import validate as chk

__all__ = ["softplus", "l2norm", "gdn_gate", "gdn_beta", "kda_gate", "gated_rmsnorm",
           "causal_conv1d", "causal_conv1d_step", "conv_state_from_hf", "conv_state_to_hf",
           "state_to_16bit", "state_to_f32", "decode_step", "verify_steps"]


def softplus(x):
    """torch.nn.functional.softplus (beta 1, threshold 20) in fp32: x itself above 20."""
    chk.array("x", x, floating=True)
    return ref.softplus(x)


def l2norm(x, eps=ref.L2NORM_EPS):
    """x * rsqrt(sum(x^2) + eps) over the last axis, in fp32 (returns fp32); eps >= 0."""
    chk.array("x", x, floating=True)
    return ref.l2norm(x, chk.eps("eps", eps))


def gdn_gate(a, A_log, dt_bias):
    """GDN log-space decay: g = -exp(A_log) * softplus(a + dt_bias), fp32, a [..., HV];
    A_log, dt_bias [HV]."""
    chk.array("a", a, floating=True)
    if len(a.shape) < 1:
        raise ValueError(f"a must be [..., HV], got shape {a.shape}")
    hv = a.shape[-1]
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        chk.array(name, x, floating=True)
        chk.shape(name, x, (hv,))
    return ref.gdn_gate(a, A_log, dt_bias)


def gdn_beta(b):
    """beta = sigmoid(b) in fp32."""
    chk.array("b", b, floating=True)
    return ref.gdn_beta(b)


def kda_gate(g, A_log, dt_bias, *, lower_bound=None):
    """KDA per-channel log decay from the raw gate projection, fp32 [..., HV, K].

    g [..., HV, K]; A_log holding HV values; dt_bias holding HV * K values; lower_bound None
    (softplus form) or a finite number < 0."""
    chk.array("g", g, floating=True)
    if len(g.shape) < 2:
        raise ValueError(f"g must be [..., HV, K], got shape {g.shape}")
    hv, kd = g.shape[-2:]
    chk.array("A_log", A_log, floating=True)
    chk.array("dt_bias", dt_bias, floating=True)
    if A_log.size != hv:
        raise ValueError(f"A_log must hold HV={hv} values, got shape {A_log.shape}")
    if dt_bias.size != hv * kd:
        raise ValueError(f"dt_bias must hold HV*K={hv * kd} values, got shape {dt_bias.shape}")
    return ref.kda_gate(g, A_log, dt_bias, lower_bound=chk.lower_bound(lower_bound))


def gated_rmsnorm(x, z, weight, *, eps=1e-6, activation="silu", out_dtype=None):
    """y = x * rsqrt(mean(x^2) + eps) * weight * act(z) over the last axis (one head of size V).
    x, z [..., V] (same shape); weight [V]; eps >= 0; out_dtype floating (default: x's)."""
    chk.array("x", x, floating=True)
    chk.array("z", z, floating=True)
    chk.shape("z", z, x.shape)
    chk.array("weight", weight, floating=True)
    chk.shape("weight", weight, x.shape[-1:])
    chk.activation("activation", activation, ("silu", "sigmoid"))
    out = chk.float_dtype("out_dtype", out_dtype, x.dtype)
    return ref.gated_rmsnorm(x, z, weight, eps=chk.eps("eps", eps), activation=activation,
                             out_dtype=out)


def _check_conv(x, weight, bias, conv_state, activation, x_rank):
    chk.array("x", x, rank=x_rank, floating=True)
    c = x.shape[-1]
    chk.array("weight", weight, rank=2, floating=True)
    if weight.shape[0] != c or weight.shape[1] < 1:
        raise ValueError(f"weight must be [C={c}, W >= 1], got {weight.shape}")
    if bias is not None:
        chk.array("bias", bias, floating=True)
        chk.shape("bias", bias, (c,))
    if conv_state is not None:
        chk.array("conv_state", conv_state, floating=True)
        chk.shape("conv_state", conv_state, (x.shape[0], weight.shape[1] - 1, c))
    chk.activation("activation", activation, ("silu", None))


def causal_conv1d(x, weight, bias=None, *, conv_state=None, activation="silu"):
    """Depthwise causal conv over time (see `gdn_jax.reference.causal_conv1d`): x [B, T, C];
    weight [C, W]; bias [C] or None; conv_state [B, W-1, C] or None."""
    _check_conv(x, weight, bias, conv_state, activation, 3)
    return ref.causal_conv1d(x, weight, bias, conv_state=conv_state, activation=activation)


def causal_conv1d_step(x, conv_state, weight, bias=None, *, activation="silu"):
    """One conv decode step: x [B, C]; conv_state [B, W-1, C]."""
    if conv_state is None:
        raise ValueError("conv_state must be an array [B, W-1, C], got None")
    _check_conv(x, weight, bias, conv_state, activation, 2)
    return ref.causal_conv1d_step(x, conv_state, weight, bias, activation=activation)


def conv_state_from_hf(hf_state):
    """HF cache conv state [B, C, W] (W >= 1) -> canonical [B, W-1, C]."""
    chk.array("hf_state", hf_state, rank=3, floating=True)
    if hf_state.shape[2] < 1:
        raise ValueError(f"hf_state must be [B, C, W >= 1], got {hf_state.shape}")
    return ref.conv_state_from_hf(hf_state)


def conv_state_to_hf(state):
    """Canonical [B, W-1, C] -> HF [B, C, W]; the oldest column (never read again) is zero."""
    chk.array("state", state, rank=3, floating=True)
    return ref.conv_state_to_hf(state)


def state_to_16bit(state, dtype=jnp.float16):
    """fp32 state -> fp16/bf16, round to nearest even (out of place). Floating states only."""
    chk.array("state", state, floating=True)
    d = chk.float_dtype("dtype", dtype)
    if d not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"dtype must be float16 or bfloat16, got {d}")
    return ref.state_to_16bit(state, d)


def state_to_f32(state):
    """16-bit (or fp32) state -> fp32, exact. Floating states only."""
    chk.array("state", state, floating=True)
    return ref.state_to_f32(state)


def _check_step(q, k, v, g, beta, state, *, t_axis):
    r = 3 + t_axis
    for name, x, rank in (("q", q, r), ("k", k, r), ("v", v, r), ("beta", beta, r - 1),
                          ("state", state, 4)):
        chk.array(name, x, rank=rank, floating=True)
    chk.shape("k", k, q.shape)
    lead = q.shape[:1 + t_axis]
    hk, kd = q.shape[-2:]
    if v.shape[:1 + t_axis] != lead:
        raise ValueError(f"v must be [{', '.join(map(str, lead))}, HV, V], got {v.shape}")
    hv, vd = v.shape[-2:]
    chk.heads(hk, hv, kd, vd)
    chk.array("g", g, floating=True)
    if chk.shape_of(g) not in (lead + (hv,), lead + (hv, kd)):
        raise ValueError(f"g must have shape {lead + (hv,)} (GDN) or {lead + (hv, kd)} (KDA), "
                         f"got {chk.shape_of(g)}")
    chk.shape("beta", beta, lead + (hv,))
    chk.shape("state", state, (q.shape[0], hv, kd, vd))
    return kd


def decode_step(q, k, v, g, beta, state, *, scale=None, use_qk_l2norm=False):
    """One token for a batch (the pure-JAX reference step): q, k [B, HK, K]; v [B, HV, V];
    g [B, HV] (GDN) or [B, HV, K] (KDA); beta [B, HV]; state [B, HV, K, V]; scale positive
    finite (default K^-0.5). Returns (o [B, HV, V] in q's dtype, new state in state's dtype)."""
    kd = _check_step(q, k, v, g, beta, state, t_axis=0)
    return ref.decode_step(q, k, v, g, beta, state, scale=chk.scale(scale, kd),
                           use_qk_l2norm=bool(use_qk_l2norm))


def verify_steps(q, k, v, g, beta, state, *, scale=None, use_qk_l2norm=False):
    """T draft tokens from a committed state, keeping the state after each token ([B, T, ...]
    layout; see `gdn_jax.reference.verify_steps`). T >= 1."""
    kd = _check_step(q, k, v, g, beta, state, t_axis=1)
    if q.shape[1] < 1:
        raise ValueError(f"q must hold at least one token (T >= 1), got shape {q.shape}")
    return ref.verify_steps(q, k, v, g, beta, state, scale=chk.scale(scale, kd),
                            use_qk_l2norm=bool(use_qk_l2norm))
