"""Test setup: Triton's interpreter on CPU-only machines, the `gpu` marker, fixed seeds."""

from __future__ import annotations

import os

import torch

# Must be set before any Triton kernel is defined (kernels are defined at import).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def device() -> str:
    """Where kernel tests run: the GPU when there is one, else the interpreter on CPU."""
    return "cuda" if HAS_CUDA else "cpu"
