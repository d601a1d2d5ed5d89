"""Every vLLM import of the backend, in one place (vLLM 0.26.0's module layout)."""

from __future__ import annotations

from vllm.config import VllmConfig, get_current_vllm_config
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.attention.backends.utils import get_num_attention_heads_from_layers
from vllm.v1.kv_cache_interface import AttentionSpec, KVQuantMode

__all__ = [
    "AttentionBackend",
    "AttentionBackendEnum",
    "AttentionCGSupport",
    "AttentionImpl",
    "AttentionLayer",
    "AttentionMetadataBuilder",
    "AttentionSpec",
    "AttentionType",
    "CommonAttentionMetadata",
    "DeviceCapability",
    "KVQuantMode",
    "VllmConfig",
    "get_current_vllm_config",
    "get_num_attention_heads_from_layers",
    "register_backend",
]
