"""Training attention benchmark (forward, forward+backward, backward) of causal varlen
attention on the nine training workloads W1..W9.

Impls (each dropped with a printed reason when its package is missing):

* ``flamia-mxfp8``        ``flamia_serve.flamia_attn_varlen(..., recipe="mxfp8")`` (BF16 in),
                          the library's default kernel (CuTe on sm_90 when installed)
* ``flamia-mxfp8-triton`` the same with the portable Triton forward kernel
* ``flamia-mxfp8-2pass``  Triton, max-only first pass (DESIGN N5 option a)
* ``flamia-mxfp8-no-windows`` the default without short-document windows (``FwdConfig.windows``)
* ``flamia-mxfp8-separate-q`` the default with Q quantized by the quantization launch
                          (``FwdConfig.quantize_q=False``) instead of inside the CuTe forward
* ``flamia-mxfp8_grad_input`` the ``mxfp8_grad_input`` recipe (dK/dQ multiply the
                          unquantized Q/K: DESIGN N6), the library's default kernels (its
                          backward Triton until the CuTe form has run on a GPU);
                          ``-cute-bwd`` with the CuTe backward's BF16 dQ form
* ``flamia-mixed_nvfp4``  mixed NVFP4 Q/K recipe, the library's default kernels (CuTe on
                          sm_90 when installed: BF16 scores from the widened NVFP4 values)
* ``flamia-mixed_nvfp4-triton`` the same on the portable Triton kernels (forward and backward)
* ``flamia-mxfp8-quant``  ``quantize_qkv(..., recipe="mxfp8")`` alone, pass ``"quant"``, as
                          the default forward calls it (without Q where the forward
                          quantizes Q itself)
* ``flamia-mixed_nvfp4-quant`` the same for the mixed recipe (widened when the default
                          forward is CuTe); ``-quant-scores`` with ``scores_only`` (only the
                          CuTe forward's operands)
* ``fa4``                 FlashAttention-4 CuTe ``flash_attn_varlen_func``
* ``cudnn-sdpa``          dense SDPA, cuDNN backend, single-document workloads only
* ``fa2-varlen``          ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2)
* ``flex-docmask``        compiled FlexAttention with a document-causal block mask

Forward rows time the eager call (as every baseline); ``flamia`` forward rows also carry
``graph_ms`` / ``graph_tflops``: the same call replayed from a CUDA graph, i.e. GPU time
without the host side. With ``--passes`` including ``fwd+bwd`` / ``bwd`` every impl with a
backward also gets rows of forward + backward (FLOPs 3.5x the forward's) and of the
backward alone (on a retained graph, 2.5x), both through ``torch.autograd.grad`` (nothing
accumulated into ``.grad``): for flamia the backward includes its quantization launches
(Q/K/V again, dO). Rows record the inputs' layout (``layout``), whether K/V heads were
repeated outside timing (``kv_expanded``), JIT compiles during timing, and for flamia the
kernel configs that ran (``fwd_config`` / ``bwd_config``).

Usage::

    python benchmarks/train_attention.py [--workloads W1,W4] [--impls fa4,flex-docmask]
                                         [--passes fwd,fwd+bwd,bwd] [--quick] [--check]
                                         [--rounds 2] [--name NAME]

``--rounds 2`` times each workload's impls twice, the second time in reverse order, and
keeps the medians: a short workload right after a long one runs slower for a while for
whichever impl comes first (``common.in_rounds``).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from benchmarks.common import (
    JitCompiles,
    Rotating,
    copy_bandwidth,
    graph_time,
    in_rounds,
    num_input_sets,
    plot_rows,
    positive_int,
    print_table,
    tensor_bytes,
    time_ms,
    write_results,
)
from benchmarks.workloads import (
    EQUAL_PACKS,
    HEAD_DIM,
    HKV,
    HQ,
    PACK_FAMILIES,
    SEED,
    WORKLOADS,
    Workload,
    training_workload,
)

Tensor = torch.Tensor
QKV = tuple[Tensor, Tensor, Tensor]
# prep(q, k, v) -> args (outside timing); run(*args) -> output [T, HQ, D] (timed)
Prep = Callable[[Tensor, Tensor, Tensor], tuple]
Run = Callable[..., Any]
Builder = Callable[[Workload, Tensor, QKV], tuple[Prep, Run]]

CHECK_WORKLOADS = ("W1", "W7")  # T=8192: one document; many short documents + one long
#: cos-sim against the FP32 reference below which ``--check`` marks a call SUSPECT: BF16
#: baselines on the same problem give ~0.99999 (a softmax scale 10% off gives 0.9965, so
#: 0.99 would pass it); FLAMIA's FP8/NVFP4 O ~0.992-0.999, dQ/dK ~0.990-0.998 (DESIGN)
CHECK_FLOOR_BASELINE = 0.9999
CHECK_FLOOR_FLAMIA = 0.99
CHECK_FLOOR_FLAMIA_GRAD = 0.98


@dataclass
class Impl:
    """A benchmarked implementation: name, pass, which workloads, and its builder."""

    name: str
    pass_: str
    build: Builder
    single_doc_only: bool = False

    def applies(self, wl: Workload) -> bool:
        """Whether this impl runs on workload ``wl``."""
        return wl.num_docs == 1 or not self.single_doc_only


def _first_tensor(out: Any) -> Tensor:
    """The output tensor of an attention call that may return ``(out, lse)``."""
    return out[0] if isinstance(out, (tuple, list)) else out


def _identity(q: Tensor, k: Tensor, v: Tensor) -> tuple:
    """Prep that passes q, k, v through unchanged."""
    return (q, k, v)


def _expand_kv(q: Tensor, k: Tensor, v: Tensor) -> tuple:
    """Prep that repeats each KV head for its Hq/Hkv query heads (MHA layout)."""
    g = q.shape[1] // k.shape[1]
    return (q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1))


def _prep_facts(prep: Prep, run: Run) -> dict[str, Any]:
    """What a row records of how its impl ran: the input layout its prep built outside the
    timed region, whether K/V heads were repeated there (GQA not native), and for FLAMIA the
    kernel configs that ran (``run.facts``)."""
    facts: dict[str, Any] = {
        "layout": "[1, H, T, d] copies" if prep in (_dense, _dense_expanded) else "[T, H, d]",
        "kv_expanded": prep in (_expand_kv, _dense_expanded),
    }
    extra = getattr(run, "facts", None)
    return {**facts, **(extra() if extra is not None else {})}


def _bhtd(x: Tensor) -> Tensor:
    """``[T, H, D]`` -> ``[1, H, T, D]`` view (no copy)."""
    return x.transpose(0, 1).unsqueeze(0)


def _thd(x: Tensor) -> Tensor:
    """``[1, H, T, D]`` -> ``[T, H, D]`` view (no copy)."""
    return x[0].transpose(0, 1)


# ----------------------------------------------------------------------------- builders


def _flamia_loader(
    recipe: str,
    two_pass: bool = False,
    kernel: str | None = None,
    cute_changes: dict[str, Any] | None = None,
    changes: dict[str, Any] | None = None,
    bwd_kernel: str | None = None,
) -> Callable[[], Builder]:
    """``flamia_serve.flamia_attn_varlen`` (quantization included); the per-microbatch plan
    (one host sync + schedules) is built outside timing, as a training step reuses it for
    every layer. ``kernel``: the forward kernel (default: the library's choice);
    ``cute_changes``: fields of the CuTe config to change where the CuTe kernel runs;
    ``changes``: fields to change whichever kernel runs; ``bwd_kernel``: the backward
    kernel (``"cute"``: ``CUTE_BWD_CONFIG``; default: the library's choice)."""

    def load() -> Builder:
        import dataclasses

        import flamia_serve
        from flamia_serve.kernels.attn_bwd.ops import CUTE_BWD_CONFIG, default_bwd_config
        from flamia_serve.kernels.attn_fwd.ops import default_config
        from flamia_serve.numerics import resolve_recipe

        def build(wl: Workload, cu: Tensor, sample: QKV) -> tuple[Prep, Run]:
            m = wl.max_seqlen
            plan = flamia_serve.plan_varlen(cu, wl.total_tokens, m)
            nvfp4 = resolve_recipe(recipe).qk_format == "nvfp4"
            base = default_config(wl.head_dim, cu.device, qk_nvfp4=nvfp4, kernel=kernel,
                                  mean_doc_len=wl.total_tokens / wl.num_docs)  # fmt: skip
            cfg = dataclasses.replace(base, two_pass=two_pass) if two_pass else base
            if cute_changes and cfg.kernel == "cute":
                cfg = dataclasses.replace(cfg, **cute_changes)
            if changes:
                cfg = dataclasses.replace(cfg, **changes)
            bcfg = None
            if bwd_kernel == "cute":
                bcfg = CUTE_BWD_CONFIG
            elif bwd_kernel is not None:
                bcfg = default_bwd_config(wl.head_dim, cu.device, kernel=bwd_kernel)

            def run(q: Tensor, k: Tensor, v: Tensor) -> Any:
                return flamia_serve.flamia_attn_varlen(
                    q, k, v, cu, m, causal=True, recipe=recipe, plan=plan, config=cfg,
                    bwd_config=bcfg,
                )  # fmt: skip

            def facts() -> dict[str, Any]:
                """The kernel configs the library ran with (the plan's checked call)."""
                calls = list(getattr(plan, "calls", {}).values())
                call = calls[-1] if calls else None
                if getattr(call, "config", None) is None:
                    return {}
                return {"fwd_config": dataclasses.asdict(call.config),
                        "bwd_config": dataclasses.asdict(call.bwd_config)}  # fmt: skip

            run.facts = facts  # type: ignore[attr-defined]
            return _identity, run

        return build

    return load


def _default_fwd_config(device: torch.device) -> dict[str, Any]:
    """The forward kernel and tiles ``flamia-mxfp8`` runs with here (recorded in the JSON)."""
    import dataclasses

    from flamia_serve.kernels.attn_fwd.ops import default_config

    return dataclasses.asdict(default_config(HEAD_DIM, device))


def _default_bwd_config(device: torch.device) -> dict[str, Any]:
    """The backward kernel's tiles (recorded in the JSON)."""
    import dataclasses

    from flamia_serve.kernels.attn_bwd.ops import default_bwd_config

    return dataclasses.asdict(default_bwd_config(HEAD_DIM, device))


def _flamia_quant_loader(recipe: str, scores_only: bool = False) -> Callable[[], Builder]:
    """``flamia_serve.kernels.quant.ops.quantize_qkv`` alone, plan prebuilt, as the default
    forward calls it: its column layout (128-aligned documents for the CuTe kernel) and, for
    NVFP4 Q/K on the CuTe kernel, the widened values (``scores_only``: nothing else)."""

    def load() -> Builder:
        import flamia_serve
        from flamia_serve.kernels.attn_fwd.ops import default_config, q_options
        from flamia_serve.kernels.quant.ops import quantize_qkv
        from flamia_serve.numerics import resolve_recipe

        def build(wl: Workload, cu: Tensor, sample: QKV) -> tuple[Prep, Run]:
            m = wl.max_seqlen
            mean = wl.total_tokens / wl.num_docs
            qk_format = resolve_recipe(recipe).qk_format
            cfg = default_config(wl.head_dim, cu.device, qk_nvfp4=qk_format == "nvfp4",
                                 mean_doc_len=mean)  # fmt: skip
            align = cfg.column_align
            blocks = flamia_serve.plan_varlen(cu, wl.total_tokens, m).token_blocks(align)

            def run(q: Tensor, k: Tensor, v: Tensor) -> Any:
                return quantize_qkv(
                    q, k, v, cu, recipe=recipe, blocks=blocks, column_align=align,
                    widen=cfg.kernel == "cute", scores_only=scores_only,
                    **q_options(cfg, qk_format, q),
                )  # fmt: skip

            return _identity, run

        return build

    return load


def _load_fa4() -> Builder:
    """FA4 CuTe varlen; returns ``(out [T, HQ, D], lse [HQ, T])``, GQA native."""
    from flash_attn.cute import flash_attn_varlen_func

    def build(wl: Workload, cu: Tensor, sample: QKV) -> tuple[Prep, Run]:
        m = wl.max_seqlen

        def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            out = flash_attn_varlen_func(
                q,
                k,
                v,
                cu_seqlens_q=cu,
                cu_seqlens_k=cu,
                max_seqlen_q=m,
                max_seqlen_k=m,
                causal=True,
            )
            return _first_tensor(out)  # (out, lse)

        return _identity, run

    return build


def _dense(q: Tensor, k: Tensor, v: Tensor) -> tuple:
    """Prep: contiguous ``[1, H, T, D]`` copies (the dense kernels' natural layout)."""
    return tuple(_bhtd(x).contiguous() for x in (q, k, v))


def _dense_expanded(q: Tensor, k: Tensor, v: Tensor) -> tuple:
    """Prep: :func:`_dense` after repeating K/V heads to Hq."""
    return _dense(*_expand_kv(q, k, v))


def _load_cudnn() -> Builder:
    """Dense SDPA forced onto cuDNN on contiguous ``[1, H, T, D]`` tensors."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run_gqa(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return _thd(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))

    def run_mha(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return _thd(F.scaled_dot_product_attention(q, k, v, is_causal=True))

    def build(wl: Workload, cu: Tensor, sample: QKV) -> tuple[Prep, Run]:
        try:
            run_gqa(*_dense(*sample))
            return _dense, run_gqa
        except RuntimeError as exc:
            print(f"  cudnn-sdpa: enable_gqa refused ({_short(exc)}); K/V expanded outside timing")
            return _dense_expanded, run_mha

    return build


def _load_fa2_varlen() -> Builder:
    """``torch.nn.attention.varlen.varlen_attn``; adapts to its torch-version signature.

    torch 2.9: ``is_causal=``; 2.10/2.11: ``window_size=(-1, 0)`` means causal;
    2.12+: also ``enable_gqa=``. Without ``enable_gqa`` we pass Hkv heads (the FA2 kernel
    takes GQA natively) and expand K/V outside timing only if that call is refused.
    """
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kw: dict[str, Any] = {}
    if "is_causal" in params:
        kw["is_causal"] = True
    elif "window_size" in params:
        kw["window_size"] = (-1, 0)
    else:
        raise AttributeError("varlen_attn has neither is_causal nor window_size")
    if "enable_gqa" in params:
        kw["enable_gqa"] = True

    def build(wl: Workload, cu: Tensor, sample: QKV) -> tuple[Prep, Run]:
        m = wl.max_seqlen

        def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return varlen_attn(q, k, v, cu, cu, m, m, **kw)

        try:
            run(*sample)
            return _identity, run
        except (RuntimeError, ValueError) as exc:
            print(f"  fa2-varlen: Hkv<Hq refused ({_short(exc)}); K/V expanded outside timing")
            return _expand_kv, run

    return build


_FLEX: dict[str, Callable[..., Any]] = {}


def _load_flex() -> Builder:
    """Compiled FlexAttention with a document-causal ``create_block_mask`` mask."""
    import torch._dynamo.config as dynamo_config
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # three sequence lengths x block masks; keep the default limit from recompiling forever
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, knob):
            setattr(dynamo_config, knob, max(getattr(dynamo_config, knob), 64))
    # the bwd-only rows replay one graph (retain_graph=True), which donated buffers forbid
    import torch._functorch.config as functorch_config

    functorch_config.donated_buffer = False
    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    flex = _FLEX["fn"]

    def build(wl: Workload, cu: Tensor, sample: QKV) -> tuple[Prep, Run]:
        t = wl.total_tokens
        lens = torch.tensor(wl.seqlens, device=cu.device)
        doc = torch.repeat_interleave(torch.arange(len(wl.seqlens), device=cu.device), lens)

        def doc_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        mask = create_block_mask(doc_causal, None, None, t, t, device=cu.device)

        def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return _thd(flex(q, k, v, block_mask=mask, enable_gqa=True))

        return _dense, run

    return build


IMPLS: dict[str, tuple[str, Callable[[], Builder], bool]] = {
    # name: (pass, loader, single-document workloads only)
    "flamia-mxfp8": ("fwd", _flamia_loader("mxfp8"), False),
    "flamia-mxfp8-triton": ("fwd", _flamia_loader("mxfp8", kernel="triton"), False),
    "flamia-mxfp8-2pass": ("fwd", _flamia_loader("mxfp8", two_pass=True, kernel="triton"), False),
    # short documents with the long ones' kernel, one item each (no windows)
    "flamia-mxfp8-no-windows": ("fwd", _flamia_loader("mxfp8", changes={"windows": False}), False),
    # Q quantized by the quantization launch, not inside the CuTe forward
    "flamia-mxfp8-separate-q": (
        "fwd", _flamia_loader("mxfp8", cute_changes={"quantize_q": False}), False
    ),
    # the CuTe forward's P̂·V̂ added to O in FP32 per key tile, or accumulated in the wgmma
    # (serial, or overlapping the next Q̂·K̂ᵀ with the softmax step)
    "flamia-mxfp8-pv-promoted": (
        "fwd", _flamia_loader("mxfp8", cute_changes={"promote_pv": True, "overlap": False}),
        False,
    ),
    "flamia-mxfp8-pv-in-mma": (
        "fwd", _flamia_loader("mxfp8", cute_changes={"promote_pv": False, "overlap": False}),
        False,
    ),
    "flamia-mxfp8-pv-in-mma-overlap": (
        "fwd", _flamia_loader("mxfp8", cute_changes={"promote_pv": False, "overlap": True}),
        False,
    ),
    # the backward kernel forced (the forward the library's choice)
    "flamia-mxfp8-cute-bwd": ("fwd", _flamia_loader("mxfp8", bwd_kernel="cute"), False),
    "flamia-mxfp8-triton-bwd": ("fwd", _flamia_loader("mxfp8", bwd_kernel="triton"), False),
    "flamia-mxfp8_grad_input": ("fwd", _flamia_loader("mxfp8_grad_input"), False),
    "flamia-mxfp8_grad_input-cute-bwd": (
        "fwd",
        _flamia_loader("mxfp8_grad_input", bwd_kernel="cute"),
        False,
    ),
    "flamia-mixed_nvfp4": ("fwd", _flamia_loader("mixed_nvfp4"), False),
    "flamia-mixed_nvfp4-triton": ("fwd", _flamia_loader("mixed_nvfp4", kernel="triton"), False),
    "flamia-mixed_nvfp4-cute": ("fwd", _flamia_loader("mixed_nvfp4", kernel="cute"), False),
    "flamia-mxfp8-quant": ("quant", _flamia_quant_loader("mxfp8"), False),
    "flamia-mixed_nvfp4-quant": ("quant", _flamia_quant_loader("mixed_nvfp4"), False),
    "flamia-mixed_nvfp4-quant-scores": (
        "quant", _flamia_quant_loader("mixed_nvfp4", scores_only=True), False
    ),
    "fa4": ("fwd", _load_fa4, False),
    "cudnn-sdpa": ("fwd", _load_cudnn, True),
    "fa2-varlen": ("fwd", _load_fa2_varlen, False),
    "flex-docmask": ("fwd", _load_flex, False),
}


def _short(exc: BaseException, n: int = 160) -> str:
    """One-line, truncated description of an exception."""
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= n else text[: n - 3] + "..."


def load_impls(names: list[str]) -> list[Impl]:
    """Import each requested impl; print why one is dropped and keep going."""
    impls = []
    for name in names:
        pass_, loader, single = IMPLS[name]
        try:
            impls.append(Impl(name, pass_, loader(), single))
        except (ImportError, AttributeError, RuntimeError) as exc:
            print(f"[skip] {name}: {_short(exc)}")
    return impls


# ----------------------------------------------------------------------------- running


def _heads(wl: Workload) -> dict[str, int]:
    """The workload's attention shape, recorded in each row."""
    return {"hq": wl.hq, "hkv": wl.hkv, "d": wl.head_dim, "docs": wl.num_docs}


def make_inputs(wl: Workload, seed: int, device: torch.device) -> QKV:
    """Random-normal BF16 q ``[T, Hq, d]``, k / v ``[T, Hkv, d]`` (the workload's heads)."""
    g = torch.Generator(device=device).manual_seed(seed)
    t = wl.total_tokens

    def randn(h: int) -> Tensor:
        return torch.randn(t, h, wl.head_dim, generator=g, device=device, dtype=torch.bfloat16)

    return randn(wl.hq), randn(wl.hkv), randn(wl.hkv)


def reference_fwd(q: Tensor, k: Tensor, v: Tensor, seqlens: list[int]) -> Tensor:
    """Float32 causal SDPA per document, K/V heads repeated; returns ``[T, HQ, D]``."""
    g = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    start = 0
    for n in seqlens:
        sl = slice(start, start + n)
        qd, kd, vd = (
            _bhtd(x[sl].float().repeat_interleave(r, dim=1)) for x, r in ((q, 1), (k, g), (v, g))
        )
        out[sl] = _thd(F.scaled_dot_product_attention(qd, kd, vd, is_causal=True))
        start += n
    return out


def reference_grads(q: Tensor, k: Tensor, v: Tensor, seqlens: list[int],
                    d_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Float32 ``(dQ, dK, dV)`` of :func:`reference_fwd` for the output gradient ``d_out``
    (dK/dV summed over each KV head's query heads)."""
    leaves = tuple(x.detach().float().requires_grad_() for x in (q, k, v))
    with torch.enable_grad():
        out = reference_fwd(*leaves, seqlens)
        return torch.autograd.grad(out, leaves, d_out.float())


def check_floor(impl: str, tensor: str = "O") -> float:
    """The cos-sim under which ``--check`` flags ``impl``'s ``tensor`` (O, dQ, dK, dV)."""
    if not impl.startswith("flamia"):
        return CHECK_FLOOR_BASELINE
    return CHECK_FLOOR_FLAMIA if tensor == "O" else CHECK_FLOOR_FLAMIA_GRAD


def _impl_grads(run: Run, prep: Prep, qkv: QKV, d_out: Tensor) -> tuple[Tensor, ...]:
    """``(dQ, dK, dV)`` of one call with respect to the raw ``[T, H, d]`` inputs: the prep
    (layout copies, K/V repeated) is inside the graph, so its backward maps the impl's
    gradients back (repeated K/V heads summed)."""
    leaves = tuple(x.detach().clone().requires_grad_() for x in qkv)
    with torch.enable_grad():
        out = _first_tensor(run(*prep(*leaves)))
        return torch.autograd.grad(out, leaves, d_out.view_as(out))


def check_impls(
    impls: list[Impl],
    device: torch.device,
    workloads: list[Workload] | None = None,
    grads: bool = False,
    include: Callable[[Impl, Workload], bool] | None = None,
) -> dict[str, dict]:
    """Cos-sim of each forward impl's O against :func:`reference_fwd` (and with ``grads`` of
    its dQ/dK/dV against :func:`reference_grads`) on ``workloads`` (default
    :data:`CHECK_WORKLOADS`), the impl built as the timed rows build it.

    Returns ``{"cos": {impl: {workload: O cos}}, "grad_cos": {impl: {workload: {dQ, dK,
    dV}}}, "floors": ..., "suspect": ["impl workload tensor cos", ...], "failed": [...]}``;
    ``include(impl, wl)``: whether to check an impl there (default ``impl.applies``).
    """
    wls = workloads if workloads is not None else [training_workload(n) for n in CHECK_WORKLOADS]
    include = include or (lambda impl, wl: impl.applies(wl))
    cos_o: dict[str, dict[str, float]] = {}
    cos_g: dict[str, dict[str, dict[str, float]]] = {}
    suspect: list[str] = []
    failed: list[str] = []
    what = "O, dQ, dK, dV" if grads else "O"
    print(f"correctness check ({what}) vs fp32 SDPA per document on "
          f"{', '.join(w.name for w in wls)}:")  # fmt: skip
    for wl in wls:
        cu = wl.cu_seqlens(device)
        q, k, v = make_inputs(wl, seed=1234, device=device)
        ref = reference_fwd(q, k, v, wl.seqlens)
        d_out = make_inputs(wl, seed=4321, device=device)[0] if grads else None
        ref_grads = reference_grads(q, k, v, wl.seqlens, d_out) if grads else None
        for impl in impls:
            if impl.pass_ != "fwd" or not include(impl, wl):
                continue
            try:
                prep, run = impl.build(wl, cu, (q, k, v))
                with torch.no_grad():
                    out = _first_tensor(run(*prep(q, k, v))).float()
                if out.shape != ref.shape:
                    raise ValueError(f"output shape {tuple(out.shape)} != {tuple(ref.shape)}")
                got = {"O": (out, ref)}
                if grads:
                    dq, dk, dv = _impl_grads(run, prep, (q, k, v), d_out)
                    got.update(dQ=(dq, ref_grads[0]), dK=(dk, ref_grads[1]),
                               dV=(dv, ref_grads[2]))  # fmt: skip
                cos = {n: F.cosine_similarity(a.float().flatten(), b.flatten(), dim=0).item()
                       for n, (a, b) in got.items()}  # fmt: skip
                err = (out - ref).abs().max().item()
            except Exception as exc:  # a broken baseline must not stop the others
                print(f"  {wl.name} {impl.name:20s} FAILED {_short(exc)}")
                failed.append(f"{impl.name} {wl.name}: {_short(exc)}")
                continue
            low = [f"{impl.name} {wl.name} {n} {c:.6f}" for n, c in cos.items()
                   if c < check_floor(impl.name, n)]  # fmt: skip
            suspect += low
            flag = "   <-- SUSPECT: wrong call?" if low else ""
            text = " ".join(f"{n}={c:.6f}" for n, c in cos.items())
            print(f"  {wl.name} {impl.name:20s} cos {text} max|err O|={err:.4g}{flag}")
            cos_o.setdefault(impl.name, {})[wl.name] = cos["O"]
            if grads:
                cos_g.setdefault(impl.name, {})[wl.name] = {n: cos[n] for n in ("dQ", "dK", "dV")}
        del q, k, v, ref, d_out, ref_grads
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    floors = {"baseline": CHECK_FLOOR_BASELINE, "flamia_O": CHECK_FLOOR_FLAMIA,
              "flamia_grads": CHECK_FLOOR_FLAMIA_GRAD}  # fmt: skip
    return {"cos": cos_o, "grad_cos": cos_g, "floors": floors, "suspect": suspect,
            "failed": failed}  # fmt: skip


def bench_workload(
    wl: Workload, impls: list[Impl], device: torch.device, warmup_ms: float, rep_ms: float
) -> list[dict]:
    """Time every applicable impl on ``wl``; a failing impl prints its reason and is skipped."""
    cu = wl.cu_seqlens(device)
    raw0 = make_inputs(wl, seed=0, device=device)
    n_sets = num_input_sets(tensor_bytes(raw0))
    raw = [raw0] + [make_inputs(wl, seed=i, device=device) for i in range(1, n_sets)]
    flops = wl.flops()
    print(f"{wl.name}: T={wl.total_tokens} docs={wl.num_docs} max={wl.max_seqlen} "
          f"input sets={n_sets} ({time.strftime('%T')})")  # fmt: skip
    rows = []
    for impl in impls:
        if not impl.applies(wl):
            continue
        try:
            prep, run = impl.build(wl, cu, raw[0])
            arg_sets = [prep(*s) for s in raw]
            out = run(*arg_sets[0])  # compile / autotune outside timing
            out_bytes = tensor_bytes(out)
            del out
            torch.cuda.synchronize()
            with JitCompiles() as jit:
                t = time_ms(Rotating(run, arg_sets), warmup_ms=warmup_ms, rep_ms=rep_ms)
            t["jit_compiles_in_timing"] = jit.total
            facts = _prep_facts(prep, run)
            first = functools.partial(run, *arg_sets[0])
            if impl.pass_ == "quant":  # GPU time from a CUDA graph; eager adds host launch
                t = {**graph_time(first, rep_ms=rep_ms), "eager_ms": t["ms"]}
            elif impl.name.startswith("flamia"):  # also the GPU time alone (host excluded)
                g = graph_time(first, rep_ms=rep_ms)
                t["graph_ms"] = g["ms"] if g["cuda_graph"] else None
        except Exception as exc:  # keep going: one broken impl must not hide the others
            print(f"  [fail] {impl.name}: {_short(exc)}")
            continue
        finally:
            arg_sets = None
            torch.cuda.empty_cache()
        row = {"workload": wl.name, "pass": impl.pass_, "impl": impl.name, **_heads(wl), **t,
               **facts, "at": time.strftime(AT_FORMAT)}  # fmt: skip
        if impl.pass_ == "fwd":
            row["tflops"] = flops / (t["ms"] * 1e-3) / 1e12
            row["gbps"] = None
            if t.get("graph_ms"):
                row["graph_tflops"] = flops / (t["graph_ms"] * 1e-3) / 1e12
        else:  # quantization: bytes read (BF16 q, k, v) + bytes written, per second
            row["tflops"] = None
            row["gbps"] = (tensor_bytes(raw[0]) + out_bytes) / (t["ms"] * 1e-3) / 1e9
        print(
            f"  {impl.name:20s} {t['ms']:8.4f} ms  "
            + (f"{row['tflops']:7.1f} TFLOP/s" if row["tflops"] else f"{row['gbps']:7.1f} GB/s")
            + (f"  (CUDA graph {t['graph_ms']:.4f} ms)" if t.get("graph_ms") else "")
        )
        rows.append(row)
    return rows


#: a row's ``at``: when its timing ended, local time as in ``nvidia-smi``'s timestamps
#: (``device_run.sh``'s ``clocks.csv``)
AT_FORMAT = "%Y/%m/%d %H:%M:%S"

BWD_FLOPS = {"fwd+bwd": 3.5, "bwd": 2.5}  # multiples of the forward's FLOPs (DESIGN §6)


def _with_grad(args: tuple) -> tuple:
    """Fresh leaves that require grad (prepped copies keep their layout)."""
    return tuple(x.detach().requires_grad_() for x in args)


def fwd_bwd_step(run: Run, q: Tensor, k: Tensor, v: Tensor, d_out: Tensor) -> tuple:
    """One forward + backward (the ``fwd+bwd`` rows): gradients returned by
    ``torch.autograd.grad``, as in :func:`bwd_step`, not accumulated into ``.grad`` (that
    adds an elementwise add per input from the second call on, which ``bwd`` would not
    time)."""
    out = _first_tensor(run(q, k, v))
    return torch.autograd.grad(out, (q, k, v), d_out.view_as(out))


def bwd_step(out: Tensor, q: Tensor, k: Tensor, v: Tensor, d_out: Tensor) -> tuple:
    """The backward alone (the ``bwd`` rows) over a forward graph built beforehand."""
    return torch.autograd.grad(out, (q, k, v), d_out.view_as(out), retain_graph=True)


def bench_backward(
    wl: Workload, impls: list[Impl], device: torch.device, passes: list[str], warmup_ms: float,
    rep_ms: float,
) -> list[dict]:  # fmt: skip
    """``fwd+bwd`` and ``bwd`` rows of every impl with a backward (inputs rotated)."""
    cu = wl.cu_seqlens(device)
    raw0 = make_inputs(wl, seed=0, device=device)
    n_sets = min(num_input_sets(2 * tensor_bytes(raw0)), 8)
    raw = [raw0] + [make_inputs(wl, seed=i, device=device) for i in range(1, n_sets)]
    flops = wl.flops()
    rows = []
    for impl in impls:
        if impl.pass_ != "fwd" or not impl.applies(wl):
            continue
        try:
            prep, run = impl.build(wl, cu, raw[0])
            sets = [_with_grad(prep(*s)) for s in raw]
            d_outs = [torch.randn_like(s[0]) for s in raw]
            fwd_bwd = functools.partial(fwd_bwd_step, run)
            fwd_bwd(*sets[0], d_outs[0])  # compile / autotune outside timing
            torch.cuda.synchronize()
            timings = {}
            if "fwd+bwd" in passes:
                args = [(*s, d) for s, d in zip(sets, d_outs, strict=True)]
                with JitCompiles() as jit:
                    timings["fwd+bwd"] = time_ms(Rotating(fwd_bwd, args), warmup_ms=warmup_ms,
                                                 rep_ms=rep_ms)  # fmt: skip
                timings["fwd+bwd"]["jit_compiles_in_timing"] = jit.total
            if "bwd" in passes:
                outs = [_first_tensor(run(*s)) for s in sets]
                args = [(o, *s, d) for o, s, d in zip(outs, sets, d_outs, strict=True)]
                with JitCompiles() as jit:
                    timings["bwd"] = time_ms(Rotating(bwd_step, args), warmup_ms=warmup_ms,
                                             rep_ms=rep_ms)  # fmt: skip
                timings["bwd"]["jit_compiles_in_timing"] = jit.total
            facts = _prep_facts(prep, run)
        except Exception as exc:  # a broken baseline must not stop the others
            print(f"  [fail] {impl.name} backward: {_short(exc)}")
            continue
        finally:
            sets = outs = args = None
            torch.cuda.empty_cache()
        for pass_, t in timings.items():
            tflops = BWD_FLOPS[pass_] * flops / (t["ms"] * 1e-3) / 1e12
            rows.append({"workload": wl.name, "pass": pass_, "impl": impl.name, **_heads(wl), **t,
                         "tflops": tflops, "gbps": None, **facts,
                         "at": time.strftime(AT_FORMAT)})  # fmt: skip
            print(f"  {impl.name:20s} {pass_:8s} {t['ms']:8.4f} ms  {tflops:7.1f} TFLOP/s")
    return rows


def add_quant_floor(rows: list[dict], copy_gbps: float) -> None:
    """``floor_ratio`` on quantization rows: time over bytes / measured copy bandwidth."""
    for r in rows:
        if r["pass"] == "quant" and r.get("gbps"):
            r["floor_ratio"] = copy_gbps / r["gbps"]


def add_speedups(rows: list[dict]) -> None:
    """Set ``speedup_vs_best_baseline`` (best baseline ms / ms, same workload and pass) on
    flamia rows of the attention passes."""
    for r in rows:
        if not r["impl"].startswith("flamia"):
            continue
        base = [
            b["ms"]
            for b in rows
            if b["workload"] == r["workload"]
            and b["pass"] == r["pass"]
            and not b["impl"].startswith("flamia")
        ]
        ok = r["pass"] in ("fwd", "fwd+bwd", "bwd") and bool(base)
        r["speedup_vs_best_baseline"] = min(base) / r["ms"] if ok else None


def _csv(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    """Parse a comma list and reject names outside ``allowed``."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in allowed]
    if bad:
        raise SystemExit(f"unknown {what}: {', '.join(bad)}; choose from {', '.join(allowed)}")
    return names


def _work_order() -> dict[str, str | int]:
    """The order the CuTe kernels' CTAs take their work lists in (``work_order.py`` sets it)."""
    from flamia_serve.kernels import schedule

    return {
        "forward": schedule.QUERY_WORK_ORDER, "forward_chunk": schedule.QUERY_ORDER_CHUNK,
        "backward": schedule.KEY_WORK_ORDER, "backward_chunk": schedule.KEY_ORDER_CHUNK,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--workloads", default=",".join(WORKLOADS),
        help=f"e.g. W1,W4,W7; also the pack families {','.join(PACK_FAMILIES + EQUAL_PACKS)}",
    )  # fmt: skip
    ap.add_argument("--impls", default=",".join(IMPLS), help=", ".join(IMPLS))
    ap.add_argument("--passes", default="fwd", help="comma list of fwd, fwd+bwd, bwd")
    ap.add_argument("--quick", action="store_true", help="short timing (warm-up 10, rep 50 ms)")
    ap.add_argument("--check", action="store_true",
                    help="before timing, cos-sim vs fp32 SDPA on the timed workloads (O; with "
                         "fwd+bwd or bwd passes also dQ/dK/dV)")  # fmt: skip
    ap.add_argument("--name", default="train_attention", help="results file stem")
    ap.add_argument(
        "--flex-workloads", default="W3,W6,W9", help="flex-docmask recompiles: limit its workloads"
    )
    ap.add_argument("--rounds", type=positive_int, default=1,
                    help="time each workload's impls this many times, in reverse order every "
                    "other round (medians; 2: each impl once first, once last)")  # fmt: skip
    args = ap.parse_args(argv)
    workloads = _csv(args.workloads, WORKLOADS + PACK_FAMILIES + EQUAL_PACKS, "workloads")
    names = _csv(args.impls, tuple(IMPLS), "impls")
    passes = _csv(args.passes, ("fwd", "fwd+bwd", "bwd"), "passes")
    if not torch.cuda.is_available():
        raise SystemExit("train_attention needs a CUDA GPU")
    device = torch.device("cuda")
    warmup_ms, rep_ms = (10.0, 50.0) if args.quick else (25.0, 200.0)

    impls = load_impls(names)
    if not impls:
        raise SystemExit("no impl could be loaded")
    extra: dict[str, Any] = {
        "heads": {"hq": HQ, "hkv": HKV, "d": HEAD_DIM, "note": "W1-W9; P1-P5 rows carry theirs"},
        "causal": True,
        "dtype": "bfloat16",
        "warmup_ms": warmup_ms,
        "rep_ms": rep_ms,
        "flamia_fwd_default": _default_fwd_config(device),
        "flamia_bwd_default": _default_bwd_config(device),
        "flamia_work_order": _work_order(),
        "passes": passes,
        "rounds": args.rounds,
        "workload_seed": SEED,
        "workloads": {name: training_workload(name).definition() for name in workloads},
    }
    rows: list[dict] = []
    flex_only = set(_csv(args.flex_workloads, WORKLOADS + PACK_FAMILIES + EQUAL_PACKS, "workloads"))
    if args.check:  # the impls on the workloads they are timed on

        def timed_on(impl: Impl, wl: Workload) -> bool:
            return impl.applies(wl) and (impl.name != "flex-docmask" or wl.name in flex_only)

        check = check_impls(impls, device, [training_workload(n) for n in workloads],
                            grads=any(p != "fwd" for p in passes), include=timed_on)  # fmt: skip
        extra["check_cos_vs_fp32"] = check["cos"]
        extra["check"] = {key: check[key] for key in ("grad_cos", "floors", "suspect", "failed")}
    with torch.no_grad():
        copy_row = copy_bandwidth(device)
        for name in workloads:
            chosen = [i for i in impls if i.name != "flex-docmask" or name in flex_only]
            if "fwd" in passes:
                wl = training_workload(name)
                rows += in_rounds(
                    lambda some, wl=wl: bench_workload(wl, some, device, warmup_ms, rep_ms),
                    chosen, args.rounds,
                )  # fmt: skip
    grad_passes = [p for p in passes if p != "fwd"]
    if grad_passes:
        for name in workloads:
            chosen = [i for i in impls if i.name != "flex-docmask" or name in flex_only]
            wl = training_workload(name)
            rows += in_rounds(
                lambda some, wl=wl: bench_backward(wl, some, device, grad_passes, warmup_ms,
                                                   rep_ms),
                chosen, args.rounds,
            )  # fmt: skip
    add_quant_floor(rows, copy_row["gbps"])
    rows.append(copy_row)
    add_speedups(rows)
    print()
    print_table(rows)
    write_results(args.name, rows, extra)
    plot_rows(args.name, rows, "tflops")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
