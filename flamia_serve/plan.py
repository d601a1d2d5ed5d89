"""Per-microbatch plan: validated ``cu_seqlens`` plus the GPU-built schedules.

Build once per packed microbatch (one host sync, for validation) and pass to every
attention call of the step: no further host synchronisation, and the token-block table
and work lists are reused across layers and by the backward.
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
from flamia_serve.numerics.checks import check_cu_seqlens, check_max_seqlen
from flamia_serve.numerics.operands import V_T_ALIGN, token_columns


@dataclass(frozen=True)
class VarlenPlan:
    """Schedules of one pack; ``work_list`` builds (and caches) one per tile shape,
    ``token_blocks`` one token-block table per column alignment (``blocks``: the default,
    ``V_T_ALIGN``), ``token_columns`` the tokens' columns in that layout."""

    cu_seqlens: torch.Tensor
    total_tokens: int
    max_seqlen: int
    blocks: TokenBlocks
    _work: dict[tuple[int, int, bool], WorkList] = field(default_factory=dict, repr=False)
    _blocks: dict[int, TokenBlocks] = field(default_factory=dict, repr=False)
    _columns: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

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

    def work_list(self, block_m: int, block_n: int, causal: bool) -> WorkList:
        """The forward's list of query tiles (built once per tile shape)."""
        key = (block_m, block_n, causal, False)
        if key not in self._work:
            self._work[key] = build_work_list(
                self.cu_seqlens, self.total_tokens, block_m=block_m, block_n=block_n, causal=causal
            )
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
    cu_seqlens: torch.Tensor, total_tokens: int, max_seqlen: int, *, validate: bool = True
) -> VarlenPlan:
    """Plan a pack; with ``validate`` (default) first check ``cu_seqlens`` ([B+1] int32:
    0 … T, non-decreasing) and ``max_seqlen`` on the host (one sync). ``validate=False``
    builds the schedules on the device only (inside ``torch.compile``, CUDA graphs)."""
    if validate:
        device = cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else torch.device("cpu")
        check_max_seqlen(max_seqlen, check_cu_seqlens(cu_seqlens, total_tokens, device))
    blocks = token_block_table(cu_seqlens, total_tokens)
    return VarlenPlan(cu_seqlens, total_tokens, max_seqlen, blocks)
