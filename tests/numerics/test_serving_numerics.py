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
from flamia_serve.numerics.kv_pages import KVPageFormat, decode_slots, encode_slots


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


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_page_formats_roundtrip_and_budgets(dtype: str, head_dim: int) -> None:
    fmt = KVPageFormat(dtype, head_dim)
    budget = {"bf16": 2 * head_dim, "fp8": head_dim + 4, "nvfp4": head_dim // 2 + head_dim // 16}
    assert fmt.slot_bytes == budget[dtype]
    assert fmt.cache_shape(10, 16, 8) == (10, 2, 8, 16 * budget[dtype])
    x = torch.randn(7, 3, head_dim) * 3
    codes, scales = encode_slots(x, fmt)
    assert codes.shape[-1] + scales.shape[-1] == fmt.slot_bytes
    dec = decode_slots(codes, scales, fmt)
    values = dec.values
    if dec.exponents is not None:
        values = values * torch.exp2(dec.exponents.float())[..., None]
    tol = {"bf16": 2**-8, "fp8": 2**-4, "nvfp4": 0.35}[dtype]
    assert ((values - x).abs() <= tol * x.abs().amax(-1, keepdim=True)).all()
    # a token's bytes depend on that token only
    c2, s2 = encode_slots(torch.cat([x[:1], torch.randn(2, 3, head_dim) * 100]), fmt)
    assert torch.equal(c2[0], codes[0]) and torch.equal(s2[0], scales[0])


def test_page_format_errors() -> None:
    with pytest.raises(ValueError, match="kv cache dtype"):
        KVPageFormat("int8", 128)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="head_dim"):
        KVPageFormat("fp8", 72)
    with pytest.raises(ValueError, match="kv_cache"):
        KVPageFormat("fp8", 128).page_size_of(torch.zeros(2, 2, 8, 100, dtype=torch.uint8))
