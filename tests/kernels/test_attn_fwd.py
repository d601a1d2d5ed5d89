"""Forward kernel against the reference twin, leakage, work list, public API errors.

Tolerance (accumulation order): the kernel sums P̂·V̂ in a different order, rounds O to BF16
once, and (online mode) quantizes early tiles against a smaller running maximum, which can
change P̂ only in E4M3's subnormal range. Bound: ‖O − O_ref‖/‖O_ref‖ <= 5e-3 and
max|O − O_ref| <= 2^-5 · max|O_ref|; the base-2 lse within 1e-4. On Hopper the FP8
``wgmma`` accumulates Q̂·K̂ᵀ with ~14 mantissa bits and ``ex2.approx`` differs from the exact
exp2 by ~2 ulp, which now and then flips the E4M3 rounding of a P̂ element (P̂·V̂ is promoted
to FP32 once per key tile). The normaliser sums P̂ itself (N3), so a flip on a row's dominant
key moves that row's O by up to one E4M3 step of its weight (seen: 6.6% of max|O|) and its
lse by up to log2(1 + 2^-3) (seen: 0.1699, H200). GPU bounds: ‖O − O_ref‖/‖O_ref‖ <= 1e-2,
max <= 2^-3 · max|O_ref|; lse within 2e-3 on 95% of rows (seen: 98.1-98.7%), within
log2(1 + 2^-3) + 2e-3 on all. The integer row reference ``M = ceil(max y)`` can differ by
one where the row max sits within rounding of an integer (the MMA sums in another order): at
most 1, on under 1% of rows.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from flamia_serve import flamia_attn, flamia_attn_varlen, plan_varlen
from flamia_serve.kernels import schedule
from flamia_serve.kernels.attn_fwd import ops as fwd_ops
from flamia_serve.kernels.attn_fwd.ops import (
    CUTE_CONFIG,
    SHORT_DOCUMENTS,
    FwdConfig,
    attn_fwd,
    cute_available,
    default_config,
)
from flamia_serve.kernels.quant.ops import quantize_qkv
from flamia_serve.kernels.schedule import build_short_windows, build_work_list
from flamia_serve.probes import cross_document_leakage, future_leakage, make_pack
from flamia_serve.reference import attention_forward


def test_default_config_runs_short_document_packs_on_triton(monkeypatch) -> None:
    """Where the CuTe kernel runs, packs of very short documents still get the Triton
    kernel with E4M3 Q/K (its 64-row tiles and 16-column alignment waste less on them; with
    NVFP4 Q/K its dequantization costs more), and packs of documents shorter than a tile
    put their short documents in windows (the CuTe kernel then quantizes the other
    documents' Q as ``WINDOWS_FUSED_Q`` says)."""
    monkeypatch.setattr(fwd_ops, "_cute_available", lambda device: True)
    for var in ("FLAMIA_FWD_KERNEL", "FLAMIA_FWD_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    gpu = torch.device("cuda")
    assert default_config(64, gpu) == CUTE_CONFIG
    # documents shorter than a tile on average: the short documents in windows
    short = dataclasses.replace(CUTE_CONFIG, quantize_q=fwd_ops.WINDOWS_FUSED_Q, windows=True)
    assert default_config(128, gpu, mean_doc_len=float(SHORT_DOCUMENTS)) == short
    assert default_config(128, gpu, mean_doc_len=fwd_ops.FUSED_Q_MIN_DOCUMENT - 0.5) == short
    assert default_config(128, gpu, mean_doc_len=float(fwd_ops.FUSED_Q_MIN_DOCUMENT)) == CUTE_CONFIG
    assert default_config(64, gpu, mean_doc_len=13.7).kernel == "triton"
    assert default_config(64, gpu, mean_doc_len=13.7).windows
    assert not default_config(64, gpu).windows  # no mean length: no windows
    assert not default_config(256, gpu, mean_doc_len=13.7).windows  # d = 256: none
    # NVFP4 Q/K: the CuTe kernel even on short documents (Q from the launch, no windows)
    nvfp4_short = default_config(128, gpu, qk_nvfp4=True, mean_doc_len=13.7)
    assert nvfp4_short == dataclasses.replace(CUTE_CONFIG, quantize_q=False)
    assert not default_config(64, torch.device("cpu"), mean_doc_len=13.7).windows
    assert default_config(64, gpu, mean_doc_len=13.7, kernel="cute") == CUTE_CONFIG
    assert default_config(256, gpu, mean_doc_len=4096.0) == fwd_ops.CUTE_CONFIG_D256
    assert default_config(256, gpu, kernel="triton").num_warps == 8  # d=256: two warpgroups
    # NVFP4 Q/K (mixed recipes): BF16 scores on the CuTe kernel, 64-key tiles at d = 256
    assert default_config(128, gpu, qk_nvfp4=True) == CUTE_CONFIG
    assert default_config(64, gpu, qk_nvfp4=True) == CUTE_CONFIG
    assert default_config(256, gpu, qk_nvfp4=True) == fwd_ops.CUTE_CONFIG_D256_NVFP4
    assert default_config(256, gpu, qk_nvfp4=True, kernel="cute").block_n == 64
    assert default_config(256, gpu, qk_nvfp4=True, mean_doc_len=13.7).kernel == "cute"


CASES = [
    # lens, hq, hkv, d, recipe, causal
    ((1, 63, 100, 37, 0, 5), 4, 2, 64, "mxfp8", True),
    ((1, 63, 100, 37, 0, 5), 4, 2, 64, "mxfp8", False),
    ((70, 33), 2, 2, 128, "mxfp8", True),
    ((45, 1, 50), 4, 1, 128, "mixed_nvfp4_hadamard", True),
    ((31, 40), 2, 1, 256, "mixed_nvfp4", False),
    ((40, 9), 2, 1, 256, "mxfp8", True),
]


def _check_close(out, m, lse, ref_out, ref_m, ref_lse) -> None:
    o, r = out.float().cpu(), ref_out.float().cpu()
    assert bool(torch.isfinite(o).all())
    rel_bound, max_bound = (1e-2, 2**-3) if out.is_cuda else (5e-3, 2**-5)
    assert float((o - r).norm() / r.norm()) <= rel_bound
    assert float((o - r).abs().max()) <= max_bound * float(r.abs().max())
    m_diff = (m.cpu() - ref_m.cpu()).abs()
    assert float(m_diff.max()) <= 1 and float((m_diff > 0).float().mean()) < 0.01
    lse_diff = (lse.cpu() - ref_lse.cpu()).abs()
    if not lse.is_cuda:
        assert float(lse_diff.max()) <= 1e-4
        return
    # Hopper's FP8 MMA sums Q̂K̂ᵀ with fewer bits than the twin's FP32 matmul. A score within
    # that error of an E4M3 rounding boundary of P' can round its P̂ one step the other way
    # (at most 2^-3 of that P̂); l sums P̂ (N3), so such a row's lse (log2 units) moves by at
    # most log2(1 + 2^-3) — the whole step when that P̂ dominates the row. Rows moved by more
    # than 2e-3: 1.3-1.9% in these tests on the H200; bound 5%.
    assert float(lse_diff.max()) <= math.log2(1 + 2**-3) + 2e-3
    assert float((lse_diff > 2e-3).float().mean()) < 0.05


@pytest.mark.parametrize("two_pass", [False, True], ids=["online", "two_pass"])
@pytest.mark.parametrize(
    ("lens", "hq", "hkv", "d", "recipe", "causal"),
    CASES,
    ids=[
        f"T{sum(c[0])}-HQ{c[1]}-H{c[2]}-D{c[3]}-{c[4]}-{'causal' if c[5] else 'full'}"
        for c in CASES
    ],
)
def test_fwd_matches_reference(lens, hq, hkv, d, recipe, causal, two_pass, device) -> None:
    q, k, v, cu, _ms = make_pack(lens, hq, hkv, d, seed=7, device=device)
    qkv = quantize_qkv(q, k, v, cu, recipe=recipe)
    # the Triton kernel's default tiles, also where the CuTe kernel is the default (its own
    # GPU tests: test_gpu_cute.py)
    base = default_config(d, q.device, qk_nvfp4=recipe != "mxfp8", kernel="triton")
    cfg = FwdConfig(base.block_m, base.block_n, base.num_warps, base.num_stages, True, two_pass,
                    base.maxnreg)  # fmt: skip
    out, m, lse = attn_fwd(qkv, cu, heads_q=hq, causal=causal, softmax_scale=d**-0.5, config=cfg)
    ref = attention_forward(
        qkv.to_reference(), cu, heads_q=hq, causal=causal, softmax_scale=d**-0.5
    )
    _check_close(out, m, lse, *ref)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("exact", [False, True], ids=["token_block", "per_token"])
def test_fwd_key_tiles_spanning_exponent_blocks(exact, causal, device) -> None:
    """Key tiles of 64 cover two 32-token K exponent blocks (one scalar load per block on
    the token-block recipe); documents not multiples of 32, one block much louder."""
    q, k, v, cu, _ms = make_pack((100, 1, 75, 33), 4, 2, 64, seed=9, device=device)
    k[40:64] *= 0.125  # the second block of the first document: its exponent is 3 lower
    qkv = quantize_qkv(q, k, v, cu, exact_causal=exact)
    assert qkv.k_exp_block == (1 if exact else 32)
    cfg = FwdConfig(block_m=64, block_n=64, num_warps=4, num_stages=1)
    out, m, lse = attn_fwd(qkv, cu, heads_q=4, causal=causal, softmax_scale=0.125, config=cfg)
    ref = attention_forward(qkv.to_reference(), cu, heads_q=4, causal=causal, softmax_scale=0.125)
    _check_close(out, m, lse, *ref)


def test_fwd_not_persistent_same_result(device) -> None:
    q, k, v, cu, _ms = make_pack((50, 20), 2, 1, 64, seed=3, device=device)
    qkv = quantize_qkv(q, k, v, cu)
    base = default_config(64, q.device, kernel="triton")
    outs = []
    for persistent in (True, False):
        cfg = FwdConfig(base.block_m, base.block_n, base.num_warps, base.num_stages, persistent)
        outs.append(attn_fwd(qkv, cu, heads_q=2, causal=True, softmax_scale=0.125, config=cfg)[0])
    assert torch.equal(outs[0], outs[1])


def _kernel_fn(exact: bool, recipe: str = "mxfp8"):
    def fn(q, k, v, cu, ms):
        return flamia_attn_varlen(q, k, v, cu, ms, recipe=recipe, exact_causal=exact)

    return fn


@pytest.mark.parametrize("layout", [(45, 70), (64, 64)], ids=["packed", "batched"])
def test_kernel_exact_causal_zero_leakage(layout, device) -> None:
    q, k, v, cu, ms = make_pack(layout, 2, 1, 64, seed=4, device=device)
    fn = _kernel_fn(exact=True)
    for t in (0, 17, 40):
        assert future_leakage(fn, q, k, v, cu, ms, 1, t) == 0.0
    assert cross_document_leakage(fn, q, k, v, cu, ms, 0) == 0.0


def test_kernel_default_recipe_cross_doc_exact(device) -> None:
    q, k, v, cu, ms = make_pack((45, 1, 40), 2, 1, 64, seed=4, device=device)
    for doc in range(3):
        assert cross_document_leakage(_kernel_fn(False), q, k, v, cu, ms, doc) == 0.0


@pytest.mark.parametrize("by", ["cost", "document"])
def test_work_list_ordered_and_complete(by: str, monkeypatch) -> None:
    monkeypatch.setattr(schedule, "QUERY_WORK_ORDER", by)
    cu = torch.tensor([0, 300, 300, 301, 1000], dtype=torch.int32)
    work = build_work_list(cu, 1000, block_m=128, block_n=64, causal=True)
    n = int(work.count)
    items = list(zip(work.doc[:n].tolist(), work.tile[:n].tolist(), strict=True))
    expected = [(0, t) for t in range(3)] + [(2, 0)] + [(3, t) for t in range(6)]
    assert sorted(items) == expected
    lengths = (cu[1:] - cu[:-1]).long()[work.doc[:n].long()]
    cost = (torch.minimum((work.tile[:n].long() + 1) * 128, lengths) + 63) // 64
    if by == "cost":
        assert bool((cost[:-1] >= cost[1:]).all())
    else:  # the longest document's tiles first (last tile first), then the next one's
        assert items == [(3, t) for t in range(5, -1, -1)] + [(0, 2), (0, 1), (0, 0), (2, 0)]


def test_extend_lists_take_their_own_order(monkeypatch) -> None:
    """With ``cu_seqlens_k`` (the paged prefill's extend lists) ``EXTEND_WORK_ORDER`` orders
    the items, not ``QUERY_WORK_ORDER``: by document, one sequence's tiles side by side."""
    monkeypatch.setattr(schedule, "QUERY_WORK_ORDER", "cost")
    cu_q = torch.tensor([0, 256, 512], dtype=torch.int32)  # two sequences' new tokens
    cu_k = torch.tensor([0, 256 + 4096, 2 * (256 + 4096)], dtype=torch.int32)
    orders = {}
    for by in ("cost", "document"):
        monkeypatch.setattr(schedule, "EXTEND_WORK_ORDER", by)
        work = build_work_list(cu_q, 512, block_m=128, block_n=64, causal=True,
                               cu_seqlens_k=cu_k)  # fmt: skip
        n = int(work.count)
        orders[by] = list(zip(work.doc[:n].tolist(), work.tile[:n].tolist(), strict=True))
    assert orders["cost"] == [(0, 1), (1, 1), (0, 0), (1, 0)]
    assert orders["document"] == [(0, 1), (0, 0), (1, 1), (1, 0)]
    assert schedule.QUERY_WORK_ORDER == "cost"  # (the no-extend lists' order, untouched)
    monkeypatch.setattr(schedule, "EXTEND_WORK_ORDER", "random")
    with pytest.raises(ValueError, match="work order 'random'"):
        build_work_list(cu_q, 512, block_m=128, block_n=64, causal=True, cu_seqlens_k=cu_k)


def test_batched_api_matches_varlen(device) -> None:
    q, k, v, cu, ms = make_pack((40, 40), 2, 1, 64, seed=9, device=device)
    out = flamia_attn(q.view(2, 40, 2, 64), k.view(2, 40, 1, 64), v.view(2, 40, 1, 64))
    assert torch.equal(out.reshape(80, 2, 64), flamia_attn_varlen(q, k, v, cu, ms))


def test_api_errors(device) -> None:
    q, k, v, cu, ms = make_pack((20, 40), 4, 2, 64, device=device)
    with pytest.raises(TypeError, match="cu_seqlens must have dtype"):
        flamia_attn_varlen(q, k, v, cu.long(), ms)
    with pytest.raises(ValueError, match="non-decreasing"):
        bad = torch.tensor([0, 40, 20, 60], dtype=torch.int32, device=device)
        flamia_attn_varlen(q, k, v, bad, ms)
    with pytest.raises(ValueError, match="head dim"):
        flamia_attn_varlen(q[..., :48], k[..., :48], v[..., :48], cu, ms)
    with pytest.raises(ValueError, match="share \\[B, S\\]"):
        flamia_attn(q.view(1, 60, 4, 64), k.view(2, 30, 2, 64), v.view(2, 30, 2, 64))
    strided = torch.stack([cu, cu], dim=1)[:, 0]  # the right values, stride 2
    with pytest.raises(ValueError, match="cu_seqlens must be contiguous"):
        flamia_attn_varlen(q, k, v, strided, ms)


def test_plan_must_match_the_call(device) -> None:
    """A plan sizes the kernels' schedules: q of another length, another max_seqlen, another
    cu_seqlens tensor or the same one changed in place are refused by name."""
    q, k, v, cu, ms = make_pack((20, 40), 2, 1, 64, device=device)
    plan = plan_varlen(cu, 60, ms)
    more = make_pack((20, 50), 2, 1, 64, device=device)[:3]
    with pytest.raises(ValueError, match="q has 70 tokens but the plan was built for 60"):
        flamia_attn_varlen(*more, cu, ms, plan=plan)
    with pytest.raises(ValueError, match="max_seqlen"):
        flamia_attn_varlen(q, k, v, cu, ms + 1, plan=plan)
    with pytest.raises(ValueError, match="another cu_seqlens"):
        flamia_attn_varlen(q, k, v, cu.clone(), ms, plan=plan)
    out = flamia_attn_varlen(q, k, v, cu, ms, plan=plan)
    cu.copy_(torch.tensor([0, 30, 60], dtype=torch.int32))  # the next microbatch's lengths
    with pytest.raises(ValueError, match="modified in place"):
        flamia_attn_varlen(q, k, v, cu, ms, plan=plan)
    fresh = flamia_attn_varlen(q, k, v, cu, ms, plan=plan_varlen(cu, 60, ms))
    assert not torch.equal(out, fresh)  # the documents did change


def test_empty_pack_and_empty_documents(device) -> None:
    q, k, v, cu, ms = make_pack((0,), 2, 1, 64, device=device)
    assert flamia_attn_varlen(q, k, v, cu, 0).shape == (0, 2, 64)
    q, k, v, cu, ms = make_pack((0, 3, 0, 0, 1, 0), 2, 1, 64, seed=2, device=device)
    out = flamia_attn_varlen(q, k, v, cu, ms)
    qkv = quantize_qkv(q, k, v, cu)
    ref = attention_forward(qkv.to_reference(), cu, heads_q=2, causal=True, softmax_scale=0.125)
    assert bool(torch.isfinite(out).all())
    assert float((out.float() - ref[0].float()).abs().max()) <= 2**-5 * float(ref[0].abs().max())


def test_fwd_config_errors(device) -> None:
    """Configs a kernel cannot run are refused by name before anything launches."""
    q, k, v, cu, _ms = make_pack((40, 9), 2, 1, 32, seed=1, device=device)
    qkv = quantize_qkv(q, k, v, cu)
    args = dict(heads_q=2, causal=True, softmax_scale=0.1)
    with pytest.raises(ValueError, match="head_dim 64, 128 or 256"):
        attn_fwd(qkv, cu, config=FwdConfig(128, 128, kernel="cute"), **args)
    q, k, v, cu, _ms = make_pack((40, 9), 2, 1, 64, seed=1, device=device)
    qkv = quantize_qkv(q, k, v, cu)
    with pytest.raises(ValueError, match="block_m in \\(64, 128, 192\\)"):
        attn_fwd(qkv, cu, config=FwdConfig(96, 32, kernel="cute"), **args)
    with pytest.raises(ValueError, match="one pass"):
        attn_fwd(qkv, cu, config=FwdConfig(128, 64, two_pass=True, kernel="cute"), **args)
    with pytest.raises(ValueError, match=r"config\.kernel must be"):
        attn_fwd(qkv, cu, config=FwdConfig(64, 64, kernel="cuda"), **args)
    with pytest.raises(ValueError, match="multiple of block_n"):
        attn_fwd(qkv, cu, config=FwdConfig(64, 48), **args)
    with pytest.raises(ValueError, match="kernel must be None"):
        default_config(64, q.device, kernel="fast")
    assert default_config(64, q.device, kernel="cute").kernel == "cute"
    assert default_config(64, q.device, kernel="triton").kernel == "triton"
    aligned = quantize_qkv(q, k, v, cu, column_align=128)
    if not cute_available(q.device):
        with pytest.raises(RuntimeError, match="needs an sm_90 GPU"):
            attn_fwd(aligned, cu, config=FwdConfig(128, 128, kernel="cute"), **args)
    debug = tuple(torch.zeros(2, 49, 49, device=q.device) for _ in range(2))
    with pytest.raises(ValueError, match="debug_p needs the Triton forward"):  # never ignored
        attn_fwd(aligned, cu, config=FwdConfig(128, 128, kernel="cute"), debug_p=debug, **args)
    q, k, v, cu, _ms = make_pack((40, 9), 2, 1, 256, seed=1, device=device)
    qkv = quantize_qkv(q, k, v, cu, column_align=128)
    with pytest.raises(ValueError, match="only with promote_pv=False"):
        attn_fwd(qkv, cu, config=FwdConfig(128, 128, kernel="cute", overlap=True), **args)


def test_fwd_config_round_trips_through_ints() -> None:
    """The custom ops carry a config as ints: every field comes back, ``promote_pv`` too."""
    for cfg in (FwdConfig(), CUTE_CONFIG, fwd_ops.CUTE_CONFIG_D256, fwd_ops.CUTE_CONFIG_D256_NVFP4,
                FwdConfig(192, 64, 8, 3, True, True, None, 4, "cute", False, False)):  # fmt: skip
        assert FwdConfig.from_ints(cfg.to_ints()) == cfg
    assert not CUTE_CONFIG.promote_pv and FwdConfig().promote_pv
    no_q = dataclasses.replace(CUTE_CONFIG, quantize_q=False)
    assert FwdConfig.from_ints(no_q.to_ints()) == no_q and CUTE_CONFIG.quantize_q
    win = dataclasses.replace(no_q, windows=True)
    assert FwdConfig.from_ints(win.to_ints()) == win and not CUTE_CONFIG.windows


def test_quantizes_q_only_where_the_cute_forward_can(device) -> None:
    """Q is left to the forward kernel only for the CuTe config with ``quantize_q``, E4M3
    Q/K, d <= 128 and a Q whose start and token/head strides its TMA can load."""
    q = torch.zeros(40, 4, 128, dtype=torch.bfloat16, device=device)
    assert fwd_ops.quantizes_q(CUTE_CONFIG, "e4m3", q)
    assert fwd_ops.quantizes_q(CUTE_CONFIG, "e4m3", q.half())
    assert not fwd_ops.quantizes_q(dataclasses.replace(CUTE_CONFIG, quantize_q=False), "e4m3", q)
    assert not fwd_ops.quantizes_q(FwdConfig(), "e4m3", q)  # the Triton kernel
    assert not fwd_ops.quantizes_q(CUTE_CONFIG, "nvfp4", q)
    assert not fwd_ops.quantizes_q(fwd_ops.CUTE_CONFIG_D256, "e4m3", torch.zeros(8, 2, 256))
    fused_qkv = torch.zeros(40, 3 * 4 * 128 + 8, dtype=torch.bfloat16, device=device)
    aligned = fused_qkv[:, : 4 * 128].view(40, 4, 128)  # token stride 1544: 16-byte multiple
    assert fwd_ops.quantizes_q(CUTE_CONFIG, "e4m3", aligned)
    odd = torch.zeros(40, 4 * 128 + 1, dtype=torch.bfloat16, device=device)[:, 1:]
    assert not fwd_ops.quantizes_q(CUTE_CONFIG, "e4m3", odd.view(40, 4, 128))  # start, stride
    assert not fwd_ops.quantizes_q(CUTE_CONFIG, "e4m3", q[:, :, ::2])  # d stride 2


def test_cute_config_refuses_a_layout_it_would_read_across(device) -> None:
    """The CuTe forward loads whole 128-key V̂ tiles: on the default 16-aligned layout a
    document's last tile would hold the next document's codes. It refuses that layout (before
    anything else, so also on machines without the CuTe kernel); the Triton forward reads
    the 128-aligned layout to the same result."""
    assert CUTE_CONFIG.column_align == 128 and FwdConfig().column_align == 16
    q, k, v, cu, _ms = make_pack((40, 9, 130), 2, 1, 64, seed=1, device=device)
    qkv = quantize_qkv(q, k, v, cu)
    with pytest.raises(ValueError, match="column_align=128"):
        attn_fwd(qkv, cu, heads_q=2, causal=True, softmax_scale=0.125, config=CUTE_CONFIG)
    aligned = quantize_qkv(q, k, v, cu, column_align=128)
    triton_cfg = default_config(64, q.device, qk_nvfp4=False, kernel="triton")
    got = attn_fwd(aligned, cu, heads_q=2, causal=True, softmax_scale=0.125, config=triton_cfg)
    want = attn_fwd(qkv, cu, heads_q=2, causal=True, softmax_scale=0.125, config=triton_cfg)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


# ---- short documents in windows (FwdConfig.windows) -------------------------------------

#: odd, 1-token, empty, exactly-the-limit and just-over-the-limit documents among longer ones
WINDOW_PACK = (1, 63, 64, 65, 5, 0, 20, 30, 100, 3, 64, 17, 2, 2)


def _window_config(device) -> FwdConfig:
    base = default_config(64, torch.device(device), kernel="triton")
    return dataclasses.replace(base, windows=True)


def test_short_windows_hold_every_short_document_once() -> None:
    """Each document of 1 to ``limit`` tokens lies in exactly one window, whole; a window
    holds only such documents, consecutive, in at most ``2·limit − 1`` tokens; the work list
    keeps the others' tiles only."""
    gen = torch.Generator().manual_seed(5)
    for limit in (4, 16, 64):
        lens = [*torch.randint(0, 3 * limit, (60,), generator=gen).tolist(), 5 * limit, 1]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        total = int(cu[-1])
        win = build_short_windows(cu, total, limit)
        assert win.start.numel() == -(-total // limit) and win.rows == 2 * limit
        n = int(win.count)  # the non-empty windows come first
        assert bool((win.end[:n] > win.start[:n]).all())
        assert bool((win.end[n:] == win.start[n:]).all())
        covered = torch.zeros(total, dtype=torch.int32)
        for a, b in zip(win.start.tolist(), win.end.tolist(), strict=True):
            assert b - a <= 2 * limit - 1
            covered[a:b] += 1
        for d, n in enumerate(lens):
            a = int(cu[d])
            expect = 1 if 0 < n <= limit else 0
            assert covered[a : a + n].tolist() == [expect] * n, (limit, d, n)
        assert win.token_doc.tolist() == [d for d, n in enumerate(lens) for _ in range(n)]
        work = build_work_list(cu, total, block_m=32, block_n=16, causal=True, window_limit=limit)
        count = int(work.count)
        assert work.window_limit == limit
        assert count == sum(-(-n // 32) for n in lens if n > limit)
        assert all(lens[d] > limit for d in work.doc[:count].tolist())
    with pytest.raises(ValueError, match="power of two"):
        build_short_windows(cu, total, 48)
    for empty in ([0], [0, 0], [0, 0, 0]):  # no token (an empty pack's backward on a GPU)
        win = build_short_windows(torch.tensor(empty, dtype=torch.int32), 0, 16)
        assert int(win.count) == 0 and win.start.numel() == win.end.numel() == 0
        assert win.token_doc.numel() == 0
    with pytest.raises(ValueError, match="extend"):
        build_work_list(cu, total, block_m=32, block_n=16, causal=True, cu_seqlens_k=cu,
                        window_limit=16)  # fmt: skip


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 2, 64), (2, 2, 128), (4, 1, 64)])
def test_fwd_windows_match_reference(hq, hkv, d, causal, device) -> None:
    """Short documents through the window kernel: within the kernels' tolerance of the twin,
    M and lse as the per-document kernel gives them (the same P̂ codes; sums in another
    order)."""
    q, k, v, cu, _ms = make_pack(WINDOW_PACK, hq, hkv, d, seed=11, device=device)
    qkv = quantize_qkv(q, k, v, cu)
    args = dict(heads_q=hq, causal=causal, softmax_scale=d**-0.5)
    out, m, lse = attn_fwd(qkv, cu, config=_window_config(device), **args)
    ref = attention_forward(qkv.to_reference(), cu, **args)
    _check_close(out, m, lse, *ref)
    plain = dataclasses.replace(_window_config(device), windows=False)
    out0, m0, lse0 = attn_fwd(qkv, cu, config=plain, **args)
    assert torch.equal(m, m0)
    assert float((lse - lse0).abs().max()) <= 1e-5
    assert float((out.float() - out0.float()).abs().max()) <= 2**-7 * float(out0.abs().max())


def test_fwd_windows_never_leak(device) -> None:
    """Across documents and (per-token scales) from the future: zero change, bit for bit,
    on a window's documents (other documents' keys meet zero weights) and on the long ones."""
    q, k, v, cu, ms = make_pack(WINDOW_PACK, 4, 2, 64, seed=12, device=device)
    cfg = _window_config(device)

    def fn(q, k, v, cu, ms, exact=False):
        return flamia_attn_varlen(q, k, v, cu, ms, config=cfg, exact_causal=exact)

    def exact_fn(q, k, v, cu, ms):
        return fn(q, k, v, cu, ms, exact=True)

    for doc in (0, 1, 4, 6, 9, 13):
        assert cross_document_leakage(fn, q, k, v, cu, ms, doc) == 0.0, doc
    for doc, t in ((1, 10), (2, 0), (6, 19), (12, 7), (8, 70)):
        assert future_leakage(exact_fn, q, k, v, cu, ms, doc, t) == 0.0, (doc, t)


def test_fwd_windows_keep_a_nan_in_its_document(device) -> None:
    """A NaN in one short document's V (its E4M3 code is NaN, the key's other codes are
    not): the other documents of its window are bit-identical to a run without it, and its
    own rows are NaN at that head-dim column, every row (0·NaN and P̂·NaN), where the GPU's
    per-document kernel puts them too (the CPU interpreter's FP8 dot reads the NaN code as
    a number, so the comparison runs on the GPU only)."""
    q, k, v, cu, ms = make_pack(WINDOW_PACK, 2, 1, 64, seed=13, device=device)
    cfg = _window_config(device)
    clean = flamia_attn_varlen(q, k, v, cu, ms, config=cfg)
    bad = v.clone()
    first = int(cu[6])  # document 6 (20 tokens), in the window of documents 4-8
    bad[first + 3, 0, 5] = float("nan")
    poisoned = flamia_attn_varlen(q, k, bad, cu, ms, config=cfg)
    per_doc = flamia_attn_varlen(q, k, bad, cu, ms, config=dataclasses.replace(cfg, windows=False))
    rows = torch.arange(q.shape[0], device=q.device)
    own = (rows >= first) & (rows < int(cu[7]))
    assert torch.equal(poisoned[~own], clean[~own])
    nan_at = torch.zeros_like(poisoned, dtype=torch.bool)
    nan_at[own, :, 5] = True
    assert torch.equal(poisoned.isnan(), nan_at)
    if poisoned.is_cuda:
        assert torch.equal(per_doc.isnan(), nan_at)


@pytest.mark.parametrize(
    ("lens", "exact"),
    [(WINDOW_PACK, False), (WINDOW_PACK, True), ((32, 33, 1, 31, 0, 2), False),
     ((3, 32, 1, 7, 16), False), ((40, 129, 33), True)],
    ids=["mixed", "mixed-exact", "at-the-limit", "all-short", "none-short-exact"],
)  # fmt: skip
def test_fwd_windows_read_the_short_documents_q_of_a_deferred_quantization(
    lens, exact, device, monkeypatch
) -> None:
    """With windows the CuTe forward quantizes Q itself and the launch only the windows'
    (``q_options``: ``defer_q`` and ``q_short``): the same outputs, bit for bit, as the launch
    quantizing all of Q (token blocks or per token; documents at the limit, all or none
    short); without ``q_short`` the window kernel refuses the operands. On a CPU (or without
    the CuTe kernel) the CuTe call is stubbed and the windows' rows compared."""
    q, k, v, cu, _ms = make_pack(lens, 4, 2, 64, seed=15, device=device)
    real = device == "cuda" and cute_available(q.device)
    if not real:  # the CuTe forward stubbed: only the window kernel writes
        import sys
        import types

        stub = types.ModuleType("flamia_serve.kernels.attn_fwd.cute_sm90")
        stub.attn_fwd_sm90_call = lambda *args, **kwargs: None
        monkeypatch.setitem(sys.modules, stub.__name__, stub)
        monkeypatch.setattr(fwd_ops, "cute_available", lambda device: True)
    cfg = dataclasses.replace(CUTE_CONFIG, windows=True, quantize_q=True)
    options = fwd_ops.q_options(cfg, "e4m3", q)
    assert options == {"defer_q": True, "q_short": fwd_ops.WINDOW_LIMIT}
    launch_q = dataclasses.replace(cfg, quantize_q=False)
    assert fwd_ops.q_options(launch_q, "e4m3", q) == {"defer_q": False, "q_short": 0}
    args = dict(heads_q=4, causal=True, softmax_scale=0.125)
    deferred = quantize_qkv(q, k, v, cu, column_align=128, exact_causal=exact, **options)
    full = quantize_qkv(q, k, v, cu, column_align=128, exact_causal=exact)
    got = attn_fwd(deferred, cu, config=cfg, **args)
    want = attn_fwd(full, cu, config=launch_q, **args)
    short = torch.tensor([0 < n <= fwd_ops.WINDOW_LIMIT for n in lens for _ in range(n)],
                         device=q.device)  # fmt: skip
    rows = slice(None) if real else short
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a[rows], b[rows])
    ref = attn_fwd(full, cu, config=_window_config(device), **args)  # the Triton kernels
    for a, b in zip(got, ref, strict=True):  # the same window kernel on the same codes
        assert torch.equal(a[short], b[short])
    no_short = quantize_qkv(q, k, v, cu, column_align=128, exact_causal=exact, defer_q=True)
    with pytest.raises(ValueError, match="quantize with q_short=32"):
        attn_fwd(no_short, cu, config=cfg, **args)


def test_fwd_windows_refuse_operands_they_cannot_read(device) -> None:
    q, k, v, cu, _ms = make_pack((20, 3), 2, 1, 64, device=device)
    args = dict(heads_q=2, causal=True, softmax_scale=0.125, config=_window_config(device))
    nvfp4 = quantize_qkv(q, k, v, cu, recipe="mixed_nvfp4")
    with pytest.raises(ValueError, match=r"config\.windows runs E4M3"):
        attn_fwd(nvfp4, cu, **args)
    qkv = quantize_qkv(q, k, v, cu)
    dense = torch.zeros(2, 23, 23, device=q.device)
    with pytest.raises(ValueError, match=r"debug_p needs config\.windows=False"):
        attn_fwd(qkv, cu, debug_p=(dense, dense.clone()), **args)


def test_fwd_windows_through_the_custom_op(device) -> None:
    """``torch.compile(fullgraph=True)`` carries the windows through the custom op's
    tensor-list arguments: the same output as the eager call, bit for bit."""
    q, k, v, cu, ms = make_pack(WINDOW_PACK, 2, 1, 64, seed=14, device=device)
    plan = plan_varlen(cu, q.shape[0], ms)
    cfg = _window_config(device)

    def step(q, k, v):
        return flamia_attn_varlen(q, k, v, cu, ms, plan=plan, config=cfg)

    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    assert torch.equal(compiled(q, k, v), step(q, k, v))
