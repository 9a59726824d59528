"""The short conv's carried window on a `ConvPool`: verify, flush and the plain decode step.

The conv window is carried like the delta rule's state (`gdn_jax.carry`): a verify of T tokens
folds the slot's pending inputs into its window, writes the window once, convolves the T
inputs from it and stashes them (`ConvStash.x`); after the verdict (`gdn_jax.carry.accept`,
which takes a ConvPool too) the accepted ones are pending, and whatever reads the window next
shifts them in first:

    y, conv_pool, refused = conv_carried_verify(x, conv_pool, slots, weight, bias)
    conv_pool, invalid = accept(conv_pool, slots, accepted)
    y, conv_pool = conv_step(x1, conv_pool, slots, weight, bias)   # folds the slot's pending inputs
    conv_pool = conv_flush(conv_pool)                              # before an export

Exact against T decode steps when the conv pool's dtype holds x exactly (the same dtype, or
fp32). Slot -1 (or outside the pool) is padding; a verify on a slot whose last verify has no
verdict is refused (ValueError when concrete, flagged and treated as padding under jit).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax import reference as ref
from gdn_jax import validate as chk
from gdn_jax.carry import _refuse_pending_verdicts, any_pending, awaiting_verdict, when_pending
from gdn_jax.state import ConvPool, ConvStash
from gdn_jax.verify import _gather, _live, _mask_rows, _scatter, normalise_slots

__all__ = ["conv_carried_verify", "conv_flush", "conv_step"]


def check_conv_pool(conv_pool, channels=None, width=None, name="conv_pool"):
    """A ConvPool whose stash has as many slots and channels as its windows."""
    if not isinstance(conv_pool, ConvPool):
        raise ValueError(f"{name} must be a gdn_jax.ConvPool (windows + stash), got {type(conv_pool).__name__}")
    windows, stash = conv_pool.windows, conv_pool.stash
    chk.array(f"{name}.windows", windows, rank=3, floating=True)
    chk.pool_slots(f"{name}.windows", windows)
    s, wm1, c = windows.shape
    if channels is not None and (c != channels or wm1 != width - 1):
        raise ValueError(f"{name}.windows must be [slots, W-1={width - 1}, C={channels}], got {tuple(windows.shape)}")
    if not isinstance(stash, ConvStash):
        raise ValueError(f"{name}.stash must be a ConvStash, got {type(stash).__name__}")
    if (len(stash.x.shape) != 3 or stash.x.shape[0] != s or stash.x.shape[2] != c
            or tuple(stash.pending.shape) != (s,) or tuple(stash.drafted.shape) != (s,)):
        raise ValueError(f"{name}.stash.x must be [slots={s}, capacity, C={c}] with [slots] counters, "
                         f"got x {tuple(stash.x.shape)}, pending {tuple(stash.pending.shape)}; build "
                         f"both with ConvPool.init(num_slots={s}, ...)")


def _check_step(x, conv_pool, slots, weight, bias, activation, rank):
    chk.array("x", x, rank=rank, floating=True)
    b, c = x.shape[0], x.shape[-1]
    chk.array("weight", weight, rank=2, floating=True)
    if weight.shape[0] != c:
        raise ValueError(f"weight must be [C={c}, W], got {chk.shape_of(weight)}")
    if bias is not None:
        chk.array("bias", bias, floating=True)
        chk.shape("bias", bias, (c,))
    chk.activation("activation", activation, ("silu", None))
    check_conv_pool(conv_pool, c, weight.shape[1])
    chk.slot_table("slots", slots, b, conv_pool.num_slots)


def _fold_window(window, rows, count):
    """Shift the first count[b] stashed inputs into each W-1 window: the last W-1 of
    [window, rows[:count]] (exactly what count decode steps leave)."""
    wm1 = window.shape[1]
    full = jnp.concatenate([window, rows.astype(window.dtype)], axis=1)
    idx = count[:, None] + jnp.arange(wm1, dtype=jnp.int32)[None, :]
    return jnp.take_along_axis(full, idx[:, :, None], axis=1)


def _folded_windows(conv_pool, slots):
    count = jnp.where(_live(slots), _gather(conv_pool.stash.pending, slots), 0)
    return _fold_window(_gather(conv_pool.windows, slots), _gather(conv_pool.stash.x, slots), count)


def conv_carried_verify(x, conv_pool: ConvPool, slots, weight, bias=None, *, activation="silu"):
    """Carried short conv for T verify tokens: x [B, T, C]. Counters after: pending = 0,
    drafted = T. Returns (y [B, T, C] in x's dtype, conv_pool, refused [B] bool); the pool is
    donated."""
    _check_step(x, conv_pool, slots, weight, bias, activation, rank=3)
    t = x.shape[1]
    if t < 1:
        raise ValueError(f"x must hold at least one token (T >= 1), got shape {x.shape}")
    if t > conv_pool.stash.capacity:
        raise ValueError(f"x holds T={t} tokens, more than the conv stash capacity {conv_pool.stash.capacity}")
    _refuse_pending_verdicts(conv_pool.stash.drafted,
                             np.asarray(slots) if chk.is_concrete(slots) else None, "conv verify")
    slots = normalise_slots(slots, conv_pool.num_slots)
    refused = awaiting_verdict(conv_pool.stash.drafted, slots)
    y, conv_pool = _conv_carried_verify(x, conv_pool, jnp.where(refused, -1, slots), weight, bias,
                                        activation=activation)
    return y, conv_pool, refused


@functools.partial(jax.jit, static_argnames=("activation",), donate_argnames=("conv_pool",))
def _conv_carried_verify(x, conv_pool, slots, weight, bias, *, activation):
    t = x.shape[1]
    live = _live(slots)
    window = _folded_windows(conv_pool, slots)
    y, _ = ref.causal_conv1d(x, weight, bias, conv_state=window, activation=activation)
    write = jnp.where(live, slots, -1)
    stash = conv_pool.stash
    rows = _gather(stash.x, slots).at[:, :t].set(x.astype(stash.x.dtype))
    stash = dataclasses.replace(
        stash, x=_scatter(stash.x, write, rows),
        pending=_scatter(stash.pending, write, jnp.zeros_like(slots)),
        drafted=_scatter(stash.drafted, write, jnp.full_like(slots, t)))
    return _mask_rows(y, live), ConvPool(windows=_scatter(conv_pool.windows, write, window), stash=stash)


def conv_flush(conv_pool: ConvPool, slots=None):
    """Shift every pending conv input into its window and set pending = 0 (slots None: the
    whole pool). Returns the conv pool (donated)."""
    check_conv_pool(conv_pool)
    if slots is None:
        slots = jnp.arange(conv_pool.num_slots, dtype=jnp.int32)
    chk.array("slots", slots, rank=1, integer=True)
    chk.slot_table("slots", slots, slots.shape[0], conv_pool.num_slots)
    slots = normalise_slots(slots, conv_pool.num_slots)
    return when_pending(any_pending(conv_pool.stash.pending, slots),
                        lambda p: (conv_fold_pending(p, slots),), (conv_pool,),
                        rows=slots.shape[0])[0]


def conv_fold_pending(conv_pool: ConvPool, slots):
    """Shift the pending inputs of the named slots (a normalised slot table) into their windows,
    unconditionally (`conv_flush` skips it when nothing is pending)."""
    return _conv_flush(conv_pool, slots)


@functools.partial(jax.jit, donate_argnames=("conv_pool",))
def _conv_flush(conv_pool, slots):
    write = jnp.where(_live(slots), slots, -1)
    window = _folded_windows(conv_pool, slots)
    stash = dataclasses.replace(conv_pool.stash,
                                pending=_scatter(conv_pool.stash.pending, write, jnp.zeros_like(slots)))
    return ConvPool(windows=_scatter(conv_pool.windows, write, window), stash=stash)


def read_windows(conv_pool: ConvPool, slots):
    """The named slots' windows (a normalised slot table) with their pending inputs shifted in:
    [B, W-1, C], zero rows for padding. With `write_windows` this is a fold that moves only the
    B windows read (a block's prefill reads them anyway)."""
    return _mask_rows(_folded_windows(conv_pool, slots), _live(slots))


def write_windows(conv_pool: ConvPool, slots, windows):
    """Write windows [B, W-1, C] into the named slots and mark their pending inputs folded
    (pending = 0): the other half of `read_windows`. Padding rows write nothing."""
    write = jnp.where(_live(slots), slots, -1)
    stash = dataclasses.replace(conv_pool.stash, pending=_scatter(conv_pool.stash.pending, write,
                                                                  jnp.zeros_like(slots)))
    return ConvPool(windows=_scatter(conv_pool.windows, write, windows), stash=stash)


def conv_step(x, conv_pool: ConvPool, slots, weight, bias=None, *, activation="silu"):
    """One plain conv decode token per row on the pool: x [B, C]. The slot's pending inputs are
    shifted in first. Returns (y [B, C], conv_pool) (donated)."""
    _check_step(x, conv_pool, slots, weight, bias, activation, rank=2)
    return _conv_step(x, conv_pool, normalise_slots(slots, conv_pool.num_slots), weight, bias,
                      activation=activation)


@functools.partial(jax.jit, static_argnames=("activation",), donate_argnames=("conv_pool",))
def _conv_step(x, conv_pool, slots, weight, bias, *, activation):
    live = _live(slots)
    write = jnp.where(live, slots, -1)
    y, window = ref.causal_conv1d_step(x, _folded_windows(conv_pool, slots), weight, bias,
                                       activation=activation)
    stash = dataclasses.replace(conv_pool.stash,
                                pending=_scatter(conv_pool.stash.pending, write, jnp.zeros_like(slots)))
    return _mask_rows(y, live), ConvPool(windows=_scatter(conv_pool.windows, write, window), stash=stash)
