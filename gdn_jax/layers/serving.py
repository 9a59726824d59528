"""The forward and the serving path both blocks share.

A block supplies its hooks -- `_raw_inputs(x, dtype) -> (mixed [B, T, C] before the conv, raw
gate a, raw beta b, z)` and `_inputs` (the same with g, beta computed), `_core_params()` (gate
parameters and norm settings), `_output(o, z, dtype) -> y` (norm + output projection) and
`_project_out(normed o, dtype) -> y`, `_dims()` and the sequence operation it runs (`DELTA_OP`:
"gated_delta_rule" or "kda") -- and gets:

    __call__(x, state=None, *, impl)                         per-sequence state (GDNState / KDAState)
    init_serving_state(num_slots, ...)                       pools + stashes (ServingState)
    prefill(x, serving, slots, *, fresh=False, impl)         T tokens into the named slots
    decode(x, serving, slots, *, impl)                       one token per row
    verify(x, serving, slots, *, carry, exact, impl)         T = 1..4 draft tokens per row
    accept(serving, slots, accepted, *, num_tokens)          the verdict
    flush(serving, slots=None)                               fold every pending row (export)
    carry_engages(serving, num_tokens, *, carry, exact, impl)

`slots` [B] int32 names each row's pool slot (-1 or outside the pool: padding, nothing read or
written, output rows zero). Everything that reads a pool folds the slot's pending rows first
(decode, prefill) or is refused (a decode or prefill while a verify that did not carry awaits
`accept`). The carried (write-on-accept) delta rule runs when `carry_engages` says so (T in
2..4, state dtype vs flavour, head dims, an implementation, a stash of capacity >= T); else the
verify flushes the slots and keeps every intermediate state (`candidates`), and `accept`
commits the accepted one. The short conv always carries (its stash is tiny, the carry pure JAX).
The fold before a decode or prefill sits behind one gate on "a named slot has pending rows"
(`gdn_jax.carry.when_pending`, a `lax.cond` under jit from 128 rows up; smaller tables fold
unconditionally): a large step with nothing pending runs no fold.

`prefill` is pool-native: `gdn_jax.prefill.gdn_prefill_pool` reads each row's initial state from
its slot and writes the final state back in place; only the named slots' conv windows are
gathered and scattered.

Single-token steps (`decode`, and `__call__` with T = 1) run the whole core -- conv window
update, conv + SiLU, q/k L2 norm, gates from the raw projections, the recurrence, the gated
RMSNorm -- as one kernel launch (`gdn_jax.conv_decode`) when the dispatch gives it the call
(`impl` "auto" or "pallas" on a GPU or in interpret mode, head dims the kernel takes); else the
unfused chain (conv step, gates, the decode operation, norm) runs. Either way only the
projections run outside.

Exactness: the delta-rule kernels are bit-identical to decode (exact flavour); the projections
run as one [B*T] matmul in verify and a [B] matmul in decode, so the block outputs agree with a
token-by-token run to matmul rounding, not bitwise.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from gdn_jax import carry as carry_ops
from gdn_jax import conv_carry
from gdn_jax import conv_decode as conv_decode_ops
from gdn_jax import decode as decode_ops
from gdn_jax import dispatch, ops
from gdn_jax import prefill as prefill_ops
from gdn_jax import reference as ref
from gdn_jax import validate as chk
from gdn_jax import verify as verify_ops
from gdn_jax.layers._common import check_hidden, check_state
from gdn_jax.state import ConvPool, DEFAULT_STASH_CAPACITY, DeltaPool, ServingState

__all__ = ["DeltaDims", "DeltaBlockMixin", "ServingState"]


@dataclasses.dataclass(frozen=True)
class DeltaDims:
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    per_channel_gate: bool

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim


def _pool_impl(impl):
    """The pool operations have no chunk form: "chunked" means the pure-JAX path there."""
    return "reference" if impl == "chunked" else impl


@functools.partial(jax.jit, donate_argnames=("delta", "conv"))
def _start_fresh(delta: DeltaPool, conv: ConvPool, slots):
    """The named slots (a normalised table) made fresh sequences: zero states (the prefill reads
    its initial states from the pool), and no stashed rows pending or awaiting a verdict (they
    belong to the slot's previous sequence). The prefill zeroes the conv windows it reads."""
    write = jnp.where(slots >= 0, slots, -1)
    zeros = jnp.zeros_like(slots)
    dstash = dataclasses.replace(delta.stash,
                                 pending=verify_ops._scatter(delta.stash.pending, write, zeros),
                                 drafted=verify_ops._scatter(delta.stash.drafted, write, zeros))
    cstash = dataclasses.replace(conv.stash,
                                 pending=verify_ops._scatter(conv.stash.pending, write, zeros),
                                 drafted=verify_ops._scatter(conv.stash.drafted, write, zeros))
    states = verify_ops._scatter(delta.states, write,
                                 jnp.zeros((slots.shape[0],) + delta.states.shape[1:],
                                           delta.states.dtype))
    return DeltaPool(states=states, stash=dstash), ConvPool(windows=conv.windows, stash=cstash)


class DeltaBlockMixin:
    """Shared forward and serving methods (see the module docstring)."""

    DELTA_OP: str

    # ------------------------------------------------------------------ the shared forward

    def _split_qkv(self, mixed):
        d = self._dims()
        bsz, t = mixed.shape[:2]
        q = mixed[..., :d.key_dim].reshape(bsz, t, d.num_k_heads, d.head_k_dim)
        k = mixed[..., d.key_dim:2 * d.key_dim].reshape(bsz, t, d.num_k_heads, d.head_k_dim)
        v = mixed[..., 2 * d.key_dim:].reshape(bsz, t, d.num_v_heads, d.head_v_dim)
        return q, k, v

    def _conv_params(self):
        return self.conv1d.weight[...], (None if self.conv1d.bias is None else self.conv1d.bias[...])

    def _compute_dtype(self, x):
        return x.dtype if self.dtype is None else self.dtype

    def _one_launch(self, x, state, windows, slots, impl):
        """The one-launch decode of one token x [B, 1, hidden] when the dispatch gives the fused
        kernel the call: (call, (mixed, a, b, z) in the compute dtype, dtype); None when `impl`
        asks for a pure-JAX path or "auto" finds no kernel (the unfused chain runs then)."""
        if impl not in ("auto", "pallas"):
            return None
        d, c, bsz, dtype = self._dims(), self.config, x.shape[0], self._compute_dtype(x)
        rows = lambda *shape: jax.ShapeDtypeStruct((bsz,) + shape, dtype)
        p = self._core_params()
        weight, bias = self._conv_params()
        # Validated on shapes: the projections run only once the kernel has the call.
        call = conv_decode_ops.conv_decode_call(
            rows(c.conv_dim), rows(d.num_v_heads * (d.head_k_dim if d.per_channel_gate else 1)),
            rows(d.num_v_heads), rows(d.num_v_heads, d.head_v_dim), state, windows, slots,
            conv_weight=weight, conv_bias=bias,
            num_k_heads=d.num_k_heads, num_v_heads=d.num_v_heads, head_k_dim=d.head_k_dim,
            head_v_dim=d.head_v_dim, per_channel_gate=d.per_channel_gate, use_qk_l2norm=True,
            out_dtype=dtype, **p)
        # impl="pallas" with a call the fused kernel cannot take still runs the unfused kernels.
        if dispatch.select("conv_decode", call, "auto").impl != "pallas":
            return None
        mixed, a, b, z = (t[:, 0] for t in self._raw_inputs(x, dtype))
        return call, (mixed, a.reshape(bsz, -1), b, z), dtype

    def _run_one_launch(self, fused, state, windows, slots):
        call, (mixed, a, b, z), dtype = fused
        p = self._core_params()
        weight, bias = self._conv_params()
        y, state, windows = conv_decode_ops.conv_decode_run(
            call, "pallas", mixed, a, b, z, state, windows, slots, weight, bias, p["A_log"],
            p["dt_bias"], p["norm_weight"], interpret=dispatch.interpret_enabled())
        return self._project_out(y[:, None], dtype), state, windows

    def __call__(self, x: jax.Array, state=None, *, impl: str = "auto"):
        """x [B, T, hidden] -> (y [B, T, hidden] in x's dtype, new state).

        `state=None` starts fresh sequences; a given state is continued, so a prefill followed by
        single-token calls reproduces one full-sequence call. The new state keeps the given
        state's dtypes."""
        c, d = self.config, self._dims()
        dispatch.check_impl(self.DELTA_OP, impl)
        bsz, t = check_hidden(x, c.hidden_size)
        if state is None:
            state = self.init_state(bsz)
        check_state(state, self.STATE_CLS, bsz, (bsz, d.num_v_heads, d.head_k_dim, d.head_v_dim),
                    (bsz, c.conv_kernel_size - 1, c.conv_dim))
        fused = self._one_launch(x, state.recurrent, state.conv, None, impl) if t == 1 else None
        if fused is not None:
            recurrent, conv_state = state.recurrent, state.conv
            if chk.is_concrete(recurrent):
                # Called eagerly, the kernel's jit really donates: give it buffers of its own so
                # the caller's state stays valid. Under an outer jit the inner donation is void
                # and XLA copies an aliased input only where its caller still needs it (never in a
                # donated step).
                recurrent, conv_state = jnp.copy(recurrent), jnp.copy(conv_state)
            y, recurrent, conv_state = self._run_one_launch(fused, recurrent, conv_state, None)
            return y.astype(x.dtype), self.STATE_CLS(recurrent=recurrent, conv=conv_state)
        dtype = self._compute_dtype(x)
        mixed, g, beta, z = self._inputs(x, dtype)
        weight, bias = self._conv_params()
        mixed, conv_state = ref.causal_conv1d(mixed, weight, bias, conv_state=state.conv,
                                              activation="silu")
        q, k, v = self._split_qkv(mixed)
        delta = ops.gated_delta_rule if self.DELTA_OP == "gated_delta_rule" else ops.kda
        o, recurrent = delta(q, k, v, g, beta, initial_state=state.recurrent,
                             output_final_state=True, use_qk_l2norm=True, impl=impl)
        y = self._output(o, z, dtype)
        return y.astype(x.dtype), self.STATE_CLS(recurrent=recurrent, conv=conv_state)

    # ------------------------------------------------------------------ serving state

    def init_serving_state(self, num_slots: int, *, dtype=jnp.float32, conv_dtype=jnp.float32,
                           capacity: int = DEFAULT_STASH_CAPACITY) -> ServingState:
        """Zero pools for `num_slots` sequences and empty stashes of `capacity` rows per slot."""
        c, d = self.config, self._dims()
        return ServingState(
            delta=DeltaPool.init(num_slots, num_k_heads=d.num_k_heads, num_v_heads=d.num_v_heads,
                                 head_k_dim=d.head_k_dim, head_v_dim=d.head_v_dim, dtype=dtype,
                                 capacity=capacity, per_channel_gate=d.per_channel_gate),
            conv=ConvPool.init(num_slots, conv_dim=c.conv_dim, conv_width=c.conv_kernel_size,
                               dtype=conv_dtype, capacity=capacity))

    def _check_serving(self, serving, x=None, *, t_min=1, t_max=None):
        if not isinstance(serving, ServingState):
            raise ValueError(f"serving must be a ServingState (from init_serving_state), got "
                             f"{type(serving).__name__}")
        if x is not None:
            _, t = check_hidden(x, self.config.hidden_size)
            if t_max is not None and not t_min <= t <= t_max:
                raise ValueError(f"x must hold {t_min}..{t_max} tokens per row, got shape {x.shape}")

    def _refuse_candidates(self, serving, what):
        if serving.candidates is not None:
            raise ValueError(f"serving holds a verify awaiting its verdict: call accept before {what}")

    def carry_engages(self, serving: ServingState, num_tokens: int, *, carry=True, exact=True,
                      impl="auto", interpret=None) -> bool:
        """Whether a verify of `num_tokens` tokens carries (write-on-accept) on this state."""
        d = self._dims()
        dispatch.check_impl(self.DELTA_OP, impl)
        impl = _pool_impl(impl)
        dt = serving.delta.states.dtype
        # "auto" and "reference" always have the pure-JAX carried verify; "pallas" needs the kernel.
        available = impl != "pallas" or carry_ops.kernel_available(
            num_tokens, d.head_k_dim, d.head_v_dim, dt, exact=exact, interpret=interpret)
        return carry_ops.carry_engages(carry_ops.CarryRequest(
            requested=bool(carry), num_tokens=int(num_tokens), state_dtype=dt,
            head_k_dim=d.head_k_dim, head_v_dim=d.head_v_dim, exact=bool(exact),
            kernel_available=available, stash_capacity=serving.delta.stash.capacity))

    # ------------------------------------------------------------------ serving path

    def _fold_pending(self, serving, slots, impl):
        """(delta pool, conv pool) with the named slots' pending rows folded (a normalised slot
        table): the delta rows into H, the conv inputs into the windows. One gate for both: when
        no named slot has any (decode after decode, after a prefill, after accept + flush) no
        fold runs at all (`gdn_jax.carry.when_pending`)."""
        pending = (carry_ops.any_pending(serving.delta.stash.pending, slots)
                   | carry_ops.any_pending(serving.conv.stash.pending, slots))
        fold = lambda delta, conv: (carry_ops.fold_pending(delta, slots, impl=_pool_impl(impl)),
                                    conv_carry.conv_fold_pending(conv, slots))
        return carry_ops.when_pending(pending, fold, (serving.delta, serving.conv),
                                     rows=slots.shape[0])

    def prefill(self, x, serving: ServingState, slots, *, fresh: bool = False, impl: str = "auto"):
        """T tokens per row into the named slots: x [B, T, hidden] -> (y, serving). The slots'
        pending rows are folded first; `fresh=True` starts the rows from zero states instead
        (a new sequence in a reused slot: the slots' stashed rows are dropped too).

        Pool-native: the delta rule reads each initial state from its pool slot and writes the
        final state back in place (`gdn_jax.prefill.gdn_prefill_pool`: the prefill kernels where
        the dispatch gives them the call, else `reference_prefill_pool`); only the small conv
        windows of the named slots are gathered and scattered."""
        self._check_serving(serving, x)
        self._refuse_candidates(serving, "a prefill")
        dispatch.check_impl(self.DELTA_OP, impl)
        chk.slot_table("slots", slots, x.shape[0], serving.num_slots)
        carry_ops.check_delta_pool(serving.delta)
        slots = verify_ops.normalise_slots(slots, serving.num_slots)
        live = slots >= 0
        if fresh:
            delta, conv = _start_fresh(serving.delta, serving.conv, slots)
        else:
            # The delta rows fold into H under the gate; the conv inputs fold as the named
            # windows are read (the conv reads them anyway).
            delta = carry_ops.flush_validated(serving.delta, slots, impl=_pool_impl(impl))
            conv = serving.conv
        dtype = self._compute_dtype(x)
        mixed, g, beta, z = self._inputs(x, dtype)
        weight, bias = self._conv_params()
        windows = conv_carry.read_windows(conv, slots)
        if fresh:
            windows = jnp.zeros_like(windows)
        else:
            # With T >= W-1 the new windows do not depend on the old ones, so nothing would order
            # the write after the read and XLA would copy the window pool to keep the read safe:
            # tie the pool to the read.
            windows, pool_windows = jax.lax.optimization_barrier((windows, conv.windows))
            conv = dataclasses.replace(conv, windows=pool_windows)
        mixed, windows = ref.causal_conv1d(mixed, weight, bias, conv_state=windows,
                                           activation="silu")
        q, k, v = self._split_qkv(mixed)
        if impl == "chunked":   # the pool entry point's pure-JAX path, in the chunk form
            o, states = prefill_ops.reference_prefill_pool(
                q, k, v, g, beta, delta.states, slots, use_qk_l2norm=True, impl="chunked")
        else:
            o, states = prefill_ops.gdn_prefill_pool(q, k, v, g, beta, delta.states, slots,
                                                     use_qk_l2norm=True, impl=impl)
        y = verify_ops._mask_rows(self._output(o, z, dtype), live)
        delta = dataclasses.replace(delta, states=states)
        conv = conv_carry.write_windows(conv, slots, windows)
        return y.astype(x.dtype), ServingState(delta=delta, conv=conv)

    def decode(self, x, serving: ServingState, slots, *, impl: str = "auto"):
        """One decode token per row: x [B, 1, hidden] -> (y [B, 1, hidden], serving). The rows'
        pending stash rows are folded first (decode reads H)."""
        self._check_serving(serving, x, t_min=1, t_max=1)
        self._refuse_candidates(serving, "a decode")
        d = self._dims()
        dispatch.check_impl(self.DELTA_OP, impl)
        bsz = x.shape[0]
        chk.slot_table("slots", slots, bsz, serving.num_slots)
        fused = self._one_launch(x, serving.delta.states, serving.conv.windows, slots, impl)
        if fused is not None:
            # Fold what a verify left pending (delta rows and conv inputs) before reading H.
            slots = verify_ops.normalise_slots(slots, serving.num_slots)
            carry_ops.check_delta_pool(serving.delta)
            delta, conv = self._fold_pending(serving, slots, impl)
            y, states, windows = self._run_one_launch(fused, delta.states, conv.windows, slots)
            return y.astype(x.dtype), ServingState(
                delta=dataclasses.replace(delta, states=states),
                conv=dataclasses.replace(conv, windows=windows))
        dtype = self._compute_dtype(x)
        mixed, g, beta, z = self._inputs(x, dtype)
        weight, bias = self._conv_params()
        mixed, conv = conv_carry.conv_step(mixed[:, 0], serving.conv, slots, weight, bias)
        o, delta = decode_ops.gdn_decode_pool(
            mixed, g[:, 0].reshape(bsz, -1), beta[:, 0], serving.delta, slots,
            num_k_heads=d.num_k_heads, num_v_heads=d.num_v_heads, head_k_dim=d.head_k_dim,
            head_v_dim=d.head_v_dim, per_channel_gate=d.per_channel_gate, use_qk_l2norm=True,
            impl=_pool_impl(impl))
        y = self._output(o[:, None], z, dtype).astype(x.dtype)
        return y, ServingState(delta=delta, conv=conv)

    def verify(self, x, serving: ServingState, slots, *, carry: bool = True, exact: bool = True,
               impl: str = "auto"):
        """Verify T draft tokens per row: x [B, T, hidden] -> (y [B, T, hidden], serving,
        refused [B] bool). Nothing is committed until `accept`. A row whose slot's last verify
        has no verdict is refused (ValueError with a concrete slot table; under jit it is
        padding and flagged in `refused`)."""
        d = self._dims()
        self._check_serving(serving, x, t_min=1, t_max=serving.delta.stash.capacity
                            if isinstance(serving, ServingState) else None)
        self._refuse_candidates(serving, "another verify")
        dispatch.check_impl(self.DELTA_OP, impl)
        t = x.shape[1]
        engaged = self.carry_engages(serving, t, carry=carry, exact=exact, impl=impl)
        pool_impl = _pool_impl(impl)
        dtype = self._compute_dtype(x)
        mixed, g, beta, z = self._inputs(x, dtype)
        weight, bias = self._conv_params()
        mixed, conv, refused_conv = conv_carry.conv_carried_verify(mixed, serving.conv, slots,
                                                                   weight, bias)
        q, k, v = self._split_qkv(mixed)
        if engaged:
            o, delta, refused = carry_ops.carried_verify(q, k, v, g, beta, serving.delta, slots,
                                                         exact=exact, use_qk_l2norm=True,
                                                         impl=pool_impl)
            candidates = None
        else:
            # Declined: fold what the previous verify left pending before reading H.
            delta = carry_ops.flush(serving.delta, slots, impl=pool_impl)
            refused = jnp.zeros(slots.shape, bool)
            o, candidates = verify_ops.verify_states(q, k, v, g, beta, delta.states, slots,
                                                     use_qk_l2norm=True, impl=pool_impl)
        y = self._output(o, z, dtype).astype(x.dtype)
        return y, ServingState(delta=delta, conv=conv, candidates=candidates), refused | refused_conv

    def accept(self, serving: ServingState, slots, accepted, *, num_tokens=None):
        """The verdict: accepted [B] in 1..T per live row. Returns (serving, invalid [B] bool); a
        bad count raises ValueError when concrete, else leaves the row unchanged and flags it."""
        self._check_serving(serving)
        conv, bad_conv = carry_ops.accept(serving.conv, slots, accepted, num_tokens=num_tokens)
        if serving.candidates is None:
            delta, bad = carry_ops.accept(serving.delta, slots, accepted, num_tokens=num_tokens)
            return ServingState(delta=delta, conv=conv), bad | bad_conv
        states, bad = verify_ops.commit_states(serving.delta.states, serving.candidates, slots,
                                               accepted)
        return (ServingState(delta=dataclasses.replace(serving.delta, states=states), conv=conv),
                bad | bad_conv)

    def flush(self, serving: ServingState, slots=None, *, impl: str = "auto"):
        """Fold every pending row (delta rule and conv) of the named slots (None: all) into the
        pools, e.g. before exporting or converting them."""
        self._check_serving(serving)
        self._refuse_candidates(serving, "a flush")
        delta = carry_ops.flush(serving.delta, slots, impl=_pool_impl(impl))
        conv = conv_carry.conv_flush(serving.conv, slots)
        return ServingState(delta=delta, conv=conv)
