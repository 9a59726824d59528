"""One dispatch for every operation: which implementation runs a call, and why.

Every public function takes `impl`, one vocabulary for all of them:

    "auto"       a Pallas kernel when one can take the call, else the pure-JAX path
    "reference"  the pure-JAX reference path (gdn_jax.reference)
    "chunked"    the pure-JAX chunk (WY/UT) form; sequence operations only
    "pallas"     a Pallas kernel; raises ValueError with the reason when none can take the call

Each operation has a small registry of kernel families. A family answers `supports(spec)` with
None (it can take the call) or the reason it cannot; the public function validates its
arguments once into a frozen spec and asks `select(op, spec, impl)`. The rule is the same for
every operation:

  * "reference" / "chunked" run that path;
  * a kernel runs only on a GPU, or anywhere in Pallas interpret mode (`interpret()` below);
  * with `jax_enable_x64` on, a kernel takes no call with a 64-bit float array (the spec's
    `float64_arrays`), and interpret mode runs none (see "64-bit mode" below);
  * no kernel takes an empty batch (a spec whose `batch` is 0): "auto" returns the empty
    results from the pure-JAX path, which computes nothing;
  * the first registered family whose `supports(spec)` is None takes the call;
  * otherwise "pallas" raises ValueError naming the reason, and "auto" falls back to the
    operation's pure-JAX path, logging the reason once (logger "gdn_jax").

`explain(op, ...)` answers the same question for given arguments without running anything (it
accepts arrays or `jax.ShapeDtypeStruct`s). Kernel modules plug in with `register(op, family)`:
the sequence operations ("gated_delta_rule", "kda") carry the single-token decode family, and a
sequence (prefill) kernel registers itself there beside it.

Interpret mode: `with gdn_jax.interpret():` or the environment variable `GDN_JAX_INTERPRET=1`
makes every kernel path run in Pallas interpret mode (on the CPU), and "auto" then picks the
kernels wherever they apply. A function's explicit `interpret=True/False` argument wins.

64-bit mode (`jax_enable_x64` on): the kernels run as with it off on a GPU (their launchers are
traced with it off: `pallas_kernels.tracing`), for the 16- and 32-bit float arrays and the int32
or int64 index arrays they take. A float64 array (only x64 keeps one; without it JAX narrows a
float64 NumPy array to float32 on the way in) goes to the pure-JAX path, which computes in
float32 as the kernels do. JAX's Pallas interpreter mixes int64 and int32 indices in 64-bit mode,
so interpret mode does not run the kernels then: `with jax.enable_x64(False):` around the call
does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import jax

IMPLS = ("auto", "reference", "chunked", "pallas")
INTERPRET_ENV = "GDN_JAX_INTERPRET"

logger = logging.getLogger("gdn_jax")

__all__ = ["IMPLS", "Choice", "KernelFamily", "Operation", "register", "select", "explain",
           "interpret", "interpret_enabled", "operations"]


# --------------------------------------------------------------------------- interpret switch

_local = threading.local()


@contextlib.contextmanager
def interpret(enabled: bool = True):
    """Run every Pallas kernel path in interpret mode inside this block (and let "auto" choose
    the kernels off a GPU). Nests; `interpret(False)` switches it off inside."""
    prev = getattr(_local, "interpret", None)
    _local.interpret = bool(enabled)
    try:
        yield
    finally:
        _local.interpret = prev


def interpret_enabled(explicit: bool | None = None) -> bool:
    """The interpret flag a call runs with: an explicit argument, else the innermost
    `interpret()` block, else GDN_JAX_INTERPRET (1/true/yes)."""
    if explicit is not None:
        return bool(explicit)
    ctx = getattr(_local, "interpret", None)
    if ctx is not None:
        return ctx
    return os.environ.get(INTERPRET_ENV, "").strip().lower() in ("1", "true", "yes", "on")


# --------------------------------------------------------------------------- registry

@dataclasses.dataclass(frozen=True)
class KernelFamily:
    """A Pallas kernel family that can serve an operation.

    supports(spec) -> None | str   None when the family can take the call, else why not
    run                            how the operation calls it (the signature is the operation's;
                                   see its module); None when the operation calls the kernel
                                   itself
    rule(spec) -> str              optional: why it takes a call it supports (for `explain`,
                                   e.g. the tuning-table row that picked it)
    """
    name: str
    supports: Callable[[Any], str | None]
    run: Callable | None = None
    rule: Callable[[Any], str] | None = None


@dataclasses.dataclass
class Operation:
    """One public operation: its pure-JAX paths and its kernel families (first match wins).

    fallback(spec) -> "reference" | "chunked"   what "auto" runs when no kernel takes the call
    spec_of(**arguments) -> spec                 the operation's validation (for `explain`)
    """
    name: str
    fallback: Callable[[Any], str]
    pure_impls: tuple[str, ...] = ("reference",)
    families: list[KernelFamily] = dataclasses.field(default_factory=list)
    spec_of: Callable[..., Any] | None = None

    @property
    def impls(self) -> tuple[str, ...]:
        return tuple(i for i in IMPLS if i in ("auto", "pallas") or i in self.pure_impls)


_OPERATIONS: dict[str, Operation] = {}


def define(name: str, *, fallback=lambda spec: "reference", pure_impls=("reference",),
           spec_of=None) -> Operation:
    """Declare an operation (done once by the module that owns its public function)."""
    if name not in _OPERATIONS:
        _OPERATIONS[name] = Operation(name, fallback, tuple(pure_impls), spec_of=spec_of)
    else:
        op = _OPERATIONS[name]
        op.fallback, op.pure_impls, op.spec_of = fallback, tuple(pure_impls), spec_of or op.spec_of
    return _OPERATIONS[name]


def register(op: str, family: KernelFamily, *, first: bool = False) -> None:
    """Add a kernel family to an operation (replacing one of the same name). `first=True`
    puts it ahead of the families already there."""
    fams = _operation(op).families
    fams[:] = [f for f in fams if f.name != family.name]
    if first:
        fams.insert(0, family)
    else:
        fams.append(family)


def operations() -> dict[str, tuple[str, ...]]:
    """Every operation and the names of its kernel families, in the order they are asked."""
    _load_all()
    return {name: tuple(f.name for f in op.families) for name, op in sorted(_OPERATIONS.items())}


def _operation(name: str) -> Operation:
    if name not in _OPERATIONS:
        _load_all()
    if name not in _OPERATIONS:
        raise ValueError(f"op must be one of {sorted(_OPERATIONS)}, got {name!r}")
    return _OPERATIONS[name]


def _load_all():
    # The modules that define operations register on import.
    import gdn_jax.ops  # noqa: F401
    import gdn_jax.decode  # noqa: F401
    import gdn_jax.conv_decode  # noqa: F401
    import gdn_jax.verify  # noqa: F401
    import gdn_jax.carry  # noqa: F401
    import gdn_jax.prefill  # noqa: F401


# --------------------------------------------------------------------------- the choice

@dataclasses.dataclass(frozen=True)
class Choice:
    """What runs a call: impl "pallas" (with the family's name), "reference" or "chunked";
    `reason` says why no kernel runs (None when one does). `detail` says, for a kernel, why this
    family: its rule and why the families asked before it declined (not part of equality)."""
    op: str
    impl: str
    family: str | None = None
    reason: str | None = None
    detail: str | None = dataclasses.field(default=None, compare=False)


_logged: set[tuple[str, str]] = set()


def check_impl(op: str, impl) -> None:
    """ValueError unless `impl` is in the operation's vocabulary."""
    allowed = _operation(op).impls
    if not isinstance(impl, str) or impl not in allowed:
        extra = ("" if impl not in IMPLS else
                 f" ({impl!r} has no meaning for {op}: it has no chunk form)")
        raise ValueError(f"impl must be one of {allowed}, got {impl!r}{extra}")


def select(op: str, spec, impl: str, *, interpret: bool | None = None, backend: str | None = None,
           log: bool = True) -> Choice:
    """Which implementation runs `op` for a validated spec. Pure: no device work.

    Raises ValueError for impl="pallas" when no kernel can take the call (naming why)."""
    operation = _operation(op)
    check_impl(op, impl)
    if impl in operation.pure_impls:
        return Choice(op, impl, reason=f"impl={impl!r} was asked for")
    backend = jax.default_backend() if backend is None else backend
    wide = getattr(spec, "float64_arrays", ())
    empty = getattr(spec, "batch", None) == 0
    if backend != "gpu" and not interpret_enabled(interpret):
        reason = (f"the Pallas kernels need a GPU (backend is {backend!r}; "
                  f"`with gdn_jax.interpret():` or {INTERPRET_ENV}=1 runs them on the CPU)")
    elif backend != "gpu" and jax.config.jax_enable_x64:
        reason = ("interpret mode does not run the Pallas kernels with jax_enable_x64 on (JAX's "
                  "Pallas interpreter then mixes int64 and int32 indices); `with "
                  "jax.enable_x64(False):` around the call runs them")
    elif wide:
        reason = (f"{', '.join(wide)} float64: the Pallas kernels take 16- and 32-bit floats "
                  f"(the pure-JAX path computes in float32, as they do)")
    elif empty:
        reason = ("the batch is empty (B = 0): no kernel runs for it (impl='auto' returns the "
                  "empty results)")
    else:
        reasons = []
        for fam in operation.families:
            why = fam.supports(spec)
            if why is None:
                notes = ([fam.rule(spec)] if fam.rule is not None else []) + reasons
                return Choice(op, "pallas", family=fam.name, detail="; ".join(notes) or None)
            reasons.append(f"{fam.name}: {why}")
        reason = "; ".join(reasons) if reasons else f"no Pallas kernel is registered for {op}"
    if impl == "pallas":
        raise ValueError(f"{op}(impl='pallas'): {reason}")
    fallback = operation.fallback(spec)
    if log and (op, reason) not in _logged:
        _logged.add((op, reason))
        # Off a GPU, or for an empty batch, the pure-JAX path is what a user expects: no warning.
        level = logging.INFO if backend != "gpu" or empty else logging.WARNING
        logger.log(level, "%s(impl='auto') runs the %s path: %s", op, fallback, reason)
    return Choice(op, fallback, reason=reason)


def explain(op: str, /, *args, impl: str = "auto", interpret: bool | None = None, **kwargs) -> Choice:
    """The choice `op` would make for these arguments, with its reason, without running
    anything. Arguments are the public function's (arrays or jax.ShapeDtypeStruct); bad ones
    raise the same ValueError the function would.

        >>> gdn_jax.explain("gated_delta_rule", q, k, v, g, beta)
        Choice(op='gated_delta_rule', impl='chunked', family=None, reason='...')
    """
    operation = _operation(op)
    if operation.spec_of is None:
        raise ValueError(f"explain does not know how to read {op}'s arguments")
    spec = operation.spec_of(*args, **kwargs)
    return select(op, spec, impl, interpret=interpret, log=False)


def family(op: str, name: str) -> KernelFamily:
    for f in _operation(op).families:
        if f.name == name:
            return f
    raise ValueError(f"{op} has no kernel family {name!r}")
