"""Shared test setup: the `gpu` marker and the modes every kernel test runs in.

A kernel test body runs in each mode it is parametrized with:
  "reference"  the pure-JAX path (impl="reference")
  "interpret"  the Pallas kernels in interpret mode on the CPU
  "gpu"        the Pallas kernels compiled (marked `gpu`; skipped without a CUDA GPU)
"""

import importlib.metadata
import os


def _cuda_jax_installed() -> bool:
    return any("jax-cuda" in (d.metadata["Name"] or "").lower().replace("_", "-")
               for d in importlib.metadata.distributions())


# CPU-only runs: compile XLA's CPU programs without LLVM's optimisation passes. The suite is
# dominated by compiling interpret-mode kernels (large programs run once on small shapes), and
# the passes take ~30% of its time without changing any result (no fast-math: LLVM may not
# reorder float arithmetic at any level). Set before JAX starts its backends; a GPU install keeps
# its codegen untouched.
if not _cuda_jax_installed() and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

ON_GPU = any(d.platform == "gpu" for d in jax.devices())

# CPU-only runs: XLA's persistent compilation cache, shared by the test workers, so that a
# program several tests compile (the interpret-mode kernels at the same shapes) is compiled once
# per run, and a second run on the same machine compiles little. The cache key is the program
# itself; a cached program's Python callbacks (the Mosaic GPU interpreter's) are bound again, by
# position, from the program being compiled.
if not _cuda_jax_installed():
    import tempfile  # noqa: E402
    jax.config.update("jax_compilation_cache_dir", os.environ.get(
        "GDN_JAX_TEST_XLA_CACHE", os.path.join(tempfile.gettempdir(), "gdn_jax_test_xla_cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

KERNEL_MODES = [pytest.param("interpret", id="interpret"),
                pytest.param("gpu", id="gpu", marks=pytest.mark.gpu)]
MODES = [pytest.param("reference", id="reference"), *KERNEL_MODES]


def interpret_flag(mode) -> bool:
    """The kernels' `interpret` argument for a mode."""
    return mode == "interpret"


@pytest.fixture
def lower_for_h200(monkeypatch):
    """Lets a test lower Pallas kernels to Triton IR for an H200 (sm_90) without a GPU: the
    Pallas -> Triton lowering runs in Python and only asks the device for its compute
    capability; only the PTX compile would need the device. Skips on a jax without that
    lowering module."""
    try:
        from jax._src.pallas.triton import gpu_info, pallas_call_registration as reg
    except ImportError:
        pytest.skip("this jax has no Pallas Triton lowering module")
    monkeypatch.setattr(reg.gpu_info_lib, "get_gpu_info",
                        lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))


# The longest CPU tests (a child pytest process each, over a minute): run first, so that under
# `-n 2` the other worker balances the rest of the suite against them instead of one worker
# starting them when the rest is done.
LONGEST_FIRST = ("test_tensor_parallel.py::test_on_host_devices",)


# The CPU suite in two tiers. `make test` (CI) runs every kernel, code path and option value at
# least once and stays within its time budget on two cores; `make test-full` (`pytest --full`)
# adds the cases marked `full`: further combinations of values the default cases already cover
# one by one, the second notebook and the slowest tool runs. Run it before merging a change to
# the kernels or the tools.
FULL = pytest.mark.full


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="also run the tests marked `full` (the whole CPU matrix)")


def full_run(config) -> bool:
    return bool(config.getoption("--full"))


FULL_RUN = False  # set for the session by pytest_configure (test modules are imported after it)


def pytest_configure(config):
    global FULL_RUN
    FULL_RUN = full_run(config)


def pytest_collection_modifyitems(config, items):
    if ON_GPU:
        return
    items.sort(key=lambda item: not any(name in item.nodeid for name in LONGEST_FIRST))
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the GPU machine)")
    skip_full = pytest.mark.skip(reason="in the full CPU matrix only (make test-full)")
    full = full_run(config)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
        elif "full" in item.keywords and not full:
            item.add_marker(skip_full)
