"""Launchers of the serving kernels: cache write and paged attention (decode + prefill).

Two layers, as FlashInfer's ``plan()`` / ``run()`` and vLLM's ``build()`` / ``forward()``:

* :func:`plan_paged` — everything decided on the host once per batch (decode / prefill
  split, split-K count, tile configs, grid sizes) from host-side batch facts;
* :func:`run_paged_attention` / :func:`run_write_kv_cache` — launch with a plan; they read
  nothing from the GPU and check nothing (CUDA-graph safe: the vLLM backend's hot path).

:func:`paged_attention` and :func:`write_kv_cache` are the validating entry points for direct
users: they check arguments (index values on the host unless ``validate=False``), plan from
the tensors and run. Sequences whose single new token is a decode (a leading run, as vLLM
orders them) go to the split-K decode launch, the rest to the prefill/extend launch of the
same kernel.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from flamia_serve.kernels._common import (
    cdiv,
    cute_available,
    cute_dsl_available,
    interpreted,
    next_power_of_2,
    sm_count,
)
from flamia_serve.kernels.attn_fwd.ops import FwdConfig, default_config, quantizes_q
from flamia_serve.kernels.paged.triton import (
    combine_splits_kernel,
    paged_attention_kernel,
    prefill_offsets_kernel,
    prefill_operands_kernel,
    quantize_q_tokens_kernel,
    write_kv_cache_kernel,
)
from flamia_serve.kernels.schedule import WorkList, build_work_list
from flamia_serve.numerics import hadamard_transform
from flamia_serve.numerics.checks import (
    INPUT_DTYPES,
    SUPPORTED_HEAD_DIMS,
    check_softmax_scale,
    check_tensor,
)
from flamia_serve.numerics.exp2 import EXP_MODES, ExpMode, check_exp_mode
from flamia_serve.numerics.kv_pages import KVCacheFormat, KVPageFormat, static_inverse
from flamia_serve.numerics.operands import EXPONENT_DTYPE, KernelQKV, v_t_length

_INDEX_DTYPES = (torch.int32,)
MAX_DECODE_SPLITS = 64
#: How a CuTe decode's CTAs fill the GPU, by cache format and warps per CTA: per occupancy
#: level, (CTAs per SM, fewest keys per split). ``cute_decode_splits`` fills one wave of a
#: level's CTAs with splits at least that long, and takes the level giving the most splits
#: (a second CTA per SM pays only with long splits: NVFP4 at eight warps). FP8 at eight warps
#: takes 251 registers, the whole register file.
_FP8_WAVES = {4: ((2, 512),), 8: ((1, 256),)}
CUTE_DECODE_WAVES = {
    KVCacheFormat.FP8: _FP8_WAVES, KVCacheFormat.FP8_STATIC: _FP8_WAVES,
    KVCacheFormat.NVFP4: {4: ((3, 512),), 8: ((1, 256), (2, 2048))},
}  # fmt: skip
CUTE_DECODE_WARPS = (2, 4, 8)


@dataclass(frozen=True)
class PagedLayout:
    """A cache tensor as the kernels see it: typed code and scale views plus the element
    strides of ``KVPageFormat.strides`` (``numerics.kv_pages`` is the one definition)."""

    codes: torch.Tensor
    scales: torch.Tensor
    page_size: int
    region_codes: int
    region_scales: int
    scale_base: int
    code_row: int
    scale_row: int
    v_code_row: int
    v_code_col: int

    @staticmethod
    def of(cache: torch.Tensor, fmt: KVPageFormat) -> PagedLayout:
        st = fmt.strides(fmt.page_size_of(cache))
        return PagedLayout(cache.view(st.code_dtype), cache.view(st.scale_dtype), st.page_size,
                           st.region_codes, st.region_scales, st.scale_base, st.code_row,
                           st.scale_row, st.v_code_row, st.v_code_col)  # fmt: skip

    def kernel_args(self) -> dict[str, int]:
        return {
            "PAGE": self.page_size,
            "REGION_CODES": self.region_codes,
            "REGION_SCALES": self.region_scales,
            "SCALE_BASE": self.scale_base,
            "CODE_ROW": self.code_row,
            "SCALE_ROW": self.scale_row,
            "V_ROW": self.v_code_row,
            "V_COL": self.v_code_col,
        }


@dataclass(frozen=True)
class PagedConfig:
    """Tile shape of one launch: ``block_m`` rows (query tokens × GQA group), ``block_n``
    keys per step. ``keys_on_m`` (8-bit caches only): swap the MMA operands so the keys fill
    M and the query rows N (``Sᵀ = K̂·Q̂ᵀ``). ``kernel="cute"`` (decodes from a quantized
    cache, :func:`cute_decode_runs`; prefills from the fp8 cache, :func:`cute_prefill_runs`):
    the CuTe DSL kernels (``cute_decode_sm90.py``; the training forward ``attn_fwd.cute_sm90``
    on operands laid out from the cache) for ``exact`` exponentials (prefill: also Mitchell-P)
    without a window and pages of a multiple of 16 slots, the Triton kernel (same numerics,
    these tiles) otherwise."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    keys_on_m: bool = False
    kernel: str = "triton"  # "triton" | "cute"


def _check_config(cfg: object, name: str) -> None:
    """A caller's tile config, named ``name``, that the kernels can run: power-of-two tiles
    (``tl.arange``), at least 16 keys per tile (the P̂·V̂ MMA's contraction), a power of two
    of warps, at least one stage, a known ``kernel``."""
    if not isinstance(cfg, PagedConfig):
        raise TypeError(f"{name} must be a PagedConfig, got {type(cfg).__name__}")
    for field, value, low in (("block_m", cfg.block_m, 16), ("block_n", cfg.block_n, 16),
                              ("num_warps", cfg.num_warps, 1)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < low \
                or value & (value - 1):  # fmt: skip
            raise ValueError(f"{name}.{field} must be a power of two >= {low}, got {value!r}")
    if isinstance(cfg.num_stages, bool) or not isinstance(cfg.num_stages, int) \
            or cfg.num_stages < 1:  # fmt: skip
        raise ValueError(f"{name}.num_stages must be a positive int, got {cfg.num_stages!r}")
    if cfg.kernel not in ("triton", "cute"):
        raise ValueError(f"{name}.kernel must be 'triton' or 'cute', got {cfg.kernel!r}")


def default_configs(group_p2: int, d: int, fmt: KVCacheFormat) -> tuple[PagedConfig, PagedConfig]:
    """(decode, prefill) configs, measured on the H200 (``benchmarks/tune_paged.py``,
    ``benchmarks/results/tune_paged*.json``): decodes from quantized caches gain from long key
    tiles (per-tile latency dominates), 16-bit decodes from short pipelined ones; the 8-bit
    decode is fastest with the keys on M (2026-12-01: 405 vs 421 µs at B64-L8192)."""
    decode_m = max(16, group_p2)
    if interpreted():
        return PagedConfig(decode_m, 16, 4, 1), PagedConfig(max(32, group_p2), 16, 4, 1)
    if d >= 256:
        return PagedConfig(decode_m, 32, 4, 2), PagedConfig(max(64, group_p2), 32, 4, 2)
    if fmt.is_16bit:
        return PagedConfig(decode_m, 64, 4, 2), PagedConfig(max(64, group_p2), 64, 4, 2)
    prefill = PagedConfig(max(64, group_p2), 128, 4, 2)
    if fmt.v_dim_major:  # 8-bit: FP8 MMAs, keys on M for decodes
        return PagedConfig(decode_m, 64, 4, 2, keys_on_m=True), prefill
    return PagedConfig(decode_m, 128, 4, 2), prefill


#: cache formats the CuTe decodes serve (``cute_decode_sm90.py``; the default on sm_90)
CUTE_DECODE_FORMATS = (KVCacheFormat.NVFP4, KVCacheFormat.FP8, KVCacheFormat.FP8_STATIC)
#: exponentials the CuTe prefill runs (Schraudolph runs on the Triton prefill)
CUTE_PREFILL_EXP_MODES = ("exact", "mitchell")


def cute_decode_runs(fmt: KVPageFormat, heads_q: int, heads_kv: int,
                     device: torch.device) -> bool:  # fmt: skip
    """Whether a CuTe decode serves this cache: an sm_90 GPU with ``nvidia-cutlass-dsl``, an
    NVFP4, FP8 or static FP8 cache, d in {64, 128}, a GQA group of at most 16 (NVFP4) or 8
    (FP8: at 16 its kernel spills registers)."""
    max_group = 16 if fmt.dtype is KVCacheFormat.NVFP4 else 8
    return (
        fmt.dtype in CUTE_DECODE_FORMATS and fmt.head_dim in (64, 128)
        and heads_q // heads_kv <= max_group and cute_dsl_available(device)
    )  # fmt: skip


def cute_prefill_runs(fmt: KVPageFormat, device: torch.device) -> bool:
    """Whether the training forward's CuTe kernel serves prefills from this cache: the fp8
    cache (its numerics are the forward's with per-token Q and per-key K/V exponents), d in
    {64, 128, 256}, an sm_90 GPU with ``nvidia-cutlass-dsl`` and ``flash-attn-4``."""
    return (
        fmt.dtype is KVCacheFormat.FP8 and fmt.head_dim in (64, 128, 256)
        and cute_available(device)
    )  # fmt: skip


def triton_decode_config(fmt: KVPageFormat, heads_q: int, heads_kv: int) -> PagedConfig:
    """The Triton kernel's measured decode config for this cache and GQA group (what runs
    where the CuTe decodes do not, and what a caller passes to compare with them)."""
    group_p2 = next_power_of_2(heads_q // heads_kv)
    return default_configs(group_p2, fmt.head_dim, fmt.dtype)[0]


def _default_decode_config(fmt: KVPageFormat, heads_q: int, heads_kv: int, num_decodes: int,
                           device: torch.device) -> PagedConfig:  # fmt: skip
    """The measured decode config for ``num_decodes`` decodes: on the CuTe kernel where
    :func:`cute_decode_runs`, with ``num_warps`` from :func:`cute_decode_warps`."""
    cfg = triton_decode_config(fmt, heads_q, heads_kv)
    if cute_decode_runs(fmt, heads_q, heads_kv, device):
        warps = cute_decode_warps(fmt, num_decodes * heads_kv, device)
        cfg = replace(cfg, kernel="cute", num_warps=warps)
    return cfg


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return sm_count(device)
    return 132


def decode_splits(num_decodes: int, heads_kv: int, max_seq_len: int, block_n: int,
                  device: torch.device, waves: int = 2) -> int:  # fmt: skip
    """Key-range splits of a decode launch: enough programs for ``waves`` programs per SM,
    each split at least four key tiles long; a power of two up to ``MAX_DECODE_SPLITS``."""
    if num_decodes == 0:
        return 1
    want = math.ceil(waves * _num_sms(device) / (num_decodes * heads_kv))
    by_length = max(1, math.ceil(max_seq_len / (4 * block_n)))
    return min(MAX_DECODE_SPLITS, next_power_of_2(max(1, min(want, by_length))))


def leading_decodes(query_start_loc: torch.Tensor) -> int:
    """Number of leading sequences with at most one new token (host read when on the GPU):
    the decodes of a batch ordered decodes first, as vLLM orders them."""
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).cpu()
    not_decode = (q_lens > 1).nonzero()
    return int(not_decode[0]) if not_decode.numel() else q_lens.numel()


def _splits_for(fmt: KVPageFormat, heads_kv: int, num_decodes: int, max_seq_len: int,
                cfg: PagedConfig, device: torch.device) -> int:  # fmt: skip
    # quantized caches: eight Triton programs per SM hide the per-tile latency (tune_paged).
    if fmt.dtype.is_16bit:
        return decode_splits(num_decodes, heads_kv, max_seq_len, cfg.block_n, device, 2)
    if cfg.kernel != "cute":
        return decode_splits(num_decodes, heads_kv, max_seq_len, cfg.block_n, device, 8)
    return cute_decode_splits(fmt, num_decodes * heads_kv, max_seq_len, device, cfg.num_warps)


def cute_decode_warps(fmt: KVPageFormat, pairs: int, device: torch.device) -> int:
    """Warps per CTA of a CuTe decode over ``pairs`` (sequence, KV head) pairs: eight while
    one wave of eight-warp CTAs (``CUTE_DECODE_WAVES``) holds every pair, so that a pair's
    keys get more warps in fewer splits; four otherwise. H200, Hkv 8, 16 sequences
    (``tune_decode_cute_warps.json``): FP8 one split of eight warps 81.9 µs at L8192 (two of
    four 84.4), 269.5 at L32768 (273.7); NVFP4 two splits of eight 60.6 (three of four
    62.0), 194.5 (203.1); 64 sequences (``tune_decode_cute_warps_b1_b64_2026-12-02.log``):
    FP8 four warps 274.1 µs at L8192 (eight 287.2), NVFP4 a tie (196.1, 194.8)."""
    most = max(ctas for ctas, _ in CUTE_DECODE_WAVES[fmt.dtype][8])
    return 8 if pairs <= most * _num_sms(device) else 4


def cute_decode_splits(fmt: KVPageFormat, pairs: int, max_seq_len: int, device: torch.device,
                       warps: int = 4) -> int:  # fmt: skip
    """Key-range splits of a CuTe decode of ``warps`` per CTA over ``pairs`` (sequence, KV
    head) pairs: per level of ``CUTE_DECODE_WAVES``, as many as fill one wave of its CTAs
    without starting a second (a partial second wave runs at a fraction of the bandwidth),
    each at least its keys long; the most of any level, at least one. H200, Hkv 8, 16
    sequences, four warps (``tune_decode_splits.json``): NVFP4 three splits 75.6 µs at L8192
    (eight 91.2, four 98.5), FP8 two 85.0 (four 90.7, three 100.8); at 64 sequences one
    split. Eight warps (``tune_decode_cute_warps_splits.json``, µs): one sequence, FP8 four
    splits 13.4 at L1024 (one 15.7), sixteen 39.3 at L32768 (eight 45.2, 33 49.0); NVFP4 four
    13.7 at L1024 (one 16.4), sixteen 20.4 at L8192 (four 26.1) and 31.6 at L32768 (33
    35.8); 16 sequences, NVFP4 two 60.2 at L8192 (one 68.1), one 17.3 at L1024 (two 20.6)."""
    if pairs == 0:
        return 1
    waves = CUTE_DECODE_WAVES[fmt.dtype]
    sms = _num_sms(device)
    best = 1
    # two warps: the four-warp levels (their CTAs are register-limited alike)
    for ctas, keys in waves.get(warps, waves[4]):
        best = max(best, min(ctas * sms // pairs, math.ceil(max_seq_len / keys)))
    return min(MAX_DECODE_SPLITS, best)


def max_workspace_rows(fmt: KVPageFormat, heads_q: int, heads_kv: int, max_decodes: int,
                       max_seq_len: int, device: torch.device | str) -> int:  # fmt: skip
    """The most split-K partial rows (tokens × splits) a default plan of up to ``max_decodes``
    decodes over at most ``max_seq_len`` keys needs: the size of a workspace that serves
    every batch (and every CUDA graph) of an engine."""
    dev = torch.device(device)
    rows = 0
    for n in range(1, max_decodes + 1):
        cfg = _default_decode_config(fmt, heads_q, heads_kv, n, dev)
        splits = _splits_for(fmt, heads_kv, n, max_seq_len, cfg, dev)
        if splits > 1:
            rows = max(rows, splits * n)
    return rows


@dataclass(frozen=True)
class PagedPlan:
    """Host-side launch plan of one batch, shared by every layer (no GPU reads at launch).

    ``num_decodes`` leading sequences (at most one new token each, ``num_decode_tokens`` of
    them) run as split-K decodes with ``num_splits`` key ranges; the other ``num_seqs −
    num_decodes`` sequences run as causal prefill/extend on ``prefill_programs`` query
    blocks (an upper bound is safe: extra programs exit). ``max_seq_len`` bounds every
    sequence's keys, ``prefill_keys`` the prefill sequences' keys together (0: unknown; the
    CuTe prefill sizes its operands by it and needs it).
    """

    fmt: KVPageFormat
    heads_q: int
    heads_kv: int
    num_seqs: int
    num_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_splits: int
    decode: PagedConfig
    prefill: PagedConfig
    prefill_programs: int
    max_seq_len: int = 0
    prefill_keys: int = 0

    @property
    def group_p2(self) -> int:
        return next_power_of_2(self.heads_q // self.heads_kv)

    @property
    def num_prefills(self) -> int:
        """Sequences after the decodes (prefill/extend)."""
        return self.num_seqs - self.num_decodes

    @property
    def num_prefill_tokens(self) -> int:
        """Query rows of the prefill sequences (``num_decode_tokens..num_tokens``)."""
        return self.num_tokens - self.num_decode_tokens

    @property
    def workspace_rows(self) -> int:
        """Rows (token × split) of split-K partials this plan needs (0: no split)."""
        return self.num_splits * self.num_decode_tokens if self.num_splits > 1 else 0


def plan_paged(
    fmt: KVPageFormat,
    heads_q: int,
    heads_kv: int,
    query_start_loc_host: torch.Tensor,
    max_seq_len: int,
    *,
    num_tokens: int | None = None,
    device: torch.device | str = "cuda",
    num_splits: int | None = None,
    decode_config: PagedConfig | None = None,
    prefill_config: PagedConfig | None = None,
    max_decodes: int | None = None,
    seq_lens_host: torch.Tensor | None = None,
) -> PagedPlan:
    """Plan one batch from host data: ``query_start_loc_host`` ``[B+1]`` (a CPU tensor),
    ``max_seq_len`` (an upper bound on ``seq_lens``, sizes the split-K), ``num_tokens`` (rows
    of ``q``; default ``query_start_loc_host[-1]``). ``num_splits`` forces the decode split
    count (1 to ``MAX_DECODE_SPLITS``); ``*_config`` override the measured tile configs;
    ``max_decodes`` caps the decode run (the rest goes to the prefill launch).
    ``seq_lens_host`` (a CPU tensor, exact or an upper bound for the prefill sequences) lets
    the CuTe prefill run."""
    qsl = query_start_loc_host.tolist()
    batch = len(qsl) - 1
    total = int(qsl[-1]) if num_tokens is None else num_tokens
    limit = batch if max_decodes is None else min(batch, max_decodes)
    num_decodes = 0
    while num_decodes < limit and qsl[num_decodes + 1] - qsl[num_decodes] <= 1:
        num_decodes += 1
    prefill_keys = 0
    if seq_lens_host is not None:
        prefill_keys = int(seq_lens_host[num_decodes:batch].long().sum())
    return plan_paged_counts(fmt, heads_q, heads_kv, num_seqs=batch, num_tokens=total,
                             num_decodes=num_decodes,
                             num_decode_tokens=int(qsl[num_decodes]) if batch else 0,
                             max_seq_len=max_seq_len, device=device, num_splits=num_splits,
                             decode_config=decode_config, prefill_config=prefill_config,
                             prefill_keys=prefill_keys)  # fmt: skip


def plan_paged_counts(
    fmt: KVPageFormat,
    heads_q: int,
    heads_kv: int,
    *,
    num_seqs: int,
    num_tokens: int,
    num_decodes: int,
    num_decode_tokens: int,
    max_seq_len: int,
    device: torch.device | str = "cuda",
    num_splits: int | None = None,
    decode_config: PagedConfig | None = None,
    prefill_config: PagedConfig | None = None,
    prefill_keys: int = 0,
) -> PagedPlan:
    """:func:`plan_paged` from batch counts the caller already knows (no tensor at all):
    the first ``num_decodes`` of ``num_seqs`` sequences are decodes holding the first
    ``num_decode_tokens`` of ``num_tokens`` query rows; the others hold at most
    ``prefill_keys`` keys together (0: unknown)."""
    if heads_q % heads_kv:
        raise ValueError(f"q heads ({heads_q}) must be a multiple of the cache's Hkv ({heads_kv})")
    if not 0 <= num_decodes <= num_seqs or not 0 <= num_decode_tokens <= num_tokens:
        raise ValueError(
            f"inconsistent batch counts: {num_decodes} decodes of {num_seqs} sequences, "
            f"{num_decode_tokens} decode tokens of {num_tokens}"
        )
    group_p2 = next_power_of_2(heads_q // heads_kv)
    for name, given in (("decode_config", decode_config), ("prefill_config", prefill_config)):
        if given is not None:
            _check_config(given, name)
    default_prefill = default_configs(group_p2, fmt.head_dim, fmt.dtype)[1]
    decode_cfg = decode_config or _default_decode_config(fmt, heads_q, heads_kv, num_decodes,
                                                         torch.device(device))  # fmt: skip
    if decode_cfg.kernel == "cute" and decode_cfg.num_warps not in CUTE_DECODE_WARPS:
        raise ValueError(f"decode_config.num_warps must be one of {CUTE_DECODE_WARPS} for the "
                         f"CuTe decode, got {decode_cfg.num_warps}")  # fmt: skip
    prefill_cfg = prefill_config or default_prefill
    if prefill_config is None and cute_prefill_runs(fmt, torch.device(device)):
        prefill_cfg = replace(prefill_cfg, kernel="cute")
    for cfg in (decode_cfg, prefill_cfg):
        if cfg.block_m % group_p2 or cfg.block_m < 16:
            raise ValueError(f"block_m must be >= 16 and a multiple of the GQA group, got {cfg}")
    if (decode_cfg.keys_on_m or prefill_cfg.keys_on_m) and not fmt.dtype.v_dim_major:
        raise ValueError(f"keys_on_m needs an 8-bit cache (fp8, fp8_static), got {fmt.dtype}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)):
        raise ValueError(f"num_splits must be an int or None, got {num_splits!r}")
    splits = num_splits or _splits_for(fmt, heads_kv, num_decodes, max_seq_len, decode_cfg,
                                       torch.device(device))  # fmt: skip
    if not 1 <= splits <= MAX_DECODE_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_DECODE_SPLITS}, got {splits}")
    rest = num_seqs - num_decodes
    block_q = prefill_cfg.block_m // group_p2
    prefill = cdiv(max(num_tokens - num_decode_tokens, 0), block_q) + rest if rest else 0
    return PagedPlan(fmt, heads_q, heads_kv, num_seqs, num_tokens, num_decodes,
                     num_decode_tokens, splits, decode_cfg, prefill_cfg, prefill, max_seq_len,
                     max(prefill_keys, 0))  # fmt: skip


@dataclass
class PagedWorkspace:
    """Split-K partials (float32 ``O`` and ``(M, l)``) reused across layers and steps —
    preallocated so CUDA-graph replays see fixed addresses. ``rows`` = tokens × splits."""

    part_o: torch.Tensor
    part_ml: torch.Tensor

    @classmethod
    def allocate(cls, rows: int, heads_q: int, head_dim: int,
                 device: torch.device | str) -> PagedWorkspace:  # fmt: skip
        rows = max(rows, 1)
        return cls(torch.empty(rows * heads_q * head_dim, dtype=torch.float32, device=device),
                   torch.empty(rows * heads_q * 2, dtype=torch.float32, device=device))  # fmt: skip

    def fits(self, plan: PagedPlan) -> bool:
        """Whether ``plan``'s split-K partials fit: its rows × query heads of ``(M, l)``
        pairs and of head-dim ``O`` rows."""
        rows = plan.workspace_rows * plan.heads_q
        return self.part_ml.numel() >= rows * 2 and self.part_o.numel() >= rows * plan.fmt.head_dim


def run_write_kv_cache(
    cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    fmt: KVPageFormat,
    num_tokens: int,
    *,
    hadamard: bool = False,
    k_inv_scale: float = 1.0,
    v_inv_scale: float = 1.0,
) -> None:
    """Launch the cache write for the first ``num_tokens`` rows (no checks, no host reads;
    ``*_inv_scale`` = ``static_inverse`` of ``fp8_static``'s scales)."""
    if num_tokens == 0:
        return
    layout = PagedLayout.of(cache, fmt)
    heads_kv, d = key.shape[1], key.shape[2]
    write_kv_cache_kernel[(num_tokens,)](
        key, value, key.stride(0), key.stride(1), value.stride(0), value.stride(1), slot_mapping,
        layout.codes, layout.scales, k_inv_scale, v_inv_scale,
        HKV=heads_kv, HKV_P2=next_power_of_2(heads_kv), D=d, LOG2_D=int(math.log2(d)),
        KV_FMT=fmt.dtype.kernel_id, HADAMARD=hadamard, INTERPRET=interpreted(),
        num_warps=4, **layout.kernel_args(),
    )  # fmt: skip


#: why the CuTe ``"decode"`` / ``"prefill"`` stopped being used in this process (absent:
#: it is used): the first import or compile error, e.g. a cutlass-dsl version it does not
#: build with
CUTE_FAILURES: dict[str, str] = {}
#: launches of ``run_paged_attention`` in this process by part and kernel ("decode:cute",
#: "decode:triton", "prefill:cute", "prefill:triton"): which kernels served (a CUDA-graph
#: replay counts once, at its capture)
LAUNCHES: Counter[str] = Counter()


def _cute_fast_path(kind: str, launch: Callable[[], None]) -> bool:
    """Run ``launch`` (import and launch of the CuTe ``kind``); on an error, warn once,
    record it in ``CUTE_FAILURES[kind]`` and return False: the Triton kernel (same numerics)
    runs from then on."""
    try:
        launch()
    except Exception as exc:  # any failure of an optional fast path
        CUTE_FAILURES[kind] = f"{type(exc).__name__}: {exc}"[:500]
        warnings.warn(f"the CuTe {kind} failed ({CUTE_FAILURES[kind]}); using the Triton "
                      f"{kind} from now on", RuntimeWarning, stacklevel=3)  # fmt: skip
        return False
    return True


def _cute_runs(kind: str, cfg: PagedConfig, window: int | None, exp_mode: ExpMode,
               page_size: int) -> bool:  # fmt: skip
    """Whether the CuTe ``kind`` ("decode" / "prefill") takes a launch its plan gave it: no
    sliding window, an exponential it runs, pages of a multiple of 16 slots, no earlier
    failure in this process (the Triton kernel, same numerics, runs otherwise)."""
    modes = CUTE_PREFILL_EXP_MODES if kind == "prefill" else ("exact",)
    return cfg.kernel == "cute" and window is None and exp_mode in modes \
        and page_size % 16 == 0 and kind not in CUTE_FAILURES  # fmt: skip


def _cute_decode(**kwargs: object) -> None:
    from flamia_serve.kernels.paged.cute_decode_sm90 import paged_decode_sm90

    paged_decode_sm90(**kwargs)  # type: ignore[arg-type]


@dataclass(frozen=True)
class PrefillSchedule:
    """The CuTe prefill's per-batch GPU schedule (built once per batch, shared by every layer,
    no host reads): ``offsets`` ``[3, n + 1]`` int32 for the ``n`` prefill sequences (rows:
    query-row prefix sums, key prefix sums, first columns in the column layout), the
    forward's ``work`` list and its tile ``config``."""

    offsets: torch.Tensor
    work: WorkList
    config: FwdConfig


def prefill_offsets(
    plan: PagedPlan,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    column_align: int,
    max_seqs: int = 0,
) -> torch.Tensor:
    """``PrefillSchedule.offsets`` of ``plan``'s prefill sequences (the ``num_seqs −
    num_decodes`` after the decodes), each one's keys padded to ``column_align`` columns.
    ``max_seqs`` (the most sequences a batch can hold) sizes the kernel's block, so every
    batch of an engine runs one compiled variant."""
    count = plan.num_prefills
    # rows 16-byte aligned for every count (else each count class is another JIT variant)
    rows = torch.empty(3, cdiv(count + 1, 4) * 4, dtype=torch.int32,
                       device=seq_lens.device)  # fmt: skip
    offsets = rows[:, : count + 1]
    prefill_offsets_kernel[(1,)](
        seq_lens, query_start_loc, plan.num_decodes, count, offsets[0], offsets[1], offsets[2],
        B_P2=next_power_of_2(max(count, max_seqs) + 1), ALIGN=column_align,
    )  # fmt: skip
    return offsets


def plan_prefill_schedule(
    plan: PagedPlan, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_seqs: int = 0
) -> PrefillSchedule | None:
    """The schedule of ``plan``'s CuTe prefill, or None when its prefills run on Triton
    (not an fp8 cache on sm_90 with the ``cute`` extra, no host key count, no prefill, or
    the CuTe prefill failed earlier in this process). ``max_seqs``: see
    :func:`prefill_offsets`."""
    if (plan.prefill.kernel != "cute" or plan.prefill_keys <= 0 or not plan.num_prefills
            or "prefill" in CUTE_FAILURES):  # fmt: skip
        return None
    cfg = default_config(plan.fmt.head_dim, seq_lens.device, kernel="cute")
    offsets = prefill_offsets(plan, seq_lens, query_start_loc, cfg.block_n, max_seqs)
    work = build_work_list(offsets[0], plan.num_prefill_tokens,
                           block_m=cfg.block_m, block_n=cfg.block_n, causal=True,
                           cu_seqlens_k=offsets[1])  # fmt: skip
    return PrefillSchedule(offsets, work, cfg)


def prefill_operands(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    plan: PagedPlan,
    offsets: torch.Tensor,
    column_align: int,
    chunk: int = 32,
    heads: int = 1,
    defer_q: bool = False,
) -> KernelQKV:
    """The training forward's operands for ``plan``'s prefill sequences (query rows
    ``num_decode_tokens..num_tokens``) from an fp8 cache, with ``offsets`` from
    :func:`prefill_offsets` (same ``column_align``); two launches, no host reads
    (``plan.prefill_keys`` and ``plan.max_seq_len`` bound the sizes; ``chunk`` keys and
    ``heads`` K/V heads per program of the layout kernel: a multiple of 16 and a power of two
    dividing Hkv; the defaults, 32 and 1: bit-equal to every other shape on the H200, and
    the fastest of 16/32/64/128 keys on S2–S4, ``profile_cute_prefill_layouts_2026-12-03.json``).
    Q̂ per token ``[Tq, Hq, d]``; K̂ ``[keys, Hkv, d]`` token-major in key order; V̂ᵀ and the
    factors ``2^eK``, ``eV``, ``2^−eV`` in the column layout; ``cu_seqlens`` counts keys;
    ``k_exp`` and ``v_exp`` are empty (the CuTe forward reads the factors). ``defer_q``
    (:func:`q_quantized_in_kernel` of ``q``): one launch, Q's rows as given in ``q_input``
    for the CuTe forward to quantize per token as it loads them (same rule, same codes);
    ``q_codes`` and ``q_exp`` then hold no values."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 16 or chunk % 16:
        raise ValueError(f"chunk must be a positive multiple of 16 keys, got {chunk!r}")
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 \
            or heads & (heads - 1) or plan.heads_kv % heads:  # fmt: skip
        raise ValueError(f"heads must be a power of two dividing Hkv={plan.heads_kv}, got "
                         f"{heads!r}")  # fmt: skip
    fmt = plan.fmt
    layout = PagedLayout.of(cache, fmt)
    dev, d = q.device, fmt.head_dim
    count, rows = plan.num_prefills, plan.num_prefill_tokens
    t_pad = v_t_length(plan.prefill_keys, count, column_align)
    k_codes = torch.empty(plan.prefill_keys, plan.heads_kv, d, dtype=torch.uint8, device=dev)
    v_t = torch.empty(plan.heads_kv, d, t_pad, dtype=torch.uint8, device=dev)
    factors = torch.empty(plan.heads_kv, 3, t_pad, dtype=torch.float32, device=dev)
    chunks = cdiv(cdiv(plan.max_seq_len, column_align) * column_align, chunk)
    prefill_operands_kernel[(count, chunks, plan.heads_kv // heads)](
        cache, layout.scales, block_table, block_table.stride(0), seq_lens, plan.num_decodes,
        offsets[1], offsets[2], k_codes, v_t, factors, t_pad, HKV=plan.heads_kv, D=d,
        ALIGN=column_align, CHUNK=chunk, HEADS=heads, **layout.kernel_args(),
    )  # fmt: skip
    q_rows = q[plan.num_decode_tokens : plan.num_tokens]
    q_codes = torch.empty(rows, plan.heads_q, d, dtype=torch.float8_e4m3fn, device=dev)
    q_exp = torch.empty(plan.heads_q, rows, dtype=EXPONENT_DTYPE, device=dev)
    if not defer_q:
        block = 16 if interpreted() else 64
        quantize_q_tokens_kernel[(cdiv(rows, block), plan.heads_q)](
            q_rows, q.stride(0), q.stride(1), rows, q_codes, q_exp,
            HQ=plan.heads_q, D=d, BLOCK=block, INTERPRET=interpreted(),
        )  # fmt: skip
    no_exponents = torch.empty(plan.heads_kv, 0, dtype=EXPONENT_DTYPE, device=dev)
    return KernelQKV(
        q_codes, q_exp.t(), k_codes.view(torch.float8_e4m3fn), no_exponents,
        v_t.view(torch.float8_e4m3fn), offsets[2, :count], offsets[1], no_exponents, factors,
        None, None, 1.0, k_exp_block=1, column_align=column_align,
        q_input=q_rows if defer_q else None,
    )  # fmt: skip


#: whether the CuTe prefill quantizes Q in the forward kernel where it can
#: (:func:`q_quantized_in_kernel`), instead of a launch before it
CUTE_PREFILL_DEFERS_Q = True


def q_quantized_in_kernel(q: torch.Tensor, num_decode_tokens: int, cfg: FwdConfig) -> bool:
    """Whether the CuTe prefill's forward (``cfg``) quantizes the prefill rows of ``q`` (from
    row ``num_decode_tokens`` on) itself as its TMA loads them (``CUTE_PREFILL_DEFERS_Q``):
    BF16/FP16 rows the training forward would quantize itself (``attn_fwd.ops.quantizes_q``:
    d <= 128, 16-byte strides and first row). Otherwise the Q launch quantizes them (same
    codes)."""
    return (
        CUTE_PREFILL_DEFERS_Q and q.dtype in (torch.bfloat16, torch.float16)
        and quantizes_q(cfg, "e4m3", q[num_decode_tokens:])
    )  # fmt: skip


def _cute_prefill(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    plan: PagedPlan,
    out: torch.Tensor,
    qk_scale: float,
    schedule: PrefillSchedule | None,
    exp_mode: ExpMode,
) -> None:
    """The prefill sequences of ``plan`` through the training forward's CuTe kernel (extend:
    each sequence's queries are its last keys; ``exp_mode`` one of
    ``CUTE_PREFILL_EXP_MODES``) into their rows of ``out``."""
    from flamia_serve.kernels.attn_fwd.cute_sm90 import attn_fwd_sm90

    schedule = schedule or plan_prefill_schedule(plan, seq_lens, query_start_loc)
    assert schedule is not None
    cfg, offsets = schedule.config, schedule.offsets
    defer_q = q_quantized_in_kernel(q, plan.num_decode_tokens, cfg)
    qkv = prefill_operands(q, cache, block_table, seq_lens, plan, offsets, cfg.block_n,
                           defer_q=defer_q)  # fmt: skip
    stats = torch.empty(2, plan.num_prefill_tokens, plan.heads_q, dtype=torch.float32,
                        device=q.device)  # fmt: skip
    attn_fwd_sm90(
        qkv, offsets[0], schedule.work, out[plan.num_decode_tokens : plan.num_tokens], stats[0],
        stats[1], heads_q=plan.heads_q, causal=True, qk_scale=qk_scale, tile_m=cfg.block_m,
        tile_n=cfg.block_n, num_stages=cfg.num_stages, overlap=cfg.overlap,
        ticket=cfg.persistent, cu_seqlens_k=offsets[1], exp_mode=exp_mode,
        promote_pv=cfg.promote_pv,
    )  # fmt: skip


def run_paged_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    plan: PagedPlan,
    out: torch.Tensor,
    *,
    qk_scale: float,
    window: int | None = None,
    exp_mode: ExpMode = "exact",
    v_scale: float = 1.0,
    workspace: PagedWorkspace | None = None,
    prefill_schedule: PrefillSchedule | None = None,
) -> torch.Tensor:
    """Launch paged attention with a plan (no checks, no host reads). ``qk_scale`` is the
    base-2 logit scale (``softmax_scale · log2 e``, times the static K scale for
    ``fp8_static``, over ``d`` after a Hadamard rotation of ``q``). ``q``/``out`` have at
    least ``plan.num_tokens`` rows. ``prefill_schedule``: :func:`plan_prefill_schedule` of
    this batch (built here when the CuTe prefill runs without one)."""
    fmt = plan.fmt
    if plan.num_seqs == 0 or plan.num_tokens == 0:
        return out
    layout = PagedLayout.of(cache, fmt)
    heads_q, heads_kv, d = plan.heads_q, plan.heads_kv, fmt.head_dim
    common = dict(
        HKV=heads_kv, GROUP=heads_q // heads_kv, GROUP_P2=plan.group_p2, D=d,
        HAS_WINDOW=window is not None, KV_FMT=fmt.dtype.kernel_id,
        EXP_MODE=EXP_MODES.index(exp_mode), INTERPRET=interpreted(), **layout.kernel_args(),
    )  # fmt: skip
    args = (q, q.stride(0), q.stride(1), layout.codes, layout.scales, block_table,
            block_table.stride(0), seq_lens, query_start_loc)  # fmt: skip
    win = window or 0
    num_decodes, splits = plan.num_decodes, plan.num_splits
    if num_decodes:
        part_o = part_ml = out
        rows = plan.num_decode_tokens
        if splits > 1:
            if (workspace is None or not workspace.fits(plan)
                    or workspace.part_o.device != q.device):  # fmt: skip
                workspace = PagedWorkspace.allocate(plan.workspace_rows, heads_q, d, q.device)
            part_o, part_ml = workspace.part_o, workspace.part_ml
        cfg = plan.decode
        cute = _cute_runs("decode", cfg, window, exp_mode, layout.page_size)
        cute = cute and _cute_fast_path("decode", lambda: _cute_decode(
            q=q, cache=cache, block_table=block_table, seq_lens=seq_lens,
            query_start_loc=query_start_loc, out=out, part_o=part_o, part_ml=part_ml,
            fmt=fmt.dtype, num_decodes=num_decodes, num_splits=splits, part_tokens=rows,
            page_size=layout.page_size, qk_scale=qk_scale, v_scale=v_scale,
            warps=cfg.num_warps,
        ))  # fmt: skip
        LAUNCHES["decode:cute" if cute else "decode:triton"] += 1
        if not cute:
            paged_attention_kernel[(num_decodes, heads_kv, splits)](
                *args, out, out.stride(0), out.stride(1), part_o, part_ml, rows,
                0, num_decodes, splits, qk_scale, win, v_scale,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, PARTIAL=splits > 1, DECODE=True,
                KEYS_ON_M=cfg.keys_on_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                **common,
            )  # fmt: skip
        if splits > 1 and rows:
            combine_splits_kernel[(rows, heads_q)](
                part_o, part_ml, out, out.stride(0), out.stride(1), rows, heads_q, splits,
                D=d, INTERPRET=interpreted(), num_warps=4,
            )  # fmt: skip
    rest = plan.num_prefills
    if rest and plan.prefill_programs:
        cfg = plan.prefill
        cute = _cute_runs("prefill", cfg, window, exp_mode, layout.page_size) \
            and plan.prefill_keys > 0  # fmt: skip
        cute = cute and _cute_fast_path("prefill", lambda: _cute_prefill(
            q, cache, block_table, seq_lens, query_start_loc, plan, out, qk_scale,
            prefill_schedule, exp_mode,
        ))  # fmt: skip
        LAUNCHES["prefill:cute" if cute else "prefill:triton"] += 1
        if cute:
            return out
        paged_attention_kernel[(plan.prefill_programs, heads_kv, 1)](
            *args, out, out.stride(0), out.stride(1), out, out, 0,
            num_decodes, rest, 1, qk_scale, win, v_scale,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, PARTIAL=False, DECODE=False,
            KEYS_ON_M=cfg.keys_on_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **common,
        )  # fmt: skip
    return out


def check_kernel_format(fmt: object) -> KVPageFormat:
    """``fmt`` if the serving kernels run it: a :class:`KVPageFormat` with a head dim in
    ``SUPPORTED_HEAD_DIMS`` (the kernels tile d as a power of two; ``KVPageFormat`` alone
    allows any multiple of 16)."""
    if not isinstance(fmt, KVPageFormat):
        raise TypeError(f"fmt must be a KVPageFormat, got {type(fmt).__name__}")
    if fmt.head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {fmt.head_dim} is not served by the paged kernels "
                         f"(supported: {SUPPORTED_HEAD_DIMS})")  # fmt: skip
    return fmt


def _check_cache(cache: object, fmt: KVPageFormat, device: torch.device) -> int:
    check_kernel_format(fmt)
    check_tensor(cache, "kv_cache", ndim=4, dtypes=(torch.uint8,))
    assert isinstance(cache, torch.Tensor)
    if cache.device != device:
        raise ValueError(f"kv_cache is on {cache.device}, the inputs on {device}")
    if not cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    return fmt.page_size_of(cache)


def _check_flat(t: torch.Tensor, name: str) -> None:
    """The kernels index a 1-D index tensor as a plain array: a strided view (a column of a
    2-D tensor) would be read as if it were contiguous."""
    if t.shape[0] > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous (got stride {t.stride(0)}); pass "
                         f"{name}.contiguous()")  # fmt: skip


def _static_inverses(fmt: KVPageFormat, k_scale: float, v_scale: float) -> tuple[float, float]:
    """``static_inverse`` of ``fp8_static``'s scales; (1, 1) for the other formats, which
    take no static scale (a scale other than 1 would be ignored: ``ValueError``)."""
    if fmt.dtype is not KVCacheFormat.FP8_STATIC:
        if k_scale != 1.0 or v_scale != 1.0:
            raise ValueError(
                f"k_scale/v_scale ({k_scale}, {v_scale}) apply to the fp8_static format only "
                f"(vLLM's --kv-cache-dtype fp8 / fp8_e4m3), not {fmt.dtype.value!r}"
                + (" (per-token-head exponents: vLLM's fp8_per_token_head)"
                   if fmt.dtype is KVCacheFormat.FP8 else "")
            )  # fmt: skip
        return 1.0, 1.0
    return static_inverse(k_scale, "k_scale"), static_inverse(v_scale, "v_scale")


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
    validate: bool = True,
) -> None:
    """Quantize ``key``/``value`` ``[N, Hkv, d]`` (bf16/fp16/fp32) into ``cache`` at
    ``slot_mapping`` ``[N]`` (int32/int64, ``block * page_size + offset``, −1 = skip), in
    place — twin: ``reference.paged.write_kv_cache``. Only the addressed slots change.
    ``k_scale``/``v_scale``: ``fp8_static``'s static scales. ``validate`` checks on the host
    that every slot is −1 or inside the cache (off for CUDA-graph capture)."""
    check_tensor(key, "key", ndim=3, dtypes=(*INPUT_DTYPES, torch.float32))
    check_tensor(value, "value", ndim=3, dtypes=(*INPUT_DTYPES, torch.float32))
    check_tensor(slot_mapping, "slot_mapping", ndim=1, dtypes=(torch.int32, torch.int64))
    page = _check_cache(cache, fmt, key.device)
    for name, t in (("value", value), ("slot_mapping", slot_mapping)):
        if t.device != key.device:
            raise ValueError(f"{name} is on {t.device}, key on {key.device}")
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
    _check_flat(slot_mapping, "slot_mapping")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value must be contiguous in the head dim")
    k_inv, v_inv = _static_inverses(fmt, k_scale, v_scale)
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
    run_write_kv_cache(cache, key, value, slot_mapping, fmt, n, hadamard=hadamard,
                       k_inv_scale=k_inv, v_inv_scale=v_inv)  # fmt: skip


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
    _check_flat(seq_lens, "seq_lens")
    _check_flat(query_start_loc, "query_start_loc")
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
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    num_decodes: int | None = None,
    max_seq_len: int | None = None,
    prefill_keys: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    validate: bool = True,
    decode_config: PagedConfig | None = None,
    prefill_config: PagedConfig | None = None,
) -> torch.Tensor:
    """Attention of new tokens ``q`` ``[T, Hq, d]`` over the paged cache (new K/V already
    written) — twin: ``reference.paged.paged_attention``.

    ``block_table`` ``[B, pages]`` int32, ``seq_lens`` ``[B]`` int32 (cached tokens incl. the
    new ones), ``query_start_loc`` ``[B+1]`` int32. ``k_scale``/``v_scale``: ``fp8_static``'s
    static scales. ``num_decodes``: how many leading sequences to run as decodes (found on
    the host when None); ``max_seq_len`` (at least the longest ``seq_lens``: checked where the
    call reads the host) sizes the split-K of decodes and the CuTe prefill's operands
    (host-read when None);
    ``prefill_keys`` bounds the keys of the sequences after the decodes together (host-read
    when None; the CuTe prefill of the fp8 cache sizes its buffers by it, so a bound below
    the true count is an error wherever the call reads the host). ``validate`` checks index values
    on the host; with ``validate=False`` and both ``num_decodes`` and ``max_seq_len`` given
    nothing is read from the GPU (CUDA-graph safe; without ``prefill_keys`` the prefill then
    runs on Triton) and each of the ``num_decodes`` sequences must have exactly one new
    token.
    ``*_config`` override the measured tile configs. Returns ``out`` (``[T, Hq,
    d]``, q's dtype). The per-batch plan is rebuilt on every call: callers that run many
    layers per batch use :func:`plan_paged` + :func:`run_paged_attention`.
    """
    _check_paged_inputs(q, cache, fmt, block_table, seq_lens, query_start_loc, validate)
    exp_mode = check_exp_mode(exp_mode)
    total, heads_q, d = q.shape
    scale = check_softmax_scale(softmax_scale, d)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):  # fmt: skip
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    _static_inverses(fmt, k_scale, v_scale)  # rejects non-positive scales
    if max_seq_len is not None and (isinstance(max_seq_len, bool)
                                    or not isinstance(max_seq_len, int)):
        raise ValueError(f"max_seq_len must be an int or None, got {max_seq_len!r}")
    if prefill_keys is not None and (isinstance(prefill_keys, bool)
                                     or not isinstance(prefill_keys, int) or prefill_keys < 0):
        raise ValueError(f"prefill_keys must be a non-negative int or None, got "
                         f"{prefill_keys!r}")  # fmt: skip
    if out is None:
        out = torch.empty_like(q)
    elif (out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1
          or out.device != q.device):  # fmt: skip
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device}, contiguous in "
                         f"the head dim, got {tuple(out.shape)} {out.dtype} on {out.device}")
    batch = seq_lens.shape[0]
    if total == 0 or batch == 0:
        return out
    qk_scale = scale * math.log2(math.e)
    if hadamard:
        q = hadamard_transform(q)
        qk_scale /= d
    static = fmt.dtype is KVCacheFormat.FP8_STATIC
    if static:
        qk_scale *= k_scale
    plan_args = dict(device=q.device, num_splits=num_splits, decode_config=decode_config,
                     prefill_config=prefill_config)  # fmt: skip
    if not validate and num_decodes is not None and max_seq_len is not None:
        # no host reads: the caller vouches that the first num_decodes sequences have one
        # new token each
        plan = plan_paged_counts(fmt, heads_q, cache.shape[2], num_seqs=batch, num_tokens=total,
                                 num_decodes=num_decodes, num_decode_tokens=num_decodes,
                                 max_seq_len=max_seq_len, prefill_keys=prefill_keys or 0,
                                 **plan_args)  # type: ignore[arg-type]  # fmt: skip
    else:
        qsl_host = query_start_loc[: batch + 1].cpu()
        longest = int(seq_lens.max())
        if max_seq_len is None:
            max_seq_len = longest
        elif max_seq_len < longest:  # the CuTe prefill lays out max_seq_len keys per sequence
            raise ValueError(f"max_seq_len={max_seq_len} is less than the longest sequence "
                             f"({longest} keys)")  # fmt: skip
        plan = plan_paged(fmt, heads_q, cache.shape[2], qsl_host, max_seq_len, num_tokens=total,
                          max_decodes=num_decodes, seq_lens_host=seq_lens.cpu(),
                          **plan_args)  # type: ignore[arg-type]  # fmt: skip
        if prefill_keys is not None:
            if prefill_keys < plan.prefill_keys:  # the CuTe prefill's buffers would overflow
                raise ValueError(f"prefill_keys={prefill_keys} is less than the "
                                 f"{plan.prefill_keys} keys of the sequences after the "
                                 "decodes")  # fmt: skip
            plan = replace(plan, prefill_keys=prefill_keys)
        if num_decodes is not None and num_decodes != plan.num_decodes:
            raise ValueError(f"num_decodes={num_decodes} exceeds the {plan.num_decodes} leading "
                             "sequences with at most one new token")  # fmt: skip
    return run_paged_attention(q, cache, block_table, seq_lens, query_start_loc, plan, out,
                               qk_scale=qk_scale, window=window, exp_mode=exp_mode,
                               v_scale=v_scale if static else 1.0)  # fmt: skip
