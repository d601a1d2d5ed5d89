"""Paged KV-cache byte layouts (DESIGN N10): the one definition kernels and caches read.

A cache is one uint8 tensor ``[num_blocks, 2, Hkv, page_size * slot_bytes]`` (index 1: 0 = K,
1 = V). Each ``(block, K|V, head)`` *region* holds ``page_size`` token slots: first all codes
(``[page_size, code_bytes]``, token-major), then all scales (``[page_size, scale_bytes]``).
Total bytes equal vLLM 0.26's page budgets (``notes/vllm.md``):

* ``bf16``  — BF16 values, ``2d`` bytes per token-head, no scale;
* ``fp8``   — E4M3 codes + one int32 power-of-two exponent per token-head (``d + 4`` bytes,
  vLLM ``fp8_per_token_head``): ``e = ceil(log2(amax / 448))`` over the token-head (N1, N3);
* ``nvfp4`` — packed E2M1 codes (low nibble = even element) + one E4M3 scale per 16
  elements (``d/2 + d/16`` bytes, vLLM ``nvfp4``); no room for a second level, so the E4M3
  scale carries the whole per-key scale and saturates at 448 (|x| up to 2688 is exact-range).

Every entry depends on its own token only, so appending never rewrites older bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from flamia_serve.numerics.scales import (
    NVFP4_GROUP,
    Granularity,
    NVFP4Tensor,
    quantize_fp8,
    quantize_nvfp4,
)

KVCacheDtype = Literal["bf16", "fp8", "nvfp4"]
KV_CACHE_DTYPES: tuple[KVCacheDtype, ...] = ("bf16", "fp8", "nvfp4")
#: vLLM ``--kv-cache-dtype`` names of the same budgets
VLLM_KV_CACHE_DTYPES: dict[str, KVCacheDtype] = {
    "auto": "bf16",
    "bfloat16": "bf16",
    "fp8_per_token_head": "fp8",
    "nvfp4": "nvfp4",
}


@dataclass(frozen=True)
class KVPageFormat:
    """Bytes of one token-head slot for a cache dtype and head dim."""

    dtype: KVCacheDtype
    head_dim: int

    def __post_init__(self) -> None:
        if self.dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv cache dtype must be one of {KV_CACHE_DTYPES}, got {self.dtype!r}")
        if self.head_dim < NVFP4_GROUP or self.head_dim % NVFP4_GROUP:
            raise ValueError(f"head_dim must be a multiple of {NVFP4_GROUP}, got {self.head_dim}")

    @property
    def code_bytes(self) -> int:
        return {"bf16": 2 * self.head_dim, "fp8": self.head_dim, "nvfp4": self.head_dim // 2}[
            self.dtype
        ]

    @property
    def scale_bytes(self) -> int:
        return {"bf16": 0, "fp8": 4, "nvfp4": self.head_dim // NVFP4_GROUP}[self.dtype]

    @property
    def slot_bytes(self) -> int:
        return self.code_bytes + self.scale_bytes

    def region_bytes(self, page_size: int) -> int:
        """Bytes of one (block, K|V, head) region."""
        return page_size * self.slot_bytes

    def cache_shape(self, num_blocks: int, page_size: int, heads_kv: int) -> tuple[int, ...]:
        return (num_blocks, 2, heads_kv, self.region_bytes(page_size))

    def page_size_of(self, cache: torch.Tensor) -> int:
        """Page size of a cache tensor of this format (checks its shape and dtype)."""
        if cache.dtype != torch.uint8 or cache.dim() != 4 or cache.shape[1] != 2:
            raise ValueError(
                "kv_cache must be uint8 [num_blocks, 2, Hkv, page_size * slot_bytes], got "
                f"{cache.dtype} {tuple(cache.shape)}"
            )
        if cache.shape[-1] % self.slot_bytes:
            raise ValueError(
                f"kv_cache last dim {cache.shape[-1]} is not a multiple of the {self.dtype} "
                f"slot size {self.slot_bytes} (head_dim {self.head_dim})"
            )
        return cache.shape[-1] // self.slot_bytes


def encode_slots(x: torch.Tensor, fmt: KVPageFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` ``[N, H, d]`` per token-head: (codes ``[N, H, code_bytes]``, scales
    ``[N, H, scale_bytes]``), both uint8 — the bytes a slot holds."""
    n, h, d = x.shape
    if d != fmt.head_dim:
        raise ValueError(f"head dim {d} does not match the cache format's {fmt.head_dim}")
    if fmt.dtype == "bf16":
        codes = x.to(torch.bfloat16).contiguous().view(torch.uint8)
        return codes, torch.empty(n, h, 0, dtype=torch.uint8, device=x.device)
    if fmt.dtype == "fp8":
        q = quantize_fp8(x, None, Granularity.TOKEN)
        scales = q.exponents.to(torch.int32).contiguous().view(torch.uint8).view(n, h, 4)
        return q.codes.view(torch.uint8), scales
    q4 = quantize_nvfp4(x, second_level=False)
    return q4.codes, q4.block_scales.view(torch.uint8)


@dataclass(frozen=True)
class DecodedSlots:
    """Dequantized cache entries ``[N, H, d]`` float32 and, for ``fp8``, the exponents
    ``[N, H]`` int32 (``values`` then holds the E4M3 codes without their ``2**e``)."""

    values: torch.Tensor
    exponents: torch.Tensor | None


def decode_slots(codes: torch.Tensor, scales: torch.Tensor, fmt: KVPageFormat) -> DecodedSlots:
    """Inverse of :func:`encode_slots` (exact)."""
    n, h, _ = codes.shape
    d = fmt.head_dim
    if fmt.dtype == "bf16":
        return DecodedSlots(codes.contiguous().view(torch.bfloat16).float(), None)
    if fmt.dtype == "fp8":
        exps = scales.contiguous().view(torch.int32).view(n, h)
        return DecodedSlots(codes.contiguous().view(torch.float8_e4m3fn).float(), exps)
    zero = torch.zeros(n, h, dtype=torch.int8, device=codes.device)
    q4 = NVFP4Tensor(codes, scales.contiguous().view(torch.float8_e4m3fn), zero)
    return DecodedSlots(q4.dequantize(second_level=False).view(n, h, d), None)


def region_view(
    cache: torch.Tensor, fmt: KVPageFormat
) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``(codes [blocks, 2, Hkv, page, code_bytes], scales [blocks, 2, Hkv, page,
    scale_bytes])`` of a cache tensor, uint8, sharing its storage."""
    page = fmt.page_size_of(cache)
    split = page * fmt.code_bytes
    lead = cache.shape[:3]
    codes = cache[..., :split].unflatten(-1, (page, fmt.code_bytes))
    scales = cache[..., split:].unflatten(-1, (page, fmt.scale_bytes))
    return codes.view(*lead, page, fmt.code_bytes), scales.view(*lead, page, fmt.scale_bytes)
