"""The notebooks are real notebooks (nbformat 4.5, cell ids), linked from the README, built from
notebooks/build_notebooks.py, and their code cells run top to bottom on a CPU."""

from __future__ import annotations

import importlib.util
import os
import pathlib

import pytest

from conftest import FULL

nbformat = pytest.importorskip("nbformat")

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _builder():
    spec = importlib.util.spec_from_file_location("build_notebooks", ROOT / "notebooks" / "build_notebooks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_notebooks_exist_and_are_linked():
    names = [p.name for p in NOTEBOOKS]
    assert "01_references.ipynb" in names and "02_block_checkpoint.ipynb" in names
    readme = (ROOT / "README.md").read_text()
    for name in names:
        assert f"notebooks/{name}" in readme, f"README does not link {name}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_valid_and_built_from_the_builder(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert (nb.nbformat, nb.nbformat_minor) >= (4, 5)
    ids = [c.id for c in nb.cells]
    assert all(ids) and len(set(ids)) == len(ids)
    cells = _builder().NOTEBOOKS[path.name]
    assert [c.source for c in nb.cells] == [src for _, src in cells], \
        "notebook differs from notebooks/build_notebooks.py: rebuild it"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs for c in code), "every code cell has stored output (executed)"


# The block-checkpoint notebook repeats the README's quick start at length: full matrix only.
RUN_FULL_ONLY = {"02_block_checkpoint.ipynb"}


@pytest.mark.parametrize("path", [pytest.param(p, marks=(FULL,) if p.name in RUN_FULL_ONLY else ())
                                  for p in NOTEBOOKS], ids=lambda p: p.name)
def test_notebook_runs(path, tmp_path, monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    monkeypatch.chdir(tmp_path)
    nb = nbformat.read(path, as_version=4)
    ns = {"__name__": "__main__"}
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        exec(compile(cell.source, f"{path.name} cell {i + 1}", "exec"), ns)
    import matplotlib.pyplot as plt
    plt.close("all")
