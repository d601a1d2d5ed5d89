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
    fp8_exponents,
    grad_operand,
    quantize_blocks_2d,
    quantize_fp8,
    quantize_nvfp4,
    token_block_ids,
    unpack_e2m1,
)
from flamia_serve.numerics.formats import e2m1_decode
from flamia_serve.numerics.kv_pages import KVPageFormat, encode_slots

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


def _bad_inputs() -> list[tuple[str, object, type[Exception], str]]:
    """(id, call, error type, what the message must name)."""
    x = _pack(h=2, d=64)
    cu2 = CU.clone()
    cu2[-1] = 107  # ends before the last token
    e8 = torch.zeros(108, 2, dtype=torch.int8)
    fp8 = quantize_fp8
    return [
        ("fp8 rank 2", lambda: fp8(x[:, 0], CU), ValueError, "x must have 3 dims [T, H, d]"),
        ("fp8 rank 4", lambda: fp8(x[None], CU, Granularity.TOKEN), ValueError, "x must have 3"),
        ("fp8 not a tensor", lambda: fp8(x.tolist(), CU), TypeError, "x must be a torch.Tensor"),
        ("fp8 int", lambda: fp8(x.int(), CU), TypeError, "x must have dtype"),
        ("fp8 float64", lambda: fp8(x.double(), CU), TypeError, "x must have dtype"),
        ("fp8 e4m3 codes", lambda: fp8(x.to(torch.float8_e4m3fn), CU), TypeError, "x must have"),
        ("fp8 empty head dim", lambda: fp8(x[..., :0], CU), ValueError, "x: head dim"),
        ("fp8 no cu", lambda: fp8(x, None), ValueError, "cu_seqlens is required"),
        ("fp8 cu int64", lambda: fp8(x, CU.long()), TypeError, "cu_seqlens must have dtype"),
        ("fp8 cu short", lambda: fp8(x, cu2), ValueError, "cu_seqlens must end at"),
        ("fp8 cu rank", lambda: fp8(x, CU[None]), ValueError, "cu_seqlens must have 1 dims"),
        ("fp8 granularity", lambda: fp8(x, CU, "rows"), ValueError, "granularity must be"),
        ("fp8 block 0", lambda: fp8(x, CU, Granularity.TOKEN_BLOCK, 0), ValueError, "block"),
        ("fp8 block float", lambda: fp8(x, CU, Granularity.TOKEN_BLOCK, 32.0), TypeError, "block"),
        ("fp8 zero_exponent", lambda: fp8(x, CU, zero_exponent=200), ValueError, "zero_exponent"),
        ("exponents rank 2", lambda: fp8_exponents(x[:, 0], CU, Granularity.TOKEN_BLOCK),
         ValueError, "x must have 3 dims"),
        ("nvfp4 rank 2", lambda: quantize_nvfp4(x[:, 0]), ValueError, "x must have 3 dims"),
        ("nvfp4 int", lambda: quantize_nvfp4(x.short()), TypeError, "x must have dtype"),
        ("nvfp4 head dim 24", lambda: quantize_nvfp4(x[..., :24]), ValueError,
         "x: head dim must be a multiple of 16"),
        ("nvfp4 candidates", lambda: quantize_nvfp4(x, scale_candidates=0), ValueError,
         "scale_candidates"),
        ("blocks_2d rank 1", lambda: quantize_blocks_2d(x[0, 0], (32, 32)), ValueError,
         "x must have at least 2 dims"),
        ("blocks_2d int", lambda: quantize_blocks_2d(x.long(), (32, 32)), TypeError,
         "x must have dtype"),
        ("blocks_2d block", lambda: quantize_blocks_2d(x, (32,)), TypeError, "block must be"),
        ("blocks_2d block 0", lambda: quantize_blocks_2d(x, (32, 0)), ValueError, "block[1]"),
        ("grad_operand rank", lambda: grad_operand(x[:, 0], e8), ValueError, "x must have 3"),
        ("grad_operand shape", lambda: grad_operand(x, e8[:, :1]), ValueError, "exponents"),
        ("grad_operand dtype", lambda: grad_operand(x, e8.float()), TypeError, "exponents"),
        ("encode_slots rank", lambda: encode_slots(x[:, 0], KVPageFormat("fp8", 64)),
         ValueError, "x must have 3 dims [N, H, d]"),
    ]  # fmt: skip


def test_bad_arguments_raise_errors_naming_them() -> None:
    """Every public quantizer refuses a wrong rank, dtype, head dim or parameter with a
    ``TypeError``/``ValueError`` whose message names the argument (not an error from deep
    inside torch), and leaves what it was given as it was."""
    x = _pack(h=2, d=64)
    kept = (x.clone(), CU.clone())
    for case, call, error, named in _bad_inputs():
        with pytest.raises(error) as info:
            call()
        assert named in str(info.value), (case, str(info.value))
    assert torch.equal(x.view(torch.int16), kept[0].view(torch.int16))
    assert torch.equal(CU, kept[1])


def test_quantizers_take_granularity_values_and_float32() -> None:
    """``granularity`` may be given by its value; float32 inputs (the twin's intermediates)
    are quantized as the BF16 ones they equal."""
    x = _pack()
    a = quantize_fp8(x, CU, "token")
    b = quantize_fp8(x.float(), CU, Granularity.TOKEN)
    assert torch.equal(a.codes.view(torch.uint8), b.codes.view(torch.uint8))
    assert torch.equal(a.exponents, b.exponents)
