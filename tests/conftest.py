"""Shared test setup: the `gpu` marker, the interpret flag for Pallas kernels, numeric helpers."""

import jax
import pytest

ON_GPU = any(d.platform == "gpu" for d in jax.devices())


def pytest_collection_modifyitems(config, items):
    if ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def interpret() -> bool:
    """Pallas kernels run compiled on a GPU and in interpret mode on the CPU."""
    return not ON_GPU
