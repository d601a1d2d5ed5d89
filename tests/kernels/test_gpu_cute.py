"""CuTe DSL forward (sm_90) against the reference twin: run on the H200 (``pytest -m gpu``)
with ``nvidia-cutlass-dsl`` and ``flash-attn-4`` installed; skipped elsewhere.

Same tolerance as the Triton kernel's GPU tests (``test_attn_fwd._check_close``)."""

from __future__ import annotations

import pytest
import torch

from flamia_serve import flamia_attn_varlen
from flamia_serve.kernels.attn_fwd.ops import (
    CUTE_CONFIG,
    CUTE_CONFIG_D256,
    FwdConfig,
    attn_fwd,
    cute_available,
    default_config,
    quantizes_q,
)
from flamia_serve.kernels.quant.ops import quantize_qkv
from flamia_serve.probes import cross_document_leakage, future_leakage, make_pack
from flamia_serve.reference import attention_float64, attention_forward
from tests.kernels.test_attn_fwd import _check_close

#: the CuTe kernels' GPU tests (also ``test_gpu_cute_bwd``): an sm_90 GPU and the cute extra
CUTE_GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not cute_available(torch.device("cuda")),
        reason="needs an sm_90 GPU with nvidia-cutlass-dsl and flash-attn-4",
    ),
]
pytestmark = CUTE_GPU

CONFIGS = {
    "default": CUTE_CONFIG,
    "serial-128x64": FwdConfig(128, 64, num_stages=3, kernel="cute", overlap=False),
    "overlap-128x64": FwdConfig(128, 64, num_stages=2, kernel="cute"),
    "one-warpgroup": FwdConfig(64, 64, num_stages=3, kernel="cute"),
    # P̂·V̂ accumulated in the wgmma, serial and overlapped with the next Q̂·K̂ᵀ
    "pv-in-mma": FwdConfig(128, 128, num_stages=2, kernel="cute", overlap=False, promote_pv=False),
    "pv-in-mma-overlap": FwdConfig(128, 128, num_stages=2, kernel="cute", promote_pv=False),
    "pv-in-mma-overlap-128x64": FwdConfig(128, 64, num_stages=2, kernel="cute", promote_pv=False),
    "pv-promoted": FwdConfig(128, 128, num_stages=2, kernel="cute", overlap=False, promote_pv=True),
}
CASES = [
    # lens (1-token documents, lengths not multiples of 32/64/128, an empty one), hq, hkv, d
    ((1, 300, 1000, 129, 0, 2048, 31), 32, 8, 128),
    ((1, 63, 100, 37, 0, 5), 4, 2, 64),
    ((700, 4), 4, 4, 128),
    ((3000,), 2, 1, 64),
]


@pytest.mark.parametrize("config", CONFIGS, ids=list(CONFIGS))
@pytest.mark.parametrize("exact", [False, True], ids=["token_block", "exact_causal"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize(("lens", "hq", "hkv", "d"), CASES, ids=[str(i) for i in range(len(CASES))])
def test_cute_fwd_matches_reference(lens, hq, hkv, d, causal, exact, config) -> None:
    _check_cute(lens, hq, hkv, d, causal, exact, CONFIGS[config])


D256_CONFIGS = {
    "default": CUTE_CONFIG_D256,
    "128x64": FwdConfig(128, 64, num_stages=2, kernel="cute", overlap=False),
    "one-warpgroup": FwdConfig(64, 64, num_stages=2, kernel="cute", overlap=False),
    "pv-in-mma": FwdConfig(128, 128, num_stages=2, kernel="cute", overlap=False, promote_pv=False),
    "pv-in-mma-overlap-128x64": FwdConfig(128, 64, num_stages=2, kernel="cute", promote_pv=False),
    "pv-in-mma-overlap": FwdConfig(128, 128, num_stages=2, kernel="cute", promote_pv=False),
    "pv-promoted": FwdConfig(128, 128, num_stages=2, kernel="cute", overlap=False, promote_pv=True),
}


@pytest.mark.parametrize("config", D256_CONFIGS, ids=list(D256_CONFIGS))
@pytest.mark.parametrize("exact", [False, True], ids=["token_block", "exact_causal"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_cute_fwd_d256_matches_reference(causal, exact, config) -> None:
    _check_cute((1, 300, 1000, 129, 0, 31), 8, 2, 256, causal, exact, D256_CONFIGS[config])


def _check_cute(lens, hq, hkv, d, causal, exact, cfg) -> None:
    q, k, v, cu, ms = make_pack(lens, hq, hkv, d, seed=21, device="cuda")
    qkv = quantize_qkv(q, k, v, cu, exact_causal=exact, column_align=cfg.column_align)
    out, m, lse = attn_fwd(qkv, cu, heads_q=hq, causal=causal, softmax_scale=d**-0.5, config=cfg)
    ref = attention_forward(
        qkv.to_reference(), cu, heads_q=hq, causal=causal, softmax_scale=d**-0.5
    )
    _check_close(out, m, lse, *ref)
    exact64 = attention_float64(q, k, v, cu, ms, causal=causal)
    cos = torch.nn.functional.cosine_similarity(out.double().flatten(), exact64.flatten(), dim=0)
    assert float(cos) >= 0.998


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_cute_three_warpgroups(causal) -> None:
    lens, hq, hkv, d = CASES[0]
    q, k, v, cu, _ms = make_pack(lens, hq, hkv, d, seed=24, device="cuda")
    cfg = FwdConfig(192, 64, num_stages=2, kernel="cute", overlap=False)
    qkv = quantize_qkv(q, k, v, cu, column_align=cfg.column_align)
    out, m, lse = attn_fwd(qkv, cu, heads_q=hq, causal=causal, softmax_scale=d**-0.5, config=cfg)
    ref = attention_forward(
        qkv.to_reference(), cu, heads_q=hq, causal=causal, softmax_scale=d**-0.5
    )
    _check_close(out, m, lse, *ref)


@pytest.mark.parametrize("d", [128, 256])
def test_cute_is_the_default_here_and_agrees_with_triton(d) -> None:
    q, k, v, cu, ms = make_pack((500, 1500, 77), 8, 2, d, seed=22, device="cuda")
    assert default_config(d, q.device).kernel == "cute"
    triton = default_config(d, q.device, kernel="triton")
    with torch.no_grad():
        cute_out = flamia_attn_varlen(q, k, v, cu, ms)
        triton_out = flamia_attn_varlen(q, k, v, cu, ms, config=triton)
    diff = (cute_out.float() - triton_out.float()).norm() / triton_out.float().norm()
    assert float(diff) < 1e-2


def test_cute_ticket_schedule_is_repeatable() -> None:
    """More (item, head) pairs than SMs: CTAs take the ones after their first by atomic
    ticket (reset per launch); two launches give the same bits, and every row is written."""
    q, k, v, cu, _ms = make_pack((4000, 129, 1), 16, 4, 128, seed=25, device="cuda")
    qkv = quantize_qkv(q, k, v, cu, column_align=CUTE_CONFIG.column_align)
    runs = [
        attn_fwd(qkv, cu, heads_q=16, causal=True, softmax_scale=0.1, config=CUTE_CONFIG)
        for _ in range(2)
    ]
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)
    assert bool(torch.isfinite(runs[0][0]).all())


def test_cute_fp16_output_and_inputs_untouched() -> None:
    q, k, v, cu, ms = make_pack((200, 90), 4, 2, 64, seed=23, device="cuda", dtype=torch.float16)
    before = [x.clone() for x in (q, k, v, cu)]
    out = flamia_attn_varlen(q, k, v, cu, ms, config=CUTE_CONFIG)
    assert out.dtype == torch.float16
    for a, b in zip(before, (q, k, v, cu), strict=True):
        assert torch.equal(a, b)


def test_cute_zero_future_and_cross_document_leakage() -> None:
    q, k, v, cu, ms = make_pack((700, 1500), 8, 2, 128, seed=12, device="cuda")

    def fn(*args):
        return flamia_attn_varlen(*args, exact_causal=True, config=CUTE_CONFIG)

    for t in (0, 129, 1000, 1498):
        assert future_leakage(fn, q, k, v, cu, ms, 1, t) == 0.0
    assert cross_document_leakage(fn, q, k, v, cu, ms, 0) == 0.0


def test_cute_rejects_what_it_does_not_run() -> None:
    q, k, v, cu, _ms = make_pack((64,), 2, 1, 256, seed=1, device="cuda")
    qkv = quantize_qkv(q, k, v, cu)  # 16-column layout: whole 128-key tiles would overrun
    with pytest.raises(ValueError, match="column_align=128"):
        attn_fwd(qkv, cu, heads_q=2, causal=True, softmax_scale=0.1, config=CUTE_CONFIG)
    qkv = quantize_qkv(q, k, v, cu, recipe="mixed_nvfp4", column_align=128, widen=True)
    with pytest.raises(ValueError, match="takes block_n 64"):
        attn_fwd(qkv, cu, heads_q=2, causal=True, softmax_scale=0.1, config=CUTE_CONFIG_D256)


MIXED_CASES = [
    # lens, hq, hkv, d, causal, exact_causal, recipe
    (*CASES[0], True, False, "mixed_nvfp4"),
    (*CASES[0], False, True, "mixed_nvfp4_hadamard"),
    (*CASES[1], True, True, "mixed_nvfp4"),
    (*CASES[1], False, False, "mixed_nvfp4_hadamard"),
    ((1, 300, 129, 31), 8, 8, 128, True, False, "mixed_nvfp4_hadamard"),
    ((1, 300, 1000, 31), 8, 2, 256, True, False, "mixed_nvfp4"),
    ((1, 300, 1000, 31), 8, 2, 256, False, True, "mixed_nvfp4_hadamard"),
    # short documents (mean under SHORT_DOCUMENTS: the default kernel for NVFP4 Q/K is still
    # this one)
    ((3, 1, 17, 30, 2, 9, 25, 1, 14, 31, 8, 5, 22, 1, 11, 40), 8, 2, 64, True, False,
     "mixed_nvfp4"),
]


@pytest.mark.parametrize(("lens", "hq", "hkv", "d", "causal", "exact", "recipe"), MIXED_CASES)
def test_cute_fwd_mixed_matches_reference_and_triton(lens, hq, hkv, d, causal, exact, recipe):
    """NVFP4 Q/K on the CuTe kernel (BF16 scores from the widened values): the reference
    twin's tolerance, the Triton kernel's output on the same codes, cos-sim vs float64 as the
    recipe's (paper: 0.992 for O)."""
    q, k, v, cu, ms = make_pack(lens, hq, hkv, d, seed=31, device="cuda")
    qkv = quantize_qkv(q, k, v, cu, recipe=recipe, exact_causal=exact, column_align=128,
                       widen=True)  # fmt: skip
    assert default_config(d, q.device, qk_nvfp4=True).kernel == "cute"
    scale = d**-0.5
    out, m, lse = attn_fwd(qkv, cu, heads_q=hq, causal=causal, softmax_scale=scale)
    ref = attention_forward(qkv.to_reference(), cu, heads_q=hq, causal=causal, softmax_scale=scale)
    _check_close(out, m, lse, *ref)
    triton = default_config(d, q.device, qk_nvfp4=True, kernel="triton")
    t_out = attn_fwd(qkv, cu, heads_q=hq, causal=causal, softmax_scale=scale, config=triton)[0]
    diff = (out.float() - t_out.float()).norm() / t_out.float().norm()
    assert float(diff) < 1e-2
    exact64 = attention_float64(q, k, v, cu, ms, causal=causal)
    cos = torch.nn.functional.cosine_similarity(out.double().flatten(), exact64.flatten(), dim=0)
    assert float(cos) >= 0.985


@pytest.mark.parametrize("recipe", ["mixed_nvfp4", "mixed_nvfp4_hadamard"])
def test_cute_fwd_reads_only_the_score_operands(recipe) -> None:
    """On operands quantized with ``scores_only`` (the E4M3 Q/K codes and packed NVFP4 codes
    left unwritten), the CuTe forward gives the bits it gives on the full quantization."""
    q, k, v, cu, _ms = make_pack((1, 300, 1000, 129, 31), 8, 2, 128, seed=33, device="cuda")
    runs = []
    for scores_only in (False, True):
        qkv = quantize_qkv(q, k, v, cu, recipe=recipe, column_align=128, widen=True,
                           scores_only=scores_only)  # fmt: skip
        runs.append(attn_fwd(qkv, cu, heads_q=8, causal=True, softmax_scale=0.1,
                             config=CUTE_CONFIG))  # fmt: skip
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


FUSED_Q_CASES = [
    # config, exact_causal, input dtype, causal, CASES index
    (CUTE_CONFIG, False, torch.bfloat16, True, 0),
    (CUTE_CONFIG, True, torch.float16, True, 1),
    (CUTE_CONFIG, False, torch.bfloat16, False, 2),
    (CONFIGS["pv-promoted"], False, torch.bfloat16, True, 3),
    (CONFIGS["overlap-128x64"], True, torch.bfloat16, True, 0),
    (CONFIGS["one-warpgroup"], False, torch.bfloat16, True, 1),
    (FwdConfig(192, 64, num_stages=2, kernel="cute", overlap=False), False, torch.float16, True, 0),
]


@pytest.mark.parametrize(("cfg", "exact", "dtype", "causal", "case"), FUSED_Q_CASES)
def test_cute_fwd_quantizing_q_itself_gives_the_bits_of_quantized_q(
    cfg, exact, dtype, causal, case
) -> None:
    """Q quantized inside the forward (``defer_q``: BF16/FP16 tile by TMA, codes and
    exponents by the consumer warpgroups) gives O, M and lse bit for bit as the forward on
    the quantization kernel's codes: same codes, same exponents; and the same bits on every
    run (a CTA takes items of short and long documents in a different order each run)."""
    lens, hq, hkv, d = CASES[case]
    q, k, v, cu, _ms = make_pack(lens, hq, hkv, d, seed=41, device="cuda", dtype=dtype)
    runs = []
    for defer_q in (False, True, True, True):
        qkv = quantize_qkv(q, k, v, cu, exact_causal=exact, column_align=cfg.column_align,
                           defer_q=defer_q)  # fmt: skip
        runs.append(attn_fwd(qkv, cu, heads_q=hq, causal=causal, softmax_scale=d**-0.5,
                             config=cfg))  # fmt: skip
    for run in runs[1:]:
        for a, b in zip(runs[0], run, strict=True):
            assert torch.equal(a, b)


def test_cute_fwd_quantizing_q_keeps_non_finite_q_in_its_document() -> None:
    """Inf and NaN in one document's Q (the kernel loads whole 128-row Q tiles across
    document ends) change no bit of the other documents' outputs, and the default call
    quantizes Q in the kernel here."""
    q, k, v, cu, ms = make_pack((300, 77, 1000), 8, 2, 128, seed=42, device="cuda")
    assert quantizes_q(default_config(128, q.device), "e4m3", q)
    bad = q.clone()
    bad[300:377:5, 3] = float("nan")
    bad[301:377:7, 1, 5] = float("inf")
    with torch.no_grad():
        clean = flamia_attn_varlen(q, k, v, cu, ms)
        dirty = flamia_attn_varlen(bad, k, v, cu, ms)
    for rows in (slice(0, 300), slice(377, 1377)):
        assert torch.equal(clean[rows], dirty[rows])
