"""Tensor parallelism for the two blocks: their heads split over the "tp" axis of a device mesh.

With `mesh=` (a `jax.sharding.Mesh` with an axis named "tp" of P devices) a block keeps on
device d the key-head groups d*HK/P .. (d+1)*HK/P - 1 and their value heads (whole GVA groups,
so every value head reads a key head of its own device):

    input projections     rows split by head (Qwen3-Next's interleaved in_proj_qkvz /
                          in_proj_ba: whole key-head groups, which are contiguous row blocks)
    conv weights, state   channels in *device-grouped* order (below)
    gates, beta, norm     local to the device's heads (norm weight [V] replicated)
    recurrent state       [.., HV, K, V] split on HV; stashes split on their head axis
    out_proj / o_proj     split by input rows (the weight's columns); each device's partial
                          output is summed once over "tp" (one all-reduce per block call)

Every block operation runs as one `jax.shard_map` over the mesh whose body is the unsharded
block's own method on a block of HK/P key heads and HV/P value heads, so the conv, the gates,
the delta-rule kernels and the serving path (prefill, decode, verify, accept, flush) are the
same code with or without a mesh, and no state is ever gathered.

Device-grouped conv channels. The unsharded conv channel axis is q | k | v (all q heads, then
all k heads, then all v heads). A contiguous split of that would hand device 0 only q channels,
so under a mesh the axis is stored as [q_0 | k_0 | v_0 | q_1 | k_1 | v_1 | ...] (q_d: the q
channels of device d's key heads, and so on): each device's slice is an ordinary q | k | v
layout. This order holds for conv1d.weight / bias, Qwen3.5's in_proj_qkv rows, `state.conv`,
`ServingState.conv.windows` and `.conv.stash.x`. `shard_state` and `gather_state` convert a
state between the unsharded layout and the mesh's.

Numerics: each device's partial out_proj output is rounded to the compute dtype before the sum,
so with bf16 projections the result differs from one device's by one bf16 rounding; in fp32 the
two agree to summation order (a projection over a slice of its rows does not round like the
full one): typically 2e-7..4e-7 relative, within 2e-6 in the tests.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gdn_jax import dispatch
from gdn_jax.state import ConvPool, ConvStash, DeltaPool, DeltaStash, ServingState

__all__ = ["AXIS", "ROWS", "COLUMNS", "CONV_ROWS", "REPLICATED", "check_mesh", "tp_size",
           "shard_state", "gather_state", "TensorParallelMixin"]

AXIS = "tp"

# How a parameter is split over the "tp" axis (each block names its parameters' kinds in
# `_shard_layout`).
ROWS = "rows"              # axis 0 split contiguously: one block of rows per device's heads
COLUMNS = "columns"        # axis 1 split (out_proj [hidden, HV*V]: its input rows)
CONV_ROWS = "conv_rows"    # axis 0 over conv channels, stored in device-grouped order
REPLICATED = "replicated"  # the same on every device

_HEADS_1 = P(None, AXIS)
_HEADS_2 = P(None, None, AXIS)


# --------------------------------------------------------------------------- the mesh

def tp_size(mesh) -> int:
    """Devices on the mesh's "tp" axis (1 without a mesh)."""
    return 1 if mesh is None else int(mesh.shape[AXIS])


def check_mesh(mesh, *, num_k_heads: int, num_v_heads: int):
    """`mesh` is None or a Mesh with a "tp" axis whose size divides both head counts (key-head
    groups stay whole on one device); ValueError naming `mesh` otherwise. Returns the mesh."""
    if mesh is None:
        return None
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh with an axis named {AXIS!r}, or None; "
                         f"got {type(mesh).__name__}")
    if AXIS not in mesh.axis_names:
        raise ValueError(f"mesh must have an axis named {AXIS!r} (the tensor-parallel axis), got "
                         f"axes {tuple(mesh.axis_names)}")
    p = int(mesh.shape[AXIS])
    for name, heads in (("num_k_heads", num_k_heads), ("num_v_heads", num_v_heads)):
        if heads % p:
            raise ValueError(f"mesh: its {AXIS!r} axis has {p} devices, which do not divide "
                             f"{name}={heads} (each device takes whole key-head groups)")
    return mesh


def _named(mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))


# --------------------------------------------------------------------------- conv channel order

def _conv_order(key_dim: int, value_dim: int, p: int) -> np.ndarray:
    """Index array: device-grouped channel i is unsharded channel order[i]."""
    kl, vl = key_dim // p, value_dim // p
    parts = []
    for d in range(p):
        parts += [np.arange(d * kl, (d + 1) * kl), key_dim + np.arange(d * kl, (d + 1) * kl),
                  2 * key_dim + np.arange(d * vl, (d + 1) * vl)]
    return np.concatenate(parts)


def _block_conv_order(block, p: int) -> np.ndarray:
    d = block._dims()
    return _conv_order(d.key_dim, d.num_v_heads * d.head_v_dim, p)


def _conv_row_ranges(key_dim: int, value_dim: int, p: int, d: int):
    """The unsharded channel ranges [(start, stop)] that device d's slice holds, in order."""
    kl, vl = key_dim // p, value_dim // p
    return [(d * kl, (d + 1) * kl), (key_dim + d * kl, key_dim + (d + 1) * kl),
            (2 * key_dim + d * vl, 2 * key_dim + (d + 1) * vl)]


# --------------------------------------------------------------------------- parameters

def _param_path(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path
                    if not (isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value"))


def _param_spec(kind: str, ndim: int) -> P:
    if kind == REPLICATED:
        return P()
    if kind in (ROWS, CONV_ROWS):
        return P(AXIS, *([None] * (ndim - 1)))
    if kind == COLUMNS:
        return P(None, AXIS)
    raise AssertionError(kind)


def _layout_of(block, path: str) -> str:
    layout = block._shard_layout()
    if path not in layout:
        raise AssertionError(f"{type(block).__name__}._shard_layout names no kind for {path!r}")
    return layout[path]


def place_params(block, mesh) -> None:
    """Move a block's parameters (unsharded layout, as built) onto `mesh`: conv rows into the
    device-grouped order, every parameter put with its sharding. Sets `block.mesh`."""
    p = tp_size(mesh)
    order = _block_conv_order(block, p)
    for path, var in nnx.to_flat_state(nnx.state(block, nnx.Param)):
        name = ".".join(str(k) for k in path)
        kind = _layout_of(block, name)
        value = var.get_value()
        if kind == CONV_ROWS:
            value = jnp.take(value, order, axis=0)
        sharding = NamedSharding(mesh, _param_spec(kind, value.ndim))
        if isinstance(value, jax.core.Tracer):
            value = jax.lax.with_sharding_constraint(value, sharding)
        else:
            value = jax.device_put(value, sharding)
        _set_param(block, name, value)
    block.mesh = mesh


def _set_param(block, name: str, value) -> None:
    obj = block
    for part in name.split("."):
        obj = getattr(obj, part)
    obj.set_value(value)


def fill_sharded(module, readers: dict, mesh, *, param_dtype=None, source: str = ""):
    """Fill an abstract block's parameters from checkpoint readers (`gdn_jax.loading.TensorReader`
    / `RowConcat`), each device reading only its slice: `readers[path].read(index)` returns the
    unsharded parameter's sub-block `index` (a tuple of slices). Sets `module.mesh`."""
    p = tp_size(mesh)
    d = module._dims()
    key_dim, value_dim = d.key_dim, d.num_v_heads * d.head_v_dim
    flat = dict((".".join(str(k) for k in path), var)
                for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)))
    missing = sorted(set(flat) - set(readers))
    if missing:
        raise ValueError(f"checkpoint is missing tensors for parameters {missing} ({source})")
    for name, var in flat.items():
        shape = tuple(var.get_value().shape)
        kind = _layout_of(module, name)
        read = readers[name].read
        rows_per_device = shape[0] // p if kind in (ROWS, CONV_ROWS) else None

        def callback(index, read=read, kind=kind, shape=shape, rpd=rows_per_device):
            if kind != CONV_ROWS:
                arr = read(tuple(index))
            else:
                start = index[0].start or 0
                dev = start // rpd
                rest = tuple(index[1:])
                arr = np.concatenate([read((slice(a, b),) + rest)
                                      for a, b in _conv_row_ranges(key_dim, value_dim, p, dev)], axis=0)
            return arr if param_dtype is None else arr.astype(jnp.dtype(param_dtype))

        dtype = readers[name].dtype if param_dtype is None else jnp.dtype(param_dtype)
        sharding = NamedSharding(mesh, _param_spec(kind, len(shape)))
        _set_param(module, name, jax.make_array_from_callback(shape, sharding, callback,
                                                              dtype=dtype))
    module.mesh = mesh
    return module


# --------------------------------------------------------------------------- state specs

def state_specs(state_cls):
    return state_cls(recurrent=_HEADS_1, conv=_HEADS_2)


def serving_specs(with_candidates: bool) -> ServingState:
    stash = DeltaStash(k=_HEADS_2, u=_HEADS_2, g=_HEADS_2, bank=P(), pending=P(), drafted=P())
    return ServingState(delta=DeltaPool(states=_HEADS_1, stash=stash),
                        conv=ConvPool(windows=_HEADS_2, stash=ConvStash(x=_HEADS_2, pending=P(),
                                                                       drafted=P())),
                        candidates=_HEADS_2 if with_candidates else None)


def _specs_of(block, state):
    if isinstance(state, ServingState):
        return serving_specs(state.candidates is not None)
    return state_specs(type(state))


def _map_conv_channels(state, fn):
    """Apply fn to every array of `state` whose last axis is conv channels."""
    if isinstance(state, ServingState):
        conv = state.conv
        conv = dataclasses.replace(conv, windows=fn(conv.windows),
                                   stash=dataclasses.replace(conv.stash, x=fn(conv.stash.x)))
        return dataclasses.replace(state, conv=conv)
    return dataclasses.replace(state, conv=fn(state.conv))


def shard_state(block, state):
    """A state in the unsharded layout (a GDNState / KDAState or a ServingState, e.g. from
    `state_from_hf` or an unsharded block) -> the same state on `block.mesh`: conv channels in
    the device-grouped order, every array sharded by heads."""
    if block.mesh is None:
        raise ValueError("block has no mesh: shard_state needs a block built with mesh=")
    order = _block_conv_order(block, tp_size(block.mesh))
    state = _map_conv_channels(state, lambda a: jnp.take(a, order, axis=-1))
    # Fresh buffers: device_put may reuse the given ones, and the serving path donates its state.
    state = jax.tree.map(lambda a: jnp.array(a, copy=True), state)
    return jax.device_put(state, _named(block.mesh, _specs_of(block, state)))


def gather_state(block, state):
    """The inverse of `shard_state`: a mesh state -> the unsharded layout, on one device (for an
    export or an unsharded block). Moves the whole state: not for the serving loop."""
    if block.mesh is None:
        raise ValueError("block has no mesh: gather_state needs a block built with mesh=")
    inverse = np.argsort(_block_conv_order(block, tp_size(block.mesh)))
    # Through the host: the arrays may carry explicit-axis sharding types, which a gather on
    # the sharded axis would refuse.
    state = jax.tree.map(lambda a: np.asarray(a), state)
    state = _map_conv_channels(state, lambda a: np.take(a, inverse, axis=-1))
    return jax.tree.map(jnp.asarray, state)


# --------------------------------------------------------------------------- sharded execution

@functools.lru_cache(maxsize=64)
def _local_graphdef(cls, local_config, dtype, precision):
    """The graph of an unsharded block with the device's head counts (built abstractly)."""
    abstract = nnx.eval_shape(lambda: cls(local_config, rngs=nnx.Rngs(0), dtype=dtype,
                                          precision=precision))
    return nnx.split(abstract)[0]


def _local_config(config, p: int):
    heads = {f.name: getattr(config, f.name) // p for f in dataclasses.fields(config)
             if f.name in ("num_k_heads", "num_heads", "num_v_heads")}
    return dataclasses.replace(config, **heads)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything static about one sharded block operation (the jit cache key)."""
    graphdef: Any
    treedef: Any
    method: Callable
    kwargs: tuple
    interpret: bool
    mesh: Mesh
    param_specs: tuple
    arg_specs: tuple
    state_specs: Any
    out_specs: Any
    reduce_output: bool


def _body(plan: _Plan, params, args, state):
    with dispatch.interpret(plan.interpret):
        local = nnx.merge(plan.graphdef, jax.tree.unflatten(plan.treedef, params))
        out = plan.method(local, args, state, dict(plan.kwargs))
    if plan.reduce_output:       # each device's out_proj gave a partial sum over its heads
        out = (jax.lax.psum(out[0], AXIS),) + tuple(out[1:])
    return out


def _sharded(plan, params, args, state):
    return jax.shard_map(functools.partial(_body, plan), mesh=plan.mesh,
                         in_specs=(plan.param_specs, plan.arg_specs, plan.state_specs),
                         out_specs=plan.out_specs, check_vma=False)(params, args, state)


_run = jax.jit(_sharded, static_argnums=0)
# The serving state is updated in place, as the unsharded serving path's kernels do.
_run_donating = jax.jit(_sharded, static_argnums=0, donate_argnums=3)


def run(block, method: Callable, args: tuple, arg_specs: tuple, state, out_specs, *,
        reduce_output: bool, donate: bool, **kwargs):
    """Run `method(local_block, args, state, kwargs)` on every device of `block.mesh` with that
    device's parameters, args sliced by `arg_specs` and state by its head specs; the first output
    is summed over "tp" when `reduce_output`."""
    mesh = block.mesh
    precision = next(m.precision for _, m in nnx.iter_graph(block) if hasattr(m, "precision"))
    graphdef = _local_graphdef(type(block), _local_config(block.config, tp_size(mesh)),
                               block.dtype, precision)
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(nnx.state(block, nnx.Param))
    params = tuple(leaf for _, leaf in leaves_with_paths)
    param_specs = tuple(_param_spec(_layout_of(block, _param_path(path)), leaf.ndim)
                        for path, leaf in leaves_with_paths)
    plan = _Plan(graphdef=graphdef, treedef=treedef, method=method,
                 kwargs=tuple(sorted(kwargs.items())), interpret=dispatch.interpret_enabled(),
                 mesh=mesh, param_specs=param_specs, arg_specs=arg_specs,
                 state_specs=_specs_of(block, state), out_specs=out_specs,
                 reduce_output=reduce_output)
    return (_run_donating if donate else _run)(plan, params, args, state)


# The per-operation bodies: module-level functions, so a plan's hash is stable across calls.

def _forward(blk, args, state, kw):
    return blk(args[0], state, **kw)


def _prefill(blk, args, serving, kw):
    return blk.prefill(args[0], serving, args[1], **kw)


def _decode(blk, args, serving, kw):
    return blk.decode(args[0], serving, args[1], **kw)


def _verify(blk, args, serving, kw):
    return blk.verify(args[0], serving, args[1], **kw)


def _accept(blk, args, serving, kw):
    return blk.accept(serving, args[0], args[1], **kw)


def _flush(blk, args, serving, kw):
    return blk.flush(serving, args[0], **kw)


# --------------------------------------------------------------------------- the blocks' methods

class TensorParallelMixin:
    """The block methods under a mesh (`self.mesh`); without one each defers to the unsharded
    method. The host-side checks (shapes, slot tables, verdicts) run here on the global arrays,
    once, before any device work; the device bodies are the unsharded methods."""

    mesh: Mesh | None

    def _shard_layout(self) -> dict[str, str]:
        """Parameter path -> ROWS / COLUMNS / CONV_ROWS / REPLICATED (each block defines it)."""
        raise NotImplementedError

    def init_state(self, batch_size: int, dtype=jnp.float32, conv_dtype=jnp.float32):
        if self.mesh is None:
            return super().init_state(batch_size, dtype, conv_dtype)
        make = functools.partial(super().init_state, batch_size, dtype, conv_dtype)
        return jax.jit(make, out_shardings=_named(self.mesh, state_specs(self.STATE_CLS)))()

    def init_serving_state(self, num_slots: int, **kwargs) -> ServingState:
        if self.mesh is None:
            return super().init_serving_state(num_slots, **kwargs)
        make = functools.partial(super().init_serving_state, num_slots, **kwargs)
        return jax.jit(make, out_shardings=_named(self.mesh, serving_specs(False)))()

    def __call__(self, x, state=None, *, impl: str = "auto"):
        if self.mesh is None:
            return super().__call__(x, state, impl=impl)
        from gdn_jax.layers._common import check_hidden, check_state
        c, d = self.config, self._dims()
        dispatch.check_impl(self.DELTA_OP, impl)
        bsz, _ = check_hidden(x, c.hidden_size)
        if state is None:
            state = self.init_state(bsz)
        check_state(state, self.STATE_CLS, bsz, (bsz, d.num_v_heads, d.head_k_dim, d.head_v_dim),
                    (bsz, c.conv_kernel_size - 1, c.conv_dim))
        return run(self, _forward, (x,), (P(),), state, (P(), state_specs(self.STATE_CLS)),
                   reduce_output=True, donate=False, impl=impl)

    def prefill(self, x, serving, slots, *, fresh: bool = False, impl: str = "auto"):
        if self.mesh is None:
            return super().prefill(x, serving, slots, fresh=fresh, impl=impl)
        from gdn_jax import carry as carry_ops
        from gdn_jax import validate as chk
        self._check_serving(serving, x)
        self._refuse_candidates(serving, "a prefill")
        dispatch.check_impl(self.DELTA_OP, impl)
        chk.slot_table("slots", slots, x.shape[0], serving.num_slots)
        carry_ops.check_delta_pool(serving.delta)
        return run(self, _prefill, (x, slots), (P(), P()), serving, (P(), serving_specs(False)),
                   reduce_output=True, donate=True, fresh=bool(fresh), impl=impl)

    def decode(self, x, serving, slots, *, impl: str = "auto"):
        if self.mesh is None:
            return super().decode(x, serving, slots, impl=impl)
        from gdn_jax import validate as chk
        self._check_serving(serving, x, t_min=1, t_max=1)
        self._refuse_candidates(serving, "a decode")
        dispatch.check_impl(self.DELTA_OP, impl)
        chk.slot_table("slots", slots, x.shape[0], serving.num_slots)
        return run(self, _decode, (x, slots), (P(), P()), serving, (P(), serving_specs(False)),
                   reduce_output=True, donate=True, impl=impl)

    def verify(self, x, serving, slots, *, carry: bool = True, exact: bool = True,
               impl: str = "auto"):
        if self.mesh is None:
            return super().verify(x, serving, slots, carry=carry, exact=exact, impl=impl)
        from gdn_jax import carry as carry_ops
        from gdn_jax import validate as chk
        self._check_serving(serving, x, t_min=1, t_max=serving.delta.stash.capacity
                            if isinstance(serving, ServingState) else None)
        self._refuse_candidates(serving, "another verify")
        dispatch.check_impl(self.DELTA_OP, impl)
        host_slots = chk.slot_table("slots", slots, x.shape[0], serving.num_slots)
        engaged = self.carry_engages(serving, x.shape[1], carry=carry, exact=exact, impl=impl)
        # The verdict checks the unsharded path makes on concrete tables (the device bodies see
        # traced slots and would only flag the rows).
        carry_ops._refuse_pending_verdicts(serving.conv.stash.drafted, host_slots, "conv verify")
        if engaged:
            carry_ops._refuse_pending_verdicts(serving.delta.stash.drafted, host_slots, "verify")
        return run(self, _verify, (x, slots), (P(), P()), serving,
                   (P(), serving_specs(not engaged), P()), reduce_output=True, donate=True,
                   carry=bool(carry), exact=bool(exact), impl=impl)

    def accept(self, serving, slots, accepted, *, num_tokens=None):
        if self.mesh is None:
            return super().accept(serving, slots, accepted, num_tokens=num_tokens)
        from gdn_jax import validate as chk
        from gdn_jax.verify import check_accepted
        self._check_serving(serving)
        chk.array("slots", slots, rank=1, integer=True)
        b = slots.shape[0]
        chk.slot_table("slots", slots, b, serving.num_slots)
        upper = serving.delta.stash.capacity
        if num_tokens is not None:
            upper = chk.count("num_tokens", num_tokens)
            if upper > serving.delta.stash.capacity:
                raise ValueError(f"num_tokens must lie in 1..{serving.delta.stash.capacity} (the "
                                 f"stash capacity), got {num_tokens}")
        check_accepted(accepted, b, slots, upper)
        return run(self, _accept, (slots, accepted), (P(), P()), serving,
                   (serving_specs(False), P()), reduce_output=False, donate=True,
                   num_tokens=num_tokens)

    def flush(self, serving, slots=None, *, impl: str = "auto"):
        if self.mesh is None:
            return super().flush(serving, slots, impl=impl)
        from gdn_jax import validate as chk
        self._check_serving(serving)
        self._refuse_candidates(serving, "a flush")
        dispatch.check_impl(self.DELTA_OP, impl)
        if slots is None:
            slots = jnp.arange(serving.num_slots, dtype=jnp.int32)
        chk.array("slots", slots, rank=1, integer=True)
        chk.slot_table("slots", slots, slots.shape[0], serving.num_slots)
        return run(self, _flush, (slots,), (P(),), serving, serving_specs(False),
                   reduce_output=False, donate=True, impl=impl)
