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


def test_interleaved_rounds_alternate_and_take_medians(tmp_path) -> None:
    """``interleaved`` times this tree's call and the variant's in turn (the variant in the
    named module's place only for its own rounds) and keeps their medians and every round;
    ``check_packs`` counts the rows its predicate refuses."""
    from benchmarks.bwd_variant_ab import CHECK_PACKS, check_packs, interleaved

    path = tmp_path / "copy.py"
    path.write_text("WHICH = 'variant'\n")
    name = "flamia_serve.kernels.attn_fwd.cute_sm90"
    variant = load_variant(path, name)
    seen: list[str] = []
    times = iter([3.0, 10.0, 1.0, 20.0, 2.0, 30.0])

    def run() -> None:
        seen.append(getattr(sys.modules.get(name), "WHICH", "tree"))

    def timer(fn) -> dict:
        fn()
        return {"ms": next(times)}

    row = interleaved(run, variant, 3, timer, name)
    assert seen == ["tree", "variant"] * 3
    assert (row["ms"], row["variant_ms"], row["speedup"]) == (2.0, 20.0, 10.0)
    assert row["ms_rounds"] == [3.0, 1.0, 2.0] and row["variant_ms_rounds"] == [10.0, 20.0, 30.0]
    rows, failed = check_packs(lambda *pack: {"d": pack[3]}, lambda row: row["d"] != 64)
    assert len(rows) == len(CHECK_PACKS) and rows[0]["seqlens"] == list(CHECK_PACKS[0][0])
    assert failed == sum(pack[3] == 64 for pack in CHECK_PACKS) > 0
