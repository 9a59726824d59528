"""A block's whole decode token in one kernel launch: short conv, gates, delta rule, gated norm.

    y, state, windows = conv_decode(mixed, a, b, z, state, windows, slots=None, conv_weight=...,
                                    A_log=..., dt_bias=..., norm_weight=..., num_k_heads=..., ...)

mixed [B, conv_dim] is the *pre-conv* projection row q | k | v (conv_dim = 2 * HK * K + HV * V);
a [B, HV] (GDN) or [B, HV * K] (KDA, `per_channel_gate=True`) and b [B, HV] are the raw gate and
beta projections; z [B, HV, V] the output gate. The kernel (`pallas_kernels.gdn_decode` with
`fused_conv`) shifts each sequence's conv window and convolves (+ SiLU), L2-normalises q and k,
computes g and beta from the raw projections (GDN, or KDA's softplus / lower-bounded form), runs
the recurrence and the gated RMSNorm, and stores y once in `out_dtype`. The conv weight is one
depthwise [conv_dim, W] array over q | k | v, which is what both blocks hold (Kimi Linear's three
convs are concatenated at load).

state: [B, HV, K, V] with windows [B, W-1, conv_dim] (contiguous), or with `slots` [B] int32 a
state pool [slots, HV, K, V] and a window pool [slots, W-1, conv_dim]; slot -1 (or outside the
pool) is padding: nothing read or written, y zero. Both are donated and updated in place.

impl ("auto", "pallas", "reference") follows `gdn_jax.dispatch` (operation "conv_decode"); the
reference is the unfused composition of the references (conv step, gates, decode step, norm).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gdn_jax import dispatch
from gdn_jax import reference as ref
from gdn_jax import validate as chk
from gdn_jax.decode import DecodeCall, _decode_supports
from gdn_jax.verify import _gather, _live, _mask_rows, _scatter, normalise_slots
from pallas_kernels import gdn_decode as decode_kernel

__all__ = ["ConvDecodeCall", "conv_decode", "conv_decode_call"]


# A one-launch call is a decode call with the fused-conv flags set: the same validated record and
# the same kernel check as `gdn_jax.decode`.
ConvDecodeCall = DecodeCall


def conv_decode_call(mixed, a, b, z, state, windows, slots=None, *, conv_weight, conv_bias=None,
                     A_log, dt_bias, norm_weight, num_k_heads, num_v_heads, head_k_dim,
                     head_v_dim, per_channel_gate=False, lower_bound=None, scale=None,
                     use_qk_l2norm=False, norm_eps=1e-6, norm_activation="silu",
                     out_dtype=None) -> ConvDecodeCall:
    """Validate `conv_decode`'s arguments (ValueError naming the argument) into its call."""
    hk, hv, kd, vd = (chk.count(n, x) for n, x in (("num_k_heads", num_k_heads),
                                                   ("num_v_heads", num_v_heads),
                                                   ("head_k_dim", head_k_dim),
                                                   ("head_v_dim", head_v_dim)))
    chk.heads(hk, hv, kd, vd)
    conv_dim = 2 * hk * kd + hv * vd
    chk.array("mixed", mixed, rank=2, floating=True)
    bsz = mixed.shape[0]
    chk.shape("mixed", mixed, (bsz, conv_dim))
    chk.array("a", a, rank=2, floating=True)
    chk.shape("a", a, (bsz, hv * kd if per_channel_gate else hv))
    chk.array("b", b, rank=2, floating=True)
    chk.shape("b", b, (bsz, hv))
    chk.array("z", z, floating=True)
    if chk.shape_of(z) not in ((bsz, hv, vd), (bsz, hv * vd)):
        raise ValueError(f"z must have shape {(bsz, hv, vd)}, got {chk.shape_of(z)}")
    chk.array("conv_weight", conv_weight, rank=2, floating=True)
    if conv_weight.shape[0] != conv_dim or conv_weight.shape[1] < 2:
        raise ValueError(f"conv_weight must be [conv_dim={conv_dim}, W >= 2], got "
                         f"{chk.shape_of(conv_weight)}")
    width = conv_weight.shape[1]
    if conv_bias is not None:
        chk.array("conv_bias", conv_bias, floating=True)
        chk.shape("conv_bias", conv_bias, (conv_dim,))
    for name, x, n in (("A_log", A_log, hv), ("dt_bias", dt_bias, hv * kd if per_channel_gate else hv),
                       ("norm_weight", norm_weight, vd)):
        chk.array(name, x, floating=True)
        if x.size != n:
            raise ValueError(f"{name} must hold {n} values, got shape {chk.shape_of(x)}")
    lower_bound = chk.lower_bound(lower_bound)
    if lower_bound is not None and not per_channel_gate:
        raise ValueError("lower_bound applies to the per-channel (KDA) gate only")
    chk.activation("norm_activation", norm_activation, ("silu", "sigmoid"))
    eps = chk.eps("norm_eps", norm_eps)
    chk.array("state", state, rank=4, floating=True)
    chk.state_dtype("state", state.dtype)
    rows = bsz if slots is None else state.shape[0]
    chk.shape("state", state, (rows, hv, kd, vd))
    chk.array("windows", windows, rank=3, floating=True)
    chk.shape("windows", windows, (rows, width - 1, conv_dim))
    if slots is not None:
        chk.pool_slots("state", state)
        chk.slot_table("slots", slots, bsz, rows)
    out = chk.float_dtype("out_dtype", out_dtype, mixed.dtype)
    spec = decode_kernel.DecodeSpec(
        num_k_heads=hk, num_v_heads=hv, head_k_dim=kd, head_v_dim=vd, scale=chk.scale(scale, kd),
        q_col=0, k_col=hk * kd, v_col=2 * hk * kd, raw_gates=True,
        per_channel_gate=bool(per_channel_gate), gate_lower_bound=lower_bound,
        use_qk_l2norm=bool(use_qk_l2norm), pooled=slots is not None, fused_norm=True,
        norm_eps=eps, norm_activation=norm_activation, fused_conv=True, conv_width=width,
        conv_bias=conv_bias is not None)
    block = decode_kernel.default_block_sizes(bsz, vd, state.dtype, True)
    wide = chk.float64_arrays(mixed=mixed, a=a, b=b, z=z, windows=windows, conv_weight=conv_weight,
                              conv_bias=conv_bias, A_log=A_log, dt_bias=dt_bias,
                              norm_weight=norm_weight, out_dtype=out)
    return ConvDecodeCall(spec, block, str(jnp.dtype(state.dtype)), int(state.size), bsz, str(out),
                          wide)


dispatch.define("conv_decode", spec_of=conv_decode_call)
dispatch.register("conv_decode", dispatch.KernelFamily("triton decode, fused conv", _decode_supports))


def conv_decode(mixed, a, b, z, state, windows, slots=None, *, conv_weight, conv_bias=None,
                A_log, dt_bias, norm_weight, num_k_heads, num_v_heads, head_k_dim, head_v_dim,
                per_channel_gate=False, lower_bound=None, scale=None, use_qk_l2norm=False,
                norm_eps=1e-6, norm_activation="silu", out_dtype=None, impl="auto",
                interpret=None):
    """One decode token of a block's delta-rule core. Returns (y [B, HV, V] in out_dtype
    (default: mixed's dtype), new state, new windows); state and windows are donated. See the
    module docstring for the shapes."""
    dispatch.check_impl("conv_decode", impl)
    call = conv_decode_call(
        mixed, a, b, z, state, windows, slots, conv_weight=conv_weight, conv_bias=conv_bias,
        A_log=A_log, dt_bias=dt_bias, norm_weight=norm_weight, num_k_heads=num_k_heads,
        num_v_heads=num_v_heads, head_k_dim=head_k_dim, head_v_dim=head_v_dim,
        per_channel_gate=per_channel_gate, lower_bound=lower_bound, scale=scale,
        use_qk_l2norm=use_qk_l2norm, norm_eps=norm_eps, norm_activation=norm_activation,
        out_dtype=out_dtype)
    choice = dispatch.select("conv_decode", call, impl, interpret=interpret)
    if slots is not None:
        slots = normalise_slots(slots, state.shape[0])
    return conv_decode_run(call, choice.impl, mixed, a, b, z, state, windows, slots, conv_weight,
                           conv_bias, A_log, dt_bias, norm_weight,
                           interpret=dispatch.interpret_enabled(interpret))


def conv_decode_run(call: ConvDecodeCall, which, mixed, a, b, z, state, windows, slots,
                    conv_weight, conv_bias, A_log, dt_bias, norm_weight, *, interpret=False):
    """`conv_decode` for a validated call and a normalised slot table (the blocks' path)."""
    rows = (mixed.shape[0], call.spec.num_v_heads * call.spec.head_v_dim)
    return _conv_decode_jit(mixed, a, b, z.reshape(rows), state, windows, slots,
                            conv_weight, conv_bias, A_log.reshape(-1), dt_bias.reshape(-1),
                            norm_weight, spec=call.spec, block=call.block,
                            out_dtype=jnp.dtype(call.out_dtype), which=which, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("spec", "block", "out_dtype", "which", "interpret"),
                   donate_argnames=("state", "windows"))
def _conv_decode_jit(mixed, a, b, z, state, windows, slots, conv_weight, conv_bias, A_log,
                     dt_bias, norm_weight, *, spec, block, out_dtype, which, interpret):
    bsz = mixed.shape[0]
    hv, vd = spec.num_v_heads, spec.head_v_dim
    if which == "pallas":
        y, state, windows = decode_kernel.gdn_decode(
            mixed, mixed, mixed, a, b, state, spec=spec, A_log=A_log, dt_bias=dt_bias,
            slots=slots, z_rows=z, norm_weight=norm_weight, conv_weight=conv_weight,
            conv_bias=conv_bias, conv_windows=windows, out_dtype=out_dtype, block=block,
            interpret=interpret)
        return y.reshape(bsz, hv, vd), state, windows
    return _reference(mixed, a, b, z, state, windows, slots, conv_weight, conv_bias, A_log,
                      dt_bias, norm_weight, spec=spec, out_dtype=out_dtype)


def _reference(mixed, a, b, z, state, windows, slots, conv_weight, conv_bias, A_log, dt_bias,
               norm_weight, *, spec, out_dtype):
    """The unfused chain, in the blocks' order: conv step (output rounded to mixed's dtype),
    split, gates, decode step, gated RMSNorm; pool rows gathered and scattered by slot."""
    bsz = mixed.shape[0]
    hk, hv, kd, vd = spec.num_k_heads, spec.num_v_heads, spec.head_k_dim, spec.head_v_dim
    live = None if slots is None else _live(slots)
    win = windows if slots is None else _gather(windows, slots)
    x, new_win = ref.causal_conv1d_step(mixed, win, conv_weight, conv_bias, activation="silu")
    q = x[:, :hk * kd].reshape(bsz, hk, kd)
    k = x[:, hk * kd:2 * hk * kd].reshape(bsz, hk, kd)
    v = x[:, 2 * hk * kd:].reshape(bsz, hv, vd)
    if spec.per_channel_gate:
        g = ref.kda_gate(a.reshape(bsz, hv, kd), A_log, dt_bias.reshape(hv, kd),
                         lower_bound=spec.gate_lower_bound)
    else:
        g = ref.gdn_gate(a, A_log, dt_bias)
    s = state if slots is None else _gather(state, slots)
    o, s = ref.decode_step(q.astype(jnp.float32), k, v, g, ref.gdn_beta(b), s, scale=spec.scale,
                           use_qk_l2norm=spec.use_qk_l2norm)
    y = ref.gated_rmsnorm(o.astype(jnp.float32), z.reshape(bsz, hv, vd), norm_weight,
                          eps=spec.norm_eps, activation=spec.norm_activation, out_dtype=out_dtype)
    if slots is None:
        return y, s.astype(state.dtype), new_win
    write = jnp.where(live, slots, -1)
    return (_mask_rows(y, live), _scatter(state, write, s), _scatter(windows, write, new_win))
