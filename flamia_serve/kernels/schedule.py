"""GPU-built schedules for packed documents: token-block table and attention work list.

Both are built with tensor ops on the device (no host synchronisation): their sizes are
upper bounds known from ``T`` and ``B`` alone, and unused slots are marked empty. Build
them once per microbatch (``plan``) and reuse them in forward and backward (``run``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flamia_serve.numerics.operands import V_T_ALIGN, check_column_align


def _tiles_of_documents(
    cu_seqlens: torch.Tensor, total_tokens: int, tile: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For ``T // tile + B`` slots: (document, tile index in the document, valid) int64."""
    cu = cu_seqlens.long()
    num_docs = cu.numel() - 1
    tiles_per_doc = (cu[1:] - cu[:-1] + tile - 1) // tile
    ends = torch.cumsum(tiles_per_doc, 0)
    slots = torch.arange(total_tokens // tile + num_docs, device=cu.device)
    doc = torch.searchsorted(ends, slots, right=True)
    valid = doc < num_docs
    doc = doc.clamp(max=max(num_docs - 1, 0))
    local = slots - (ends - tiles_per_doc)[doc]
    return doc, local, valid


@dataclass(frozen=True)
class TokenBlocks:
    """Document-local 32-token blocks: first token and length (0 = empty slot), int32;
    ``v_t_start``: the block's first column in the K-major V layout; ``doc_v_t_start``:
    each document's first column there (a multiple of the layout's column alignment)."""

    start: torch.Tensor
    length: torch.Tensor
    v_t_start: torch.Tensor
    doc_v_t_start: torch.Tensor

    @property
    def num_slots(self) -> int:
        return self.start.numel()


def token_block_table(
    cu_seqlens: torch.Tensor, total_tokens: int, block: int = 32, align: int = V_T_ALIGN
) -> TokenBlocks:
    """Every document-local ``block``-token block of a pack (blocks restart per document);
    documents start at multiples of ``align`` columns in the column layout."""
    check_column_align(align)
    doc, local, valid = _tiles_of_documents(cu_seqlens, total_tokens, block)
    cu = cu_seqlens.long()
    start = cu[doc] + local * block
    length = torch.where(valid, (cu[doc + 1] - start).clamp(0, block), 0)
    padded = (cu[1:] - cu[:-1] + align - 1) // align * align
    doc_v_t_start = torch.cumsum(padded, 0) - padded
    v_t_start = doc_v_t_start[doc] + local * block
    return TokenBlocks(
        start.to(torch.int32),
        length.to(torch.int32),
        v_t_start.to(torch.int32),
        doc_v_t_start.to(torch.int32),
    )


@dataclass(frozen=True)
class WorkList:
    """(document, tile) items sorted by work, longest first; heads are expanded by the
    kernel (item ``i`` covers programs ``i*H .. i*H+H-1``). ``count`` ([1] int32) is the
    number of valid items; slots after it are padding. Forward lists hold query tiles of
    ``block_m`` rows (``by_keys=False``); backward lists key tiles of ``block_n`` keys that
    step over queries ``block_m`` at a time (``by_keys=True``)."""

    doc: torch.Tensor
    tile: torch.Tensor
    count: torch.Tensor
    block_m: int
    block_n: int
    causal: bool
    by_keys: bool = False

    @property
    def num_slots(self) -> int:
        return self.doc.numel()


def build_work_list(
    cu_seqlens: torch.Tensor,
    total_tokens: int,
    *,
    block_m: int,
    block_n: int,
    causal: bool,
    cu_seqlens_k: torch.Tensor | None = None,
) -> WorkList:
    """Work list of query tiles, sorted by the number of key tiles each one visits.
    ``cu_seqlens_k`` (extend): each document's keys, its queries being the last of them."""
    doc, tile, valid = _tiles_of_documents(cu_seqlens, total_tokens, block_m)
    cu = cu_seqlens.long()
    length = cu[doc + 1] - cu[doc]
    offset = torch.zeros_like(length)
    if cu_seqlens_k is not None:
        cu_k = cu_seqlens_k.long()
        offset = cu_k[doc + 1] - cu_k[doc] - length
    key_end = torch.minimum(offset + (tile + 1) * block_m, offset + length) if causal \
        else offset + length  # fmt: skip
    cost = torch.where(valid, (key_end + block_n - 1) // block_n, -1)
    order = torch.argsort(cost, descending=True, stable=True)
    count = valid.sum().to(torch.int32).reshape(1)
    return WorkList(
        doc[order].to(torch.int32),
        tile[order].to(torch.int32),
        count,
        block_m,
        block_n,
        causal,
    )


def build_key_work_list(
    cu_seqlens: torch.Tensor, total_tokens: int, *, block_n: int, block_m: int, causal: bool
) -> WorkList:
    """Work list of key tiles (the backward's items), sorted by the number of query steps
    each one takes (causal: the queries from the tile's first key to the document's end)."""
    doc, tile, valid = _tiles_of_documents(cu_seqlens, total_tokens, block_n)
    cu = cu_seqlens.long()
    length = cu[doc + 1] - cu[doc]
    queries = length - tile * block_n if causal else length
    cost = torch.where(valid, (queries + block_m - 1) // block_m, -1)
    order = torch.argsort(cost, descending=True, stable=True)
    count = valid.sum().to(torch.int32).reshape(1)
    return WorkList(
        doc[order].to(torch.int32), tile[order].to(torch.int32), count, block_m, block_n, causal,
        by_keys=True,
    )  # fmt: skip
