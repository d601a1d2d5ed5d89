"""Scale rules and quantizers (DESIGN.md N1–N7, N10): the executable spec of every quantizer.

Packed tensors are ``[T, H, d]`` with documents given by ``cu_seqlens`` (int32, ``B+1``).
FP8 operands carry one int8 exponent per token and head (``[T, H]``): for token-block
scales (N2) it is equal across each 32-token, document-local block; per-token (N4 exact
causal) and per-key V (N3) use the same storage. All functions are vectorized.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

import torch

from flamia_serve.numerics.checks import (
    FLOAT_DTYPES,
    check_cu_seqlens,
    check_int,
    check_tensor,
    check_tokens,
)
from flamia_serve.numerics.formats import (
    E4M3_MAX,
    EXP_MAX,
    EXP_MIN,
    NVFP4_MAX,
    e2m1_decode,
    e2m1_encode,
    e2m1_ratio,
    e4m3_encode,
    exp2i,
    nvfp4_group_scale,
    pack_e2m1,
    pow2_exponent_ceil,
    unpack_e2m1,
)

TOKEN_BLOCK = 32
NVFP4_GROUP = 16
#: exponent of an all-zero V row (N3): V's exponent is folded into the key's logit, so
#: EXP_MIN would scale its probability by 2^-127, which underflows and drops the key from
#: the normaliser (every other key's weight then comes out too large)
V_ZERO_EXPONENT = 0


class Granularity(enum.Enum):
    """Which tokens share one FP8 scale exponent (per head, whole head dimension)."""

    TOKEN = "token"  # one exponent per token: exact causal (N4), per-key V (N3)
    TOKEN_BLOCK = "token_block"  # 32 consecutive tokens of one document (N2)


@dataclass(frozen=True)
class FP8Tensor:
    """E4M3 codes ``[T, H, d]`` and exponents ``[T, H]`` int8: value = code * 2**exponent."""

    codes: torch.Tensor
    exponents: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """float32 ``[T, H, d]``."""
        return self.codes.float() * exp2i(self.exponents)[..., None]


@dataclass(frozen=True)
class NVFP4Tensor:
    """NVFP4 per token: packed E2M1 codes ``[T, H, d/2]`` uint8 (low nibble = even element),
    E4M3 scales ``[T, H, d/16]``, power-of-two second level ``[T, H]`` int8.

    value = e2m1(code) * block_scale * 2**exponent.
    """

    codes: torch.Tensor
    block_scales: torch.Tensor
    exponents: torch.Tensor

    def dequantize(self, *, second_level: bool = True) -> torch.Tensor:
        """float32 ``[T, H, d]``; ``second_level=False`` leaves out ``2**exponent``."""
        vals = e2m1_decode(unpack_e2m1(self.codes))
        t, h, d = vals.shape
        scale = self.block_scales.float().repeat_interleave(NVFP4_GROUP, dim=-1)
        out = vals * scale
        if second_level:
            out = out * exp2i(self.exponents)[..., None]
        return out.view(t, h, d)


def token_documents(cu_seqlens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Document index and document-local position of every packed token, both int64 ``[T]``."""
    cu = cu_seqlens.long()
    tok = torch.arange(total, device=cu.device)
    # (the whole of cu, not cu[1:]: inductor's searchsorted takes no sliced boundaries)
    doc = torch.searchsorted(cu, tok, right=True) - 1
    return doc, tok - cu[doc]


def document_slices(cu_seqlens: torch.Tensor) -> list[slice]:
    """Token slices of the non-empty documents of a pack (reads ``cu_seqlens`` on the host)."""
    return [slice(a, b) for a, b in itertools.pairwise(cu_seqlens.tolist()) if b > a]


def token_block_ids(cu_seqlens: torch.Tensor, total: int, block: int = TOKEN_BLOCK) -> torch.Tensor:
    """Global index of each token's document-local ``block``-token group, int64 ``[T]``.

    Blocks restart at every document start; a document's last block may be short.
    """
    doc, pos = token_documents(cu_seqlens, total)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    blocks_per_doc = (lengths + block - 1) // block
    first_block = torch.cumsum(blocks_per_doc, 0) - blocks_per_doc
    return first_block[doc] + pos // block


def group_amax(x: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Per-head amax over tokens sharing a group id: ``[T, H, d]`` -> ``[T, H]`` (per token)."""
    token_amax = x.float().abs().amax(dim=-1)
    n_groups = int(group_ids.max().item()) + 1 if group_ids.numel() else 0
    out = torch.zeros(n_groups, x.shape[1], dtype=torch.float32, device=x.device)
    idx = group_ids[:, None].expand_as(token_amax)
    out.scatter_reduce_(0, idx, token_amax, reduce="amax", include_self=True)
    return out[group_ids]


def _check_granularity(granularity: object) -> Granularity:
    """A :class:`Granularity` from one or its value (``"token"``, ``"token_block"``)."""
    try:
        return Granularity(granularity)
    except ValueError:
        choices = ", ".join(repr(g.value) for g in Granularity)
        raise ValueError(
            f"granularity must be a Granularity ({choices}), got {granularity!r}"
        ) from None


def fp8_exponents(
    x: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    granularity: Granularity,
    block: int = TOKEN_BLOCK,
    *,
    zero_exponent: int = EXP_MIN,
) -> torch.Tensor:
    """Scale exponents ``[T, H]`` int8 for E4M3 codes of ``x`` ``[T, H, d]`` (N1, N2, N4);
    all-zero groups get ``zero_exponent`` (their codes are zero whatever it is).

    ``x``: BF16/FP16/float32; ``cu_seqlens`` (token blocks only, else unused): int32 ``[B+1]``
    on x's device, from 0 to T. ``TypeError``/``ValueError`` name the argument that does not
    fit."""
    x = check_tokens(x)
    granularity = _check_granularity(granularity)
    check_int(block, "block", low=1)
    check_int(zero_exponent, "zero_exponent", low=EXP_MIN, high=EXP_MAX)
    if granularity is Granularity.TOKEN:
        amax = x.float().abs().amax(dim=-1)
    else:
        if cu_seqlens is None:
            raise ValueError("cu_seqlens is required for token-block scales")
        check_cu_seqlens(cu_seqlens, x.shape[0], x.device)
        amax = group_amax(x, token_block_ids(cu_seqlens, x.shape[0], block))
    exponents = pow2_exponent_ceil(amax, E4M3_MAX)
    if zero_exponent != EXP_MIN:
        exponents = torch.where(amax == 0, torch.full_like(exponents, zero_exponent), exponents)
    return exponents


def quantize_fp8(
    x: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    granularity: Granularity = Granularity.TOKEN_BLOCK,
    block: int = TOKEN_BLOCK,
    *,
    zero_exponent: int = EXP_MIN,
) -> FP8Tensor:
    """E4M3 codes with power-of-two exponents rounded up (never clamps), RNE codes.
    ``zero_exponent``: the exponent of all-zero groups (``V_ZERO_EXPONENT`` for V, N3).
    Arguments as :func:`fp8_exponents` takes them (checked there)."""
    exponents = fp8_exponents(x, cu_seqlens, granularity, block, zero_exponent=zero_exponent)
    codes = e4m3_encode(x.float() * exp2i(-exponents.int())[..., None])
    return FP8Tensor(codes, exponents)


def grad_operand(x: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """BF16 ``x·2^-e`` ``[T, H, d]`` with ``exponents`` ``[T, H]`` (an ``FP8Tensor``'s): the
    gradient products' Q/K operand of ``Recipe(grad_qk="input")`` (N6), in the units of the
    codes, so dŜ keeps its E4M3 codes and scales. Exact for BF16 ``x`` (a power of two moves
    no mantissa bit, and ``|x·2^-e| <= 448`` stays far inside BF16's range); FP16 ``x`` is
    rounded to BF16's 8 significant bits (E4M3 keeps 4)."""
    x = check_tokens(x)
    check_tensor(exponents, "exponents", ndim=2, dtypes=(torch.int8, torch.int16, torch.int32),
                 layout="[T, H]")  # fmt: skip
    if exponents.shape != x.shape[:2] or exponents.device != x.device:
        raise ValueError(
            f"exponents must be [T, H] = {tuple(x.shape[:2])} on {x.device} like x, got "
            f"{tuple(exponents.shape)} on {exponents.device}"
        )
    return (x.float() * exp2i(-exponents.int())[..., None]).to(torch.bfloat16)


def quantize_nvfp4(
    x: torch.Tensor, *, second_level: bool = True, scale_candidates: int = 1
) -> NVFP4Tensor:
    """NVFP4 per token (N7, N10): E2M1 codes, one E4M3 scale per 16 elements.

    With ``second_level`` a per-token power-of-two exponent ``e = ceil(log2(amax/2688))``
    first brings the token into E4M3-scale range (never a per-tensor scale: that leaks the
    future). Block scales: ``nvfp4_group_scale`` with ``scale_candidates`` (1: round up, so
    no code clamps; more: the candidate of least squared error, N7). Without the second
    level (KV-cache slot with no room for the exponent) block scales saturate at 448.
    ``x``: ``[T, H, d]`` BF16/FP16/float32, d a multiple of 16; ``TypeError``/``ValueError``
    name the argument that does not fit.
    """
    t, h, d = check_tokens(x).shape
    if d % NVFP4_GROUP:
        raise ValueError(f"x: head dim must be a multiple of {NVFP4_GROUP}, got {d}")
    check_int(scale_candidates, "scale_candidates", low=1)
    xf = x.float().reshape(t, h, d // NVFP4_GROUP, NVFP4_GROUP)
    amax16 = xf.abs().amax(dim=-1)
    if second_level:
        exponents = pow2_exponent_ceil(amax16.amax(dim=-1), NVFP4_MAX)
    else:
        exponents = torch.zeros(t, h, dtype=torch.int8, device=x.device)
    pow2 = exp2i(-exponents.int())[..., None]
    scaled = xf * pow2[..., None]
    # the round-up scale of a group past 2688 (no second level) saturates at 448
    scale = nvfp4_group_scale(scaled.clamp(-NVFP4_MAX, NVFP4_MAX), scale_candidates)
    codes = e2m1_encode(e2m1_ratio(scaled, scale)).reshape(t, h, d)
    return NVFP4Tensor(pack_e2m1(codes), scale.to(torch.float8_e4m3fn), exponents)


@dataclass(frozen=True)
class Block2DTensor:
    """E4M3 codes ``[..., M, N]`` and one exponent per ``(bm, bn)`` block ``[..., ⌈M/bm⌉,
    ⌈N/bn⌉]`` int8 (dS, N6)."""

    codes: torch.Tensor
    exponents: torch.Tensor
    block: tuple[int, int]

    def expanded_exponents(self) -> torch.Tensor:
        """Exponent of every element, int8 ``[..., M, N]``."""
        return _expand_blocks(self.exponents, self.block, *self.codes.shape[-2:])

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * exp2i(self.expanded_exponents())


def quantize_blocks_2d(x: torch.Tensor, block: tuple[int, int]) -> Block2DTensor:
    """E4M3 with one power-of-two exponent per ``block`` tile of the last two dims (N6).

    Blocks start at index 0 of each of the last two dims (callers pass one document's
    ``[H, L, L]`` slab, so blocks are document-local); edge blocks may be short. ``x``:
    BF16/FP16/float32, at least 2 dims; ``block``: two ints >= 1. ``TypeError``/``ValueError``
    name the argument that does not fit.
    """
    check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES, layout="[..., M, N]", at_least=True)
    if not isinstance(block, (tuple, list)) or len(block) != 2:
        raise TypeError(f"block must be a pair (rows, cols) of ints, got {block!r}")
    bm, bn = (check_int(b, f"block[{i}]", low=1) for i, b in enumerate(block))
    *lead, m, n = x.shape
    mb, nb = -(-m // bm), -(-n // bn)
    padded = torch.zeros(*lead, mb * bm, nb * bn, dtype=torch.float32, device=x.device)
    padded[..., :m, :n] = x.float().abs()
    amax = padded.view(*lead, mb, bm, nb, bn).amax(dim=(-3, -1))
    exponents = pow2_exponent_ceil(amax, E4M3_MAX)
    per_element = _expand_blocks(exponents, block, m, n)
    codes = e4m3_encode(x.float() * exp2i(-per_element.int()))
    return Block2DTensor(codes, exponents, block)


def _expand_blocks(exponents: torch.Tensor, block: tuple[int, int], m: int, n: int) -> torch.Tensor:
    bm, bn = block
    e = exponents.repeat_interleave(bm, dim=-2).repeat_interleave(bn, dim=-1)
    return e[..., :m, :n]
