"""The benchmark workloads (``benchmarks/workloads.py``): W1–W9 and the pack families P1–P5
are what DESIGN §7 says, the same on every build, and carry their own heads."""

from __future__ import annotations

import pytest

from benchmarks.workloads import (
    EQUAL_PACKS,
    HEAD_DIM,
    HKV,
    HQ,
    PACK_FAMILIES,
    WORKLOADS,
    training_workload,
)
from flamia_serve.kernels.attn_fwd.ops import SHORT_DOCUMENTS


@pytest.mark.parametrize("name", WORKLOADS + PACK_FAMILIES + EQUAL_PACKS)
def test_workloads_fill_their_tokens_deterministically(name: str) -> None:
    wl = training_workload(name)
    assert sum(wl.seqlens) == wl.total_tokens and min(wl.seqlens) >= 1
    assert training_workload(name).seqlens == wl.seqlens
    cu = wl.cu_seqlens()
    assert int(cu[0]) == 0 and int(cu[-1]) == wl.total_tokens and cu.numel() == wl.num_docs + 1
    expected = sum(n * n / 2 for n in wl.seqlens) * 4 * wl.hq * wl.head_dim
    assert wl.flops() == pytest.approx(expected)


def test_pack_families_have_their_shapes() -> None:
    shapes = {n: (w.total_tokens, w.hq, w.hkv, w.head_dim)
              for n in PACK_FAMILIES for w in [training_workload(n)]}  # fmt: skip
    assert shapes == {
        "P1": (16384, 32, 8, 64),
        "P2": (8192, 32, 8, 256),
        "P3": (16384, 16, 16, 128),
        "P4": (32768, 32, 8, 128),
        "P5": (65536, 32, 8, 128),
    }
    assert all((training_workload(n).hq, training_workload(n).head_dim) == (HQ, HEAD_DIM)
               and training_workload(n).hkv == HKV for n in WORKLOADS)  # fmt: skip
    p1, p3, p4 = (training_workload(n) for n in ("P1", "P3", "P4"))
    assert p1.num_docs > 1000 and p1.total_tokens / p1.num_docs < SHORT_DOCUMENTS
    assert p4.num_docs > 300 and p4.total_tokens / p4.num_docs >= SHORT_DOCUMENTS
    assert all(n % 2 == 1 for n in p3.seqlens[:-1])  # odd lengths (the last one is cut)
    assert training_workload("P2").num_docs == training_workload("P5").num_docs == 1


def test_equal_packs_cut_16k_tokens_into_equal_documents() -> None:
    for name in EQUAL_PACKS:
        wl = training_workload(name)
        n = int(name[1:])
        assert wl.seqlens == [16384 // n] * n
        assert (wl.hq, wl.hkv, wl.head_dim) == (HQ, HKV, HEAD_DIM)
    # the shortest stays on the CuTe path (windows start below SHORT_DOCUMENTS on average)
    assert min(16384 // int(n[1:]) for n in EQUAL_PACKS) >= SHORT_DOCUMENTS


def test_unknown_workload_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"unknown workload 'W10'.*P5"):
        training_workload("W10")
