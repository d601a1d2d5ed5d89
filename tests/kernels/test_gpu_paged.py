"""Serving kernels at realistic sizes on the GPU (``pytest -m gpu``)."""

from __future__ import annotations

import pytest
import torch

from flamia_serve.kernels import paged as kernels
from flamia_serve.reference import paged as ref
from tests.kernels.paged_cases import make_batch
from tests.kernels.test_paged import _assert_close

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("exp_mode", ["exact", "mitchell"])
def test_large_mixed_batch(dtype: str, exp_mode: str) -> None:
    """8 decodes over up to 5000 cached tokens (split-K) + 2 prefills of 700 on 1000."""
    new = [1] * 8 + [700, 333]
    cached = [5000, 17, 1024, 4095, 300, 2500, 64, 999, 1000, 0]
    b = make_batch(new, cached, heads_q=32, heads_kv=8, head_dim=128, dtype=dtype,
                   device="cuda", seed=5)  # fmt: skip
    cache = b.cache.clone()
    kernels.write_kv_cache(cache, b.key, b.value, b.slot_mapping, b.fmt)
    expected_cache = b.cache.clone()
    ref.write_kv_cache(expected_cache, b.key, b.value, b.slot_mapping, b.fmt)
    assert torch.equal(cache, expected_cache)
    expected = ref.paged_attention(b.q, cache, b.fmt, b.block_table, b.seq_lens,
                                   b.query_start_loc, softmax_scale=128**-0.5,
                                   exp_mode=exp_mode)  # fmt: skip
    out = kernels.paged_attention(b.q, cache, b.fmt, b.block_table, b.seq_lens,
                                  b.query_start_loc, exp_mode=exp_mode)  # fmt: skip
    _assert_close(out, expected, b.fmt)


def _planned_call(b, max_seqs: int) -> torch.Tensor:
    """One batch as the vLLM backend runs it: a host plan, the CuTe prefill's schedule, a
    workspace sized for every batch of ``max_seqs`` sequences."""
    heads_q, heads_kv = b.q.shape[1], b.key.shape[1]
    plan = kernels.plan_paged(b.fmt, heads_q, heads_kv, b.query_start_loc.cpu(),
                              int(b.seq_lens.max()), device="cuda",
                              seq_lens_host=b.seq_lens.cpu())  # fmt: skip
    rows = kernels.max_workspace_rows(b.fmt, heads_q, heads_kv, max_seqs, 8192, "cuda")
    workspace = kernels.PagedWorkspace.allocate(rows, heads_q, b.fmt.head_dim, "cuda")
    schedule = kernels.plan_prefill_schedule(plan, b.seq_lens, b.query_start_loc, max_seqs)
    out = torch.empty_like(b.q)
    kernels.run_paged_attention(b.q, b.cache, b.block_table, b.seq_lens, b.query_start_loc,
                                plan, out, qk_scale=128**-0.5 * 1.4426950408889634,
                                workspace=workspace, prefill_schedule=schedule)  # fmt: skip
    return out


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "nvfp4"])
def test_batch_shapes_compile_nothing_after_warm_up(dtype: str) -> None:
    """Once a split and an unsplit decode batch and a mixed batch ran, batches with other
    decode / prefill counts, token counts and split counts compile no Triton kernel (the
    batch-dependent integers are runtime arguments): a serving engine never stalls on the
    JIT after its warm-up."""
    from benchmarks.common import JitCompiles

    def batch(new: list[int], cached: list[int], seed: int):
        b = make_batch(new, cached, heads_q=32, heads_kv=8, head_dim=128, dtype=dtype,
                       device="cuda", seed=seed)  # fmt: skip
        kernels.write_kv_cache(b.cache, b.key, b.value, b.slot_mapping, b.fmt)
        return b

    # as vLLM's warm-up (CUDA-graph captures down to one sequence): a one-tile decode is
    # unsplit under every split policy (the Triton decode splits 48 sequences, the CuTe not)
    warm = [batch([1] * 2, [3000, 40], 0), batch([1] * 48, [600] * 48, 1),
            batch([1, 1, 300], [100, 2000, 50], 2), batch([1], [3], 3)]  # fmt: skip
    for b in warm:
        _planned_call(b, 64)
    shapes = [([1], [7000]), ([1] * 16, [900] * 16), ([1] * 17 + [33], [64] * 17 + [0]),
              ([1] * 5 + [16, 1024, 7], [5, 80, 3000, 1, 0, 4000, 2, 9]), ([1], [1]),
              ([200, 200], [0, 16]), ([1] * 32 + [1], [1500] * 32 + [1])]  # fmt: skip
    with JitCompiles() as jit:
        for i, (new, cached) in enumerate(shapes):
            b = batch(new, cached, 10 + i)
            out = _planned_call(b, 64)
            expected = ref.paged_attention(b.q, b.cache, b.fmt, b.block_table, b.seq_lens,
                                           b.query_start_loc, softmax_scale=128**-0.5)  # fmt: skip
            _assert_close(out, expected, b.fmt)
    torch.cuda.synchronize()
    compiled = {k: v for k, v in jit.summary()["triton"].items() if "paged" in k
                or k in ("combine_splits_kernel", "write_kv_cache_kernel",
                         "prefill_offsets_kernel", "prefill_operands_kernel",
                         "quantize_q_tokens_kernel")}  # fmt: skip
    assert compiled == {}
    assert jit.summary()["cute"] == 0
