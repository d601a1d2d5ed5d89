"""GPU-built schedules for packed documents: token-block table and attention work list.

Both are built with tensor ops on the device (no host synchronisation): their sizes are
upper bounds known from ``T`` and ``B`` alone, and unused slots are marked empty. Build
them once per microbatch (``plan``) and reuse them in forward and backward (``run``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flamia_serve.numerics.operands import V_T_ALIGN, check_column_align
from flamia_serve.numerics.scales import token_documents


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


def _blocks_of_documents(
    cu_seqlens: torch.Tensor, total_tokens: int, block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For every slot of :func:`token_block_table`: (document, block index in it, tokens)
    int64, tokens 0 for an empty slot."""
    doc, local, valid = _tiles_of_documents(cu_seqlens, total_tokens, block)
    cu = cu_seqlens.long()
    tokens = (cu[doc + 1] - cu[doc] - local * block).clamp(0, block)
    return doc, local, torch.where(valid, tokens, 0)


def short_documents(cu_seqlens: torch.Tensor, limit: int) -> torch.Tensor:
    """bool ``[B]``: the documents of 1 to ``limit`` tokens (the forward's windows hold
    these, and with Q left to the CuTe forward the launch still quantizes their Q)."""
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    return (lengths > 0) & (lengths <= limit)


def short_document_slots(
    cu_seqlens: torch.Tensor, total_tokens: int, block: int, limit: int
) -> torch.Tensor:
    """The slots of :func:`token_block_table` whose documents have 1 to ``limit`` tokens
    (the blocks whose Q the window kernel reads when the CuTe forward quantizes the rest,
    ``quantize_qkv(q_short=limit)``): int32 ``[1 + slots]``, their count, then those slots
    in slot order, then the others. On the device, no host sync."""
    doc, _local, length = _blocks_of_documents(cu_seqlens, total_tokens, block)
    short = (length > 0) & short_documents(cu_seqlens, limit)[doc]
    order = torch.argsort((~short).to(torch.int8), stable=True)
    return torch.cat([short.sum().reshape(1), order]).to(torch.int32)


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

    def tensors(self) -> list[torch.Tensor]:
        """``[start, length, v_t_start, doc_v_t_start]`` (``TokenBlocks(*tensors)``)."""
        return [self.start, self.length, self.v_t_start, self.doc_v_t_start]


def token_block_table(
    cu_seqlens: torch.Tensor, total_tokens: int, block: int = 32, align: int = V_T_ALIGN
) -> TokenBlocks:
    """Every document-local ``block``-token block of a pack (blocks restart per document);
    documents start at multiples of ``align`` columns in the column layout."""
    check_column_align(align)
    doc, local, length = _blocks_of_documents(cu_seqlens, total_tokens, block)
    cu = cu_seqlens.long()
    start = cu[doc] + local * block
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
class ShortWindows:
    """Short documents (1 to ``limit`` tokens) grouped for the forward's window kernel: the
    ones that start in tokens ``[c·limit, (c+1)·limit)`` form window ``c``, a run of whole,
    consecutive short documents (a longer one starting in that chunk ends past it, so every
    document after it starts in a later chunk) of at most ``2·limit − 1`` tokens.
    ``start``/``end`` int32 ``[ceil(T / limit)]``: the windows' tokens, the ``count`` ([1]
    int32) non-empty ones first (the rest: ``end == start``); ``token_doc`` int32 ``[T]``:
    each token's document (the window's mask)."""

    start: torch.Tensor
    end: torch.Tensor
    count: torch.Tensor
    token_doc: torch.Tensor
    limit: int

    @property
    def rows(self) -> int:
        """Rows of the window kernel's tile (a power of two holding any window)."""
        return 2 * self.limit

    def tensors(self) -> list[torch.Tensor]:
        return [self.start, self.end, self.count, self.token_doc]


def build_short_windows(cu_seqlens: torch.Tensor, total_tokens: int, limit: int) -> ShortWindows:
    """The windows of documents of at most ``limit`` tokens (a power of two), on the device."""
    if limit < 1 or limit & (limit - 1):
        raise ValueError(f"limit must be a power of two, got {limit}")
    cu = cu_seqlens.long()
    starts, ends = cu[:-1], cu[1:]
    short = short_documents(cu_seqlens, limit)
    n = (total_tokens + limit - 1) // limit
    if n == 0:  # no token: no window (the scatters below would index an empty tensor)
        none = torch.zeros(0, dtype=torch.int32, device=cu.device)
        count = torch.zeros(1, dtype=torch.int32, device=cu.device)
        return ShortWindows(none, none.clone(), count, token_documents(cu_seqlens, 0)[0].int(),
                            limit)  # fmt: skip
    chunk = (starts // limit).clamp(0, n - 1)
    first = torch.full((n,), total_tokens, dtype=torch.long, device=cu.device)
    first = first.scatter_reduce(0, chunk, torch.where(short, starts, total_tokens), "amin")
    last = torch.zeros(n, dtype=torch.long, device=cu.device)
    last = last.scatter_reduce(0, chunk, torch.where(short, ends, 0), "amax")
    empty = last <= first
    order = torch.argsort(empty.to(torch.int8), stable=True)  # non-empty windows first
    doc, _ = token_documents(cu_seqlens, total_tokens)
    return ShortWindows(
        torch.where(empty, 0, first)[order].to(torch.int32),
        torch.where(empty, 0, last)[order].to(torch.int32),
        (~empty).sum().to(torch.int32).reshape(1),
        doc.to(torch.int32),
        limit,
    )


@dataclass(frozen=True)
class WorkList:
    """(document, tile) items in the order CTAs take them (``_order_items``); heads are
    expanded by the kernel (item ``i`` covers programs ``i*H .. i*H+H-1``). ``count`` ([1]
    int32) is the number of valid items; slots after it are padding. Forward lists hold
    query tiles of ``block_m`` rows (``by_keys=False``); backward lists key tiles of
    ``block_n`` keys that step over queries ``block_m`` at a time (``by_keys=True``).
    ``windows`` (forward): the documents of at most ``windows.limit`` tokens are not in the
    list but in windows."""

    doc: torch.Tensor
    tile: torch.Tensor
    count: torch.Tensor
    block_m: int
    block_n: int
    causal: bool
    by_keys: bool = False
    windows: ShortWindows | None = None

    @property
    def num_slots(self) -> int:
        return self.doc.numel()

    @property
    def window_limit(self) -> int:
        """Documents of up to this many tokens are in windows (0: none)."""
        return 0 if self.windows is None else self.windows.limit


#: Item order of the work lists (``_order_items``): "cost" or "document". The backward's
#: key tiles go by document: CTAs that run at the same time then read the same documents'
#: Q̂/dÔ from L2 (H100, 2026-12-06, ``results/bwd_order_*_s27_2026-12-06.json``: backward
#: W6 8.86 → 5.94 ms, W5 3.53 → 2.81, P3 1.82 → 1.46, one document unchanged)
#: Set them before plans are built: a plan keeps its lists (and its cached calls them).
QUERY_WORK_ORDER = "cost"
KEY_WORK_ORDER = "document"
#: The extend lists' order (``cu_seqlens_k``: the paged prefill's queries after their
#: cached keys): by document, so that CTAs running at once read one sequence's K̂/V̂ pages
#: (H100, 2026-12-06, one call, ``results/prefill_order_{cost,document}_s28_2026-12-06.json``,
#: FP8 cache, ms by cost → by document: S1 0.834 → 0.834, S2 1.258 → 1.218, S3 2.012 →
#: 1.833, S4 0.978 → 0.957; FlashInfer's BF16 prefill in that call 1.019 / 1.674 / 2.309 /
#: 1.084)
EXTEND_WORK_ORDER = "document"
#: "document" in rounds (an experiment, ``work_order.py --fwd-chunk/--bwd-chunk``): 0 takes
#: each document whole; C > 0 the C longest items of every document in document order, then
#: their next C, ..., so the longest items of every document still come early (H100,
#: 2026-12-06, ``results/work_rounds_*_s27_2026-12-06.json``: within noise of the defaults)
QUERY_ORDER_CHUNK = 0
KEY_ORDER_CHUNK = 0


def _order_items(
    cost: torch.Tensor, doc: torch.Tensor, num_docs: int, by: str, chunk: int = 0
) -> torch.Tensor:
    """Permutation of a work list's items (``cost`` -1: empty slot, last): every item by its
    cost, longest first (``by="cost"``), or documents by their longest item, longest first,
    each document's items side by side, longest first (``"document"``; ties: lower index
    first; ``chunk`` > 0: in rounds of ``chunk`` items per document)."""
    if by not in ("cost", "document"):
        raise ValueError(f"work order {by!r}: 'cost' or 'document'")
    if chunk < 0:
        raise ValueError(f"work order chunk {chunk}: 0 (whole documents) or more")
    order = torch.argsort(cost, descending=True, stable=True)
    if by == "document" and num_docs:
        longest = torch.full((num_docs,), -1, dtype=cost.dtype, device=cost.device)
        longest = longest.scatter_reduce(0, doc, cost, "amax")
        key = torch.where(cost >= 0, longest[doc] * (num_docs + 1) + num_docs - doc, -1)
        order = order[torch.argsort(key[order], descending=True, stable=True)]
        if chunk:  # an item's rank in its document (its run in ``order``) picks its round
            n = order.numel()
            at = torch.arange(n, device=cost.device)
            docs = doc[order]
            starts = torch.ones_like(docs, dtype=torch.bool)
            starts[1:] = docs[1:] != docs[:-1]
            rank = at - torch.cummax(torch.where(starts, at, 0), 0).values
            rounds = torch.where(cost[order] >= 0, rank // chunk, n)
            order = order[torch.argsort(rounds * n + at)]
    return order


def build_work_list(
    cu_seqlens: torch.Tensor,
    total_tokens: int,
    *,
    block_m: int,
    block_n: int,
    causal: bool,
    cu_seqlens_k: torch.Tensor | None = None,
    window_limit: int = 0,
) -> WorkList:
    """Work list of query tiles, ordered by the number of key tiles each one visits
    (``QUERY_WORK_ORDER``; with ``cu_seqlens_k`` ``EXTEND_WORK_ORDER``).
    ``cu_seqlens_k`` (extend): each document's keys, its queries being the last of them.
    ``window_limit`` (no extend): documents of at most that many tokens go to
    :class:`ShortWindows` instead (0: none do)."""
    if window_limit and cu_seqlens_k is not None:
        raise ValueError("window_limit does not apply with cu_seqlens_k (extend)")
    doc, tile, valid = _tiles_of_documents(cu_seqlens, total_tokens, block_m)
    cu = cu_seqlens.long()
    length = cu[doc + 1] - cu[doc]
    windows = None
    if window_limit:
        windows = build_short_windows(cu_seqlens, total_tokens, window_limit)
        valid = valid & (length > window_limit)
    offset = torch.zeros_like(length)
    if cu_seqlens_k is not None:
        cu_k = cu_seqlens_k.long()
        offset = cu_k[doc + 1] - cu_k[doc] - length
    key_end = torch.minimum(offset + (tile + 1) * block_m, offset + length) if causal \
        else offset + length  # fmt: skip
    cost = torch.where(valid, (key_end + block_n - 1) // block_n, -1)
    by = QUERY_WORK_ORDER if cu_seqlens_k is None else EXTEND_WORK_ORDER
    order = _order_items(cost, doc, cu.numel() - 1, by, QUERY_ORDER_CHUNK)
    count = valid.sum().to(torch.int32).reshape(1)
    return WorkList(
        doc[order].to(torch.int32),
        tile[order].to(torch.int32),
        count,
        block_m,
        block_n,
        causal,
        windows=windows,
    )


def build_key_work_list(
    cu_seqlens: torch.Tensor, total_tokens: int, *, block_n: int, block_m: int, causal: bool
) -> WorkList:
    """Work list of key tiles (the backward's items), ordered by the number of query steps
    each one takes (causal: the queries from the tile's first key to the document's end)
    within documents, longest documents first (``KEY_WORK_ORDER``)."""
    doc, tile, valid = _tiles_of_documents(cu_seqlens, total_tokens, block_n)
    cu = cu_seqlens.long()
    length = cu[doc + 1] - cu[doc]
    queries = length - tile * block_n if causal else length
    cost = torch.where(valid, (queries + block_m - 1) // block_m, -1)
    order = _order_items(cost, doc, cu.numel() - 1, KEY_WORK_ORDER, KEY_ORDER_CHUNK)
    count = valid.sum().to(torch.int32).reshape(1)
    return WorkList(
        doc[order].to(torch.int32), tile[order].to(torch.int32), count, block_m, block_n, causal,
        by_keys=True,
    )  # fmt: skip
