"""Probes: future/cross-document leakage and accuracy against float64 (library + CLI).

Leakage: for a causal call, the tokens after position ``t`` of one document are replaced
by fresh values ``SPIKE`` times larger (adversarial: any scale computed over them grows
by about 2^10, pushing earlier elements that share it into E4M3's subnormal range), and the largest
change of the outputs at positions ``<= t`` is reported; separately every *other*
document of the pack is replaced and the largest change anywhere in the probed document
is reported. Zero means bit-identical outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from flamia_serve.reference import attention, attention_float64, per_tensor_fp8_attention

SPIKE = 1024.0

AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]

#: (name, recipe or None for the per-tensor comparison, exact_causal)
LEAKAGE_METHODS: tuple[tuple[str, str | None, bool], ...] = (
    ("mxfp8", "mxfp8", False),
    ("mxfp8 exact_causal", "mxfp8", True),
    ("mixed_nvfp4", "mixed_nvfp4", False),
    ("mixed_nvfp4 exact_causal", "mixed_nvfp4", True),
    ("per-tensor fp8 (leaky comparison)", None, False),
)
ACCURACY_RECIPES = ("mxfp8", "mixed_nvfp4", "mixed_nvfp4_hadamard")


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


def attention_fn(recipe: str | None, exact_causal: bool) -> AttnFn:
    """Causal attention callable for a probe row (``None`` = per-tensor FP8)."""
    if recipe is None:
        return lambda q, k, v, cu, ms: per_tensor_fp8_attention(q, k, v, cu, ms)
    return lambda q, k, v, cu, ms: attention(
        q, k, v, cu, ms, recipe=recipe, exact_causal=exact_causal
    )


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
    gen = torch.Generator().manual_seed(seed)
    changed = []
    for x in qkv:
        noise = (torch.randn(x.shape, generator=gen) * SPIKE).to(device=x.device, dtype=x.dtype)
        changed.append(torch.where(replace.to(x.device)[:, None, None], noise, x))
    base = fn(*qkv, cu_seqlens, max_seqlen)[watch].float()
    moved = fn(*changed, cu_seqlens, max_seqlen)[watch].float()
    return float((base - moved).abs().max())


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
    """Largest |ΔO| at positions ``<= t`` of ``doc`` when its tokens after ``t`` change."""
    start, end = int(cu_seqlens[doc]), int(cu_seqlens[doc + 1])
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
    start, end = int(cu_seqlens[doc]), int(cu_seqlens[doc + 1])
    replace = torch.ones(q.shape[0], dtype=torch.bool)
    replace[start:end] = False
    return _replaced_rows(fn, (q, k, v), cu_seqlens, max_seqlen, replace, slice(start, end), seed)


@dataclass(frozen=True)
class LeakageRow:
    method: str
    layout: str
    future_leak: float
    cross_doc_leak: float


def leakage_table(*, seed: int = 0, device: str | torch.device = "cpu") -> list[LeakageRow]:
    """Leakage of every method on a packed call (unequal documents) and a batched call
    (equal documents), probing several cut points inside and at the end of 32-token blocks."""
    layouts = {"packed": (45, 97, 70), "batched": (80, 80, 80)}
    rows = []
    for layout, lens in layouts.items():
        q, k, v, cu, ms = make_pack(lens, 4, 2, 64, seed=seed, device=device)
        cuts = (0, 5, 33, lens[1] - 3)
        for name, recipe, exact in LEAKAGE_METHODS:
            fn = attention_fn(recipe, exact)
            future = max(future_leakage(fn, q, k, v, cu, ms, 1, t, seed=seed + t) for t in cuts)
            cross = cross_document_leakage(fn, q, k, v, cu, ms, 1, seed=seed)
            rows.append(LeakageRow(name, layout, future, cross))
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
    doc_lens: Sequence[int] = (1, 63, 200, 120),
    heads: tuple[int, int] = (8, 2),
    head_dim: int = 128,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> list[AccuracyRow]:
    """cos-sim and relative error of O, dQ, dK, dV against float64, per recipe."""
    q, k, v, cu, ms = make_pack(doc_lens, *heads, head_dim, seed=seed, device=device)
    d_out = make_pack(doc_lens, heads[0], 1, head_dim, seed=seed + 1, device=device)[0]
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    ref = attention_float64(*leaves, cu, ms)
    ref_grads = torch.autograd.grad(ref, leaves, d_out.double())
    rows = []
    for recipe in ACCURACY_RECIPES:
        out = attention(*leaves, cu, ms, recipe=recipe)
        grads = torch.autograd.grad(out, leaves, d_out)
        for name, x, r in zip(
            ("O", "dQ", "dK", "dV"), (out, *grads), (ref, *ref_grads), strict=True
        ):
            rows.append(AccuracyRow(recipe, name, *_compare(x, r)))
    out = per_tensor_fp8_attention(q, k, v, cu, ms)
    rows.append(AccuracyRow("per-tensor fp8", "O", *_compare(out, ref)))
    return rows


def probe(*, seed: int = 0, device: str | torch.device = "cpu") -> dict[str, list[dict]]:
    """Both tables as plain dicts (what ``flamia probe`` writes as JSON)."""
    return {
        "leakage": [asdict(r) for r in leakage_table(seed=seed, device=device)],
        "accuracy": [asdict(r) for r in accuracy_table(seed=seed, device=device)],
    }
