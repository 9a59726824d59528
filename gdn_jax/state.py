"""Layer state as explicit pytrees: frozen, registered dataclasses that jit, donate and shard.

Per-sequence state of one layer (`GDNState`, `KDAState`):
  recurrent  [B, HV, K, V]     the delta-rule state S (K-major), fp32 unless a 16-bit dtype is chosen
  conv       [B, W-1, C]       the short conv's last W-1 inputs, time-major (see
                               reference.causal_conv1d); C = 2 * HK * K + HV * V (q | k | v)

Serving state of one layer for a pool of sequences (slots), each pool with the stash of its
carried verify, so that nothing reads a pool without its pending rows:
  DeltaPool  states [slots, HV, K, V] + DeltaStash
  ConvPool   windows [slots, W-1, C] + ConvStash
The operations on them are in `gdn_jax.carry` (delta rule) and `gdn_jax.conv_carry` (conv);
`gdn_decode_pool` and `convert_state` take a DeltaPool and fold its pending rows first.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gdn_jax import validate as chk

F32 = jnp.float32
DEFAULT_STASH_CAPACITY = 4

__all__ = ["GDNState", "KDAState", "DeltaStash", "ConvStash", "DeltaPool", "ConvPool", "ServingState",
           "DEFAULT_STASH_CAPACITY"]


def _count(name, val):
    return chk.count(name, val)


def _init(cls, batch_size, *, num_v_heads, head_k_dim, head_v_dim, conv_dim, conv_width,
          dtype=jnp.float32, conv_dtype=jnp.float32):
    for name, val in (("batch_size", batch_size), ("num_v_heads", num_v_heads),
                      ("head_k_dim", head_k_dim), ("head_v_dim", head_v_dim), ("conv_dim", conv_dim),
                      ("conv_width", conv_width)):
        _count(name, val)
    chk.state_dtype("dtype", dtype)
    chk.float_dtype("conv_dtype", conv_dtype)
    return cls(recurrent=jnp.zeros((batch_size, num_v_heads, head_k_dim, head_v_dim), dtype),
               conv=jnp.zeros((batch_size, conv_width - 1, conv_dim), conv_dtype))


@dataclasses.dataclass(frozen=True)
class _LayerState:
    """recurrent [B, HV, K, V] and conv [B, W-1, conv_dim]; one subclass per layer kind, so a
    block can tell a state of its own kind from another's."""
    recurrent: jax.Array
    conv: jax.Array

    init = classmethod(_init)

    @property
    def batch_size(self) -> int:
        return self.recurrent.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GDNState(_LayerState):
    """State of one Gated DeltaNet layer for a batch of sequences."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KDAState(_LayerState):
    """State of one Kimi Delta Attention layer for a batch of sequences."""


# --------------------------------------------------------------------------- carried-verify stashes

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeltaStash:
    """Per-slot stash of the carried-state verify for one delta-rule layer.

    k        [slots, 2, HK, C, K]   prepared keys (L2-normed when asked), fp32, one row per key
                                    head (the HV / HK value heads of a group share it)
    u        [slots, 2, HV, C, V]   deltas beta (v - S^T k) on the decayed S, fp32
    g        [slots, 2, HV, C]      GDN log decays, or [slots, 2, HV, C, K] for KDA, fp32
    bank     [slots] int32          which of the two banks holds the slot's rows
    pending  [slots] int32          accepted rows of that bank not yet folded into H
    drafted  [slots] int32          rows of the last verify awaiting the verdict
    C is the capacity: the largest verify width this stash takes.
    """
    k: jax.Array
    u: jax.Array
    g: jax.Array
    bank: jax.Array
    pending: jax.Array
    drafted: jax.Array

    @classmethod
    def init(cls, num_slots, *, num_v_heads, head_k_dim, head_v_dim, num_k_heads=None,
             capacity=DEFAULT_STASH_CAPACITY, per_channel_gate=False):
        """An empty stash (nothing pending) for a pool of `num_slots` states. `num_k_heads`
        (default: num_v_heads) is the layer's key-head count: the k rows are kept once per key
        head, so grouped value heads (GVA) need it."""
        hk = num_v_heads if num_k_heads is None else num_k_heads
        for name, val in (("num_slots", num_slots), ("num_v_heads", num_v_heads),
                          ("num_k_heads", hk), ("head_k_dim", head_k_dim),
                          ("head_v_dim", head_v_dim), ("capacity", capacity)):
            _count(name, val)
        if int(num_v_heads) % int(hk):
            raise ValueError(f"num_v_heads={num_v_heads} must be a multiple of num_k_heads={hk}")
        s, hv, c = int(num_slots), int(num_v_heads), int(capacity)
        gshape = (s, 2, hv, c, head_k_dim) if per_channel_gate else (s, 2, hv, c)
        # Separate buffers per counter: a donated pytree must not hold one buffer twice.
        zeros_i = lambda: jnp.zeros((s,), jnp.int32)
        return cls(k=jnp.zeros((s, 2, int(hk), c, head_k_dim), F32), u=jnp.zeros((s, 2, hv, c, head_v_dim), F32),
                   g=jnp.zeros(gshape, F32), bank=zeros_i(), pending=zeros_i(), drafted=zeros_i())

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def per_channel_gate(self) -> bool:
        return self.g.ndim == 5

    @property
    def num_slots(self) -> int:
        return self.k.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ConvStash:
    """Per-slot stash of the carried conv window: the verify's conv inputs.

    x        [slots, C, conv_dim]  the last verify's inputs, in the conv pool's dtype
    pending  [slots] int32         accepted inputs not yet shifted into the window
    drafted  [slots] int32         inputs of the last verify awaiting the verdict
    """
    x: jax.Array
    pending: jax.Array
    drafted: jax.Array

    @classmethod
    def init(cls, num_slots, *, conv_dim, capacity=DEFAULT_STASH_CAPACITY, dtype=jnp.float32):
        for name, val in (("num_slots", num_slots), ("conv_dim", conv_dim), ("capacity", capacity)):
            _count(name, val)
        return cls(x=jnp.zeros((int(num_slots), int(capacity), int(conv_dim)), dtype),
                   pending=jnp.zeros((int(num_slots),), jnp.int32),
                   drafted=jnp.zeros((int(num_slots),), jnp.int32))

    @property
    def capacity(self) -> int:
        return self.x.shape[1]



# --------------------------------------------------------------------------- pools

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeltaPool:
    """The delta-rule states of a pool of sequences with their carried-verify stash.

    states  [slots, HV, K, V]  H of every slot (fp32, fp16 or bf16); rows stashed as pending
                               are not in H yet: read H only through the functions that fold them
    stash   DeltaStash         the pending and drafted rows of each slot
    """
    states: jax.Array
    stash: DeltaStash

    @classmethod
    def init(cls, num_slots, *, num_k_heads, num_v_heads, head_k_dim, head_v_dim,
             dtype=jnp.float32, capacity=DEFAULT_STASH_CAPACITY, per_channel_gate=False):
        """Zero states and an empty stash for `num_slots` sequences."""
        for name, val in (("num_slots", num_slots), ("num_k_heads", num_k_heads),
                          ("num_v_heads", num_v_heads), ("head_k_dim", head_k_dim),
                          ("head_v_dim", head_v_dim)):
            _count(name, val)
        chk.state_dtype("dtype", dtype)
        return cls(states=jnp.zeros((num_slots, num_v_heads, head_k_dim, head_v_dim), dtype),
                   stash=DeltaStash.init(num_slots, num_k_heads=num_k_heads, num_v_heads=num_v_heads,
                                         head_k_dim=head_k_dim, head_v_dim=head_v_dim,
                                         capacity=capacity, per_channel_gate=per_channel_gate))

    @property
    def num_slots(self) -> int:
        return self.states.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ConvPool:
    """The conv windows of a pool of sequences with their carried-verify stash.

    windows  [slots, W-1, C]  the last W-1 conv inputs of every slot (pending ones not yet in)
    stash    ConvStash        the pending and drafted inputs of each slot
    """
    windows: jax.Array
    stash: ConvStash

    @classmethod
    def init(cls, num_slots, *, conv_dim, conv_width, dtype=jnp.float32,
             capacity=DEFAULT_STASH_CAPACITY):
        for name, val in (("num_slots", num_slots), ("conv_dim", conv_dim), ("conv_width", conv_width)):
            _count(name, val)
        chk.float_dtype("dtype", dtype)
        return cls(windows=jnp.zeros((num_slots, conv_width - 1, conv_dim), dtype),
                   stash=ConvStash.init(num_slots, conv_dim=conv_dim, capacity=capacity, dtype=dtype))

    @property
    def num_slots(self) -> int:
        return self.windows.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ServingState:
    """One block's serving state for a pool of sequences (see the blocks' `prefill`, `decode`,
    `verify`, `accept`, `flush`).

    delta       DeltaPool                 delta-rule states + carried-verify stash
    conv        ConvPool                  conv windows + carried conv inputs
    candidates  [B, T, HV, K, V] or None  states after each token of a verify that did not
                                          carry, awaiting `accept`
    """
    delta: DeltaPool
    conv: ConvPool
    candidates: jax.Array | None = None

    @property
    def num_slots(self) -> int:
        return self.delta.num_slots
