"""CuTe DSL backward (sm_90) against the reference twin and the Triton backward: run on the
H200 (``pytest -m gpu``) with ``nvidia-cutlass-dsl`` and ``flash-attn-4``; skipped elsewhere.

Same tolerance as the Triton backward's GPU tests (``test_attn_bwd``): relative error 3e-2
against the reference backward (dQ is summed by bulk adds in no fixed order)."""

from __future__ import annotations

import pytest
import torch

from flamia_serve import flamia_attn_varlen
from flamia_serve.kernels.attn_bwd.ops import (
    CUTE_BWD_CONFIG,
    BwdConfig,
    attn_bwd,
    default_bwd_config,
)
from flamia_serve.kernels.attn_fwd.ops import attn_fwd
from flamia_serve.kernels.quant.ops import quantize_do, quantize_qkv
from flamia_serve.numerics import RECIPES
from flamia_serve.probes import make_pack
from flamia_serve.reference import attention_backward
from tests.kernels.test_attn_bwd import _grads, _rel
from tests.kernels.test_gpu_cute import CUTE_GPU

pytestmark = CUTE_GPU

# lens (1-token documents, lengths not multiples of 32/64/128, an empty one), hq, hkv, d,
# causal, exact_causal
CASES = [
    ((1, 300, 1000, 129, 0, 31), 4, 2, 64, True, False),
    ((1, 300, 1000, 129, 31), 8, 1, 128, True, False),
    ((257, 64, 700), 4, 4, 128, False, False),
    ((500, 3, 77, 128), 8, 2, 64, False, True),
    ((2048, 1, 130), 16, 4, 128, True, True),
    # d = 128 non-causal with the second warpgroup's keys partly inside the document (dQ once
    # per CTA step reads both warpgroups' dŜ; added 2026-12-03, not yet run on a GPU)
    ((100, 230, 1), 4, 2, 128, False, False),
    # d = 256: a dK/dQ pass and a dV pass (mxfp8), two CTAs per key tile (mixed recipes)
    ((1, 300, 1000, 129, 0, 31), 8, 2, 256, True, False),
    ((257, 64, 700), 4, 4, 256, False, True),
    ((100, 230, 1), 4, 2, 256, False, False),
]


def _operands(lens, hq, hkv, d, causal, exact, seed=5, recipe="mxfp8"):
    q, k, v, cu, _ = make_pack(lens, hq, hkv, d, seed=seed, device="cuda")
    d_out = make_pack(lens, hq, hkv, d, seed=seed + 1, device="cuda")[0]
    rows = RECIPES[recipe].grad_input  # (both kernels read Q/K rows then)
    qkv = quantize_qkv(q, k, v, cu, recipe=recipe, exact_causal=exact, with_transposed=True,
                       column_align=128, widen=True, q_rows=rows, k_rows=rows)  # fmt: skip
    out, m, lse = attn_fwd(qkv, cu, heads_q=hq, causal=causal, softmax_scale=d**-0.5)
    qdo = quantize_do(d_out, out, m, lse, cu, recipe=recipe, column_align=128)
    return qkv, qdo, m, lse, cu, d_out, out


def _bwd(ops, hq, d, causal, config, debug_p=None, recipe="mxfp8"):
    qkv, qdo, m, lse, cu = ops[:5]
    return attn_bwd(qkv, qdo, m, lse, cu, heads_q=hq, causal=causal, softmax_scale=d**-0.5,
                    recipe=recipe, config=config, debug_p=debug_p)  # fmt: skip


MIXED = [
    (*CASES[0], "mixed_nvfp4"), (*CASES[2], "mixed_nvfp4_hadamard"), (*CASES[3], "mixed_nvfp4"),
    (*CASES[4], "mixed_nvfp4_hadamard"), (*CASES[6], "mixed_nvfp4"),
]
# grad_qk="input": BF16 dQ from K's rows, 32-query steps at d = 128, parts at d = 256
# (compiled for sm_90a on the CPU, 2026-12-04; not yet run on a GPU)
GRAD_INPUT = [(*CASES[i], "mxfp8_grad_input") for i in (0, 1, 2, 4, 5, 6, 7)]


@pytest.mark.parametrize(
    ("lens", "hq", "hkv", "d", "causal", "exact", "recipe"),
    [(*c, "mxfp8") for c in CASES] + MIXED + GRAD_INPUT,
)
def test_cute_bwd_matches_reference(lens, hq, hkv, d, causal, exact, recipe) -> None:
    """Against the reference backward and the Triton kernel on the same codes; mixed
    recipes rebuild Sᵀ from the widened NVFP4 values (BF16 ``wgmma``); ``mxfp8_grad_input``
    multiplies dŜ by Q/K's BF16 rows (dQ as a BF16 ``wgmma``)."""
    ops = _operands(lens, hq, hkv, d, causal, exact, recipe=recipe)
    qkv, qdo, m, lse, cu, d_out, out = ops
    got = _bwd(ops, hq, d, causal, CUTE_BWD_CONFIG, recipe=recipe)
    triton = _bwd(ops, hq, d, causal, BwdConfig(), recipe=recipe)
    ref = attention_backward(d_out, out, m, lse, qkv.to_reference(), cu, RECIPES[recipe],
                             causal=causal,
                             softmax_scale=d**-0.5, qdo=qdo.to_reference())  # fmt: skip
    for name, g, t, r in zip(("dq", "dk", "dv"), got, triton, ref, strict=True):
        assert g.shape == r.shape and g.dtype == t.dtype, name
        assert bool(torch.isfinite(g).all()), name
        assert _rel(g, r) <= 3e-2, (name, _rel(g, r))
        assert _rel(g, t.float()) <= 3e-2, (name, _rel(g, t.float()))


@pytest.mark.parametrize(("recipe", "d"), [("mxfp8", 64), ("mixed_nvfp4", 64), ("mxfp8", 256)])
def test_cute_bwd_rebuilds_the_same_p_hat_as_triton(recipe, d) -> None:
    """The P̂ each backward rebuilds (debug hook), on one quantization: the same codes (at
    d = 256 both CTAs of a key tile write the same P̂)."""
    lens, hq = (100, 1, 45, 130), 4
    ops = _operands(lens, hq, 2, d, True, False, recipe=recipe)
    t = sum(lens)
    bufs = [torch.zeros(hq, t, t, device="cuda") for _ in range(2)]
    _bwd(ops, hq, d, True, CUTE_BWD_CONFIG, bufs[0], recipe=recipe)
    _bwd(ops, hq, d, True, BwdConfig(), bufs[1], recipe=recipe)
    assert int((bufs[1] != 0).sum()) > 1000
    assert torch.equal(bufs[0], bufs[1])


@pytest.mark.parametrize("case", CASES[1:3] + CASES[4:9])
def test_cute_bwd_passes_match_the_parts(case, monkeypatch) -> None:
    """E4M3 Q/K in two kernels (a dK/dQ pass, then a dV pass, one CTA per key tile each; the
    d = 256 default, at d = 128 an option): dK and dV bit for bit those of the one-kernel
    "parts" form (d = 256: two CTAs per key tile), dQ up to the order of its bulk adds."""
    from flamia_serve.kernels.attn_bwd import cute_sm90

    lens, hq, hkv, d, causal, exact = case
    ops = _operands(lens, hq, hkv, d, causal, exact)
    monkeypatch.setattr(cute_sm90, "PASS_HEAD_DIMS", frozenset({d}))
    assert cute_sm90.bwd_modes(d, False, True) == ("dkdq", "dv")
    passes = _bwd(ops, hq, d, causal, CUTE_BWD_CONFIG)
    monkeypatch.setattr(cute_sm90, "PASS_HEAD_DIMS", frozenset())
    assert cute_sm90.bwd_modes(d, False, True) == ("parts",)
    parts = _bwd(ops, hq, d, causal, CUTE_BWD_CONFIG)
    assert float(parts[1].float().abs().sum()) > 0 and float(parts[2].float().abs().sum()) > 0
    assert torch.equal(passes[1], parts[1]), "dK"
    assert torch.equal(passes[2], parts[2]), "dV"
    assert _rel(passes[0], parts[0].float()) <= 1e-3, "dQ"


def test_cute_bwd_d256_each_pass_rebuilds_the_same_p_hat(monkeypatch) -> None:
    """Each d = 256 pass alone (debug hook) writes the P̂ the Triton backward rebuilds."""
    from flamia_serve.kernels.attn_bwd import cute_sm90

    lens, hq = (100, 1, 45, 130), 4
    ops = _operands(lens, hq, 2, 256, True, False)
    t = sum(lens)
    triton = torch.zeros(hq, t, t, device="cuda")
    _bwd(ops, hq, 256, True, BwdConfig(), triton)
    assert int((triton != 0).sum()) > 1000
    for mode in ("dkdq", "dv"):
        monkeypatch.setattr(cute_sm90, "bwd_modes", lambda *args, m=mode: (m,))
        buf = torch.zeros(hq, t, t, device="cuda")
        _bwd(ops, hq, 256, True, CUTE_BWD_CONFIG, buf)
        assert torch.equal(buf, triton), mode


def test_cute_bwd_is_the_default_on_its_layout() -> None:
    """The CuTe backward is the default at d 64/128/256; given operands on a layout it cannot
    read, ``attn_bwd`` without a config takes the Triton kernel, with the CuTe config it
    raises."""
    dev = torch.device("cuda")
    for d in (64, 128, 256):
        assert default_bwd_config(d, dev).kernel == "cute"
    assert default_bwd_config(64, dev, qk_nvfp4=True).kernel == "cute"
    q, k, v, cu, _ = make_pack((70,), 2, 1, 64, device="cuda")
    qkv = quantize_qkv(q, k, v, cu, with_transposed=True)  # column alignment 16
    out, m, lse = attn_fwd(qkv, cu, heads_q=2, causal=True, softmax_scale=0.125)
    qdo = quantize_do(torch.randn_like(out), out, m, lse, cu)
    with pytest.raises(ValueError, match="column alignment"):
        attn_bwd(qkv, qdo, m, lse, cu, heads_q=2, causal=True, softmax_scale=0.125,
                 config=CUTE_BWD_CONFIG)  # fmt: skip


@pytest.mark.parametrize("name", ["q", "k", "v", "d"])
def test_cute_bwd_never_crosses_a_document(name: str) -> None:
    """A NaN at the first and the last token of document 1 (the CuTe kernel's token-major
    tiles load past a document's end) leaves the gradients of documents 0 and 2 as they
    were: dK/dV bit for bit, dQ up to its summation order."""
    docs, start, end = (40, 200, 30), 40, 240
    q, k, v, cu, ms = make_pack(docs, 4, 2, 128, seed=7, device="cuda")
    d_out = torch.randn_like(q)

    def grads(tensors):
        return _grads(lambda *a: flamia_attn_varlen(*a, cu, ms), *tensors[:3], tensors[3])

    clean = grads([q, k, v, d_out])
    bad = [x.clone() for x in (q, k, v, d_out)]
    i = "qkvd".index(name)
    bad[i][start, 0] = float("nan")
    bad[i][end - 1, 1] = float("nan")
    dirty = grads(bad)
    other = torch.ones(sum(docs), dtype=torch.bool, device="cuda")
    other[start:end] = False
    for label, a, b in zip(("o", "dq", "dk", "dv"), dirty, clean, strict=True):
        assert bool(torch.isfinite(a[other]).all()), label
        if label == "dq":
            assert _rel(a[other], b[other]) <= 1e-2, label
        else:
            assert torch.equal(a[other], b[other]), label


@pytest.mark.parametrize(("d", "recipe"), [(128, "mxfp8"), (256, "mixed_nvfp4")])
@pytest.mark.parametrize("custom_ops", [False, True])
def test_cute_bwd_after_a_forward_on_another_layout(d, recipe, custom_ops, monkeypatch) -> None:
    """A forward on a layout the CuTe backward cannot read (the Triton forward's 16 columns;
    the mixed recipes' d = 256 CuTe forward, 64-key tiles) and the default backward: the
    CuTe kernel quantizes into its own 128-column layout and gives the gradients of the
    Triton backward on the forward's layout (within the two kernels' summation-order
    differences), eagerly and through the custom ops."""
    from flamia_serve import attention, plan_varlen
    from flamia_serve.kernels.attn_fwd.ops import default_config

    monkeypatch.setattr(attention, "EAGER_CUSTOM_OPS", custom_ops)
    q, k, v, cu, ms = make_pack((300, 1, 700, 47), 8, 2, d, seed=1, device="cuda")
    d_out = torch.randn_like(q)
    plan = plan_varlen(cu, q.shape[0], ms)
    kernel = "cute" if d == 256 else "triton"
    cfg = default_config(d, q.device, qk_nvfp4=recipe != "mxfp8", kernel=kernel)
    assert cfg.column_align % 128 != 0
    grads = {}
    for name, bcfg in (("triton", default_bwd_config(d, q.device, kernel="triton")),
                       ("default", None)):  # fmt: skip
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        out = flamia_attn_varlen(*leaves, cu, ms, recipe=recipe, plan=plan, config=cfg,
                                 bwd_config=bcfg)  # fmt: skip
        out.backward(d_out)
        grads[name] = [x.grad for x in leaves]
    calls = list(plan.calls.values())  # the checked calls the plan keeps, in call order
    assert [c.bwd_config.kernel for c in calls] == ["triton", "cute"]
    assert calls[0].bwd_blocks is None and calls[1].bwd_blocks is not None
    for g, t in zip(grads["default"], grads["triton"], strict=True):
        assert bool(torch.isfinite(g).all())
        # the same codes and P̂; sums in another order (the kernels agree to <= 5.7e-4)
        assert _rel(g, t) <= 1e-3, _rel(g, t)
