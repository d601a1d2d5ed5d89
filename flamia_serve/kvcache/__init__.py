"""Quantized paged KV caches (DESIGN N10): allocation, writes and attention through kernels."""

from flamia_serve.kvcache.cache import PagedKVCache
from flamia_serve.numerics.kv_pages import (
    KV_CACHE_DTYPES,
    VLLM_KV_CACHE_DTYPES,
    KVCacheFormat,
    KVPageFormat,
    format_for_vllm,
)

__all__ = [
    "KV_CACHE_DTYPES",
    "VLLM_KV_CACHE_DTYPES",
    "KVCacheFormat",
    "KVPageFormat",
    "PagedKVCache",
    "format_for_vllm",
]
