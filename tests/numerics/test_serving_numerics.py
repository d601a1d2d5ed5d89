"""Serving numerics: inference exponentials (N9) and KV page formats (N10)."""

from __future__ import annotations

import pytest
import torch

from flamia_serve.numerics import P_HAT_EXP
from flamia_serve.numerics.exp2 import (
    P_BF16,
    P_E4M3,
    mitchell_codes,
    mitchell_value,
    probabilities,
    schraudolph_exp2,
)
from flamia_serve.numerics.kv_pages import (
    KVCacheFormat,
    KVPageFormat,
    decode_slots,
    encode_slots,
    format_for_vllm,
    region_view,
)


def test_mitchell_exact_at_integers_and_linear_mantissa() -> None:
    t = torch.tensor([0.0, -1.0, -5.0, -14.0, -0.5, -0.25, float("-inf"), -14.2, -30.0])
    value = mitchell_value(mitchell_codes(t, P_E4M3), P_E4M3) * 2.0**-P_HAT_EXP
    # integers exact; the fraction becomes the mantissa linearly: 2^-0.5 -> 0.75, 2^-.25 -> .875
    expected = torch.tensor([1.0, 0.5, 2.0**-5, 2.0**-14, 0.75, 0.875, 0.0, 0.0, 0.0])
    assert torch.equal(value, expected)
    # the code's value is what torch decodes from the same byte
    codes = mitchell_codes(torch.linspace(-13.9, 0, 500), P_E4M3)
    decoded = codes.to(torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.equal(mitchell_value(codes, P_E4M3), decoded)
    bf = mitchell_codes(torch.linspace(-100, 0, 500), P_BF16)
    assert torch.equal(mitchell_value(bf, P_BF16),
                       bf.to(torch.int16).view(torch.bfloat16).float())  # fmt: skip


def test_schraudolph_error_bound() -> None:
    t = torch.linspace(-60, 0, 100_001)
    rel = schraudolph_exp2(t) / torch.exp2(t) - 1
    assert rel.abs().max() < 0.052  # σ balances (1+f−σ)/2^f around 1
    assert schraudolph_exp2(torch.tensor([float("-inf"), -200.0])).eq(0).all()


@pytest.mark.parametrize("mode", ["exact", "schraudolph", "mitchell"])
def test_probabilities_properties(mode: str) -> None:
    t = -torch.rand(4000) * 20
    t[0] = 0.0
    p_hat, p = probabilities(t, mode, P_E4M3)
    assert p_hat.max() <= 448 and p.max() <= 1.0
    assert torch.equal(p_hat, p_hat.to(torch.float8_e4m3fn).float())  # valid E4M3 values
    exact, _ = probabilities(t, "exact", P_E4M3)
    agree = (p_hat == exact).float().mean()
    assert agree == 1.0 if mode == "exact" else 0.2 < agree < 1.0


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp8", "fp8_static", "nvfp4"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_page_formats_roundtrip_and_budgets(dtype: str, head_dim: int) -> None:
    fmt = KVPageFormat(dtype, head_dim)
    assert fmt.dtype is KVCacheFormat(dtype) and fmt.dtype == dtype
    budget = {"bf16": 2 * head_dim, "fp16": 2 * head_dim, "fp8": head_dim + 4,
              "fp8_static": head_dim, "nvfp4": head_dim // 2 + head_dim // 16}  # fmt: skip
    assert fmt.slot_bytes == budget[dtype]
    assert fmt.cache_shape(10, 16, 8) == (10, 2, 8, 16 * budget[dtype])
    static = 0.05  # fp8_static: x / 0.05 stays below 448
    x = torch.randn(7, 3, head_dim) * 3
    codes, scales = encode_slots(x, fmt, static)
    assert codes.shape[-1] + scales.shape[-1] == fmt.slot_bytes
    dec = decode_slots(codes, scales, fmt)
    values = dec.values
    if dec.exponents is not None:
        values = values * torch.exp2(dec.exponents.float())[..., None]
    if fmt.dtype is KVCacheFormat.FP8_STATIC:
        values = values * static
    tol = {"bf16": 2**-8, "fp16": 2**-11, "fp8": 2**-4, "fp8_static": 2**-4, "nvfp4": 0.35}[dtype]
    assert ((values - x).abs() <= tol * x.abs().amax(-1, keepdim=True)).all()
    # a token's bytes depend on that token only
    c2, s2 = encode_slots(torch.cat([x[:1], torch.randn(2, 3, head_dim) * 100]), fmt, static)
    assert torch.equal(c2[0], codes[0]) and torch.equal(s2[0], scales[0])


@pytest.mark.parametrize("dtype", list(KVCacheFormat))
def test_page_strides_address_the_region_view(dtype: KVCacheFormat) -> None:
    """The kernels' element strides (``KVPageFormat.strides``) and the references' byte view
    (``region_view``) name the same bytes for every slot: one layout definition. The 8-bit
    formats store V dim-major within a page."""
    fmt, page, blocks, heads = KVPageFormat(dtype, 64), 16, 3, 2
    cache = torch.arange(fmt.region_bytes(page) * blocks * 2 * heads, dtype=torch.int64)
    cache = (cache % 251).to(torch.uint8).view(fmt.cache_shape(blocks, page, heads))
    st = fmt.strides(page)
    codes, scales = cache.view(st.code_dtype).flatten(), cache.view(st.scale_dtype).flatten()
    by_bytes_codes, by_bytes_scales = region_view(cache, fmt)
    if dtype in (KVCacheFormat.FP8, KVCacheFormat.FP8_STATIC):  # a page of V̂ᵀ
        assert (st.v_code_row, st.v_code_col) == (1, page)
    else:
        assert (st.v_code_row, st.v_code_col) == (st.code_row, 1)
    for blk, half, head, off in [(0, 0, 0, 0), (2, 1, 1, 15), (1, 0, 1, 7), (1, 1, 0, 3)]:
        region = (blk * 2 + half) * heads + head
        row, col = (st.code_row, 1) if half == 0 else (st.v_code_row, st.v_code_col)
        c0 = region * st.region_codes + off * row
        n_codes = fmt.code_bytes // codes.element_size()
        got = codes[c0 : c0 + n_codes * col : col].contiguous().view(torch.uint8)
        assert torch.equal(got, by_bytes_codes[half][blk, head, off])
        s0 = region * st.region_scales + st.scale_base + off * st.scale_row
        n_scales = fmt.scale_bytes // scales.element_size()
        got = scales[s0 : s0 + n_scales].contiguous().view(torch.uint8)
        assert torch.equal(got, by_bytes_scales[blk, half, head, off])


def test_vllm_cache_dtype_mapping() -> None:
    bf, fp = torch.bfloat16, torch.float16
    assert format_for_vllm("auto", bf) is KVCacheFormat.BF16
    assert format_for_vllm("auto", fp) is KVCacheFormat.FP16
    assert format_for_vllm("fp8_per_token_head", bf) is KVCacheFormat.FP8
    assert format_for_vllm("nvfp4", fp) is KVCacheFormat.NVFP4
    assert format_for_vllm("fp8", bf) is format_for_vllm("fp8_e4m3", bf) is KVCacheFormat.FP8_STATIC
    with pytest.raises(ValueError, match=r"'fp8_e5m2' is not served by FLAMIA; supported: auto"):
        format_for_vllm("fp8_e5m2", bf)
    with pytest.raises(ValueError, match="bfloat16 or float16 model"):
        format_for_vllm("auto", torch.float32)


def test_page_format_errors() -> None:
    with pytest.raises(ValueError, match="kv cache dtype"):
        KVPageFormat("int8", 128)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="head_dim"):
        KVPageFormat("fp8", 72)
    with pytest.raises(ValueError, match="kv_cache"):
        KVPageFormat("fp8", 128).page_size_of(torch.zeros(2, 2, 8, 100, dtype=torch.uint8))
