"""Probes: future/cross-document leakage and accuracy against float64 (library + CLI).

Leakage, forward: for a causal call, the tokens after position ``t`` of one document are
replaced by fresh values ``SPIKE`` times larger (adversarial: any scale computed over them
grows by about 2^10, pushing earlier elements that share it into E4M3's subnormal range),
and the largest change of the outputs at positions ``<= t`` is reported; separately every
*other* document of the pack is replaced and the largest change anywhere in the probed
document is reported. Zero means bit-identical outputs.

Leakage, backward: the same replacement, applied to q, k, v *and* the incoming gradient
dO. dQ rows in the token blocks that end at or before ``t`` must not change (the rows of
``t``'s own block may: dO and dS share block exponents); dQ, dK and dV of a document must
not change when other documents do.

The probed attention is pluggable: any callable with the signature of
:func:`flamia_serve.reference.attention` (``attention(q, k, v, cu_seqlens, max_seqlen, *,
causal, recipe, exact_causal)``), e.g. :func:`flamia_serve.flamia_attn_varlen` on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from flamia_serve.numerics import resolve_recipe
from flamia_serve.reference import attention, attention_float64, per_tensor_fp8_attention
from flamia_serve.reference.float64 import _varlen as _float64_varlen

SPIKE = 1024.0

AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
#: ``attention(q, k, v, cu_seqlens, max_seqlen, *, causal, recipe, exact_causal)``
AttentionImpl = Callable[..., torch.Tensor]

#: (name, recipe or None for the per-tensor comparison, exact_causal)
LEAKAGE_METHODS: tuple[tuple[str, str | None, bool], ...] = (
    ("mxfp8", "mxfp8", False),
    ("mxfp8 exact_causal", "mxfp8", True),
    ("mixed_nvfp4", "mixed_nvfp4", False),
    ("mixed_nvfp4 exact_causal", "mixed_nvfp4", True),
    ("mxfp8_grad_input exact_causal", "mxfp8_grad_input", True),
    ("per-tensor fp8 (leaky)", None, False),
)
ACCURACY_RECIPES = ("mxfp8", "mxfp8_grad_input", "mixed_nvfp4", "mixed_nvfp4_hadamard")


@dataclass(frozen=True)
class LeakageSetup:
    """What the leakage table probes: random normal BF16 inputs, document ``doc`` of each
    layout, cut points ``t`` (document-local; negative = from the document's end)."""

    heads_q: int = 4
    heads_kv: int = 2
    head_dim: int = 64
    layouts: tuple[tuple[str, tuple[int, ...]], ...] = (
        ("packed", (45, 97, 70)),
        ("batched", (80, 80, 80)),
    )
    doc: int = 1
    cuts: tuple[int, ...] = (0, 5, 31, 33, -3)
    spike: float = SPIKE


@dataclass(frozen=True)
class AccuracySetup:
    """What the accuracy table probes: random normal BF16 q, k, v, dO; causal."""

    heads_q: int = 8
    heads_kv: int = 2
    head_dim: int = 128
    doc_lens: tuple[int, ...] = (1, 63, 200, 120)


def make_pack(
    doc_lens: Sequence[int],
    heads_q: int,
    heads_kv: int,
    head_dim: int,
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Random normal packed ``(q, k, v, cu_seqlens, max_seqlen)`` for the given documents."""
    gen = torch.Generator().manual_seed(seed)
    total = int(sum(doc_lens))
    cu = torch.zeros(len(doc_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(doc_lens), 0)

    def rand(h: int) -> torch.Tensor:
        return torch.randn(total, h, head_dim, generator=gen).to(device=device, dtype=dtype)

    return rand(heads_q), rand(heads_kv), rand(heads_kv), cu.to(device), max(doc_lens)


def doc_span(cu_seqlens: torch.Tensor, doc: int, t: int | None = None) -> tuple[int, int, int]:
    """``(start, end, t)`` of document ``doc`` of a pack, a negative cut ``t`` counted from
    the document's end (as ``LeakageSetup.cuts``; a cut at or past the last token has no
    future: leakage 0). ``ValueError`` names ``doc`` outside ``[0, B)`` or ``t`` below
    ``-length`` (they watched no rows of the document and reported 0)."""
    docs = cu_seqlens.numel() - 1
    if isinstance(doc, bool) or not isinstance(doc, int) or not 0 <= doc < docs:
        raise ValueError(f"doc must be an int in [0, {docs}), got {doc!r}")
    start, end = int(cu_seqlens[doc]), int(cu_seqlens[doc + 1])
    if t is None:
        return start, end, 0
    length = end - start
    if isinstance(t, bool) or not isinstance(t, int) or t < -length:
        raise ValueError(f"t must be an int >= -{length} (document {doc} has {length} "
                         f"tokens), got {t!r}")  # fmt: skip
    return start, end, t + length if t < 0 else t


def attention_fn(recipe: str | None, exact_causal: bool, impl: AttentionImpl = attention) -> AttnFn:
    """Causal attention callable for a probe row (``None`` = per-tensor FP8); ``impl`` is
    the probed attention (default: the reference)."""
    if recipe is None:
        return lambda q, k, v, cu, ms: per_tensor_fp8_attention(q, k, v, cu, ms)
    return lambda q, k, v, cu, ms: impl(
        q, k, v, cu, ms, causal=True, recipe=recipe, exact_causal=exact_causal
    )


def _replace(
    tensors: Sequence[torch.Tensor], replace: torch.Tensor, seed: int
) -> list[torch.Tensor]:
    """Copies of ``tensors`` ``[T, ...]`` whose rows where ``replace`` is True hold fresh
    normal values ``SPIKE`` times larger (the inputs are not modified)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for x in tensors:
        noise = (torch.randn(x.shape, generator=gen) * SPIKE).to(device=x.device, dtype=x.dtype)
        mask = replace.to(x.device).view(-1, *([1] * (x.dim() - 1)))
        out.append(torch.where(mask, noise, x))
    return out


def _max_change(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a − b| (0.0 for empty slices; NaN in both counts as unchanged, NaN in one
    as an infinite change)."""
    if a.numel() == 0:
        return 0.0
    a, b = a.float(), b.float()
    diff = (a - b).abs().masked_fill(a.isnan() & b.isnan(), 0.0)
    return float(diff.nan_to_num(nan=float("inf")).max())


def _replaced_rows(
    fn: AttnFn,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    replace: torch.Tensor,
    watch: slice,
    seed: int,
) -> float:
    """Largest |ΔO| on the ``watch`` rows when the tokens where ``replace`` is True get fresh
    values ``SPIKE`` times larger; the inputs themselves are not modified."""
    changed = _replace(qkv, replace, seed)
    with torch.no_grad():
        base = fn(*qkv, cu_seqlens, max_seqlen)[watch]
        moved = fn(*changed, cu_seqlens, max_seqlen)[watch]
    return _max_change(base, moved)


def future_leakage(
    fn: AttnFn,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    doc: int,
    t: int,
    *,
    seed: int = 1,
) -> float:
    """Largest |ΔO| at positions ``<= t`` of ``doc`` when its tokens after ``t`` change
    (``t`` < 0: from the end, :func:`doc_span`)."""
    start, end, t = doc_span(cu_seqlens, doc, t)
    cut = start + t + 1
    replace = torch.zeros(q.shape[0], dtype=torch.bool)
    replace[cut:end] = True
    return _replaced_rows(fn, (q, k, v), cu_seqlens, max_seqlen, replace, slice(start, cut), seed)


def cross_document_leakage(
    fn: AttnFn,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    doc: int,
    *,
    seed: int = 2,
) -> float:
    """Largest |ΔO| anywhere in ``doc`` when every other document of the pack changes."""
    start, end, _ = doc_span(cu_seqlens, doc)
    replace = torch.ones(q.shape[0], dtype=torch.bool)
    replace[start:end] = False
    return _replaced_rows(fn, (q, k, v), cu_seqlens, max_seqlen, replace, slice(start, end), seed)


def forward_backward(
    fn: AttnFn,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    d_out: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(O, dQ, dK, dV)`` of ``fn`` for the incoming gradient ``d_out`` (inputs untouched)."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    with torch.enable_grad():
        out = fn(*leaves, cu_seqlens, max_seqlen)
        grads = torch.autograd.grad(out, leaves, d_out.to(out.dtype))
    return out.detach(), grads[0], grads[1], grads[2]


def float64_forward_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    d_out: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 ``(O, dQ, dK, dV)`` of exact causal softmax attention: autograd in float64
    from float64 leaves (gradients not rounded back to the inputs' dtype)."""
    attention_float64(q, k, v, cu_seqlens, max_seqlen)  # validates the arguments
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    scale = q.shape[-1] ** -0.5
    with torch.enable_grad():
        # the validated body of attention_float64 (it accepts only BF16/FP16 inputs)
        out = _float64_varlen(*leaves, cu_seqlens, True, scale)
        grads = torch.autograd.grad(out, leaves, d_out.double())
    return out.detach(), grads[0], grads[1], grads[2]


def complete_block_rows(start: int, t: int, block: int = 32) -> slice:
    """Rows of the document starting at ``start`` whose ``block``-token block (document-
    local) ends at or before position ``t``: ``start .. start + block·⌊(t+1)/block⌋``."""
    return slice(start, start + block * ((t + 1) // block))


def future_grad_leakage(
    fn: AttnFn,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    d_out: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    doc: int,
    t: int,
    *,
    block: int = 32,
    seed: int = 1,
) -> float:
    """Largest |ΔdQ| on the rows of ``doc`` in ``block``-token blocks that end at or before
    ``t``, when q, k, v and dO after ``t`` (inside ``doc``) change. 0.0 when no block ends
    by ``t`` (``t`` < 0: from the end, :func:`doc_span`)."""
    start, end, t = doc_span(cu_seqlens, doc, t)
    replace = torch.zeros(q.shape[0], dtype=torch.bool)
    replace[start + t + 1 : end] = True
    watch = complete_block_rows(start, t, block)
    base = forward_backward(fn, q, k, v, d_out, cu_seqlens, max_seqlen)[1]
    moved = forward_backward(fn, *_replace((q, k, v, d_out), replace, seed), cu_seqlens,
                             max_seqlen)[1]  # fmt: skip
    return _max_change(base[watch], moved[watch])


def cross_document_grad_leakage(
    fn: AttnFn,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    d_out: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    doc: int,
    *,
    seed: int = 2,
) -> float:
    """Largest |Δ| of dQ, dK and dV anywhere in ``doc`` when q, k, v and dO of every other
    document change."""
    start, end, _ = doc_span(cu_seqlens, doc)
    replace = torch.ones(q.shape[0], dtype=torch.bool)
    replace[start:end] = False
    base = forward_backward(fn, q, k, v, d_out, cu_seqlens, max_seqlen)[1:]
    moved = forward_backward(fn, *_replace((q, k, v, d_out), replace, seed), cu_seqlens,
                             max_seqlen)[1:]  # fmt: skip
    return max(_max_change(a[start:end], b[start:end]) for a, b in zip(base, moved, strict=True))


@dataclass(frozen=True)
class LeakageRow:
    """Largest changes (0 = bit-identical). ``future_leak``/``cross_doc_leak``: O;
    ``future_leak_dq``: dQ rows in blocks ending by the cut; ``cross_doc_leak_grads``:
    dQ/dK/dV of the document (None: backward not probed)."""

    method: str
    layout: str
    future_leak: float
    cross_doc_leak: float
    future_leak_dq: float | None = None
    cross_doc_leak_grads: float | None = None


def _block_of(recipe: str | None) -> int:
    """Rows sharing a dQ-side exponent (dO token block and dS row block)."""
    if recipe is None:
        return 32
    rec = resolve_recipe(recipe)
    return max(rec.token_block, rec.ds_block[0])


def _leakage_row(
    name: str,
    layout: str,
    recipe: str | None,
    fn: AttnFn,
    pack: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int],
    d_out: torch.Tensor | None,
    cuts: Sequence[int],
    doc: int,
    seed: int,
) -> LeakageRow:
    q, k, v, cu, ms = pack
    start, end = int(cu[doc]), int(cu[doc + 1])
    if d_out is None:
        future = max(future_leakage(fn, q, k, v, cu, ms, doc, t, seed=seed + t) for t in cuts)
        cross = cross_document_leakage(fn, q, k, v, cu, ms, doc, seed=seed)
        return LeakageRow(name, layout, future, cross)
    # one baseline forward+backward shared by every cut (same values as future_leakage
    # and future_grad_leakage, with fewer calls)
    base = forward_backward(fn, q, k, v, d_out, cu, ms)
    block = _block_of(recipe)
    future = future_dq = 0.0
    for t in cuts:
        replace = torch.zeros(q.shape[0], dtype=torch.bool)
        replace[start + t + 1 : end] = True
        moved = forward_backward(fn, *_replace((q, k, v, d_out), replace, seed + t), cu, ms)
        rows = slice(start, start + t + 1)
        future = max(future, _max_change(base[0][rows], moved[0][rows]))
        rows = complete_block_rows(start, t, block)
        future_dq = max(future_dq, _max_change(base[1][rows], moved[1][rows]))
    replace = torch.ones(q.shape[0], dtype=torch.bool)
    replace[start:end] = False
    moved = forward_backward(fn, *_replace((q, k, v, d_out), replace, seed), cu, ms)
    cross, cross_grads = (
        max(_max_change(a[start:end], b[start:end]) for a, b in zip(xs, ys, strict=True))
        for xs, ys in ((base[:1], moved[:1]), (base[1:], moved[1:]))
    )
    return LeakageRow(name, layout, future, cross, future_dq, cross_grads)


def leakage_table(
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    impl: AttentionImpl = attention,
    backward: bool = True,
) -> list[LeakageRow]:
    """Leakage of every method on a packed call (unequal documents) and a batched call
    (equal documents), cutting inside and at the end of 32-token blocks
    (``LeakageSetup``). ``impl``: the probed attention; ``backward=False`` probes the
    forward only (for a forward-only ``impl``)."""
    s = LeakageSetup()
    rows = []
    for layout, lens in s.layouts:
        pack = make_pack(lens, s.heads_q, s.heads_kv, s.head_dim, seed=seed, device=device)
        d_out = None
        if backward:
            d_out = make_pack(lens, s.heads_q, 1, s.head_dim, seed=seed + 7, device=device)[0]
        cuts = [t if t >= 0 else lens[s.doc] + t for t in s.cuts]
        for name, recipe, exact in LEAKAGE_METHODS:
            fn = attention_fn(recipe, exact, impl)
            rows.append(_leakage_row(name, layout, recipe, fn, pack, d_out, cuts, s.doc, seed))
    return rows


@dataclass(frozen=True)
class AccuracyRow:
    recipe: str
    tensor: str
    cos_sim: float
    rel_err: float


def _compare(x: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    a, b = x.detach().double().flatten(), ref.detach().double().flatten()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=0)
    return float(cos), float((a - b).norm() / b.norm())


def accuracy_table(
    *,
    doc_lens: Sequence[int] = AccuracySetup.doc_lens,
    heads: tuple[int, int] = (AccuracySetup.heads_q, AccuracySetup.heads_kv),
    head_dim: int = AccuracySetup.head_dim,
    seed: int = 0,
    device: str | torch.device = "cpu",
    impl: AttentionImpl = attention,
    backward: bool = True,
) -> list[AccuracyRow]:
    """cos-sim and relative error of O (and dQ, dK, dV with ``backward``) against float64
    attention (its gradients by float64 autograd), per recipe, for ``impl``."""
    q, k, v, cu, ms = make_pack(doc_lens, *heads, head_dim, seed=seed, device=device)
    d_out = make_pack(doc_lens, heads[0], 1, head_dim, seed=seed + 1, device=device)[0]
    ref_all = float64_forward_backward(q, k, v, d_out, cu, ms)
    names = ("O", "dQ", "dK", "dV") if backward else ("O",)
    rows = []
    for recipe in ACCURACY_RECIPES:
        fn = attention_fn(recipe, False, impl)
        if backward:
            got: tuple[torch.Tensor, ...] = forward_backward(fn, q, k, v, d_out, cu, ms)
        else:
            with torch.no_grad():
                got = (fn(q, k, v, cu, ms),)
        for name, x, r in zip(names, got, ref_all, strict=False):
            rows.append(AccuracyRow(recipe, name, *_compare(x, r)))
    with torch.no_grad():
        out = per_tensor_fp8_attention(q, k, v, cu, ms)
    rows.append(AccuracyRow("per-tensor fp8", "O", *_compare(out, ref_all[0])))
    return rows


def probe(
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    impl: AttentionImpl = attention,
    backward: bool = True,
) -> dict[str, object]:
    """Both tables as plain dicts, with what was probed (what ``flamia probe`` writes as
    JSON). ``impl`` is the probed attention (default: ``flamia_serve.reference.attention``);
    ``backward=False`` leaves out the gradient rows and columns."""
    name = f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__qualname__', repr(impl))}"
    return {
        "attention": name,
        "backward": backward,
        "setup": {"leakage": asdict(LeakageSetup()), "accuracy": asdict(AccuracySetup())},
        "leakage": [
            asdict(r) for r in leakage_table(seed=seed, device=device, impl=impl, backward=backward)
        ],
        "accuracy": [
            asdict(r)
            for r in accuracy_table(seed=seed, device=device, impl=impl, backward=backward)
        ],
    }
