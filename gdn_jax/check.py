"""`gdn-jax check`: every implementation of every operation against a float64 oracle.

For random inputs of the shapes and dtypes asked for (never zeros: random q, k, v, gates, beta
and initial states), each operation runs through each implementation it has

    reference   the pure-JAX references (token-serial scan, single step, verify steps)
    chunked     the pure-JAX WY/UT chunk form (sequence operations)
    pallas      the Pallas kernels: compiled on a GPU, in interpret mode on a CPU

and its outputs and states are compared with the recurrence evaluated in float64 NumPy (the
semantics of gdn_jax.reference, token by token) on the same (dtype-rounded) inputs. A row passes
when the relative L2 error is within the stated tolerance: 1e-5 for float32 inputs, 5e-3 for
bfloat16 / float16 inputs. An implementation that cannot take the call (no such kernel, a head
dim the kernel does not support) is listed as "n/a" with the reason, not as a failure.

With `--checkpoint DIR --layer N` the block of that layer (Qwen3-Next / Qwen3.5 Gated DeltaNet,
Kimi Linear / GLM-5.3-Flash KDA) is loaded and run with each `impl`, and as a prefill followed by
single-token steps, against the same block run with impl="reference" on the same input (the
composition of the references, which compute in float32; a bf16 input keeps its bf16
projections on both sides). The same tolerances apply.

Exit status: 0 when no row fails, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from typing import Any, Callable, Sequence

import numpy as np

TOLERANCE = {"float32": 1e-5, "bfloat16": 5e-3, "float16": 5e-3}
OPERATIONS = ("gdn", "kda", "prefill_pool", "decode", "decode_kda", "decode_pool", "verify",
              "carried_verify")


@dataclasses.dataclass
class Row:
    """One line of the table."""
    op: str
    impl: str
    dtype: str
    shape: str
    rel_err: float | None
    tol: float | None
    status: str           # "pass", "FAIL" or "n/a"
    note: str = ""
    seconds: float = 0.0


# --------------------------------------------------------------------------- float64 oracle

def _l2n(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def oracle_delta_rule(q, k, v, g, beta, state, *, scale=None, use_qk_l2norm=True,
                      keep_states=True):
    """The recurrence of gdn_jax.reference in float64 NumPy, token by token.

    q, k [B, T, HK, K]; v [B, T, HV, V]; g [B, T, HV] or [B, T, HV, K]; beta [B, T, HV];
    state [B, HV, K, V], or None for zeros. Returns (o [B, T, HV, V], states [B, T, HV, K, V])
    in float64, or with keep_states=False (o, the final state [B, HV, K, V]), which long
    sequences can afford."""
    f = lambda x: np.asarray(x, np.float64)
    q, k, v, g, beta = map(f, (q, k, v, g, beta))
    state_shape = (v.shape[0], v.shape[2], q.shape[-1], v.shape[-1])
    if state is None:
        S = np.zeros(state_shape)
    else:
        S = f(state)
        if S.shape != state_shape:
            raise ValueError(f"state: expected shape {state_shape} [B, HV, K, V], got {S.shape}")
    if use_qk_l2norm:
        q, k = _l2n(q), _l2n(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    rep = v.shape[2] // q.shape[2]
    q, k = np.repeat(q * scale, rep, axis=2), np.repeat(k, rep, axis=2)
    outs, states = [], []
    for t in range(q.shape[1]):
        decay = np.exp(g[:, t])
        S = S * (decay[..., :, None] if decay.ndim == 3 else decay[..., None, None])
        u = beta[:, t, :, None] * (v[:, t] - np.einsum("bhk,bhkv->bhv", k[:, t], S))
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        outs.append(np.einsum("bhk,bhkv->bhv", q[:, t], S))
        if keep_states:
            states.append(S)
    return np.stack(outs, 1), (np.stack(states, 1) if keep_states else S)


def rel_err(a, b) -> float:
    """Relative L2 error of `a` against `b`, in float64; inf when `a` holds a NaN or inf."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not np.all(np.isfinite(a)):
        return float("inf")
    den = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (den if den > 0 else 1.0))


# --------------------------------------------------------------------------- inputs

@dataclasses.dataclass(frozen=True)
class Shapes:
    batch: int = 2
    seq_len: int = 70
    num_k_heads: int = 2
    num_v_heads: int = 4
    head_k_dim: int = 32
    head_v_dim: int = 32
    draft_tokens: int = 3

    def __str__(self) -> str:
        return (f"B={self.batch} T={self.seq_len} HK={self.num_k_heads} HV={self.num_v_heads} "
                f"K={self.head_k_dim} V={self.head_v_dim}")


def _inputs(seed: int, s: Shapes, t: int, dtype, per_channel: bool):
    """Random q, k, v (in `dtype`), fp32 gates/beta, a random fp32 initial state."""
    import jax
    import jax.numpy as jnp
    import gdn_jax
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    b, hk, hv, kd, vd = s.batch, s.num_k_heads, s.num_v_heads, s.head_k_dim, s.head_v_dim
    q = jax.random.normal(ks[0], (b, t, hk, kd)).astype(dtype)
    k = jax.random.normal(ks[1], (b, t, hk, kd)).astype(dtype)
    v = jax.random.normal(ks[2], (b, t, hv, vd)).astype(dtype)
    if per_channel:
        g = gdn_jax.kda_gate(jax.random.normal(ks[3], (b, t, hv, kd)), jnp.zeros(hv),
                             jnp.zeros((hv, kd)), lower_bound=-5.0)
    else:
        g = gdn_jax.gdn_gate(jax.random.normal(ks[3], (b, t, hv)), jnp.zeros(hv), jnp.zeros(hv))
    beta = gdn_jax.gdn_beta(jax.random.normal(ks[4], (b, t, hv)))
    state = 0.1 * jax.random.normal(ks[5], (b, hv, kd, vd), jnp.float32)
    return q, k, v, g, beta, state


# --------------------------------------------------------------------------- running one row

def _interpret_context():
    """On a CPU the kernels run in Pallas interpret mode. Functions that take `interpret=` get it
    passed; sequence functions run under `gdn_jax.interpret()` where that switch exists."""
    import gdn_jax
    switch = getattr(gdn_jax, "interpret", None)
    return switch() if callable(switch) else contextlib.nullcontext()


def _unavailable(exc: Exception) -> str | None:
    """The reason a kernel declined the call (a ValueError from impl='pallas'), else None."""
    msg = str(exc)
    if isinstance(exc, ValueError) and "impl='pallas'" in msg:
        return msg.split("impl='pallas':", 1)[-1].strip()
    return None


def _row(op, impl, dtype, shape, fn: Callable[[], float], progress) -> Row:
    tol = TOLERANCE[dtype]
    t0 = time.perf_counter()
    try:
        err = fn()
    except Exception as exc:  # noqa: BLE001 - every failure becomes a row of the table
        reason = _unavailable(exc)
        if reason is not None:
            row = Row(op, impl, dtype, shape, None, tol, "n/a", reason)
        else:
            row = Row(op, impl, dtype, shape, None, tol, "FAIL", f"{type(exc).__name__}: {exc}"[:300])
    else:
        row = Row(op, impl, dtype, shape, err, tol, "pass" if err <= tol else "FAIL")
    row.seconds = time.perf_counter() - t0
    if progress:
        progress(f"[check] {op:<15} {impl:<16} {dtype:<9} {_fmt_err(row.rel_err):>9}  {row.status}"
                 f"{'  ' + row.note[:90] if row.note else ''}")
    return row


def _fmt_err(e) -> str:
    return "-" if e is None else f"{e:.2e}"


# --------------------------------------------------------------------------- the operations

def _sequence_rows(kind: str, s: Shapes, dtype: str, seed: int, on_gpu: bool, progress,
                   varlen: bool = True):
    import jax
    import gdn_jax
    fn = gdn_jax.gated_delta_rule if kind == "gdn" else gdn_jax.kda
    q, k, v, g, beta, h0 = _inputs(seed, s, s.seq_len, dtype, per_channel=kind == "kda")
    o_want, states = oracle_delta_rule(q, k, v, g, beta, h0)
    s_want = states[:, -1]
    rows = []
    for impl in ("reference", "chunked", "pallas"):
        def run(impl=impl):
            ctx = _interpret_context() if impl == "pallas" and not on_gpu else contextlib.nullcontext()
            with ctx:
                o, st = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                           use_qk_l2norm=True, impl=impl)
                jax.block_until_ready((o, st))
            return max(rel_err(o, o_want), rel_err(st, s_want))
        rows.append(_row(kind, impl, dtype, str(s), run, progress))
    # packed variable-length input: the batch's rows laid end to end with unequal lengths
    if varlen and s.seq_len >= 4:
        cut = [0] + sorted({max(1, s.seq_len // 3), s.seq_len})
        for impl in ("chunked", "pallas"):
            def run_varlen(impl=impl):
                import jax.numpy as jnp
                n = len(cut) - 1
                ctx = (_interpret_context() if impl == "pallas" and not on_gpu
                       else contextlib.nullcontext())
                with ctx:
                    o, st = fn(*(x[:1] for x in (q, k, v, g, beta)), initial_state=jnp.repeat(h0[:1], n, 0),
                               output_final_state=True, use_qk_l2norm=True, impl=impl,
                               cu_seqlens=np.asarray(cut, np.int32))
                errs = []
                for i, (a, b) in enumerate(zip(cut[:-1], cut[1:])):
                    ow, sw = oracle_delta_rule(*(x[:1, a:b] for x in (q, k, v, g, beta)), h0[:1])
                    errs += [rel_err(o[:, a:b], ow), rel_err(st[i:i + 1], sw[:, -1])]
                return max(errs)
            rows.append(_row(f"{kind} varlen", impl, dtype, f"N={len(cut) - 1} T={s.seq_len}",
                             run_varlen, progress))
    return rows


def _decode_rows(kind: str, s: Shapes, dtype: str, seed: int, on_gpu: bool, progress):
    import jax
    import jax.numpy as jnp
    from gdn_jax import decode as dec
    q, k, v, g, beta, h0 = _inputs(seed, s, 1, dtype, per_channel=kind == "decode_kda")
    o_want, states = oracle_delta_rule(q, k, v, g, beta, h0)
    rows = []
    for impl in ("reference", "pallas"):
        def run(impl=impl):
            o, st = dec.gdn_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], jnp.copy(h0),
                                   use_qk_l2norm=True, impl=impl, interpret=not on_gpu)
            jax.block_until_ready((o, st))
            return max(rel_err(o, o_want[:, 0]), rel_err(st, states[:, 0]))
        rows.append(_row(kind, impl, dtype, f"B={s.batch} HK={s.num_k_heads} HV={s.num_v_heads} "
                         f"K={s.head_k_dim} V={s.head_v_dim}", run, progress))
    return rows


def _pool_rows(s: Shapes, dtype: str, seed: int, on_gpu: bool, progress):
    """Packed q | k | v rows, a pool of B + 2 slots, the batch's last row padding (slot -1)."""
    import jax
    import jax.numpy as jnp
    from gdn_jax import decode as dec
    q, k, v, g, beta, h0 = _inputs(seed, s, 1, dtype, per_channel=False)
    b = s.batch
    pool, slots, live, o_want, pool_want = _pool_case(s, seed + 7, q, k, v, g, beta)
    qkv = jnp.concatenate([q[:, 0].reshape(b, -1), k[:, 0].reshape(b, -1), v[:, 0].reshape(b, -1)], 1)
    rows = []
    for impl in ("reference", "pallas"):
        def run(impl=impl):
            o, p = dec.gdn_decode_pool(qkv, g[:, 0], beta[:, 0], jnp.copy(pool), jnp.asarray(slots),
                                       num_k_heads=s.num_k_heads, num_v_heads=s.num_v_heads,
                                       head_k_dim=s.head_k_dim, head_v_dim=s.head_v_dim,
                                       use_qk_l2norm=True, impl=impl, interpret=not on_gpu)
            jax.block_until_ready((o, p))
            o = np.asarray(o, np.float64)
            if np.any(o[~live] != 0):
                raise AssertionError("padding row (slot -1) has a non-zero output")
            return max(rel_err(o[live], o_want[live, 0]), rel_err(p, pool_want))
        rows.append(_row("decode_pool", impl, dtype, f"B={b} slots={b + 2} (1 padding row)", run,
                         progress))
    return rows


def _pool_case(s: Shapes, seed: int, q, k, v, g, beta):
    """A random state pool of B + 2 slots, the batch's slot table (reversed slots, the last row
    padding, slot -1) and the float64 oracle's outputs and updated pool for it: (pool, slots,
    live rows, outputs [B, T, HV, V], pool after)."""
    import jax
    b = s.batch
    pool = 0.1 * jax.random.normal(jax.random.PRNGKey(seed),
                                   (b + 2, s.num_v_heads, s.head_k_dim, s.head_v_dim))
    slots = np.arange(b, dtype=np.int32)[::-1] + 2
    slots[-1] = -1
    live = slots >= 0
    o_want, states = oracle_delta_rule(q, k, v, g, beta, np.asarray(pool)[np.maximum(slots, 0)])
    pool_want = np.asarray(pool, np.float64).copy()
    pool_want[slots[live]] = states[live, -1]
    return pool, slots, live, o_want, pool_want


def _prefill_pool_rows(s: Shapes, dtype: str, seed: int, on_gpu: bool, progress):
    """The prefill kernel landing in a state pool (B + 2 slots, the last row padding, slot -1)
    against `reference_prefill_pool` and the float64 oracle."""
    import jax
    import jax.numpy as jnp
    from gdn_jax import prefill as pf
    q, k, v, g, beta, _ = _inputs(seed, s, s.seq_len, dtype, per_channel=False)
    b = s.batch
    pool, slots, live, o_want, pool_want = _pool_case(s, seed + 9, q, k, v, g, beta)
    rows = []
    for impl in ("reference", "pallas"):
        def run(impl=impl):
            if impl == "reference":
                o, p = pf.reference_prefill_pool(q, k, v, g, beta, jnp.copy(pool), jnp.asarray(slots),
                                                 use_qk_l2norm=True)
            else:
                o, p = pf.gdn_prefill_pool(q, k, v, g, beta, jnp.copy(pool), jnp.asarray(slots),
                                           use_qk_l2norm=True, interpret=not on_gpu)
            jax.block_until_ready((o, p))
            o = np.asarray(o, np.float64)
            if np.any(o[~live] != 0):
                raise AssertionError("padding row (slot -1) has a non-zero output")
            return max(rel_err(o[live], o_want[live]), rel_err(p, pool_want))
        rows.append(_row("prefill_pool", impl, dtype, f"B={b} T={s.seq_len} slots={b + 2} "
                         "(1 padding row)", run, progress))
    return rows


def _verify_rows(op: str, s: Shapes, dtype: str, seed: int, on_gpu: bool, progress):
    """verify_states (T outputs + T states) or carried_verify + accept(all T) + flush, with the
    carried state in a `DeltaPool`."""
    import jax
    import jax.numpy as jnp
    from gdn_jax import carry
    from gdn_jax import verify as vf
    t = s.draft_tokens
    q, k, v, g, beta, h0 = _inputs(seed, s, t, dtype, per_channel=False)
    b = s.batch
    slots = jnp.arange(b, dtype=jnp.int32)[::-1]
    o_want, states = oracle_delta_rule(q, k, v, g, beta, h0)  # row i reads pool[slots[i]] = h0[i]
    flavours = [("exact", True), ("fast", False)] if op == "carried_verify" else [("", None)]
    rows = []
    for impl in ("reference", "pallas"):
        for name, exact in flavours:
            def run(impl=impl, exact=exact):
                pool = jnp.asarray(np.asarray(h0)[::-1].copy())
                if op == "verify":
                    o, st = vf.verify_states(q, k, v, g, beta, pool, slots, use_qk_l2norm=True,
                                             impl=impl, interpret=not on_gpu)
                    jax.block_until_ready((o, st))
                    return max(rel_err(o, o_want), rel_err(st, states))
                dpool = carry.DeltaPool(states=pool, stash=carry.DeltaStash.init(
                    b, num_v_heads=s.num_v_heads, num_k_heads=s.num_k_heads,
                    head_k_dim=s.head_k_dim, head_v_dim=s.head_v_dim))
                o, dpool, refused = carry.carried_verify(q, k, v, g, beta, dpool, slots, exact=exact,
                                                         use_qk_l2norm=True, impl=impl,
                                                         interpret=not on_gpu)
                dpool, invalid = carry.accept(dpool, slots, jnp.full((b,), t, jnp.int32))
                dpool = carry.flush(dpool, slots, impl=impl, interpret=not on_gpu)
                jax.block_until_ready((o, dpool))
                if np.any(np.asarray(refused)) or np.any(np.asarray(invalid)):
                    raise AssertionError("a live row was refused by verify or flagged by accept")
                pool = dpool.states
                return max(rel_err(o, o_want), rel_err(np.asarray(pool)[::-1], states[:, -1]))
            label = impl + (f" ({name})" if name else "")
            rows.append(_row(op, label, dtype, f"B={b} T={t} HV={s.num_v_heads} K={s.head_k_dim} "
                             f"V={s.head_v_dim}", run, progress))
    return rows


# --------------------------------------------------------------------------- a block

def load_block(path: str, layer: int):
    """The Flax block of `layer` in the checkpoint folder `path`, by the config's model type."""
    from gdn_jax.loading import read_config
    from gdn_jax.layers import KimiDeltaAttention, Qwen3NextGatedDeltaNet
    cfg = read_config(path)
    types = {cfg.get("model_type", ""), (cfg.get("text_config") or {}).get("model_type", "")}
    is_kda = any(t.startswith(("kimi", "glm")) for t in types if t)
    cls = KimiDeltaAttention if is_kda else Qwen3NextGatedDeltaNet
    return cls.from_pretrained(path, layer_idx=layer)


def _block_rows(path: str, layer: int, s: Shapes, dtypes: Sequence[str], seed: int, on_gpu: bool,
                progress):
    import jax
    import jax.numpy as jnp
    block = load_block(path, layer)
    name = f"block {type(block).__name__}[{layer}]"
    hidden = block.config.hidden_size
    t = max(s.seq_len, 3)
    x = jax.random.normal(jax.random.PRNGKey(seed), (s.batch, t, hidden), jnp.float32)
    state0 = block.init_state(s.batch)
    state0 = dataclasses.replace(state0, recurrent=0.1 * jax.random.normal(
        jax.random.PRNGKey(seed + 1), state0.recurrent.shape))
    rows = []
    for dtype in dtypes:
        xd = x.astype(dtype)
        # The reference composition at the same input dtype: projections in `dtype`, conv,
        # gates, recurrence and norm in fp32 (the references' math).
        y_want, st_want = block(xd, state0, impl="reference")
        for impl in ("chunked", "pallas", "auto", "prefill+decode"):
            def run(impl=impl):
                ctx = _interpret_context() if not on_gpu else contextlib.nullcontext()
                with ctx:
                    if impl == "prefill+decode":  # T-2 tokens, then two single-token calls
                        y0, st = block(xd[:, :-2], state0, impl="auto")
                        y1, st = block(xd[:, -2:-1], st, impl="auto")
                        y2, st = block(xd[:, -1:], st, impl="auto")
                        y = jnp.concatenate([y0, y1, y2], axis=1)
                    else:
                        y, st = block(xd, state0, impl=impl)
                    jax.block_until_ready((y, st))
                return max(rel_err(y, y_want), rel_err(st.recurrent, st_want.recurrent))
            rows.append(_row(name, impl, dtype, f"B={s.batch} T={t} hidden={hidden}", run, progress))
    return rows


# --------------------------------------------------------------------------- driver

def run_check(shapes: Shapes = Shapes(), *, dtypes: Sequence[str] = ("float32", "bfloat16"),
              ops: Sequence[str] = OPERATIONS, checkpoint: str | None = None,
              layer: int | None = None, seed: int = 0,
              progress: Callable[[str], Any] | None = print) -> list[Row]:
    """Run the harness; returns the table's rows (see the module docstring). Raises ValueError
    for an unknown operation or dtype, or a checkpoint given without a layer."""
    import jax
    for d in dtypes:
        if d not in TOLERANCE:
            raise ValueError(f"dtypes: {d!r} is not one of {sorted(TOLERANCE)}")
    for op in ops:
        if op not in OPERATIONS:
            raise ValueError(f"ops: {op!r} is not one of {OPERATIONS}")
    if (checkpoint is None) != (layer is None):
        raise ValueError("checkpoint and layer go together (a folder and a layer index)")
    for name in ("batch", "seq_len", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim",
                 "draft_tokens"):
        if int(getattr(shapes, name)) <= 0:
            raise ValueError(f"{name} must be positive, got {getattr(shapes, name)}")
    if shapes.num_v_heads % shapes.num_k_heads:
        raise ValueError(f"num_v_heads={shapes.num_v_heads} must be a multiple of "
                         f"num_k_heads={shapes.num_k_heads}")
    on_gpu = jax.default_backend() == "gpu"
    rows: list[Row] = []
    for dtype in dtypes:
        for op in ops:
            if op in ("gdn", "kda"):
                # packed input is a matter of indexing, not of dtype: checked with the first dtype
                rows += _sequence_rows(op, shapes, dtype, seed, on_gpu, progress,
                                       varlen=dtype == dtypes[0])
            elif op in ("decode", "decode_kda"):
                rows += _decode_rows(op, shapes, dtype, seed, on_gpu, progress)
            elif op == "prefill_pool":
                rows += _prefill_pool_rows(shapes, dtype, seed, on_gpu, progress)
            elif op == "decode_pool":
                rows += _pool_rows(shapes, dtype, seed, on_gpu, progress)
            else:
                rows += _verify_rows(op, shapes, dtype, seed, on_gpu, progress)
    if checkpoint is not None:
        rows += _block_rows(checkpoint, int(layer), shapes, dtypes, seed, on_gpu, progress)
    return rows


def format_table(rows: Sequence[Row]) -> str:
    head = f"{'operation':<34}{'impl':<18}{'dtype':<10}{'rel err':>10}{'tol':>9}  {'result':<6} note"
    lines = [head, "-" * len(head)]
    for r in rows:
        tol = "-" if r.tol is None else f"{r.tol:.0e}"
        lines.append(f"{r.op:<34}{r.impl:<18}{r.dtype:<10}{_fmt_err(r.rel_err):>10}{tol:>9}  "
                     f"{r.status:<6} {r.note[:100]}")
    return "\n".join(lines)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="gdn-jax check")
    p.description = ("Every implementation of every operation (references, chunk form, Pallas "
                     "kernels: compiled on a GPU, interpret mode on a CPU) against a float64 "
                     "oracle on random inputs; a pass/fail table (tolerance: fp32 1e-5, "
                     "bf16/fp16 5e-3 relative L2). Exit status 1 when a row fails.")
    d = Shapes()
    p.add_argument("--batch", type=int, default=d.batch, help="B (default %(default)s)")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="T of the sequence operations")
    p.add_argument("--num-k-heads", type=int, default=d.num_k_heads, help="HK")
    p.add_argument("--num-v-heads", type=int, default=d.num_v_heads, help="HV (a multiple of HK)")
    p.add_argument("--head-k-dim", type=int, default=d.head_k_dim, help="K")
    p.add_argument("--head-v-dim", type=int, default=d.head_v_dim, help="V")
    p.add_argument("--draft-tokens", type=int, default=d.draft_tokens, help="T of the verify operations")
    p.add_argument("--dtypes", default="float32,bfloat16",
                   help="input dtypes, comma-separated: float32, bfloat16, float16")
    p.add_argument("--ops", default=",".join(OPERATIONS),
                   help="operations, comma-separated (default: all of %(default)s)")
    p.add_argument("--checkpoint", default=None, help="HF checkpoint folder of a block to check")
    p.add_argument("--layer", type=int, default=None, help="its layer index (with --checkpoint)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON ('-': stdout)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run(args)


def run(args: argparse.Namespace) -> int:
    import jax
    shapes = Shapes(args.batch, args.seq_len, args.num_k_heads, args.num_v_heads, args.head_k_dim,
                    args.head_v_dim, args.draft_tokens)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    to_stdout = args.json == "-"
    say = None if args.quiet else (lambda m: print(m, file=sys.stderr if to_stdout else sys.stdout,
                                                   flush=True))
    if say:
        mode = "compiled" if jax.default_backend() == "gpu" else "interpret mode"
        say(f"[check] {jax.devices()[0].device_kind} ({jax.default_backend()}); kernels in {mode}; "
            f"{shapes}; dtypes {', '.join(dtypes)}")
    try:
        rows = run_check(shapes, dtypes=dtypes, ops=ops, checkpoint=args.checkpoint,
                         layer=args.layer, seed=args.seed, progress=say)
    except ValueError as e:
        print(f"gdn-jax check: {e}", file=sys.stderr)
        return 2
    failed = [r for r in rows if r.status == "FAIL"]
    if args.json:
        payload = {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
                   "shapes": dataclasses.asdict(shapes), "rows": [dataclasses.asdict(r) for r in rows],
                   "failed": len(failed)}
        text = json.dumps(payload, indent=1, default=str)
        if to_stdout:
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    if not to_stdout:
        print("\n" + format_table(rows))
        n_na = sum(r.status == "n/a" for r in rows)
        print(f"\n{len(rows) - len(failed) - n_na} passed, {len(failed)} failed, {n_na} not available")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
