"""The kernel path's forward and backward, as ``torch.library`` custom ops (traced by
``torch.compile``) and as an eager ``torch.autograd.Function`` over the same implementation.

``attention_forward`` quantizes Q/K/V and runs the forward kernel; ``attention_backward``
quantizes Q/K/V again (the same kernel on the same inputs: the same codes, bit for bit, now
with the column-layout copies the backward reads), quantizes dO (dÔ, Ĝ, D in one launch)
and runs the backward kernel. Saving BF16 Q/K/V instead of their FP8 copies keeps the saved
state that of any attention op; the re-quantization costs one memory-bound launch.

Two ways in, one implementation:

* ``flamia::attn_varlen_fwd`` / ``flamia::attn_varlen_bwd`` (custom ops with fake
  implementations and a registered autograd formula): what ``torch.compile(fullgraph=True)``
  traces. Their arguments are tensors, tensor lists and ints (schedules from a
  ``VarlenPlan``, kernel configs as int lists), so nothing reads the GPU on the host.
* ``EagerAttention`` (``torch.autograd.Function``): the eager call. It skips the custom-op
  dispatcher's Python layers (a no-op custom op with these arguments measured ~130 µs of
  host time per call on a CPU, an autograd function ~20 µs) and takes the plan's cached
  objects as they are.

Callers go through ``flamia_serve.attention``, which validates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch.autograd.function import once_differentiable

from flamia_serve.kernels._common import BoundLaunch
from flamia_serve.kernels.attn_bwd.ops import BwdConfig, BwdLaunch, attn_bwd_launch, bwd_reads_rows
from flamia_serve.kernels.attn_fwd.ops import (
    FwdConfig,
    FwdLaunch,
    attn_fwd_launch,
    q_options,
    window_limit,
)
from flamia_serve.kernels.quant.ops import QKVLaunch, quantize_do_launch, quantize_qkv_launch
from flamia_serve.kernels.schedule import ShortWindows, TokenBlocks, WorkList
from flamia_serve.kernels.workspace import PackWorkspace
from flamia_serve.numerics import RECIPES, Recipe
from flamia_serve.numerics.operands import KernelDO, KernelQKV

Tensors = list[torch.Tensor]
Prepared = TypeVar("Prepared", "ForwardLaunch", "BackwardLaunch")


@dataclass(frozen=True)
class AttnCall:
    """The non-tensor part of one call: schedules (from a plan), options and kernel configs.

    ``column_align``: documents start at multiples of it in the forward's column layout
    (``FwdConfig.column_align``); ``blocks``: the token-block table of that layout;
    ``work``/``bwd_work``: the forward's query-tile and the backward's key-tile lists
    (``bwd_work`` None when no gradient is needed); ``config`` None in a backward-only call;
    ``columns``: int64 ``[T]``, each token's column in the layout (the forward windows';
    ``VarlenPlan.token_columns``, built when None); ``bwd_blocks``/``bwd_columns``: the same
    for the backward's layout (``bwd_config.column_align``; None: the forward's, which must
    then have that alignment); ``workspace``: the plan's buffers for the kernels
    (``VarlenPlan.workspace``; eager calls with a plan), None: new ones. ``prepared``: with
    a workspace, the launches kept per input layout (:func:`attention_forward`,
    :func:`attention_backward`).
    """

    blocks: TokenBlocks
    column_align: int
    work: WorkList | None
    bwd_work: WorkList | None
    causal: bool
    recipe: Recipe
    exact_causal: bool
    softmax_scale: float
    config: FwdConfig | None
    bwd_config: BwdConfig
    columns: torch.Tensor | None = None
    workspace: PackWorkspace | None = None
    bwd_blocks: TokenBlocks | None = None
    bwd_columns: torch.Tensor | None = None
    prepared: dict[tuple, ForwardLaunch | BackwardLaunch] = field(
        default_factory=dict, compare=False, repr=False
    )

    def backward_layout(self) -> tuple[TokenBlocks, int, torch.Tensor | None]:
        """``(blocks, column_align, columns)`` of the layout the backward quantizes into:
        ``bwd_blocks`` at ``bwd_config.column_align``, else the forward's layout when its
        alignment is a multiple of that."""
        align = self.bwd_config.column_align
        if self.bwd_blocks is not None:
            return self.bwd_blocks, align, self.bwd_columns
        if self.column_align % align:
            raise ValueError(
                f"the backward reads a layout aligned to {align} columns, the forward's is "
                f"aligned to {self.column_align}: the call needs bwd_blocks"
            )
        return self.blocks, self.column_align, self.columns


@dataclass(frozen=True)
class ForwardLaunch:
    """The launches of one forward (quantization, then attention), prepared for q/k/v of one
    layout: ``launch(q, k, v) -> (O, M, lse)``."""

    quantize: QKVLaunch
    attend: FwdLaunch
    defer_q: bool

    def keep(self) -> bool:
        """Bind its launches for other tensors: whether they can run them."""
        return all([self.quantize.keep(), self.attend.keep()])

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.quantize(q=q, k=k, v=v)
        return self.attend(q=q if self.defer_q else None)


#: input layouts whose prepared launches a call keeps; then it starts over
MAX_PREPARED = 8
#: False: eager calls with a plan prepare their launches anew every time, as calls without
#: one do (host-time comparisons, ``benchmarks/host_time.py``)
KEEP_PREPARED = True


def _layout(*tensors: torch.Tensor) -> tuple:
    """What prepared launches fix beyond an ``AttnCall``'s key: the tensors' strides and
    16-byte alignment (Triton's and the CuTe loads' specialisation; whether the CuTe forward
    quantizes Q) and the current CUDA device (Triton launches on it)."""
    device = torch._C._cuda_getDevice() if tensors[0].is_cuda else None  # current_device()
    return (*[t.stride() for t in tensors], *[t.data_ptr() % 16 == 0 for t in tensors], device)


def _prepared(call: AttnCall, key: tuple, prepare: Callable[[], Prepared]) -> Prepared:
    """``call.prepared[key]``, prepared now if missing (and kept when it can be)."""
    launch = call.prepared.get(key)
    if launch is None:
        launch = prepare()
        if launch.keep():
            if len(call.prepared) >= MAX_PREPARED:
                call.prepared.clear()
            call.prepared[key] = launch
    return launch  # type: ignore[return-value]


def prepare_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, call: AttnCall
) -> ForwardLaunch:
    """The forward's launches for inputs laid out as ``q``/``k``/``v`` (checked inputs)."""
    if call.config is None or call.config.column_align != call.column_align:
        raise ValueError("attention_forward needs the forward config of call.column_align")
    options = q_options(call.config, call.recipe.qk_format, q)
    qkv, quantize = quantize_qkv_launch(
        q, k, v, cu_seqlens, recipe=call.recipe, exact_causal=call.exact_causal,
        blocks=call.blocks, column_align=call.column_align, columns=call.columns,
        workspace=call.workspace, widen=call.config.kernel == "cute", **options,
    )  # fmt: skip
    attend = attn_fwd_launch(
        qkv, cu_seqlens, heads_q=q.shape[1], causal=call.causal,
        softmax_scale=call.softmax_scale, out_dtype=q.dtype, config=call.config, work=call.work,
        workspace=call.workspace,
    )  # fmt: skip
    return ForwardLaunch(quantize, attend, bool(options["defer_q"]))


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, call: AttnCall
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(O [T, Hq, d], M [T, Hq], lse [T, Hq])`` of checked inputs. With a workspace the
    prepared launches are kept in ``call.prepared`` per input layout: a later call of that
    layout only launches (its tensors in place of the first call's), into the same
    buffers."""
    if call.workspace is None or not KEEP_PREPARED:
        return prepare_forward(q, k, v, cu_seqlens, call)(q, k, v)
    key = ("fwd", *_layout(q, k, v))
    return _prepared(call, key, lambda: prepare_forward(q, k, v, cu_seqlens, call))(q, k, v)


@dataclass
class BackwardLaunch:
    """The launches of one backward, prepared for tensors of one layout: the quantizations
    (Q/K/V with their column-layout copies, then dO) into ``qkv``/``qdo`` (buffers only),
    then the backward kernel(s) (``attend``: ``attn_bwd_launch``'s, prepared at the first
    call, once the quantizations are queued, since a fallback may read their codes; kept
    when :meth:`keep` was called and it can run again). ``launch(d_out, q, k, v, out, m,
    lse) -> (dQ, dK, dV)``."""

    quantize: QKVLaunch
    quantize_grad: BoundLaunch | None
    qkv: KernelQKV
    qdo: KernelDO
    cu_seqlens: torch.Tensor
    call: AttnCall
    attend: BwdLaunch | None = None
    kept: bool = False

    def keep(self) -> bool:
        """Bind its launches for other tensors: whether they can run them."""
        grad = self.quantize_grad
        self.kept = all([self.quantize.keep(), grad is None or grad.keep()])
        return self.kept

    def __call__(
        self, d_out, q, k, v, out, m_rows, lse_rows
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.quantize(q=q, k=k, v=v)
        if self.quantize_grad is not None:
            self.quantize_grad(d_out=d_out, out=out, m=m_rows, lse=lse_rows)
        attend = self.attend
        if attend is None:
            call = self.call
            attend = attn_bwd_launch(
                self.qkv, self.qdo, m_rows, lse_rows, self.cu_seqlens, heads_q=q.shape[1],
                causal=call.causal, softmax_scale=call.softmax_scale, recipe=call.recipe,
                out_dtype=q.dtype, config=call.bwd_config, work=call.bwd_work,
                workspace=call.workspace,
            )  # fmt: skip
            if self.kept and attend.keep():
                self.attend = attend
        return attend(m=m_rows, lse=lse_rows)


def prepare_backward(
    d_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    m_rows: torch.Tensor,
    lse_rows: torch.Tensor,
    cu_seqlens: torch.Tensor,
    call: AttnCall,
) -> BackwardLaunch:
    """The backward's launches for tensors laid out as these (``d_out``, ``m_rows``,
    ``lse_rows`` contiguous)."""
    blocks, align, columns = call.backward_layout()
    grad_input = call.recipe.grad_input  # dK/dQ read Q/K as BF16 rows
    rows = bwd_reads_rows(call.bwd_config, q.shape[2], grad_input)  # Q and Ĝ as BF16 rows
    qkv, quantize = quantize_qkv_launch(
        q, k, v, cu_seqlens, recipe=call.recipe, exact_causal=call.exact_causal,
        blocks=blocks, with_transposed=True, column_align=align, columns=columns,
        workspace=call.workspace, widen=call.bwd_config.kernel == "cute",
        q_transposed=not (rows or grad_input), q_rows=rows or grad_input, k_rows=grad_input,
    )  # fmt: skip
    qdo, quantize_grad = quantize_do_launch(
        d_out, out, m_rows, lse_rows, cu_seqlens, recipe=call.recipe, blocks=blocks,
        column_align=align, workspace=call.workspace, g_columns=not rows, g_rows=rows,
    )  # fmt: skip
    return BackwardLaunch(quantize, quantize_grad, qkv, qdo, cu_seqlens, call)


def attention_backward(
    d_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    m_rows: torch.Tensor,
    lse_rows: torch.Tensor,
    cu_seqlens: torch.Tensor,
    call: AttnCall,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dQ, dK, dV)`` in the input dtype (``flamia_serve.reference.attention_backward``)."""
    if call.bwd_work is None:
        raise RuntimeError("flamia attention: the forward ran without gradients enabled")
    if d_out.numel() == 0:  # no token or no query head: autograd's dO may have 0 strides
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    d_out, m_rows, lse_rows = d_out.contiguous(), m_rows.contiguous(), lse_rows.contiguous()
    tensors = (d_out, q, k, v, out, m_rows, lse_rows)
    if call.workspace is None or not KEEP_PREPARED:
        launch = prepare_backward(*tensors, cu_seqlens, call)
    else:
        key = ("bwd", *_layout(d_out, q, k, v, out))
        launch = _prepared(call, key, lambda: prepare_backward(*tensors, cu_seqlens, call))
    return launch(*tensors)


class EagerAttention(torch.autograd.Function):
    """Eager autograd of ``attention_forward``/``attention_backward``:
    ``apply(q, k, v, cu_seqlens, call) -> (O, M, lse)``, gradients to q, k, v."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, call: AttnCall):
        out, m_rows, lse_rows = attention_forward(q, k, v, cu_seqlens, call)
        ctx.save_for_backward(q, k, v, out, m_rows, lse_rows, cu_seqlens)
        ctx.call = call
        ctx.mark_non_differentiable(m_rows, lse_rows)
        # M and lse get no gradient: without this autograd would fill two [T, Hq] zero
        # tensors for them at every backward (two allocations and memsets per layer)
        ctx.set_materialize_grads(False)
        return out, m_rows, lse_rows

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out, _d_m, _d_lse):
        if d_out is None:  # not materialised: only if autograd ever calls it without O's
            return None, None, None, None, None
        dq, dk, dv = attention_backward(d_out, *ctx.saved_tensors, ctx.call)
        return dq, dk, dv, None, None


#: the C ``apply`` that ``autograd.Function.apply`` ends in, bound to ``EagerAttention``
_EAGER_APPLY = (
    torch._C._FunctionBase.__dict__["apply"].__get__(None, EagerAttention)
    if "apply" in torch._C._FunctionBase.__dict__
    else None
)


def eager_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, call: AttnCall
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``EagerAttention.apply(q, k, v, cu_seqlens, call)``. Outside functorch transforms it
    calls the C ``apply`` directly, as ``autograd.Function.apply`` does after its checks
    (their Python costs ~4 µs a call on the development CPU, several times that on the GPU
    hosts); inside one, ``apply`` itself (which refuses: no ``setup_context``)."""
    if _EAGER_APPLY is None or torch._C._are_functorch_transforms_active():
        return EagerAttention.apply(q, k, v, cu_seqlens, call)
    unwrap = torch._C._functorch.unwrap_if_dead  # as Function.apply does
    return _EAGER_APPLY(unwrap(q), unwrap(k), unwrap(v), unwrap(cu_seqlens), call)


# ---- custom ops: the same calls with tensor-list / int arguments ------------------------


def op_arguments(call: AttnCall) -> tuple:
    """The custom ops' non-tensor arguments for ``call`` (``attn_varlen_fwd`` rebuilds the
    call from them)."""
    w, bw, bb = call.work, call.bwd_work, call.bwd_blocks
    if w is None or call.config is None:
        raise ValueError("op_arguments needs a forward call (work list and config)")
    return (
        call.blocks.tensors(),
        [w.doc, w.tile, w.count, *(w.windows.tensors() if w.windows is not None else [])],
        [bw.doc, bw.tile, bw.count] if bw is not None else [],
        bb.tensors() if bb is not None and bw is not None else [],
        call.causal, call.recipe.name, call.exact_causal, call.softmax_scale,
        call.config.to_ints(), call.bwd_config.to_ints(),
    )  # fmt: skip


@torch.library.custom_op("flamia::attn_varlen_fwd", mutates_args=())
def attn_varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    blocks: Tensors,
    work: Tensors,
    bwd_work: Tensors,
    bwd_blocks: Tensors,
    causal: bool,
    recipe: str,
    exact_causal: bool,
    softmax_scale: float,
    config: list[int],
    bwd_config: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(O [T, Hq, d], M [T, Hq], lse [T, Hq])``; ``bwd_work``/``bwd_config`` and
    ``bwd_blocks`` (the backward's layout, empty: the forward's) are carried for the
    backward only."""
    cfg, bcfg = FwdConfig.from_ints(config), BwdConfig.from_ints(bwd_config)
    windows = ShortWindows(*work[3:], window_limit(cfg)) if cfg.windows else None
    fwd_work = WorkList(*work[:3], cfg.block_m, cfg.block_n, causal, windows=windows)
    back = WorkList(*bwd_work, bcfg.block_m, bcfg.block_n, causal, True) if bwd_work else None
    call = AttnCall(TokenBlocks(*blocks), cfg.column_align, fwd_work, back, causal,
                    RECIPES[recipe], exact_causal, softmax_scale, cfg, bcfg)  # fmt: skip
    return attention_forward(q, k, v, cu_seqlens, call)


@attn_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens, blocks, work, bwd_work, bwd_blocks, causal, recipe, exact_causal,
      softmax_scale, config, bwd_config):  # fmt: skip
    rows = q.new_empty(q.shape[:2], dtype=torch.float32)
    return torch.empty_like(q), rows, torch.empty_like(rows)


@torch.library.custom_op("flamia::attn_varlen_bwd", mutates_args=())
def attn_varlen_bwd(
    d_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    m_rows: torch.Tensor,
    lse_rows: torch.Tensor,
    cu_seqlens: torch.Tensor,
    blocks: Tensors,
    work: Tensors,
    causal: bool,
    recipe: str,
    exact_causal: bool,
    softmax_scale: float,
    config: list[int],
    column_align: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dQ, dK, dV)`` in the input dtype; ``work``/``config`` are the backward's key-tile
    list and ``BwdConfig``, ``blocks`` the token-block table of the layout to quantize into,
    aligned to ``column_align`` columns (a multiple of ``BwdConfig.column_align``)."""
    bcfg = BwdConfig.from_ints(config)
    call = AttnCall(
        TokenBlocks(*blocks), column_align, None,
        WorkList(*work, bcfg.block_m, bcfg.block_n, causal, True), causal, RECIPES[recipe],
        exact_causal, softmax_scale, None, bcfg,
    )  # fmt: skip
    return attention_backward(d_out, q, k, v, out, m_rows, lse_rows, cu_seqlens, call)


@attn_varlen_bwd.register_fake
def _(d_out, q, k, v, out, m_rows, lse_rows, cu_seqlens, blocks, work, causal, recipe,
      exact_causal, softmax_scale, config, column_align):  # fmt: skip
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    (q, k, v, cu_seqlens, blocks, _work_fwd, bwd_work, bwd_blocks, causal, recipe, exact_causal,
     softmax_scale, config, bwd_config) = inputs  # fmt: skip
    out, m_rows, lse_rows = output
    if bwd_blocks:  # the backward's own layout
        layout, column_align = bwd_blocks, BwdConfig.from_ints(bwd_config).column_align
    else:
        layout, column_align = blocks, FwdConfig.from_ints(config).column_align
    ctx.save_for_backward(q, k, v, out, m_rows, lse_rows, cu_seqlens, *layout, *bwd_work)
    ctx.n_blocks = len(layout)
    ctx.n_inputs = (len(blocks), len(_work_fwd), len(bwd_work), len(bwd_blocks))
    ctx.args = (causal, recipe, exact_causal, softmax_scale, bwd_config, column_align)
    ctx.mark_non_differentiable(m_rows, lse_rows)


def _backward(ctx, d_out, _d_m, _d_lse):
    q, k, v, out, m_rows, lse_rows, cu_seqlens, *rest = ctx.saved_tensors
    blocks, bwd_work = rest[: ctx.n_blocks], rest[ctx.n_blocks :]
    if not bwd_work:
        raise RuntimeError("flamia attention: the forward ran without gradients enabled")
    causal, recipe, exact_causal, softmax_scale, bwd_config, column_align = ctx.args
    dq, dk, dv = attn_varlen_bwd(
        d_out, q, k, v, out, m_rows, lse_rows, cu_seqlens, list(blocks), list(bwd_work),
        causal, recipe, exact_causal, softmax_scale, bwd_config, column_align,
    )  # fmt: skip
    # tensor-list inputs take a list of Nones; every other non-tensor input one None
    lists = [[None] * n for n in ctx.n_inputs]
    return dq, dk, dv, None, *lists, None, None, None, None, None, None


torch.library.register_autograd(
    "flamia::attn_varlen_fwd", _backward, setup_context=_setup_context
)
