"""The vLLM backend on a CPU machine: selection through vLLM's CLI parser and engine config,
KV cache bytes against vLLM's page budgets, the builder's batch plans, clear rejections, and
``do_kv_cache_update`` + ``forward`` against the reference twins (Triton interpreter).

Needs vLLM 0.26.0 (``pip install --no-deps -r .ci/vllm-cpu-requirements.txt``); skipped
without it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import math
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="needs vLLM 0.26 (.ci/vllm-cpu-requirements.txt)")

from tests.backend import vllm_cpu  # noqa: E402

vllm_cpu.install((9, 0))

from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.model_executor.layers.attention import Attention  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402
from vllm.utils.torch_utils import get_dtype_size, set_default_torch_dtype  # noqa: E402
from vllm.v1.attention import selector  # noqa: E402
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.backends.utils import split_decodes_and_prefills  # noqa: E402

import flamia_serve.backend as fb  # noqa: E402
from flamia_serve.backend.vllm_backend import (  # noqa: E402
    FlamiaAttentionBackend,
    FlamiaAttentionImpl,
    FlamiaMetadataBuilder,
)
from flamia_serve.numerics.kv_pages import KVCacheFormat, KVPageFormat  # noqa: E402
from flamia_serve.reference import paged as ref  # noqa: E402
from tests.kernels.paged_cases import make_batch  # noqa: E402
from tests.kernels.test_paged import _assert_close  # noqa: E402

fb.register()

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64
#: vLLM cache dtype -> the FLAMIA format it selects for a BF16 model
SERVED = {
    "auto": KVCacheFormat.BF16,
    "bfloat16": KVCacheFormat.BF16,
    "fp8_per_token_head": KVCacheFormat.FP8,
    "nvfp4": KVCacheFormat.NVFP4,
    "fp8": KVCacheFormat.FP8_STATIC,
    "fp8_e4m3": KVCacheFormat.FP8_STATIC,
}


@functools.cache
def _model_dir(tmp: str, **kw: object) -> Path:
    return vllm_cpu.write_model_dir(Path(tmp) / "_".join(f"{k}{v}" for k, v in kw.items()),
                                    **kw)  # type: ignore[arg-type]  # fmt: skip


@functools.cache
def engine_config(kv_cache_dtype: str, *extra: str, dtype: str = "bfloat16"):
    """vLLM's engine config built from a real command line (``vllm serve``'s engine args)."""
    import tempfile

    model = _model_dir(tempfile.gettempdir() + "/flamia_vllm_cpu", dtype=dtype)
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", str(model), "--attention-backend", "FlAmIa",
                              "--kv-cache-dtype", kv_cache_dtype, "--load-format", "dummy",
                              "--skip-tokenizer-init", "--max-model-len", "2048",
                              *extra])  # fmt: skip
    return EngineArgs.from_cli_args(args).create_engine_config()


_layer_count = 0


def make_layer(cfg, **kw: object) -> Attention:
    """A real vLLM ``Attention`` layer built under ``cfg`` (selects its backend)."""
    global _layer_count
    _layer_count += 1
    dtype = cfg.model_config.dtype
    with set_current_vllm_config(cfg), set_default_torch_dtype(dtype):
        return Attention(num_heads=kw.pop("num_heads", HEADS),  # type: ignore[arg-type]
                         head_size=kw.pop("head_size", HEAD_DIM),  # type: ignore[arg-type]
                         scale=HEAD_DIM**-0.5, num_kv_heads=KV_HEADS,
                         cache_config=cfg.cache_config,
                         prefix=f"model.layers.{_layer_count}.self_attn.attn",
                         **kw)  # type: ignore[arg-type]  # fmt: skip


def test_register_is_idempotent_and_adds_the_alias() -> None:
    fb.register()
    fb.register()
    assert AttentionBackendEnum["FLAMIA"] is AttentionBackendEnum.CUSTOM
    assert AttentionBackendEnum.CUSTOM.get_path() == fb.BACKEND_CLASS
    assert AttentionBackendEnum.CUSTOM.get_class() is FlamiaAttentionBackend
    # the layer maps the backend back by name: get_name() must resolve to CUSTOM
    assert AttentionBackendEnum[FlamiaAttentionBackend.get_name()] is AttentionBackendEnum.CUSTOM
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    flamia = [ep for ep in eps if ep.name == "flamia"]
    if flamia:  # installed with the pyproject entry point
        assert flamia[0].load() is fb.register


@pytest.mark.parametrize("kv_cache_dtype", sorted(SERVED))
def test_cli_selects_flamia_and_cache_bytes_match_vllm_budget(kv_cache_dtype: str) -> None:
    """``--attention-backend flamia`` (any case) parses, lands in the engine config, makes
    every attention layer pick FLAMIA, and the cache shape's bytes equal vLLM's page size."""
    cfg = engine_config(kv_cache_dtype)
    assert cfg.attention_config.backend is AttentionBackendEnum.CUSTOM
    layer = make_layer(cfg)
    assert layer.attn_backend is FlamiaAttentionBackend
    assert isinstance(layer.impl, FlamiaAttentionImpl)
    assert layer.impl.fmt == KVPageFormat(SERVED[kv_cache_dtype], HEAD_DIM)
    spec = layer.get_kv_cache_spec(cfg)
    blocks = 7
    shape = FlamiaAttentionBackend.get_kv_cache_shape(blocks, spec.block_size, KV_HEADS,
                                                      HEAD_DIM, kv_cache_dtype)  # fmt: skip
    nbytes = math.prod(shape) * get_dtype_size(spec.dtype)
    assert nbytes == blocks * spec.page_size_bytes
    fmt = KVPageFormat(SERVED[kv_cache_dtype], HEAD_DIM)
    assert nbytes == blocks * 2 * KV_HEADS * fmt.region_bytes(spec.block_size)
    budget = {"auto": 2 * HEAD_DIM, "bfloat16": 2 * HEAD_DIM, "fp8": HEAD_DIM,
              "fp8_e4m3": HEAD_DIM, "fp8_per_token_head": HEAD_DIM + 4,
              "nvfp4": HEAD_DIM // 2 + HEAD_DIM // 16}[kv_cache_dtype]  # fmt: skip
    assert fmt.slot_bytes == budget


@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_cache_shape_bytes_for_every_served_dtype(head_size: int, block_size: int) -> None:
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    cfg = engine_config("auto")
    for name, fmt in SERVED.items():
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=8, head_size=head_size,
                                 dtype=kv_cache_dtype_str_to_dtype(name, cfg.model_config),
                                 kv_quant_mode=get_kv_quant_mode(name))  # fmt: skip
        shape = FlamiaAttentionBackend.get_kv_cache_shape(3, block_size, 8, head_size, name)
        assert math.prod(shape) * get_dtype_size(spec.dtype) == 3 * spec.page_size_bytes, name
        assert spec.page_size_bytes == 2 * 8 * KVPageFormat(fmt, head_size).region_bytes(
            block_size)


def _common(new: list[int], seq_lens: list[int], *, pad_reqs: int = 0) -> CommonAttentionMetadata:
    """CPU batch metadata as vLLM's model runner builds it (decodes first)."""
    new = new + [0] * pad_reqs
    seq_lens = seq_lens + [0] * pad_reqs
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    pages = max(-(-max(seq_lens) // 16), 1)
    table = torch.arange(len(new) * pages, dtype=torch.int32).view(len(new), pages)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=lens,
        num_reqs=len(new), num_actual_tokens=int(qsl[-1]), max_query_len=max(new),
        max_seq_len=max(seq_lens), block_table_tensor=table,
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
    )  # fmt: skip


def _builder(kv_cache_dtype: str = "nvfp4") -> FlamiaMetadataBuilder:
    cfg = engine_config(kv_cache_dtype)
    layer = make_layer(cfg)
    spec = layer.get_kv_cache_spec(cfg)
    with set_current_vllm_config(cfg):
        return FlamiaMetadataBuilder(spec, [layer.layer_name], cfg, torch.device("cpu"))


@pytest.mark.parametrize(
    ("new", "seq_lens", "pad_reqs"),
    [
        ([1, 1, 1, 7, 20], [40, 9, 100, 30, 20], 0),  # mixed: 3 decodes, 2 prefills
        ([1] * 6, [5, 17, 300, 1, 2, 64], 0),  # decode only
        ([9, 1, 1], [9, 10, 11], 0),  # a prefill first: no decode launch
        ([1, 1, 1], [3, 4, 5], 5),  # padded uniform decode batch (CUDA graph sizes)
        ([1, 1, 33], [8, 1500, 33], 0),  # chunk of a long prompt after two decodes
    ],
)
def test_builder_splits_batches_like_vllm(new: list[int], seq_lens: list[int],
                                          pad_reqs: int) -> None:  # fmt: skip
    builder = _builder()
    assert builder.reorder_batch_threshold == 1
    cm = _common(new, seq_lens, pad_reqs=pad_reqs)
    md = builder.build(0, cm)
    plan = md.plan
    num_decodes, num_prefills, decode_tokens, prefill_tokens = split_decodes_and_prefills(cm)
    assert (plan.num_decodes, plan.num_seqs - plan.num_decodes) == (num_decodes, num_prefills)
    assert plan.num_decode_tokens == decode_tokens
    assert plan.num_tokens - plan.num_decode_tokens == prefill_tokens
    assert (plan.prefill_programs > 0) == (num_prefills > 0)
    assert md.workspace is builder.workspace and md.workspace.fits(plan)
    assert md.seq_lens is cm.seq_lens and md.block_table is cm.block_table_tensor
    # capture plans size split-K for max_model_len: every later replay fits them
    captured = builder.build_for_cudagraph_capture(cm).plan
    assert captured.num_splits >= plan.num_splits and builder.workspace.fits(captured)


def test_builder_plans_the_cute_prefill_once_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the FP8 cache where the CuTe prefill runs, ``build()`` sizes it from vLLM's host
    key counts (``seq_lens_cpu_upper_bound``) and builds its GPU schedule once for every
    layer; without those counts, and for CUDA-graph captures, the Triton prefill is planned
    (no host reads, no schedule)."""
    from flamia_serve.kernels.paged import ops

    monkeypatch.setattr(ops, "cute_available", lambda device: True)
    builder = _builder("fp8_per_token_head")
    new, seq_lens = [1, 1, 7, 20], [40, 9, 30, 20]
    cm = _common(new, seq_lens)
    cm.seq_lens_cpu_upper_bound = cm.seq_lens.clone()
    md = builder.build(0, cm)
    assert md.plan.prefill.kernel == "cute" and md.plan.prefill_keys == 50
    assert md.prefill_schedule is not None
    assert md.prefill_schedule.offsets[:2].tolist() == [[0, 7, 27], [0, 30, 50]]
    assert int(md.prefill_schedule.work.count) == 2  # one 128-row query tile per prefill
    assert builder.build_for_cudagraph_capture(cm).prefill_schedule is None
    cm.seq_lens_cpu_upper_bound = None
    md = builder.build(0, cm)
    assert md.plan.prefill_keys == 0 and md.prefill_schedule is None
    assert _builder("nvfp4").build(0, cm).plan.prefill.kernel == "triton"
    cm.seq_lens_cpu_upper_bound = cm.seq_lens.clone()
    monkeypatch.setenv("FLAMIA_EXP_MODE", "schraudolph")  # runs on the Triton prefill
    assert _builder("fp8_per_token_head").build(0, cm).prefill_schedule is None
    monkeypatch.setenv("FLAMIA_EXP_MODE", "mitchell")  # runs on the CuTe prefill
    assert _builder("fp8_per_token_head").build(0, cm).prefill_schedule is not None


def test_builder_declares_decode_cuda_graphs() -> None:
    from vllm.v1.attention.backend import AttentionCGSupport

    assert FlamiaMetadataBuilder._cudagraph_support is (
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )


def _select(cfg, **kw: object) -> type:
    selector._cached_get_attn_backend.cache_clear()
    args = dict(head_size=HEAD_DIM, dtype=torch.bfloat16, kv_cache_dtype="auto") | kw
    with set_current_vllm_config(cfg):
        return selector.get_attn_backend(**args)  # type: ignore[arg-type]


def test_unsupported_configurations_are_rejected_with_what_is_supported() -> None:
    cfg = engine_config("auto")
    assert _select(cfg) is FlamiaAttentionBackend
    cases = [
        (dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype 'fp8_e5m2' not supported "
         r"\(supported: auto, bfloat16, float16, fp8_per_token_head, nvfp4, fp8, fp8_e4m3\)"),
        (dict(head_size=96), r"head_size 96 not supported \(supported: 64, 128, 256\)"),
        (dict(dtype=torch.float32), r"dtype torch.float32 not supported \(supported: "
         "bfloat16, float16"),
        (dict(attn_type=AttentionType.ENCODER_DECODER), "attention type encoder_decoder not "
         r"supported \(supported: decoder self-attention\)"),
        (dict(has_sink=True), "attention sinks not supported"),
    ]  # fmt: skip
    for kw, message in cases:
        with pytest.raises(ValueError, match=message):
            _select(cfg, **kw)
    with pytest.raises(ValueError, match=r"block_size 8 not supported \(supported: 16, 32, 64"):
        _select(engine_config("auto", "--block-size", "8"))
    vllm_cpu.set_capability((8, 0))
    try:
        with pytest.raises(ValueError, match=r"compute capability sm_80 not supported \(supported: "
                                             "sm_90 and newer; tested on sm_90"):  # fmt: skip
            _select(cfg)
    finally:
        vllm_cpu.set_capability((9, 0))
        selector._cached_get_attn_backend.cache_clear()


def test_unsupported_layer_options_are_rejected() -> None:
    base = dict(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2)
    for kw, message in [
        (dict(logits_soft_cap=30.0), "logits_soft_cap"),
        (dict(alibi_slopes=[0.5] * 4), "ALiBi"),
        (dict(sinks=torch.zeros(4)), "sinks"),
        (dict(attn_type=AttentionType.ENCODER_ONLY), "decoder self-attention only"),
        (dict(kv_cache_dtype="int8_per_token_head"), "'int8_per_token_head' is not served"),
        (dict(head_size=80), "head_size 80 not supported"),
        (dict(chunk_lookback=4), "chunk_lookback"),
    ]:
        with pytest.raises(ValueError, match=message):
            FlamiaAttentionImpl(**(base | kw))  # type: ignore[arg-type]


def test_bad_exp_mode_variable_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad ``FLAMIA_EXP_MODE`` names the environment variable (the message named an
    ``exp_mode`` argument a vLLM user never passed)."""
    monkeypatch.setenv("FLAMIA_EXP_MODE", "fast")
    with pytest.raises(ValueError, match=r"FLAMIA_EXP_MODE must be one of .*, got 'fast'"):
        FlamiaAttentionImpl(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2,
                            kv_cache_dtype="nvfp4")


@pytest.mark.parametrize(
    ("kv_cache_dtype", "window", "scales"),
    [("auto", None, None), ("nvfp4", 24, None), ("fp8_per_token_head", None, None),
     ("fp8", None, (0.37, 2.5))],
)  # fmt: skip
def test_forward_matches_reference(kv_cache_dtype: str, window: int | None,
                                   scales: tuple[float, float] | None) -> None:  # fmt: skip
    """``do_kv_cache_update`` + ``forward`` of a real layer on a mixed batch with padding
    (slot −1, rows past the last token) equal the reference twins; the memory-profiling run
    (``attn_metadata=None``) returns zeros."""
    cfg = engine_config(kv_cache_dtype)
    layer = make_layer(cfg, per_layer_sliding_window=window)
    if scales:
        layer._k_scale_float, layer._v_scale_float = scales
    impl = layer.impl
    spec = layer.get_kv_cache_spec(cfg)
    fmt = impl.fmt
    b = make_batch([1, 1, 9, 40], [50, 3, 20, 0], heads_q=HEADS, heads_kv=KV_HEADS,
                   head_dim=HEAD_DIM, page_size=spec.block_size, dtype=fmt.dtype,
                   seed=5)  # fmt: skip
    kv_cache = torch.zeros(FlamiaAttentionBackend.get_kv_cache_shape(
        b.cache.shape[0], spec.block_size, KV_HEADS, HEAD_DIM, kv_cache_dtype), dtype=spec.dtype)
    pad = 3
    slots = torch.cat([b.slot_mapping, torch.full((pad,), -1, dtype=torch.long)])
    key = torch.cat([b.key, torch.randn(pad, KV_HEADS, HEAD_DIM).bfloat16()])
    value = torch.cat([b.value, torch.randn(pad, KV_HEADS, HEAD_DIM).bfloat16()])
    impl.do_kv_cache_update(layer, key, value, kv_cache, slots)
    kw = {"k_scale": scales[0], "v_scale": scales[1]} if scales else {}
    expected_cache = b.cache.clone()
    ref.write_kv_cache(expected_cache, b.key, b.value, b.slot_mapping, fmt, **kw)
    assert torch.equal(kv_cache.view(torch.uint8), expected_cache)

    total = b.q.shape[0]
    qsl = b.query_start_loc
    cm = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=b.seq_lens,
        num_reqs=4, num_actual_tokens=total, max_query_len=40,
        max_seq_len=int(b.seq_lens.max()), block_table_tensor=b.block_table,
        slot_mapping=slots[:total],
    )  # fmt: skip
    with set_current_vllm_config(cfg):
        builder = FlamiaMetadataBuilder(spec, [layer.layer_name], cfg, torch.device("cpu"))
    md = builder.build(0, cm)
    assert md.plan.num_decodes == 2
    query = torch.cat([b.q, torch.randn(pad, HEADS, HEAD_DIM).bfloat16()])
    output = torch.full_like(query, 7.0)
    impl.forward(layer, query, key, value, kv_cache, md, output)
    expected = ref.paged_attention(b.q, expected_cache, fmt, b.block_table, b.seq_lens, qsl,
                                   softmax_scale=HEAD_DIM**-0.5, window=window, **kw)  # fmt: skip
    _assert_close(output[:total], expected, fmt)
    assert (output[total:] == 7.0).all()
    profiled = impl.forward(layer, query, key, value, kv_cache, None, output)
    assert profiled is output and (output == 0).all()


def test_bad_static_scales_are_named_with_the_layer() -> None:
    """``--kv-cache-dtype fp8`` with a checkpoint scale of inf (or one whose float32 inverse
    overflows) wrote zero (or ±448 and NaN) codes without an error; it raises naming the
    layer and the scale before anything is written."""
    cfg = engine_config("fp8")
    layer = make_layer(cfg)
    spec = layer.get_kv_cache_spec(cfg)
    kv_cache = torch.zeros(FlamiaAttentionBackend.get_kv_cache_shape(
        2, spec.block_size, KV_HEADS, HEAD_DIM, "fp8"), dtype=spec.dtype)  # fmt: skip
    key = torch.randn(2, KV_HEADS, HEAD_DIM).bfloat16()
    for name, bad in (("k_scale", float("inf")), ("v_scale", 1e-39)):
        layer._k_scale_float = layer._v_scale_float = 1.0
        setattr(layer, f"_{name}_float", bad)
        with pytest.raises(ValueError, match=f"{layer.layer_name}: {name} must be"):
            layer.impl.do_kv_cache_update(layer, key, key, kv_cache, torch.arange(2))
        assert not kv_cache.view(torch.uint8).any()
