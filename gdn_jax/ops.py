"""Public sequence entry points: `gated_delta_rule` (GDN) and `kda`.

Both validate once into a `DeltaSpec` and ask `gdn_jax.dispatch` which implementation runs:

  "reference"  token-serial `lax.scan` (gdn_jax.reference.recurrent_delta_rule)
  "chunked"    pure-JAX WY/UT chunk form, chunk 64 (gdn_jax.reference.chunked_delta_rule)
  "pallas"     a registered kernel family: the single-token decode kernel (T = 1, not packed),
               else the token-serial prefill kernel for short prompts (by
               gdn_jax.prefill.SERIAL_PREFILL_TABLE, KDA_SERIAL_PREFILL_TABLE for kda, on the
               number of sequences and the longest),
               else the chunked prefill kernels (gdn_jax.prefill; any T, packed or not)
  "auto"       a kernel when one takes the call (a GPU, or interpret mode, and head dims the
               kernels take), else the scan for T < 16 and the chunk form above

Kernel families for these operations are called as
`run(spec, q, k, v, g, beta, initial_state, cu_seqlens) -> (o [B, T, HV, V], final [N, HV, K, V])`
with the caller's initial state (None for zeros), which a family must not donate. Under
jax.grad / jax.jvp a kernel call takes its derivatives from the pure-JAX path "auto" falls back
to (`_kernel`), so every impl is differentiable.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax import dispatch
from gdn_jax import reference as ref
from gdn_jax import validate as chk

IMPLS = dispatch.IMPLS
CHUNK_SIZE = 64
# Below this many tokens the token-serial scan is as fast as the chunk form and simpler.
AUTO_CHUNKED_MIN_T = 16

__all__ = ["gated_delta_rule", "kda", "DeltaSpec", "delta_spec", "IMPLS"]


@dataclasses.dataclass(frozen=True)
class DeltaSpec:
    """A validated sequence call (static; hashable). N is the number of sequences (B, or the
    number of packed sequences with cu_seqlens)."""
    kind: str                  # "gdn" or "kda"
    batch: int
    seq_len: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    num_seqs: int
    varlen: bool
    scale: float
    use_qk_l2norm: bool
    input_dtype: str
    state_dtype: str           # the initial state's dtype (float32 without one)
    max_seq_len: int = 0       # the longest sequence: T, or with concrete cu_seqlens the longest
    float64_arrays: tuple[str, ...] = ()   # arrays JAX holds as float64 (x64 on): no kernel


def delta_spec(kind, q, k, v, g, beta, *, scale=None, initial_state=None, use_qk_l2norm=False,
               cu_seqlens=None, output_final_state=False) -> DeltaSpec:
    """Validate a sequence call's arguments (ValueError naming the argument) into its spec."""
    b, t, hk, hv, kd, vd = chk.tokens(q, k, v, beta)
    want_g = (b, t, hv) if kind == "gdn" else (b, t, hv, kd)
    chk.array("g", g, floating=True)
    chk.shape("g", g, want_g)
    chk.shape("beta", beta, (b, t, hv))
    n, longest = b, t
    if cu_seqlens is not None:
        if b != 1:
            raise ValueError(f"cu_seqlens needs packed input with B = 1, got B = {b}")
        cu = cu_seqlens if hasattr(cu_seqlens, "dtype") else np.asarray(cu_seqlens)
        if len(cu.shape) != 1 or cu.shape[0] < 2 or not jnp.issubdtype(cu.dtype, jnp.integer):
            raise ValueError(f"cu_seqlens must be a 1-D integer array of N+1 >= 2 offsets, got "
                             f"shape {chk.shape_of(cu)} dtype {cu.dtype}")
        n = cu.shape[0] - 1
        if chk.is_concrete(cu):
            c = np.asarray(cu)
            if c[0] != 0 or c[-1] != t:
                raise ValueError(f"cu_seqlens must start at 0 and end at T={t}, got {c.tolist()}")
            if np.any(np.diff(c) < 0):
                raise ValueError(f"cu_seqlens must be non-decreasing, got {c.tolist()}")
            longest = int(np.max(np.diff(c)))
        elif chk.checking():      # traced offsets: checked on the device inside `checked`
            cu = jnp.asarray(cu)
            chk.device_check((cu[0] == 0) & (cu[-1] == t) & jnp.all(cu[1:] >= cu[:-1]),
                             f"cu_seqlens must start at 0, end at T={t} and never decrease")
    state_dtype = jnp.dtype(jnp.float32)
    if initial_state is not None:
        chk.array("initial_state", initial_state, floating=True)
        chk.shape("initial_state", initial_state, (n, hv, kd, vd))
        state_dtype = jnp.dtype(initial_state.dtype)
    return DeltaSpec(kind=kind, batch=b, seq_len=t, num_k_heads=hk, num_v_heads=hv, head_k_dim=kd,
                     head_v_dim=vd, num_seqs=n, varlen=cu_seqlens is not None,
                     scale=chk.scale(scale, kd), use_qk_l2norm=bool(use_qk_l2norm),
                     input_dtype=_input_dtype(q, k, v), state_dtype=str(state_dtype),
                     max_seq_len=longest,
                     float64_arrays=chk.float64_arrays(q=q, k=k, v=v, g=g, beta=beta,
                                                       initial_state=initial_state))


def _input_dtype(q, k, v) -> str:
    """The one dtype the kernels take q, k and v in: theirs when they agree, else float32 (the
    chunked kernels pick their precision by it, so mixed inputs run at the widest; a float64
    among them keeps the call off the kernels anyway)."""
    dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
    return str(dtypes.pop() if len(dtypes) == 1 else jnp.dtype(jnp.float32))


def _fallback(spec: DeltaSpec) -> str:
    return "chunked" if spec.seq_len >= AUTO_CHUNKED_MIN_T else "reference"


# --------------------------------------------------------------------------- the decode family

def _decode_supports(spec: DeltaSpec):
    if spec.seq_len != 1 or spec.varlen:
        return (f"the decode kernel takes one token per sequence (T={spec.seq_len}"
                f"{', packed' if spec.varlen else ''})")
    from gdn_jax import decode  # imports Pallas: only when a kernel is considered
    return decode.sequence_step_reason(spec)


def _decode_run(spec, q, k, v, g, beta, initial_state, cu_seqlens):
    from gdn_jax import decode
    if initial_state is None:
        initial_state = jnp.zeros((spec.num_seqs, spec.num_v_heads, spec.head_k_dim,
                                   spec.head_v_dim), jnp.float32)
    # Not donated (an eager call, or one under vmap, keeps the caller's initial_state valid, as
    # every other impl does). Inside the caller's jit the kernel's in-place alias is resolved by
    # XLA: it copies the caller's buffer only when the caller still needs it, so a step whose
    # state the caller donates reads and writes it once.
    return decode.sequence_step(spec, q, k, v, g, beta, initial_state)


# --------------------------------------------------------------------------- the prefill families

def _prefill_call(spec: DeltaSpec):
    from gdn_jax import prefill  # imports Pallas: only when a kernel is considered
    return prefill.PrefillCall(num_seqs=spec.num_seqs, max_seq_len=spec.max_seq_len,
                               head_k_dim=spec.head_k_dim, head_v_dim=spec.head_v_dim,
                               state_dtype=spec.state_dtype,
                               fp32_inputs=prefill.fp32_inputs(spec.input_dtype),
                               per_channel_gate=spec.kind == "kda")


def _serial_supports(spec: DeltaSpec):
    from gdn_jax import prefill
    return prefill.SERIAL_FAMILY.supports(_prefill_call(spec))


def _serial_rule(spec: DeltaSpec):
    from gdn_jax import prefill
    return prefill.SERIAL_FAMILY.rule(_prefill_call(spec))


def _prefill_supports(spec: DeltaSpec):
    from gdn_jax import prefill
    return prefill.CHUNKED_FAMILY.supports(_prefill_call(spec))


def _prefill_runner(kernel):
    def run(spec, q, k, v, g, beta, initial_state, cu_seqlens):
        from gdn_jax import prefill
        o, final, _ = prefill.gdn_prefill_validated(
            q, k, v, g, beta, scale=spec.scale, initial_state=initial_state,
            output_final_state=True, use_qk_l2norm=spec.use_qk_l2norm, cu_seqlens=cu_seqlens,
            kernel=kernel, impl="pallas", interpret=dispatch.interpret_enabled())
        return o, final
    return run


for _op in ("gated_delta_rule", "kda"):
    dispatch.define(_op, fallback=_fallback, pure_impls=("reference", "chunked"),
                    spec_of=functools.partial(
                        lambda kind, q, k, v, g, beta, **kw: delta_spec(kind, q, k, v, g, beta, **kw),
                        "gdn" if _op == "gated_delta_rule" else "kda"))
    dispatch.register(_op, dispatch.KernelFamily("decode", _decode_supports, _decode_run))
    dispatch.register(_op, dispatch.KernelFamily("serial prefill", _serial_supports,
                                                 _prefill_runner("serial"), rule=_serial_rule))
    dispatch.register(_op, dispatch.KernelFamily("chunked prefill", _prefill_supports,
                                                 _prefill_runner("chunked")))


# --------------------------------------------------------------------------- pure-JAX paths

@functools.partial(jax.jit, static_argnames=("impl", "scale", "use_qk_l2norm"))
def _run_dense(impl, q, k, v, g, beta, scale, initial_state, use_qk_l2norm):
    fn = ref.recurrent_delta_rule if impl == "reference" else ref.chunked_delta_rule
    return fn(q, k, v, g, beta, scale=scale, initial_state=initial_state, use_qk_l2norm=use_qk_l2norm)


@functools.partial(jax.jit, static_argnames=("impl", "scale", "use_qk_l2norm", "tmax"))
def _varlen(impl, q, k, v, g, beta, scale, initial_state, use_qk_l2norm, cu, tmax):
    """Packed sequences -> a padded [N, Tmax] batch (neutral padding: g = 0, beta = 0, q = k = v = 0,
    which leaves the state untouched) -> the dense path -> packed outputs."""
    t = q.shape[1]
    lens = cu[1:] - cu[:-1]
    offs = jnp.arange(tmax, dtype=jnp.int32)
    valid = offs[None, :] < lens[:, None]                                   # [N, Tmax]
    idx = jnp.where(valid, cu[:-1, None] + offs[None, :], 0)

    def gather(x):
        y = x[0][idx]                                                       # [N, Tmax, ...]
        m = valid.reshape(valid.shape + (1,) * (y.ndim - 2))
        return jnp.where(m, y, jnp.zeros((), y.dtype))

    o, s = _run_dense(impl, *map(gather, (q, k, v, g, beta)), scale, initial_state, use_qk_l2norm)
    pos = jnp.arange(t, dtype=jnp.int32)
    seq = jnp.searchsorted(cu, pos, side="right") - 1
    return o[seq, pos - cu[seq]][None], s


def _delta_rule(kind, q, k, v, g, beta, *, scale, initial_state, output_final_state,
                use_qk_l2norm, cu_seqlens, impl, interpret=None):
    op = "gated_delta_rule" if kind == "gdn" else "kda"
    dispatch.check_impl(op, impl)
    spec = delta_spec(kind, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                      use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens)
    choice = dispatch.select(op, spec, impl, interpret=interpret)
    out_dtype = q.dtype
    if choice.impl == "pallas":
        q, k, v = (x if x.dtype == spec.input_dtype else x.astype(spec.input_dtype)
                   for x in (q, k, v))
        o, s = _kernel(spec, dispatch.family(op, choice.family).run,
                       dispatch.interpret_enabled(interpret), q, k, v, g, beta, initial_state,
                       cu_seqlens)
    else:
        o, s = _pure(choice.impl, spec, q, k, v, g, beta, initial_state, cu_seqlens)
    return o.astype(out_dtype), (s.astype(spec.state_dtype) if output_final_state else None)


def _pure(impl, spec, q, k, v, g, beta, initial_state, cu_seqlens):
    """The pure-JAX path `impl` ("reference" or "chunked") of a validated call."""
    if cu_seqlens is None:
        return _run_dense(impl, q, k, v, g, beta, spec.scale, initial_state, spec.use_qk_l2norm)
    # Concrete offsets pad to the longest sequence; traced ones (under jit) to T.
    tmax = (int(np.max(np.diff(np.asarray(cu_seqlens)))) if chk.is_concrete(cu_seqlens)
            else q.shape[1])
    return _varlen(impl, q, k, v, g, beta, spec.scale, initial_state, spec.use_qk_l2norm,
                   jnp.asarray(cu_seqlens, jnp.int32), tmax)


def _kernel(spec, run, interpret, q, k, v, g, beta, initial_state, cu_seqlens):
    """A kernel family's `run`, with the derivatives of the pure-JAX path "auto" falls back to.

    The kernels are forward-only (a Pallas call with aliased outputs has no JVP). Under
    jax.jvp / jax.grad the outputs still come from the kernel, and the tangents (and, by
    transposition, the gradients) from differentiating the same recurrence in pure JAX at the
    same inputs: the backward pass costs what the pure-JAX path's does. Without
    differentiation only the kernel runs."""
    @jax.custom_jvp
    def call(q, k, v, g, beta, h0):
        with dispatch.interpret(interpret):
            return run(spec, q, k, v, g, beta, h0, cu_seqlens)

    @call.defjvp
    def _(primals, tangents):
        out = call(*primals)
        pure = lambda *x: _pure(_fallback(spec), spec, *x, cu_seqlens)
        _, t_out = jax.jvp(pure, primals, tangents)
        return out, jax.tree.map(lambda t, o: t.astype(o.dtype), t_out, out)

    return call(q, k, v, g, beta, initial_state)


def gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                     use_qk_l2norm=False, cu_seqlens=None, impl="auto", interpret=None):
    """Gated DeltaNet over a sequence (FLA layout). Returns (o [B, T, HV, V], final_state or None).

    q, k [B, T, HK, K]; v [B, T, HV, V]; g [B, T, HV] log-space decay (<= 0); beta [B, T, HV];
    scale: a positive finite number (default K^-0.5); initial_state [N, HV, K, V] (N = B, or
    the number of packed sequences with cu_seqlens); the final state has initial_state's dtype
    (fp32 without one). cu_seqlens [N+1] int: B = 1 packed variable-length sequences, each
    starting from its own initial state (checked on the host when concrete; traced offsets are
    checked inside `gdn_jax.checked`). o has q's dtype; all state/gate math is fp32.
    impl: see `gdn_jax.dispatch` ("auto", "reference", "chunked", "pallas"); interpret: None
    follows `gdn_jax.interpret()` / GDN_JAX_INTERPRET."""
    return _delta_rule("gdn", q, k, v, g, beta, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
                       cu_seqlens=cu_seqlens, impl=impl, interpret=interpret)


def kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
        use_qk_l2norm=False, cu_seqlens=None, impl="auto", interpret=None):
    """Kimi Delta Attention: `gated_delta_rule` with a per-key-channel decay g [B, T, HV, K]."""
    return _delta_rule("kda", q, k, v, g, beta, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
                       cu_seqlens=cu_seqlens, impl=impl, interpret=interpret)
