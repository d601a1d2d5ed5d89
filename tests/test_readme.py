"""The README runs as written: every ```python block is executed in a fresh interpreter
(blocks whose first line is ``# GPU only`` under the ``gpu`` marker), and the README and
docs/DESIGN.md are self-contained (relative links resolve, no paths outside the repo)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
GPU_MARK = "# GPU only"


def python_blocks(text: str) -> list[str]:
    """Bodies of the ```python fenced blocks of a markdown text, in order."""
    return re.findall(r"^```python[^\n]*\n(.*?)^```", text, flags=re.M | re.S)


def _params() -> list:
    params = []
    for i, code in enumerate(python_blocks(README.read_text())):
        gpu = code.lstrip().startswith(GPU_MARK)
        marks = [pytest.mark.gpu] if gpu else []
        params.append(pytest.param(code, id=f"block{i}{'-gpu' if gpu else ''}", marks=marks))
    return params


def test_readme_has_python_examples() -> None:
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 3
    assert any(not b.lstrip().startswith(GPU_MARK) for b in blocks)


@pytest.mark.parametrize("code", _params())
def test_readme_example_runs(code: str, tmp_path: Path) -> None:
    # a fresh process, without the test session's TRITON_INTERPRET: a CPU example that
    # needs the interpreter must say so itself
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), flags=re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_are_self_contained(doc: Path) -> None:
    text = doc.read_text()
    assert "../" not in text, "points outside the repository"
    assert "shared/" not in text and "the issue asks" not in text
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        assert path.is_file(), f"{doc.name}: broken link {target}"
        assert path.is_relative_to(ROOT), f"{doc.name}: {target} is outside the repository"
        if anchor:
            assert anchor in _anchors(path), f"{doc.name}: no heading for #{anchor}"


def test_readme_defines_the_workloads() -> None:
    text = README.read_text()
    for name in ("W1", "W4", "W7", "W9", "P1–P5", "B·L", "S1-1x8192+0"):
        assert name in text
    design = (ROOT / "docs" / "DESIGN.md").read_text()
    for n in range(1, 11):
        assert f"**N{n} —" in design
    for name in ("W1", "W9", "P1–P5", "B{b}-L{l}", "S1-1x8192+0", "MIX-32dec@4096+2x2048+1024"):
        assert name in design
