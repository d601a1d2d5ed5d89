"""Serving kernels vs their reference twins (interpreter on CPU, the GPU where present)."""

from __future__ import annotations

import dataclasses
import math
import sys
import types

import pytest
import torch

from flamia_serve.kernels import paged as kernels
from flamia_serve.kvcache import PagedKVCache
from flamia_serve.numerics import unpack_e2m1
from flamia_serve.numerics.kv_pages import KVCacheFormat, KVPageFormat, region_view
from flamia_serve.reference import attention as training_attention
from flamia_serve.reference import paged as ref
from tests.kernels.paged_cases import PagedBatch, make_batch
from tests.kernels.signed_zeros import negative_zero_bytes, with_signed_zeros


def _written(b: PagedBatch, hadamard: bool = False) -> torch.Tensor:
    cache = b.cache.clone()
    ref.write_kv_cache(cache, b.key, b.value, b.slot_mapping, b.fmt, hadamard=hadamard)
    return cache


def _assert_close(out: torch.Tensor, expected: torch.Tensor, fmt: KVPageFormat) -> None:
    """Accumulation-order tolerance: FP32 sums in another order move logits by ~1e-6
    relative, which can flip one rounding of P̂ (E4M3: up to 12.5% of a dominant key's
    weight) or of the BF16 output: max error ≤ 2^-3 · max|O| (as the training forward's
    GPU tests), mean error ≤ 1e-3 · mean|O|. On the GPU the 8-bit caches multiply on FP8
    tensor cores, whose accumulator keeps ~14 bits (DESIGN N10): logits move by ~1e-4
    relative and P̂ flips more often (seen: mean error 1.2–2.2e-3 · mean|O| on 2026-12-01,
    a tenth of what E4M3 K/V themselves change), so the mean bound there is 5e-3."""
    o, e = out.float(), expected.float()
    err = (o - e).abs()
    mean_bound = 5e-3 if out.is_cuda and fmt.dtype.v_dim_major else 1e-3
    assert err.max() <= 2**-3 * e.abs().max(), (err.max(), e.abs().max())
    assert err.mean() <= mean_bound * e.abs().mean(), (err.mean(), e.abs().mean())


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize(("page_size", "head_dim", "hadamard"), [(16, 64, False), (32, 128, True)])
def test_cache_write_bit_exact(
    dtype: str, page_size: int, head_dim: int, hadamard: bool, device: str
) -> None:
    b = make_batch([3, 1], [20, 9], dtype=dtype, page_size=page_size, head_dim=head_dim,
                   device=device)  # fmt: skip
    b.key[0, 0] *= 5000.0  # saturates NVFP4 block scales (no second level in the slot)
    b.value[1] = 0.0  # all-zero token
    expected = _written(b, hadamard)
    got = b.cache.clone()
    key_before = b.key.clone()
    kernels.write_kv_cache(got, b.key, b.value, b.slot_mapping, b.fmt, hadamard=hadamard)
    assert torch.equal(got, expected)
    assert torch.equal(b.key, key_before)  # inputs untouched


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp8", "fp8_static", "nvfp4"])
@pytest.mark.parametrize("hadamard", [False, True], ids=["plain", "hadamard"])
def test_cache_write_signed_zeros_bit_exact(dtype: str, hadamard: bool, device: str) -> None:
    """-0.0 and negatives that round to zero (DESIGN N1, the sign of zero): the cache writer
    stores the twin's bytes in every format (E4M3 negative zero 0x80 for ``fp8`` and
    ``fp8_static``, E2M1's 0x8 for ``nvfp4``), with or without K's rotation; inputs
    untouched."""
    b = make_batch([2], [6], dtype=dtype, device=device, seed=5)
    key, value = with_signed_zeros(b.key), with_signed_zeros(b.value)
    if dtype == "fp16":
        key, value = key.half(), value.half()
    scales = {"k_scale": 0.37, "v_scale": 2.5} if dtype == "fp8_static" else {}
    before = (key.clone(), value.clone())
    expected = b.cache.clone()
    ref.write_kv_cache(expected, key, value, b.slot_mapping, b.fmt, hadamard=hadamard, **scales)
    got = b.cache.clone()
    kernels.write_kv_cache(got, key, value, b.slot_mapping, b.fmt, hadamard=hadamard, **scales)
    assert torch.equal(got, expected)
    codes = region_view(expected, b.fmt).codes[1]  # V (never rotated)
    if dtype in ("fp8", "fp8_static"):
        assert negative_zero_bytes(codes) > 0  # the case is there
    elif dtype == "nvfp4":
        assert bool((unpack_e2m1(codes.contiguous()) == 8).any())
    for a, x in zip(before, (key, value), strict=True):
        assert torch.equal(a.view(torch.int16), x.view(torch.int16))


def test_prefill_q_quantizer_signed_zeros_bit_exact(device: str) -> None:
    """The FP8-cache prefill's Q quantizer (``prefill_operands``) on -0.0 and negatives that
    round to zero: its E4M3 codes and exponents are the twin's bytes (negative zero 0x80)."""
    from flamia_serve.kernels.paged.ops import prefill_offsets, prefill_operands
    from flamia_serve.numerics import Granularity, quantize_fp8

    b = make_batch([1, 9], [5, 7], dtype="fp8", device=device, seed=6)
    q = b.q.clone()
    q[1:] = with_signed_zeros(q[1:])
    cache = _written(b)
    plan = kernels.plan_paged(b.fmt, 4, 2, b.query_start_loc.cpu(), int(b.seq_lens.max()),
                              device=device, seq_lens_host=b.seq_lens.cpu())  # fmt: skip
    assert (plan.num_decode_tokens, plan.num_prefill_tokens) == (1, 9)
    offsets = prefill_offsets(plan, b.seq_lens, b.query_start_loc, 16)
    qkv = prefill_operands(q, cache, b.block_table, b.seq_lens, plan, offsets, 16)
    q8 = quantize_fp8(q[1:], None, Granularity.TOKEN)
    assert negative_zero_bytes(q8.codes) > 0
    assert torch.equal(qkv.q_codes.view(torch.uint8), q8.codes.view(torch.uint8))
    assert torch.equal(qkv.q_exp.long(), q8.exponents.long())


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4"])
def test_cache_write_skips_minus_one_and_leaves_other_bytes(dtype: str, device: str) -> None:
    b = make_batch([2], [30], dtype=dtype, spare_blocks=2, device=device)
    gen = torch.Generator().manual_seed(3)
    start = torch.randint(0, 256, b.cache.shape, generator=gen, dtype=torch.uint8).to(device)
    slots = b.slot_mapping.clone()
    slots[::3] = -1
    got = start.clone()
    kernels.write_kv_cache(got, b.key, b.value, slots, b.fmt)
    expected = start.clone()
    ref.write_kv_cache(expected, b.key, b.value, slots, b.fmt)
    assert torch.equal(got, expected)
    # exactly the bytes of the addressed slots changed; -1 slots and other pages did not
    touched = torch.zeros_like(start, dtype=torch.bool)
    marker = torch.full_like(start, 0)
    probe = marker.clone()
    ones = torch.ones_like(b.key)
    ref.write_kv_cache(probe, ones, ones, slots, b.fmt)
    touched |= probe != marker
    assert torch.equal(got[~touched], start[~touched])


def test_appending_never_changes_earlier_bytes(device: str) -> None:
    b = make_batch([0], [40], dtype="nvfp4", device=device)
    cache = PagedKVCache(b.cache.clone(), b.fmt)
    cache.write(b.key[:33], b.value[:33], b.slot_mapping[:33])
    before = cache.data.clone()
    cache.write(b.key[33:], b.value[33:], b.slot_mapping[33:])
    changed = (cache.data != before).nonzero()
    one_shot = _written(b)
    assert torch.equal(cache.data, one_shot)  # token by token == all at once
    # only slots of tokens 33.. changed: their (block, offset) pairs
    slots = b.slot_mapping[33:].long()
    page = cache.page_size
    allowed = {(int(s) // page, int(s) % page) for s in slots}
    code_bytes, split = b.fmt.code_bytes, page * b.fmt.code_bytes
    for blk, _, _, byte in changed.tolist():
        off = byte // code_bytes if byte < split else (byte - split) // b.fmt.scale_bytes
        assert (blk, off) in allowed


CASES = {
    "decode": ([1, 1, 1], [40, 0, 77]),
    "prefill": ([17, 5], [0, 33]),
    "mixed": ([1, 1, 9, 40], [50, 3, 20, 0]),
}


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("exp_mode", ["exact", "schraudolph", "mitchell"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_paged_attention_matches_reference(
    dtype: str, exp_mode: str, case: str, device: str
) -> None:
    new, cached = CASES[case]
    b = make_batch(new, cached, dtype=dtype, device=device)
    cache = _written(b)
    expected = ref.paged_attention(b.q, cache, b.fmt, b.block_table, b.seq_lens,
                                   b.query_start_loc, softmax_scale=0.125,
                                   exp_mode=exp_mode)  # fmt: skip
    out = kernels.paged_attention(b.q, cache, b.fmt, b.block_table, b.seq_lens,
                                  b.query_start_loc, exp_mode=exp_mode, num_splits=2)  # fmt: skip
    _assert_close(out, expected, b.fmt)


@pytest.mark.parametrize(
    ("dtype", "head_dim", "page_size", "heads_q", "heads_kv", "window", "hadamard"),
    [
        ("fp8", 256, 64, 2, 2, None, False),
        ("nvfp4", 128, 32, 6, 2, 24, True),
        ("bf16", 64, 16, 8, 1, 7, False),
        ("nvfp4", 64, 64, 4, 4, None, False),
    ],
)
def test_paged_attention_shapes_windows(
    dtype: str, head_dim: int, page_size: int, heads_q: int, heads_kv: int,
    window: int | None, hadamard: bool, device: str,
) -> None:  # fmt: skip
    b = make_batch([1, 13, 1], [70, 31, 5], dtype=dtype, head_dim=head_dim,
                   page_size=page_size, heads_q=heads_q, heads_kv=heads_kv,
                   device=device)  # fmt: skip
    cache = PagedKVCache(b.cache.clone(), b.fmt, hadamard=hadamard)
    cache.write(b.key, b.value, b.slot_mapping)
    kwargs = dict(softmax_scale=head_dim**-0.5, window=window)
    expected = ref.paged_attention(b.q, cache.data, b.fmt, b.block_table, b.seq_lens,
                                   b.query_start_loc, hadamard=hadamard, **kwargs)  # fmt: skip
    out = cache.attention(b.q, b.block_table, b.seq_lens, b.query_start_loc, num_splits=4,
                          **kwargs)  # fmt: skip
    _assert_close(out, expected, b.fmt)


def test_fp8_cache_equals_training_forward(device: str) -> None:
    """Serving through the FP8 cache = the training path's exact-causal MXFP8 forward."""
    b = make_batch([48], [0], dtype="fp8", device=device, heads_q=4, heads_kv=2)
    cache = _written(b)
    k, v = b.key, b.value  # this sequence's tokens, in order
    cu = torch.tensor([0, 48], dtype=torch.int32, device=device)
    train = training_attention(b.q, k, v, cu, 48, causal=True, recipe="mxfp8",
                               exact_causal=True, softmax_scale=0.125)  # fmt: skip
    prefill = kernels.paged_attention(b.q, cache, b.fmt, b.block_table, b.seq_lens,
                                      b.query_start_loc, softmax_scale=0.125)  # fmt: skip
    _assert_close(prefill, train, b.fmt)
    # decode of the last token over the 47 cached ones: the training output's last row
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=device)
    last = kernels.paged_attention(b.q[-1:], cache, b.fmt, b.block_table, b.seq_lens, qsl,
                                   softmax_scale=0.125, num_splits=3)  # fmt: skip
    _assert_close(last, train[-1:], b.fmt)


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4"])
def test_prefill_no_future_leakage(dtype: str, device: str) -> None:
    """A new token's output is bit-identical when later tokens' K/V are replaced."""
    b = make_batch([40], [20], dtype=dtype, device=device)
    cache = _written(b)
    out = kernels.paged_attention(b.q, cache, b.fmt, b.block_table, b.seq_lens,
                                  b.query_start_loc)  # fmt: skip
    key, value = b.key.clone(), b.value.clone()
    key[45:] *= 1024.0
    value[45:] = -value[45:] * 1024.0
    other = b.cache.clone()
    ref.write_kv_cache(other, key, value, b.slot_mapping, b.fmt)
    out2 = kernels.paged_attention(b.q, other, b.fmt, b.block_table, b.seq_lens,
                                   b.query_start_loc)  # fmt: skip
    # new token i sits at position 20 + i: rows for positions < 45 see no changed key
    assert torch.equal(out[:25], out2[:25])
    assert not torch.equal(out[25:], out2[25:])


def test_bad_inputs_raise(device: str) -> None:
    b = make_batch([2, 1], [5, 5], dtype="fp8", device=device)
    cache = _written(b)
    args = (b.q, cache, b.fmt, b.block_table, b.seq_lens, b.query_start_loc)

    def call(**over: object) -> None:
        names = ("q", "cache", "fmt", "block_table", "seq_lens", "query_start_loc")
        kw = dict(zip(names, args, strict=True)) | over
        kernels.paged_attention(*(kw[n] for n in names))

    with pytest.raises(TypeError, match="block_table"):
        call(block_table=b.block_table.long())
    with pytest.raises(TypeError, match="q must"):
        call(q=b.q.float())
    with pytest.raises(ValueError, match="query_start_loc"):
        call(query_start_loc=b.query_start_loc.flip(0).contiguous())
    with pytest.raises(ValueError, match="seq_lens"):
        call(seq_lens=torch.ones_like(b.seq_lens))
    with pytest.raises(ValueError, match="block ids"):
        call(block_table=b.block_table + 1000)
    with pytest.raises(ValueError, match="head dim"):
        call(q=b.q[..., :32].contiguous())
    with pytest.raises(ValueError, match="exp_mode"):
        kernels.paged_attention(*args, exp_mode="fast")
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="prefill_keys"):
            kernels.paged_attention(*args, prefill_keys=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prefill_keys=12 is less than the 13 keys"):
        kernels.paged_attention(*args, prefill_keys=12)  # no leading decode: 7 + 6 keys
    with pytest.raises(ValueError, match="slot_mapping"):
        kernels.write_kv_cache(cache, b.key, b.value, b.slot_mapping[:3], b.fmt)
    with pytest.raises(ValueError, match="kv_cache"):
        kernels.write_kv_cache(cache[..., :-1].contiguous(), b.key, b.value, b.slot_mapping,
                               b.fmt)  # fmt: skip


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "nvfp4"])
def test_approximate_exponentials_stay_close_to_exact(dtype: str) -> None:
    """N9: Schraudolph and Mitchell-P outputs have cos-sim >= 0.999 with exact exp (the
    constant part of their error cancels in the normaliser)."""
    b = make_batch([128, 1], [384, 700], heads_q=8, heads_kv=2, head_dim=128, dtype=dtype,
                   seed=3)  # fmt: skip
    cache = _written(b)
    args = (b.q, cache, b.fmt, b.block_table, b.seq_lens, b.query_start_loc)
    outs = {
        mode: ref.paged_attention(*args, softmax_scale=128**-0.5, exp_mode=mode).float().flatten()
        for mode in ("exact", "schraudolph", "mitchell")
    }
    for mode in ("schraudolph", "mitchell"):
        cos = torch.nn.functional.cosine_similarity(outs[mode], outs["exact"], dim=0)
        assert cos >= 0.999, (mode, float(cos))
        assert not torch.equal(outs[mode], outs["exact"])


def test_edge_batches(device: str) -> None:
    """An empty sequence between others, a one-token context, all-zero queries and keys,
    a window wider than the context, and an empty call."""
    b = make_batch([3, 0, 1, 1], [10, 4, 0, 20], dtype="fp8", device=device)
    b.q[-1] = 0.0
    b.key[:5] = 0.0
    cache = _written(b)
    args = (b.q, cache, b.fmt, b.block_table, b.seq_lens, b.query_start_loc)
    for window in (None, 1000, 1):
        expected = ref.paged_attention(*args, softmax_scale=0.125, window=window)
        out = kernels.paged_attention(*args, window=window, num_decodes=0)
        _assert_close(out, expected, b.fmt)
        assert torch.isfinite(out.float()).all()
    empty = kernels.paged_attention(b.q[:0], cache, b.fmt, b.block_table[:0], b.seq_lens[:0],
                                    b.query_start_loc[:1])  # fmt: skip
    assert empty.shape == (0, *b.q.shape[1:])


def poisoned_cache(b: PagedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``b``'s tokens written over a zeroed cache and over one full of 0xFF bytes (NaN in
    every format), and ``b``'s block table with every column past a sequence's pages
    pointing at a never-written spare block: (clean, poisoned, table, spare)."""
    clean = _written(b)
    poisoned = b.cache.clone().fill_(0xFF)
    ref.write_kv_cache(poisoned, b.key, b.value, b.slot_mapping, b.fmt)
    table = b.block_table.clone()
    spare = int(table.max()) + 1  # a never-written block (``make_batch`` keeps spares)
    page = b.fmt.page_size_of(b.cache)
    for s, length in enumerate(b.seq_lens.tolist()):
        table[s, -(-length // page) :] = spare
    return clean, poisoned, table, spare


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "fp8_static", "nvfp4"])
def test_unwritten_slots_and_stale_pages_are_never_read(dtype: str, device: str) -> None:
    """Slots past a sequence's length, pages before its window and spare pages hold NaN
    bytes (a reused page, an evicted one): the output equals that of a zeroed cache bit for
    bit, with and without a window and split-K (the unmasked tiles stop where written
    slots end)."""
    b = make_batch([1, 1, 5, 1], [37, 15, 27, 64], dtype=dtype, device=device)
    clean, poisoned, table, spare = poisoned_cache(b)
    args = (b.q, b.fmt, table, b.seq_lens, b.query_start_loc)
    for window, splits in ((None, 1), (None, 4), (20, 2)):
        outs = [kernels.paged_attention(args[0], c, *args[1:], window=window,
                                        num_splits=splits) for c in (clean, poisoned)]  # fmt: skip
        assert torch.isfinite(outs[1].float()).all()
        assert torch.equal(outs[0], outs[1])
    if dtype == "fp8":  # pages wholly before the window (evicted) may hold anything too
        window = 12
        first_pos = (b.seq_lens - b.query_start_loc.diff()).tolist()
        for s, pos in enumerate(first_pos):
            if pos - window + 1 >= 16:
                table[s, 0] = spare
        assert int((table[:, 0] == spare).sum()) == 3
        outs = [kernels.paged_attention(args[0], c, b.fmt, table, *args[3:], window=window)
                for c in (clean, poisoned)]  # fmt: skip
        assert torch.equal(outs[0], outs[1]) and torch.isfinite(outs[1].float()).all()


def test_write_rejects_slots_outside_the_cache(device: str) -> None:
    b = make_batch([2], [3], dtype="nvfp4", device=device)
    slots = b.slot_mapping.clone()
    slots[1] = b.cache.shape[0] * 16
    with pytest.raises(ValueError, match="slot_mapping holds slots"):
        kernels.write_kv_cache(b.cache.clone(), b.key, b.value, slots, b.fmt)


@pytest.mark.parametrize(("dtype", "exp_mode"), [("fp16", "exact"), ("fp16", "mitchell"),
                                               ("fp8_static", "exact"),
                                               ("fp8_static", "schraudolph")])  # fmt: skip
def test_fp16_and_static_fp8_formats(dtype: str, exp_mode: str, device: str) -> None:
    """FP16 cache (vLLM ``auto`` for FP16 models) and E4M3 with static per-layer scales
    (vLLM ``fp8``): writes bit-exact, attention within the reference budget. Non-1.0
    scales; K values beyond 448·k_scale saturate."""
    scales = {"k_scale": 0.37, "v_scale": 2.5} if dtype == "fp8_static" else {}
    b = make_batch([1, 1, 9, 40], [50, 3, 20, 0], dtype=dtype, device=device, seed=7)
    if dtype == "fp16":
        b.q, b.key, b.value = b.q.half(), b.key.half(), b.value.half()
    b.key[3, 1, :4] = 900.0  # > 448 * 0.37: saturates to ±448 codes
    expected_cache = b.cache.clone()
    ref.write_kv_cache(expected_cache, b.key, b.value, b.slot_mapping, b.fmt, **scales)
    cache = PagedKVCache(b.cache.clone(), b.fmt, **scales)
    cache.write(b.key, b.value, b.slot_mapping)
    assert torch.equal(cache.data, expected_cache)
    expected = ref.paged_attention(b.q, expected_cache, b.fmt, b.block_table, b.seq_lens,
                                   b.query_start_loc, softmax_scale=0.125, exp_mode=exp_mode,
                                   **scales)  # fmt: skip
    out = cache.attention(b.q, b.block_table, b.seq_lens, b.query_start_loc,
                          softmax_scale=0.125, exp_mode=exp_mode, num_splits=2)  # fmt: skip
    assert out.dtype == b.q.dtype
    _assert_close(out, expected, b.fmt)
    if dtype == "fp8_static":  # the scales matter: a unit-scale cache decodes differently
        unit = ref.paged_attention(b.q, expected_cache, b.fmt, b.block_table, b.seq_lens,
                                   b.query_start_loc, softmax_scale=0.125)  # fmt: skip
        assert (unit.float() - expected.float()).abs().max() > 0.1


@pytest.mark.parametrize(("dtype", "exp_mode"), [("fp8", "exact"), ("fp8_static", "mitchell")])
def test_keys_on_m(dtype: str, exp_mode: str, device: str) -> None:
    """The swapped-operand kernel (keys on the MMA's M side) is the same computation, for
    decodes and prefill blocks: equal to the reference, with windows, split-K and poisoned
    unwritten slots."""
    b = make_batch([1, 1, 1, 1, 21, 40], [37, 15, 130, 64, 30, 0], dtype=dtype, device=device,
                   heads_q=8)  # fmt: skip
    cache = _written(b)
    poisoned = b.cache.clone().fill_(0xFF)
    ref.write_kv_cache(poisoned, b.key, b.value, b.slot_mapping, b.fmt)
    block_n = 16 if device == "cpu" else 64
    decode = kernels.PagedConfig(16, block_n, 4, 2, keys_on_m=True)
    prefill = kernels.PagedConfig(16 if device == "cpu" else 64, block_n, 4, 2, keys_on_m=True)
    swapped = dict(decode_config=decode, prefill_config=prefill, exp_mode=exp_mode)
    args = (b.q, cache, b.fmt, b.block_table, b.seq_lens, b.query_start_loc)
    for window, splits in ((None, 4), (20, 2), (3, 1)):
        expected = ref.paged_attention(*args, softmax_scale=0.125, window=window,
                                       exp_mode=exp_mode)  # fmt: skip
        out = kernels.paged_attention(*args, window=window, num_splits=splits, **swapped)
        _assert_close(out, expected, b.fmt)
        again = kernels.paged_attention(b.q, poisoned, *args[2:], window=window,
                                        num_splits=splits, **swapped)  # fmt: skip
        assert torch.equal(out, again)


def test_keys_on_m_needs_an_8bit_cache() -> None:
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    swapped = kernels.PagedConfig(16, 64, keys_on_m=True)
    for which in ("decode_config", "prefill_config"):
        with pytest.raises(ValueError, match="keys_on_m needs an 8-bit cache"):
            kernels.plan_paged(KVPageFormat("nvfp4", 64), 8, 2, qsl, 100, device="cpu",
                               **{which: swapped})  # fmt: skip
    plan = kernels.plan_paged(KVPageFormat("fp8", 64), 8, 2, qsl, 100, device="cpu",
                              decode_config=swapped, prefill_config=swapped)  # fmt: skip
    assert plan.decode.keys_on_m and plan.prefill.keys_on_m


def test_plan_splits_mixed_batches() -> None:
    """Leading sequences with <= 1 new token are decodes (a 0-token padding row too); the
    first longer one starts the prefill part; grids and partial rows follow."""
    f = KVPageFormat("nvfp4", 64)

    def plan(qsl: list[int], **kw: object) -> kernels.PagedPlan:
        return kernels.plan_paged(f, 8, 2, torch.tensor(qsl, dtype=torch.int32), 4000,
                                  device="cpu", **kw)  # type: ignore[arg-type]  # fmt: skip

    p = plan([0, 1, 2, 2, 3, 12, 52, 53])
    assert (p.num_seqs, p.num_decodes, p.num_decode_tokens, p.num_tokens) == (7, 4, 3, 53)
    block_q = p.prefill.block_m // p.group_p2
    assert p.prefill_programs == -(-(53 - 3) // block_q) + 3
    assert p.num_splits > 1 and p.workspace_rows == p.num_splits * 3
    decodes = plan([0, 1, 2, 3])
    assert (decodes.num_decodes, decodes.prefill_programs) == (3, 0)
    prefills = plan([0, 5, 6, 7])  # a prefill first: no decodes at all
    assert (prefills.num_decodes, prefills.num_decode_tokens) == (0, 0)
    assert plan([0, 1, 2, 3], max_decodes=1).num_decodes == 1
    assert plan([0, 1, 2], num_splits=1).workspace_rows == 0
    padded = plan([0, 1, 2, 9], num_tokens=16)  # rows past the last sequence are padding
    assert padded.num_tokens == 16
    assert plan([0, 1], num_splits=3).workspace_rows == 3  # any count: splits of whole tiles
    for bad in (-1, 65):
        with pytest.raises(ValueError, match="num_splits"):
            plan([0, 1], num_splits=bad)
    with pytest.raises(ValueError, match="multiple"):
        kernels.plan_paged(f, 6, 4, torch.tensor([0, 1]), 10, device="cpu")


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_planned_fast_path_equals_validating_path(dtype: str, device: str) -> None:
    """One plan + a reused workspace reproduce the validating launcher bit for bit; padded
    rows (slot −1, past the last sequence) are neither written to the cache nor attended."""
    b = make_batch([1, 1, 7, 20], [40, 9, 30, 0], dtype=dtype, device=device, seed=11)
    pad = 5
    key = torch.cat([b.key, torch.randn_like(b.key[:pad])])
    value = torch.cat([b.value, torch.randn_like(b.value[:pad])])
    slots = torch.cat([b.slot_mapping, torch.full((pad,), -1, device=device,
                                                  dtype=b.slot_mapping.dtype)])  # fmt: skip
    cache = b.cache.clone()
    kernels.run_write_kv_cache(cache, key, value, slots, b.fmt, key.shape[0])
    assert torch.equal(cache, _written(b))
    expected = kernels.paged_attention(b.q, cache, b.fmt, b.block_table, b.seq_lens,
                                       b.query_start_loc, num_splits=4)  # fmt: skip
    total = b.q.shape[0]
    q = torch.cat([b.q, torch.randn_like(b.q[:pad])])
    out = torch.full_like(q, 7.0)
    plan = kernels.plan_paged(b.fmt, q.shape[1], b.cache.shape[2], b.query_start_loc.cpu(),
                              int(b.seq_lens.max()), num_tokens=total, device=device,
                              num_splits=4)  # fmt: skip
    ws = kernels.PagedWorkspace.allocate(plan.workspace_rows, q.shape[1], 64, device)
    from flamia_serve.kernels.paged.ops import LAUNCHES

    before = LAUNCHES.copy()
    for _ in range(2):  # the same plan and workspace serve every layer
        kernels.run_paged_attention(q, cache, b.block_table, b.seq_lens, b.query_start_loc,
                                    plan, out, qk_scale=64**-0.5 * math.log2(math.e),
                                    workspace=ws)  # fmt: skip
    assert torch.equal(out[:total], expected)
    assert (out[total:] == 7.0).all()
    # each call counted once per part, under the kernel that served it (Triton on the CPU)
    counted = LAUNCHES - before
    if device == "cpu":
        assert counted == {"decode:triton": 2, "prefill:triton": 2}
    else:
        assert sum(counted.values()) == 4 and set(counted) <= {
            "decode:triton", "decode:cute", "prefill:triton", "prefill:cute"}
    # the validating entry point without host reads (counts given) plans the same launch
    quiet = kernels.paged_attention(b.q, cache, b.fmt, b.block_table, b.seq_lens,
                                    b.query_start_loc, num_splits=4, validate=False,
                                    num_decodes=2, max_seq_len=int(b.seq_lens.max()))  # fmt: skip
    assert torch.equal(quiet, expected)


def test_cache_allocate_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="page_size"):
        PagedKVCache.allocate(4, 0, 2, 64, "fp8", device="cpu")
    with pytest.raises(ValueError, match="kv cache dtype"):
        PagedKVCache.allocate(4, 16, 2, 64, "int4", device="cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="static fp8 scale"):
        PagedKVCache.allocate(4, 16, 2, 64, "fp8_static", device="cpu", k_scale=0.0).write(
            torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), torch.zeros(1, dtype=torch.long))
    cache = PagedKVCache.allocate(4, 32, 2, 64, "nvfp4", device="cpu")
    assert cache.page_size == 32 and cache.heads_kv == 2
    assert cache.data.shape == (4, 2, 2, 32 * (32 + 4))


def test_cute_decode_plan_and_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the CuTe decodes would run (an sm_90 GPU with cutlass-dsl, faked here), plans
    of quantized caches pick them with their own split-K, BF16 caches and large GQA groups
    keep the Triton kernel, and calls the CuTe kernels do not serve (a sliding window,
    approximate exponentials) run the Triton kernel without trying them; a CuTe decode that
    fails to import or compile (a stand-in that raises) warns once, and the Triton kernel
    serves that call and every later one: the reference's output throughout."""
    from flamia_serve.kernels.paged import ops

    calls = []

    def failing(*args: object, **kwargs: object) -> None:
        calls.append(kwargs["fmt"])
        raise RuntimeError("stand-in: no CuTe here")

    stand_in = types.ModuleType("cute_decode_sm90")
    stand_in.paged_decode_sm90 = failing  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flamia_serve.kernels.paged.cute_decode_sm90", stand_in)
    monkeypatch.setattr(ops, "cute_dsl_available", lambda device: True)
    monkeypatch.setattr(ops, "CUTE_FAILURES", {})
    dev = torch.device("cpu")
    qsl64 = torch.arange(65, dtype=torch.int32)
    for dtype, splits in (("nvfp4", 1), ("fp8", 1), ("fp8_static", 1), ("bf16", 1)):
        p = kernels.plan_paged(KVPageFormat(dtype, 128), 32, 8, qsl64, 8192, device=dev)
        assert p.decode.kernel == ("triton" if dtype == "bf16" else "cute"), dtype
        assert p.num_splits == splits, (dtype, p.num_splits)
        if dtype != "bf16":  # 512 pairs: more than a wave of eight-warp CTAs
            assert p.decode.num_warps == 4, (dtype, p.decode)
    qsl16 = torch.arange(17, dtype=torch.int32)  # 16 decodes x 8 heads: one wave of 132 SMs
    nvfp4 = kernels.plan_paged(KVPageFormat("nvfp4", 128), 32, 8, qsl16, 8192, device=dev)
    assert (nvfp4.decode.num_warps, nvfp4.num_splits) == (8, 2)  # 2 CTAs of 8 warps per SM
    fp8 = kernels.plan_paged(KVPageFormat("fp8", 128), 32, 8, qsl16, 8192, device=dev)
    assert (fp8.decode.num_warps, fp8.num_splits) == (8, 1)  # 1 CTA of 8 warps per SM
    # 17 FP8 decodes: 136 pairs > 132 SMs, back to four warps and two CTAs per SM
    qsl17 = torch.arange(18, dtype=torch.int32)
    fp8 = kernels.plan_paged(KVPageFormat("fp8", 128), 32, 8, qsl17, 8192, device=dev)
    assert (fp8.decode.num_warps, fp8.num_splits) == (4, 1)
    assert ops.cute_decode_splits(KVPageFormat("nvfp4", 128), 17 * 8, 8192, dev, 8) == 1
    # the warps of a caller's CuTe config are checked, named
    with pytest.raises(ValueError, match="num_warps"):
        kernels.plan_paged(KVPageFormat("fp8", 128), 32, 8, qsl16, 8192, device=dev,
                           decode_config=ops.PagedConfig(16, 128, 16, kernel="cute"))  # fmt: skip
    # splits fill a wave of CTAs, each at least as long as its occupancy level asks
    fp8_fmt, nvfp4_fmt = KVPageFormat("fp8", 128), KVPageFormat("nvfp4", 128)
    assert ops.cute_decode_splits(fp8_fmt, 8, 1000, dev) == 2  # 512 keys (4 warps)
    assert ops.cute_decode_splits(fp8_fmt, 8, 1024, dev, 8) == 4  # 256 keys (8 warps)
    assert ops.cute_decode_splits(fp8_fmt, 8, 10**6, dev, 8) == 16  # 132 SMs // 8 pairs
    assert ops.cute_decode_splits(nvfp4_fmt, 8, 10**6, dev) == 49  # 3 · 132 // 8
    assert ops.cute_decode_splits(nvfp4_fmt, 8, 1024, dev, 8) == 4  # one CTA per SM
    assert ops.cute_decode_splits(nvfp4_fmt, 8, 10**6, dev, 8) == 33  # two CTAs per SM
    assert ops.cute_decode_splits(nvfp4_fmt, 128, 8192, dev, 8) == 2  # 4096 keys >= 2048
    assert ops.cute_decode_splits(nvfp4_fmt, 128, 1024, dev, 8) == 1
    assert ops.cute_decode_splits(nvfp4_fmt, 0, 1000, dev) == 1
    triton_only = kernels.plan_paged(KVPageFormat("fp8", 128), 32, 2, qsl16, 8192, device=dev)
    assert triton_only.decode.kernel == "triton"  # FP8 with a GQA group of 16
    assert kernels.plan_paged(KVPageFormat("nvfp4", 256), 8, 2, qsl16, 100,
                              device=dev).decode.kernel == "triton"  # fmt: skip
    rows = ops.max_workspace_rows(nvfp4_fmt, 32, 8, 64, 8192, dev)
    configs = {n: ops._default_decode_config(nvfp4_fmt, 32, 8, n, dev) for n in range(1, 65)}
    assert {c.num_warps for c in configs.values()} == {4, 8}  # both kinds of CTA in the range
    splits = {n: ops._splits_for(nvfp4_fmt, 8, n, 8192, c, dev) for n, c in configs.items()}
    assert rows == max(s * n for n, s in splits.items() if s > 1)  # one split: no partials

    b = make_batch([1, 1, 1], [40, 17, 3], heads_q=4, heads_kv=2, dtype="nvfp4")
    cache = _written(b)
    args = (b.q, cache, b.fmt, b.block_table, b.seq_lens, b.query_start_loc)
    assert kernels.plan_paged(b.fmt, 4, 2, b.query_start_loc, 41, device=dev).decode.kernel == (
        "cute")  # fmt: skip
    for kw in ({"window": 8}, {"exp_mode": "mitchell"}, {}, {}):
        if kw:
            out = kernels.paged_attention(*args, **kw)
        elif not calls:
            with pytest.warns(RuntimeWarning, match="CuTe decode failed.*stand-in"):
                out = kernels.paged_attention(*args)
        else:
            out = kernels.paged_attention(*args)  # no second attempt, no second warning
        _assert_close(out, ref.paged_attention(*args, softmax_scale=64**-0.5, **kw), b.fmt)
    assert calls == [KVCacheFormat.NVFP4]
    assert ops.CUTE_FAILURES == {"decode": "RuntimeError: stand-in: no CuTe here"}


@pytest.mark.parametrize(("page_size", "align"), [(16, 128), (32, 16)])
def test_prefill_operands_layout(page_size: int, align: int) -> None:
    """The FP8-cache prefill's operands for the training forward (bit-exact on the CPU
    interpreter): cache codes copied per key (K token-major, V̂ᵀ in the column layout's
    permuted columns), factors 2^eK, eV, 2^-eV from the cache's exponents, zeros over each
    sequence's padding up to ``align``, Q per token as the reference quantizes it; the
    decodes before the prefills are left out."""
    from flamia_serve.kernels.paged.ops import prefill_offsets, prefill_operands
    from flamia_serve.numerics import Granularity, quantize_fp8
    from flamia_serve.numerics.kv_pages import region_view
    from flamia_serve.numerics.operands import v_t_position

    b = make_batch([1, 1, 9, 1, 40], [30, 7, 21, 0, 100], dtype="fp8", page_size=page_size,
                   seed=page_size)  # fmt: skip
    cache = _written(b)
    plan = kernels.plan_paged(b.fmt, 4, 2, b.query_start_loc, int(b.seq_lens.max()),
                              device="cpu", seq_lens_host=b.seq_lens)  # fmt: skip
    assert (plan.num_decodes, plan.num_decode_tokens, plan.prefill_keys) == (2, 2, 30 + 1 + 140)
    offsets = prefill_offsets(plan, b.seq_lens, b.query_start_loc, align)
    qkv = prefill_operands(b.q, cache, b.block_table, b.seq_lens, plan, offsets, align)
    assert offsets[:2].tolist() == [[0, 9, 10, 50], [0, 30, 31, 171]]
    assert torch.equal(qkv.cu_seqlens, offsets[1])
    pads = [-(-n // align) * align for n in (30, 1, 140)]
    assert qkv.doc_v_t_start.tolist() == [0, pads[0], pads[0] + pads[1]]
    codes, _ = region_view(cache, b.fmt)
    for s, length in zip(range(2, 5), (30, 1, 140), strict=True):
        pos = torch.arange(length)
        blk, off = b.block_table[s].long()[pos // page_size], pos % page_size
        k0 = int(offsets[1, s - 2])
        assert torch.equal(qkv.k_codes[k0 : k0 + length].view(torch.uint8), codes[0][blk, :, off])
        start = int(qkv.doc_v_t_start[s - 2])
        cols = start + v_t_position(pos)
        v_t = qkv.v_t.view(torch.uint8)
        assert torch.equal(v_t[:, :, cols], codes[1][blk, :, off].permute(1, 2, 0))
        k, v = ref.gather_kv(cache, b.fmt, b.block_table[s], length)
        factors = qkv.kv_factors[:, :, cols]  # [Hkv, 3, L]
        assert torch.equal(factors[:, 0], torch.exp2(k.exponents.t().double()).float())
        assert torch.equal(factors[:, 1], v.exponents.t().float())
        assert torch.equal(factors[:, 2], torch.exp2(-v.exponents.t().double()).float())
        pad = torch.arange(start + length, start + pads[s - 2])
        pad = pad[v_t_position(pad - start) >= length]  # padding columns (permuted groups)
        assert not v_t[:, :, pad].any() and not qkv.kv_factors[:, :, pad].any()
    q8 = quantize_fp8(b.q[2:].float(), None, Granularity.TOKEN)
    assert torch.equal(qkv.q_codes.view(torch.uint8), q8.codes.view(torch.uint8))
    assert torch.equal(qkv.q_exp.long(), q8.exponents.long())
    # other program shapes of the layout kernel (default: 32 keys x one head)
    used = torch.cat([start + torch.arange(pad) for start, pad in
                      zip(qkv.doc_v_t_start.tolist(), pads, strict=True)])  # fmt: skip
    for chunk, heads in ((16, 1), (32, 2), (64, 1)):
        one = prefill_operands(b.q, cache, b.block_table, b.seq_lens, plan, offsets, align,
                               chunk=chunk, heads=heads)  # fmt: skip
        assert torch.equal(one.k_codes.view(torch.uint8)[:171],
                           qkv.k_codes.view(torch.uint8)[:171])  # fmt: skip
        assert torch.equal(one.v_t[:, :, used].view(torch.uint8), v_t[:, :, used])
        assert torch.equal(one.kv_factors[:, :, used], qkv.kv_factors[:, :, used])
    for bad in ({"chunk": 24}, {"chunk": 0}, {"heads": 3}, {"heads": 4}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            prefill_operands(b.q, cache, b.block_table, b.seq_lens, plan, offsets, align,
                             **bad)  # fmt: skip


def test_prefill_operands_leave_q_to_the_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """``defer_q``: one launch (the K/V layout, the same bytes), Q's prefill rows handed over
    as given (a view, not a copy) for the CuTe forward to quantize; every other reader
    refuses the Q codes. ``q_quantized_in_kernel`` takes the rows the kernel's TMA can load
    (BF16/FP16, d <= 128, 16-byte strides and first row) and nothing else."""
    from flamia_serve.kernels.attn_fwd.ops import CUTE_CONFIG
    from flamia_serve.kernels.paged import ops
    from flamia_serve.kernels.paged.ops import prefill_offsets, prefill_operands

    b = make_batch([1, 9, 40], [30, 21, 100], dtype="fp8", seed=4)
    cache = _written(b)
    plan = kernels.plan_paged(b.fmt, 4, 2, b.query_start_loc, int(b.seq_lens.max()),
                              device="cpu", seq_lens_host=b.seq_lens)  # fmt: skip
    offsets = prefill_offsets(plan, b.seq_lens, b.query_start_loc, 16)
    args = (cache, b.block_table, b.seq_lens, plan, offsets, 16)
    full = prefill_operands(b.q, *args)
    part = prefill_operands(b.q, *args, defer_q=True)
    assert full.q_input is None and part.q_input.shape == (49, 4, 64)
    assert part.q_input.data_ptr() == b.q[1].data_ptr()  # rows from the first prefill on
    keys = plan.prefill_keys
    u8 = torch.uint8
    assert torch.equal(part.k_codes[:keys].view(u8), full.k_codes[:keys].view(u8))
    used = torch.cat([start + torch.arange(-(-n // 16) * 16) for start, n in
                      zip(full.doc_v_t_start.tolist(), b.seq_lens[1:].tolist(), strict=True)])
    assert torch.equal(part.v_t[:, :, used].view(u8), full.v_t[:, :, used].view(u8))
    assert torch.equal(part.kv_factors[:, :, used], full.kv_factors[:, :, used])
    with pytest.raises(ValueError, match="defer_q"):
        part.score_operands("the Triton prefill")
    q = b.q
    fused = torch.zeros(q.shape[0], 8, 64, dtype=torch.bfloat16)[:, :4]  # a QKV buffer's Q
    shifted = torch.zeros(q.numel() + 1, dtype=torch.bfloat16)[1:].view(q.shape)
    odd_rows = torch.zeros(q.shape[0], 4 * 64 + 4, dtype=torch.bfloat16)[:, :256].view(-1, 4, 64)
    wide = torch.zeros(q.shape[0], 2, 256, dtype=torch.bfloat16)
    cfg = CUTE_CONFIG
    for x, expected in ((q, True), (q.half(), True), (fused, True), (q.float(), False),
                        (shifted, False), (odd_rows, False), (wide, False)):  # fmt: skip
        assert ops.q_quantized_in_kernel(x, 1, cfg) is expected, (x.dtype, x.shape, x.stride())
    assert not ops.q_quantized_in_kernel(q, 1, dataclasses.replace(cfg, quantize_q=False))
    monkeypatch.setattr(ops, "CUTE_PREFILL_DEFERS_Q", False)
    assert not ops.q_quantized_in_kernel(q, 1, cfg)


def test_cute_prefill_plan_and_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fp8 cache's prefills go to the training forward's CuTe kernel where it runs (and
    the host knows the prefill key count); its launch gets the operands of the prefill rows
    only; an import or compile error warns once and the Triton prefill answers."""
    from flamia_serve.kernels.paged import ops

    calls: list[dict] = []

    def failing(qkv, cu_seqlens, work, out, *args: object, **kwargs: object) -> None:
        calls.append({"rows": out.shape[0], "cu_q": cu_seqlens.tolist(),
                      "cu_k": kwargs["cu_seqlens_k"].tolist(), "causal": kwargs["causal"]})
        raise RuntimeError("stand-in: no CuTe here")  # fmt: skip

    stand_in = types.ModuleType("cute_sm90")
    stand_in.attn_fwd_sm90 = failing  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flamia_serve.kernels.attn_fwd.cute_sm90", stand_in)
    monkeypatch.setattr(ops, "cute_available", lambda device: True)
    monkeypatch.setattr(ops, "cute_dsl_available", lambda device: False)  # Triton decodes
    monkeypatch.setattr(ops, "CUTE_FAILURES", {})
    for dtype, kernel in (("fp8", "cute"), ("fp8_static", "triton"), ("nvfp4", "triton")):
        plan = kernels.plan_paged(KVPageFormat(dtype, 64), 4, 2, torch.tensor([0, 1, 9]), 50,
                                  device="cpu")  # fmt: skip
        assert plan.prefill.kernel == kernel, dtype
    b = make_batch([1, 9, 40], [30, 21, 100], dtype="fp8")
    cache = _written(b)
    args = (b.q, cache, b.fmt, b.block_table, b.seq_lens, b.query_start_loc)
    expected = ref.paged_attention(*args, softmax_scale=0.125)
    # no host key count (the graph-safe path), or Schraudolph exponentials: Triton, no attempt
    out = kernels.paged_attention(*args, validate=False, num_decodes=1, max_seq_len=140)
    _assert_close(out, expected, b.fmt)
    schraudolph = kernels.paged_attention(*args, exp_mode="schraudolph")
    _assert_close(schraudolph, ref.paged_attention(*args, softmax_scale=0.125,
                                                   exp_mode="schraudolph"), b.fmt)  # fmt: skip
    assert not calls
    with pytest.warns(RuntimeWarning, match="CuTe prefill failed.*stand-in"):
        out = kernels.paged_attention(*args)
    _assert_close(out, expected, b.fmt)
    out = kernels.paged_attention(*args)  # no second attempt, no second warning
    _assert_close(out, expected, b.fmt)
    assert calls == [{"rows": 49, "cu_q": [0, 9, 49], "cu_k": [0, 30, 170], "causal": True}]
    assert ops.CUTE_FAILURES == {"prefill": "RuntimeError: stand-in: no CuTe here"}
    plan = kernels.plan_paged(b.fmt, 4, 2, b.query_start_loc, 140, device="cpu",
                              seq_lens_host=b.seq_lens)  # fmt: skip
    assert plan.prefill.kernel == "cute" and plan.prefill_keys == 170
    # no schedule is built for a prefill that will not run
    assert kernels.plan_prefill_schedule(plan, b.seq_lens, b.query_start_loc) is None
    monkeypatch.setattr(ops, "CUTE_FAILURES", {})
    assert kernels.plan_prefill_schedule(plan, b.seq_lens, b.query_start_loc) is not None


def test_a_workspace_too_small_for_the_plan_is_not_used(device: str) -> None:
    """``PagedWorkspace.fits`` checked only the ``(M, l)`` rows: a workspace allocated for a
    smaller head dim (or fewer heads) was taken, and the split-K partials of O were written
    past its end. Now it is replaced, and the output equals the validating path's."""
    b = make_batch([1, 1], [20, 30], heads_q=4, heads_kv=2, head_dim=128, device=device)
    cache = _written(b)
    plan = kernels.plan_paged(b.fmt, 4, 2, b.query_start_loc.cpu(), 31, device=device,
                              num_splits=4)  # fmt: skip
    assert plan.workspace_rows == 8
    small = kernels.PagedWorkspace.allocate(plan.workspace_rows, 4, 64, device)  # d 64 < 128
    assert not small.fits(plan)
    assert not kernels.PagedWorkspace.allocate(plan.workspace_rows, 2, 128, device).fits(plan)
    assert kernels.PagedWorkspace.allocate(plan.workspace_rows, 4, 128, device).fits(plan)
    small.part_o.fill_(0.0)
    out = torch.empty_like(b.q)
    kernels.run_paged_attention(b.q, cache, b.block_table, b.seq_lens, b.query_start_loc, plan,
                                out, qk_scale=128**-0.5 * math.log2(math.e),
                                workspace=small)  # fmt: skip
    expected = kernels.paged_attention(b.q, cache, b.fmt, b.block_table, b.seq_lens,
                                       b.query_start_loc, num_splits=4)  # fmt: skip
    assert torch.equal(out, expected)
    assert not small.part_o.any()  # the too-small workspace was not written


def test_reference_writer_takes_a_padded_slot_mapping(device: str) -> None:
    """The kernel writer takes a ``slot_mapping`` longer than ``key`` (vLLM's padded one: the
    first N entries count); the twin raised an IndexError on it instead of writing the same
    bytes."""
    b = make_batch([3], [4], dtype="nvfp4", device=device)
    slots = torch.cat([b.slot_mapping, b.slot_mapping[:2]])  # two extra entries, never used
    got, expected = b.cache.clone(), b.cache.clone()
    kernels.write_kv_cache(got, b.key, b.value, slots, b.fmt)
    ref.write_kv_cache(expected, b.key, b.value, slots, b.fmt)
    assert torch.equal(got, expected) and torch.equal(got, _written(b))


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_non_finite_values_never_cross_a_sequence(dtype: str, device: str) -> None:
    """DESIGN "Non-finite inputs", serving: NaN / Inf in one sequence's K, V and Q (a decode
    and a prefill, split-K) leave every other sequence's output bit-identical."""
    b = make_batch([1, 1, 3, 4], [17, 9, 5, 12], dtype=dtype, device=device)
    qsl = b.query_start_loc.tolist()
    key, value, q = b.key.clone(), b.value.clone(), b.q.clone()
    for victim, start, bad in ((1, 18, float("nan")), (2, 28, float("inf"))):  # cached rows
        key[start + 2, 0, 5] = bad
        value[start + 3, 1, 7] = -bad
        q[qsl[victim], 1, 1] = bad
    keep = torch.ones(q.shape[0], dtype=torch.bool, device=device)
    keep[qsl[1] : qsl[3]] = False
    outs = []
    for k, v, qq in ((b.key, b.value, b.q), (key, value, q)):
        cache = b.cache.clone()
        kernels.write_kv_cache(cache, k, v, b.slot_mapping, b.fmt)
        outs.append(kernels.paged_attention(qq, cache, b.fmt, b.block_table, b.seq_lens,
                                            b.query_start_loc, num_splits=2))  # fmt: skip
    assert torch.equal(outs[0][keep], outs[1][keep])
