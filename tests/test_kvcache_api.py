"""The paged KV cache's validating entry points (``PagedKVCache``, ``kernels.paged.
write_kv_cache`` / ``paged_attention``) reject bad arguments by name before any kernel runs
(Triton interpreter on CPU machines)."""

from __future__ import annotations

import pytest
import torch

from flamia_serve.kernels import paged as kernels
from flamia_serve.kvcache import PagedKVCache
from flamia_serve.numerics.kv_pages import KVPageFormat


def _small_cache(dtype: str = "fp8", **kw: float) -> tuple[PagedKVCache, tuple[torch.Tensor, ...]]:
    """A 3-token sequence written into a 4-block cache, and its (q, block_table, seq_lens,
    query_start_loc)."""
    cache = PagedKVCache.allocate(4, 16, 2, 64, dtype, device="cpu", **kw)  # type: ignore[arg-type]
    key = torch.randn(3, 2, 64, dtype=torch.bfloat16)
    cache.write(key, key, torch.arange(3))
    q = torch.randn(3, 4, 64, dtype=torch.bfloat16)
    table = torch.zeros(1, 1, dtype=torch.int32)
    lens, qsl = torch.tensor([3], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32)
    return cache, (q, table, lens, qsl)


@pytest.mark.parametrize("head_dim", [32, 48, 80, 96])
def test_head_dims_the_kernels_do_not_run_are_rejected(head_dim: int) -> None:
    """``KVPageFormat`` takes any multiple of 16; the kernels tile d in {64, 128, 256}: other
    head dims raise naming head_dim (they crashed inside Triton, or ran untested)."""
    with pytest.raises(ValueError, match=f"head_dim {head_dim} is not served"):
        PagedKVCache.allocate(4, 16, 2, head_dim, "fp8", device="cpu")
    fmt = KVPageFormat("fp8", head_dim)
    data = torch.zeros(fmt.cache_shape(4, 16, 2), dtype=torch.uint8)
    key = torch.randn(3, 2, head_dim, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"head_dim {head_dim} is not served"):
        kernels.write_kv_cache(data, key, key, torch.arange(3), fmt)
    q = torch.randn(3, 4, head_dim, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"head_dim {head_dim} is not served"):
        kernels.paged_attention(q, data, fmt, torch.zeros(1, 1, dtype=torch.int32),
                                torch.tensor([3], dtype=torch.int32),
                                torch.tensor([0, 3], dtype=torch.int32))  # fmt: skip


def test_inputs_on_another_device_are_named() -> None:
    """``value``, ``slot_mapping`` and ``out`` on another device than key / q raise naming
    them (on a GPU a host ``slot_mapping`` reached the kernel as a host pointer)."""
    cache, (q, table, lens, qsl) = _small_cache()
    key = torch.randn(3, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="value is on meta"):
        cache.write(key, key.to("meta"), torch.arange(3))
    with pytest.raises(ValueError, match="slot_mapping is on meta"):
        cache.write(key, key, torch.arange(3, device="meta"))
    with pytest.raises(ValueError, match=r"out must be .* on cpu"):
        cache.attention(q, table, lens, qsl, out=torch.empty_like(q, device="meta"))


def test_window_must_be_a_positive_int() -> None:
    """``window=True`` was taken as an int and crashed inside the kernel."""
    cache, args = _small_cache()
    for bad in (True, 0, 2.0):
        with pytest.raises(ValueError, match="window must be a positive int"):
            cache.attention(*args, window=bad)  # type: ignore[arg-type]
    assert cache.attention(*args, window=2).shape == args[0].shape


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4", "bf16"])
def test_static_scales_on_other_formats_are_rejected(dtype: str) -> None:
    """``k_scale`` / ``v_scale`` belong to ``fp8_static`` (vLLM's ``fp8``); with another
    format they were silently ignored: FLAMIA's ``fp8`` is vLLM's ``fp8_per_token_head``."""
    cache, args = _small_cache(dtype)
    cache.k_scale = 0.5
    key = torch.randn(1, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"k_scale/v_scale .* fp8_static format only"):
        cache.write(key, key, torch.tensor([5]))
    with pytest.raises(ValueError, match=r"k_scale/v_scale .* fp8_static format only"):
        cache.attention(*args)
    static, args = _small_cache("fp8_static", k_scale=0.5, v_scale=2.0)
    assert static.attention(*args).shape == args[0].shape


def test_strided_index_tensors_are_refused_by_name() -> None:
    """The kernels index ``slot_mapping``, ``seq_lens`` and ``query_start_loc`` as plain
    arrays: a strided view (a column of a [B, 2] tensor) was read as if contiguous, so the
    write filled the wrong slots and attention used other sequences' lengths, silently."""
    cache = PagedKVCache.allocate(4, 16, 2, 64, "fp8", device="cpu")
    key = torch.randn(6, 2, 64, dtype=torch.bfloat16)
    slots = torch.tensor([[0, -1], [1, -1], [2, -1], [16, -1], [17, -1], [18, -1]])[:, 0]
    with pytest.raises(ValueError, match="slot_mapping must be contiguous"):
        cache.write(key, key, slots)
    assert not cache.data.any()
    cache.write(key, key, slots.contiguous())
    q = torch.randn(4, 4, 64, dtype=torch.bfloat16)
    table = torch.tensor([[0], [1]], dtype=torch.int32)
    lens = torch.tensor([[3, 0], [3, 0]], dtype=torch.int32)[:, 0]
    qsl = torch.tensor([[0, 9], [2, 9], [4, 9]], dtype=torch.int32)[:, 0]  # 2 + 2 tokens
    with pytest.raises(ValueError, match="seq_lens must be contiguous"):
        cache.attention(q, table, lens, qsl.contiguous())
    with pytest.raises(ValueError, match="query_start_loc must be contiguous"):
        cache.attention(q, table, lens.contiguous(), qsl)
    assert cache.attention(q, table, lens.contiguous(), qsl.contiguous()).shape == q.shape


@pytest.mark.parametrize("bad", [float("inf"), 1e-39, 0.0, -2.0, float("nan")])
def test_static_scales_must_be_positive_finite_with_a_finite_inverse(bad: float) -> None:
    """``fp8_static`` writes multiply by the float32 ``1 / scale``: ``k_scale=inf`` wrote all
    zero codes and attended with an infinite logit scale, ``1e-39`` (inverse past float32)
    wrote ±448 and NaN codes, both without an error; a bad scale is now refused at
    ``allocate`` and by every call, naming ``k_scale`` or ``v_scale``."""
    for name in ("k_scale", "v_scale"):
        with pytest.raises(ValueError, match=f"{name} must be"):
            PagedKVCache.allocate(4, 16, 2, 64, "fp8_static", device="cpu", **{name: bad})
        cache, args = _small_cache("fp8_static")
        setattr(cache, name, bad)
        key = torch.randn(1, 2, 64, dtype=torch.bfloat16)
        before = cache.data.clone()
        with pytest.raises(ValueError, match=f"{name} must be"):
            cache.write(key, key, torch.tensor([5]))
        assert torch.equal(cache.data, before)
        with pytest.raises(ValueError, match=f"{name} must be"):
            cache.attention(*args)


def test_max_seq_len_below_the_longest_sequence_is_refused() -> None:
    """``max_seq_len`` is documented as an upper bound on ``seq_lens``; the fp8 cache's CuTe
    prefill lays out only ``max_seq_len`` keys per sequence (the rest of its operands stay
    uninitialised), so a smaller value was a silent wrong answer on the GPU. Wherever the
    call reads ``seq_lens`` on the host it is now checked, naming ``max_seq_len``."""
    cache, (q, table, lens, qsl) = _small_cache()
    for bad in (2, 0, -1):
        with pytest.raises(ValueError, match=f"max_seq_len={bad} is less than"):
            cache.attention(q, table, lens, qsl, max_seq_len=bad)
    with pytest.raises(ValueError, match="max_seq_len must be an int"):
        cache.attention(q, table, lens, qsl, max_seq_len=3.0)  # type: ignore[arg-type]
    assert cache.attention(q, table, lens, qsl, max_seq_len=3).shape == q.shape
    assert cache.attention(q, table, lens, qsl, max_seq_len=4096).shape == q.shape


def test_allocate_names_a_size_that_is_not_a_positive_int() -> None:
    """A float size (``page_size=16.0``) failed inside ``torch.zeros`` with "argument 'size'
    ... at pos 4", naming no argument; each size is now checked by name."""
    sizes = dict(num_blocks=4, page_size=16, heads_kv=2, head_dim=64)
    for name in sizes:
        for bad, error in ((float(sizes[name]), TypeError), (True, TypeError), (0, ValueError)):
            with pytest.raises(error, match=name):
                PagedKVCache.allocate(**(sizes | {name: bad}), dtype="fp8", device="cpu")


def test_tile_configs_the_kernels_cannot_run_are_named() -> None:
    """``decode_config`` / ``prefill_config`` with a tile that is not a power of two failed
    inside Triton ("arange's range must be a power of 2", naming no argument); a key tile
    below 16 (no MMA on the GPU), zero warps or stages, or an unknown ``kernel`` (taken as
    Triton, silently) ran. Each is refused naming the config and the field."""
    cache, args = _small_cache()
    bad = [({"block_n": 24}, "block_n"), ({"block_m": 48}, "block_m"), ({"block_n": 8}, "block_n"),
           ({"num_warps": 0}, "num_warps"), ({"num_warps": 3}, "num_warps"),
           ({"num_stages": 0}, "num_stages"), ({"kernel": "cuda"}, "kernel")]  # fmt: skip
    for which in ("decode_config", "prefill_config"):
        for over, field in bad:
            cfg = kernels.PagedConfig(**({"block_m": 16, "block_n": 16} | over))  # type: ignore[arg-type]
            with pytest.raises(ValueError, match=f"{which}.{field}"):
                cache.attention(*args, **{which: cfg})
        with pytest.raises(TypeError, match=f"{which} must be a PagedConfig"):
            cache.attention(*args, **{which: (16, 16)})
    ok = kernels.PagedConfig(16, 16, 2, 1)
    assert cache.attention(*args, decode_config=ok, prefill_config=ok).shape == args[0].shape


def test_num_splits_must_be_an_int() -> None:
    """``num_splits=2.5`` passed the range check and failed inside the launch (a float grid
    size); ``True`` was taken as 1."""
    cache, args = _small_cache()
    for bad in (2.5, True, "2"):
        with pytest.raises(ValueError, match="num_splits must be an int"):
            cache.attention(*args, num_splits=bad)  # type: ignore[arg-type]
