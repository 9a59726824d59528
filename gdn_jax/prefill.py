"""GDN and KDA prefill through the Pallas kernels: the chunked kernels
(pallas_kernels/gdn_prefill.py) and the token-serial kernel (pallas_kernels/gdn_decode.py,
`serial_prefill`: the decode kernel's body walking a sequence with its state in registers).

    gdn_prefill(q, k, v, g, beta, ...)                 dense [B, T] or packed (cu_seqlens) batch;
                                                       optional raw gates, chunk-boundary states,
                                                       the states after requested token counts
    gdn_prefill_pool(q, k, v, g, beta, pool, slots)    initial and final states in pool slots,
                                                       updated in place (pool donated); optional
                                                       the states after requested token counts
    prefill_kernel_reason(...)                         why the kernels cannot take a call (or None)
    SERIAL_PREFILL_TABLE, KDA_SERIAL_PREFILL_TABLE     when "auto" picks the token-serial kernel

Which kernel. Both entry points are dispatch operations ("gdn_prefill", "gdn_prefill_pool") with
two kernel families, asked in this order: "serial prefill" (the token-serial kernel) takes a call
when N sequences' longest has at most SERIAL_PREFILL_TABLE's length for N (KDA's table for a
per-channel gate), and "chunked
prefill" takes the rest. `kernel="serial"` or `"chunked"` forces one. `gated_delta_rule` / `kda`
carry the same two families (after the single-token decode). `gdn_jax.explain` shows the choice,
and `Choice.detail` the table row that made it.

Every sequence of a batch is processed without padding: a dense batch is the packing of B
sequences of T tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax import dispatch
from gdn_jax import reference as ref
from gdn_jax import validate as chk
from gdn_jax.ops import delta_spec
from gdn_jax.verify import _mask_rows, check_tokens
from pallas_kernels import gdn_decode as serial_kern
from pallas_kernels import gdn_prefill as kern

CHUNK = kern.CHUNK
KERNELS = ("serial", "chunked")

# When "auto" runs the token-serial kernel: (most sequences N, longest sequence it takes). First
# row whose N bound holds wins; a longer sequence goes to the chunked kernel. The token-serial
# kernel pays per token in sequence (no tensor cores) but has no chunk setup (one launch, no
# prep pass, no intermediates through memory): it wins on short prompts. The rows follow the
# crossover `gdn-jax bench prefill --short` measured on the H200 (BENCHMARKS.md).
SERIAL_PREFILL_TABLE: tuple[tuple[int, int], ...] = (
    (1, 16),
    (8, 24),
    (1 << 30, 16),
)
# The same for KDA (a per-channel gate), from `gdn-jax bench kda --short`: its chunked kernels
# (three, the intra-chunk one first) cost about twice GDN's at these lengths, so the token-serial
# kernel keeps the lead about twice as long.
KDA_SERIAL_PREFILL_TABLE: tuple[tuple[int, int], ...] = (
    (1, 32),
    (8, 48),
    (1 << 30, 32),
)

__all__ = ["ChunkStates", "PrefillCall", "gdn_prefill", "gdn_prefill_pool",
           "reference_prefill_pool", "reference_states_after", "prefill_kernel_reason",
           "serial_prefill_limit", "serial_prefill_table", "SERIAL_PREFILL_TABLE", "KDA_SERIAL_PREFILL_TABLE", "CHUNK", "KERNELS"]


class ChunkStates(NamedTuple):
    """The state after every chunk of C = 64 tokens (after min((c + 1) * C, len) tokens).

    states [S, HV, K, V] (fp32); sequence n's chunk c is states[first[n] + c], for
    c < count[n] = ceil(len_n / C). Slots past every sequence's chunks are unspecified."""
    states: jax.Array
    first: jax.Array
    count: jax.Array


def prefill_kernel_reason(*, head_k_dim: int, head_v_dim: int, backend: str,
                          interpret: bool) -> str | None:
    """None when the prefill kernels can take a call with these head dims here, else why not."""
    if backend != "gpu" and not interpret:
        return (f"the Pallas prefill kernels need a GPU (backend is {backend!r}; "
                "interpret mode runs them on the CPU)")
    spec = kern.PrefillSpec(num_k_heads=1, num_v_heads=1, head_k_dim=head_k_dim,
                            head_v_dim=head_v_dim, scale=1.0)
    return kern.unsupported_reason(spec)


# --------------------------------------------------------------------------- the choice

def serial_prefill_table(per_channel_gate: bool = False) -> tuple[str, tuple[tuple[int, int], ...]]:
    """(name, rows) of the short-prompt table for a gate form: KDA_SERIAL_PREFILL_TABLE for a
    per-channel gate, else SERIAL_PREFILL_TABLE."""
    if per_channel_gate:
        return "KDA_SERIAL_PREFILL_TABLE", KDA_SERIAL_PREFILL_TABLE
    return "SERIAL_PREFILL_TABLE", SERIAL_PREFILL_TABLE


def serial_prefill_limit(num_seqs: int, per_channel_gate: bool = False) -> int:
    """The longest sequence "auto" gives the token-serial kernel in a call of N sequences (from
    `serial_prefill_table(per_channel_gate)`)."""
    for max_seqs, max_len in serial_prefill_table(per_channel_gate)[1]:
        if num_seqs <= max_seqs:
            return max_len
    return 0


@dataclasses.dataclass(frozen=True)
class PrefillCall:
    """What the kernel choice of a prefill reads (static; hashable). max_seq_len is T for a
    dense batch, the longest packed sequence when cu_seqlens is concrete, else T."""
    num_seqs: int
    max_seq_len: int
    head_k_dim: int
    head_v_dim: int
    state_dtype: str
    kernel: str | None = None       # "serial" / "chunked": forced; None: SERIAL_PREFILL_TABLE
    fp32_inputs: bool = False       # the chunked kernel then runs three-pass TF32 dots
    per_channel_gate: bool = False  # KDA
    chunk_states: bool = False
    pooled: bool = False
    float64_arrays: tuple[str, ...] = ()   # arrays JAX holds as float64 (x64 on): no kernel

    @property
    def batch(self) -> int:
        """The sequences the call computes (the dispatch gives an empty batch no kernel)."""
        return self.num_seqs


def _serial_supports(call: PrefillCall) -> str | None:
    if call.kernel == "chunked":
        return "kernel='chunked' was asked for"
    if call.chunk_states:
        return "chunk_states=True needs the chunked kernel"
    spec = serial_kern.DecodeSpec(num_k_heads=1, num_v_heads=1, head_k_dim=call.head_k_dim,
                                  head_v_dim=call.head_v_dim, scale=1.0, tokens=True)
    block = serial_kern.default_serial_block_sizes(call.num_seqs, 1, call.head_v_dim,
                                                   call.head_k_dim)
    why = serial_kern.unsupported_reason(spec, block, call.state_dtype)
    if why is not None or call.kernel == "serial":
        return why
    limit = serial_prefill_limit(call.num_seqs, call.per_channel_gate)
    if call.max_seq_len > limit:
        return (f"longest sequence {call.max_seq_len} > {limit} tokens for N={call.num_seqs} "
                f"sequences ({serial_prefill_table(call.per_channel_gate)[0]})")
    return None


def _serial_rule(call: PrefillCall) -> str:
    if call.kernel == "serial":
        return "kernel='serial' was asked for"
    limit = serial_prefill_limit(call.num_seqs, call.per_channel_gate)
    return (f"longest sequence {call.max_seq_len} <= {limit} tokens "
            f"for N={call.num_seqs} sequences ({serial_prefill_table(call.per_channel_gate)[0]})")


def _chunked_supports(call: PrefillCall) -> str | None:
    if call.kernel == "serial":
        return "kernel='serial' was asked for"
    spec = kern.PrefillSpec(num_k_heads=1, num_v_heads=1, head_k_dim=call.head_k_dim,
                            head_v_dim=call.head_v_dim, scale=1.0, precise=call.fp32_inputs,
                            per_channel_gate=call.per_channel_gate)
    return kern.unsupported_reason(spec)


SERIAL_FAMILY = dispatch.KernelFamily("serial prefill", _serial_supports, rule=_serial_rule)
CHUNKED_FAMILY = dispatch.KernelFamily("chunked prefill", _chunked_supports)


def fp32_inputs(dtype) -> bool:
    """Whether inputs of this dtype take the chunked kernel's precise form (three-pass TF32):
    fp32 as JAX would store it (float64 arrays under x64 never reach a kernel)."""
    return jax.dtypes.canonicalize_dtype(dtype) == jnp.float32


def _max_seq_len(T, cu_seqlens) -> int:
    if cu_seqlens is not None and chk.is_concrete(cu_seqlens):
        c = np.asarray(cu_seqlens)
        return int(np.max(np.diff(c))) if c.shape[0] > 1 else 0
    return int(T)


def prefill_call(q, v, g, *, cu_seqlens=None, state_dtype=jnp.float32, kernel=None,
                 chunk_states=False, pooled=False, float64_arrays=()) -> PrefillCall:
    """The choice's view of a prefill (q [B, T, HK, K], v [B, T, HV, V]); checks `kernel`.
    float64_arrays: `validate.float64_arrays` of the call's arrays."""
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"kernel must be None (the table decides), 'serial' or 'chunked', "
                         f"got {kernel!r}")
    if kernel == "serial" and chunk_states:
        raise ValueError("kernel='serial' cannot give chunk_states (they come from the chunked "
                         "kernel); use states_after for states at positions")
    B, T = q.shape[0], q.shape[1]
    N = B if cu_seqlens is None else int(np.shape(cu_seqlens)[0]) - 1
    return PrefillCall(num_seqs=N, max_seq_len=_max_seq_len(T, cu_seqlens),
                       head_k_dim=int(q.shape[3]), head_v_dim=int(v.shape[3]),
                       state_dtype=str(jnp.dtype(state_dtype)), kernel=kernel,
                       chunk_states=bool(chunk_states), pooled=pooled,
                       fp32_inputs=fp32_inputs(v.dtype),
                       per_channel_gate=np.ndim(g) == 4, float64_arrays=tuple(float64_arrays))


def _prefill_spec_of(q, k, v, g, beta, *, initial_state=None, cu_seqlens=None, kernel=None,
                     chunk_states=False, A_log=None, dt_bias=None, **_):
    return prefill_call(q, v, g, cu_seqlens=cu_seqlens, kernel=kernel, chunk_states=chunk_states,
                        state_dtype=jnp.float32 if initial_state is None else initial_state.dtype,
                        float64_arrays=chk.float64_arrays(
                            q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias,
                            initial_state=initial_state))


def _pool_spec_of(q, k, v, g, beta, pool, slots, *, cu_seqlens=None, kernel=None, A_log=None,
                  dt_bias=None, **_):
    return prefill_call(q, v, g, cu_seqlens=cu_seqlens, kernel=kernel, pooled=True,
                        state_dtype=pool.dtype,
                        float64_arrays=chk.float64_arrays(
                            q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias,
                            pool=pool))


def _explain_prefill(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None,
                     A_log=None, dt_bias=None, lower_bound=None, **kw):
    check_args(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
               A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    return _prefill_spec_of(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                            A_log=A_log, dt_bias=dt_bias, **kw)


def _explain_pool(q, k, v, g, beta, pool, slots, *, scale=None, cu_seqlens=None, A_log=None,
                  dt_bias=None, lower_bound=None, **kw):
    check_args(q, k, v, g, beta, scale=scale, cu_seqlens=cu_seqlens, A_log=A_log,
               dt_bias=dt_bias, lower_bound=lower_bound, pool=pool, slots=slots)
    return _pool_spec_of(q, k, v, g, beta, pool, slots, cu_seqlens=cu_seqlens, A_log=A_log,
                         dt_bias=dt_bias, **kw)


# `explain` runs the public functions' checks; the calls themselves check once and build the
# spec from the checked arguments.
for _op, _spec_of in (("gdn_prefill", _explain_prefill), ("gdn_prefill_pool", _explain_pool)):
    dispatch.define(_op, fallback=lambda call: "reference", spec_of=_spec_of)
    dispatch.register(_op, SERIAL_FAMILY)
    dispatch.register(_op, CHUNKED_FAMILY)


def _choose(op: str, call: PrefillCall, impl, interpret) -> str | None:
    """"serial" / "chunked" (a kernel runs) or None (the pure-JAX path), by the dispatch rule."""
    choice = dispatch.select(op, call, impl, interpret=interpret)
    if choice.impl != "pallas":
        return None
    return "serial" if choice.family == SERIAL_FAMILY.name else "chunked"


def _raw_to_gates(g, beta, A_log, dt_bias, lower_bound):
    if A_log is None:
        return g, beta
    if g.ndim == 4:
        HV, K = g.shape[2], g.shape[3]
        g = ref.kda_gate(g, A_log, jnp.reshape(dt_bias, (HV, K)), lower_bound=lower_bound)
    else:
        g = ref.gdn_gate(g, A_log, dt_bias)
    return g, ref.gdn_beta(beta)


def _pack(x):
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def _rows(x):
    """[B, T, ...] -> the token-serial kernel's row array [B * T, width] (a free view)."""
    return x.reshape(x.shape[0] * x.shape[1], -1)


def _spec(q, v, g, *, scale, use_qk_l2norm, raw_gates, lower_bound, **flags):
    """The chunked kernels' static spec for FLA-layout q [B, T, HK, K], v [B, T, HV, V] and g."""
    return kern.PrefillSpec(num_k_heads=q.shape[2], num_v_heads=v.shape[2], head_k_dim=q.shape[3],
                            head_v_dim=v.shape[3], scale=scale, use_qk_l2norm=use_qk_l2norm,
                            raw_gates=raw_gates, per_channel_gate=g.ndim == 4,
                            gate_lower_bound=lower_bound, precise=fp32_inputs(v.dtype), **flags)


def _serial_spec(q, v, g, *, scale, use_qk_l2norm, raw_gates, lower_bound, **flags):
    """The token-serial kernel's static spec (the decode body with tokens=True)."""
    return serial_kern.DecodeSpec(num_k_heads=q.shape[2], num_v_heads=v.shape[2],
                                  head_k_dim=q.shape[3], head_v_dim=v.shape[3], scale=scale,
                                  raw_gates=raw_gates, per_channel_gate=g.ndim == 4,
                                  gate_lower_bound=lower_bound, use_qk_l2norm=use_qk_l2norm,
                                  tokens=True, **flags)


def _serial(q, k, v, g, beta, seq_start, seq_end, state, A_log, dt_bias, *, static, state_dtype,
            interpret, slots=None, **flags):
    """The token-serial kernel over rows seq_start[n]..seq_end[n] of the packed tokens."""
    spec = _serial_spec(q, v, g, **static, reads_state=state is not None,
                        pooled=slots is not None, **flags)
    return serial_kern.serial_prefill(
        _rows(q), _rows(k), _rows(v), _rows(g), _rows(beta), seq_start, seq_end, state, spec=spec,
        A_log=A_log, dt_bias=None if dt_bias is None else dt_bias.reshape(-1), slots=slots,
        state_dtype=state_dtype, interpret=interpret)


def _static_args(q, scale, cu_seqlens, A_log, dt_bias, lower_bound, use_qk_l2norm):
    """What both entry points pass their jitted runner: (cu, A_log, dt_bias, static keywords)."""
    B, T, K = q.shape[0], q.shape[1], q.shape[3]
    cu = (jnp.arange(B + 1, dtype=jnp.int32) * T if cu_seqlens is None
          else jnp.asarray(cu_seqlens, jnp.int32))
    raw = A_log is not None
    as_f32 = lambda x: None if not raw else jnp.asarray(x, jnp.float32)
    static = dict(scale=float(K ** -0.5 if scale is None else scale),
                  use_qk_l2norm=bool(use_qk_l2norm), raw_gates=raw,
                  lower_bound=None if lower_bound is None else float(lower_bound))
    return cu, as_f32(A_log), as_f32(dt_bias), static


# --------------------------------------------------------------------------- states at positions

def _check_positions(states_after, num_seqs: int, lens) -> jax.Array:
    """`states_after` as int32 [N, P]: token counts [P] shared by every sequence or [N, P] per
    sequence, each in [0, len_n] (checked on the host when concrete; `lens` is None when the
    lengths are not, then only the shape is checked here)."""
    x = states_after if hasattr(states_after, "dtype") else np.asarray(states_after)
    shape = tuple(x.shape)
    if (not jnp.issubdtype(x.dtype, jnp.integer) or len(shape) not in (1, 2)
            or shape[-1] == 0 or (len(shape) == 2 and shape[0] != num_seqs)):
        raise ValueError(f"states_after must be integer token counts [P] (shared by every "
                         f"sequence) or [N={num_seqs}, P] (per sequence), P >= 1; got shape "
                         f"{shape} dtype {x.dtype}")
    if chk.is_concrete(x) and lens is not None:
        c = np.broadcast_to(np.asarray(x), (num_seqs, shape[-1]))
        bad = np.argwhere((c < 0) | (c > np.asarray(lens)[:, None]))
        if bad.size:
            n, i = bad[0]
            raise ValueError(f"states_after must lie in [0, len] of its sequence: sequence {n} "
                             f"has {int(lens[n])} tokens, asked for the state after "
                             f"{int(c[n, i])}")
    return jnp.broadcast_to(jnp.asarray(x, jnp.int32), (num_seqs, shape[-1]))


def _advance_to_positions(q, k, v, g, beta, cu, positions, initial_state, bounds, first,
                          A_log, dt_bias, *, static, state_dtype, interpret):
    """The state after positions[n, i] tokens of sequence n: from the last chunk boundary at or
    before the position (`bounds`, fp32, from the chunked kernel; without them from the
    initial state), advanced over the < 64 remaining tokens (or the whole short prompt) by the
    token-serial kernel, one launch for every (sequence, position). [N, P, HV, K, V]."""
    N, P = positions.shape
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    lens = cu[1:] - cu[:-1]
    pos = jnp.clip(positions, 0, lens[:, None])   # traced counts are checked in `checked`
    base = pos // CHUNK if bounds is not None else jnp.zeros_like(pos)
    start = (cu[:-1, None] + base * CHUNK).reshape(-1)
    end = (cu[:-1, None] + pos).reshape(-1)
    seq = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32)[:, None], (N, P))
    if bounds is None and initial_state is None:
        state = None                                  # every walk starts from zeros
    else:
        h0 = (jnp.zeros((N, HV, K, V), jnp.float32) if initial_state is None
              else initial_state.astype(jnp.float32))
        if bounds is None:
            state = h0[seq.reshape(-1)]
        else:
            src = jnp.concatenate([h0, bounds.astype(jnp.float32)])
            idx = jnp.where(base == 0, seq, N + first[:, None] + base - 1)
            state = src[idx.reshape(-1)]
    _, states = _serial(q, k, v, g, beta, start, end, state, A_log, dt_bias, static=static,
                        state_dtype=state_dtype, interpret=interpret, token_outputs=False)
    return states.reshape(N, P, HV, K, V)


def reference_states_after(q, k, v, g, beta, states_after, *, scale=None, initial_state=None,
                           use_qk_l2norm=False, cu_seqlens=None, A_log=None, dt_bias=None,
                           lower_bound=None):
    """The pure-JAX meaning of `gdn_prefill(..., states_after=...)`: for each position, the
    final state of the prompt with every later token made neutral (g = 0, beta = 0 leave the
    state untouched). [N, P, HV, K, V] in initial_state's dtype (fp32 without one)."""
    g, beta = _raw_to_gates(g, beta, A_log, dt_bias, lower_bound)
    B, T = q.shape[:2]
    N = B if cu_seqlens is None else int(np.shape(cu_seqlens)[0]) - 1
    positions = jnp.broadcast_to(jnp.asarray(states_after, jnp.int32),
                                 (N, np.shape(states_after)[-1]))
    if cu_seqlens is None:
        offset = jnp.broadcast_to(jnp.arange(T)[None, :], (B, T))
        owner = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    else:
        cu = jnp.asarray(cu_seqlens, jnp.int32)
        owner = jnp.searchsorted(cu, jnp.arange(T), side="right") - 1
        offset = (jnp.arange(T) - cu[owner])[None]
        owner = owner[None]
    from gdn_jax.ops import gated_delta_rule, kda
    fn = kda if g.ndim == 4 else gated_delta_rule
    states = []
    for i in range(positions.shape[1]):
        keep = offset < positions[jnp.clip(owner, 0, N - 1), i]            # [B, T]
        gi = jnp.where(keep.reshape(keep.shape + (1,) * (g.ndim - 2)), g, 0.0)
        bi = jnp.where(keep[..., None], beta, 0.0)
        _, s = fn(q, k, v, gi, bi, scale=scale, initial_state=initial_state,
                  output_final_state=True, use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens,
                  impl="chunked")
        states.append(s)
    return jnp.stack(states, axis=1)


# --------------------------------------------------------------------------- entry points

def _forward_only(name: str):
    """A kernel launch with a derivative rule that says it has none. The Pallas calls alias
    their outputs and have no JVP; without this, differentiating fails on an assertion deep in
    Pallas. The sequence functions give the kernels derivatives from the pure-JAX path."""
    def no_derivatives(primals, tangents):
        raise NotImplementedError(
            f"{name}'s Pallas kernels run forward only, with no derivatives: differentiate "
            f"gdn_jax.gated_delta_rule / gdn_jax.kda (any impl: a kernel's derivatives come "
            f"from the pure-JAX path), or call {name} with impl='reference'")

    def wrap(run):
        @functools.wraps(run)
        def launch(*arrays, **static):
            if not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(arrays)):
                return run(*arrays, **static)     # concrete arrays: nothing to differentiate
            call = jax.custom_jvp(lambda *a: run(*a, **static))
            call.defjvp(no_derivatives)
            return call(*arrays)
        return launch
    return wrap


@_forward_only("gdn_prefill")
@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "raw_gates", "lower_bound",
                                             "output_final_state", "chunk_states", "kernel",
                                             "even_starts", "aligned_chunks", "dense_len",
                                             "interpret"))
def _run(q, k, v, g, beta, cu, initial_state, A_log, dt_bias, positions, *, scale, use_qk_l2norm,
         raw_gates, lower_bound, output_final_state, chunk_states, kernel, even_starts,
         aligned_chunks, dense_len, interpret):
    B, T = q.shape[:2]
    HV, V = v.shape[2], v.shape[3]
    N = cu.shape[0] - 1
    static = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, raw_gates=raw_gates,
                  lower_bound=lower_bound)
    state_dtype = jnp.dtype(jnp.float32 if initial_state is None else initial_state.dtype)
    bounds = first = None
    if kernel == "serial":
        o, final = _serial(q, k, v, g, beta, cu[:-1], cu[1:], initial_state, A_log, dt_bias,
                           static=static, state_dtype=state_dtype, interpret=interpret)
    else:
        spec = _spec(q, v, g, **static, has_initial_state=initial_state is not None,
                     output_final_state=output_final_state,
                     boundary_states=chunk_states or positions is not None,
                     even_starts=even_starts, aligned_chunks=aligned_chunks)
        o, final, bounds, (_, _, first) = kern.chunk_prefill(
            _pack(q), _pack(k), _pack(v), _pack(g), _pack(beta), cu, spec=spec,
            block=kern.PrefillBlockSizes.get_default(spec, N, v.dtype), A_log=A_log,
            dt_bias=dt_bias, initial_state=initial_state, state_dtype=state_dtype,
            dense_len=dense_len, interpret=interpret)
    at = None
    if positions is not None:
        at = _advance_to_positions(q, k, v, g, beta, cu, positions, initial_state, bounds, first,
                                   A_log, dt_bias, static=static, state_dtype=state_dtype,
                                   interpret=interpret)
    lens = cu[1:] - cu[:-1]
    chunks = ChunkStates(bounds, first, (lens + CHUNK - 1) // CHUNK) if chunk_states else None
    return o.reshape(B, T, HV, V), final, chunks, at


def check_args(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, A_log=None,
               dt_bias=None, lower_bound=None, pool=None, slots=None):
    """A prefill's arguments, as `gdn_prefill` (and with a pool, `gdn_prefill_pool`) takes them
    (ValueError naming the argument): the sequence functions' checks (`gdn_jax.ops.delta_spec`)
    for g of either form (GDN [B, T, HV], KDA [B, T, HV, K]; raw or not), the raw gates'
    parameters, and the pool and its slot table (a concrete table naming no slot twice)."""
    kind = check_tokens(q, k, v, g, beta)[0]
    spec = delta_spec(kind, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                      cu_seqlens=cu_seqlens)
    chk.gate_params(A_log, dt_bias, spec.num_v_heads, spec.head_k_dim, kind == "kda", lower_bound)
    if pool is None:
        return
    want = (spec.num_v_heads, spec.head_k_dim, spec.head_v_dim)
    if len(chk.shape_of(pool)) != 4 or chk.shape_of(pool)[1:] != want:
        raise ValueError(f"pool must have shape [P, HV={want[0]}, K={want[1]}, V={want[2]}], got "
                         f"{chk.shape_of(pool)}")
    chk.array("pool", pool, floating=True)
    chk.pool_slots("pool", pool)
    chk.slot_table("slots", slots if hasattr(slots, "dtype") else np.asarray(slots),
                   spec.num_seqs, pool.shape[0], outside_is_padding=True)


def gdn_prefill(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=True,
                use_qk_l2norm=False, cu_seqlens=None, A_log=None, dt_bias=None, lower_bound=None,
                chunk_states=False, states_after=None, kernel=None, impl="auto", interpret=None):
    """GDN over whole prompts with the Pallas prefill kernels (FLA-layout arrays).

    q, k [B, T, HK, K]; v [B, T, HV, V]; g, beta [B, T, HV] — or, with `A_log` and `dt_bias`
    [HV], the raw projections a and b (g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)
    in the kernel). KDA: g [B, T, HV, K] per key channel (raw: dt_bias [HV * K], and
    `lower_bound` < 0 for the GLM form g = lb * sigmoid(exp(A_log) * (a + dt_bias))).
    cu_seqlens [N + 1]: B = 1 packed sequences (empty and one-token ones legal).
    initial_state [N, HV, K, V].
    chunk_states: also the state after every chunk of 64 tokens (`ChunkStates`; chunked kernel).
    states_after: token counts, [P] shared by every sequence or [N, P] per sequence (each in
    [0, len_n]; 0 is the initial state): also the state after each, [N, P, HV, K, V] in the
    final state's dtype, equal to the final state of a call cut there.
    kernel: None (SERIAL_PREFILL_TABLE picks), "serial" (token-serial) or "chunked".
    Returns (o [B, T, HV, V] in v's dtype, final state [N, HV, K, V] in initial_state's dtype
    (fp32 without one) or None, ChunkStates or None), and with `states_after` a fourth element,
    the states at those positions.
    impl: "auto" (a kernel where one runs: a GPU or `gdn_jax.interpret()`), "pallas",
    "reference" (the public sequence function with impl="chunked"; no chunk states)."""
    check_args(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
               A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    return gdn_prefill_validated(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens,
        A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, chunk_states=chunk_states,
        states_after=states_after, kernel=kernel, impl=impl, interpret=interpret)


def gdn_prefill_validated(q, k, v, g, beta, *, scale=None, initial_state=None,
                          output_final_state=True, use_qk_l2norm=False, cu_seqlens=None,
                          A_log=None, dt_bias=None, lower_bound=None, chunk_states=False,
                          states_after=None, kernel=None, impl="auto", interpret=None):
    """`gdn_prefill` for callers that have validated the arrays (the sequence functions)."""
    B, T = q.shape[:2]
    call = _prefill_spec_of(q, k, v, g, beta, initial_state=initial_state,
                            cu_seqlens=cu_seqlens, kernel=kernel, chunk_states=chunk_states,
                            A_log=A_log, dt_bias=dt_bias)
    positions = None
    if states_after is not None:
        lens = (np.full((B,), T) if cu_seqlens is None else
                np.diff(np.asarray(cu_seqlens)) if chk.is_concrete(cu_seqlens) else None)
        positions = _check_positions(states_after, call.num_seqs, lens)
    which = _choose("gdn_prefill", call, impl, interpret)
    if which is None:
        if chunk_states:
            raise ValueError("chunk_states=True needs the prefill kernels (a GPU, or "
                             "gdn_jax.interpret()); split the call at the positions instead")
        from gdn_jax.ops import gated_delta_rule, kda
        g2, beta2 = _raw_to_gates(g, beta, A_log, dt_bias, lower_bound)
        o, final = (kda if g2.ndim == 4 else gated_delta_rule)(
            q, k, v, g2, beta2, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
            cu_seqlens=cu_seqlens, impl="chunked")
        if positions is None:
            return o, final, None
        at = reference_states_after(q, k, v, g, beta, positions, scale=scale,
                                    initial_state=initial_state, use_qk_l2norm=use_qk_l2norm,
                                    cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias,
                                    lower_bound=lower_bound)
        return o, final, None, at
    cu, A_log, dt_bias, static = _static_args(q, scale, cu_seqlens, A_log, dt_bias, lower_bound,
                                              use_qk_l2norm)
    if positions is not None and not (chk.is_concrete(states_after) and lens is not None):
        lens = cu[1:] - cu[:-1]
        chk.device_check(jnp.all((positions >= 0) & (positions <= lens[:, None])),
                         "states_after must lie in [0, len] of its sequence")
    o, final, chunks, at = _run(q, k, v, g, beta, cu, initial_state, A_log, dt_bias, positions,
                                **static, output_final_state=bool(output_final_state),
                                chunk_states=bool(chunk_states), kernel=which,
                                **_start_facts(B, T, cu_seqlens),
                                interpret=dispatch.interpret_enabled(interpret))
    final = final if output_final_state else None
    return (o, final, chunks) if positions is None else (o, final, chunks, at)


def _start_align(B: int, T: int, cu_seqlens) -> int:
    """The largest of CHUNK, 2 and 1 that every sequence's first token is known, at trace time,
    to be a multiple of: from B and T for a dense batch (one sequence starts at 0), from
    concrete cu_seqlens, else 1."""
    if cu_seqlens is None:
        starts = np.arange(B) * T
    elif chk.is_concrete(cu_seqlens):
        starts = np.asarray(cu_seqlens)[:-1]
    else:
        return 1
    return next(a for a in (CHUNK, 2, 1) if np.all(starts % a == 0))


def _start_facts(B: int, T: int, cu_seqlens) -> dict:
    """The kernels' static facts about where sequences start: even_starts (what the Mosaic GPU
    scan's narrow form needs), aligned_chunks (every start a multiple of CHUNK: what the
    Mosaic GPU KDA prep needs) and, for a dense batch, dense_len = T (the chunk table is then
    built at trace time: `chunk_prefill`)."""
    align = _start_align(B, T, cu_seqlens)
    return dict(even_starts=align % 2 == 0, aligned_chunks=align == CHUNK,
                dense_len=T if cu_seqlens is None else None)


@_forward_only("gdn_prefill_pool")
@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "raw_gates", "lower_bound",
                                             "kernel", "even_starts", "aligned_chunks",
                                             "dense_len", "interpret"),
                   donate_argnames=("pool",))
def _run_pool(q, k, v, g, beta, cu, pool, slots, A_log, dt_bias, positions, *, scale,
              use_qk_l2norm, raw_gates, lower_bound, kernel, even_starts, aligned_chunks,
              dense_len, interpret):
    B, T = q.shape[:2]
    HV, V = v.shape[2], v.shape[3]
    static = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, raw_gates=raw_gates,
                  lower_bound=lower_bound)
    h0 = live = None
    if positions is not None:
        # The walks to the positions start from the initial states: read them before the kernel
        # overwrites their slots, and tie the pool to that read (else XLA copies the pool to keep
        # the read safe from the in-place write).
        live, h0 = kern.pool_rows(pool, slots)
        h0, pool = jax.lax.optimization_barrier((h0, pool))
    bounds = first = None
    if kernel == "serial":
        o, pool = _serial(q, k, v, g, beta, cu[:-1], cu[1:], pool, A_log, dt_bias, static=static,
                          state_dtype=pool.dtype, interpret=interpret, slots=slots)
    else:
        spec = _spec(q, v, g, **static, pooled=True, boundary_states=positions is not None,
                     even_starts=even_starts, aligned_chunks=aligned_chunks)
        o, pool, bounds, (_, _, first) = kern.chunk_prefill(
            _pack(q), _pack(k), _pack(v), _pack(g), _pack(beta), cu, spec=spec,
            block=kern.PrefillBlockSizes.get_default(spec, cu.shape[0] - 1, v.dtype), A_log=A_log,
            dt_bias=dt_bias, pool=pool, slots=slots, dense_len=dense_len, interpret=interpret)
    if positions is None:
        return o.reshape(B, T, HV, V), pool, None
    at = _advance_to_positions(q, k, v, g, beta, cu, positions, h0, bounds, first, A_log,
                               dt_bias, static=static, state_dtype=pool.dtype,
                               interpret=interpret)
    return o.reshape(B, T, HV, V), pool, _mask_rows(at, live)


def gdn_prefill_pool(q, k, v, g, beta, pool, slots, *, scale=None, use_qk_l2norm=False,
                     cu_seqlens=None, A_log=None, dt_bias=None, lower_bound=None,
                     states_after=None, kernel=None, impl="auto", interpret=None):
    """Prefill that lands in a state pool: sequence n starts from pool[slots[n]] and its final
    state is written there, in place (the pool is donated: use the returned one). A slot outside
    [0, P) (-1 by convention) is padding: nothing is read or written and its outputs are zero;
    slots not named keep their bits. Shapes as `gdn_prefill`; pool [P, HV, K, V] (fp32, fp16 or
    bf16: math in fp32, one rounding at the store); slots [N] int32 (N = B, or len(cu_seqlens)-1).
    states_after: token counts as in `gdn_prefill` ([P] or [N, P], each in [0, len_n]): also
    the state of each sequence after each count, [N, P, HV, K, V] in the pool's dtype (zero
    rows for padding); the named slots' initial states are read once for it (N states).
    kernel and impl as `gdn_prefill` ("reference": `reference_prefill_pool`). Returns (o, pool),
    and with `states_after` a third element, the states at those positions."""
    check_args(q, k, v, g, beta, scale=scale, cu_seqlens=cu_seqlens, A_log=A_log,
               dt_bias=dt_bias, lower_bound=lower_bound, pool=pool, slots=slots)
    B, T = q.shape[:2]
    slots = jnp.asarray(slots)
    call = _pool_spec_of(q, k, v, g, beta, pool, slots, cu_seqlens=cu_seqlens, kernel=kernel,
                         A_log=A_log, dt_bias=dt_bias)
    positions = lens = None
    if states_after is not None:
        lens = (np.full((B,), T) if cu_seqlens is None else
                np.diff(np.asarray(cu_seqlens)) if chk.is_concrete(cu_seqlens) else None)
        positions = _check_positions(states_after, call.num_seqs, lens)
    which = _choose("gdn_prefill_pool", call, impl, interpret)
    if which is None:
        # "auto" without a kernel takes the sequence functions' pure-JAX rule (the scan for
        # short sequences, the chunk form for long ones); "reference" the scan.
        from gdn_jax.ops import AUTO_CHUNKED_MIN_T
        form = "chunked" if impl == "auto" and call.max_seq_len >= AUTO_CHUNKED_MIN_T else "reference"
        if positions is not None:
            live, h0 = kern.pool_rows(pool, slots.astype(jnp.int32))
        o, pool = reference_prefill_pool(q, k, v, g, beta, pool, slots, scale=scale,
                                         use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens,
                                         A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                                         impl=form)
        if positions is None:
            return o, pool
        at = reference_states_after(q, k, v, g, beta, positions, scale=scale,
                                    initial_state=h0.astype(pool.dtype),
                                    use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens,
                                    A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
        return o, pool, _mask_rows(at, live)
    cu, A_log, dt_bias, static = _static_args(q, scale, cu_seqlens, A_log, dt_bias, lower_bound,
                                              use_qk_l2norm)
    if positions is not None and not (chk.is_concrete(states_after) and lens is not None):
        lens = cu[1:] - cu[:-1]
        chk.device_check(jnp.all((positions >= 0) & (positions <= lens[:, None])),
                         "states_after must lie in [0, len] of its sequence")
    o, pool, at = _run_pool(q, k, v, g, beta, cu, pool, slots.astype(jnp.int32), A_log, dt_bias,
                            positions, **static, kernel=which,
                            **_start_facts(B, T, cu_seqlens),
                            interpret=dispatch.interpret_enabled(interpret))
    return (o, pool) if positions is None else (o, pool, at)


def reference_prefill_pool(q, k, v, g, beta, pool, slots, *, scale=None, use_qk_l2norm=False,
                           cu_seqlens=None, A_log=None, dt_bias=None, lower_bound=None,
                           impl="reference"):
    """The pure-JAX meaning of `gdn_prefill_pool` (the oracle its kernel is tested against).
    impl: the sequence function's pure-JAX form, "reference" (the token scan) or "chunked"."""
    if impl not in ("reference", "chunked"):
        raise ValueError(f"impl must be 'reference' or 'chunked', got {impl!r}")
    g, beta = _raw_to_gates(g, beta, A_log, dt_bias, lower_bound)
    P = pool.shape[0]
    slots = jnp.asarray(slots, jnp.int32)
    live, h0 = kern.pool_rows(pool, slots)
    from gdn_jax.ops import gated_delta_rule, kda
    o, hT = (kda if g.ndim == 4 else gated_delta_rule)(q, k, v, g, beta, scale=scale, initial_state=h0,
                             output_final_state=True, use_qk_l2norm=use_qk_l2norm,
                             cu_seqlens=cu_seqlens, impl=impl)
    if cu_seqlens is None:
        o = jnp.where(live[:, None, None, None], o, 0)
    else:
        cu = jnp.asarray(cu_seqlens, jnp.int32)
        seq = jnp.searchsorted(cu, jnp.arange(q.shape[1]), side="right") - 1
        o = jnp.where(live[seq][None, :, None, None], o, 0)
    target = jnp.where(live, slots, P)  # padding rows scatter out of bounds: dropped
    return o, pool.at[target].set(hT.astype(pool.dtype), mode="drop")
