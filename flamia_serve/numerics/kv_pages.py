"""Paged KV-cache byte layouts (DESIGN N10): the one definition kernels and caches read.

A cache is one uint8 tensor ``[num_blocks, 2, Hkv, page_size * slot_bytes]`` (index 1: 0 = K,
1 = V). Each ``(block, K|V, head)`` *region* holds ``page_size`` token slots: first all codes
(``[page_size, code_bytes]``, token-major), then all scales (``[page_size, scale_bytes]``).
The V codes of the 8-bit formats (``fp8``, ``fp8_static``) are dim-major instead
(``[code_bytes, page_size]``, :attr:`KVCacheFormat.v_dim_major`): a page of V̂ᵀ, so that
P̂·V̂ reads V̂ as a K-major FP8 MMA operand with 16-byte loads along the keys, as the
training forward's ``v_t`` does.
Total bytes equal vLLM 0.26's page budgets (``notes/vllm.md``). Formats
(:class:`KVCacheFormat`):

* ``bf16`` / ``fp16`` — 16-bit values, ``2d`` bytes per token-head, no scale (vLLM ``auto``
  for a BF16 / FP16 model, ``bfloat16``, ``float16``);
* ``fp8``   — E4M3 codes + one int32 power-of-two exponent per token-head (``d + 4`` bytes,
  vLLM ``fp8_per_token_head``): ``e = ceil(log2(amax / 448))`` over the token-head (N1, N3);
* ``fp8_static`` — E4M3 codes of ``x / s`` (saturated at ±448) with one static float scale
  ``s`` per layer for K and one for V, kept outside the cache (``d`` bytes, vLLM ``fp8`` /
  ``fp8_e4m3`` with the layer's ``k_scale`` / ``v_scale``); a constant scale is causally safe;
* ``nvfp4`` — packed E2M1 codes (low nibble = even element) + one E4M3 scale per 16
  elements (``d/2 + d/16`` bytes, vLLM ``nvfp4``); no room for a second level, so the E4M3
  scale carries the whole per-key scale and saturates at 448 (|x| up to 2688 is exact-range).

Every entry depends on its own token (and, for ``fp8_static``, a per-layer constant) only, so
appending never rewrites older bytes and prefix caches stay valid.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from flamia_serve.numerics.checks import FLOAT_DTYPES, check_tensor
from flamia_serve.numerics.formats import E4M3_MAX
from flamia_serve.numerics.scales import (
    NVFP4_GROUP,
    V_ZERO_EXPONENT,
    Granularity,
    NVFP4Tensor,
    quantize_fp8,
    quantize_nvfp4,
)


class KVCacheFormat(str, enum.Enum):
    """Cache formats. ``kernel_id`` is the ``KV_FMT`` constexpr the Triton kernels branch on
    (0–2 keep their historical values)."""

    BF16 = "bf16"
    FP8 = "fp8"
    NVFP4 = "nvfp4"
    FP16 = "fp16"
    FP8_STATIC = "fp8_static"

    @property
    def kernel_id(self) -> int:
        return _KERNEL_IDS[self]

    @property
    def is_16bit(self) -> bool:
        return self in (KVCacheFormat.BF16, KVCacheFormat.FP16)

    @property
    def v_dim_major(self) -> bool:
        """Whether V codes are stored dim-major within a page (the 8-bit formats)."""
        return self in (KVCacheFormat.FP8, KVCacheFormat.FP8_STATIC)

    @property
    def value_dtype(self) -> torch.dtype | None:
        """torch dtype of the stored values of a 16-bit format (None otherwise)."""
        return {KVCacheFormat.BF16: torch.bfloat16, KVCacheFormat.FP16: torch.float16}.get(self)

    def __str__(self) -> str:
        return self.value


_KERNEL_IDS = {
    KVCacheFormat.BF16: 0,
    KVCacheFormat.FP8: 1,
    KVCacheFormat.NVFP4: 2,
    KVCacheFormat.FP16: 3,
    KVCacheFormat.FP8_STATIC: 4,
}

KVCacheDtype = Literal["bf16", "fp16", "fp8", "fp8_static", "nvfp4"] | KVCacheFormat
KV_CACHE_DTYPES: tuple[str, ...] = tuple(f.value for f in KVCacheFormat)

#: vLLM ``--kv-cache-dtype`` values served, and the format each selects (``auto`` follows the
#: model dtype, see :func:`format_for_vllm`)
VLLM_KV_CACHE_DTYPES: dict[str, KVCacheFormat | None] = {
    "auto": None,
    "bfloat16": KVCacheFormat.BF16,
    "float16": KVCacheFormat.FP16,
    "fp8_per_token_head": KVCacheFormat.FP8,
    "nvfp4": KVCacheFormat.NVFP4,
    "fp8": KVCacheFormat.FP8_STATIC,
    "fp8_e4m3": KVCacheFormat.FP8_STATIC,
}


def format_for_vllm(kv_cache_dtype: str, model_dtype: torch.dtype) -> KVCacheFormat:
    """The cache format for a vLLM ``--kv-cache-dtype`` and the model's dtype (BF16/FP16)."""
    if kv_cache_dtype not in VLLM_KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r} is not served by FLAMIA; supported: "
            f"{', '.join(VLLM_KV_CACHE_DTYPES)}"
        )
    fmt = VLLM_KV_CACHE_DTYPES[kv_cache_dtype]
    if fmt is not None:
        return fmt
    if model_dtype == torch.bfloat16:
        return KVCacheFormat.BF16
    if model_dtype == torch.float16:
        return KVCacheFormat.FP16
    raise ValueError(f"kv_cache_dtype 'auto' needs a bfloat16 or float16 model, got {model_dtype}")


@dataclass(frozen=True)
class PageStrides:
    """How kernels index a cache of one format: element types of the code and scale views
    and strides in elements of those types (one definition for kernels and references).

    ``region_codes`` / ``region_scales``: elements per ``(block, K|V, head)`` region;
    ``scale_base``: first scale of a region; ``code_row`` / ``scale_row``: per token slot
    (K codes: consecutive elements of a slot are adjacent). V codes: ``v_code_row`` per slot,
    ``v_code_col`` per element (``code_row`` / 1 unless ``v_dim_major``: 1 / ``page_size``).
    """

    code_dtype: torch.dtype
    scale_dtype: torch.dtype
    page_size: int
    region_codes: int
    region_scales: int
    scale_base: int
    code_row: int
    scale_row: int
    v_code_row: int
    v_code_col: int


@dataclass(frozen=True)
class KVPageFormat:
    """Bytes of one token-head slot for a cache format and head dim (``dtype`` accepts the
    format's string value and is stored as :class:`KVCacheFormat`)."""

    dtype: KVCacheFormat
    head_dim: int

    def __post_init__(self) -> None:
        try:
            fmt = KVCacheFormat(self.dtype)
        except ValueError:
            raise ValueError(
                f"kv cache dtype must be one of {KV_CACHE_DTYPES}, got {self.dtype!r}"
            ) from None
        object.__setattr__(self, "dtype", fmt)
        if self.head_dim < NVFP4_GROUP or self.head_dim % NVFP4_GROUP:
            raise ValueError(f"head_dim must be a multiple of {NVFP4_GROUP}, got {self.head_dim}")

    @property
    def code_bytes(self) -> int:
        d = self.head_dim
        if self.dtype.is_16bit:
            return 2 * d
        return d // 2 if self.dtype is KVCacheFormat.NVFP4 else d

    @property
    def scale_bytes(self) -> int:
        return {KVCacheFormat.FP8: 4, KVCacheFormat.NVFP4: self.head_dim // NVFP4_GROUP}.get(
            self.dtype, 0
        )

    @property
    def slot_bytes(self) -> int:
        return self.code_bytes + self.scale_bytes

    def region_bytes(self, page_size: int) -> int:
        """Bytes of one (block, K|V, head) region."""
        return page_size * self.slot_bytes

    def cache_shape(self, num_blocks: int, page_size: int, heads_kv: int) -> tuple[int, ...]:
        return (num_blocks, 2, heads_kv, self.region_bytes(page_size))

    def strides(self, page_size: int) -> PageStrides:
        """Element strides of the code and scale views of a cache with ``page_size`` slots."""
        d, region, fmt = self.head_dim, self.region_bytes(page_size), self.dtype
        if fmt.is_16bit:
            code_dtype, scale_dtype, code_row = fmt.value_dtype, torch.uint8, d
            region_codes, region_scales, scale_base, scale_row = region // 2, region, 0, 0
        elif fmt is KVCacheFormat.FP8:
            code_dtype, scale_dtype, code_row = torch.float8_e4m3fn, torch.int32, d
            region_codes, region_scales, scale_base, scale_row = (
                region, region // 4, page_size * d // 4, 1)  # fmt: skip
        elif fmt is KVCacheFormat.FP8_STATIC:
            code_dtype, scale_dtype, code_row = torch.float8_e4m3fn, torch.uint8, d
            region_codes, region_scales, scale_base, scale_row = region, region, 0, 0
        else:
            code_dtype, scale_dtype, code_row = torch.uint8, torch.uint8, d // 2
            region_codes, region_scales = region, region
            scale_base, scale_row = page_size * d // 2, d // NVFP4_GROUP
        v_row, v_col = (1, page_size) if fmt.v_dim_major else (code_row, 1)
        return PageStrides(
            code_dtype, scale_dtype, page_size, region_codes,  # type: ignore[arg-type]
            region_scales, scale_base, code_row, scale_row, v_row, v_col,
        )  # fmt: skip

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


def static_inverse(scale: float, name: str = "scale") -> float:
    """``1 / scale`` rounded to float32: the factor ``fp8_static`` writes multiply by (the
    kernels receive it as a float32 argument). ``ValueError`` naming ``name`` unless
    ``scale`` is positive and finite with a finite, nonzero float32 inverse (an infinite
    scale wrote zero codes, one below ~3e-39 an infinite factor: ±448 and NaN codes)."""
    try:
        value = float(scale)
    except (TypeError, ValueError):
        value = math.nan
    inv = float(torch.tensor(1.0 / value if 0 < value < math.inf else 0.0, dtype=torch.float32))
    if not 0 < inv < math.inf:
        raise ValueError(f"{name} must be a positive finite static fp8 scale with a finite "
                         f"float32 inverse, got {scale!r}")  # fmt: skip
    return inv


def encode_slots(
    x: torch.Tensor, fmt: KVPageFormat, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` ``[N, H, d]`` per token-head: (codes ``[N, H, code_bytes]``, scales
    ``[N, H, scale_bytes]``), both uint8 — the bytes a slot holds. ``scale``: the static
    scale of ``fp8_static`` (ignored by the other formats). ``x``: BF16/FP16/float32;
    ``TypeError``/``ValueError`` name what does not fit."""
    n, h, d = check_tensor(x, "x", ndim=3, dtypes=FLOAT_DTYPES, layout="[N, H, d]").shape
    if d != fmt.head_dim:
        raise ValueError(f"head dim {d} does not match the cache format's {fmt.head_dim}")
    none = torch.empty(n, h, 0, dtype=torch.uint8, device=x.device)
    if fmt.dtype.is_16bit:
        codes = x.to(fmt.dtype.value_dtype).contiguous().view(torch.uint8)  # type: ignore[arg-type]
        return codes, none
    if fmt.dtype is KVCacheFormat.FP8:
        q = quantize_fp8(x, None, Granularity.TOKEN, zero_exponent=V_ZERO_EXPONENT)
        scales = q.exponents.to(torch.int32).contiguous().view(torch.uint8).view(n, h, 4)
        return q.codes.view(torch.uint8), scales
    if fmt.dtype is KVCacheFormat.FP8_STATIC:
        inv = torch.tensor(static_inverse(scale), dtype=torch.float32, device=x.device)
        y = (x.float() * inv).clamp(-E4M3_MAX, E4M3_MAX)
        return y.to(torch.float8_e4m3fn).view(torch.uint8), none
    q4 = quantize_nvfp4(x, second_level=False)
    return q4.codes, q4.block_scales.view(torch.uint8)


@dataclass(frozen=True)
class DecodedSlots:
    """Dequantized cache entries ``[N, H, d]`` float32 and, for ``fp8``, the exponents
    ``[N, H]`` int32 (``values`` then holds the E4M3 codes without their ``2**e``). For
    ``fp8_static`` ``values`` are the E4M3 codes without the static scale."""

    values: torch.Tensor
    exponents: torch.Tensor | None


def decode_slots(codes: torch.Tensor, scales: torch.Tensor, fmt: KVPageFormat) -> DecodedSlots:
    """Inverse of :func:`encode_slots` (exact; ``fp8_static`` leaves the scale out)."""
    n, h, _ = codes.shape
    d = fmt.head_dim
    if fmt.dtype.is_16bit:
        return DecodedSlots(codes.contiguous().view(fmt.dtype.value_dtype).float(), None)  # type: ignore[arg-type]
    if fmt.dtype is KVCacheFormat.FP8:
        exps = scales.contiguous().view(torch.int32).view(n, h)
        return DecodedSlots(codes.contiguous().view(torch.float8_e4m3fn).float(), exps)
    if fmt.dtype is KVCacheFormat.FP8_STATIC:
        return DecodedSlots(codes.contiguous().view(torch.float8_e4m3fn).float(), None)
    zero = torch.zeros(n, h, dtype=torch.int8, device=codes.device)
    q4 = NVFP4Tensor(codes, scales.contiguous().view(torch.float8_e4m3fn), zero)
    return DecodedSlots(q4.dequantize(second_level=False).view(n, h, d), None)


class RegionViews(NamedTuple):
    """Byte views of a cache tensor, sharing its storage: ``codes[half]`` (0 = K, 1 = V)
    ``[blocks, Hkv, page, code_bytes]`` and ``scales`` ``[blocks, 2, Hkv, page, scale_bytes]``,
    indexed by slot whatever the byte order inside a page."""

    codes: tuple[torch.Tensor, torch.Tensor]
    scales: torch.Tensor


def region_view(cache: torch.Tensor, fmt: KVPageFormat) -> RegionViews:
    """The :class:`RegionViews` of a cache tensor of format ``fmt``."""
    page = fmt.page_size_of(cache)
    split = page * fmt.code_bytes
    k_codes = cache[:, 0, :, :split].unflatten(-1, (page, fmt.code_bytes))
    v_codes = cache[:, 1, :, :split]
    if fmt.dtype.v_dim_major:
        v_codes = v_codes.unflatten(-1, (fmt.code_bytes, page)).transpose(-1, -2)
    else:
        v_codes = v_codes.unflatten(-1, (page, fmt.code_bytes))
    scales = cache[..., split:].unflatten(-1, (page, fmt.scale_bytes))
    return RegionViews((k_codes, v_codes), scales)
