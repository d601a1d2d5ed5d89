"""The training entry points (``flamia_attn_varlen``, ``flamia_attn``) called the way ML code
calls them, against the reference twin: q/k/v as views of a fused QKV projection, head-major
views, broadcast K/V heads; awkward packs (empty and 1-token documents, T not a multiple of
16); GQA groups 1-16; d 64/128/256; FP16 and BF16; every recipe; gradients for only some
inputs and strided incoming gradients; a plan reused across layers of other layouts and
values; extreme magnitudes; tiny batched calls; leakage at document starts that are not
32-aligned.

Tolerances are those of ``test_attn_fwd.py`` (O: ‖O − O_ref‖/‖O_ref‖ <= 5e-3 and
max|O − O_ref| <= 2^-5·max|O_ref| on the CPU interpreter; 1e-2 and 2^-3 on a GPU) and of
``test_attn_bwd.py`` end to end (each path runs its own forward: gradients within 3e-2 of the
twin's, and against float64 autograd as accurate as the twin, cos-sim within 2e-4). Where
two kernel-path calls must agree (a view against its contiguous copy, a plan against none)
they agree bit for bit; dQ only up to its FP32 atomics' order on a GPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flamia_serve import flamia_attn, flamia_attn_varlen, plan_varlen
from flamia_serve.kernels.attn_fwd.ops import default_config
from flamia_serve.probes import make_pack
from flamia_serve.reference import attention, attention_float64, per_tensor_fp8_attention

NAMES = ("O", "dQ", "dK", "dV")


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖/‖ref‖ in float64 (tiny magnitudes do not underflow)."""
    r = ref.detach().double().cpu()
    return float((x.detach().double().cpu() - r).norm() / r.norm().clamp(min=1e-300))


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(torch.nn.functional.cosine_similarity(a, b, 0))


def _run(fn, q, k, v, d_out, *args, **kwargs) -> list[torch.Tensor]:
    """``[O, dQ, dK, dV]`` of ``fn`` on fresh leaves (the inputs are not touched)."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves, *args, **kwargs)
    out.backward(d_out.to(out.dtype))
    return [out.detach(), *(x.grad for x in leaves)]


def _check_out(out: torch.Tensor, ref: torch.Tensor) -> None:
    o, r = out.detach().float().cpu(), ref.detach().float().cpu()
    assert bool(torch.isfinite(o).all())
    rel_bound, max_bound = (1e-2, 2**-3) if out.is_cuda else (5e-3, 2**-5)
    assert _rel(o, r) <= rel_bound, _rel(o, r)
    assert float((o - r).abs().max()) <= max_bound * float(r.abs().max())


def _check_against_twin(kern: list, ref: list, exact: list | None = None) -> None:
    """O within the kernel path's bounds; each gradient within 3% of the twin's, relative to
    the twin's norm or, where that is (near) zero — dQ/dK of 1-token documents, whose
    softmax has one key — to 2e-2 of the call's largest gradient norm, i.e. within 6e-4 of
    it (a GPU's FP8 dot and D's FP32 sum round dP − D differently, leaving a residue the
    twin does not have: 9.2e-5 and 9.6e-5 of dV's norm measured for 1-token documents on an
    H100, 2026-12-06)."""
    _check_out(kern[0], ref[0])
    scale = max(float(r.detach().double().norm()) for r in ref[1:])
    for name, a, r in zip(NAMES[1:], kern[1:], ref[1:], strict=True):
        assert a.shape == r.shape and a.dtype == r.dtype, name
        assert bool(torch.isfinite(a).all()), name
        diff = float((a.detach().double() - r.detach().double()).norm())
        den = max(float(r.detach().double().norm()), 2e-2 * scale, 1e-300)
        assert diff / den <= 3e-2, (name, diff / den)
    if exact is not None:
        for name, a, r, e in zip(NAMES, kern, ref, exact, strict=True):
            assert _cos(a, e) >= _cos(r, e) - 2e-4, (name, _cos(a, e), _cos(r, e))


def _same(a: torch.Tensor, b: torch.Tensor, name: str, *, chained: bool = False) -> bool:
    """Bit for bit; on a GPU dQ (FP32 atomics) within their summation order, and every
    gradient of a chain of calls (one call's dQ is the previous call's incoming gradient)."""
    if a.is_cuda and (name == "dQ" or (chained and name != "O")):
        return _rel(a, b) <= 1e-2
    return torch.equal(a, b)


# ---- shapes, dtypes, recipes against the twin -------------------------------------------

CASES = [
    # lens, hq, hkv, d, dtype, recipe, causal, exact_causal
    ((19,), 16, 1, 64, torch.bfloat16, "mxfp8", True, False),
    ((1, 0, 20), 8, 1, 64, torch.float16, "mxfp8", False, False),
    ((3, 0, 20), 2, 1, 128, torch.float16, "mixed_nvfp4", False, True),
    ((19, 1), 2, 2, 256, torch.bfloat16, "mixed_nvfp4_hadamard", True, False),
    ((33, 0, 2), 4, 1, 64, torch.float16, "mxfp8_grad_input", True, True),
    ((45,), 1, 1, 256, torch.bfloat16, "mxfp8", False, True),
]


@pytest.mark.parametrize(
    ("lens", "hq", "hkv", "d", "dtype", "recipe", "causal", "exact"),
    CASES,
    ids=[
        f"T{sum(c[0])}-g{c[1] // c[2]}-H{c[2]}-D{c[3]}-{str(c[4])[6:]}-{c[5]}"
        f"-{'causal' if c[6] else 'full'}{'-exact' if c[7] else ''}"
        for c in CASES
    ],
)
def test_matches_twin_across_groups_dims_dtypes_recipes(
    lens, hq, hkv, d, dtype, recipe, causal, exact, device
) -> None:
    """O and dQ/dK/dV against the twin and float64 for GQA groups 1-16 (Hkv = 1 too), every
    head dim, FP16 and BF16, every recipe, non-causal and exact-causal calls, packs with
    empty and 1-token documents and T not a multiple of 16; inputs unchanged."""
    q, k, v, cu, ms = make_pack(lens, hq, hkv, d, seed=3, device=device, dtype=dtype)
    d_out = make_pack(lens, hq, hkv, d, seed=4, device=device, dtype=dtype)[0]
    before = [x.clone() for x in (q, k, v, d_out, cu)]
    opts = dict(causal=causal, recipe=recipe, exact_causal=exact)
    kern = _run(flamia_attn_varlen, q, k, v, d_out, cu, ms, **opts)
    ref = _run(attention, q, k, v, d_out, cu, ms, **opts)
    exact64 = _run(attention_float64, q, k, v, d_out, cu, ms, causal=causal)
    assert kern[0].dtype == dtype and kern[0].shape == q.shape
    _check_against_twin(kern, ref, exact64)
    for x, y in zip((q, k, v, d_out, cu), before, strict=True):
        assert torch.equal(x, y)


# ---- layouts of q/k/v ---------------------------------------------------------------------


def _layout_inputs(layout: str, device: str):
    """``(leaf, (q, k, v), gather)``: views of one leaf as a model makes them, and a function
    mapping the contiguous run's (dQ, dK, dV) onto the leaf's gradient."""
    total, d = 30, 64
    gen = torch.Generator().manual_seed(11)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=torch.bfloat16)

    if layout == "fused_qkv":  # qkv = x @ W: [T, (Hq + 2 Hkv)·d], split by heads
        hq, hkv = 2, 1
        leaf = randn(total, (hq + 2 * hkv) * d).requires_grad_()
        heads = leaf.view(total, hq + 2 * hkv, d)
        views = heads[:, :hq], heads[:, hq : hq + hkv], heads[:, hq + hkv :]

        def gather(dq, dk, dv):
            return torch.cat([dq, dk, dv], dim=1).view(total, -1)

    elif layout == "head_major":  # [H, T, d] storage, read as [T, H, d]
        leaf = randn(4, total, d).requires_grad_()
        views = leaf[:2].transpose(0, 1), leaf[2:3].transpose(0, 1), leaf[3:].transpose(0, 1)

        def gather(dq, dk, dv):
            return torch.cat([dq, dk, dv], dim=1).transpose(0, 1)

    elif layout == "broadcast_kv":  # one K/V head expanded to the model's Hkv (stride 0)
        leaf = randn(total, 4, d).requires_grad_()
        views = leaf[:, :2], leaf[:, 2:3].expand(total, 2, d), leaf[:, 3:].expand(total, 2, d)

        def gather(dq, dk, dv):
            return torch.cat([dq, dk.sum(1, keepdim=True), dv.sum(1, keepdim=True)], dim=1)

    else:  # "unaligned": a flat buffer read from its second element (2-byte aligned)
        leaf = randn(total * 4 * d + 1).requires_grad_()
        heads = leaf[1:].view(total, 4, d)
        views = heads[:, :2], heads[:, 2:3], heads[:, 3:]

        def gather(dq, dk, dv):
            return torch.cat([dq.new_zeros(1), torch.cat([dq, dk, dv], dim=1).flatten()])

    return leaf, views, gather


@pytest.mark.parametrize("layout", ["fused_qkv", "head_major", "broadcast_kv", "unaligned"])
def test_view_layouts_match_contiguous_copies(layout, device) -> None:
    """Strided q/k/v give what their contiguous copies give, forward and backward, and the
    gradient reaches the tensor the views were taken from."""
    leaf, (q, k, v), gather = _layout_inputs(layout, device)
    cu = torch.tensor([0, 10, 10, 11, 30], dtype=torch.int32, device=device)
    d_out = make_pack((30,), q.shape[1], 1, 64, seed=12, device=device)[0]
    out = flamia_attn_varlen(q, k, v, cu, 19)
    out.backward(d_out)
    copies = _run(flamia_attn_varlen, q.contiguous(), k.contiguous(), v.contiguous(), d_out, cu, 19)
    assert torch.equal(out.detach(), copies[0])
    assert _same(leaf.grad, gather(*copies[1:]), "dQ")
    _check_out(out, attention(q.detach(), k.detach(), v.detach(), cu, 19))


def test_strided_head_dim_is_refused_by_name(device) -> None:
    q, k, v, cu, ms = make_pack((20, 9), 2, 1, 128, device=device)
    half = (q[..., ::2], k[..., ::2], v[..., ::2])  # d = 64 with element stride 2
    for i, name in enumerate("qkv"):
        args = [x[..., :64].contiguous() for x in (q, k, v)]
        args[i] = half[i]
        with pytest.raises(ValueError, match=f"{name} must have a contiguous last dim"):
            flamia_attn_varlen(*args, cu, ms)


# ---- gradients ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["causal", "exact_causal"])
def test_flags_must_be_booleans(name, device) -> None:
    """``causal``/``exact_causal`` take a bool (NumPy's too) or 0/1; a string (``"false"``
    is truthy) or another number is refused by name, by the kernel path and the twin, and
    ``flamia_attn``; 0 / NumPy False give the bool's result."""
    import numpy as np

    q, k, v, cu, ms = make_pack((9, 4), 2, 1, 64, seed=6, device=device)
    for fn in (flamia_attn_varlen, attention):
        for bad in ("false", 2, 0.5, None):
            with pytest.raises(TypeError, match=f"{name} must be a bool"):
                fn(q, k, v, cu, ms, **{name: bad})
        want = fn(q, k, v, cu, ms, **{name: False})
        for ok in (0, np.bool_(False)):
            torch.testing.assert_close(fn(q, k, v, cu, ms, **{name: ok}), want, rtol=0, atol=0)
    with pytest.raises(TypeError, match=f"{name} must be a bool"):
        flamia_attn(q[None], k[None], v[None], **{name: "yes"})
    if name == "causal":  # the float64 twin and the leaky per-tensor comparison too
        for fn in (attention_float64, per_tensor_fp8_attention):
            with pytest.raises(TypeError, match="causal must be a bool"):
                fn(q, k, v, cu, ms, causal="false")


def test_gradients_for_some_inputs_and_strided_incoming_gradients(device) -> None:
    """requires_grad on only some of q/k/v: the others get no gradient, the rest exactly the
    full call's; an incoming gradient that is a transposed view and a second backward
    through a retained graph give the same (twice the) gradients."""
    q, k, v, cu, ms = make_pack((1, 0, 22), 2, 1, 64, seed=5, device=device)
    d_out = make_pack((1, 0, 22), 2, 1, 64, seed=6, device=device)[0]
    full = _run(flamia_attn_varlen, q, k, v, d_out, cu, ms)
    for wanted in ((True, False, False), (False, True, True)):
        leaves = [x.clone().requires_grad_(w) for x, w in zip((q, k, v), wanted, strict=True)]
        out = flamia_attn_varlen(*leaves, cu, ms)
        assert torch.equal(out.detach(), full[0])
        out.backward(d_out)
        for name, x, w, g in zip(NAMES[1:], leaves, wanted, full[1:], strict=True):
            assert (x.grad is not None) == w, name
            if w:
                assert _same(x.grad, g, name), name
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = flamia_attn_varlen(*leaves, cu, ms)
    weight = d_out.transpose(0, 1).contiguous()  # the loss reads O head-major
    loss = (out.transpose(0, 1).float() * weight.float()).sum()
    loss.backward(retain_graph=True)
    first = [x.grad.clone() for x in leaves]
    for name, g, want in zip(NAMES[1:], first, full[1:], strict=True):
        assert _same(g, want, name), name
    loss.backward()
    for name, x, g in zip(NAMES[1:], leaves, first, strict=True):
        assert _same(x.grad, 2 * g, name), name


@pytest.mark.parametrize("windows", [False, True])
def test_empty_pack_backward_of_a_reduced_loss(windows, device) -> None:
    """An empty microbatch (T = 0; the forward returns an empty O) must also run the
    backward of the usual ``loss = o.sum()`` / ``o.mean()``, as the twin does; also with the
    short-document windows a GPU picks for it (their schedule indexed an empty tensor)."""
    cu = torch.zeros(3, dtype=torch.int32, device=device)
    leaves = [torch.zeros(0, h, 64, dtype=torch.bfloat16, device=device, requires_grad=True)
              for h in (2, 1, 1)]  # fmt: skip
    config = None
    if windows:
        base = default_config(64, torch.device(device), kernel="triton")
        config = dataclasses.replace(base, windows=True, quantize_q=False)
    flamia_attn_varlen(*leaves, cu, 0, config=config).float().sum().backward()
    assert [tuple(x.grad.shape) for x in leaves] == [(0, 2, 64), (0, 1, 64), (0, 1, 64)]


# ---- plans reused across layers -----------------------------------------------------------


def test_plan_reused_across_values_layouts_and_layers(device) -> None:
    """One plan for every layer of a step: calls with new values, an input rewritten in
    place, inputs at other strides and offsets, other recipes and head counts give what
    calls without a plan give, and never change an earlier call's outputs; a two-layer
    forward and backward on the plan equals the same without one."""
    lens = (5, 0, 17)
    q, k, v, cu, ms = make_pack(lens, 2, 1, 64, seed=7, device=device)
    total = q.shape[0]
    plan = plan_varlen(cu, total, ms)
    with torch.no_grad():
        buf = q.clone()
        first = flamia_attn_varlen(buf, k, v, cu, ms, plan=plan, return_stats=True)
        kept = [x.clone() for x in first]
        buf.mul_(-1.5)  # the same storage (the allocator's reuse), new values
        calls = [((buf, k, v), {})]
        flat = make_pack((total * 4 + 1,), 1, 1, 64, seed=8, device=device)[0].view(-1)
        heads = flat[1 : 1 + total * 4 * 64].view(total, 4, 64)  # token stride 4d, 2-byte aligned
        calls.append(((heads[:, :2], heads[:, 2:3], heads[:, 3:]), {}))
        calls.append(((heads[:, 1:3], k, v), {"recipe": "mixed_nvfp4", "exact_causal": True}))
        for args, opts in calls:
            got = flamia_attn_varlen(*args, cu, ms, plan=plan, return_stats=True, **opts)
            fresh = flamia_attn_varlen(*(x.contiguous() for x in args), cu, ms,
                                       return_stats=True, **opts)  # fmt: skip
            for a, b in zip(got, fresh, strict=True):
                assert torch.equal(a, b)
        for a, b in zip(first, kept, strict=True):
            assert torch.equal(a, b)

    d_out = make_pack(lens, 2, 1, 64, seed=9, device=device)[0]

    def two_layers(p):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        mid = flamia_attn_varlen(*leaves, cu, ms, plan=p)
        fused = torch.cat([mid, leaves[1], leaves[2] * 0.5], dim=1)  # [T, 4, d]
        out = flamia_attn_varlen(fused[:, :2], fused[:, 2:3], fused[:, 3:], cu, ms, plan=p)
        out.backward(d_out)
        return [out.detach(), *(x.grad for x in leaves)]

    for name, a, b in zip(NAMES, two_layers(plan), two_layers(None), strict=True):
        assert _same(a, b, name, chained=True), name


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's NaN/Inf arithmetic
def test_nonfinite_call_leaves_nothing_in_a_reused_plan(device) -> None:
    """A step whose inputs held NaN/Inf, then a clean step on the same plan (its kept
    buffers): the clean step equals a clean call without a plan, forward and backward."""
    q, k, v, cu, ms = make_pack((5, 20), 2, 1, 64, seed=10, device=device)
    d_out = make_pack((5, 20), 2, 1, 64, seed=11, device=device)[0]
    plan = plan_varlen(cu, q.shape[0], ms)
    bad = [x.clone() for x in (q, k, v, d_out)]
    bad[0][10, 0, 3] = float("nan")
    bad[1][24, 0, 7] = float("inf")
    bad[2][5, 0, 1] = float("nan")
    bad[3][15, 1, 2] = float("-inf")
    _run(flamia_attn_varlen, *bad, cu, ms, plan=plan)
    clean = _run(flamia_attn_varlen, q, k, v, d_out, cu, ms, plan=plan)
    for name, a, b in zip(NAMES, clean, _run(flamia_attn_varlen, q, k, v, d_out, cu, ms),
                          strict=True):  # fmt: skip
        assert bool(torch.isfinite(a).all()), name
        assert _same(a, b, name), name


def test_max_seqlen_must_cover_the_longest_document(device) -> None:
    q, k, v, cu, _ms = make_pack((20, 29), 2, 1, 64, device=device)
    for bad in (28, 0):
        with pytest.raises(ValueError, match=r"max_seqlen \(\d+\) is below the longest"):
            flamia_attn_varlen(q, k, v, cu, bad)
        with pytest.raises(ValueError, match=r"max_seqlen \(\d+\) is below the longest"):
            plan_varlen(cu, q.shape[0], bad)
    for bad in (29.0, torch.tensor(29), True):  # e.g. lengths.max() left a tensor
        with pytest.raises(TypeError, match="max_seqlen must be an int"):
            flamia_attn_varlen(q, k, v, cu, bad)


# ---- magnitudes ---------------------------------------------------------------------------

MAGNITUDES = [
    # q/k scale, v scale, dO scale, dtype
    (1e-6, 1e-6, 1e-6, torch.bfloat16),
    (1.0, 1e4, 1e4, torch.bfloat16),
    (1e-3, 1e4, 1e-6, torch.float16),
]


def _scaled(lens, qk, vs, ds, dtype, device):
    q, k, v, cu, ms = make_pack(lens, 2, 1, 64, seed=13, device=device, dtype=torch.float32)
    d_out = make_pack(lens, 2, 1, 64, seed=14, device=device, dtype=torch.float32)[0]
    q, k, v, d_out = ((x * s).to(dtype) for x, s in ((q, qk), (k, qk), (v, vs), (d_out, ds)))
    return q, k, v, d_out, cu, ms


@pytest.mark.parametrize(("qk", "vs", "ds", "dtype"), MAGNITUDES)
def test_small_and_large_magnitudes_match_twin(qk, vs, ds, dtype, device) -> None:
    q, k, v, d_out, cu, ms = _scaled((12, 1, 15), qk, vs, ds, dtype, device)
    kern = _run(flamia_attn_varlen, q, k, v, d_out, cu, ms)
    _check_against_twin(kern, _run(attention, q, k, v, d_out, cu, ms))


def test_huge_logits_match_twin(device) -> None:
    """q, k ~ 1e4 (BF16, logits ~2^27): the softmax is one-hot; O must stay the twin's (a V̂
    row) and the gradients finite. (Their size is not bounded here: dQ/dK are the FP8 dP − D
    residue times |q| ~ 1e4, 1024 at most on an H100; dV: the next test.)"""
    q, k, v, d_out, cu, ms = _scaled((12, 1, 15), 1e4, 1.0, 1.0, torch.bfloat16, device)
    kern = _run(flamia_attn_varlen, q, k, v, d_out, cu, ms)
    ref = _run(attention, q, k, v, d_out, cu, ms)
    _check_out(kern[0], ref[0])
    for name, g in zip(NAMES[1:], kern[1:], strict=True):
        assert bool(torch.isfinite(g).all()), name


@pytest.mark.xfail(
    strict=True,
    reason="lse = M + log2(l) in float32 keeps none of log2(l)'s bits below M's ulp (8 to 16 "
    "at |M| ~ 2^27), so the backward's f = 2^(M - 8 - lse) is off by powers of two: dV rows "
    "~100x float64's, kernel and twin alike (a float32 lse cannot hold those bits there)",
)
def test_huge_logits_dv_matches_float64(device) -> None:
    q, k, v, d_out, cu, ms = _scaled((12, 1, 15), 1e4, 1.0, 1.0, torch.bfloat16, device)
    kern = _run(flamia_attn_varlen, q, k, v, d_out, cu, ms)
    exact = _run(attention_float64, q, k, v, d_out, cu, ms)
    assert _rel(kern[3], exact[3]) <= 0.5


@pytest.mark.xfail(
    strict=True,
    reason="tiny dO (1e-32): Ĝ's token-block exponent clamps at -127 and the backward "
    "multiplies by exp2i(-127) = 0 (the twin: 2^-127), so dV is flushed to 0",
)
def test_tiny_incoming_gradient_keeps_dv(device) -> None:
    q, k, v, d_out, cu, ms = _scaled((12, 1, 15), 1.0, 1.0, 1e-32, torch.bfloat16, device)
    kern = _run(flamia_attn_varlen, q, k, v, d_out, cu, ms)
    ref = _run(attention, q, k, v, d_out, cu, ms)
    assert _rel(ref[3], _run(attention_float64, q, k, v, d_out, cu, ms)[3]) <= 0.1
    assert _rel(kern[3], ref[3]) <= 3e-2


# ---- batched calls ------------------------------------------------------------------------


@pytest.mark.parametrize(("batch", "seq"), [(1, 1), (2, 1), (2, 9)])
def test_batched_tiny_shapes_and_head_major_views(batch, seq, device) -> None:
    """``flamia_attn`` with B = 1 or S = 1 and with [B, H, S, d] tensors read as
    [B, S, H, d] (``transpose(1, 2)``, as transformers' attention modules hold them)."""
    gen = torch.Generator().manual_seed(batch * 100 + seq)
    q, k, v, d_out = (
        torch.randn(batch, h, seq, 64, generator=gen).to(device=device, dtype=torch.bfloat16)
        for h in (4, 2, 2, 4)
    )
    kern = _run(lambda *a: flamia_attn(*(x.transpose(1, 2) for x in a)).transpose(1, 2),
                q, k, v, d_out)  # fmt: skip
    cu = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=device)

    def packed(*a):
        flat = (x.transpose(1, 2).reshape(batch * seq, x.shape[1], 64) for x in a)
        return attention(*flat, cu, seq).view(batch, seq, 4, 64).transpose(1, 2)

    ref = _run(packed, q, k, v, d_out)
    assert kern[0].shape == (batch, 4, seq, 64)
    _check_against_twin(kern, ref)


# ---- leakage ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("recipe", "exact"),
    [("mxfp8", False), ("mxfp8", True), ("mixed_nvfp4_hadamard", False)],
)
def test_no_leak_at_unaligned_document_starts(recipe, exact, device) -> None:
    """Document 1 starts at token 20 (not a multiple of 32). Changing its tokens from
    position t on leaves its rows of the 32-token blocks that end before t (rows before t
    with per-token exponents: ``exact_causal``, and the NVFP4 Q/K of the mixed recipes
    are per token too) and every other document bit-identical."""
    lens, start, length = (20, 44, 2), 20, 44
    q, k, v, cu, ms = make_pack(lens, 2, 1, 64, seed=15, device=device)
    opts = dict(recipe=recipe, exact_causal=exact)
    base = flamia_attn_varlen(q, k, v, cu, ms, **opts)
    per_token = exact or recipe.startswith("mixed")
    t = 40  # in the document's second 32-token block (tokens 52-63 of the pack)
    changed = [x.clone() for x in (q, k, v)]
    for x in changed:
        x[start + t : start + length] = torch.randn_like(x[start + t : start + length]) * 4
    out = flamia_attn_varlen(*changed, cu, ms, **opts)
    keep = start + (t if per_token else t // 32 * 32)
    assert torch.equal(out[:keep], base[:keep])
    assert torch.equal(out[start + length :], base[start + length :])
    assert not torch.equal(out[start + t :], base[start + t :])
