"""Quantizers: hand cases bit-exact, no clamping, document-local blocks, causal prefixes."""

from __future__ import annotations

import pytest
import torch

from flamia_serve.numerics import (
    E4M3_MAX,
    RECIPES,
    Granularity,
    Recipe,
    exp2i,
    grad_operand,
    quantize_blocks_2d,
    quantize_fp8,
    quantize_nvfp4,
    token_block_ids,
    unpack_e2m1,
)
from flamia_serve.numerics.formats import e2m1_decode

CU = torch.tensor([0, 5, 40, 40, 107, 108], dtype=torch.int32)  # incl. empty and 1-token docs


def _pack(h: int = 3, d: int = 64) -> torch.Tensor:
    return torch.randn(int(CU[-1]), h, d).to(torch.bfloat16)


def test_token_blocks_restart_at_each_document() -> None:
    ids = token_block_ids(CU, 108)
    expected = [0] * 5 + [1] * 32 + [2] * 3 + [3] * 32 + [4] * 32 + [5] * 3 + [6]
    assert ids.tolist() == expected


def test_fp8_hand_case_bit_exact() -> None:
    x = torch.zeros(3, 1, 4)
    x[0, 0] = torch.tensor([448.0, -1.0, 0.0, 3.3])
    x[1, 0] = torch.tensor([449.0, 1.0, 0.1, -2.0])
    cu = torch.tensor([0, 3], dtype=torch.int32)
    per_token = quantize_fp8(x, cu, Granularity.TOKEN)
    assert per_token.exponents[:, 0].tolist() == [0, 1, -127]
    assert per_token.codes[0, 0].float().tolist() == [448.0, -1.0, 0.0, 3.25]
    assert per_token.codes[1, 0].float().tolist() == [224.0, 0.5, 0.05078125, -1.0]
    assert per_token.codes[2, 0].float().tolist() == [0.0] * 4
    block = quantize_fp8(x, cu, Granularity.TOKEN_BLOCK)
    assert block.exponents[:, 0].tolist() == [1, 1, 1]
    assert block.codes[0, 0].float().tolist() == [224.0, -0.5, 0.0, 1.625]


def test_fp8_never_clamps_and_uses_the_range() -> None:
    x = _pack() * torch.exp(torch.randn(108, 3, 1) * 6).to(torch.bfloat16)
    for gran in Granularity:
        qt = quantize_fp8(x, CU, gran)
        scaled = x.float() * exp2i(-qt.exponents.int())[..., None]
        assert float(scaled.abs().max()) <= E4M3_MAX
        amax = scaled.abs().amax(-1)
        if gran is Granularity.TOKEN:
            assert bool((amax > E4M3_MAX / 2).all())  # rounded up by less than one binade
        deq = qt.dequantize()
        rel = (deq - x.float()).abs() / x.float().abs().clamp(min=1e-30)
        big = x.float().abs() >= exp2i(qt.exponents.int() - 6)[..., None]  # normal range
        assert float(rel[big].max()) <= 2.0**-4


def test_token_block_exponent_shared_and_document_local() -> None:
    x = _pack()
    qt = quantize_fp8(x, CU, Granularity.TOKEN_BLOCK)
    ids = token_block_ids(CU, 108)
    for b in ids.unique():
        e = qt.exponents[ids == b]
        assert bool((e == e[0]).all())
    # a spike in document 3 changes no exponent outside document 3
    y = x.clone()
    y[50, 0, 0] = 1e4
    qy = quantize_fp8(y, CU, Granularity.TOKEN_BLOCK)
    outside = torch.ones(108, dtype=torch.bool)
    outside[40:107] = False
    assert torch.equal(qy.exponents[outside], qt.exponents[outside])
    assert torch.equal(qy.codes[outside].view(torch.uint8), qt.codes[outside].view(torch.uint8))
    assert not torch.equal(qy.exponents[40:72], qt.exponents[40:72])


def test_token_block_codes_identical_for_transpose() -> None:
    """One 32×d block payload serves both orientations (N2)."""
    x = torch.randn(96, 1, 128).to(torch.bfloat16)
    cu = torch.tensor([0, 96], dtype=torch.int32)
    rows = quantize_fp8(x, cu, Granularity.TOKEN_BLOCK)
    xt = x[:, 0].t()  # [d, T]: contraction over tokens now runs along columns
    cols = quantize_blocks_2d(xt, (128, 32))
    assert torch.equal(cols.codes.t().view(torch.uint8), rows.codes[:, 0].view(torch.uint8))
    assert torch.equal(cols.exponents[0], rows.exponents[::32, 0])


def test_per_token_prefix_independent_of_suffix() -> None:
    x = _pack()
    y = x.clone()
    y[60:] = torch.randn_like(y[60:]) * 1000
    a = quantize_fp8(x, CU, Granularity.TOKEN)
    b = quantize_fp8(y, CU, Granularity.TOKEN)
    assert torch.equal(a.codes[:60].view(torch.uint8), b.codes[:60].view(torch.uint8))
    assert torch.equal(a.exponents[:60], b.exponents[:60])
    na, nb = quantize_nvfp4(x), quantize_nvfp4(y)
    for fa, fb in ((na.codes, nb.codes), (na.exponents, nb.exponents)):
        assert torch.equal(fa[:60], fb[:60])
    assert torch.equal(
        na.block_scales[:60].view(torch.uint8), nb.block_scales[:60].view(torch.uint8)
    )


def test_nvfp4_never_clamps_and_second_level() -> None:
    x = (_pack(d=128).float() * torch.exp(torch.randn(108, 3, 1) * 5)).to(torch.bfloat16)
    qt = quantize_nvfp4(x)
    scale = qt.block_scales.float().repeat_interleave(16, -1) * exp2i(qt.exponents.int())[..., None]
    ratio = x.float() / scale.clamp(min=1e-38)
    assert float(ratio.abs().max()) <= 6.0
    assert float(qt.block_scales.float().amax(-1).min()) > 448.0 / 2 / 6 * 0.99  # range used
    err = (qt.dequantize() - x.float()).norm() / x.float().norm()
    assert float(err) < 0.12


def test_nvfp4_hand_case() -> None:
    x = torch.zeros(1, 1, 16)
    x[0, 0, :4] = torch.tensor([6.0, -3.0, 1.0, 0.2])
    qt = quantize_nvfp4(x, second_level=False)
    assert int(qt.exponents) == 0
    assert float(qt.block_scales.float()) == 1.0
    vals = e2m1_decode(unpack_e2m1(qt.codes))[0, 0, :4]
    assert vals.tolist() == [6.0, -3.0, 1.0, 0.0]
    two = quantize_nvfp4(x)
    # amax 6 -> e = ceil(log2(6 / 2688)) = -8; block scale 6*2^8/6 = 256
    assert int(two.exponents) == -8
    assert float(two.block_scales.float()) == 256.0
    assert torch.equal(two.dequantize(), qt.dequantize())


def test_blocks_2d_hand_case_and_edges() -> None:
    x = torch.ones(3, 40, 33)
    x[0, 0, 0] = 900.0  # block (0, 0) of head 0
    x[1, 39, 32] = 0.001  # lone element in the edge block (1, 1)
    x[1, 32:, 32:] = 0.0
    x[1, 39, 32] = 0.001
    qt = quantize_blocks_2d(x, (32, 32))
    assert qt.exponents.shape == (3, 2, 2)
    assert qt.exponents[0].tolist() == [[2, -8], [-8, -8]]
    assert int(qt.exponents[1, 1, 1]) == -18
    assert torch.allclose(qt.dequantize()[1, 39, 32], torch.tensor(0.001), rtol=2**-4)
    assert float(qt.dequantize()[0, 0, 0]) == 896.0


def test_grad_operand_is_the_input_over_the_exponents() -> None:
    """BF16 ``x·2^-e``: exact for BF16 input (times 2^e gives x back bit for bit), rounded to
    nearest for FP16; the recipe field that asks for it is checked."""
    x = _pack() * 37.0
    q8 = quantize_fp8(x, CU)
    g = grad_operand(x, q8.exponents)
    assert g.dtype == torch.bfloat16 and g.shape == x.shape
    assert torch.equal(g.float() * exp2i(q8.exponents.int())[..., None], x.float())
    assert float(g.float().abs().max()) <= E4M3_MAX
    # the codes are E4M3 of the same values: |code - g| within half an E4M3 step
    assert float((q8.codes.float() - g.float()).abs().max()) <= 16.0
    h = (torch.randn(108, 3, 64) * 300).to(torch.float16)
    e = quantize_fp8(h, CU).exponents
    expect = (h.float() * exp2i(-e.int())[..., None]).to(torch.bfloat16)
    assert torch.equal(grad_operand(h, e), expect)
    assert RECIPES["mxfp8_grad_input"].grad_qk == "input" and RECIPES["mxfp8"].grad_qk == "codes"
    with pytest.raises(ValueError, match="grad_qk"):
        Recipe("bad", grad_qk="bf16")
