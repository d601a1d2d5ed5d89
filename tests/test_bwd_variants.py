"""``benchmarks/bwd_variants.py --ablate``: every ablation still applies to the CuTe
backward's source (so a device call never spends its time on a stale recipe)."""

from __future__ import annotations

import ast

import pytest

from benchmarks.bwd_variants import ABLATIONS, KERNEL, ablated_source


@pytest.mark.parametrize("name", sorted(ABLATIONS))
def test_each_ablation_applies_once_and_stays_python(name: str) -> None:
    source = KERNEL.read_text()
    ablated = ablated_source(name, source)
    assert ablated != source
    ast.parse(ablated)  # the copy is still a module the device run can import
    for _, new in ABLATIONS[name]:
        if new:
            assert new in ablated


def test_a_kernel_without_the_text_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="ablation 'noadd'"):
        ablated_source("noadd", "def kernel():\n    pass\n")


def test_shapes_are_checked_before_any_version_runs() -> None:
    """A malformed ``--shapes`` stops the run at once, naming the form it expects."""
    from benchmarks.bwd_variants import main

    with pytest.raises(ValueError, match="TOKENSxHEAD_DIM"):
        main(["--shapes", "8192x"])
