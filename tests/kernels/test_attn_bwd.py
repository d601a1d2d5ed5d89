"""Backward path: dO quantization bit-exact, backward kernel against its reference twin,
P̂ of forward and backward, autograd, ``torch.compile``, transformers, errors.

Tolerance of the kernel against the twin (same quantized operands in, ``reference.
attention_backward``): on the CPU interpreter the kernels sum in the reference's order and
the results agree after rounding to BF16: ‖x − ref‖/‖ref‖ <= 1e-3. On the GPU the FP8
``wgmma`` sums Q̂·K̂ᵀ and dÔ·V̂ᵀ in another order with ~14 mantissa bits and ``ex2.approx``
replaces exp2, which moves P and dS by ulps and now and then flips an E4M3 code of P̂ or
dS (one code step: up to 1/8 of an element): bound 3e-2 there. End to end (each path runs
its own forward) the kernel's O differs from the twin's by an ulp or two of BF16, which
D = rowsum(dÔ ∘ O) and dS = P ∘ (dP − D) amplify where dP ≈ D: gradients of the two paths
agree to 3e-2 and, against float64 autograd, the kernel must be as accurate as the twin
(cos-sim within 2e-4 of the twin's).
"""

from __future__ import annotations

import pytest
import torch

from flamia_serve import flamia_attn, flamia_attn_varlen, plan_varlen
from flamia_serve.attention import debug_p_hat
from flamia_serve.kernels import schedule
from flamia_serve.kernels.attn_bwd.ops import (
    BwdConfig,
    attn_bwd,
    bwd_reads_rows,
    default_bwd_config,
)
from flamia_serve.kernels.attn_fwd.ops import attn_fwd
from flamia_serve.kernels.quant.ops import quantize_do, quantize_qkv
from flamia_serve.kernels.schedule import build_key_work_list
from flamia_serve.numerics import RECIPES, Recipe
from flamia_serve.numerics.operands import token_columns, v_t_key
from flamia_serve.probes import make_pack
from flamia_serve.reference import attention, attention_backward, attention_float64
from flamia_serve.reference import quantize_do as reference_quantize_do
from flamia_serve.reference.quantized import quantize_qkv as reference_quantize_qkv

CASES = [
    # lens, hq, hkv, d, recipe, causal, exact_causal
    ((1, 63, 100, 37, 5), 4, 2, 64, "mxfp8", True, False),
    ((1, 63, 100, 37, 5), 4, 2, 64, "mxfp8", False, False),
    ((70, 33), 2, 2, 64, "mxfp8", True, True),
    ((45, 1, 50), 4, 1, 128, "mixed_nvfp4_hadamard", True, False),
    ((31, 40), 8, 1, 64, "mixed_nvfp4", False, True),
    ((40, 9), 2, 1, 256, "mxfp8", True, False),
    ((1, 63, 100, 37, 5), 4, 2, 64, "mxfp8_grad_input", True, False),
    ((70, 33), 4, 1, 128, "mxfp8_grad_input", False, True),
    ((40, 9), 2, 1, 256, "mxfp8_grad_input", True, False),
]
IDS = [
    f"T{sum(c[0])}-HQ{c[1]}-H{c[2]}-D{c[3]}-{c[4]}-{'causal' if c[5] else 'full'}"
    f"{'-exact' if c[6] else ''}"
    for c in CASES
]


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖/‖ref‖ with the reference rounded to x's dtype first."""
    r = ref.to(x.dtype).float().cpu()
    return float((x.float().cpu() - r).norm() / ref.float().cpu().norm().clamp(min=1e-30))


def _kernel_backward(lens, hq, hkv, d, recipe, causal, exact, device, seed=5):
    q, k, v, cu, _ms = make_pack(lens, hq, hkv, d, seed=seed, device=device)
    d_out = make_pack(lens, hq, hkv, d, seed=seed + 1, device=device)[0]
    rec = RECIPES[recipe]
    rows = rec.grad_input
    qkv = quantize_qkv(q, k, v, cu, recipe=rec, exact_causal=exact, with_transposed=True,
                       q_rows=rows, k_rows=rows)  # fmt: skip
    out, m, lse = attn_fwd(qkv, cu, heads_q=hq, causal=causal, softmax_scale=d**-0.5)
    qdo = quantize_do(d_out, out, m, lse, cu, recipe=rec)
    grads = attn_bwd(qkv, qdo, m, lse, cu, heads_q=hq, causal=causal, softmax_scale=d**-0.5,
                     recipe=rec)  # fmt: skip
    ref = attention_backward(
        d_out, out, m, lse, qkv.to_reference(), cu, rec, causal=causal, softmax_scale=d**-0.5,
        qdo=qdo.to_reference(),
    )  # fmt: skip
    return grads, ref


@pytest.mark.parametrize(
    ("lens", "hq", "hkv", "d", "recipe", "causal", "parts"),
    [
        ((40, 9), 2, 1, 256, "mxfp8", True, 2),
        ((1, 63, 37), 2, 1, 64, "mxfp8", False, 2),
        ((45, 1, 50), 2, 1, 128, "mixed_nvfp4_hadamard", True, 4),
    ],
)
def test_bwd_head_dim_parts_give_the_same_gradients(lens, hq, hkv, d, recipe, causal, parts,
                                                    device) -> None:  # fmt: skip
    """Programs that split the head dim of dK/dV/dQ rebuild the same scores and dS codes:
    dK and dV equal the unsplit kernel's bit for bit, dQ too where its FP32 atomics run in
    one order (the CPU interpreter), within FP32 reassociation on a GPU."""
    q, k, v, cu, _ms = make_pack(lens, hq, hkv, d, seed=11, device=device)
    d_out = make_pack(lens, hq, hkv, d, seed=12, device=device)[0]
    rec = RECIPES[recipe]
    qkv = quantize_qkv(q, k, v, cu, recipe=rec, with_transposed=True)
    out, m, lse = attn_fwd(qkv, cu, heads_q=hq, causal=causal, softmax_scale=d**-0.5)
    qdo = quantize_do(d_out, out, m, lse, cu, recipe=rec)
    grads = [
        attn_bwd(qkv, qdo, m, lse, cu, heads_q=hq, causal=causal, softmax_scale=d**-0.5,
                 recipe=rec, config=BwdConfig(num_warps=4, head_dim_parts=n))
        for n in (1, parts)
    ]  # fmt: skip
    (dq1, dk1, dv1), (dqn, dkn, dvn) = grads
    assert torch.equal(dk1, dkn) and torch.equal(dv1, dvn)
    assert bool(dk1.abs().sum() > 0) and bool(dv1.abs().sum() > 0)
    if device == "cpu":
        assert torch.equal(dq1, dqn)
    else:
        assert _rel(dqn, dq1.float()) <= 1e-2


@pytest.mark.parametrize(("lens", "hq", "hkv", "d", "recipe", "causal", "exact"), CASES, ids=IDS)
def test_bwd_kernel_matches_reference(lens, hq, hkv, d, recipe, causal, exact, device) -> None:
    grads, ref = _kernel_backward(lens, hq, hkv, d, recipe, causal, exact, device)
    bound = 3e-2 if device == "cuda" else 1e-3
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref, strict=True):
        assert g.shape == r.shape, name
        assert bool(torch.isfinite(g).all()), name
        assert _rel(g, r) <= bound, (name, _rel(g, r))


@pytest.mark.parametrize("lens", [(1, 63, 100, 37, 0, 5), (64,), (33, 1, 1, 32)])
def test_quantize_do_bit_exact(lens, device) -> None:
    """dÔ and Ĝ codes/exponents bit-exact against the twin (given the kernel's f), D to the
    sum order, f = 2^(M − 8 − lse) to the ulps of exp2."""
    q, k, v, cu, _ms = make_pack(lens, 4, 2, 64, seed=2, device=device)
    d_out = make_pack(lens, 4, 2, 64, seed=3, device=device)[0] * 1e-3
    qkv = quantize_qkv(q, k, v, cu)
    out, m, lse = attn_fwd(qkv, cu, heads_q=4, causal=True, softmax_scale=0.125)
    got = quantize_do(d_out, out, m, lse, cu)
    ref = reference_quantize_do(d_out, out, m, lse, cu, RECIPES["mxfp8"], row_factor=got.row_factor)
    mine = got.to_reference()
    for a, b in ((mine.do8, ref.do8), (mine.g8, ref.g8)):
        assert torch.equal(a.codes.view(torch.uint8), b.codes.view(torch.uint8))
        assert torch.equal(a.exponents, b.exponents)
    assert torch.allclose(mine.delta, ref.delta, rtol=1e-5, atol=1e-6)
    f = torch.exp2(m - 8 - lse)
    assert torch.allclose(got.row_factor, f, rtol=1e-6, atol=0)


def test_quantize_do_g_rows(device) -> None:
    """``g_rows``: Ĝ's values ``code·2^eG`` in BF16, a row per column of the layout with the
    tokens in order, bit-exact against the twin's dequantized Ĝ, zeros in every other row
    (with or without the column layout's codes; never neither); the other outputs
    unchanged."""
    lens = (1, 63, 100, 37, 0, 5)
    q, k, v, cu, _ms = make_pack(lens, 4, 2, 64, seed=2, device=device)
    d_out = make_pack(lens, 4, 2, 64, seed=3, device=device)[0] * 1e-3
    out, m, lse = attn_fwd(quantize_qkv(q, k, v, cu), cu, heads_q=4, causal=True,
                           softmax_scale=0.125)  # fmt: skip
    both = quantize_do(d_out, out, m, lse, cu, g_rows=True)
    ref = reference_quantize_do(d_out, out, m, lse, cu, RECIPES["mxfp8"],
                                row_factor=both.row_factor)  # fmt: skip
    used = token_columns(cu, both.doc_v_t_start, d_out.shape[0])
    rows = v_t_key(used)
    assert both.g_rows.dtype == torch.bfloat16
    assert both.g_rows.shape == (both.g_exp.shape[1], *d_out.shape[1:])
    assert torch.equal(both.g_rows[rows].float(), ref.g8.dequantize().float())
    assert int((both.g_rows != 0).sum()) > 1000
    others = torch.ones(both.g_rows.shape[0], dtype=torch.bool)
    others[rows] = False
    assert not bool(both.g_rows[others].any())
    rows_only = quantize_do(d_out, out, m, lse, cu, g_rows=True, g_columns=False)
    assert rows_only.g_t is None
    assert torch.equal(rows_only.g_rows, both.g_rows)
    columns = quantize_do(d_out, out, m, lse, cu)
    assert columns.g_rows is None
    assert torch.equal(rows_only.do_codes.view(torch.uint8), columns.do_codes.view(torch.uint8))
    assert torch.equal(both.g_t.view(torch.uint8), columns.g_t.view(torch.uint8))
    assert torch.equal(rows_only.g_exp[:, used], columns.g_exp[:, used])
    assert torch.equal(rows_only.delta, columns.delta)
    with pytest.raises(ValueError, match="g_columns and g_rows"):
        quantize_do(d_out, out, m, lse, cu, g_columns=False)
    with pytest.raises(ValueError, match="g_columns"):
        rows_only.to_reference()


@pytest.mark.parametrize(("recipe", "exact"), [("mxfp8", False), ("mixed_nvfp4", True)])
def test_quantize_qkv_q_rows(recipe, exact, device) -> None:
    """``q_rows``: Q's E4M3 codes as BF16 values, a row per column of the layout with the
    tokens in order (bit-exact against ``q_codes``), zeros in every other row; the other
    outputs unchanged; refused without ``with_transposed``."""
    lens = (1, 63, 100, 37, 0, 5)
    q, k, v, cu, _ms = make_pack(lens, 4, 2, 64, seed=5, device=device)
    kw = dict(recipe=recipe, exact_causal=exact, with_transposed=True, column_align=128)
    rows_only = quantize_qkv(q, k, v, cu, q_rows=True, q_transposed=False, **kw)
    columns = quantize_qkv(q, k, v, cu, **kw)
    assert rows_only.q_t is None and columns.q_rows is None
    used = token_columns(cu, rows_only.doc_v_t_start, q.shape[0])
    rows = v_t_key(used)
    q_rows = rows_only.q_rows
    assert q_rows.dtype == torch.bfloat16
    assert q_rows.shape == (rows_only.v_t.shape[2], *q.shape[1:])
    assert torch.equal(q_rows[rows].float(), columns.q_codes.float())
    assert int((q_rows != 0).sum()) > 1000
    others = torch.ones(q_rows.shape[0], dtype=torch.bool)
    others[rows] = False
    assert not bool(q_rows[others].any())
    for name in ("q_codes", "k_codes", "k_t", "v_t"):
        a, b = getattr(rows_only, name), getattr(columns, name)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    assert torch.equal(rows_only.q_exp, columns.q_exp)
    with pytest.raises(ValueError, match="q_rows"):
        quantize_qkv(q, k, v, cu, q_rows=True)


@pytest.mark.parametrize(("dtype", "exact"), [(torch.bfloat16, False), (torch.float16, True)])
def test_quantize_qkv_grad_input_rows(dtype, exact, device) -> None:
    """``grad_qk="input"``: ``q_rows``/``k_rows`` hold the reference's ``grad_operand`` of Q
    and K bit for bit (via ``to_reference``), rows of padding zero, every code as ``mxfp8``'s;
    the codes recipe's ``k_rows`` are K's codes."""
    lens = (1, 63, 100, 37, 0, 5)
    q, k, v, cu, _ms = make_pack(lens, 4, 2, 64, seed=6, device=device)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    kw = dict(exact_causal=exact, with_transposed=True, q_rows=True, k_rows=True)
    got = quantize_qkv(q, k, v, cu, recipe="mxfp8_grad_input", **kw)
    codes = quantize_qkv(q, k, v, cu, recipe="mxfp8", **kw)
    assert got.grad_input and not codes.grad_input
    ref = reference_quantize_qkv(q.cpu(), k.cpu(), v.cpu(), cu.cpu(), RECIPES["mxfp8_grad_input"],
                                 exact)  # fmt: skip
    mine = got.to_reference()
    assert torch.equal(mine.q_grad.cpu(), ref.q_grad) and torch.equal(mine.k_grad.cpu(), ref.k_grad)
    assert not torch.equal(ref.q_grad.float(), ref.q8.codes.float())
    used = v_t_key(token_columns(cu, got.doc_v_t_start, q.shape[0]))
    others = torch.ones(got.k_rows.shape[0], dtype=torch.bool, device=used.device)
    others[used] = False
    assert not bool(got.q_rows[others].any()) and not bool(got.k_rows[others].any())
    assert torch.equal(codes.k_rows[used].float(), codes.k_codes.float())
    for name in ("q_codes", "k_codes", "k_t", "v_t"):
        a, b = getattr(got, name), getattr(codes, name)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    with pytest.raises(ValueError, match="q_rows/k_rows"):
        quantize_qkv(q, k, v, cu, recipe="mxfp8_grad_input", k_rows=True)


def test_grad_input_backward_errors(device) -> None:
    """The backward refuses operands quantized for the other ``grad_qk`` and a
    grad_qk="input" quantization without its rows; the CuTe kernel takes the recipe on its
    own layout only, reading Q as BF16 rows at every head dim."""
    q, k, v, cu, _ms = make_pack((40, 9), 2, 1, 64, seed=2, device=device)
    rows = quantize_qkv(q, k, v, cu, recipe="mxfp8_grad_input", with_transposed=True,
                        q_rows=True, k_rows=True)  # fmt: skip
    no_rows = quantize_qkv(q, k, v, cu, recipe="mxfp8_grad_input", with_transposed=True)
    out, m, lse = attn_fwd(rows, cu, heads_q=2, causal=True, softmax_scale=0.125)
    qdo = quantize_do(torch.randn_like(out), out, m, lse, cu)
    call = dict(heads_q=2, causal=True, softmax_scale=0.125)
    with pytest.raises(ValueError, match=r"grad_qk='codes'.*grad_qk=input"):
        attn_bwd(rows, qdo, m, lse, cu, recipe="mxfp8", **call)
    with pytest.raises(ValueError, match="q_rows=True and k_rows=True"):
        attn_bwd(no_rows, qdo, m, lse, cu, recipe="mxfp8_grad_input", **call)
    with pytest.raises(ValueError, match="multiple of 128"):  # the CuTe kernel's layout
        attn_bwd(rows, qdo, m, lse, cu, recipe="mxfp8_grad_input",
                 config=BwdConfig(kernel="cute"), **call)  # fmt: skip
    # the CuTe backward reads Q (and Ĝ) as BF16 rows for this recipe at every head dim
    cute = BwdConfig(kernel="cute")
    assert bwd_reads_rows(cute, 64, grad_input=True) and not bwd_reads_rows(cute, 64)
    assert not bwd_reads_rows(BwdConfig(), 128, grad_input=True)
    dq, dk, _dv = attn_bwd(rows, qdo, m, lse, cu, recipe="mxfp8_grad_input", **call)
    assert bool(dq.abs().sum() > 0) and bool(dk.abs().sum() > 0)


@pytest.mark.parametrize(
    ("two_pass", "exact"), [(False, False), (True, True)], ids=["online", "two_pass-exact"]
)
def test_p_hat_forward_backward_bit_identical(two_pass, exact, device) -> None:
    """DESIGN N5: the backward rebuilds the forward's P̂ bit for bit. Integer-valued inputs
    make every score exact in FP32 whatever the MMA's summation order. With the online
    (integer running maximum) forward, tiles quantized against a smaller maximum differ
    only below 2^-14 of the row maximum (E4M3 subnormals of P'·2^8); these peaked inputs
    put a few percent of P̂ there (``benchmarks/bwd_numerics.py`` measures realistic ones)."""
    gen = torch.Generator().manual_seed(1)
    lens = (100, 1, 37)
    total = sum(lens)
    cu = torch.tensor([0, 100, 101, 138], dtype=torch.int32, device=device)

    def ints(h: int) -> torch.Tensor:
        x = torch.randint(-4, 5, (total, h, 64), generator=gen).to(torch.bfloat16)
        return x.to(device)

    q, k, v = ints(4), ints(2), ints(2)
    fwd, bwd = debug_p_hat(q, k, v, cu, exact_causal=exact, two_pass=two_pass, softmax_scale=0.05)
    assert int((bwd > 0).sum()) > 0.3 * 4 * sum(n * (n + 1) // 2 for n in lens)
    differ = fwd != bwd
    if two_pass:
        assert not bool(differ.any())
    else:  # only E4M3 subnormals (and their round-up to 2^-6), by at most one subnormal step
        assert bool((bwd[differ] <= 2**-6).all())
        assert float((fwd - bwd).abs().max()) <= 2**-9


def test_key_work_list_by_document_and_complete() -> None:
    """Default order: documents longest first (equal ones by index), each one's key tiles
    side by side, most query steps first; every tile once; empty slots last."""
    cu = torch.tensor([0, 300, 300, 301, 1000, 1300], dtype=torch.int32)
    work = build_key_work_list(cu, 1300, block_n=64, block_m=32, causal=True)
    n = int(work.count)
    items = list(zip(work.doc[:n].tolist(), work.tile[:n].tolist(), strict=True))
    expected = [(3, t) for t in range(11)] + [(0, t) for t in range(5)]
    assert items == expected + [(4, t) for t in range(5)] + [(2, 0)]
    assert n < work.num_slots  # padding slots exist and are not counted


@pytest.mark.parametrize("by", ["cost", "document"])
def test_key_work_list_orders_are_permutations(by: str, monkeypatch) -> None:
    monkeypatch.setattr(schedule, "KEY_WORK_ORDER", by)
    cu = torch.tensor([0, 300, 300, 301, 1000], dtype=torch.int32)
    work = build_key_work_list(cu, 1000, block_n=64, block_m=32, causal=True)
    n = int(work.count)
    items = sorted(zip(work.doc[:n].tolist(), work.tile[:n].tolist(), strict=True))
    assert items == [(0, t) for t in range(5)] + [(2, 0)] + [(3, t) for t in range(11)]
    lengths = (cu[1:] - cu[:-1]).long()[work.doc[:n].long()]
    cost = (lengths - work.tile[:n].long() * 64 + 31) // 32
    if by == "cost":
        assert bool((cost[:-1] >= cost[1:]).all())
    else:  # within each document most steps first, documents never interleaved
        docs = work.doc[:n]
        assert int((docs[1:] != docs[:-1]).sum()) == 2
        same = docs[1:] == docs[:-1]
        assert bool((cost[:-1][same] >= cost[1:][same]).all())


def test_key_work_list_by_document_in_rounds(monkeypatch) -> None:
    """``KEY_ORDER_CHUNK`` = 2: the two longest tiles of every document (documents longest
    first), then the next two of each, and so on; every tile once."""
    monkeypatch.setattr(schedule, "KEY_ORDER_CHUNK", 2)
    cu = torch.tensor([0, 300, 600, 601, 1000], dtype=torch.int32)
    work = build_key_work_list(cu, 1000, block_n=64, block_m=32, causal=True)
    n = int(work.count)
    items = list(zip(work.doc[:n].tolist(), work.tile[:n].tolist(), strict=True))
    assert items == [
        (3, 0), (3, 1), (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (3, 2), (3, 3), (0, 2),
        (0, 3), (1, 2), (1, 3), (3, 4), (3, 5), (0, 4), (1, 4), (3, 6),
    ]  # fmt: skip
    monkeypatch.setattr(schedule, "KEY_ORDER_CHUNK", -1)
    with pytest.raises(ValueError, match="chunk -1"):
        build_key_work_list(cu, 1000, block_n=64, block_m=32, causal=True)


def test_work_order_refuses_unknown_order(monkeypatch) -> None:
    monkeypatch.setattr(schedule, "KEY_WORK_ORDER", "random")
    cu = torch.tensor([0, 300], dtype=torch.int32)
    with pytest.raises(ValueError, match="work order 'random'"):
        build_key_work_list(cu, 300, block_n=64, block_m=32, causal=True)


def _grads(fn, q, k, v, d_out):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    out.backward(d_out.to(out.dtype))
    return [out.detach(), *(x.grad for x in leaves)]


def test_work_order_does_not_change_results(device, monkeypatch) -> None:
    """The order CTAs take work-list items in is a schedule only: O, dK and dV come out bit
    for bit the same (dQ too here; on a GPU its FP32 adds may land in another order). Each
    order gets its own plan (a plan keeps the lists it built), and the lists do differ."""
    q, k, v, cu, ms = make_pack((70, 1, 130, 33, 200), 4, 2, 64, seed=5, device=device)
    d_out = torch.randn_like(q)
    results, lists = [], []
    for by in ("cost", "document"):
        monkeypatch.setattr(schedule, "QUERY_WORK_ORDER", by)
        monkeypatch.setattr(schedule, "KEY_WORK_ORDER", by)
        plan = plan_varlen(cu, q.shape[0], ms)
        results.append(_grads(lambda *x, p=plan: flamia_attn_varlen(*x, cu, ms, plan=p), q, k,
                              v, d_out))  # fmt: skip
        (call,) = plan.calls.values()  # the one gradient-enabled call of this plan
        lists.append(list(zip(call.bwd_work.doc.tolist(), call.bwd_work.tile.tolist(),
                              strict=True)))  # fmt: skip
    assert lists[0] != lists[1] and sorted(lists[0]) == sorted(lists[1])
    (o, dq, dk, dv), (o2, dq2, dk2, dv2) = results
    assert torch.equal(o, o2) and torch.equal(dk, dk2) and torch.equal(dv, dv2)
    if q.is_cuda:
        torch.testing.assert_close(dq, dq2, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(dq, dq2)


@pytest.mark.parametrize("zero_v", [False, True])
@pytest.mark.parametrize("recipe", ["mxfp8", "mixed_nvfp4", "mxfp8_grad_input"])
def test_autograd_as_accurate_as_reference(recipe, zero_v, device) -> None:
    """``loss.backward()`` through the kernels: against float64 autograd the kernel path is
    as accurate as the reference twin (and close to it); ``zero_v``: some keys' V rows are
    zero (they keep their probability in the normaliser, N3)."""
    q, k, v, cu, ms = make_pack((100, 1, 45), 2, 1, 64, seed=3, device=device)
    if zero_v:
        v[:40] = 0
        v[120] = 0
    d_out = torch.randn_like(q)
    kern = _grads(lambda *a: flamia_attn_varlen(*a, cu, ms, recipe=recipe), q, k, v, d_out)
    ref = _grads(lambda *a: attention(*a, cu, ms, recipe=recipe), q, k, v, d_out)
    exact = _grads(lambda *a: attention_float64(*a, cu, ms), q, k, v, d_out)
    floor = 0.997 if recipe.startswith("mxfp8") else 0.99
    for name, a, r, e in zip(("o", "dq", "dk", "dv"), kern, ref, exact, strict=True):
        cos_k = torch.nn.functional.cosine_similarity(a.double().flatten(), e.double().flatten(), 0)
        cos_r = torch.nn.functional.cosine_similarity(r.double().flatten(), e.double().flatten(), 0)
        assert float(cos_k) >= float(cos_r) - 2e-4, name
        assert float(cos_k) >= floor, (name, float(cos_k))
        assert _rel(a, r) <= 3e-2, name


def test_eager_backward_gets_no_zero_gradients_for_the_statistics(device, monkeypatch) -> None:
    """M and lse are not differentiable: the eager backward receives None for them (autograd
    would otherwise allocate and fill two [T, Hq] zero tensors per layer and step), with or
    without ``return_stats``, and its gradients are unchanged."""
    from flamia_serve.custom_ops import EagerAttention

    seen = []
    backward = EagerAttention.backward

    def recording(ctx, d_out, d_m, d_lse):
        seen.append((d_out is None, d_m, d_lse))
        return backward(ctx, d_out, d_m, d_lse)

    monkeypatch.setattr(EagerAttention, "backward", staticmethod(recording))
    q, k, v, cu, ms = make_pack((9, 1, 6), 2, 1, 64, seed=4, device=device)
    d_out = torch.randn_like(q)
    plain = _grads(lambda *a: flamia_attn_varlen(*a, cu, ms), q, k, v, d_out)
    stats = _grads(lambda *a: flamia_attn_varlen(*a, cu, ms, return_stats=True)[0], q, k, v, d_out)
    assert seen == [(False, None, None)] * 2
    tol = 1e-2 if q.is_cuda else 0  # dQ: FP32 atomics on a GPU
    for a, b in zip(plain, stats, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol / 10)


def test_torch_compile_fullgraph(device) -> None:
    """A function calling the op compiles with fullgraph=True (AOTAutograd traces the
    custom ops' fake implementations, forward and backward) and matches eager."""
    q, k, v, cu, ms = make_pack((40, 25), 2, 1, 64, seed=4, device=device)
    plan = plan_varlen(cu, 65, ms)

    def step(q, k, v):
        return (flamia_attn_varlen(q, k, v, cu, ms, plan=plan).float() ** 2).sum()

    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    compiled(*leaves).backward()
    eager = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    step(*eager).backward()
    bound = 1e-2 if device == "cuda" else 0.0  # dQ's FP32 atomics sum in any order on a GPU
    for a, b in zip(leaves, eager, strict=True):
        assert _rel(a.grad, b.grad) <= bound


def test_grad_errors(device) -> None:
    q, k, v, cu, ms = make_pack((20, 40), 4, 2, 64, device=device)
    custom = Recipe("mine", token_block=64)
    with pytest.raises(ValueError, match="kernel path runs the presets"):
        flamia_attn_varlen(q, k, v, cu, ms, recipe=custom)
    with pytest.raises(ValueError, match="dq_ds_block"):
        flamia_attn_varlen(q.requires_grad_(), k, v, cu, ms, bwd_config=BwdConfig(block_n=128))
    qkv = quantize_qkv(q.detach(), k, v, cu)
    out, m, lse = attn_fwd(qkv, cu, heads_q=4, causal=True, softmax_scale=0.125)
    with pytest.raises(ValueError, match="with_transposed=True"):
        attn_bwd(qkv, quantize_do(q.detach(), out, m, lse, cu), m, lse, cu, heads_q=4,
                 causal=True, softmax_scale=0.125)  # fmt: skip


def test_functorch_transforms_are_refused(device) -> None:
    """``torch.func`` transforms of an eager call raise (the autograd function has no
    ``setup_context``), as ``autograd.Function.apply`` does, instead of running untracked."""
    q, k, v, cu, ms = make_pack((9, 4), 2, 1, 64, seed=5, device=device)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda x: flamia_attn_varlen(x, k, v, cu, ms).float().sum())(q)


def test_kernel_path_needs_gpu_or_interpreter(monkeypatch) -> None:
    q, k, v, cu, ms = make_pack((20,), 2, 1, 64)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    message = r"needs CUDA tensors.*flamia_serve\.reference\.attention"
    with pytest.raises(RuntimeError, match=message):
        flamia_attn_varlen(q, k, v, cu, ms)


def test_transformers_llama_flamia_matches_reference_path(device) -> None:
    """A tiny Llama with ``attn_implementation="flamia"`` trains through the kernels: loss and
    gradients equal those of the same model on the reference path (packed documents from
    ``position_ids``; GQA; the FP32 Q/K that Llama hands over are cast to BF16)."""
    pytest.importorskip("transformers")
    from tests.train.test_hf import tiny_llama

    model = tiny_llama(flamia_recipe="mxfp8").to(device)
    ids = torch.randint(0, 64, (1, 50), device=device)
    pos = torch.cat([torch.arange(20), torch.arange(30)])[None].to(device)
    results = []
    for path in ("kernel", "reference"):
        model.config.flamia_path = path
        model.zero_grad()
        loss = model(input_ids=ids, position_ids=pos, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_k, grads_k), (loss_r, grads_r) = results
    assert torch.isfinite(loss_k)
    assert float((loss_k - loss_r).abs()) <= 1e-3 * float(loss_r.abs())
    for name, g in grads_k.items():
        assert _rel(g, grads_r[name]) <= 3e-2, name


def test_transformers_llama_flamia_padded_batch_packs_once(device, monkeypatch) -> None:
    """A padded batch (2-D attention mask) through the kernels: its packing and plan are made
    once per forward and shared by the layers, with the results of packing at every layer
    (bit for bit on the CPU; dQ's atomics on a GPU) and the reference path's loss."""
    pytest.importorskip("transformers")
    import flamia_serve.train.hf as hf
    from tests.train.test_hf import tiny_llama

    model = tiny_llama(flamia_recipe="mxfp8", num_hidden_layers=2).to(device)
    ids = torch.randint(0, 64, (2, 24), device=device)
    mask = torch.ones(2, 24, dtype=torch.long, device=device)
    mask[1, 15:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    packings = []
    put, get = hf._UNPADDED.put, hf._UNPADDED.get

    def recorded(source, value) -> None:
        packings.append(value[0])
        put(source, value)

    monkeypatch.setattr(hf._UNPADDED, "put", recorded)
    results = []
    for path, reuse in (("kernel", True), ("kernel", False), ("reference", True)):
        monkeypatch.setattr(hf._UNPADDED, "get", get if reuse else lambda source: None)
        model.config.flamia_path = path
        model.zero_grad()
        packings.clear()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        assert len(packings) == (1 if reuse else 2)  # per forward / per layer
        if reuse and path == "kernel":  # both layers ran on the one packing's plan
            ((_idx, _cu, _ms, plan),) = packings
            assert plan is not None and len(plan.calls) == 1
    (loss_k, grads_k), (loss_f, grads_f), (loss_r, _grads_r) = results
    exact = device == "cpu"
    torch.testing.assert_close(loss_k, loss_f, rtol=0 if exact else 1e-3, atol=0)
    for g, f in zip(grads_k, grads_f, strict=True):
        torch.testing.assert_close(g, f, rtol=0 if exact else 2e-2, atol=0 if exact else 1e-5)
    assert float((loss_k - loss_r).abs()) <= 1e-3 * float(loss_r.abs())


def test_training_entry_point_errors(device) -> None:
    """Bad choices of the training entry points fail by name before any work."""
    from types import SimpleNamespace

    from flamia_serve.train import FlamiaAttention, flamia_attention
    from flamia_serve.train.hf import flamia_attention_forward

    with pytest.raises(ValueError, match="path must be one of"):
        FlamiaAttention(path="gpu")
    q, k, v, cu, _ms = make_pack((20, 12), 2, 1, 64)
    with pytest.raises(ValueError, match="max_seqlen is required"):
        flamia_attention(q, k, v, cu)
    with pytest.raises(ValueError, match=r"q must be \[B, S, Hq, d\]"):
        flamia_attention(q, k, v)
    q4, k4 = q[:16].view(2, 8, 2, 64), k[:16].view(8, 2, 1, 64)
    with pytest.raises(ValueError, match=r"share \[B, S\]"):
        flamia_attention(q4, k4, k4, path="reference")
    for shape in ((2, 0), (0, 5)):  # nothing to attend: empty outputs, no error
        empty_q, empty_k = (torch.zeros(*shape, h, 64, dtype=q.dtype) for h in (2, 1))
        for out in (flamia_attention(empty_q, empty_k, empty_k, path="reference"),
                    flamia_attn(empty_q, empty_k, empty_k)):  # fmt: skip
            assert out.shape == (*shape, 2, 64)
    module = SimpleNamespace(config=SimpleNamespace(), is_causal=True)
    query = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)
    key = torch.zeros(1, 1, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="no dropout"):
        flamia_attention_forward(module, query, key, key, None, dropout=0.1)
    with pytest.raises(NotImplementedError, match="KV cache"):
        flamia_attention_forward(module, query[:, :, :1], key, key, None)
    for name, value in (("softcap", 30.0), ("s_aux", torch.zeros(2)), ("sliding_window", 4)):
        with pytest.raises(NotImplementedError, match=name):
            flamia_attention_forward(module, query, key, key, None, **{name: value})
    # a window no document exceeds changes nothing: accepted
    out, _ = flamia_attention_forward(module, query, key, key, None, sliding_window=8)
    assert out.shape == (1, 8, 2, 64)
    big = torch.zeros(2049, 2, 64, dtype=torch.bfloat16, device=device)
    cu_big = torch.tensor([0, 2049], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="T must be <= 2048"):
        debug_p_hat(big, big[:, :1], big[:, :1], cu_big)


def test_backward_op_reads_the_cute_layout(device) -> None:
    """``flamia::attn_varlen_bwd`` with the CuTe forward's 128-column layout (what autograd
    passes after a CuTe forward): the same gradients as with the default layout, which
    moves columns, not codes (bit for bit on the CPU; the GPU's dQ atomics reorder sums)."""
    lens = (5, 130, 1, 40)
    q, k, v, cu, ms = make_pack(lens, 4, 2, 64, seed=3, device=device)
    d_out = make_pack(lens, 4, 2, 64, seed=4, device=device)[0]
    plan = plan_varlen(cu, q.shape[0], ms)
    out, m, lse = attn_fwd(quantize_qkv(q, k, v, cu), cu, heads_q=4, causal=True,
                           softmax_scale=0.125)  # fmt: skip
    grads = {}
    for align in (16, 128):  # on sm_90 with the cute extra: Triton, then the CuTe backward
        bcfg = BwdConfig() if align == 16 else default_bwd_config(64, q.device)
        bw = plan.key_work_list(bcfg.work_block_n, bcfg.block_m, True)
        b = plan.token_blocks(align)
        assert plan.token_blocks(align) is b  # cached per alignment
        grads[align] = torch.ops.flamia.attn_varlen_bwd(
            d_out, q, k, v, out, m, lse, cu, [b.start, b.length, b.v_t_start, b.doc_v_t_start],
            [bw.doc, bw.tile, bw.count], True, "mxfp8", False, 0.125, bcfg.to_ints(), align,
        )  # fmt: skip
    assert bool((plan.token_blocks(128).doc_v_t_start % 128 == 0).all())
    for a, b in zip(grads[16], grads[128], strict=True):
        assert bool(torch.isfinite(a).all())
        if device == "cpu":
            assert torch.equal(a, b)
        else:  # another kernel there, and dQ's atomics: within the kernels' 1.4e-5
            assert _rel(b, a) <= 3e-5


def test_attn_call_errors(device) -> None:
    """The implementations behind both entry points refuse calls they cannot run: a forward
    without its config (or with one of another column layout), custom-op arguments of a
    backward-only call, a backward of a forward that ran without gradients."""
    import dataclasses

    from flamia_serve.custom_ops import (
        AttnCall,
        attention_backward,
        attention_forward,
        op_arguments,
    )
    from flamia_serve.kernels.attn_fwd.ops import default_config
    from flamia_serve.numerics import RECIPES

    q, k, v, cu, ms = make_pack((20, 40), 4, 2, 64, device=device)
    plan = plan_varlen(cu, q.shape[0], ms)
    cfg, bcfg = default_config(64, q.device), default_bwd_config(64, q.device)
    call = AttnCall(
        plan.token_blocks(cfg.column_align), cfg.column_align,
        plan.work_list(cfg.block_m, cfg.block_n, True), None, True, RECIPES["mxfp8"], False,
        0.125, cfg, bcfg,
    )  # fmt: skip
    with pytest.raises(ValueError, match="needs the forward config"):
        attention_forward(q, k, v, cu, dataclasses.replace(call, config=None))
    other_align = 128 if cfg.column_align != 128 else 16  # the GPU's default reads 128
    with pytest.raises(ValueError, match="needs the forward config"):
        attention_forward(q, k, v, cu, dataclasses.replace(call, column_align=other_align))
    with pytest.raises(ValueError, match="needs a forward call"):
        op_arguments(dataclasses.replace(call, work=None))
    out, m, lse = attention_forward(q, k, v, cu, call)
    with pytest.raises(RuntimeError, match="without gradients"):
        attention_backward(torch.randn_like(q), q, k, v, out, m, lse, cu, call)


def test_attn_call_backward_layout(device) -> None:
    """The backward quantizes into the forward's layout when its alignment is a multiple of
    the backward kernel's, else into its own (``bwd_blocks``, carried by the custom ops'
    arguments); a call that needs its own and lacks it is refused."""
    import dataclasses

    from flamia_serve.custom_ops import AttnCall, op_arguments
    from flamia_serve.kernels.attn_bwd.ops import CUTE_BWD_CONFIG
    from flamia_serve.kernels.attn_fwd.ops import default_config
    from flamia_serve.numerics import RECIPES

    q, _k, _v, cu, ms = make_pack((20, 40), 4, 2, 64, device=device)
    plan = plan_varlen(cu, q.shape[0], ms)
    cfg = default_config(64, q.device, kernel="triton")
    fwd_blocks, cute_blocks = plan.token_blocks(16), plan.token_blocks(128)
    call = AttnCall(
        fwd_blocks, 16, plan.work_list(cfg.block_m, cfg.block_n, True),
        plan.key_work_list(128, 32, True), True, RECIPES["mxfp8"], False, 0.125, cfg,
        CUTE_BWD_CONFIG,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"aligned to 128 columns.*aligned to 16"):
        call.backward_layout()
    own = dataclasses.replace(call, bwd_blocks=cute_blocks)
    assert own.backward_layout() == (cute_blocks, 128, None)
    assert op_arguments(own)[3] == cute_blocks.tensors()
    assert op_arguments(call)[3] == []
    triton_bwd = dataclasses.replace(call, bwd_config=BwdConfig())
    assert triton_bwd.backward_layout()[:2] == (fwd_blocks, 16)
    wide = dataclasses.replace(triton_bwd, blocks=cute_blocks, column_align=128)
    assert wide.backward_layout()[:2] == (cute_blocks, 128)  # Triton reads any 16-multiple
    assert bool((cute_blocks.doc_v_t_start % 128 == 0).all())


def test_bwd_refuses_dO_quantized_on_another_column_layout(device) -> None:
    """qkv on the CuTe forward's 128-column layout, qdo on the default 16: a clear error
    naming both layouts (Ĝ's columns would be read at qkv's positions: garbage)."""
    q, k, v, cu, _ = make_pack((70, 5), 2, 1, 64, seed=1, device=device)
    qkv = quantize_qkv(q, k, v, cu, with_transposed=True, column_align=128)
    out, m, lse = attn_fwd(qkv, cu, heads_q=2, causal=True, softmax_scale=0.125)
    qdo = quantize_do(torch.randn_like(out), out, m, lse, cu)
    with pytest.raises(ValueError, match=r"column_align 16.*not qkv's \(128"):
        attn_bwd(qkv, qdo, m, lse, cu, heads_q=2, causal=True, softmax_scale=0.125)
    qdo = quantize_do(torch.randn_like(out), out, m, lse, cu, column_align=128)
    # Ĝ's columns between a document's 16-padded and 128-padded end are zero codes
    pad = qdo.g_t.view(torch.uint8)[:, :, 80:128]
    assert int(pad.count_nonzero()) == 0


def test_triton_bwd_refuses_operands_quantized_as_rows(device) -> None:
    """Q̂ / Ĝ quantized only as the CuTe backward's BF16 rows: the Triton backward, which
    reads their column copies, names what is missing instead of reading ``None``."""
    q, k, v, cu, _ = make_pack((70, 5), 2, 1, 64, seed=1, device=device)
    kw = dict(with_transposed=True, column_align=128)
    rows = quantize_qkv(q, k, v, cu, q_rows=True, q_transposed=False, **kw)
    out, m, lse = attn_fwd(rows, cu, heads_q=2, causal=True, softmax_scale=0.125)
    qdo = quantize_do(torch.randn_like(out), out, m, lse, cu, column_align=128)
    g_rows = quantize_do(torch.randn_like(out), out, m, lse, cu, column_align=128,
                         g_rows=True, g_columns=False)  # fmt: skip
    columns = quantize_qkv(q, k, v, cu, **kw)
    triton = BwdConfig()
    for qkv_, qdo_ in ((rows, qdo), (columns, g_rows)):
        with pytest.raises(ValueError, match=r"qkv\.q_t and qdo\.g_t"):
            attn_bwd(qkv_, qdo_, m, lse, cu, heads_q=2, causal=True, softmax_scale=0.125,
                     config=triton)  # fmt: skip


def test_bwd_config_kernel_choice_and_round_trip(device) -> None:
    """Off sm_90 (or without the cute extra) the default is Triton; an explicit CuTe config
    is refused with the reason; configs survive the custom op's int encoding."""
    q, k, v, cu, _ = make_pack((40,), 2, 1, 64, seed=1, device=device)
    qkv = quantize_qkv(q, k, v, cu, with_transposed=True, column_align=128)
    out, m, lse = attn_fwd(qkv, cu, heads_q=2, causal=True, softmax_scale=0.125)
    qdo = quantize_do(torch.randn_like(out), out, m, lse, cu, column_align=128)
    cute = BwdConfig(kernel="cute")
    if device == "cpu":
        assert default_bwd_config(64, torch.device("cpu")).kernel == "triton"
        with pytest.raises(ValueError, match="sm_90 GPU"):
            attn_bwd(qkv, qdo, m, lse, cu, heads_q=2, causal=True, softmax_scale=0.125,
                     config=cute)  # fmt: skip
    with pytest.raises(ValueError, match="with_dq=False"):
        attn_bwd(qkv, qdo, m, lse, cu, heads_q=2, causal=True, softmax_scale=0.125,
                 config=cute, with_dq=False)  # fmt: skip
    with pytest.raises(ValueError, match=r"\(block_m, block_n\) = \(32, 64\)"):
        attn_bwd(qkv, qdo, m, lse, cu, heads_q=2, causal=True, softmax_scale=0.125,
                 config=BwdConfig(block_n=128, kernel="cute"),
                 recipe=Recipe("wide", dq_ds_block=(32, 128)))  # fmt: skip
    with pytest.raises(ValueError, match=r"< 2\^31"):  # int32 dQ addressing in the kernel
        attn_bwd(qkv, qdo, m, lse, cu, heads_q=2**20, causal=True, softmax_scale=0.125,
                 config=cute)  # fmt: skip
    for bad, match in ((BwdConfig(head_dim_parts=3), "must be 1, 2 or 4"),
                       (BwdConfig(head_dim_parts=2, kernel="cute"), "1 with kernel='cute'"),
                       (BwdConfig(head_dim_parts=4), "16 head-dim columns per program")):
        with pytest.raises(ValueError, match=match):
            attn_bwd(qkv, qdo, m, lse, cu, heads_q=2, causal=True, softmax_scale=0.125,
                     config=bad)  # fmt: skip
    for cfg in (cute, BwdConfig(), BwdConfig(kernel="cute", num_stages=3),
                BwdConfig(num_warps=8, head_dim_parts=2)):  # fmt: skip
        assert BwdConfig.from_ints(cfg.to_ints()) == cfg
    assert cute.work_block_n == 128 and BwdConfig().work_block_n == 64


def test_default_bwd_config_picks_the_cute_kernel_where_it_runs(monkeypatch) -> None:
    """Where the CuTe kernels run, the backward is CuTe at d 64/128/256 (E4M3 or NVFP4 Q/K)
    whatever layout the forward read (it quantizes into its own, ``BwdConfig.column_align``),
    except on packs of documents under ``CUTE_BWD_MIN_MEAN_DOCUMENT`` tokens on average and with
    ``kernel="triton"``; without the cute extra, always Triton."""
    from flamia_serve.kernels.attn_bwd import ops as bwd_ops

    gpu = torch.device("cuda")
    monkeypatch.setattr(bwd_ops, "_cute_available", lambda device: True)
    for d in (64, 128, 256):
        assert default_bwd_config(d, gpu) == bwd_ops.CUTE_BWD_CONFIG
        assert default_bwd_config(d, gpu, qk_nvfp4=True) == bwd_ops.CUTE_BWD_CONFIG
        assert default_bwd_config(d, gpu, mean_doc_len=14).kernel == "cute"  # P1's
    assert bwd_ops.CUTE_BWD_CONFIG.column_align == 128 and BwdConfig().column_align == 16
    short = dict(mean_doc_len=bwd_ops.CUTE_BWD_MIN_MEAN_DOCUMENT - 0.5)
    for kw in (short, dict(kernel="triton"), dict(qk_nvfp4=True, **short)):
        assert default_bwd_config(128, gpu, **kw) == BwdConfig(), kw
    assert default_bwd_config(96, gpu) == BwdConfig()
    for d in (64, 128, 256):  # the BF16 dQ form (measured on the H200, 2026-12-05)
        assert default_bwd_config(d, gpu, grad_input=True) == bwd_ops.CUTE_BWD_CONFIG
    d256 = BwdConfig(num_warps=4, head_dim_parts=2)
    assert default_bwd_config(256, gpu, kernel="triton") == d256
    with pytest.raises(ValueError, match="kernel must be None or 'triton'"):
        default_bwd_config(128, gpu, kernel="cute")
    monkeypatch.setattr(bwd_ops, "_cute_available", lambda device: False)
    assert default_bwd_config(128, gpu) == BwdConfig()


def test_cute_kernels_take_nvfp4_only_widened(device) -> None:
    """NVFP4 Q/K (mixed recipes) reach the CuTe kernels only as the quantizer's widened BF16
    values: an explicit CuTe config on codes quantized without ``widen=True`` is refused by
    name before any device check (as is the forward's 128-key tile at d = 256), and without
    a config the kernels fall back to Triton."""
    from flamia_serve.kernels.attn_bwd.ops import CUTE_BWD_CONFIG
    from flamia_serve.kernels.attn_fwd.ops import CUTE_CONFIG, CUTE_CONFIG_D256

    q, k, v, cu, _ms = make_pack((70, 20), 2, 1, 64, seed=3, device=device)
    qkv = quantize_qkv(q, k, v, cu, recipe="mixed_nvfp4", column_align=128, with_transposed=True)
    assert qkv.q_wide is None
    with pytest.raises(ValueError, match="widen=True"):
        attn_fwd(qkv, cu, heads_q=2, causal=True, softmax_scale=0.125, config=CUTE_CONFIG)
    out, m, lse = attn_fwd(qkv, cu, heads_q=2, causal=True, softmax_scale=0.125)
    qdo = quantize_do(torch.randn_like(out), out, m, lse, cu, recipe="mixed_nvfp4",
                      column_align=128)  # fmt: skip
    with pytest.raises(ValueError, match="widen=True"):
        attn_bwd(qkv, qdo, m, lse, cu, heads_q=2, causal=True, softmax_scale=0.125,
                 recipe="mixed_nvfp4", config=CUTE_BWD_CONFIG)  # fmt: skip
    q, k, v, cu, _ms = make_pack((40,), 2, 1, 256, seed=3, device=device)
    wide = quantize_qkv(q, k, v, cu, recipe="mixed_nvfp4", column_align=128, widen=True)
    assert wide.q_wide is not None
    with pytest.raises(ValueError, match="takes block_n 64"):
        attn_fwd(wide, cu, heads_q=2, causal=True, softmax_scale=0.1, config=CUTE_CONFIG_D256)
