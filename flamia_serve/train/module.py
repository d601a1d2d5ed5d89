"""``flamia_attention``: one differentiable call for packed or batched attention, on the
kernels (CUDA) or the reference twin (anywhere else), and ``FlamiaAttention``, its module."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from flamia_serve.attention import flamia_attn, flamia_attn_varlen
from flamia_serve.numerics import Recipe
from flamia_serve.numerics.checks import batched_cu_seqlens
from flamia_serve.plan import VarlenPlan
from flamia_serve.reference import attention as reference_attention

Path = Literal["auto", "kernel", "reference"]
PATHS: tuple[str, ...] = ("auto", "kernel", "reference")


def use_kernels(device: torch.device, path: Path = "auto") -> bool:
    """``auto``: the kernels on CUDA tensors, the reference twin (same numerics) elsewhere;
    ``kernel`` / ``reference`` force one (``kernel`` on a CPU needs Triton's interpreter,
    ``TRITON_INTERPRET=1``: tests). ``ValueError`` names the choices."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if path != "auto":
        return path == "kernel"
    return device.type == "cuda"


def flamia_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    *,
    causal: bool = True,
    recipe: str | Recipe = "mxfp8",
    exact_causal: bool = False,
    softmax_scale: float | None = None,
    plan: VarlenPlan | None = None,
    path: Path = "auto",
) -> torch.Tensor:
    """FLAMIA attention, differentiable.

    Packed: q ``[T, Hq, d]``, k/v ``[T, Hkv, d]`` with ``cu_seqlens`` ``[B+1]`` int32 and
    ``max_seqlen``. Batched (``cu_seqlens=None``): q ``[B, S, Hq, d]``, k/v ``[B, S, Hkv, d]``,
    every row one document. BF16/FP16, d in {64, 128, 256}. ``path``: see ``use_kernels``.
    """
    kernels = use_kernels(q.device, path)
    opts = dict(
        causal=causal, recipe=recipe, exact_causal=exact_causal, softmax_scale=softmax_scale
    )
    if cu_seqlens is None:
        if q.dim() != 4:
            raise ValueError(
                f"q must be [B, S, Hq, d] without cu_seqlens, got shape {tuple(q.shape)}"
            )
        if kernels:
            return flamia_attn(q, k, v, **opts)
        cu = batched_cu_seqlens(q, k, v)
        if cu is None:  # nothing to attend: an empty output (still in q's graph)
            return q.clone()
        flat = (x.flatten(0, 1) for x in (q, k, v))
        return reference_attention(*flat, cu, q.shape[1], **opts).view(q.shape)
    if max_seqlen is None:
        raise ValueError("max_seqlen is required with cu_seqlens")
    if kernels:
        return flamia_attn_varlen(q, k, v, cu_seqlens, max_seqlen, plan=plan, **opts)
    return reference_attention(q, k, v, cu_seqlens, max_seqlen, **opts)


class FlamiaAttention(nn.Module):
    """Drop-in core attention (no projections): ``forward(q, k, v, cu_seqlens=None,
    max_seqlen=None, plan=None)`` with the shapes of :func:`flamia_attention`.

    Example::

        attn = FlamiaAttention(recipe="mxfp8")
        out = attn(q, k, v, cu_seqlens, max_seqlen)   # q [T, Hq, d] BF16
    """

    def __init__(
        self,
        *,
        causal: bool = True,
        recipe: str | Recipe = "mxfp8",
        exact_causal: bool = False,
        softmax_scale: float | None = None,
        path: Path = "auto",
    ) -> None:
        super().__init__()
        use_kernels(torch.device("cpu"), path)  # validates ``path`` now
        self.causal, self.recipe, self.exact_causal = causal, recipe, exact_causal
        self.softmax_scale, self.path = softmax_scale, path

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        plan: VarlenPlan | None = None,
    ) -> torch.Tensor:
        return flamia_attention(
            q, k, v, cu_seqlens, max_seqlen, causal=self.causal, recipe=self.recipe,
            exact_causal=self.exact_causal, softmax_scale=self.softmax_scale, plan=plan,
            path=self.path,
        )  # fmt: skip

    def extra_repr(self) -> str:
        recipe = getattr(self.recipe, "name", self.recipe)
        return f"recipe={recipe!r}, causal={self.causal}, exact_causal={self.exact_causal}"
