"""Launchers of the serving kernels: cache write and paged attention (decode + prefill).

``paged_attention`` is the one entry point for mixed batches: sequences whose single new
token is a decode (a leading run, as vLLM orders them) go to the split-K decode launch, the
rest to the prefill/extend launch of the same kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from flamia_serve.kernels._common import interpreted
from flamia_serve.kernels.paged.triton import (
    combine_splits_kernel,
    paged_attention_kernel,
    write_kv_cache_kernel,
)
from flamia_serve.numerics import hadamard_transform
from flamia_serve.numerics.checks import INPUT_DTYPES, check_softmax_scale, check_tensor
from flamia_serve.numerics.exp2 import EXP_MODES, ExpMode, check_exp_mode
from flamia_serve.numerics.kv_pages import KVPageFormat

_FMT_ID = {"bf16": 0, "fp8": 1, "nvfp4": 2}
_INDEX_DTYPES = (torch.int32,)


@dataclass(frozen=True)
class PagedLayout:
    """Element strides of a cache tensor as the kernels see it (codes and scales views)."""

    codes: torch.Tensor
    scales: torch.Tensor
    page_size: int
    region_codes: int
    region_scales: int
    scale_base: int
    code_row: int
    scale_row: int

    @staticmethod
    def of(cache: torch.Tensor, fmt: KVPageFormat) -> PagedLayout:
        page = fmt.page_size_of(cache)
        region = fmt.region_bytes(page)
        d = fmt.head_dim
        if fmt.dtype == "bf16":
            codes = cache.view(torch.bfloat16)
            return PagedLayout(codes, cache, page, region // 2, region, 0, d, 0)
        if fmt.dtype == "fp8":
            return PagedLayout(cache, cache.view(torch.int32), page, region, region // 4,
                               page * d // 4, d, 1)  # fmt: skip
        return PagedLayout(cache, cache, page, region, region, page * d // 2, d // 2, d // 16)

    def kernel_args(self) -> dict[str, int]:
        return {
            "PAGE": self.page_size,
            "REGION_CODES": self.region_codes,
            "REGION_SCALES": self.region_scales,
            "SCALE_BASE": self.scale_base,
            "CODE_ROW": self.code_row,
            "SCALE_ROW": self.scale_row,
        }


def _check_cache(cache: object, fmt: KVPageFormat, device: torch.device) -> int:
    if not isinstance(fmt, KVPageFormat):
        raise TypeError(f"fmt must be a KVPageFormat, got {type(fmt).__name__}")
    check_tensor(cache, "kv_cache", ndim=4, dtypes=(torch.uint8,))
    assert isinstance(cache, torch.Tensor)
    if cache.device != device:
        raise ValueError(f"kv_cache is on {cache.device}, the inputs on {device}")
    if not cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    return fmt.page_size_of(cache)


def write_kv_cache(
    cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    fmt: KVPageFormat,
    *,
    hadamard: bool = False,
    validate: bool = True,
) -> None:
    """Quantize ``key``/``value`` ``[N, Hkv, d]`` (bf16/fp16/fp32) into ``cache`` at
    ``slot_mapping`` ``[N]`` (int32/int64, ``block * page_size + offset``, −1 = skip), in
    place — twin: ``reference.paged.write_kv_cache``. Only the addressed slots change.
    ``validate`` checks on the host that every slot is −1 or inside the cache (off for
    CUDA-graph capture)."""
    check_tensor(key, "key", ndim=3, dtypes=(*INPUT_DTYPES, torch.float32))
    check_tensor(value, "value", ndim=3, dtypes=(*INPUT_DTYPES, torch.float32))
    check_tensor(slot_mapping, "slot_mapping", ndim=1, dtypes=(torch.int32, torch.int64))
    page = _check_cache(cache, fmt, key.device)
    n, heads_kv, d = key.shape
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if heads_kv != cache.shape[2] or d != fmt.head_dim:
        raise ValueError(
            f"key [N, Hkv, d] = {tuple(key.shape)} does not fit the cache (Hkv={cache.shape[2]}, "
            f"d={fmt.head_dim})"
        )
    if slot_mapping.shape[0] < n:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {n} tokens")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value must be contiguous in the head dim")
    if hadamard and d & (d - 1):
        raise ValueError(f"hadamard needs a power-of-two head dim, got {d}")
    if n == 0:
        return
    if validate:
        slots = slot_mapping[:n]
        bad = (slots < -1) | (slots >= cache.shape[0] * page)
        if bool(bad.any()):
            raise ValueError(
                f"slot_mapping holds slots outside [-1, {cache.shape[0] * page}) "
                f"(num_blocks {cache.shape[0]} x page_size {page})"
            )
    layout = PagedLayout.of(cache, fmt)
    write_kv_cache_kernel[(n,)](
        key, value, key.stride(0), key.stride(1), value.stride(0), value.stride(1), slot_mapping,
        layout.codes, layout.scales,
        HKV=heads_kv, HKV_P2=triton.next_power_of_2(heads_kv), D=d, LOG2_D=int(math.log2(d)),
        KV_FMT=_FMT_ID[fmt.dtype], HADAMARD=hadamard, INTERPRET=interpreted(),
        num_warps=4, **layout.kernel_args(),
    )  # fmt: skip


@dataclass(frozen=True)
class PagedConfig:
    """Tile shape of one launch: ``block_m`` rows (query tokens × GQA group), ``block_n``
    keys per step."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


def _configs(group_p2: int, d: int, dtype: str) -> tuple[PagedConfig, PagedConfig]:
    """(decode, prefill) configs, measured on the H200 (``benchmarks/tune_paged.py``,
    ``benchmarks/results/tune_paged*.json``): decodes from quantized caches gain from long key
    tiles (per-tile latency dominates), BF16 decodes from short pipelined ones."""
    decode_m = max(16, group_p2)
    if interpreted():
        return PagedConfig(decode_m, 16, 4, 1), PagedConfig(max(32, group_p2), 16, 4, 1)
    if d >= 256:
        return PagedConfig(decode_m, 32, 4, 2), PagedConfig(max(64, group_p2), 32, 4, 2)
    if dtype == "bf16":
        return PagedConfig(decode_m, 64, 4, 2), PagedConfig(max(64, group_p2), 64, 4, 2)
    prefill = PagedConfig(max(128, group_p2), 64, 8, 3) if dtype == "fp8" else PagedConfig(
        max(64, group_p2), 64, 4, 2)
    return PagedConfig(decode_m, 128, 4, 2), prefill


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def decode_splits(num_decodes: int, heads_kv: int, max_seq_len: int, block_n: int,
                  device: torch.device, waves: int = 2) -> int:  # fmt: skip
    """Key-range splits of a decode launch: enough programs for ``waves`` programs per SM,
    each split at least four key tiles long; a power of two up to 64."""
    if num_decodes == 0:
        return 1
    want = math.ceil(waves * _num_sms(device) / (num_decodes * heads_kv))
    by_length = max(1, math.ceil(max_seq_len / (4 * block_n)))
    return min(64, triton.next_power_of_2(max(1, min(want, by_length))))


def leading_decodes(query_start_loc: torch.Tensor) -> int:
    """Number of leading sequences with exactly one new token (host read): the decodes of a
    batch ordered decodes first, as vLLM orders them."""
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).cpu()
    not_decode = (q_lens != 1).nonzero()
    return int(not_decode[0]) if not_decode.numel() else q_lens.numel()


def _check_paged_inputs(
    q: torch.Tensor,
    cache: torch.Tensor,
    fmt: KVPageFormat,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    validate: bool,
) -> None:
    check_tensor(q, "q", ndim=3, dtypes=INPUT_DTYPES)
    _check_cache(cache, fmt, q.device)
    check_tensor(block_table, "block_table", ndim=2, dtypes=_INDEX_DTYPES)
    check_tensor(seq_lens, "seq_lens", ndim=1, dtypes=_INDEX_DTYPES)
    check_tensor(query_start_loc, "query_start_loc", ndim=1, dtypes=_INDEX_DTYPES)
    total, heads_q, d = q.shape
    heads_kv = cache.shape[2]
    if d != fmt.head_dim:
        raise ValueError(f"q head dim {d} != the cache format's head_dim {fmt.head_dim}")
    if heads_q % heads_kv:
        raise ValueError(f"q heads ({heads_q}) must be a multiple of the cache's Hkv ({heads_kv})")
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous in the head dim")
    batch = seq_lens.shape[0]
    if query_start_loc.shape[0] != batch + 1 or block_table.shape[0] < batch:
        raise ValueError(
            f"query_start_loc must have B+1 = {batch + 1} entries and block_table >= B rows, got "
            f"{query_start_loc.shape[0]} and {block_table.shape[0]}"
        )
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc)):  # fmt: skip
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if block_table.stride(-1) != 1:
        raise ValueError("block_table must be contiguous in its last dim")
    if not validate:
        return
    qsl = query_start_loc.cpu().long()
    lens = seq_lens.cpu().long()
    q_lens = qsl[1:] - qsl[:-1]
    if int(qsl[0]) != 0 or int(qsl[-1]) != total or bool((q_lens < 0).any()):
        raise ValueError(
            f"query_start_loc must start at 0, not decrease and end at T={total}, got "
            f"{qsl.tolist()[:8]}..."
        )
    if bool((lens < q_lens).any()):
        raise ValueError("seq_lens must be >= each sequence's number of new query tokens")
    pages = -(-lens // fmt.page_size_of(cache))
    if batch and int(pages.max()) > block_table.shape[1]:
        raise ValueError(f"block_table has {block_table.shape[1]} columns, a sequence needs "
                         f"{int(pages.max())} pages")  # fmt: skip
    used = torch.arange(block_table.shape[1])[None, :] < pages[:, None]
    ids = block_table[:batch].cpu()[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= cache.shape[0]):
        raise ValueError(f"block_table holds block ids outside [0, {cache.shape[0]})")


def paged_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    fmt: KVPageFormat,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    window: int | None = None,
    exp_mode: ExpMode = "exact",
    hadamard: bool = False,
    num_decodes: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    validate: bool = True,
    decode_config: PagedConfig | None = None,
    prefill_config: PagedConfig | None = None,
) -> torch.Tensor:
    """Attention of new tokens ``q`` ``[T, Hq, d]`` over the paged cache (new K/V already
    written) — twin: ``reference.paged.paged_attention``.

    ``block_table`` ``[B, pages]`` int32, ``seq_lens`` ``[B]`` int32 (cached tokens incl. the
    new ones), ``query_start_loc`` ``[B+1]`` int32. ``num_decodes``: the leading sequences
    with one query token (found on the host when None); ``max_seq_len`` sizes the split-K of
    decodes (host-read when None). ``validate`` checks index values on the host (off for
    CUDA-graph capture). ``*_config`` override the measured tile configs.
    Returns ``out`` (``[T, Hq, d]``, q's dtype).
    """
    _check_paged_inputs(q, cache, fmt, block_table, seq_lens, query_start_loc, validate)
    exp_mode = check_exp_mode(exp_mode)
    total, heads_q, d = q.shape
    scale = check_softmax_scale(softmax_scale, d)
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if hadamard and d & (d - 1):
        raise ValueError(f"hadamard needs a power-of-two head dim, got {d}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, contiguous in the head dim")
    batch = seq_lens.shape[0]
    if total == 0 or batch == 0:
        return out
    qk_scale = scale * math.log2(math.e)
    if hadamard:
        q = hadamard_transform(q)
        qk_scale /= d
    if num_decodes is None:
        num_decodes = leading_decodes(query_start_loc[: batch + 1])
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    layout = PagedLayout.of(cache, fmt)
    heads_kv = cache.shape[2]
    group = heads_q // heads_kv
    group_p2 = triton.next_power_of_2(group)
    default_decode, default_prefill = _configs(group_p2, d, fmt.dtype)
    decode_cfg = decode_config or default_decode
    prefill_cfg = prefill_config or default_prefill
    for cfg in (decode_cfg, prefill_cfg):
        if cfg.block_m % group_p2 or cfg.block_m < 16:
            raise ValueError(f"block_m must be >= 16 and a multiple of the GQA group, got {cfg}")
    common = dict(
        HKV=heads_kv, GROUP=group, GROUP_P2=group_p2, D=d, HAS_WINDOW=window is not None,
        KV_FMT=_FMT_ID[fmt.dtype], EXP_MODE=EXP_MODES.index(exp_mode), INTERPRET=interpreted(),
        **layout.kernel_args(),
    )  # fmt: skip
    args = (q, q.stride(0), q.stride(1), layout.codes, layout.scales, block_table,
            block_table.stride(0), seq_lens, query_start_loc)  # fmt: skip
    win = window or 0
    if num_decodes:
        # quantized caches: eight programs per SM hide the per-tile latency (tune_paged)
        waves = 2 if fmt.dtype == "bf16" else 8
        splits = num_splits or decode_splits(num_decodes, heads_kv, max_seq_len,
                                             decode_cfg.block_n, q.device, waves)  # fmt: skip
        if splits & (splits - 1):
            raise ValueError(f"num_splits must be a power of two, got {splits}")
        part_o = part_ml = out
        if splits > 1:
            part_o = torch.empty(splits, num_decodes, heads_q, d, dtype=torch.float32,
                                 device=q.device)  # fmt: skip
            part_ml = torch.empty(splits, num_decodes, heads_q, 2, dtype=torch.float32,
                                  device=q.device)  # fmt: skip
        paged_attention_kernel[(num_decodes, heads_kv, splits)](
            *args, out, out.stride(0), out.stride(1), part_o, part_ml, num_decodes,
            0, num_decodes, qk_scale, win,
            BLOCK_M=decode_cfg.block_m, BLOCK_N=decode_cfg.block_n, NUM_SPLITS=splits,
            DECODE=True, num_warps=decode_cfg.num_warps, num_stages=decode_cfg.num_stages,
            **common,
        )  # fmt: skip
        if splits > 1:
            combine_splits_kernel[(num_decodes, heads_q)](
                part_o, part_ml, out, out.stride(0), out.stride(1), num_decodes, heads_q,
                NUM_SPLITS=splits, D=d, INTERPRET=interpreted(), num_warps=4,
            )  # fmt: skip
    rest = batch - num_decodes
    if rest:
        block_q = prefill_cfg.block_m // group_p2
        grid = (triton.cdiv(total - num_decodes, block_q) + rest, heads_kv, 1)
        paged_attention_kernel[grid](
            *args, out, out.stride(0), out.stride(1), out, out, 0,
            num_decodes, rest, qk_scale, win,
            BLOCK_M=prefill_cfg.block_m, BLOCK_N=prefill_cfg.block_n, NUM_SPLITS=1,
            DECODE=False, num_warps=prefill_cfg.num_warps, num_stages=prefill_cfg.num_stages,
            **common,
        )  # fmt: skip
    return out
