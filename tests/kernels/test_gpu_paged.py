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
