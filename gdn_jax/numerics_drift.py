"""16-bit recurrent state drift, measured with the reference decode step.

    python -m gdn_jax.numerics_drift --out docs/            # 32768 tokens, all 16 curves (CPU)

A sequence of decode steps runs three copies of the same GDN state side by side: fp32 (the
yardstick), 16-bit with round-to-nearest-even stores, and 16-bit with stochastic-rounding stores
(`reference.stochastic_round`, one PRNG key per step). The curve is the state's relative error
||S_16 - S_32||_F / ||S_32||_F against the token count, for

    dtype   bf16, fp16
    keys    full rank (unit random keys in R^K); low rank: unit keys on 8 of the K key
            channels ("low", the other rows of S are never rewritten) or in a random 8-dim
            subspace ("rotated", every entry of S is rewritten, the complement only in sum)
    decay   slow (g = -1e-4 every token), fast (g = -1e-3)

with K = V = 32, beta ~ sigmoid(N(0, 1)), v ~ N(0, 1) and an initial state ~ N(0, 1). The
directions a low-rank key stream never rewrites only decay, and round to nearest even stalls the
decay of a 16-bit value once |g| is below half an ulp; see docs/numerics.md for the results.

Writes `numerics_drift.csv` (one row per recorded token count) and, when matplotlib is
installed, `numerics_drift.png`, and prints a markdown table.
"""

from __future__ import annotations

import argparse
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax import reference as ref

__all__ = ["DriftCase", "drift_cases", "drift_curves", "main"]

F32 = jnp.float32
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}
DECAYS = {"slow": -1e-4, "fast": -1e-3}
LOW_RANK = 8


KEYS = ("full", "low", "rotated")


class DriftCase(tuple):
    """(dtype name, keys (one of KEYS), decay name), e.g. ("bf16", "low", "fast")."""

    @property
    def label(self) -> str:
        return "{} {} g={:g}".format(self[0], {"full": "full-rank", "low": "8-channel",
                                                 "rotated": "8-dim-rotated"}[self[1]], DECAYS[self[2]])


def drift_cases() -> list[DriftCase]:
    return [DriftCase((d, r, g)) for d in DTYPES for r in KEYS for g in DECAYS]


@functools.partial(jax.jit, static_argnames=("tokens", "dtype", "keys", "heads", "dim"))
def _run(key, g, *, tokens, dtype, keys, heads, dim):
    """Relative state error per token, [tokens, 2] (round to nearest even, stochastic)."""
    k_basis, k_state, k_steps = jax.random.split(key, 3)
    basis = (jnp.eye(dim) if keys == "full" else jnp.eye(dim)[:, :LOW_RANK] if keys == "low"
             else jnp.linalg.qr(jax.random.normal(k_basis, (dim, dim)))[0][:, :LOW_RANK])
    S0 = jax.random.normal(k_state, (heads, 1, dim, dim), F32)
    g_tok = jnp.full((heads, 1), g, F32)

    def step(carry, i):
        S32, S_rne, S_sr = carry
        kk, kv, kb, kr = jax.random.split(jax.random.fold_in(k_steps, i), 4)
        k = ref.l2norm(jax.random.normal(kk, (heads, 1, basis.shape[1])) @ basis.T)
        v = jax.random.normal(kv, (heads, 1, dim))
        beta = jax.nn.sigmoid(jax.random.normal(kb, (heads, 1)))
        args = (k, k, v, g_tok, beta)
        _, S32 = ref.decode_step(*args, S32)
        _, S_rne = ref.decode_step(*args, S_rne)
        _, S_sr = ref.decode_step(*args, S_sr, rounding_key=kr)
        norm = jnp.linalg.norm(S32)
        err = jnp.stack([jnp.linalg.norm(S_rne.astype(F32) - S32),
                         jnp.linalg.norm(S_sr.astype(F32) - S32)]) / norm
        return (S32, S_rne, S_sr), err

    S16 = S0.astype(dtype)
    _, errs = jax.lax.scan(step, (S0, S16, S16), jnp.arange(tokens))
    return errs


def record_points(tokens: int) -> np.ndarray:
    """Token counts at which the curves are kept: about 8 per octave, plus 1000 and the end."""
    pts = np.unique(np.round(np.geomspace(1, tokens, 8 * int(np.log2(max(tokens, 2))) + 1)))
    return np.unique(np.concatenate([pts, [t for t in (1000, tokens) if t <= tokens]])).astype(int)


def drift_curves(tokens: int = 32768, *, heads: int = 16, dim: int = 32, seed: int = 0,
                 cases: list[DriftCase] | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(token counts, {curve label: relative state error at those counts}); each case gives two
    curves, "<case> RNE" and "<case> SR" (stochastic rounding)."""
    points = record_points(tokens)
    curves = {}
    for case in cases or drift_cases():
        dname, rank, decay = case
        errs = np.asarray(_run(jax.random.PRNGKey(seed), DECAYS[decay], tokens=tokens,
                               dtype=DTYPES[dname], keys=rank,
                               heads=heads, dim=dim))
        curves[case.label + " RNE"] = errs[points - 1, 0]
        curves[case.label + " SR"] = errs[points - 1, 1]
    return points, curves


def markdown_table(points, curves, at=(1000, 8192, 32768)) -> str:
    at = [t for t in at if t in set(points.tolist())]
    rows = ["| state, keys, decay | rounding | " + " | ".join(f"{t} tok" for t in at) + " |",
            "|---|---|" + "---|" * len(at)]
    idx = [int(np.searchsorted(points, t)) for t in at]
    for label, errs in curves.items():
        case, rounding = label.rsplit(" ", 1)
        rows.append(f"| {case} | {rounding} | " + " | ".join(f"{errs[i]:.3g}" for i in idx) + " |")
    return "\n".join(rows)


def _plot(points, curves, file):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4), sharey=True)
    cases = sorted({label.split(" ", 1)[1].rsplit(" ", 1)[0] for label in curves},
                   key=lambda c: list(curves).index(next(l for l in curves if c in l)))
    colors = dict(zip(cases, plt.get_cmap("tab10").colors))
    for ax, dname in zip(axes, DTYPES):
        for label, errs in curves.items():
            if label.startswith(dname):
                case, rounding = label[len(dname) + 1:].rsplit(" ", 1)
                ax.loglog(points, np.maximum(errs, 1e-6), "-" if rounding == "RNE" else "--",
                          color=colors[case], lw=1.3, label=f"{case} {rounding}")
        ax.set_title(f"{dname} state vs fp32 state")
        ax.set_xlabel("tokens")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("||S16 - S32|| / ||S32||")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8)
    fig.suptitle("relative state error; solid: round to nearest even, dashed: stochastic rounding",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.8, 1))
    fig.savefig(file, dpi=72)
    plt.close(fig)


def _read_csv(file):
    with open(file) as f:
        labels = f.readline().strip().split(",")[1:]
    data = np.loadtxt(file, delimiter=",", skiprows=1, ndmin=2)
    return data[:, 0].astype(int), {k: data[:, i + 1] for i, k in enumerate(labels)}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m gdn_jax.numerics_drift", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="docs", help="folder for numerics_drift.csv / .png")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--heads", type=int, default=16, help="independent states per case")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replot", action="store_true",
                   help="redraw the plot and table from an existing numerics_drift.csv in --out")
    args = p.parse_args(argv)
    if args.tokens < 1 or args.heads < 1:
        raise SystemExit("--tokens and --heads must be positive")
    os.makedirs(args.out, exist_ok=True)
    csv = os.path.join(args.out, "numerics_drift.csv")
    if args.replot:
        points, curves = _read_csv(csv)
    else:
        points, curves = drift_curves(args.tokens, heads=args.heads, seed=args.seed)
        labels = list(curves)
        table = np.column_stack([points] + [curves[k] for k in labels])
        np.savetxt(csv, table, delimiter=",", header="tokens," + ",".join(labels), comments="",
                   fmt=["%d"] + ["%.4g"] * len(labels))
    try:
        _plot(points, curves, os.path.join(args.out, "numerics_drift.png"))
    except ImportError:
        print("matplotlib not installed: no plot written")
    print(markdown_table(points, curves))


if __name__ == "__main__":
    main()
