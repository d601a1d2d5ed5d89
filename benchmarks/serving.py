"""Shared setup of the serving benchmarks: paged batches in every cache format, FlashInfer
wrappers over the same tokens, CUDA-graph timing and accuracy against exact attention."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.common import graph_time, in_rounds
from flamia_serve.kernels.paged import (
    PagedConfig,
    PagedPlan,
    PagedWorkspace,
    PrefillSchedule,
    leading_decodes,
    plan_paged_counts,
    plan_prefill_schedule,
    run_paged_attention,
    triton_decode_config,
    write_kv_cache,
)
from flamia_serve.kernels.paged import ops as paged_ops
from flamia_serve.kernels.paged.ops import cute_decode_runs, cute_prefill_runs
from flamia_serve.numerics.exp2 import EXP_MODES
from flamia_serve.numerics.kv_pages import KVPageFormat, region_view

HQ, HKV, HEAD_DIM, PAGE = 32, 8, 128, 16
#: cache formats the kernel benchmarks measure (the vLLM-only ones are in vllm_throughput.py)
BENCH_DTYPES = ("bf16", "fp8", "nvfp4")


@dataclass
class ServingBatch:
    """``B`` sequences of ``seq_lens`` tokens (the last ``q_lens`` new) in random pages; K/V in
    FlashInfer's NHD BF16 layout and in each FLAMIA cache format."""

    q: torch.Tensor
    q_lens: list[int]
    seq_lens_list: list[int]
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    kv_nhd: torch.Tensor  # [pages, 2, PAGE, HKV, D] bf16
    caches: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def batch(self) -> int:
        return len(self.q_lens)

    def kv_bytes(self, dtype: str) -> int:
        """Bytes of K and V read for the batch's tokens in a cache format."""
        slot = {"fi-fp8": HEAD_DIM, **{d: KVPageFormat(d, HEAD_DIM).slot_bytes
                                        for d in BENCH_DTYPES}}[dtype]  # fmt: skip
        return 2 * sum(self.seq_lens_list) * HKV * slot


def make_serving_batch(q_lens: list[int], seq_lens: list[int], device: torch.device,
                       seed: int = 0) -> ServingBatch:  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(seed)
    pages = [math.ceil(n / PAGE) for n in seq_lens]
    total_pages = sum(pages)
    order = torch.randperm(total_pages, device=device, generator=gen).int()
    table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32, device=device)
    start = 0
    for i, p in enumerate(pages):
        table[i, :p] = order[start : start + p]
        start += p
    kv = torch.randn(total_pages, 2, PAGE, HKV, HEAD_DIM, device=device, generator=gen,
                     dtype=torch.bfloat16)  # fmt: skip
    q = torch.randn(sum(q_lens), HQ, HEAD_DIM, device=device, generator=gen,
                    dtype=torch.bfloat16) * 2  # fmt: skip
    qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=device)
    batch = ServingBatch(q, q_lens, seq_lens, table,
                         torch.tensor(seq_lens, dtype=torch.int32, device=device), qsl, kv)
    for dtype in BENCH_DTYPES:
        fmt = KVPageFormat(dtype, HEAD_DIM)
        cache = torch.zeros(fmt.cache_shape(total_pages, PAGE, HKV), dtype=torch.uint8,
                            device=device)  # fmt: skip
        # every page in order: slot = page * PAGE + offset
        flat = kv.permute(1, 0, 2, 3, 4).reshape(2, -1, HKV, HEAD_DIM)
        slots = torch.arange(flat.shape[1], device=device, dtype=torch.int64)
        for lo in range(0, flat.shape[1], 1 << 20):
            sl = slice(lo, lo + (1 << 20))
            write_kv_cache(cache, flat[0, sl], flat[1, sl], slots[sl], fmt)
        batch.caches[dtype] = cache
    return batch


@dataclass
class Fp8Prefill:
    """A serving batch with its fp8-cache prefill planned (the CuTe path's per-batch work)."""

    batch: ServingBatch
    plan: PagedPlan
    schedule: PrefillSchedule
    decodes: int
    keys: int


def fp8_prefill(new: list[int], cached: list[int], device: torch.device, seed: int) -> Fp8Prefill:
    """``make_serving_batch`` of sequences with ``new`` tokens after ``cached`` ones, planned
    for the fp8 cache's CuTe prefill (``plan_prefill_schedule``; asserts that it runs)."""
    lens = [c + n for c, n in zip(cached, new, strict=True)]
    batch = make_serving_batch(new, lens, device, seed=seed)
    decodes = leading_decodes(batch.query_start_loc)
    keys = sum(lens[decodes:])
    plan = plan_paged_counts(KVPageFormat("fp8", HEAD_DIM), HQ, HKV, num_seqs=batch.batch,
                             num_tokens=batch.q.shape[0], num_decodes=decodes,
                             num_decode_tokens=decodes, max_seq_len=max(lens), device=device,
                             prefill_keys=keys)  # fmt: skip
    schedule = plan_prefill_schedule(plan, batch.seq_lens, batch.query_start_loc)
    assert schedule is not None, plan.prefill
    return Fp8Prefill(batch, plan, schedule, decodes, keys)


def planned_call(batch: ServingBatch, dtype: str, *, exp_mode: str = "exact",
                 prefill_keys: int = 0, decode_config: PagedConfig | None = None,
                 ) -> Callable[[], torch.Tensor]:  # fmt: skip
    """One layer's attention as the vLLM backend runs it: the batch planned once (the host
    plan and, with ``prefill_keys``, the CuTe prefill's GPU schedule; as FlashInfer's
    ``plan()`` stays outside its timed ``run()``), the call only launches. Without
    ``prefill_keys`` the prefills run on Triton."""
    fmt = KVPageFormat(dtype, HEAD_DIM)
    num_decodes = leading_decodes(batch.query_start_loc)
    plan = plan_paged_counts(fmt, HQ, HKV, num_seqs=batch.batch, num_tokens=batch.q.shape[0],
                             num_decodes=num_decodes, num_decode_tokens=num_decodes,
                             max_seq_len=max(batch.seq_lens_list), device=batch.q.device,
                             decode_config=decode_config, prefill_keys=prefill_keys)  # fmt: skip
    schedule = plan_prefill_schedule(plan, batch.seq_lens, batch.query_start_loc)
    workspace = PagedWorkspace.allocate(plan.workspace_rows, HQ, HEAD_DIM, batch.q.device)
    out = torch.empty_like(batch.q)
    qk_scale = HEAD_DIM**-0.5 * math.log2(math.e)

    def call() -> torch.Tensor:
        return run_paged_attention(
            batch.q, batch.caches[dtype], batch.block_table, batch.seq_lens,
            batch.query_start_loc, plan, out, qk_scale=qk_scale, exp_mode=exp_mode,  # type: ignore[arg-type]
            workspace=workspace, prefill_schedule=schedule,
        )  # fmt: skip

    return call


def flamia_impls(batch: ServingBatch, modes: tuple[str, ...] = EXP_MODES
                 ) -> dict[str, tuple[str, Callable[[], torch.Tensor]]]:  # fmt: skip
    """``flamia-<cache>-<exp mode>`` -> (cache dtype, call) with no host synchronisation
    (:func:`planned_call`), and the Triton kernels beside the CuTe ones where those are the
    default (``flamia-<cache>-triton-decode`` / ``flamia-fp8-triton-prefill``), and the CuTe
    prefill with Q quantized by its own launch (``flamia-fp8-q-launch``)."""
    num_decodes = leading_decodes(batch.query_start_loc)
    prefill_keys = sum(batch.seq_lens_list[num_decodes:])
    impls = {}
    for dtype in BENCH_DTYPES:
        for mode in modes:
            call = planned_call(batch, dtype, exp_mode=mode, prefill_keys=prefill_keys)
            impls[f"flamia-{dtype}-{mode}"] = (dtype, call)
    for dtype in ("nvfp4", "fp8"):  # the Triton decode beside the CuTe one (the default)
        fmt = KVPageFormat(dtype, HEAD_DIM)
        if not num_decodes or dtype not in BENCH_DTYPES or not cute_decode_runs(
                fmt, HQ, HKV, batch.q.device):  # fmt: skip
            continue
        call = planned_call(batch, dtype, prefill_keys=prefill_keys,
                            decode_config=triton_decode_config(fmt, HQ, HKV))  # fmt: skip
        impls[f"flamia-{dtype}-triton-decode"] = (dtype, call)
    if prefill_keys and cute_prefill_runs(KVPageFormat("fp8", HEAD_DIM), batch.q.device):
        impls["flamia-fp8-triton-prefill"] = ("fp8", planned_call(batch, "fp8"))
        call = planned_call(batch, "fp8", prefill_keys=prefill_keys)
        impls["flamia-fp8-q-launch"] = ("fp8", _with_q_launch(call))
    return impls


def _with_q_launch(call: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``call`` with the CuTe prefill's Q quantized by a launch of its own (as before the
    forward quantized it, ``paged.ops.CUTE_PREFILL_DEFERS_Q``): the same codes, timed beside
    the default."""

    def run() -> torch.Tensor:
        saved = paged_ops.CUTE_PREFILL_DEFERS_Q
        paged_ops.CUTE_PREFILL_DEFERS_Q = False
        try:
            return call()
        finally:
            paged_ops.CUTE_PREFILL_DEFERS_Q = saved

    return run


def flashinfer_nvfp4_cache(batch: ServingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Our NVFP4 bytes in FlashInfer's NHD layout: codes ``[pages, 2, PAGE, HKV, D/2]`` uint8
    and E4M3 scales ``[pages, 2, PAGE, HKV, D/16]``."""
    codes, scales = region_view(batch.caches["nvfp4"], KVPageFormat("nvfp4", HEAD_DIM))
    codes = torch.stack(codes, dim=1)  # [pages, 2, HKV, PAGE, D/2]
    return (codes.permute(0, 1, 3, 2, 4).contiguous(),
            scales.permute(0, 1, 3, 2, 4).contiguous().view(torch.float8_e4m3fn))  # fmt: skip


def flashinfer_page_table(batch: ServingBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's paged-KV description of ``batch``: ``(indptr [B+1], indices, last page
    lengths [B])``, int32 on the batch's device: each sequence's ``ceil(len / PAGE)`` pages
    of its block table, the last one holding ``len - (pages - 1)·PAGE`` tokens."""
    dev = batch.block_table.device
    pages = [-(-n // PAGE) for n in batch.seq_lens_list]
    indptr = torch.tensor([0, *itertools.accumulate(pages)], dtype=torch.int32, device=dev)
    indices = torch.cat([batch.block_table[i, :p] for i, p in enumerate(pages)]).contiguous()
    last = torch.tensor([n - (p - 1) * PAGE for n, p in zip(batch.seq_lens_list, pages,
                                                            strict=True)],
                        dtype=torch.int32, device=dev)  # fmt: skip
    return indptr, indices.to(torch.int32), last


def exact_attention(batch: ServingBatch) -> torch.Tensor:
    """FP32 attention of the new tokens over the BF16 K/V (causal within the new tokens)."""
    out = torch.empty(batch.q.shape, dtype=torch.float32, device=batch.q.device)
    starts = batch.query_start_loc.tolist()
    for s, length in enumerate(batch.seq_lens_list):
        pages = batch.block_table[s, : math.ceil(length / PAGE)].long()
        kv = batch.kv_nhd[pages].permute(1, 0, 2, 3, 4).reshape(2, -1, HKV, HEAD_DIM)
        k = kv[0, :length].float().repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)
        v = kv[1, :length].float().repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)
        a, b = starts[s], starts[s + 1]
        q = batch.q[a:b].float().transpose(0, 1)
        n = b - a
        mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out[a:b] = o.transpose(0, 1)
    return out


def import_flashinfer() -> Any:
    """The ``flashinfer`` module, or None (baselines are then left out, with a message)."""
    try:
        import flashinfer
    except ImportError as exc:
        print(f"flashinfer baselines skipped: {exc}")
        return None
    return flashinfer


def measure(workload: str, pass_name: str, batch: ServingBatch,
            impls: dict[str, tuple[str, Callable[[], torch.Tensor]]], *, impl_filter: str = "",
            quick: bool = False, clean_l2: bool = False, rounds: int = 1,
            ) -> list[dict]:  # fmt: skip
    """Time every impl (``impl_filter``: comma-separated substrings, one must match) on
    ``batch`` (``clean_l2``: also with L2 flushed by reads, ``ms_clean_l2``; see
    ``common.time_ms``) and compare its output with
    FP32 attention (``cos_vs_exact``) and, for flamia impls, with the same cache's exact-exp
    output (``cos_vs_exact_exp``). One row per impl; the caller adds its rates. ``rounds``:
    the impls timed that many times, in reverse order every other round, medians
    (``common.in_rounds``): the impl timed first after a long call may run slower."""
    exact = exact_attention(batch)
    exact_exp: dict[str, torch.Tensor] = {}
    rows = []
    for impl, (fmt, call) in impls.items():
        if impl_filter and not any(f in impl for f in impl_filter.split(",")):
            continue
        out = call()
        if impl.endswith("-exact"):
            exact_exp[fmt] = out
        own = impl.startswith("flamia") and fmt in exact_exp
        rows.append({"workload": workload, "pass": pass_name, "impl": impl,
                     "kv_format": fmt, "cos_vs_exact": cos_sim(out, exact),
                     "cos_vs_exact_exp": cos_sim(out, exact_exp[fmt]) if own else None})
    def timed(row: dict) -> dict:
        call = impls[row["impl"]][1]
        t = graph_time(call, rep_ms=50 if quick else 200)
        if clean_l2:
            t["ms_clean_l2"] = graph_time(call, rep_ms=50 if quick else 200, l2="clean")["ms"]
        return {**row, **t}

    return in_rounds(lambda some: [timed(row) for row in some], rows, rounds)


def cos_sim(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(),
                                                       dim=0))  # fmt: skip
