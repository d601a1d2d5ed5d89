"""Where the CuTe backward's dQ accumulator holds each value (torch only, no CuTe import).

The kernel's consumer warpgroups stage each dQᵀ product piece (64 head-dim rows x ``step``
queries, FP32) to shared memory as it lies in their ``wgmma`` accumulator registers (16-byte
stores: thread t's n-th four values at ``512·n + 4·t``) and bulk-add the step's pieces to
one block of ``dq_acc [Hq, t_pad / step, step·d]``: block b covers the column-layout
positions ``[b·step, (b + 1)·step)``, i.e. ``step`` consecutive tokens of one document (a
document's columns start at a multiple of 128 and keep its tokens in order)."""

from __future__ import annotations

import torch


def dq_fragment_index(columns: torch.Tensor, step: int, d: int) -> torch.Tensor:
    """int32 ``[T·d]``, token-major: the offset in ``dq_acc[h].view(-1)`` of dQ for the token
    whose natural column (document column start + index in the document) is ``columns [T]``
    and head-dim column c. Hopper's 64xN accumulator gives thread t = 32w + 4r + m rows
    16w + 8h + r and columns 8k + 2m + c' (value e = c' + 2h + 4k), so query q = 8k + 2m + c'
    and head-dim column 64·p + 16w + 8h + r sit at ``(p·step/8 + k)·512 + 128w + 16r + 4m +
    2h + c'`` in its block: a part from the query plus a part from the column."""
    if step % 8 or d % 64:
        raise ValueError(f"step {step} / d {d}: need multiples of 8 / 64")
    block, q = columns // step, columns % step
    q_part = block * (step * d) + (q // 8) * 512 + (q % 8 // 2) * 4 + q % 2
    c = torch.arange(d, device=columns.device)
    piece, row = c // 64, c % 64
    c_part = piece * (step // 8) * 512 + (row // 16) * 128 + (row % 8) * 16 + (row % 16 // 8) * 2
    return (q_part[:, None] + c_part[None, :]).reshape(-1).to(torch.int32)
