"""Serving kernels over the paged KV cache (cache write, paged attention)."""

from flamia_serve.kernels.paged.ops import (
    PagedConfig,
    PagedLayout,
    decode_splits,
    leading_decodes,
    paged_attention,
    write_kv_cache,
)

__all__ = [
    "PagedConfig",
    "PagedLayout",
    "decode_splits",
    "leading_decodes",
    "paged_attention",
    "write_kv_cache",
]
