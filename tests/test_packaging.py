"""Packaging: dependencies are what the package imports, the GPU install pins no triton, the
CPU pins live only in the CPU test command, and CI runs exactly the README's command."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0].lower() for r in requirements}


def _imports(folder: Path, skip: tuple[str, ...] = ()) -> set[str]:
    """Top-level names imported by the ``.py`` files under ``folder`` (sub-folders in
    ``skip`` left out)."""
    found = set()
    for path in folder.rglob("*.py"):
        if path.relative_to(folder).parts[0] in skip:
            continue
        for line in path.read_text().splitlines():
            m = re.match(r"\s*(?:import|from)\s+([A-Za-z_]\w*)", line)
            if m:
                found.add(m.group(1))
    return found


def test_runtime_dependencies_are_what_the_package_imports() -> None:
    deps = PROJECT["dependencies"]
    assert _names(deps) == {"torch", "triton"}
    assert "torch>=2.11" in deps
    # no exact triton pin: a CUDA torch brings its own triton version
    assert not any(d.startswith("triton") and "==" in d for d in deps)
    # train/ and backend/ need their extras (train: transformers, which brings numpy; vllm)
    imported = _imports(ROOT / "flamia_serve", skip=("train", "backend"))
    assert "numpy" not in imported and "rich" not in imported


def test_extras() -> None:
    extras = PROJECT["optional-dependencies"]
    assert {"vllm", "cute", "bench", "test", "dev", "train"} <= set(extras)
    assert extras["train"] == ["transformers>=5.0", "tokenizers"]
    everything = [r for reqs in extras.values() for r in reqs]
    assert "hypothesis" not in _names(everything)
    assert "hypothesis" not in _imports(ROOT / "tests")
    # the interpreter's numpy is a test dependency, never a runtime one
    assert "numpy" in _names(extras["test"])


def test_license_and_build_backend() -> None:
    assert PROJECT["license"] == "Apache-2.0"  # SPDX expression, not the deprecated table
    assert "setuptools>=77" in PYPROJECT["build-system"]["requires"]


def test_entry_points() -> None:
    assert PROJECT["scripts"]["flamia"] == "flamia_serve.cli:main"
    plugins = PROJECT["entry-points"]["vllm.general_plugins"]
    assert plugins == {"flamia": "flamia_serve.backend:register"}


def _indented_commands(section: str) -> list[str]:
    """The 4-space-indented command lines of the README paragraph starting with ``section``."""
    start = README.index(section)
    end = README.index("\n\n", README.index("\n\n    ", start) + 2)
    return [line.strip() for line in README[start:end].splitlines() if line.startswith("    ")]


def test_ci_runs_the_readme_cpu_command() -> None:
    commands = _indented_commands("**CPU**")
    assert commands == [
        "pip install torch==2.13.0",
        'pip install "triton==3.6.0" "numpy<2.3" -e ".[test,dev]" && python -m pytest -q -n auto',
    ]
    ci_lines = [line.strip() for line in CI.splitlines()]
    assert 'python -m pip install -q "torch==2.13.0"' in ci_lines
    assert 'python -m pip install -q "triton==3.6.0" "numpy<2.3" -e ".[test,dev]"' in ci_lines
    assert ci_lines.index("ruff check flamia_serve tests benchmarks") < ci_lines.index(
        "python -m pytest -q -n auto"
    )


def test_readme_gpu_command_pins_nothing() -> None:
    commands = _indented_commands("**GPU**")
    assert commands[0] == 'pip install -e ".[test]"'
    assert not any("==" in c or "<" in c for c in commands)


def test_ci_uses_a_fresh_venv_outside_the_checkout() -> None:
    assert "mktemp -d" in CI and ".ci-venv" not in CI
    assert 'python3 -m venv "$work/venv"' in CI
    assert "trap 'rm -rf \"$work\"' EXIT" in CI
    # the vLLM CPU requirements, when another part of the project provides them
    assert "-f .ci/vllm-cpu-requirements.txt" in CI
    assert "--no-deps -r .ci/vllm-cpu-requirements.txt" in CI
    subprocess.run(["bash", "-n", str(ROOT / ".ci" / "run")], check=True)
    subprocess.run(["bash", "-n", str(ROOT / "docs" / "gpu_install_dry_run.sh")], check=True)


def test_gitignore() -> None:
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "flamia_probe.json" in ignored


def test_no_registry_hosts_in_docs() -> None:
    for path in (ROOT / "README.md", *(ROOT / "docs").iterdir(), ROOT / "pyproject.toml"):
        text = path.read_text()
        for host in ("pypi.org", "pythonhosted", "download.pytorch.org", "npmjs"):
            assert host not in text, (path.name, host)
