"""Every ```python block of README.md and docs/*.md runs as written, on a CPU.

Each block is one test and runs alone in a fresh namespace, in a temporary working directory:
a snippet a reader copies must not depend on another snippet. A block preceded by the line
`<!-- no-run -->` is skipped: only for GPU-only snippets (the marker says so to the reader too).
A block may be preceded by a hidden setup, an HTML comment `<!-- setup` ... `-->` holding Python
that defines the block's inputs (small random arrays, a demo checkpoint); it runs first, in the
block's namespace, and a markdown viewer does not show it.
"""

from __future__ import annotations

import os
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NO_RUN = "<!-- no-run -->"
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
ANY_FENCE = re.compile(r"^```.*?^```[ \t]*$", re.S | re.M)
SETUP = re.compile(r"<!-- setup[ \t]*\n(.*?)^-->[ \t]*\s*$", re.S | re.M)

# Blocks known not to run as written yet, by (file, the heading they sit under). Strict: once a
# block runs, its entry fails the suite and must be deleted here.
NOT_YET_RUNNABLE: set[tuple[str, str]] = set()


def python_blocks(text: str) -> list[tuple[int, str, str, bool]]:
    """[(line number, heading above, code, runnable)] of the ```python blocks of a markdown text;
    `code` starts with the block's hidden setup, if it has one."""
    out = []
    for m in FENCE.finditer(text):
        before = text[:m.start()]
        line = before.count("\n") + 1
        # a "# comment" inside an earlier code block is not a heading
        headings = re.findall(r"^#+ +(.+?)\s*$", ANY_FENCE.sub("", before), re.M)
        prev = [ln.strip() for ln in before.splitlines() if ln.strip()]
        runnable = not (prev and prev[-1] == NO_RUN)
        setups = list(SETUP.finditer(before))
        code = m.group(1)
        if setups and not before[setups[-1].end():].strip():
            code = setups[-1].group(1) + code
        out.append((line, headings[-1] if headings else "", code, runnable))
    return out


def _doc_files() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _cases():
    for path in _doc_files():
        rel = path.relative_to(ROOT).as_posix()
        for line, heading, code, runnable in python_blocks(path.read_text()):
            marks = []
            if not runnable:
                marks.append(pytest.mark.skip(reason=f"{NO_RUN}: GPU-only snippet"))
            elif (rel, heading) in NOT_YET_RUNNABLE:
                marks.append(pytest.mark.xfail(strict=True, reason="listed in NOT_YET_RUNNABLE"))
            yield pytest.param(rel, line, code, id=f"{rel}:{line}", marks=marks)


def test_python_blocks_found():
    """The collector sees the blocks (a regex that matched nothing would pass every file)."""
    readme = python_blocks((ROOT / "README.md").read_text())
    assert len(readme) >= 2
    sample = "x\n<!-- no-run -->\n```python\nA\n```\n## H\n```python\nB\n```\n"
    assert [(h, c, r) for _, h, c, r in python_blocks(sample)] == [("", "A\n", False), ("H", "B\n", True)]
    hidden = "## H\n```python\n# not a heading\n```\n<!-- setup\nx = 1\n-->\n```python\nprint(x)\n```\n"
    assert [(h, c) for _, h, c, _ in python_blocks(hidden)] == [("H", "# not a heading\n"),
                                                                 ("H", "x = 1\nprint(x)\n")]


@pytest.mark.parametrize("path,line,code", list(_cases()))
def test_doc_block_runs(path, line, code, tmp_path, monkeypatch):
    from gdn_jax import dispatch
    monkeypatch.chdir(tmp_path)
    # a snippet may register a kernel family (docs/design.md shows how): undone afterwards
    dispatch.operations()
    saved = {name: list(op.families) for name, op in dispatch._OPERATIONS.items()}
    ns = {"__name__": f"doc_block_{line}"}
    try:
        exec(compile(code, f"{path}:{line}", "exec"), ns)
    finally:
        for name, fams in saved.items():
            dispatch._OPERATIONS[name].families[:] = fams
