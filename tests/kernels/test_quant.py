"""Fused quantization kernel: bit-exact against the reference quantizers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flamia_serve.kernels.quant.ops import quantize_do, quantize_qkv
from flamia_serve.kernels.schedule import token_block_table
from flamia_serve.numerics import (
    EXP_MIN,
    RECIPES,
    exp2i,
    resolve_recipe,
    token_block_ids,
    unpack_e2m1,
)
from flamia_serve.numerics.operands import token_columns, v_t_key, v_t_position
from flamia_serve.probes import make_pack
from flamia_serve.reference import quantize_do as reference_quantize_do
from flamia_serve.reference import quantize_qkv as reference_quantize_qkv
from tests.kernels.signed_zeros import negative_zero_bytes, with_signed_zeros

CASES = [
    # lens, hq, hkv, d, recipe, exact_causal
    ((1, 63, 100, 37, 0, 5), 4, 2, 64, "mxfp8", False),
    ((70, 33), 2, 2, 128, "mxfp8", True),
    ((45, 1, 50), 4, 1, 128, "mixed_nvfp4_hadamard", False),
    ((31, 33), 2, 1, 256, "mixed_nvfp4", True),
    ((40,), 2, 1, 256, "mxfp8", False),
]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.element_size() == 1 else x


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(_bits(a.cpu()), _bits(b.cpu()))


@pytest.mark.parametrize(
    ("lens", "hq", "hkv", "d", "recipe", "exact"),
    CASES,
    ids=[f"T{sum(c[0])}-HQ{c[1]}-H{c[2]}-D{c[3]}-{c[4]}{'-exact' if c[5] else ''}" for c in CASES],
)
def test_quant_kernel_bit_exact(lens, hq, hkv, d, recipe, exact, device) -> None:
    q, k, v, cu, _ms = make_pack(lens, hq, hkv, d, seed=5, device=device)
    # adversarial magnitudes: per-token spread over ~2^40, a zero token, a huge one
    spread = torch.exp(torch.randn(q.shape[0], 1, 1) * 6).to(device=device, dtype=q.dtype)
    q, k = q * spread, k * spread.flip(0)
    q[3] = 0
    v[2] = 3e4
    v[4] = 0  # a zero V row: exponent V_ZERO_EXPONENT, not EXP_MIN (N3)
    before = [x.clone() for x in (q, k, v, cu)]
    got = quantize_qkv(q, k, v, cu, recipe=recipe, exact_causal=exact).to_reference()
    ref = reference_quantize_qkv(q, k, v, cu, resolve_recipe(recipe), exact)
    for name in ("q8", "k8", "v8"):
        a, b = getattr(got, name), getattr(ref, name)
        assert _same(a.codes, b.codes), name
        assert _same(a.exponents, b.exponents), name
    if ref.q4 is not None:
        for a, b in ((got.q4, ref.q4), (got.k4, ref.k4)):
            assert _same(a.codes, b.codes)
            assert _same(a.block_scales, b.block_scales)
            assert _same(a.exponents, b.exponents)
    assert got.qk_rescale == ref.qk_rescale
    for a, b in zip(before, (q, k, v, cu), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("candidates", [1, 2, 5])
def test_quant_kernel_nvfp4_scale_search_bit_exact(candidates, device) -> None:
    """The NVFP4 block-scale search (``Recipe.nvfp4_scale_candidates``) picks the twin's
    scales, bit for bit, on groups spread over ~2^40 with exact powers of two and zeros."""
    recipe = dataclasses.replace(resolve_recipe("mixed_nvfp4"), nvfp4_scale_candidates=candidates)
    q, k, v, cu, _ms = make_pack((45, 1, 50), 4, 2, 64, seed=9, device=device)
    spread = torch.exp(torch.randn(q.shape[0], 1, 4, device=device) * 6).repeat_interleave(16, -1)
    q = (q * spread).to(q.dtype)
    k[:, :, :16] = 2.0 ** torch.randint(-10, 6, k[:, :, :16].shape, device=device).to(k.dtype)
    k[5] = 0
    got = quantize_qkv(q, k, v, cu, recipe=recipe).to_reference()
    ref = reference_quantize_qkv(q, k, v, cu, recipe, False)
    for a, b in ((got.q4, ref.q4), (got.k4, ref.k4)):
        assert _same(a.codes, b.codes)
        assert _same(a.block_scales, b.block_scales)


def test_v_t_key_order() -> None:
    """``v_t_position`` permutes keys inside 16-key groups (the order that makes an FP8
    ``wgmma`` accumulator fragment the A fragment of the next one), ``v_t_key`` inverts it."""
    keys = torch.arange(64)
    pos = v_t_position(keys)
    assert pos[:16].tolist() == [0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15]
    assert torch.equal(pos // 16, keys // 16)
    assert torch.equal(v_t_key(pos), keys)


def test_v_t_columns_are_permuted_keys(device) -> None:
    """Each token's V codes sit at its permuted column: ``v_t[:, :, key_columns()]`` is V
    quantized token by token (checked against the reference's codes)."""
    lens = (37, 16, 1, 50)
    q, k, v, cu, _ms = make_pack(lens, 2, 1, 64, seed=6, device=device)
    qkv = quantize_qkv(q, k, v, cu)
    ref = reference_quantize_qkv(q, k, v, cu, resolve_recipe("mxfp8"), False)
    cols = qkv.key_columns()
    starts = qkv.doc_v_t_start.long().cpu()
    local = (cols.cpu() - starts.repeat_interleave(torch.tensor(lens)))
    assert local[:16].tolist() == [0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15]
    got = qkv.v_t[:, :, cols].permute(2, 0, 1)
    assert _same(got, ref.v8.codes)


def test_token_block_table_matches_numerics() -> None:
    cu = torch.tensor([0, 5, 40, 40, 107, 108], dtype=torch.int32)
    table = token_block_table(cu, 108)
    ids = token_block_ids(cu, 108)
    valid = table.length > 0
    assert int(valid.sum()) == int(ids.max()) + 1
    tokens = torch.cat(
        [
            torch.arange(int(s), int(s) + int(n))
            for s, n in zip(table.start, table.length, strict=True)
        ]
    )
    assert torch.equal(tokens, torch.arange(108))
    for s, n in zip(table.start[valid], table.length[valid], strict=True):
        assert bool((ids[int(s) : int(s) + int(n)] == ids[int(s)]).all())


def test_v_t_outside_documents_is_zero(device, monkeypatch) -> None:
    """Columns of ``v_t`` outside every document (16-alignment padding, the tail) hold zero
    codes even when the buffer starts as NaN bytes: whole key tiles may be read past a
    document's end and multiplied by P̂ = 0."""
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.dtype == torch.float8_e4m3fn:
            t.view(torch.uint8).fill_(0x7F)
        return t

    monkeypatch.setattr(torch, "empty", nan_empty)
    lens = (5, 40, 16, 1)
    q, k, v, cu, _ms = make_pack(lens, 2, 2, 64, seed=3, device=device)
    qkv = quantize_qkv(q, k, v, cu)
    inside = torch.zeros(qkv.v_t.shape[-1], dtype=torch.bool)
    inside[qkv.key_columns().cpu()] = True
    outside = qkv.v_t.view(torch.uint8).cpu()[:, :, ~inside]
    assert outside.numel() > 0
    assert not bool(outside.any())


@pytest.mark.parametrize("exact", [False, True], ids=["token_block", "exact_causal"])
def test_kv_factors_are_the_exponents_as_floats(exact, device) -> None:
    """``kv_factors`` holds ``2^eK``, ``eV``, ``2^-eV`` exactly, in ``v_t``'s columns; like the
    kernels' ``exp2i``, ``2^EXP_MIN`` (all-zero groups: zero codes) is flushed to 0."""
    lens = (5, 40, 1, 33)
    q, k, v, cu, _ms = make_pack(lens, 2, 2, 64, seed=4, device=device)
    k, v = k * torch.exp(torch.randn(k.shape[0], 1, 1) * 8).to(k), v * 1e-30
    k[:40] = 0  # all-zero K groups get EXP_MIN
    qkv = quantize_qkv(q, k, v, cu, exact_causal=exact)
    cols = qkv.key_columns().cpu()
    ke, ve = (x.cpu()[:, cols].int() for x in (qkv.k_exp, qkv.v_exp))
    f = qkv.kv_factors.cpu()[:, :, cols]
    assert bool((ke == EXP_MIN).any())
    assert torch.equal(f[:, 0], torch.where(ke == EXP_MIN, 0.0, exp2i(ke)))
    assert torch.equal(f[:, 1], ve.float())
    assert torch.equal(f[:, 2], exp2i(-ve))


@pytest.mark.parametrize("recipe", ["mixed_nvfp4", "mixed_nvfp4_hadamard", "mxfp8"])
@pytest.mark.parametrize("exact", [False, True], ids=["token_block", "exact_causal"])
def test_widened_nvfp4_score_operands(recipe, exact, device) -> None:
    """``widen=True`` (the CuTe kernels' score operands): ``q_wide``/``k_wide`` are the NVFP4
    values without their per-token power of two, in BF16 bit for bit (exact: at most 6
    significant bits); ``kv_factors`` row 0 is then 2^ of K's NVFP4 second level per token
    (0 for an all-zero token), and nothing else changes. E4M3 recipes widen nothing."""
    lens = (5, 40, 1, 33, 0, 70)
    q, k, v, cu, _ms = make_pack(lens, 4, 2, 64, seed=8, device=device)
    spread = torch.exp(torch.randn(q.shape[0], 1, 1) * 6).to(device=device, dtype=q.dtype)
    q, k = q * spread, k * spread.flip(0)
    k[7] = 0
    plain = quantize_qkv(q, k, v, cu, recipe=recipe, exact_causal=exact, column_align=128)
    wide = quantize_qkv(q, k, v, cu, recipe=recipe, exact_causal=exact, column_align=128,
                        widen=True)  # fmt: skip
    cols = wide.key_columns().cpu()
    for name in ("q_codes", "q_exp", "k_codes", "v_t"):
        assert _same(getattr(plain, name), getattr(wide, name)), name
    for name in ("k_exp", "v_exp"):  # (columns outside the documents are never written)
        assert _same(getattr(plain, name).cpu()[:, cols], getattr(wide, name).cpu()[:, cols])
    if plain.q4 is None:
        assert wide.q_wide is None and wide.k_wide is None
        assert wide.score_operands("CuTe kernel")[:2] == (wide.q_codes, wide.k_codes)
        assert _same(plain.kv_factors.cpu()[:, :, cols], wide.kv_factors.cpu()[:, :, cols])
        return
    assert plain.unwidened and not wide.unwidened
    with pytest.raises(ValueError, match="NVFP4 Q/K on the CuTe kernel: quantize with widen"):
        plain.score_operands("CuTe kernel")
    q_in, k_in, q_exp = wide.score_operands("CuTe kernel")
    assert q_in is wide.q_wide and k_in is wide.k_wide
    assert torch.equal(q_exp, wide.q4.exponents.t()) and q_exp.is_contiguous()
    for got, nv in ((wide.q_wide, wide.q4), (wide.k_wide, wide.k4)):
        values = nv.dequantize(second_level=False)
        assert got.dtype == torch.bfloat16 and got.shape == values.shape
        assert torch.equal(got.float(), values)  # exact in BF16
        assert _same(got, values.to(torch.bfloat16))
    e4 = wide.k4.exponents.cpu().t().int()  # [Hkv, T]
    assert bool((e4 == EXP_MIN).any())  # the zero token
    f = wide.kv_factors.cpu()[:, :, cols]
    assert torch.equal(f[:, 0], torch.where(e4 == EXP_MIN, 0.0, exp2i(e4)))
    assert _same(f[:, 1:], plain.kv_factors.cpu()[:, 1:, cols])


@pytest.mark.parametrize("recipe", ["mixed_nvfp4", "mixed_nvfp4_hadamard"])
def test_scores_only_writes_the_cute_forwards_operands_as_the_full_quantization(
    recipe, device
) -> None:
    """``scores_only`` (the CuTe forward's operands): the widened values, the NVFP4 second
    levels, ``kv_factors``, ``v_t`` and ``v_exp`` equal the full quantization's bit for bit;
    every reader of the rest refuses the result by name, and so do impossible requests."""
    from flamia_serve.kernels.attn_fwd.ops import FwdConfig, attn_fwd

    lens = (5, 40, 1, 33, 0, 70)
    q, k, v, cu, _ms = make_pack(lens, 4, 2, 64, seed=9, device=device)
    full = quantize_qkv(q, k, v, cu, recipe=recipe, column_align=128, widen=True)
    part = quantize_qkv(q, k, v, cu, recipe=recipe, column_align=128, widen=True,
                        scores_only=True)  # fmt: skip
    assert part.scores_only and not full.scores_only
    cols = full.key_columns().cpu()
    for name in ("q_wide", "k_wide", "v_t"):
        assert _same(getattr(full, name), getattr(part, name)), name
    for a, b in ((full.q4, part.q4), (full.k4, part.k4)):
        assert _same(a.exponents, b.exponents)
    for name in ("kv_factors", "v_exp"):
        assert _same(getattr(full, name).cpu()[..., cols], getattr(part, name).cpu()[..., cols])
    with pytest.raises(ValueError, match="to_reference reads"):
        part.to_reference()
    with pytest.raises(ValueError, match="a Triton attention kernel reads"):  # (CuTe: default
        # on a GPU with the cute extra, where it reads exactly these operands)
        attn_fwd(part, cu, heads_q=4, causal=True, softmax_scale=0.125, config=FwdConfig())
    for kw in (dict(recipe="mxfp8", widen=True), dict(recipe=recipe),
               dict(recipe=recipe, widen=True, with_transposed=True)):  # fmt: skip
        with pytest.raises(ValueError, match="scores_only writes"):
            quantize_qkv(q, k, v, cu, column_align=128, scores_only=True, **kw)


@pytest.mark.parametrize("exact", [False, True], ids=["token_block", "exact_causal"])
def test_defer_q_writes_k_and_v_as_the_full_quantization(exact, device) -> None:
    """``defer_q`` (the CuTe forward quantizes Q itself): K's codes and exponents,
    ``kv_factors``, ``v_t`` and ``v_exp`` equal the full quantization's bit for bit, Q's
    buffers are not written, ``q_input`` is Q itself (not a copy), and every reader of Q's
    codes refuses the result by name, as do impossible requests."""
    from flamia_serve.kernels.attn_fwd.ops import FwdConfig, attn_fwd

    q, k, v, cu, _ms = make_pack((5, 40, 1, 33, 0, 70), 4, 2, 64, seed=9, device=device)
    full = quantize_qkv(q, k, v, cu, column_align=128, exact_causal=exact)
    sentinel = torch.full((4, q.shape[0]), 77, dtype=torch.int16, device=device)
    part = quantize_qkv(q, k, v, cu, column_align=128, exact_causal=exact, defer_q=True)
    assert part.q_input is q and full.q_input is None
    assert part.k_exp_block == full.k_exp_block == (1 if exact else 32)
    cols = full.key_columns().cpu()
    for name in ("k_codes", "v_t"):
        assert _same(getattr(full, name), getattr(part, name)), name
    for name in ("kv_factors", "k_exp", "v_exp"):
        assert _same(getattr(full, name).cpu()[..., cols], getattr(part, name).cpu()[..., cols])
    # Q's exponents stay whatever the buffer held: the Q items were skipped
    ws_part = quantize_qkv(q, k, v, cu, column_align=128, exact_causal=exact, defer_q=True,
                           workspace=_workspace_with("q_exp", sentinel))  # fmt: skip
    assert torch.equal(ws_part.q_exp.t().cpu(), sentinel.cpu())
    with pytest.raises(ValueError, match="to_reference reads the E4M3 Q codes"):
        part.to_reference()
    with pytest.raises(ValueError, match="a Triton attention kernel reads the E4M3 Q codes"):
        # the Triton kernel named: on a GPU with the cute extra the default reads Q itself
        attn_fwd(part, cu, heads_q=4, causal=True, softmax_scale=0.125, config=FwdConfig())
    with pytest.raises(ValueError, match="the CuTe backward reads the E4M3 Q codes"):
        part.score_operands("CuTe backward")
    assert part.score_operands("CuTe forward", quantizes_q=True)[0] is q
    for kw in (dict(recipe="mixed_nvfp4"), dict(with_transposed=True),
               dict(recipe="mixed_nvfp4", widen=True, scores_only=True)):  # fmt: skip
        with pytest.raises(ValueError, match="defer_q leaves Q"):
            quantize_qkv(q, k, v, cu, column_align=128, defer_q=True, **kw)


@pytest.mark.parametrize("exact", [False, True], ids=["token_block", "exact_causal"])
def test_defer_q_keeps_the_short_documents_q(exact, device) -> None:
    """``defer_q`` with ``q_short=L``: the Q codes and exponents of documents of at most L
    tokens (what the window kernel reads) equal the full quantization's bit for bit, the other
    rows are not written, K/V as before; ``q_short`` without ``defer_q`` is refused."""
    from flamia_serve.kernels.schedule import short_document_slots

    lens = (5, 40, 1, 32, 0, 33, 70, 17, 2)
    q, k, v, cu, _ms = make_pack(lens, 4, 2, 64, seed=10, device=device)
    full = quantize_qkv(q, k, v, cu, column_align=128, exact_causal=exact)
    sentinel = torch.full((4, q.shape[0]), 77, dtype=torch.int16, device=device)
    part = quantize_qkv(q, k, v, cu, column_align=128, exact_causal=exact, defer_q=True,
                        q_short=32, workspace=_workspace_with("q_exp", sentinel))  # fmt: skip
    assert part.q_input is q and part.q_short == 32 and full.q_short == 0
    short = torch.tensor([n <= 32 for n in lens for _ in range(n)], device=device)
    assert bool(short.any()) and not bool(short.all())
    assert _same(part.q_codes[short], full.q_codes[short])
    assert torch.equal(part.q_exp[short].cpu(), full.q_exp[short].cpu())
    assert bool((part.q_exp[~short] == 77).all())  # the long documents' Q items skipped
    assert _same(part.k_codes, full.k_codes) and _same(part.v_t, full.v_t)
    blocks = token_block_table(cu, q.shape[0], 32)
    short_slots = [slot for slot, (d, n) in
                   enumerate(zip(_block_docs(cu, blocks), blocks.length.tolist(), strict=True))
                   if n and int(cu[d + 1] - cu[d]) <= 8]  # fmt: skip
    slots = short_document_slots(cu, q.shape[0], 32, 8).tolist()
    assert slots[0] == len(short_slots) > 0 and slots[1 : 1 + slots[0]] == short_slots
    assert sorted(slots[1:]) == list(range(blocks.num_slots))
    with pytest.raises(ValueError, match=r"q_short=32 .* needs defer_q=True"):
        quantize_qkv(q, k, v, cu, column_align=128, q_short=32)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="q_short must be a number of tokens"):
            quantize_qkv(q, k, v, cu, column_align=128, defer_q=True, q_short=bad)


def _block_docs(cu: torch.Tensor, blocks) -> list[int]:
    """The document of each slot of a token block table (empty slots: the last one)."""
    cu = cu.long().cpu()
    last = cu.numel() - 2
    return [min(max(int(torch.searchsorted(cu, s, right=True)) - 1, 0), last)
            for s in blocks.start.long().cpu()]  # fmt: skip


def _workspace_with(name: str, value: torch.Tensor):
    """A workspace whose buffer ``name`` already holds ``value`` (head-major)."""
    from flamia_serve.kernels.workspace import PackWorkspace

    ws = PackWorkspace(value.device)
    ws.empty(name, tuple(value.shape), value.dtype).copy_(value)
    return ws


def test_token_block_must_fill_v_t_key_groups(device) -> None:
    """A recipe whose token blocks are not whole 16-key groups is refused by name (the
    K-major V layout permutes keys inside 16-key groups)."""
    q, k, v, cu, _ms = make_pack((40,), 2, 1, 64, seed=1, device=device)
    recipe = dataclasses.replace(resolve_recipe("mxfp8"), token_block=8)
    with pytest.raises(ValueError, match="token_block 8: must be a multiple of 16"):
        quantize_qkv(q, k, v, cu, recipe=recipe)


@pytest.mark.parametrize(
    ("lens", "hq", "hkv", "d", "recipe", "exact"),
    CASES,
    ids=[f"T{sum(c[0])}-HQ{c[1]}-H{c[2]}-D{c[3]}-{c[4]}{'-exact' if c[5] else ''}" for c in CASES],
)
def test_column_copies_bit_exact(lens, hq, hkv, d, recipe, exact, device) -> None:
    """``q_t``/``k_t`` (the backward's column-layout copies) hold exactly the token-major
    codes at ``key_columns``, zeros in every other column (document padding, slack)."""
    q, k, v, cu, _ms = make_pack(lens, hq, hkv, d, seed=6, device=device)
    qkv = quantize_qkv(q, k, v, cu, recipe=recipe, exact_causal=exact, with_transposed=True)
    column = qkv.key_columns()
    for name, t, codes in (("q_t", qkv.q_t, qkv.q_codes), ("k_t", qkv.k_t, qkv.k_codes)):
        assert _same(t[:, :, column].permute(2, 0, 1), codes), name
        rest = torch.ones(t.shape[-1], dtype=torch.bool, device=t.device)
        rest[column] = False
        assert not bool(t[:, :, rest].view(torch.uint8).any()), name


@pytest.mark.parametrize("exact", [False, True], ids=["token_block", "per_token"])
def test_column_align_moves_documents_not_codes(exact, device) -> None:
    """The CuTe forward's layout (documents at multiples of 128 columns): each token's codes
    and exponents are those of the default 16-aligned layout, every document's whole
    128-column tiles hold only its own tokens, and every other column holds zero codes (a
    tile read past a document's end multiplies them by P̂ = 0: NaN there would cross)."""
    lens = (5, 130, 1, 40, 0, 16)
    q, k, v, cu, _ms = make_pack(lens, 4, 2, 64, seed=3, device=device)
    a = quantize_qkv(q, k, v, cu, exact_causal=exact, with_transposed=True)
    b = quantize_qkv(q, k, v, cu, exact_causal=exact, with_transposed=True, column_align=128)
    assert (a.column_align, b.column_align) == (16, 128)
    starts = b.doc_v_t_start.long().cpu()
    spans = (torch.tensor(lens) + 127) // 128 * 128
    assert bool((starts % 128 == 0).all())
    assert bool((starts[1:] - starts[:-1] >= spans[:-1]).all())
    assert b.v_t.shape[-1] >= int(starts[-1] + spans[-1])
    ca, cb = a.key_columns(), b.key_columns()
    for name in ("v_t", "q_t", "k_t", "k_exp", "v_exp", "kv_factors"):
        assert _same(getattr(a, name)[..., ca], getattr(b, name)[..., cb]), name
    assert _same(a.q_codes, b.q_codes) and _same(a.k_codes, b.k_codes)
    outside = torch.ones(b.v_t.shape[-1], dtype=torch.bool)
    outside[cb.cpu()] = False
    for name in ("v_t", "q_t", "k_t"):
        assert int(_bits(getattr(b, name)).cpu()[:, :, outside].count_nonzero()) == 0, name


@pytest.mark.parametrize("align", [0, 8, 24, True, 16.0])
def test_bad_column_align_is_refused(align) -> None:
    q, k, v, cu, _ms = make_pack((5, 7), 2, 1, 64, seed=1, device="cpu")
    with pytest.raises(ValueError, match="column_align must be a positive multiple of 16"):
        quantize_qkv(q, k, v, cu, column_align=align)
    with pytest.raises(ValueError, match="column_align"):
        token_block_table(cu, 12, align=align)


def _same_bf16(a: torch.Tensor, b: torch.Tensor) -> bool:
    """BF16 tensors equal bit for bit (``torch.equal`` takes -0.0 for +0.0)."""
    return torch.equal(a.cpu().view(torch.int16), b.cpu().view(torch.int16))


SIGNED_ZERO_CASES = [
    ("mxfp8", False),
    ("mxfp8", True),
    ("mixed_nvfp4", False),
    ("mixed_nvfp4_hadamard", True),
    ("mxfp8_grad_input", False),
]


@pytest.mark.parametrize(
    ("recipe", "exact"),
    SIGNED_ZERO_CASES,
    ids=[f"{r}{'-exact' if e else ''}" for r, e in SIGNED_ZERO_CASES],
)
def test_quant_kernel_signed_zeros_bit_exact(recipe, exact, device) -> None:
    """-0.0 and negatives that round to zero (DESIGN N1, the sign of zero): the kernel writes
    the twin's bytes: E4M3 negative zero (0x80) for both, as torch's cast and the GPU's;
    E2M1 codes, block scales and exponents, the widened NVFP4 values and the ``grad_qk =
    "input"`` BF16 rows likewise, in every recipe; the inputs are left as they were."""
    rec = resolve_recipe(recipe)
    q, k, v, cu, _ms = make_pack((37, 5), 2, 1, 64, seed=11, device=device)
    q, k, v = (with_signed_zeros(x) for x in (q, k, v))
    before = [x.clone() for x in (q, k, v)]
    nvfp4, rows = rec.qk_format == "nvfp4", rec.grad_input
    qkv = quantize_qkv(q, k, v, cu, recipe=rec, exact_causal=exact, widen=nvfp4,
                       with_transposed=rows, q_rows=rows, k_rows=rows)  # fmt: skip
    got = qkv.to_reference()
    ref = reference_quantize_qkv(q, k, v, cu, rec, exact)
    for name in ("q8", "k8", "v8"):
        a, b = getattr(got, name), getattr(ref, name)
        assert negative_zero_bytes(b.codes) > 0, name  # the case is there
        assert _same(a.codes, b.codes), name
        assert _same(a.exponents, b.exponents), name
    if nvfp4:
        for a, b, wide in ((got.q4, ref.q4, qkv.q_wide), (got.k4, ref.k4, qkv.k_wide)):
            assert _same(a.codes, b.codes)
            assert _same(a.block_scales, b.block_scales)
            assert _same(a.exponents, b.exponents)
            assert _same_bf16(wide, b.dequantize(second_level=False).to(torch.bfloat16))
        if not rec.hadamard:  # E2M1 negative zero (the tiny negatives)
            assert bool((unpack_e2m1(ref.q4.codes.cpu()) == 8).any())
    if rows:
        for a, b in ((got.q_grad, ref.q_grad), (got.k_grad, ref.k_grad)):
            assert _same_bf16(a, b)
    for a, b in zip(before, (q, k, v), strict=True):
        assert _same_bf16(a, b)


def test_quantize_do_signed_zeros_bit_exact(device) -> None:
    """The dO quantizer on -0.0 and negatives that round to zero: dÔ and Ĝ codes (E4M3
    negative zero included) and exponents equal the twin's bytes, and so do Ĝ's BF16 rows."""
    lens = (37, 5)
    d_out = with_signed_zeros(make_pack(lens, 2, 1, 64, seed=12, device=device)[0])
    out, _k, _v, cu, _ms = make_pack(lens, 2, 1, 64, seed=13, device=device)
    gen = torch.Generator().manual_seed(14)
    m = torch.randint(-4, 5, (sum(lens), 2), generator=gen).float()
    lse = m + torch.rand(sum(lens), 2, generator=gen) * 6
    m, lse = m.to(device), lse.to(device)
    before = d_out.clone()
    got = quantize_do(d_out, out, m, lse, cu, g_rows=True)
    ref = reference_quantize_do(d_out, out, m, lse, cu, RECIPES["mxfp8"],
                                row_factor=got.row_factor)  # fmt: skip
    mine = got.to_reference()
    for a, b in ((mine.do8, ref.do8), (mine.g8, ref.g8)):
        assert negative_zero_bytes(b.codes) > 0
        assert _same(a.codes, b.codes)
        assert _same(a.exponents, b.exponents)
    rows = v_t_key(token_columns(cu, got.doc_v_t_start, d_out.shape[0]))
    assert _same_bf16(got.g_rows[rows], ref.g8.dequantize().to(torch.bfloat16))
    assert _same_bf16(d_out, before)


@pytest.mark.parametrize(("d", "warps"), [(64, 2), (128, 4), (256, 4)])
def test_quantizers_default_warps_follow_the_head_dim(d, warps, device) -> None:
    """Both quantizers launch ``default_warps(d)`` warps per program unless told otherwise
    (2 at d <= 64 with E4M3 Q/K: measured faster there), NVFP4 Q/K 4, or 8 with a scale
    search."""
    from flamia_serve.kernels.quant.ops import (
        default_warps,
        quantize_do_launch,
        quantize_qkv_launch,
    )

    assert default_warps(d) == warps
    q, k, v, cu, _ms = make_pack((40, 33), 2, 1, d, seed=2, device=device)
    _, launch = quantize_qkv_launch(q, k, v, cu)
    assert launch.quantize.kwargs["num_warps"] == warps
    _, launch = quantize_qkv_launch(q, k, v, cu, num_warps=8)
    assert launch.quantize.kwargs["num_warps"] == 8
    search = dataclasses.replace(resolve_recipe("mixed_nvfp4"), nvfp4_scale_candidates=3)
    _, launch = quantize_qkv_launch(q, k, v, cu, recipe=search)
    assert launch.quantize.kwargs["num_warps"] == 8
    plain = dataclasses.replace(resolve_recipe("mixed_nvfp4"), nvfp4_scale_candidates=1)
    _, launch = quantize_qkv_launch(q, k, v, cu, recipe=plain)
    assert launch.quantize.kwargs["num_warps"] == 4  # NVFP4: two warps not measured
    m = torch.zeros(q.shape[:2], device=device)
    _, launch = quantize_do_launch(q, q, m, m, cu)
    assert launch.kwargs["num_warps"] == warps
