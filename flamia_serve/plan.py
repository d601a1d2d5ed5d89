"""Per-microbatch plan: validated ``cu_seqlens`` plus the GPU-built schedules.

Build once per packed microbatch (one host sync, for validation) and pass to every
attention call of the step: no further host synchronisation, and the token-block table
and work lists are reused across layers and by the backward, as are the eager calls'
checked arguments and kernel buffers (``workspace``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flamia_serve.kernels.schedule import (
    TokenBlocks,
    WorkList,
    build_key_work_list,
    build_work_list,
    token_block_table,
)
from flamia_serve.kernels.workspace import PackWorkspace
from flamia_serve.numerics.checks import check_cu_seqlens, check_max_seqlen
from flamia_serve.numerics.operands import V_T_ALIGN, token_columns


@dataclass(frozen=True)
class VarlenPlan:
    """Schedules of one pack; ``work_list`` builds (and caches) one per tile shape,
    ``token_blocks`` one token-block table per column alignment (``blocks``: the default,
    ``V_T_ALIGN``), ``token_columns`` the tokens' columns in that layout.

    ``workspace(device, stream)``: the kernel buffers the eager calls on this pack reuse
    (quantized operands, column-layout copies, the backward's accumulator), held as long
    as the plan is: one set per stream and shape, whatever the number of layers.
    ``calls``: what ``flamia_attn_varlen`` keeps per call signature (checked arguments,
    configs, schedules). ``reuse=False``: neither is kept (a plan made for one call)."""

    cu_seqlens: torch.Tensor
    total_tokens: int
    max_seqlen: int
    blocks: TokenBlocks
    reuse: bool = True
    #: ``cu_seqlens._version`` when planned (-1 inside ``torch.compile``): an in-place change
    #: of ``cu_seqlens`` afterwards makes the plan stale (``check_call`` refuses it)
    cu_version: int = -1
    _work: dict[tuple, WorkList] = field(default_factory=dict, repr=False)
    _blocks: dict[int, TokenBlocks] = field(default_factory=dict, repr=False)
    _columns: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _workspaces: dict[tuple, PackWorkspace] = field(default_factory=dict, repr=False)
    calls: dict[tuple, object] = field(default_factory=dict, repr=False)

    def check_call(
        self, total_tokens: int, cu_seqlens: torch.Tensor, max_seqlen: object, compiling: bool
    ) -> None:
        """A call with this plan must pass the same ``cu_seqlens`` tensor, unchanged since
        planning, ``max_seqlen`` and q/k/v of ``total_tokens`` tokens (``ValueError`` names
        what differs): the kernels trust the plan's schedules, sized for its pack.
        ``compiling``: ``torch.compiler.is_compiling()`` (traced calls skip the version)."""
        if self.cu_seqlens is not cu_seqlens:
            raise ValueError("plan was built for another cu_seqlens tensor")
        if self.cu_version >= 0 and not compiling and cu_seqlens._version != self.cu_version:
            raise ValueError(
                "cu_seqlens was modified in place after plan_varlen built the plan: build a new "
                "plan for the new values"
            )
        if total_tokens != self.total_tokens:
            raise ValueError(
                f"q has {total_tokens} tokens but the plan was built for {self.total_tokens}"
            )
        if max_seqlen != self.max_seqlen:
            raise ValueError(
                f"max_seqlen ({max_seqlen}) differs from the plan's ({self.max_seqlen})"
            )

    def workspace(self, device: torch.device, stream: int | None) -> PackWorkspace:
        """The buffers of this pack's calls on ``device`` in the stream ``stream`` (a CUDA
        stream's ``cuda_stream`` handle; ``None`` off CUDA)."""
        key = (device, stream)
        if key not in self._workspaces:
            self._workspaces[key] = PackWorkspace(device)
        return self._workspaces[key]

    def workspace_bytes(self) -> int:
        """Bytes held by this plan's workspaces."""
        return sum(ws.nbytes() for ws in self._workspaces.values())

    def token_blocks(self, align: int) -> TokenBlocks:
        """The token-block table whose documents start at multiples of ``align`` columns
        (``FwdConfig.column_align`` of the forward that reads the layout)."""
        if align == V_T_ALIGN:
            return self.blocks
        if align not in self._blocks:
            self._blocks[align] = token_block_table(self.cu_seqlens, self.total_tokens,
                                                    align=align)  # fmt: skip
        return self._blocks[align]

    def token_columns(self, align: int) -> torch.Tensor:
        """int64 ``[T]``: each token's column in the layout of ``token_blocks(align)``."""
        if align not in self._columns:
            self._columns[align] = token_columns(
                self.cu_seqlens, self.token_blocks(align).doc_v_t_start, self.total_tokens
            )
        return self._columns[align]

    def work_list(
        self, block_m: int, block_n: int, causal: bool, window_limit: int = 0
    ) -> WorkList:
        """The forward's list of query tiles (built once per tile shape and window limit:
        documents of at most ``window_limit`` tokens go to its windows)."""
        key = (block_m, block_n, causal, False, window_limit)
        if key not in self._work:
            self._work[key] = build_work_list(
                self.cu_seqlens, self.total_tokens, block_m=block_m, block_n=block_n,
                causal=causal, window_limit=window_limit,
            )  # fmt: skip
        return self._work[key]

    def key_work_list(self, block_n: int, block_m: int, causal: bool) -> WorkList:
        """The backward's list of key tiles (built once per tile shape)."""
        key = (block_m, block_n, causal, True)
        if key not in self._work:
            self._work[key] = build_key_work_list(
                self.cu_seqlens, self.total_tokens, block_n=block_n, block_m=block_m, causal=causal
            )
        return self._work[key]


def plan_varlen(
    cu_seqlens: torch.Tensor,
    total_tokens: int,
    max_seqlen: int,
    *,
    validate: bool = True,
    reuse: bool = True,
) -> VarlenPlan:
    """Plan a pack; with ``validate`` (default) first check ``cu_seqlens`` ([B+1] int32:
    0 … T, non-decreasing) and ``max_seqlen`` on the host (one sync). ``validate=False``
    builds the schedules on the device only (inside ``torch.compile``, CUDA graphs).
    ``reuse``: eager calls with this plan keep their checked arguments and kernel buffers
    for the next call (``VarlenPlan.workspace``; held as long as the plan is)."""
    if validate:
        device = cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else torch.device("cpu")
        check_max_seqlen(max_seqlen, check_cu_seqlens(cu_seqlens, total_tokens, device))
    blocks = token_block_table(cu_seqlens, total_tokens)
    version = -1 if torch.compiler.is_compiling() else cu_seqlens._version
    return VarlenPlan(cu_seqlens, total_tokens, max_seqlen, blocks, reuse, version)
