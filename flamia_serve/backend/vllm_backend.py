"""FLAMIA as a vLLM 0.26 attention backend: Backend, Metadata, MetadataBuilder, Impl.

* ``FlamiaAttentionBackend`` — capabilities as data (``validate_configuration`` names what
  is supported when it rejects), the KV cache shape of each format (``numerics.kv_pages``,
  byte-equal to vLLM's page budget), kernel block sizes.
* ``FlamiaMetadataBuilder.build`` — once per step: a :class:`~flamia_serve.kernels.paged.
  PagedPlan` from host-side batch facts (``query_start_loc_cpu``, ``max_seq_len``): the
  decode / prefill split, split-K count and grid sizes; a persistent split-K workspace
  (allocated once, so full CUDA graphs of decode batches replay on fixed addresses).
* ``FlamiaAttentionImpl`` — ``do_kv_cache_update`` quantizes new K/V into their slots
  (slot −1 = padding, skipped), ``forward`` launches with the step's plan: no host reads,
  no checks, no allocations. ``attn_metadata is None`` (vLLM's memory-profiling run)
  returns zeros.

Cache dtypes (``--kv-cache-dtype``): ``auto`` / ``bfloat16`` / ``float16`` (16-bit cache),
``fp8_per_token_head`` (E4M3 + per-key power-of-two exponent), ``nvfp4`` (E2M1 + E4M3 per
16), ``fp8`` / ``fp8_e4m3`` (E4M3 with the layer's static ``k_scale`` / ``v_scale``).
``FLAMIA_EXP_MODE`` = ``exact`` (default) / ``schraudolph`` / ``mitchell`` picks the
kernels' exponential (DESIGN N9).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import ClassVar

import torch

from flamia_serve.backend import BACKEND_NAME
from flamia_serve.backend._vllm import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionSpec,
    AttentionType,
    CommonAttentionMetadata,
    DeviceCapability,
    KVQuantMode,
    VllmConfig,
    get_current_vllm_config,
    get_num_attention_heads_from_layers,
)
from flamia_serve.kernels.paged import (
    CUTE_PREFILL_EXP_MODES,
    PagedPlan,
    PagedWorkspace,
    PrefillSchedule,
    max_workspace_rows,
    plan_paged,
    plan_prefill_schedule,
    run_paged_attention,
    run_write_kv_cache,
)
from flamia_serve.numerics.exp2 import EXP_MODES, ExpMode, check_exp_mode
from flamia_serve.numerics.kv_pages import (
    VLLM_KV_CACHE_DTYPES,
    KVCacheFormat,
    KVPageFormat,
    format_for_vllm,
    static_inverse,
)

SUPPORTED_HEAD_SIZES = (64, 128, 256)
SUPPORTED_BLOCK_SIZES = (16, 32, 64)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
#: lowest compute capability (major * 10 + minor): the kernels convert E4M3 in hardware
#: (sm_89+); only sm_90 (H200) is tested
MIN_CAPABILITY = 90


def _names(values: object) -> str:
    return ", ".join(str(v).removeprefix("torch.") for v in values)  # type: ignore[attr-defined]


def format_of_spec(spec: AttentionSpec) -> KVCacheFormat:
    """The cache format vLLM allocated a layer group for (its KV spec's quant mode)."""
    mode = spec.kv_quant_mode
    if mode == KVQuantMode.NONE:
        return format_for_vllm("auto", spec.dtype)
    by_mode = {
        KVQuantMode.FP8_PER_TOKEN_HEAD: KVCacheFormat.FP8,
        KVQuantMode.NVFP4: KVCacheFormat.NVFP4,
        KVQuantMode.FP8_PER_TENSOR: KVCacheFormat.FP8_STATIC,
    }
    if mode not in by_mode:
        raise ValueError(f"FLAMIA serves no KV cache quantization mode {mode.name}; "
                         f"supported kv_cache_dtype: {_names(VLLM_KV_CACHE_DTYPES)}")  # fmt: skip
    return by_mode[mode]


class FlamiaAttentionBackend(AttentionBackend):
    """``--attention-backend flamia``: FLAMIA's paged kernels for decoder self-attention."""

    accept_output_buffer: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = list(SUPPORTED_DTYPES)
    supported_kv_cache_dtypes: ClassVar[list] = list(VLLM_KV_CACHE_DTYPES)  # type: ignore[type-arg]
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[FlamiaAttentionImpl]:
        return FlamiaAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[FlamiaMetadataBuilder]:
        return FlamiaMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int]:  # type: ignore[override]
        return list(SUPPORTED_BLOCK_SIZES)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(SUPPORTED_HEAD_SIZES)

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        """``[num_blocks, 2, Hkv, block_size · slot_elements]`` in the KV spec's element type
        (16-bit for ``auto`` / ``bfloat16`` / ``float16``, uint8 otherwise): the uint8 layout
        of ``numerics.kv_pages`` seen through that type."""
        fmt = format_for_vllm(cache_dtype_str, torch.bfloat16)
        region = KVPageFormat(fmt, head_size).region_bytes(block_size)
        return (num_blocks, 2, num_kv_heads, region // 2 if fmt.is_16bit else region)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return capability.to_int() >= MIN_CAPABILITY

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def validate_configuration(cls, **config: object) -> list[str]:  # type: ignore[override]
        """vLLM's checks, with each reason naming the value and what FLAMIA supports."""
        reasons = super().validate_configuration(**config)  # type: ignore[arg-type]
        cap = config.get("device_capability")
        cap_name = f"sm_{cap.to_int()}" if isinstance(cap, DeviceCapability) else cap
        attn = config.get("attn_type")
        detail = {
            "head_size not supported": f"head_size {config.get('head_size')} not supported "
            f"(supported: {_names(SUPPORTED_HEAD_SIZES)})",
            "dtype not supported": f"dtype {config.get('dtype')} not supported (supported: "
            f"{_names(SUPPORTED_DTYPES)})",
            "kv_cache_dtype not supported": f"kv_cache_dtype {config.get('kv_cache_dtype')!r} "
            f"not supported (supported: {_names(VLLM_KV_CACHE_DTYPES)})",
            "block_size not supported": f"block_size {config.get('block_size')} not supported "
            f"(supported: {_names(SUPPORTED_BLOCK_SIZES)} or multiples)",
            "compute capability not supported": f"compute capability {cap_name} not supported "
            f"(supported: sm_{MIN_CAPABILITY} and newer; tested on sm_90)",
            f"attention type {attn} not supported": "attention type "
            f"{getattr(attn, 'value', attn)} not supported (supported: decoder self-attention)",
        }
        return [f"FLAMIA: {detail.get(r, r)}" for r in reasons]


@dataclass
class FlamiaMetadata:
    """One step's attention metadata: vLLM's batch tensors (views of its persistent
    buffers) plus the host-built launch plan, the builder's workspace and, where the
    fp8 cache's prefills run on the CuTe kernel, their GPU schedule (built once per step)."""

    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    plan: PagedPlan
    workspace: PagedWorkspace
    prefill_schedule: PrefillSchedule | None = None


class FlamiaMetadataBuilder(AttentionMetadataBuilder[FlamiaMetadata]):
    """Plans each step on the host (decodes first: ``reorder_batch_threshold = 1``).

    CUDA graphs: full graphs for pure single-token decode batches
    (``UNIFORM_SINGLE_TOKEN_DECODE``); mixed and prefill batches run the attention eagerly
    between piecewise graphs. A captured decode graph keeps the split-K count of its capture,
    sized for ``max_model_len`` so it is valid for every replay.
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = (
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )
    reorder_batch_threshold: int | None = 1

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        model = vllm_config.model_config
        self.heads_q = get_num_attention_heads_from_layers(
            vllm_config, layer_names
        ) or model.get_num_attention_heads(vllm_config.parallel_config)
        self.heads_kv = kv_cache_spec.num_kv_heads
        self.fmt = KVPageFormat(format_of_spec(kv_cache_spec), kv_cache_spec.head_size)
        self.max_model_len = model.max_model_len
        max_seqs = self.max_seqs = vllm_config.scheduler_config.max_num_seqs
        rows = max_workspace_rows(self.fmt, self.heads_q, self.heads_kv, max_seqs,
                                  self.max_model_len, device)  # fmt: skip
        self.workspace = PagedWorkspace.allocate(rows, self.heads_q, self.fmt.head_dim, device)
        self._capturing = False
        # the CuTe prefill runs neither sliding windows nor Schraudolph: no schedule for them
        self._cute_prefill_possible = getattr(kv_cache_spec, "sliding_window", None) is None \
            and _exp_mode() in CUTE_PREFILL_EXP_MODES  # fmt: skip

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> FlamiaMetadata:
        cm = common_attn_metadata
        max_seq_len = self.max_model_len if self._capturing else cm.max_seq_len
        # host key counts (exact for prefill rows) size the CuTe prefill's operands; graph
        # captures keep the Triton prefill
        seq_lens_host = None if self._capturing else getattr(cm, "seq_lens_cpu_upper_bound",
                                                             None)  # fmt: skip
        plan = plan_paged(self.fmt, self.heads_q, self.heads_kv, cm.query_start_loc_cpu,
                          max_seq_len, num_tokens=cm.num_actual_tokens, device=self.device,
                          seq_lens_host=seq_lens_host)  # fmt: skip
        return FlamiaMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
            query_start_loc=cm.query_start_loc,
            seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            plan=plan,
            workspace=self.workspace,
            prefill_schedule=plan_prefill_schedule(plan, cm.seq_lens, cm.query_start_loc,
                                                   self.max_seqs)
            if self._cute_prefill_possible else None,
        )

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata
                                    ) -> FlamiaMetadata:  # fmt: skip
        self._capturing = True
        try:
            return self.build(0, common_attn_metadata)
        finally:
            self._capturing = False


class FlamiaAttentionImpl(AttentionImpl[FlamiaMetadata]):
    """Decoder self-attention through FLAMIA's paged kernels."""

    supports_dcp: bool = False
    can_return_lse_for_decode: bool = False
    supports_quant_query_input: bool = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        **unsupported: object,
    ) -> None:
        if attn_type != AttentionType.DECODER:
            raise ValueError(f"FLAMIA serves decoder self-attention only, got attn_type "
                             f"{attn_type!r}")  # fmt: skip
        if alibi_slopes is not None:
            raise ValueError("FLAMIA does not support ALiBi (alibi_slopes)")
        if logits_soft_cap:
            raise ValueError(f"FLAMIA does not support logits_soft_cap ({logits_soft_cap})")
        if sinks is not None:
            raise ValueError("FLAMIA does not support attention sinks (sinks)")
        extra = {k: v for k, v in unsupported.items() if v not in (None, False, -1)}
        if extra:
            raise ValueError(f"FLAMIA does not support the attention options {sorted(extra)}")
        if head_size not in SUPPORTED_HEAD_SIZES:
            raise ValueError(f"FLAMIA: head_size {head_size} not supported (supported: "
                             f"{_names(SUPPORTED_HEAD_SIZES)})")  # fmt: skip
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads "
                             f"{self.num_kv_heads}")  # fmt: skip
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.fmt = KVPageFormat(format_for_vllm(kv_cache_dtype, _model_dtype()), head_size)
        self.static = self.fmt.dtype is KVCacheFormat.FP8_STATIC
        self.exp_mode = _exp_mode()
        self.qk_scale = self.scale * math.log2(math.e)
        self._inverse: dict[float, float] = {}
        self._cache_checked = False

    def _inv(self, layer: AttentionLayer, name: str) -> float:
        """``static_inverse`` of the layer's ``k_scale`` / ``v_scale`` (cached by value); a
        bad scale raises naming the layer and the scale."""
        scale = getattr(layer, f"_{name}_float")
        inv = self._inverse.get(scale)
        if inv is None:
            where = getattr(layer, "layer_name", None) or type(layer).__name__
            inv = self._inverse[scale] = static_inverse(scale, f"{where}: {name}")
        return inv

    def _bytes(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The cache as the kernels' uint8 ``[blocks, 2, Hkv, page · slot_bytes]`` tensor."""
        if not self._cache_checked:
            if not kv_cache.is_contiguous():
                raise ValueError("FLAMIA needs a contiguous KV cache (no padded pages), got "
                                 f"strides {kv_cache.stride()}")  # fmt: skip
            self._cache_checked = True
        return kv_cache if kv_cache.dtype == torch.uint8 else kv_cache.view(torch.uint8)

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Quantize the step's new K/V ``[tokens, Hkv, d]`` into their slots (−1 skipped)."""
        if kv_cache.numel() == 0:
            return
        n = min(key.shape[0], slot_mapping.shape[0])
        k_inv = v_inv = 1.0
        if self.static:
            k_inv, v_inv = self._inv(layer, "k_scale"), self._inv(layer, "v_scale")
        run_write_kv_cache(self._bytes(kv_cache), key, value, slot_mapping, self.fmt, n,
                           k_inv_scale=k_inv, v_inv_scale=v_inv)  # fmt: skip

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: FlamiaMetadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``output[:num_actual_tokens]`` ``[T, Hq, d]`` = attention of ``query`` over the
        cache (K/V already written by ``do_kv_cache_update``)."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("FLAMIA does not fuse output quantization")
        if attn_metadata is None:  # vLLM's memory-profiling run
            return output.fill_(0)
        md = attn_metadata
        qk_scale, v_scale = self.qk_scale, 1.0
        if self.static:
            qk_scale, v_scale = qk_scale * layer._k_scale_float, layer._v_scale_float
        run_paged_attention(query, self._bytes(kv_cache), md.block_table, md.seq_lens,
                            md.query_start_loc, md.plan, output, qk_scale=qk_scale,
                            window=self.sliding_window, exp_mode=self.exp_mode,
                            v_scale=v_scale, workspace=md.workspace,
                            prefill_schedule=md.prefill_schedule)  # fmt: skip
        return output


def _exp_mode() -> ExpMode:
    """The serving exponential, from ``FLAMIA_EXP_MODE`` (default ``exact``); a bad value
    raises naming the variable."""
    value = os.environ.get("FLAMIA_EXP_MODE", "exact")
    try:
        return check_exp_mode(value)
    except ValueError:
        raise ValueError(f"FLAMIA_EXP_MODE must be one of {EXP_MODES}, got {value!r}") from None


def _model_dtype() -> torch.dtype:
    """The model's dtype from vLLM's current config (the default dtype outside one)."""
    try:
        model = get_current_vllm_config().model_config
    except Exception:  # no current config (direct construction)
        model = None
    dtype = getattr(model, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else torch.get_default_dtype()
