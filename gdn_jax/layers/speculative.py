"""Speculative decoding for the Flax blocks: verify T draft tokens, accept, decode, flush.

Works with `Qwen3NextGatedDeltaNet` and `KimiDeltaAttention` as they are (the block files are
not changed): the functions here take the block instance, run its projections, gates, norm and
output projection, and replace the conv and the delta rule by their pool + slot-table serving
forms from `gdn_jax.verify`.

    spec = Speculative(block, carry=True, exact=True)       # or the functions below
    state = spec.init_state(num_slots)                      # pools + stashes for the pool
    y, state = spec.verify(x_k, state, slots)               # x_k [B, T, hidden], T = 2..4
    state, invalid = spec.accept(state, slots, accepted)    # accepted [B] in 1..T
    y, state = spec.decode(x_1, state, slots)               # a plain one-token step
    state = spec.flush(state)                               # before export / dtype conversion

`slots` [B] int32 names each row's pool slot (-1: padding, nothing read or written).

The carried (write-on-accept) delta rule runs when `carry_engages` says so for this call (T in
2..4, state dtype vs flavour, head dims, an implementation, a stash of capacity >= T); else the
verify flushes the slot's pending rows and keeps every intermediate state (`candidates`), and
`accept` commits the accepted one. The short conv is always carried (its stash is tiny and the
carry is pure JAX). `decode` flushes first, then runs the decode kernel (`gdn_jax.decode`).

Exactness at this level: the delta-rule kernels are bit-identical to decode (exact flavour);
the block's projections run as one [B*T] matmul in verify and a [B] matmul in decode, so the
layer outputs agree with a token-by-token run to matmul rounding, not bitwise.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gdn_jax import decode as dec
from gdn_jax import reference as ref
from gdn_jax import verify as vf
from gdn_jax.layers.kimi import KimiDeltaAttention
from gdn_jax.layers.qwen3_next import Qwen3NextGatedDeltaNet

F32 = jnp.float32

__all__ = ["SpeculativeState", "Speculative", "init_speculative_state", "speculative_verify",
           "speculative_accept", "speculative_decode", "speculative_flush", "carry_request"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpeculativeState:
    """One layer's serving state for a pool of sequences.

    recurrent   [slots, HV, K, V]   delta-rule states H (fp32, fp16 or bf16)
    conv        [slots, W-1, C]     conv windows (last W-1 inputs, q | k | v channels)
    delta       DeltaStash          carried rows of the delta rule
    conv_stash  ConvStash           carried conv inputs
    candidates  [B, T, HV, K, V]    states after each token of a verify that did not carry,
                                    awaiting `accept`; None otherwise
    """
    recurrent: jax.Array
    conv: jax.Array
    delta: vf.DeltaStash
    conv_stash: vf.ConvStash
    candidates: jax.Array | None = None


# --------------------------------------------------------------------------- block adapters

@dataclasses.dataclass(frozen=True)
class _Dims:
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    per_channel_gate: bool


def _dims(block) -> _Dims:
    if isinstance(block, Qwen3NextGatedDeltaNet):
        c = block.config
        return _Dims(c.num_k_heads, c.num_v_heads, c.head_k_dim, c.head_v_dim, False)
    if isinstance(block, KimiDeltaAttention):
        c = block.config
        return _Dims(c.num_heads, c.num_v_heads, c.head_dim, c.head_v_dim, True)
    raise ValueError(f"block must be a Qwen3NextGatedDeltaNet or KimiDeltaAttention, got {type(block).__name__}")


def _front(block, x):
    """The block's projections and gates, as its __call__ computes them:
    -> (mixed [B, T, C] before the conv, g, beta, output gate z, compute dtype)."""
    c = block.config
    dtype = x.dtype if block.dtype is None else block.dtype
    bsz, t = x.shape[:2]
    if isinstance(block, Qwen3NextGatedDeltaNet):
        mixed, z, b, a = block._project(x, dtype)
        return mixed, ref.gdn_gate(a, block.A_log[...], block.dt_bias[...]), ref.gdn_beta(b), z, dtype
    mixed = jnp.concatenate([block.q_proj(x, dtype), block.k_proj(x, dtype), block.v_proj(x, dtype)], -1)
    g_raw = block.f_b_proj(block.f_a_proj(x, dtype), dtype).reshape(bsz, t, c.num_v_heads, c.head_dim)
    g = ref.kda_gate(g_raw, block.A_log[...], block.dt_bias[...], lower_bound=c.lower_bound)
    beta = jax.nn.sigmoid(block.b_proj(x, dtype).astype(F32))
    z = block.g_b_proj(block.g_a_proj(x, dtype), dtype).reshape(bsz, t, c.num_v_heads, c.head_v_dim)
    return mixed, g, beta, z, dtype


def _back(block, o, z, dtype, x_dtype):
    """Gated RMSNorm per head and the output projection, as the block's __call__ does."""
    c = block.config
    bsz, t = o.shape[:2]
    if isinstance(block, Qwen3NextGatedDeltaNet):
        o = ref.gated_rmsnorm(o, z, block.norm.weight[...], eps=c.rms_norm_eps, activation="silu",
                              out_dtype=dtype)
        return block.out_proj(o.reshape(bsz, t, c.value_dim), dtype).astype(x_dtype)
    o = ref.gated_rmsnorm(o, z, block.o_norm.weight[...], eps=c.rms_norm_eps, activation="sigmoid",
                          out_dtype=dtype)
    return block.o_proj(o.reshape(bsz, t, c.value_dim), dtype).astype(x_dtype)


def _split_qkv(mixed, d: _Dims):
    bsz, t = mixed.shape[:2]
    kd = d.num_k_heads * d.head_k_dim
    q = mixed[..., :kd].reshape(bsz, t, d.num_k_heads, d.head_k_dim)
    k = mixed[..., kd:2 * kd].reshape(bsz, t, d.num_k_heads, d.head_k_dim)
    v = mixed[..., 2 * kd:].reshape(bsz, t, d.num_v_heads, d.head_v_dim)
    return q, k, v


def _conv_params(block):
    return block.conv1d.weight[...], (None if block.conv1d.bias is None else block.conv1d.bias[...])


# --------------------------------------------------------------------------- API

def init_speculative_state(block, num_slots, *, dtype=jnp.float32, conv_dtype=jnp.float32,
                           capacity=vf.DEFAULT_STASH_CAPACITY) -> SpeculativeState:
    """Zero pools for `num_slots` sequences and empty stashes of `capacity` rows per slot."""
    d = _dims(block)
    base = block.init_state(num_slots, dtype=dtype, conv_dtype=conv_dtype)
    return SpeculativeState(
        recurrent=base.recurrent, conv=base.conv,
        delta=vf.DeltaStash.init(num_slots, num_v_heads=d.num_v_heads, num_k_heads=d.num_k_heads,
                                 head_k_dim=d.head_k_dim, head_v_dim=d.head_v_dim, capacity=capacity,
                                 per_channel_gate=d.per_channel_gate),
        conv_stash=vf.ConvStash.init(num_slots, conv_dim=base.conv.shape[2], capacity=capacity,
                                     dtype=conv_dtype))


def carry_request(block, state: SpeculativeState, num_tokens, *, carry=True, exact=True,
                  impl="auto", interpret=False) -> vf.CarryRequest:
    """The engage-decision inputs for a verify of `num_tokens` tokens on this block and state."""
    d = _dims(block)
    which = vf._resolve_impl(impl, interpret)
    available = which == "reference" or vf.kernel_available(
        num_tokens, d.head_k_dim, d.head_v_dim, state.recurrent.dtype, exact=exact, interpret=interpret)
    return vf.CarryRequest(requested=bool(carry), num_tokens=int(num_tokens),
                           state_dtype=state.recurrent.dtype, head_k_dim=d.head_k_dim,
                           head_v_dim=d.head_v_dim, exact=bool(exact), kernel_available=available,
                           stash_capacity=state.delta.capacity)


def speculative_verify(block, x, state: SpeculativeState, slots, *, carry=True, exact=True,
                       impl="auto", interpret=False):
    """Verify T tokens per row: x [B, T, hidden] -> (y [B, T, hidden], state). Nothing is
    committed until `speculative_accept`."""
    if not isinstance(state, SpeculativeState):
        raise ValueError(f"state must be a SpeculativeState, got {type(state).__name__}")
    if state.candidates is not None:
        raise ValueError("state holds an unaccepted verify: call speculative_accept first")
    d = _dims(block)
    if getattr(x, "ndim", None) != 3 or x.shape[-1] != block.config.hidden_size:
        raise ValueError(f"x must be [B, T, hidden_size={block.config.hidden_size}], got {getattr(x, 'shape', None)}")
    t = x.shape[1]
    engaged = vf.carry_engages(carry_request(block, state, t, carry=carry, exact=exact, impl=impl,
                                             interpret=interpret))
    mixed, g, beta, z, dtype = _front(block, x)
    weight, bias = _conv_params(block)
    mixed, conv, conv_stash = vf.conv_carried_verify(mixed, state.conv, state.conv_stash, slots,
                                                     weight, bias, activation="silu")
    q, k, v = _split_qkv(mixed, d)
    if engaged:
        o, recurrent, delta = vf.carried_verify(q, k, v, g, beta, state.recurrent, state.delta, slots,
                                                exact=exact, use_qk_l2norm=True, impl=impl,
                                                interpret=interpret)
        candidates = None
    else:
        # Declined: fold what the previous verify left pending before reading H.
        recurrent, delta = vf.flush(state.recurrent, state.delta, slots, impl=impl, interpret=interpret)
        o, candidates = vf.verify_states(q, k, v, g, beta, recurrent, slots, use_qk_l2norm=True,
                                         impl=impl, interpret=interpret)
    y = _back(block, o, z, dtype, x.dtype)
    return y, SpeculativeState(recurrent=recurrent, conv=conv, delta=delta, conv_stash=conv_stash,
                               candidates=candidates)


def speculative_accept(state: SpeculativeState, slots, accepted, *, num_tokens=None):
    """The verdict: accepted [B] in 1..T per live row. Returns (state, invalid [B] bool); a bad
    count raises ValueError when concrete, else leaves the row unchanged and flags it."""
    conv_stash, bad_conv = vf.accept(state.conv_stash, slots, accepted, num_tokens=num_tokens)
    if state.candidates is None:
        delta, bad = vf.accept(state.delta, slots, accepted, num_tokens=num_tokens)
        return dataclasses.replace(state, delta=delta, conv_stash=conv_stash), bad | bad_conv
    recurrent, bad = vf.commit_states(state.recurrent, state.candidates, slots, accepted)
    return (dataclasses.replace(state, recurrent=recurrent, conv_stash=conv_stash, candidates=None),
            bad | bad_conv)


def speculative_flush(state: SpeculativeState, slots=None, *, impl="auto", interpret=False):
    """Fold every pending row (delta rule and conv) of the named slots (None: all) into the pools."""
    if state.candidates is not None:
        raise ValueError("state holds an unaccepted verify: call speculative_accept first")
    recurrent, delta = vf.flush(state.recurrent, state.delta, slots, impl=impl, interpret=interpret)
    conv, conv_stash = vf.conv_flush(state.conv, state.conv_stash, slots)
    return dataclasses.replace(state, recurrent=recurrent, conv=conv, delta=delta, conv_stash=conv_stash)


def speculative_decode(block, x, state: SpeculativeState, slots, *, impl="auto", interpret=False):
    """One plain decode token per row on the pools: x [B, 1, hidden] -> (y [B, 1, hidden], state).
    Flushes the rows' pending stash first (decode reads H)."""
    if getattr(x, "ndim", None) != 3 or x.shape[1] != 1:
        raise ValueError(f"x must be [B, 1, hidden], got {getattr(x, 'shape', None)}")
    state = speculative_flush(state, slots, impl=impl, interpret=interpret)
    d = _dims(block)
    bsz = x.shape[0]
    mixed, g, beta, z, dtype = _front(block, x)
    weight, bias = _conv_params(block)
    mixed, conv = vf.pool_conv_step_reference(mixed[:, 0], state.conv, slots, weight, bias)
    o, recurrent = dec.gdn_decode_pool(
        mixed, g[:, 0].reshape(bsz, -1), beta[:, 0], state.recurrent, slots,
        num_k_heads=d.num_k_heads, num_v_heads=d.num_v_heads, head_k_dim=d.head_k_dim,
        head_v_dim=d.head_v_dim, per_channel_gate=d.per_channel_gate, use_qk_l2norm=True,
        impl=impl, interpret=interpret)
    y = _back(block, o[:, None], z, dtype, x.dtype)
    return y, dataclasses.replace(state, recurrent=recurrent, conv=conv)


class Speculative:
    """The block with `verify` / `accept` / `decode` / `flush` bound (static configuration:
    carry requested, flavour, impl). Holds no arrays; the state is passed in and returned."""

    def __init__(self, block, *, carry=True, exact=True, impl="auto", interpret=False):
        _dims(block)
        if impl not in vf.VERIFY_IMPLS:
            raise ValueError(f"impl must be one of {vf.VERIFY_IMPLS}, got {impl!r}")
        self.block, self.carry, self.exact, self.impl, self.interpret = block, carry, exact, impl, interpret

    def init_state(self, num_slots, **kw) -> SpeculativeState:
        return init_speculative_state(self.block, num_slots, **kw)

    def engages(self, state, num_tokens) -> bool:
        return vf.carry_engages(carry_request(self.block, state, num_tokens, carry=self.carry,
                                              exact=self.exact, impl=self.impl, interpret=self.interpret))

    def verify(self, x, state, slots):
        return speculative_verify(self.block, x, state, slots, carry=self.carry, exact=self.exact,
                                  impl=self.impl, interpret=self.interpret)

    def accept(self, state, slots, accepted, *, num_tokens=None):
        return speculative_accept(state, slots, accepted, num_tokens=num_tokens)

    def decode(self, x, state, slots):
        return speculative_decode(self.block, x, state, slots, impl=self.impl, interpret=self.interpret)

    def flush(self, state, slots=None):
        return speculative_flush(state, slots, impl=self.impl, interpret=self.interpret)
