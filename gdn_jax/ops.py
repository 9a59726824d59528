"""Public sequence entry points: `gated_delta_rule` (GDN) and `kda`, with validation and `impl` dispatch.

`impl` values (relied on by outside code, keep them):
  "reference"  token-serial `lax.scan` (gdn_jax.reference.recurrent_delta_rule)
  "chunked"    pure-JAX WY/UT chunk form, chunk 64 (gdn_jax.reference.chunked_delta_rule)
  "pallas"     the Pallas kernels; raises ValueError when no kernel can take the call
  "auto"       the best available for the call (see `select_impl`)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax import reference as ref

IMPLS = ("auto", "reference", "chunked", "pallas")
CHUNK_SIZE = 64
# Below this many tokens the token-serial scan is as fast as the chunk form and simpler.
AUTO_CHUNKED_MIN_T = 16


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _check_float(name, x):
    # Callers check the rank first, so x is an array here.
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating-point array, got dtype {x.dtype}")


def validate_delta_inputs(kind, q, k, v, g, beta, initial_state=None, cu_seqlens=None, impl="auto"):
    """Shape/dtype checks shared by every sequence entry point. Raises ValueError naming the argument.

    Returns the number of sequences N (B, or len(cu_seqlens) - 1 for packed varlen input)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    for name, x, rank in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("beta", beta, 3)):
        if getattr(x, "ndim", None) != rank:
            raise ValueError(f"{name} must have rank {rank}, got shape {getattr(x, 'shape', None)}")
        _check_float(name, x)
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {q.shape}, got {k.shape}")
    b, t, hk, kd = q.shape
    if v.shape[:2] != (b, t):
        raise ValueError(f"v must be [B={b}, T={t}, HV, V], got {v.shape}")
    hv, vd = v.shape[2], v.shape[3]
    if hk == 0 or hv % hk:
        raise ValueError(f"v's head count HV={hv} must be a multiple of q/k's head count HK={hk}")
    if kd == 0 or vd == 0:
        raise ValueError(f"head dims must be positive, got K={kd} (q) and V={vd} (v)")
    want_g = (b, t, hv) if kind == "gdn" else (b, t, hv, kd)
    if getattr(g, "shape", None) != want_g:
        raise ValueError(f"g must have shape {want_g} for {kind.upper()}, got {getattr(g, 'shape', None)}")
    _check_float("g", g)
    if beta.shape != (b, t, hv):
        raise ValueError(f"beta must have shape {(b, t, hv)}, got {beta.shape}")
    n = b
    if cu_seqlens is not None:
        if b != 1:
            raise ValueError(f"cu_seqlens needs packed input with B = 1, got B = {b}")
        cu = jnp.asarray(cu_seqlens) if not hasattr(cu_seqlens, "dtype") else cu_seqlens
        if cu.ndim != 1 or cu.shape[0] < 2 or not jnp.issubdtype(cu.dtype, jnp.integer):
            raise ValueError(f"cu_seqlens must be a 1-D integer array of N+1 >= 2 offsets, got "
                             f"shape {cu.shape} dtype {cu.dtype}")
        n = cu.shape[0] - 1
        if _is_concrete(cu):
            c = np.asarray(cu)
            if c[0] != 0 or c[-1] != t:
                raise ValueError(f"cu_seqlens must start at 0 and end at T={t}, got {c.tolist()}")
            if np.any(np.diff(c) < 0):
                raise ValueError(f"cu_seqlens must be non-decreasing, got {c.tolist()}")
    if initial_state is not None:
        if getattr(initial_state, "shape", None) != (n, hv, kd, vd):
            raise ValueError(f"initial_state must have shape {(n, hv, kd, vd)} "
                             f"([N, HV, K, V]), got {getattr(initial_state, 'shape', None)}")
        _check_float("initial_state", initial_state)
    return n


def select_impl(impl: str, *, seq_len: int, kind: str, varlen: bool = False) -> str:
    """Which implementation runs a sequence call. Pure: testable without a device.

    A single token (not packed varlen) with impl "pallas" or "auto" goes to the decode dispatch
    ("decode"), which runs the Pallas decode kernel when it can take the call (and, for "auto",
    the reference step otherwise). There is no Pallas prefill kernel yet, so "pallas" is refused
    for longer sequences and "auto" takes the reference scan for short sequences, the chunk form
    for long ones."""
    if impl in ("pallas", "auto") and seq_len == 1 and not varlen:
        return "decode"
    if impl == "pallas":
        raise ValueError(f"impl='pallas': no Pallas {kind.upper()} sequence (prefill) kernel exists "
                         f"(T={seq_len}); use impl='chunked' or 'auto' (the single-token decode kernel "
                         "takes T = 1)")
    if impl == "auto":
        return "chunked" if seq_len >= AUTO_CHUNKED_MIN_T else "reference"
    return impl


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
                use_qk_l2norm, cu_seqlens, impl):
    validate_delta_inputs(kind, q, k, v, g, beta, initial_state, cu_seqlens, impl)
    which = select_impl(impl, seq_len=q.shape[1], kind=kind, varlen=cu_seqlens is not None)
    if which == "decode":
        from gdn_jax.decode import gdn_decode  # the decode dispatch imports the kernels: load lazily
        b, _, hk, kd = q.shape
        hv, vd = v.shape[2:]
        # The decode kernel updates its state argument in place (donated): give it a buffer of its
        # own so the caller's initial_state stays valid, as for every other impl.
        state = (jnp.zeros((b, hv, kd, vd), jnp.float32) if initial_state is None
                 else jnp.copy(initial_state))
        o, s = gdn_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state, scale=scale,
                          use_qk_l2norm=use_qk_l2norm, impl=impl)
        return o[:, None].astype(q.dtype), (s if output_final_state else None)
    if cu_seqlens is None:
        o, s = _run_dense(which, q, k, v, g, beta, scale, initial_state, use_qk_l2norm)
    else:
        # Concrete offsets pad to the longest sequence; traced ones (under jit) to T.
        tmax = (int(np.max(np.diff(np.asarray(cu_seqlens)))) if _is_concrete(cu_seqlens)
                else q.shape[1])
        o, s = _varlen(which, q, k, v, g, beta, scale, initial_state, use_qk_l2norm,
                       jnp.asarray(cu_seqlens, jnp.int32), tmax)
    state_dtype = jnp.float32 if initial_state is None else initial_state.dtype
    return o.astype(q.dtype), (s.astype(state_dtype) if output_final_state else None)


def gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                     use_qk_l2norm=False, cu_seqlens=None, impl="auto"):
    """Gated DeltaNet over a sequence (FLA layout). Returns (o [B, T, HV, V], final_state or None).

    q, k [B, T, HK, K]; v [B, T, HV, V]; g [B, T, HV] log-space decay (<= 0); beta [B, T, HV];
    scale defaults to K^-0.5; initial_state [N, HV, K, V] (N = B, or the number of packed
    sequences with cu_seqlens); the final state has initial_state's dtype (fp32 without one).
    cu_seqlens [N+1] int: B = 1 packed variable-length sequences, each starting from its own
    initial state. o has q's dtype; all state/gate math is fp32."""
    return _delta_rule("gdn", q, k, v, g, beta, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
                       cu_seqlens=cu_seqlens, impl=impl)


def kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
        use_qk_l2norm=False, cu_seqlens=None, impl="auto"):
    """Kimi Delta Attention: `gated_delta_rule` with a per-key-channel decay g [B, T, HV, K]."""
    return _delta_rule("kda", q, k, v, g, beta, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
                       cu_seqlens=cu_seqlens, impl=impl)
