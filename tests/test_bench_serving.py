"""CPU checks of the serving benchmarks' problem set-up: FlashInfer sees the same pages and
tokens as FLAMIA, and a prefill workload's data does not depend on the list it is run in."""

from __future__ import annotations

import pytest
import torch

from benchmarks.prefill import WORKLOADS, workload_seed
from benchmarks.serving import PAGE, ServingBatch, flashinfer_page_table


def _batch(seq_lens: list[int], q_lens: list[int]) -> ServingBatch:
    pages = [-(-n // PAGE) for n in seq_lens]
    order = torch.randperm(sum(pages)).int()
    table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
    start = 0
    for i, p in enumerate(pages):
        table[i, :p] = order[start : start + p]
        start += p
    empty = torch.empty(0)
    return ServingBatch(empty, q_lens, seq_lens, table, torch.tensor(seq_lens), empty, empty)


def test_page_table_covers_every_token_including_a_partial_last_page() -> None:
    batch = _batch([1000, 16, 17, 4096], [1, 1, 1, 1])
    indptr, indices, last = flashinfer_page_table(batch)
    assert indptr.tolist() == [0, 63, 64, 66, 322]
    assert last.tolist() == [1000 - 62 * PAGE, 16, 1, 16]
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    for s, n in enumerate(batch.seq_lens_list):  # the sequence's own pages, in its order
        a, b = indptr[s], indptr[s + 1]
        assert torch.equal(indices[a:b], batch.block_table[s, : b - a])
        assert (b - a - 1) * PAGE + last[s] == n


def test_page_table_of_the_design_decode_workloads_is_unchanged() -> None:
    for b, length in ((1, 1024), (16, 8192), (64, 32768)):
        batch = _batch([length] * b, [1] * b)
        indptr, indices, last = flashinfer_page_table(batch)
        pages = length // PAGE  # the former formula (whole pages only)
        assert torch.equal(indptr, torch.arange(0, (b + 1) * pages, pages, dtype=torch.int32))
        assert torch.equal(indices, batch.block_table[:, :pages].reshape(-1))
        assert bool((last == PAGE).all())


def test_prefill_seed_belongs_to_the_workload_not_its_place_in_the_list() -> None:
    assert [workload_seed(n) for n in WORKLOADS] == list(range(len(WORKLOADS)))
    assert workload_seed("S3-4x2048+8192") == 2  # also when run alone (it was 0 then)
    with pytest.raises(SystemExit, match=r"unknown workload 'S9'.*S1-1x8192"):
        workload_seed("S9")


def test_measure_rounds_alternate_the_order_and_keep_medians(monkeypatch) -> None:
    """``measure(rounds=3)``: each impl's output checked once, the impls timed in the other
    order every other round, one row per impl with its median and every round's time."""
    from benchmarks import serving

    order: list[str] = []
    times = {"flamia-fp8-exact": iter([1.0, 5.0, 3.0]), "flashinfer-bf16": iter([2.0, 2.0, 8.0])}
    calls = {name: (lambda name=name: (order.append(f"out {name}"), torch.ones(4))[1])
             for name in times}  # fmt: skip

    def graph_time(call, rep_ms, l2="dirty"):
        name = next(n for n, c in calls.items() if c is call)
        order.append(name)
        ms = next(times[name])
        return {"ms": ms, "ms_p20": ms, "ms_p80": ms}

    monkeypatch.setattr(serving, "graph_time", graph_time)
    monkeypatch.setattr(serving, "exact_attention", lambda batch: torch.ones(4))
    impls = {name: ("fp8" if name.startswith("flamia") else "bf16", call)
             for name, call in calls.items()}  # fmt: skip
    rows = serving.measure("S1", "prefill", None, impls, rounds=3)  # type: ignore[arg-type]
    names = list(times)
    assert order == [f"out {n}" for n in names] + names + names[::-1] + names
    assert [r["impl"] for r in rows] == names
    assert rows[0]["ms"] == 3.0 and rows[0]["ms_rounds"] == [1.0, 5.0, 3.0]
    assert rows[1]["ms"] == 2.0 and rows[0]["cos_vs_exact"] == pytest.approx(1.0)
