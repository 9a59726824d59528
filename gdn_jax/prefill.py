"""GDN and KDA prefill through the chunked Pallas kernels (pallas_kernels/gdn_prefill.py).

    gdn_prefill(q, k, v, g, beta, ...)                 dense [B, T] or packed (cu_seqlens) batch;
                                                       optional raw gates, chunk-boundary states
    gdn_prefill_pool(q, k, v, g, beta, pool, slots)    initial and final states in pool slots,
                                                       updated in place (pool donated)
    prefill_kernel_reason(...)                         why the kernel cannot take a call (or None)

`gated_delta_rule(..., impl="pallas" | "auto")` runs the same kernels for T > 1. Every sequence
of a batch is processed without padding: a dense batch is the packing of B sequences of T tokens.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax import dispatch
from gdn_jax import reference as ref
from pallas_kernels import gdn_prefill as kern

CHUNK = kern.CHUNK

__all__ = ["ChunkStates", "gdn_prefill", "gdn_prefill_pool", "reference_prefill_pool",
           "prefill_kernel_reason", "CHUNK"]


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


def _kernel_runs(impl, interpret, head_k_dim, head_v_dim) -> bool:
    """The dispatch rule for these entry points: "reference" runs the pure-JAX path, "pallas" the
    kernels (ValueError with the reason when they cannot run here), "auto" the kernels when they
    can, else the pure-JAX path."""
    if impl not in ("auto", "pallas", "reference"):
        raise ValueError(f"impl must be one of ('auto', 'pallas', 'reference'), got {impl!r}")
    if impl == "reference":
        return False
    reason = prefill_kernel_reason(head_k_dim=head_k_dim, head_v_dim=head_v_dim,
                                   backend=jax.default_backend(),
                                   interpret=dispatch.interpret_enabled(interpret))
    if reason is not None and impl == "pallas":
        raise ValueError(f"impl='pallas': {reason}")
    return reason is None


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


def _spec(q, v, g, *, scale, use_qk_l2norm, raw_gates, lower_bound, **flags):
    """The kernels' static spec for FLA-layout q [B, T, HK, K], v [B, T, HV, V] and g."""
    return kern.PrefillSpec(num_k_heads=q.shape[2], num_v_heads=v.shape[2], head_k_dim=q.shape[3],
                            head_v_dim=v.shape[3], scale=scale, use_qk_l2norm=use_qk_l2norm,
                            raw_gates=raw_gates, per_channel_gate=g.ndim == 4,
                            gate_lower_bound=lower_bound, precise=v.dtype == jnp.float32, **flags)


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


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "raw_gates", "lower_bound",
                                             "output_final_state", "chunk_states", "interpret"))
def _run(q, k, v, g, beta, cu, initial_state, A_log, dt_bias, *, scale, use_qk_l2norm,
         raw_gates, lower_bound, output_final_state, chunk_states, interpret):
    B, T = q.shape[:2]
    HV, V = v.shape[2], v.shape[3]
    N = cu.shape[0] - 1
    spec = _spec(q, v, g, scale=scale, use_qk_l2norm=use_qk_l2norm, raw_gates=raw_gates,
                 lower_bound=lower_bound, has_initial_state=initial_state is not None,
                 output_final_state=output_final_state, boundary_states=chunk_states)
    state_dtype = jnp.float32 if initial_state is None else initial_state.dtype
    o, final, bounds, (_, _, first) = kern.chunk_prefill(
        _pack(q), _pack(k), _pack(v), _pack(g), _pack(beta), cu, spec=spec,
        block=kern.PrefillBlockSizes.get_default(spec, N), A_log=A_log, dt_bias=dt_bias,
        initial_state=initial_state, state_dtype=jnp.dtype(state_dtype), interpret=interpret)
    lens = cu[1:] - cu[:-1]
    chunks = ChunkStates(bounds, first, (lens + CHUNK - 1) // CHUNK) if chunk_states else None
    return o.reshape(B, T, HV, V), final, chunks


def gdn_prefill(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=True,
                use_qk_l2norm=False, cu_seqlens=None, A_log=None, dt_bias=None, lower_bound=None,
                chunk_states=False, impl="auto", interpret=None):
    """GDN over whole prompts with the chunked Pallas kernels (validated by the caller's front
    door, or call it directly with FLA-layout arrays).

    q, k [B, T, HK, K]; v [B, T, HV, V]; g, beta [B, T, HV] — or, with `A_log` and `dt_bias`
    [HV], the raw projections a and b (g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)
    in the kernel). KDA: g [B, T, HV, K] per key channel (raw: dt_bias [HV * K], and
    `lower_bound` < 0 for the GLM form g = lb * sigmoid(exp(A_log) * (a + dt_bias))).
    cu_seqlens [N + 1]: B = 1 packed sequences (empty and one-token ones legal).
    initial_state [N, HV, K, V]. Returns (o [B, T, HV, V] in v's dtype, final state [N, HV, K, V]
    in initial_state's dtype (fp32 without one) or None, ChunkStates or None).
    impl: "auto" (the kernels where they run: a GPU or `gdn_jax.interpret()`), "pallas",
    "reference" (the public sequence function with impl="chunked"; no chunk states)."""
    K, V = q.shape[3], v.shape[3]
    if not _kernel_runs(impl, interpret, K, V):
        if chunk_states:
            raise ValueError("chunk_states=True needs the prefill kernels (a GPU, or "
                             "gdn_jax.interpret()); split the call at the positions instead")
        from gdn_jax.ops import gated_delta_rule, kda
        g, beta = _raw_to_gates(g, beta, A_log, dt_bias, lower_bound)
        o, final = (kda if g.ndim == 4 else gated_delta_rule)(
            q, k, v, g, beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
            cu_seqlens=cu_seqlens, impl="chunked")
        return o, final, None
    cu, A_log, dt_bias, static = _static_args(q, scale, cu_seqlens, A_log, dt_bias, lower_bound,
                                              use_qk_l2norm)
    o, final, chunks = _run(q, k, v, g, beta, cu, initial_state, A_log, dt_bias, **static,
                            output_final_state=bool(output_final_state),
                            chunk_states=bool(chunk_states),
                            interpret=dispatch.interpret_enabled(interpret))
    return o, final if output_final_state else None, chunks


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "raw_gates", "lower_bound",
                                             "interpret"),
                   donate_argnames=("pool",))
def _run_pool(q, k, v, g, beta, cu, pool, slots, A_log, dt_bias, *, scale, use_qk_l2norm,
              raw_gates, lower_bound, interpret):
    B, T = q.shape[:2]
    HV, V = v.shape[2], v.shape[3]
    spec = _spec(q, v, g, scale=scale, use_qk_l2norm=use_qk_l2norm, raw_gates=raw_gates,
                 lower_bound=lower_bound, pooled=True)
    o, pool, _, _ = kern.chunk_prefill(
        _pack(q), _pack(k), _pack(v), _pack(g), _pack(beta), cu, spec=spec,
        block=kern.PrefillBlockSizes.get_default(spec, cu.shape[0] - 1), A_log=A_log,
        dt_bias=dt_bias, pool=pool, slots=slots, interpret=interpret)
    return o.reshape(B, T, HV, V), pool


def gdn_prefill_pool(q, k, v, g, beta, pool, slots, *, scale=None, use_qk_l2norm=False,
                     cu_seqlens=None, A_log=None, dt_bias=None, lower_bound=None, impl="auto",
                     interpret=None):
    """Prefill that lands in a state pool: sequence n starts from pool[slots[n]] and its final
    state is written there, in place (the pool is donated: use the returned one). A slot outside
    [0, P) (-1 by convention) is padding: nothing is read or written and its outputs are zero;
    slots not named keep their bits. Shapes as `gdn_prefill`; pool [P, HV, K, V] (fp32, fp16 or
    bf16: math in fp32, one rounding at the store); slots [N] int32 (N = B, or len(cu_seqlens)-1).
    impl as `gdn_prefill` ("reference": `reference_prefill_pool`). Returns (o, pool)."""
    B, _, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else int(np.shape(cu_seqlens)[0]) - 1
    if getattr(pool, "ndim", None) != 4 or pool.shape[1:] != (HV, K, V):
        raise ValueError(f"pool must have shape [P, HV={HV}, K={K}, V={V}], got "
                         f"{getattr(pool, 'shape', None)}")
    if not jnp.issubdtype(pool.dtype, jnp.floating):
        raise ValueError(f"pool must be a floating-point array, got dtype {pool.dtype}")
    slots = jnp.asarray(slots)
    if slots.shape != (N,) or not jnp.issubdtype(slots.dtype, jnp.integer):
        raise ValueError(f"slots must be an integer array of shape ({N},), got shape "
                         f"{slots.shape} dtype {slots.dtype}")
    if (A_log is None) != (dt_bias is None):
        raise ValueError("A_log and dt_bias must be given together (raw gates) or not at all")
    if not _kernel_runs(impl, interpret, K, V):
        return reference_prefill_pool(q, k, v, g, beta, pool, slots, scale=scale,
                                      use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens,
                                      A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    cu, A_log, dt_bias, static = _static_args(q, scale, cu_seqlens, A_log, dt_bias, lower_bound,
                                              use_qk_l2norm)
    return _run_pool(q, k, v, g, beta, cu, pool, slots.astype(jnp.int32), A_log, dt_bias,
                     **static, interpret=dispatch.interpret_enabled(interpret))


def reference_prefill_pool(q, k, v, g, beta, pool, slots, *, scale=None, use_qk_l2norm=False,
                           cu_seqlens=None, A_log=None, dt_bias=None, lower_bound=None):
    """The pure-JAX meaning of `gdn_prefill_pool` (the oracle its kernel is tested against)."""
    g, beta = _raw_to_gates(g, beta, A_log, dt_bias, lower_bound)
    P = pool.shape[0]
    slots = jnp.asarray(slots, jnp.int32)
    live = (slots >= 0) & (slots < P)
    h0 = jnp.where(live[:, None, None, None], pool[jnp.clip(slots, 0, P - 1)], 0).astype(jnp.float32)
    from gdn_jax.ops import gated_delta_rule, kda
    o, hT = (kda if g.ndim == 4 else gated_delta_rule)(q, k, v, g, beta, scale=scale, initial_state=h0,
                             output_final_state=True, use_qk_l2norm=use_qk_l2norm,
                             cu_seqlens=cu_seqlens, impl="reference")
    if cu_seqlens is None:
        o = jnp.where(live[:, None, None, None], o, 0)
    else:
        cu = jnp.asarray(cu_seqlens, jnp.int32)
        seq = jnp.searchsorted(cu, jnp.arange(q.shape[1]), side="right") - 1
        o = jnp.where(live[seq][None, :, None, None], o, 0)
    target = jnp.where(live, slots, P)  # padding rows scatter out of bounds: dropped
    return o, pool.at[target].set(hT.astype(pool.dtype), mode="drop")
