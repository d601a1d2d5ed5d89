"""CuTe DSL quantized-cache decodes (sm_90: NVFP4, FP8, static FP8) against the reference
twin and the Triton kernel: run on the H200 (``pytest -m gpu``) with ``nvidia-cutlass-dsl``
installed; skipped elsewhere."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from flamia_serve.kernels import paged as kernels
from flamia_serve.kernels._common import cute_dsl_available
from flamia_serve.kernels.paged.ops import cute_decode_runs
from flamia_serve.reference import paged as ref
from tests.kernels.paged_cases import make_batch
from tests.kernels.test_paged import _assert_close, poisoned_cache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not cute_dsl_available(torch.device("cuda")),
        reason="needs an sm_90 GPU with nvidia-cutlass-dsl",
    ),
]


@pytest.fixture(autouse=True)
def _cute_decode_really_runs():
    """The CuTe decodes fall back to Triton on an import or compile error (a warning): here
    that is a failure."""
    yield
    from flamia_serve.kernels.paged import ops

    assert "decode" not in ops.CUTE_FAILURES, ops.CUTE_FAILURES


#: base-2 logit scale at d = 128
QK_SCALE = 128**-0.5 * math.log2(math.e)


@pytest.mark.parametrize("dtype", ["nvfp4", "fp8"])
@pytest.mark.parametrize(
    ("heads_q", "heads_kv", "head_dim", "page_size", "cached", "splits"),
    [
        (32, 8, 128, 16, [8191, 5000, 17, 1, 0, 15, 16, 300], None),  # default splits
        (32, 8, 128, 16, [4095, 33, 64], 1),  # one split: straight to the output
        (32, 8, 128, 32, [1000, 31, 32, 2047], 3),  # larger pages, an odd split count
        (8, 8, 128, 16, [999, 64, 3], 2),  # MHA: group 1
        (16, 2, 64, 16, [777, 128, 5], 8),  # group 8, d = 64
        (32, 2, 128, 16, [2000, 19], 2),  # group 16: both halves of the MMA rows
        (24, 4, 64, 16, [513, 100], 1),  # group 6 (not a power of two)
    ],
)
def test_cute_decode_matches_reference_and_triton(
    dtype: str, heads_q: int, heads_kv: int, head_dim: int, page_size: int, cached: list[int],
    splits: int | None,
) -> None:  # fmt: skip
    if dtype == "fp8" and heads_q // heads_kv > 8:
        pytest.skip("the CuTe FP8 decode serves GQA groups up to 8")
    b = make_batch([1] * len(cached), cached, heads_q=heads_q, heads_kv=heads_kv,
                   head_dim=head_dim, page_size=page_size, dtype=dtype, device="cuda",
                   seed=len(cached) + head_dim)  # fmt: skip
    cache = b.cache.clone()
    ref.write_kv_cache(cache, b.key, b.value, b.slot_mapping, b.fmt)
    args = (b.q, cache, b.fmt, b.block_table, b.seq_lens, b.query_start_loc)
    assert cute_decode_runs(b.fmt, heads_q, heads_kv, b.q.device)
    plan = kernels.plan_paged(b.fmt, heads_q, heads_kv, b.query_start_loc.cpu(),
                              max(cached) + 1, num_splits=splits)  # fmt: skip
    assert plan.decode.kernel == "cute" and plan.num_decodes == len(cached)
    out = kernels.paged_attention(*args, num_splits=splits)
    expected = ref.paged_attention(*args, softmax_scale=head_dim**-0.5)
    _assert_close(out, expected, b.fmt)
    triton_cfg = kernels.triton_decode_config(b.fmt, heads_q, heads_kv)
    triton = kernels.paged_attention(*args, num_splits=splits, decode_config=triton_cfg)
    _assert_close(out, triton, b.fmt)


@pytest.mark.parametrize("dtype", ["nvfp4", "fp8"])
@pytest.mark.parametrize("warps", [2, 4, 8])
@pytest.mark.parametrize(
    ("heads_q", "heads_kv", "head_dim", "cached", "splits"),
    [(32, 8, 128, [8191, 5000, 17, 1, 0, 300], 2), (16, 2, 64, [777, 128, 5], 1)],
)
def test_cute_decode_other_warp_counts_match_reference(
    dtype: str, warps: int, heads_q: int, heads_kv: int, head_dim: int, cached: list[int],
    splits: int,
) -> None:  # fmt: skip
    """CTAs of 2, 4 or 8 warps (the CuTe decode config's ``num_warps``; the plan picks 4 or
    8 by batch size) take every 2nd / 4th / 8th key tile and merge as many partials: the
    same attention as the reference twin and the Triton kernel."""
    from flamia_serve.kernels.paged import cute_decode_sm90

    b = make_batch([1] * len(cached), cached, heads_q=heads_q, heads_kv=heads_kv,
                   head_dim=head_dim, page_size=16, dtype=dtype, device="cuda",
                   seed=warps + head_dim)  # fmt: skip
    cache = b.cache.clone()
    ref.write_kv_cache(cache, b.key, b.value, b.slot_mapping, b.fmt)
    args = (b.q, cache, b.fmt, b.block_table, b.seq_lens, b.query_start_loc)
    triton_cfg = kernels.triton_decode_config(b.fmt, heads_q, heads_kv)
    cute_decode_sm90._COMPILED.clear()
    out = kernels.paged_attention(*args, num_splits=splits,
                                  decode_config=replace(triton_cfg, kernel="cute",
                                                        num_warps=warps))  # fmt: skip
    assert [key[10] for key in cute_decode_sm90._COMPILED] == [warps]  # this kernel ran
    _assert_close(out, ref.paged_attention(*args, softmax_scale=head_dim**-0.5), b.fmt)
    _assert_close(out, kernels.paged_attention(*args, num_splits=splits,
                                               decode_config=triton_cfg), b.fmt)  # fmt: skip


def test_cute_decode_static_fp8_scales() -> None:
    """``fp8_static``: per-layer K and V scales outside the cache (K's in the logit scale,
    V's on O), split and unsplit."""
    cached = [3000, 45, 16, 1]
    b = make_batch([1] * len(cached), cached, heads_q=32, heads_kv=8, head_dim=128,
                   dtype="fp8_static", device="cuda", seed=11)  # fmt: skip
    cache = b.cache.clone()
    scales = dict(k_scale=0.03, v_scale=0.011)
    ref.write_kv_cache(cache, b.key, b.value, b.slot_mapping, b.fmt, **scales)
    args = (b.q, cache, b.fmt, b.block_table, b.seq_lens, b.query_start_loc)
    expected = ref.paged_attention(*args, softmax_scale=128**-0.5, **scales)
    for splits in (1, 4):
        _assert_close(kernels.paged_attention(*args, num_splits=splits, **scales), expected,
                      b.fmt)  # fmt: skip


@pytest.mark.parametrize("dtype", ["nvfp4", "fp8"])
def test_cute_decode_never_reads_unwritten_slots(dtype: str) -> None:
    """NaN bytes in slots past each sequence's length (last page) and in pages the table
    points to past it: the same output as over a zeroed cache, bit for bit."""
    cached = [37, 15, 64, 1000, 0, 47]
    b = make_batch([1] * len(cached), cached, heads_q=32, heads_kv=8, head_dim=128,
                   dtype=dtype, device="cuda", seed=3)  # fmt: skip
    clean, poisoned, table, _ = poisoned_cache(b)
    for splits in (1, 4):
        outs = [kernels.paged_attention(b.q, c, b.fmt, table, b.seq_lens, b.query_start_loc,
                                        num_splits=splits) for c in (clean, poisoned)]  # fmt: skip
        assert torch.isfinite(outs[1].float()).all()
        assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", ["nvfp4", "fp8"])
def test_cute_decode_in_a_mixed_batch_and_under_cuda_graphs(dtype: str) -> None:
    """Decodes (CuTe) and a prefill (Triton) in one planned call, replayed from a CUDA
    graph with a preallocated workspace: the same output as eager."""
    new, cached = [1, 1, 1, 40], [3000, 70, 512, 200]
    b = make_batch(new, cached, heads_q=32, heads_kv=8, head_dim=128, dtype=dtype,
                   device="cuda", seed=7)  # fmt: skip
    cache = b.cache.clone()
    ref.write_kv_cache(cache, b.key, b.value, b.slot_mapping, b.fmt)
    plan = kernels.plan_paged(b.fmt, 32, 8, b.query_start_loc.cpu(), 3001)
    assert plan.num_decodes == 3 and plan.decode.kernel == "cute" and plan.num_splits > 1
    ws = kernels.PagedWorkspace.allocate(plan.workspace_rows, 32, 128, "cuda")
    out = torch.empty_like(b.q)
    run = (b.q, cache, b.block_table, b.seq_lens, b.query_start_loc, plan)
    eager = kernels.run_paged_attention(*run, torch.empty_like(b.q), qk_scale=QK_SCALE,
                                        workspace=ws).clone()  # fmt: skip
    expected = ref.paged_attention(b.q, cache, b.fmt, b.block_table, b.seq_lens,
                                   b.query_start_loc, softmax_scale=128**-0.5)  # fmt: skip
    _assert_close(eager, expected, b.fmt)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernels.run_paged_attention(*run, out, qk_scale=QK_SCALE,
                                    workspace=ws)  # fmt: skip
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        kernels.run_paged_attention(*run, out, qk_scale=QK_SCALE,
                                    workspace=ws)  # fmt: skip
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize(("stages", "split_edge"), [(2, False), (3, True), (4, False), (6, True)])
@pytest.mark.parametrize(
    ("heads_q", "heads_kv", "head_dim", "page_size", "cached", "splits"),
    [
        (32, 8, 128, 16, [8191, 5000, 17, 1, 0, 15, 16, 300], None),
        (32, 8, 128, 32, [1000, 31, 32, 2047], 3),  # two tiles per page
        (16, 2, 64, 16, [777, 128, 5], 8),  # d = 64: chunk counts below a warp
        (32, 2, 128, 16, [2000, 19], 2),  # group 16
        (32, 8, 128, 64, [3000, 70, 1], 2),  # four tiles per page
    ],
)
def test_cute_nvfp4_decode_shared_ring_gives_the_register_rings_bits(
    monkeypatch: pytest.MonkeyPatch, stages: int, split_edge: bool, heads_q: int,
    heads_kv: int, head_dim: int, page_size: int, cached: list[int], splits: int | None,
) -> None:  # fmt: skip
    """The NVFP4 decode with its tiles copied through a shared-memory ring (``STAGES``) reads
    the same fragments in the same order as with the register ring: the same bits, over a
    clean cache and over one with NaN bytes in every unwritten slot and spare page; also
    with the interior tiles' unmasked copy of the step (``SPLIT_EDGE``)."""
    from flamia_serve.kernels.paged import cute_decode_sm90

    b = make_batch([1] * len(cached), cached, heads_q=heads_q, heads_kv=heads_kv,
                   head_dim=head_dim, page_size=page_size, dtype="nvfp4", device="cuda",
                   seed=len(cached) + head_dim + stages)  # fmt: skip
    assert cute_decode_runs(b.fmt, heads_q, heads_kv, b.q.device)
    clean, poisoned, table, _ = poisoned_cache(b)
    outs = {}
    monkeypatch.setattr(cute_decode_sm90, "SPLIT_EDGE", split_edge)
    for ring in (0, stages):
        monkeypatch.setattr(cute_decode_sm90, "STAGES", ring)
        for name, cache in (("clean", clean), ("poisoned", poisoned)):
            outs[ring, name] = kernels.paged_attention(
                b.q, cache, b.fmt, table, b.seq_lens, b.query_start_loc, num_splits=splits)
    assert torch.isfinite(outs[stages, "poisoned"].float()).all()
    for name in ("clean", "poisoned"):
        assert torch.equal(outs[stages, name], outs[0, name]), name
    assert torch.equal(outs[stages, "poisoned"], outs[stages, "clean"])
    expected = ref.paged_attention(b.q, clean, b.fmt, table, b.seq_lens, b.query_start_loc,
                                   softmax_scale=head_dim**-0.5)  # fmt: skip
    _assert_close(outs[stages, "clean"], expected, b.fmt)
