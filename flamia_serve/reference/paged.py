"""Reference twins of the serving kernels: cache write and paged attention (plain PyTorch).

Paged attention over a cache of format ``fmt`` (``numerics.kv_pages``), per sequence ``s``
with ``n`` new query tokens (``query_start_loc``) and ``L = seq_lens[s]`` cached tokens
(the new ones included, already written): query ``i`` sits at position ``L − n + i`` and
sees keys ``j <= pos`` (and ``j > pos − window`` with a sliding window). With
``c = softmax_scale · log2(e)`` (times the exact ``1/d`` after the Hadamard option, which
rotates Q here and K at write time by the unnormalized transform):

* ``bf16`` / ``fp16`` — ``x = (bf16(Q)·K) c`` (``fp16(Q)``), no V exponent;
* ``fp8`` — Q quantized per token (E4M3, ``eQ``, as ``exact_causal`` training):
  ``x = (Q̂·K̂) 2^(eQ + eK) c``, and V's exponent is folded into P (N3): ``y = x + eV``;
* ``fp8_static`` — Q as for ``fp8``, K̂/V̂ the stored codes and ``s_K``/``s_V`` the layer's
  static scales: ``x = (Q̂·K̂) 2^eQ s_K c``, no V exponent, and O is multiplied by ``s_V``;
* ``nvfp4`` — Q scaled per token by ``2^-eQ`` into FP16 (``eQ = ceil(log2(amax/2^15))``):
  ``x = (Q̃·K̃) 2^eQ c`` with K̃, Ṽ the exact dequantized NVFP4 entries.

Then ``M = ceil(max_j y)``; ``(P̂, p) = numerics.exp2.probabilities(y − M, exp_mode, P)``
with P = E4M3·2^8 (fp8, fp8_static, nvfp4) or the 16-bit type (bf16, fp16);
``l = Σ p·2^(−eV)``; ``O = Σ P̂·V / (2^shift · l)`` (times ``s_V`` for fp8_static) — the
training forward's numerics for the fp8 cache.
"""

from __future__ import annotations

import math

import torch

from flamia_serve.numerics import exp2i, hadamard_transform, pow2_exponent_ceil, quantize_fp8
from flamia_serve.numerics.exp2 import P_BF16, P_E4M3, P_FP16, ExpMode, PFormat, probabilities
from flamia_serve.numerics.kv_pages import (
    DecodedSlots,
    KVCacheFormat,
    KVPageFormat,
    decode_slots,
    encode_slots,
    region_view,
)
from flamia_serve.numerics.scales import Granularity

LOG2E = math.log2(math.e)
#: FP16 row maximum Q is scaled to for the NVFP4 cache's FP16 products
Q_FP16_MAX = 2.0**15


def write_kv_cache(
    cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    fmt: KVPageFormat,
    *,
    hadamard: bool = False,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Quantize ``key``/``value`` ``[N, Hkv, d]`` into ``cache`` at ``slot_mapping`` ``[N]``
    (``block * page_size + offset``; −1 = skip; only its first N entries are read, as the
    kernel's), in place. K is rotated first with ``hadamard``; ``k_scale``/``v_scale`` are
    ``fp8_static``'s static scales."""
    page = fmt.page_size_of(cache)
    codes, scales = region_view(cache, fmt)
    slot_mapping = slot_mapping[: key.shape[0]]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blk, off = slots // page, slots % page
    k, v = key[keep], value[keep]
    if hadamard:
        k = hadamard_transform(k)
    for half, x, static in ((0, k, k_scale), (1, v, v_scale)):
        c, s = encode_slots(x, fmt, static)
        codes[half][blk, :, off] = c
        scales[blk, half, :, off] = s


def gather_kv(
    cache: torch.Tensor, fmt: KVPageFormat, block_table_row: torch.Tensor, length: int
) -> tuple[DecodedSlots, DecodedSlots]:
    """Decoded K and V ``[length, Hkv, d]`` of one sequence's first ``length`` tokens."""
    page = fmt.page_size_of(cache)
    codes, scales = region_view(cache, fmt)
    pos = torch.arange(length, device=cache.device)
    blk, off = block_table_row.long()[pos // page], pos % page
    k = decode_slots(codes[0][blk, :, off], scales[blk, 0, :, off], fmt)
    v = decode_slots(codes[1][blk, :, off], scales[blk, 1, :, off], fmt)
    return k, v


def p_format(fmt: KVPageFormat) -> PFormat:
    """P̂'s format for a cache dtype: the 16-bit type for 16-bit caches, E4M3·2^8 otherwise."""
    return {KVCacheFormat.BF16: P_BF16, KVCacheFormat.FP16: P_FP16}.get(fmt.dtype, P_E4M3)


def _scores(
    q: torch.Tensor, k: DecodedSlots, fmt: KVPageFormat, scale: float
) -> torch.Tensor:
    """Base-2 logits ``[H, n, L]`` (``q`` float32 ``[n, H, d]``, ``k`` per query head)."""
    if fmt.dtype.is_16bit:
        q16 = q.to(fmt.dtype.value_dtype).float()  # type: ignore[arg-type]
        return torch.einsum("ihd,jhd->hij", q16, k.values) * scale
    if fmt.dtype in (KVCacheFormat.FP8, KVCacheFormat.FP8_STATIC):
        q8 = quantize_fp8(q, None, Granularity.TOKEN)
        dots = torch.einsum("ihd,jhd->hij", q8.codes.float(), k.values)
        row = exp2i(q8.exponents.int()).t()[:, :, None]
        if k.exponents is None:  # fp8_static: its K scale is folded into ``scale``
            return dots * row * scale
        col = exp2i(k.exponents).t()[:, None, :]
        return dots * row * col * scale
    eq = pow2_exponent_ceil(q.abs().amax(dim=-1), Q_FP16_MAX).int()  # [n, H]
    q16 = (q * exp2i(-eq)[..., None]).to(torch.float16).float()
    dots = torch.einsum("ihd,jhd->hij", q16, k.values)
    return dots * exp2i(eq).t()[:, :, None] * scale


def _per_q_head(x: DecodedSlots, group: int) -> DecodedSlots:
    exps = None if x.exponents is None else x.exponents.repeat_interleave(group, dim=1)
    return DecodedSlots(x.values.repeat_interleave(group, dim=1), exps)


def paged_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    fmt: KVPageFormat,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    softmax_scale: float,
    window: int | None = None,
    exp_mode: ExpMode = "exact",
    hadamard: bool = False,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of ``q`` ``[T, Hq, d]`` over the paged cache (module docstring), ``[T, Hq,
    d]`` in ``q.dtype``. ``k_scale``/``v_scale``: ``fp8_static``'s static scales."""
    total, heads_q, d = q.shape
    group = heads_q // cache.shape[2]
    pfmt = p_format(fmt)
    static = fmt.dtype is KVCacheFormat.FP8_STATIC
    scale = softmax_scale * LOG2E * (1.0 / d if hadamard else 1.0)
    if static:
        scale *= k_scale
    out_scale = v_scale if static else 1.0
    out = torch.zeros(total, heads_q, d, dtype=torch.float32, device=q.device)
    starts = query_start_loc.tolist()
    for s, length in enumerate(seq_lens.tolist()):
        a, b = starts[s], starts[s + 1]
        if b == a:
            continue
        k, v = gather_kv(cache, fmt, block_table[s], length)
        k, v = _per_q_head(k, group), _per_q_head(v, group)
        qs = q[a:b].float()
        if hadamard:
            qs = hadamard_transform(qs)
        x = _scores(qs, k, fmt, scale)
        pos = torch.arange(length - (b - a), length, device=q.device)[:, None]
        keys = torch.arange(length, device=q.device)[None, :]
        allowed = keys <= pos
        if window is not None:
            allowed &= keys > pos - window
        ev = torch.zeros(heads_q, length, device=q.device)
        if v.exponents is not None:
            ev = v.exponents.t().float()
        y = (x + ev[:, None, :]).masked_fill(~allowed, float("-inf"))
        m = torch.ceil(y.amax(dim=-1, keepdim=True))
        p_hat, p = probabilities(y - m, exp_mode, pfmt)
        l_row = (p * exp2i(-ev.int())[:, None, :]).sum(-1)  # [H, n]
        pv = torch.einsum("hij,jhd->ihd", p_hat, v.values)
        out[a:b] = pv / (l_row.t()[..., None] * 2.0**pfmt.shift) * out_scale
    return out.to(q.dtype)
