"""Random paged-cache batches shared by the serving tests (and the GPU benchmarks)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flamia_serve.numerics.kv_pages import KVCacheDtype, KVPageFormat


@dataclass
class PagedBatch:
    """New tokens of ``B`` sequences over a cache: everything a paged attention call takes.

    ``key``/``value`` ``[total_len, Hkv, d]`` hold every cached token of every sequence
    (sequence after sequence) and ``slot_mapping`` where each goes; ``q`` the new tokens.
    """

    q: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    cache: torch.Tensor
    fmt: KVPageFormat


def make_batch(
    new_tokens: list[int],
    cached_tokens: list[int],
    *,
    heads_q: int = 4,
    heads_kv: int = 2,
    head_dim: int = 64,
    page_size: int = 16,
    dtype: KVCacheDtype = "fp8",
    device: str = "cpu",
    spare_blocks: int = 3,
    seed: int = 0,
) -> PagedBatch:
    """Sequences with ``cached_tokens[i]`` earlier tokens and ``new_tokens[i]`` new ones,
    pages drawn in random order from a pool with ``spare_blocks`` unused blocks."""
    gen = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in zip(cached_tokens, new_tokens, strict=True)]
    pages = [-(-n // page_size) for n in lens]
    num_blocks = sum(pages) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(lens), max([*pages, 1]), dtype=torch.int32)
    slots, taken = [], 0
    for i, (n, p) in enumerate(zip(lens, pages, strict=True)):
        table[i, :p] = order[taken : taken + p].int()
        taken += p
        pos = torch.arange(n)
        slots.append(table[i, pos // page_size].long() * page_size + pos % page_size)
    total_len = sum(lens)
    fmt = KVPageFormat(dtype, head_dim)
    key = torch.randn(total_len, heads_kv, head_dim, generator=gen) * 2
    value = torch.randn(total_len, heads_kv, head_dim, generator=gen)
    q = torch.randn(sum(new_tokens), heads_q, head_dim, generator=gen) * 2
    qsl = torch.tensor([0, *torch.tensor(new_tokens).cumsum(0).tolist()], dtype=torch.int32)
    cache = torch.zeros(fmt.cache_shape(num_blocks, page_size, heads_kv), dtype=torch.uint8)
    return PagedBatch(
        q.to(device, torch.bfloat16),
        key.to(device, torch.bfloat16),
        value.to(device, torch.bfloat16),
        torch.cat(slots).to(device) if slots else torch.zeros(0, dtype=torch.long, device=device),
        table.to(device),
        torch.tensor(lens, dtype=torch.int32, device=device),
        qsl.to(device),
        cache.to(device),
        fmt,
    )
