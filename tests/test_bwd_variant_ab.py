"""CPU checks of ``benchmarks/bwd_variant_ab.py``'s swap of the CuTe backward's module: the
variant is imported from its file under its own name, takes the kernel module's place only
inside the block (also when the block raises), and a file that is not a module is refused."""

from __future__ import annotations

import sys

import pytest

from benchmarks.bwd_variant_ab import KERNEL_MODULE, kernel_module, load_variant


def test_the_variant_takes_the_kernel_module_place_only_inside(tmp_path) -> None:
    path = tmp_path / "copy.py"
    path.write_text("WHICH = 'variant'\n")
    variant = load_variant(path)
    assert variant.WHICH == "variant" and variant.__name__ == f"{KERNEL_MODULE}_variant"
    before = sys.modules.get(KERNEL_MODULE)
    with kernel_module(variant):
        assert sys.modules[KERNEL_MODULE] is variant
    assert sys.modules.get(KERNEL_MODULE) is before
    with pytest.raises(RuntimeError, match="inside"), kernel_module(variant):
        raise RuntimeError("inside")
    assert sys.modules.get(KERNEL_MODULE) is before
    with kernel_module(None):
        assert sys.modules.get(KERNEL_MODULE) is before


def test_a_path_that_is_not_a_module_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="--variant"):
        load_variant(tmp_path / "notes.txt")
