"""The one-launch block decode (`gdn_jax.conv_decode`, the decode kernel's `fused_conv` flag):
conv window update, conv + SiLU, q/k L2 norm, raw gates, recurrence and gated RMSNorm in one
kernel, on contiguous states and on pools with a slot table.

Oracle: the unfused chain (impl="reference": the references composed in the blocks' order), on
fresh random inputs; fp32 <= 1e-5 relative, 16-bit states <= 5e-3. Through the blocks: the
fused decode (impl="auto" in interpret mode / on the GPU) against the same block's unfused
chain, for the state, the conv windows and the outputs.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import gdn_jax
from conftest import KERNEL_MODES, interpret_flag
from gdn_jax import dispatch
from gdn_jax.conv_decode import conv_decode
from gdn_jax.layers import GDNConfig, KDAConfig, KimiDeltaAttention, Qwen3NextGatedDeltaNet
from helpers import jit_block, rel_err

F32, BF16 = jnp.float32, jnp.bfloat16
TOL = 1e-5
TOL16 = 5e-3

# (name, per-channel gate, lower bound, norm activation)
CORES = [("gdn", False, None, "silu"), ("kda-softplus", True, None, "sigmoid"),
         ("kda-lower-bound", True, -5.0, "sigmoid")]


def _core_inputs(seed, *, B, rows, per_channel, HK=1, HV=2, K=16, V=16, W=4, bias=True,
                 state_dtype=F32):
    ks = iter(jax.random.split(jax.random.PRNGKey(seed), 16))
    rnd = lambda *shape: jax.random.normal(next(ks), shape, F32)
    C = 2 * HK * K + HV * V
    gk = K if per_channel else 1
    arrays = dict(mixed=rnd(B, C), a=rnd(B, HV * gk), b=rnd(B, HV), z=rnd(B, HV, V),
                  state=(0.3 * rnd(rows, HV, K, V)).astype(state_dtype), windows=rnd(rows, W - 1, C))
    params = dict(conv_weight=0.5 * rnd(C, W), conv_bias=rnd(C) if bias else None,
                  A_log=0.3 * rnd(HV), dt_bias=rnd(HV * gk), norm_weight=1.0 + 0.1 * rnd(V),
                  num_k_heads=HK, num_v_heads=HV, head_k_dim=K, head_v_dim=V,
                  per_channel_gate=per_channel, use_qk_l2norm=True)
    return arrays, params


def _run(arrays, params, slots, **kw):
    a = {k: jnp.copy(v) for k, v in arrays.items()}   # state and windows are donated
    return conv_decode(a["mixed"], a["a"], a["b"], a["z"], a["state"], a["windows"], slots,
                       **params, **kw)


# --------------------------------------------------------------------------- the kernel call

@pytest.mark.parametrize("mode", KERNEL_MODES)
@pytest.mark.parametrize("name, per_channel, lower_bound, act, pooled", [
    (*CORES[0], True), (*CORES[2], False)], ids=["gdn-pool", "kda-lower-bound-contiguous"])
def test_conv_decode_kernel_matches_unfused_chain(mode, name, per_channel, lower_bound, act, pooled):
    B = 3
    rows = 5 if pooled else B
    # HK=1, HV=2: one program owns a key-head group of two value heads (grouped heads).
    arrays, params = _core_inputs(7, B=B, rows=rows, per_channel=per_channel, bias=pooled)
    params.update(lower_bound=lower_bound, norm_activation=act)
    slots = jnp.array([3, -1, 0], jnp.int32) if pooled else None
    y0, s0, w0 = _run(arrays, params, slots, impl="reference")
    y1, s1, w1 = _run(arrays, params, slots, impl="pallas", interpret=interpret_flag(mode))
    assert y1.shape == (B, 2, 16) and y1.dtype == F32
    assert rel_err(y1, y0) <= TOL and rel_err(s1, s0) <= TOL and rel_err(w1, w0) <= TOL
    assert float(jnp.max(jnp.abs(y0))) > 0.1          # not a trivially small output
    if pooled:
        # The padding row's output is written (zero, not whatever the buffer held); slots not
        # named are bit-for-bit untouched, state and windows alike.
        assert bool(jnp.all(y1[1] == 0))
        for s in (1, 2, 4):
            assert bool(jnp.all(s1[s] == arrays["state"][s]))
            assert bool(jnp.all(w1[s] == arrays["windows"][s]))
        assert not bool(jnp.all(w1[3] == arrays["windows"][3]))   # named slots did move


@pytest.mark.parametrize("mode", KERNEL_MODES)
@pytest.mark.parametrize("state_dtype", [jnp.float16], ids=["f16"])   # bf16: through the blocks
def test_conv_decode_16bit_state(mode, state_dtype):
    arrays, params = _core_inputs(11, B=2, rows=4, per_channel=False, state_dtype=state_dtype)
    slots = jnp.array([1, 3], jnp.int32)
    y0, s0, w0 = _run(arrays, params, slots, impl="reference")
    y1, s1, w1 = _run(arrays, params, slots, impl="pallas", interpret=interpret_flag(mode))
    assert s1.dtype == state_dtype
    assert rel_err(y1, y0) <= TOL16 and rel_err(s1, s0) <= TOL16 and rel_err(w1, w0) <= TOL


@pytest.mark.parametrize("mode", KERNEL_MODES)
def test_conv_decode_bf16_inputs_vs_float64(mode):
    """bf16 projections and conv windows against a float64 run of the same composition."""
    arrays, params = _core_inputs(13, B=2, rows=2, per_channel=True, HK=2, HV=2)
    params.update(lower_bound=None, norm_activation="sigmoid")
    a16 = {k: (v if k == "state" else v.astype(BF16)) for k, v in arrays.items()}
    y1, s1, w1 = _run(a16, params, None, impl="pallas", interpret=interpret_flag(mode))
    call = gdn_jax.conv_decode.conv_decode_call(
        a16["mixed"], a16["a"], a16["b"], a16["z"], a16["state"], a16["windows"], None, **params)
    with jax.enable_x64(True):
        a64 = {k: jnp.asarray(np.asarray(v.astype(F32)), jnp.float64) for k, v in a16.items()}
        p64 = {k: (jnp.asarray(np.asarray(v), jnp.float64) if hasattr(v, "dtype") else v)
               for k, v in params.items()}
        from gdn_jax.conv_decode import _reference
        y64, s64, _ = _reference(a64["mixed"], a64["a"], a64["b"], a64["z"], a64["state"],
                                 a64["windows"], None, p64["conv_weight"], p64["conv_bias"],
                                 p64["A_log"], p64["dt_bias"], p64["norm_weight"],
                                 spec=call.spec, out_dtype=jnp.float64)
        y64, s64 = np.asarray(y64), np.asarray(s64)
    assert y1.dtype == BF16
    assert rel_err(y1, y64) <= TOL16 and rel_err(s1, s64) <= TOL16
    assert bool(jnp.all(w1[:, -1] == a16["mixed"]))      # the new input went in last, unrounded


def test_conv_decode_validates_once_naming_the_argument():
    arrays, params = _core_inputs(3, B=2, rows=2, per_channel=False)
    bad = dict(params, conv_weight=params["conv_weight"][:, :3])
    with pytest.raises(ValueError, match="windows"):
        _run(arrays, bad, None, impl="reference")
    with pytest.raises(ValueError, match="conv_weight"):
        _run(arrays, dict(params, conv_weight=params["conv_weight"][1:]), None, impl="reference")
    with pytest.raises(ValueError, match="slots"):
        _run(arrays, params, jnp.array([0, 5], jnp.int32), impl="reference")
    with pytest.raises(ValueError, match="lower_bound"):
        _run(arrays, dict(params, lower_bound=-1.0), None, impl="reference")
    # A head dim the kernel cannot tile: impl="pallas" says why, "auto" runs the unfused chain.
    odd, odd_params = _core_inputs(3, B=2, rows=2, per_channel=False, K=24, V=16)
    with gdn_jax.interpret(), pytest.raises(ValueError, match="K=24"):
        _run(odd, odd_params, None, impl="pallas")
    with gdn_jax.interpret():
        y, _, _ = _run(odd, odd_params, None, impl="auto")
    assert np.all(np.isfinite(np.asarray(y)))


def test_dispatch_names_the_fused_family():
    arrays, params = _core_inputs(5, B=2, rows=2, per_channel=False)
    args = [arrays[k] for k in ("mixed", "a", "b", "z", "state", "windows")]
    assert "conv_decode" in dispatch.operations()
    with gdn_jax.interpret():
        assert gdn_jax.explain("conv_decode", *args, **params).impl == "pallas"
    with gdn_jax.interpret(False):
        choice = gdn_jax.explain("conv_decode", *args, **params)
    assert choice.impl == "reference" and ("GPU" in choice.reason or "gpu" in choice.reason)


# --------------------------------------------------------------------------- through the blocks

def _block(kind, *, hidden=32):
    if kind == "gdn":   # grouped value heads: HK=1, HV=2
        cfg = GDNConfig(hidden_size=hidden, num_k_heads=1, num_v_heads=2, head_k_dim=16,
                        head_v_dim=16, conv_bias=True)
        return Qwen3NextGatedDeltaNet(cfg, rngs=nnx.Rngs(0))
    cfg = KDAConfig(hidden_size=hidden, num_heads=2, head_dim=16,
                    lower_bound=-5.0 if kind == "kda-lower-bound" else None)
    return KimiDeltaAttention(cfg, rngs=nnx.Rngs(1))


BLOCKS = ["gdn", "kda-softplus", "kda-lower-bound"]


def _x(seed, B, T, hidden=32):
    return jax.random.normal(jax.random.PRNGKey(seed), (B, T, hidden), F32)


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def _reference(block, op="__call__", **static):
    """`block.<op>(..., impl="reference")` as one jitted program (`helpers.jit_block`): the
    unfused chain the fused call is compared with, and the set-up steps, compile a few whole
    programs instead of dispatching op by op (most of this file's CPU time). The fused call
    under test runs as a caller writes it."""
    return jit_block(block, op, impl="reference", **static)


def _kernel_ctx(mode):
    return gdn_jax.interpret() if mode == "interpret" else gdn_jax.interpret(False)


def _assert_serving_close(a, b, tol=TOL):
    assert rel_err(a.delta.states, b.delta.states) <= tol
    assert rel_err(a.conv.windows, b.conv.windows) <= tol
    assert bool(jnp.all(a.delta.stash.pending == b.delta.stash.pending))
    assert bool(jnp.all(a.conv.stash.pending == b.conv.stash.pending))


def _explain_serving(block, serving, slots):
    """The dispatch's choice for one decode token of `block` on `serving` (shapes only)."""
    c, d, bsz = block.config, block._dims(), slots.shape[0]
    sds = lambda *shape: jax.ShapeDtypeStruct((bsz,) + shape, F32)
    weight, bias = block._conv_params()
    return gdn_jax.explain(
        "conv_decode", sds(c.conv_dim), sds(d.num_v_heads * (d.head_k_dim if d.per_channel_gate else 1)),
        sds(d.num_v_heads), sds(d.num_v_heads, d.head_v_dim), serving.delta.states,
        serving.conv.windows, slots, conv_weight=weight, conv_bias=bias,
        num_k_heads=d.num_k_heads, num_v_heads=d.num_v_heads, head_k_dim=d.head_k_dim,
        head_v_dim=d.head_v_dim, per_channel_gate=d.per_channel_gate, use_qk_l2norm=True,
        **block._core_params())


@pytest.mark.parametrize("mode", KERNEL_MODES)
@pytest.mark.parametrize("kind", BLOCKS)
def test_block_serving_decode_fused_equals_unfused(mode, kind):
    block = _block(kind)
    slots = jnp.array([2, -1, 0], jnp.int32)
    serving = block.init_serving_state(4)
    _, serving = _reference(block, "prefill", fresh=True)(_x(0, 3, 5), serving, slots)
    x = _x(1, 3, 1)
    y0, s0 = _reference(block, "decode")(x, _copy(serving), slots)
    with _kernel_ctx(mode):
        assert _explain_serving(block, serving, slots).impl == "pallas"
        y1, s1 = block.decode(x, _copy(serving), slots, impl="auto")
    assert rel_err(y1, y0) <= TOL
    _assert_serving_close(s1, s0)
    assert bool(jnp.all(y1[1] == 0))                             # padding row
    for s in (1, 3):                                             # slots not named: untouched
        assert bool(jnp.all(s1.delta.states[s] == serving.delta.states[s]))
        assert bool(jnp.all(s1.conv.windows[s] == serving.conv.windows[s]))


@pytest.mark.parametrize("mode", KERNEL_MODES)
@pytest.mark.parametrize("kind", ["gdn"])
def test_block_decode_folds_pending_verify_rows_first(mode, kind):
    """prefill -> carried verify -> accept leaves delta and conv rows pending; the fused decode
    folds them before reading H, like the unfused chain."""
    block = _block(kind)
    slots = jnp.array([0, 3], jnp.int32)
    serving = block.init_serving_state(4)
    _, serving = _reference(block, "prefill", fresh=True)(_x(2, 2, 4), serving, slots)
    _, serving, refused = _reference(block, "verify")(_x(3, 2, 3), serving, slots)
    assert block.carry_engages(serving, 3) and not bool(jnp.any(refused))
    serving, _ = block.accept(serving, slots, jnp.array([2, 1], jnp.int32))
    assert bool(jnp.all(serving.delta.stash.pending[jnp.array([0, 3])] > 0))
    x = _x(4, 2, 1)
    y0, s0 = _reference(block, "decode")(x, _copy(serving), slots)
    with _kernel_ctx(mode):
        y1, s1 = block.decode(x, _copy(serving), slots, impl="auto")
    assert rel_err(y1, y0) <= TOL
    _assert_serving_close(s1, s0)
    assert bool(jnp.all(s1.delta.stash.pending == 0)) and bool(jnp.all(s1.conv.stash.pending == 0))


@pytest.mark.parametrize("mode", KERNEL_MODES)
@pytest.mark.parametrize("kind", ["kda-softplus"])
def test_block_decode_16bit_state_pool(mode, kind):
    block = _block(kind)
    slots = jnp.array([1, -1], jnp.int32)
    serving = block.init_serving_state(3, dtype=BF16)
    _, serving = _reference(block, "prefill", fresh=True)(_x(5, 2, 4), serving, slots)
    x = _x(6, 2, 1)
    y0, s0 = _reference(block, "decode")(x, _copy(serving), slots)
    with _kernel_ctx(mode):
        y1, s1 = block.decode(x, _copy(serving), slots, impl="auto")
    assert s1.delta.states.dtype == BF16
    assert rel_err(y1, y0) <= TOL16
    _assert_serving_close(s1, s0, TOL16)


@pytest.mark.parametrize("mode", KERNEL_MODES)
@pytest.mark.parametrize("kind", ["gdn", "kda-lower-bound"])
def test_block_prefill_then_fused_decode_equals_one_call(mode, kind):
    """__call__ with T = 1 runs the one-launch kernel; a prefill + such a step reproduce one
    full-sequence call, and the step matches the unfused chain (state and conv window)."""
    block = _block(kind)
    x = _x(7, 2, 5)
    reference = _reference(block)
    y_all, s_all = reference(x)
    y, state = reference(x[:, :4])
    ys = [y]
    for t in (4,):
        y0, st0 = reference(x[:, t:t + 1], state)
        with _kernel_ctx(mode):
            y1, st1 = block(x[:, t:t + 1], state, impl="auto")
        assert not state.recurrent.is_deleted()       # an eager call keeps the caller's state
        assert rel_err(y1, y0) <= TOL and rel_err(st1.recurrent, st0.recurrent) <= TOL
        assert rel_err(st1.conv, st0.conv) <= TOL
        ys.append(y1)
        state = st1
    assert rel_err(jnp.concatenate(ys, 1), y_all) <= TOL
    assert rel_err(state.recurrent, s_all.recurrent) <= TOL and rel_err(state.conv, s_all.conv) <= TOL


# --------------------------------------------------------------------------- no state copies

def _state_copies(hlo: str, shape) -> list[str]:
    """The copies in compiled HLO text whose result has this shape: copy / copy-done ops and
    fusions XLA made of a lone copy (named like "wrapped_copy")."""
    dims = ",".join(str(n) for n in shape)
    inst = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.-]+)\s*=\s*\(?\w+\[" + re.escape(dims)
                      + r"\]\S*\s+([\w-]+)\(")
    found = []
    for line in hlo.splitlines():
        m = inst.search(line)
        if m and (m.group(2) in ("copy", "copy-start", "copy-done")
                  or (m.group(2) == "fusion" and "copy" in m.group(1))):
            found.append(line.strip())
    return found


def test_state_copy_counter_sees_a_copy():
    """The counter finds a state-sized copy where XLA must make one: a non-donated state whose
    old value is returned beside the new one."""
    shape = (4, 2, 16, 16)

    def fn(s):
        return s, s.at[0].add(1.0)

    hlo = jax.jit(fn).lower(jnp.zeros(shape)).compile().as_text()
    assert len(_state_copies(hlo, shape)) >= 1


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gdn", "kda-softplus"])
@pytest.mark.parametrize("path", ["call", "serving"])
def test_donated_block_decode_step_has_no_state_copy(kind, path):
    """A jitted, donated block decode step reads and writes each recurrent state once: the
    compiled program holds no copy of a state-sized (or pool-sized) buffer, and the one kernel
    launch updates state and conv windows in place."""
    block = _block(kind, hidden=64)
    graphdef, params = nnx.split(block)
    B = 8
    x = _x(8, B, 1, 64)
    if path == "call":
        state = block.init_state(B)

        @functools.partial(jax.jit, donate_argnums=2)
        def step(params, x, state):
            return nnx.merge(graphdef, params)(x, state)

        shapes = [state.recurrent.shape, state.conv.shape]
    else:
        state = block.init_serving_state(B + 2)
        slots = jnp.arange(B, dtype=jnp.int32)

        @functools.partial(jax.jit, donate_argnums=2)
        def step(params, x, state):
            return nnx.merge(graphdef, params).decode(x, state, slots)

        shapes = [state.delta.states.shape, state.conv.windows.shape]
    probe = state if path == "call" else None
    if probe is not None:   # the one-launch kernel takes this call (else the test means little)
        assert block._one_launch(x, probe.recurrent, probe.conv, None, "auto") is not None
    hlo = step.lower(params, x, state).compile().as_text()
    for shape in shapes:
        assert _state_copies(hlo, shape) == []


# --------------------------------------------------------------------------- Triton lowering

@pytest.mark.parametrize("per_channel, pooled, bias, state_dtype", [
    (False, True, True, F32), (True, False, False, BF16)], ids=["gdn-pool-f32", "kda-bf16"])
def test_fused_conv_lowers_to_triton_ir(lower_for_h200, per_channel, pooled, bias, state_dtype):
    """The fused-conv variant lowers to Triton IR for an H200 (sm_90) without a GPU, at the
    Qwen3-Next head shape (K = V = 128, two value heads per key head): the Pallas -> Triton
    lowering runs in Python; only the PTX compile needs the device."""
    from pallas_kernels import gdn_decode as kern
    B, HK, HV, K, W = 4, 2, 4, 128, 4
    C = 2 * HK * K + HV * K
    gk = K if per_channel else 1
    spec = kern.DecodeSpec(num_k_heads=HK, num_v_heads=HV, head_k_dim=K, head_v_dim=K, scale=0.1,
                           k_col=HK * K, v_col=2 * HK * K, raw_gates=True,
                           per_channel_gate=per_channel, use_qk_l2norm=True, pooled=pooled,
                           fused_norm=True, norm_activation="sigmoid" if per_channel else "silu",
                           fused_conv=True, conv_width=W, conv_bias=bias)
    rows = 6 if pooled else B
    sds = jax.ShapeDtypeStruct
    mixed = sds((B, C), BF16)
    conv = (sds((C, W), BF16), sds((C,), BF16) if bias else None, sds((rows, W - 1, C), BF16))
    args = (mixed, mixed, mixed, sds((B, HV * gk), BF16), sds((B, HV), BF16), sds((HV,), F32),
            sds((HV * gk,), F32), sds((B,), jnp.int32) if pooled else None, None,
            sds((B, HV * K), BF16),
            sds((K,), F32), sds((rows, HV, K, K), state_dtype), conv)
    block = kern.default_block_sizes(B, K, state_dtype, True)
    assert kern.unsupported_reason(spec, block, state_dtype) is None
    hlo = kern._launch.trace(*args, spec=spec, block=block, out_dtype=jnp.dtype(BF16),
                             interpret=False).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in hlo and "output_operand_aliases" in hlo
