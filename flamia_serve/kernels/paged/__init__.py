"""Serving kernels over the paged KV cache (cache write, paged attention): validating entry
points, and plan + run launchers for callers that plan once per batch (the vLLM backend)."""

from flamia_serve.kernels.paged.ops import (
    CUTE_PREFILL_EXP_MODES,
    PagedConfig,
    PagedLayout,
    PagedPlan,
    PagedWorkspace,
    PrefillSchedule,
    decode_splits,
    default_configs,
    leading_decodes,
    max_workspace_rows,
    paged_attention,
    plan_paged,
    plan_paged_counts,
    plan_prefill_schedule,
    run_paged_attention,
    run_write_kv_cache,
    triton_decode_config,
    write_kv_cache,
)

__all__ = [
    "CUTE_PREFILL_EXP_MODES",
    "PagedConfig",
    "PagedLayout",
    "PagedPlan",
    "PagedWorkspace",
    "PrefillSchedule",
    "decode_splits",
    "default_configs",
    "leading_decodes",
    "max_workspace_rows",
    "paged_attention",
    "plan_paged",
    "plan_paged_counts",
    "plan_prefill_schedule",
    "run_paged_attention",
    "run_write_kv_cache",
    "triton_decode_config",
    "write_kv_cache",
]
