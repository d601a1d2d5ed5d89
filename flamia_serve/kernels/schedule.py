"""GPU-built schedules for packed documents: token-block table and attention work list.

Both are built with tensor ops on the device (no host synchronisation): their sizes are
upper bounds known from ``T`` and ``B`` alone, and unused slots are marked empty. Build
them once per microbatch (``plan``) and reuse them in forward and backward (``run``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl  # noqa: F401  (in scope where _common jits v_t_key)


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


#: each document's keys start at a multiple of this in the K-major V layout (16-byte loads)
V_T_ALIGN = 16


def v_t_position(key):
    """Column, inside its document's span of the K-major V layout, of document-local key
    ``key`` (int tensor, torch or Triton). Keys are permuted inside each 16-key group (key
    ``8a + 2b + c`` at ``4b + 2a + c``: order 0,1,8,9,2,3,10,11,4,5,12,13,6,7,14,15) so
    that a Hopper FP8 ``wgmma`` accumulator fragment of ``Q̂·K̂ᵀ`` (columns ``2b + c`` and
    ``8 + 2b + c`` per thread) is, byte for byte, the A fragment of ``P̂·V̂`` (4
    consecutive keys per register): P̂ stays in registers. Every array in this layout
    (``v_t``, ``k_exp``, ``v_exp``, ``kv_factors``) uses the same columns; 16-key groups,
    32-key exponent blocks and key tiles keep their sets of keys."""
    k = key & 15
    return (key - k) + (((k >> 1) & 3) << 2) + ((k >> 3) << 1) + (k & 1)


def v_t_key(position):
    """Inverse of ``v_t_position``: the document-local key stored at column ``position``."""
    i = position & 15
    return (position - i) + ((i >> 2) << 1) + (((i >> 1) & 1) << 3) + (i & 1)


def v_t_length(total_tokens: int, num_docs: int) -> int:
    """Columns of the K-major V layout: every document padded to ``V_T_ALIGN``."""
    return max(-(-(total_tokens + (V_T_ALIGN - 1) * num_docs) // V_T_ALIGN) * V_T_ALIGN, V_T_ALIGN)


@dataclass(frozen=True)
class TokenBlocks:
    """Document-local 32-token blocks: first token and length (0 = empty slot), int32;
    ``v_t_start``: the block's first column in the K-major V layout; ``doc_v_t_start``:
    each document's first column there (a multiple of ``V_T_ALIGN``)."""

    start: torch.Tensor
    length: torch.Tensor
    v_t_start: torch.Tensor
    doc_v_t_start: torch.Tensor

    @property
    def num_slots(self) -> int:
        return self.start.numel()


def token_block_table(cu_seqlens: torch.Tensor, total_tokens: int, block: int = 32) -> TokenBlocks:
    """Every document-local ``block``-token block of a pack (blocks restart per document)."""
    doc, local, valid = _tiles_of_documents(cu_seqlens, total_tokens, block)
    cu = cu_seqlens.long()
    start = cu[doc] + local * block
    length = torch.where(valid, (cu[doc + 1] - start).clamp(0, block), 0)
    padded = (cu[1:] - cu[:-1] + V_T_ALIGN - 1) // V_T_ALIGN * V_T_ALIGN
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
    """(document, query tile) items sorted by work, longest first; heads are expanded by
    the kernel (item ``i`` covers programs ``i*H .. i*H+H-1``). ``count`` ([1] int32) is
    the number of valid items; slots after it are padding."""

    doc: torch.Tensor
    tile: torch.Tensor
    count: torch.Tensor
    block_m: int
    block_n: int
    causal: bool

    @property
    def num_slots(self) -> int:
        return self.doc.numel()


def build_work_list(
    cu_seqlens: torch.Tensor, total_tokens: int, *, block_m: int, block_n: int, causal: bool
) -> WorkList:
    """Work list of query tiles, sorted by the number of key tiles each one visits."""
    doc, tile, valid = _tiles_of_documents(cu_seqlens, total_tokens, block_m)
    cu = cu_seqlens.long()
    length = cu[doc + 1] - cu[doc]
    key_end = torch.minimum((tile + 1) * block_m, length) if causal else length
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
