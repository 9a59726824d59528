"""Shared test setup: the `gpu` marker and the modes every kernel test runs in.

A kernel test body runs in each mode it is parametrized with:
  "reference"  the pure-JAX path (impl="reference")
  "interpret"  the Pallas kernels in interpret mode on the CPU
  "gpu"        the Pallas kernels compiled (marked `gpu`; skipped without a CUDA GPU)
"""

import jax
import pytest

ON_GPU = any(d.platform == "gpu" for d in jax.devices())

KERNEL_MODES = [pytest.param("interpret", id="interpret"),
                pytest.param("gpu", id="gpu", marks=pytest.mark.gpu)]
MODES = [pytest.param("reference", id="reference"), *KERNEL_MODES]


def interpret_flag(mode) -> bool:
    """The kernels' `interpret` argument for a mode."""
    return mode == "interpret"


def pytest_collection_modifyitems(config, items):
    if ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
