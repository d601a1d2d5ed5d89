"""Copies between token-major tensors and the column layout, and the CuTe backward's dQ
read-back, as Triton kernels beside their torch twins.

The column layout keeps each head's codes ``[H, d, t_pad]``, tokens along the last axis at
their columns (``KernelQKV.key_columns``). torch's indexed copies into or out of it
(``index_put_`` on a permuted view, ``index_select`` of one) touch one byte per
``t_pad``-strided address: on the H200 they took ~0.6 ms per 32k-token pack, where these
kernels move a tile of columns x head-dim per program, walking the columns in order through
their inverse map (``column_tokens``), so the accesses are consecutive along the columns on
the column side and along the head dimension on the token side. ``dq_from_fragments`` reads the
backward's FP32 ``dq_acc`` at ``dq_layout.dq_fragment_index`` and writes dQ in the output
dtype in one pass (torch: a gather, then a permuted copy).

Each function runs its kernel on CUDA tensors and under Triton's CPU interpreter; its
``*_torch`` twin is the plain-torch definition (tests compare them bit for bit).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from flamia_serve.kernels._common import (
    BoundLaunch,
    TritonLaunch,
    cdiv,
    interpreted,
    sm_count,
    to_out,
)
from flamia_serve.kernels.workspace import PackWorkspace, pack_constant

#: columns per program of the copies
BLOCK_T = 64
#: the dQ read-back's tokens per program; heads per program: all, halved while the grid has
#: fewer than ``DQ_PROGRAMS_PER_SM`` programs per SM (H200, ``tune_bwd_pass.py``: W7's 8192
#: tokens 86 µs with all 32 heads per program, 68 with 8; W3's 32k tokens best with all 32)
DQ_BLOCK_T, DQ_PROGRAMS_PER_SM = 32, 6


@triton.jit
def _copy_kernel(
    src_ptr, tokens_ptr, out_ptr, t_pad, H: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    TO_COLUMNS: tl.constexpr,
):  # fmt: skip
    """One ``[BLOCK, D]`` tile (column block, head) between ``[T, H, D]`` rows and the ``[H, D,
    t_pad]`` column layout, walked in column order (``tokens[col]``: the token at ``col``,
    -1 for none): ``out[h, c, col] = src[tokens[col], h, c]``, 0 where there is no token
    (``TO_COLUMNS``), else ``out[tokens[col], h, c] = src[h, c, col]``. The column side is
    accessed whole (no per-column mask: vector accesses along the columns), the token side
    by rows (masked per row: vector accesses along the head dim). A block without tokens
    stores nothing."""
    col = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    h = tl.program_id(1)
    in_layout = col < t_pad
    tok = tl.load(tokens_ptr + col, mask=in_layout, other=-1).to(tl.int64)
    if tl.max(tok, axis=0) >= 0:
        ok = (tok >= 0)[:, None]
        c = tl.arange(0, D)
        at_rows = (tok[:, None] * H + h) * D + c[None, :]
        at_cols = (h * D + c[None, :]).to(tl.int64) * t_pad + col[:, None]
        if TO_COLUMNS:
            x = tl.load(src_ptr + at_rows, mask=ok, other=0)
            tl.store(out_ptr + at_cols, x, mask=in_layout[:, None])
        else:
            x = tl.load(src_ptr + at_cols, mask=in_layout[:, None])
            tl.store(out_ptr + at_rows, x, mask=ok)


@triton.jit
def _dq_from_fragments_kernel(
    acc_ptr, at_ptr, out_ptr, n_tokens, row_len, HQ: tl.constexpr, D: tl.constexpr,
    BLOCK: tl.constexpr, HEADS: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """``out[t, h, c] = acc[h, at[t·D + c]]`` (in ``out``'s dtype, round to nearest even)
    for one block of tokens and ``HEADS`` heads (the index is read once for them)."""
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    h0 = tl.program_id(1) * HEADS
    ok = t < n_tokens
    c = tl.arange(0, D)
    at = tl.load(at_ptr + t[:, None].to(tl.int64) * D + c[None, :], mask=ok[:, None], other=0)
    out_at = t[:, None].to(tl.int64) * (HQ * D) + h0 * D + c[None, :]
    acc_row = acc_ptr + h0.to(tl.int64) * row_len  # head h's row (64-bit however long)
    for h in range(HEADS):
        x = tl.load(acc_row + at, mask=ok[:, None], other=0.0)
        tl.store(out_ptr + out_at + h * D, to_out(x, out_ptr, INTERPRET), mask=ok[:, None])
        acc_row += row_len


_LAUNCH_COPY = TritonLaunch(_copy_kernel)
_LAUNCH_DQ = TritonLaunch(_dq_from_fragments_kernel)


def _check(cols: torch.Tensor, t_pad: int, d: int) -> None:
    if cols.dtype not in (torch.int32, torch.int64) or cols.dim() != 1:
        raise ValueError(f"columns must be a 1-D int32/int64 tensor, got {cols.dtype}")
    if d < 16 or d & (d - 1):
        raise ValueError(f"head dim {d}: the copies need a power of two >= 16")
    if t_pad >= 2**31:
        raise ValueError(f"t_pad {t_pad}: the column layout must have < 2^31 columns")


def column_tokens(columns: torch.Tensor, t_pad: int) -> torch.Tensor:
    """int32 ``[t_pad]``: the token at each column of the layout (inverse of ``columns``,
    token -> column), -1 where there is none (document padding, slack)."""
    tokens = torch.full((t_pad,), -1, dtype=torch.int32, device=columns.device)
    idx = torch.arange(columns.numel(), dtype=torch.int32, device=columns.device)
    return tokens.index_put_((columns.long(),), idx)


def pack_column_tokens(
    workspace: PackWorkspace | None, columns: torch.Tensor, column_align: int, t_pad: int
) -> torch.Tensor:
    """``column_tokens(columns, t_pad)``, made once per pack and layout (alignment and
    ``t_pad``) with a workspace, at every call without one."""
    key = ("column_tokens", column_align, t_pad)
    return pack_constant(workspace, key, lambda: column_tokens(columns, t_pad))


def _no_copy() -> None:
    """The copy of a pack without tokens."""


def _copy_launch(src: torch.Tensor, tokens: torch.Tensor, out: torch.Tensor, heads: int, d: int,
                 t_pad: int, to_columns: bool) -> BoundLaunch:  # fmt: skip
    """The copy kernel bound to its buffers, kept: calling it copies their current values
    (no argument changes between calls, so later calls launch the compiled kernel
    directly)."""
    if tokens.shape != (t_pad,) or tokens.dtype != torch.int32:
        raise ValueError(f"tokens must be an int32 [{t_pad}] tensor (column_tokens)")
    grid = (cdiv(t_pad, BLOCK_T), heads)
    args = (src.view(torch.uint8), tokens, out.view(torch.uint8), t_pad)
    options = dict(H=heads, D=d, BLOCK=BLOCK_T, TO_COLUMNS=to_columns)
    launch = BoundLaunch(_LAUNCH_COPY, grid, args, options, {})
    launch.keep()
    return launch


def rows_from_columns_launch(
    src: torch.Tensor, columns: torch.Tensor, out: torch.Tensor, tokens: torch.Tensor | None = None
) -> Callable[[], None]:
    """:func:`rows_from_columns` into ``out`` (contiguous ``[T, H, d]``, a 1-byte dtype),
    prepared: ``copy()`` copies ``src``'s current codes (the same buffers at every call)."""
    heads, d, t_pad = src.shape
    _check(columns, t_pad, d)
    if not src.is_contiguous():
        raise ValueError("src must be a contiguous [H, d, t_pad] tensor")
    n = columns.numel()
    if out.shape != (n, heads, d) or out.element_size() != 1 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous 1-byte [{n}, {heads}, {d}] tensor")
    if not n:
        return _no_copy
    tokens = column_tokens(columns, t_pad) if tokens is None else tokens
    return _copy_launch(src, tokens, out, heads, d, t_pad, False)


def rows_from_columns(
    src: torch.Tensor,
    columns: torch.Tensor,
    out: torch.Tensor | None = None,
    tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token-major ``[T, H, d]`` copy of the column-layout ``src`` ``[H, d, t_pad]`` (a
    1-byte dtype) at ``columns [T]``; ``out``: where to write it (else a new tensor);
    ``tokens``: ``column_tokens(columns, t_pad)`` when the caller keeps it (else built)."""
    if out is None:
        heads, d, _t_pad = src.shape
        out = torch.empty(columns.numel(), heads, d, dtype=src.dtype, device=src.device)
    rows_from_columns_launch(src, columns, out, tokens)()
    return out


def rows_from_columns_torch(src: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Twin of :func:`rows_from_columns`."""
    return src.permute(2, 0, 1)[columns.long()].contiguous()


def columns_from_rows_launch(
    rows: torch.Tensor, columns: torch.Tensor, out: torch.Tensor, tokens: torch.Tensor | None = None
) -> Callable[[], None]:
    """:func:`columns_from_rows` of contiguous ``rows`` prepared: ``copy()`` copies their
    current codes (the same buffers at every call)."""
    n, heads, d = rows.shape
    _check(columns, out.shape[2], d)
    if out.shape[:2] != (heads, d) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{heads}, {d}, t_pad] tensor")
    if not rows.is_contiguous():
        raise ValueError("rows must be a contiguous [T, H, d] tensor")
    if not n:
        return _no_copy
    t_pad = out.shape[2]
    tokens = column_tokens(columns, t_pad) if tokens is None else tokens
    return _copy_launch(rows, tokens, out, heads, d, t_pad, True)


def columns_from_rows(
    rows: torch.Tensor,
    columns: torch.Tensor,
    out: torch.Tensor,
    tokens: torch.Tensor | None = None,
) -> None:
    """Write token-major ``rows`` ``[T, H, d]`` (a 1-byte dtype) into the column layout
    ``out`` ``[H, d, t_pad]`` at ``columns [T]``, zero into the columns without a token
    that share a 64-column block with one (others are left as they are: keep ``out``'s
    padding zero); ``tokens`` as for :func:`rows_from_columns`."""
    columns_from_rows_launch(rows.contiguous(), columns, out, tokens)()


def columns_from_rows_torch(rows: torch.Tensor, columns: torch.Tensor, out: torch.Tensor) -> None:
    """Twin of :func:`columns_from_rows`."""
    blocks = torch.unique(columns.long() // BLOCK_T)
    spans = (blocks[:, None] * BLOCK_T + torch.arange(BLOCK_T, device=out.device)).flatten()
    out.view(torch.uint8)[:, :, spans[spans < out.shape[2]]] = 0
    out.permute(2, 0, 1)[columns.long()] = rows


def dq_heads_per_program(n_tokens: int, heads: int, device: torch.device) -> int:
    """The read-back's heads per program: a divisor of ``heads``, all of them unless the
    grid would then have fewer than ``DQ_PROGRAMS_PER_SM`` programs per SM."""
    if device.type != "cuda":
        return heads
    target = DQ_PROGRAMS_PER_SM * sm_count(device)
    group = heads
    while group > 1 and cdiv(n_tokens, DQ_BLOCK_T) * (heads // group) < target:
        group = math.gcd(heads, group // 2)
    return group


class DQReadBack:
    """:func:`dq_from_fragments` of one accumulator and index, prepared: ``read()`` returns a
    new dQ ``[T, Hq, d]`` from the accumulator's current values (one kept launch)."""

    def __init__(
        self, dq_acc: torch.Tensor, at: torch.Tensor, d: int, out_dtype: torch.dtype,
        *, block_t: int = DQ_BLOCK_T, heads_per_program: int | None = None,
    ) -> None:  # fmt: skip
        heads = dq_acc.shape[0]
        if d < 16 or d & (d - 1):
            raise ValueError(f"head dim {d}: the read-back needs a power of two >= 16")
        if block_t < 1 or block_t & (block_t - 1):
            raise ValueError(f"block_t {block_t}: tokens per program must be a power of two")
        if heads_per_program is not None and heads_per_program < 1:
            raise ValueError(f"heads_per_program {heads_per_program}: must be at least 1")
        if at.numel() % d or not dq_acc.is_contiguous():
            raise ValueError(f"at must hold T·{d} offsets and dq_acc be contiguous")
        n_tokens = at.numel() // d
        self.shape, self.dtype, self.device = (n_tokens, heads, d), out_dtype, dq_acc.device
        self.launch: BoundLaunch | None = None
        self._first: torch.Tensor | None = None  # the first call's output
        if n_tokens:
            if heads_per_program is None:
                heads_per_program = dq_heads_per_program(n_tokens, heads, dq_acc.device)
            group = math.gcd(heads, heads_per_program)
            grid = (cdiv(n_tokens, block_t), heads // group)
            out = self._first = self._empty()
            args = (dq_acc, at, out, n_tokens, dq_acc[0].numel())
            options = dict(HQ=heads, D=d, BLOCK=block_t, HEADS=group, INTERPRET=interpreted())
            self.launch = BoundLaunch(_LAUNCH_DQ, grid, args, options, {"out": out})
            self.launch.keep()

    def _empty(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def __call__(self) -> torch.Tensor:
        out, self._first = self._first, None
        if out is None:
            out = self._empty()
        if self.launch is not None:
            self.launch(out=out)
        return out


def dq_from_fragments(
    dq_acc: torch.Tensor, at: torch.Tensor, d: int, out_dtype: torch.dtype,
    *, block_t: int = DQ_BLOCK_T, heads_per_program: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """dQ ``[T, Hq, d]`` in ``out_dtype`` from the CuTe backward's FP32 accumulator
    ``dq_acc`` (``[Hq, ...]``, contiguous) and its int32 index ``at [T·d]``
    (``attn_bwd.dq_layout.dq_fragment_index``). A program reads ``block_t`` tokens of
    ``heads_per_program`` heads (its gcd with Hq; default :func:`dq_heads_per_program`)."""
    read = DQReadBack(
        dq_acc, at, d, out_dtype, block_t=block_t, heads_per_program=heads_per_program
    )
    return read()


def dq_from_fragments_torch(
    dq_acc: torch.Tensor, at: torch.Tensor, d: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """Twin of :func:`dq_from_fragments`."""
    heads = dq_acc.shape[0]
    picked = torch.index_select(dq_acc.reshape(heads, -1), 1, at).view(heads, -1, d)
    return picked.permute(1, 0, 2).to(out_dtype).contiguous()
