"""Buffers reused by the attention calls of one pack (the eager host path).

A training step calls attention once per layer on the same pack, with a plan
(``VarlenPlan``). The quantized operands of a call live only inside it, so the next call
can write them into the same buffers: with ``PackWorkspace`` a call with a plan skips ~20
allocations and the memsets of the column layout's padding.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

#: tickets handed out before the ring is zeroed again (one memset per that many calls)
TICKETS = 1024


class PackWorkspace:
    """Scratch buffers of one pack's kernel calls on one device and one stream.

    Work in one stream runs in order, so a buffer a call writes and then reads is free again
    when the next call's kernels start; another stream gets another workspace
    (``VarlenPlan.workspace``). Nothing returned to a caller lives here: outputs (O, M,
    lse, dQ, dK, dV) are allocated per call.

    * ``empty(name, shape, dtype)``: contents undefined; the caller writes what it reads.
    * ``zeroed(name, shape, dtype)``: zero when created, for buffers whose written elements
      are the same in every call (the pack's layout fixes them): the rest stays zero, so the
      per-call memset is not needed.
    * ``cached(name, build)``: ``build()``'s tensor, made in the first call only (values the
      pack alone fixes, e.g. an index into a kernel's accumulator layout).
    * ``ticket()``: an int32 zero that a persistent kernel counts up (from a ring of zeros
      that one memset refills every ``TICKETS`` calls).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[Hashable, torch.Tensor] = {}
        self._tickets: list[torch.Tensor] = []
        self._ring: torch.Tensor | None = None

    def empty(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        key = (name, shape, dtype)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(shape, dtype=dtype, device=self.device)
        return buf

    def zeroed(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        key = ("zeroed", name, shape, dtype)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.zeros(shape, dtype=dtype, device=self.device)
        return buf

    def cached(self, name: Hashable, build: Callable[[], torch.Tensor]) -> torch.Tensor:
        key = ("cached", name)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = build()
        return buf

    def ticket(self) -> torch.Tensor:
        if not self._tickets:
            if self._ring is None:  # 16 bytes per ticket: every one is 16-byte aligned
                self._ring = torch.zeros(4 * TICKETS, dtype=torch.int32, device=self.device)
            else:  # every earlier ticket's kernel precedes this memset in the stream
                self._ring.zero_()
            self._tickets = [self._ring[i : i + 1] for i in range(4 * TICKETS - 4, -1, -4)]
        return self._tickets.pop()

    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def zero_counter(workspace: PackWorkspace | None, device: torch.device) -> torch.Tensor:
    """An int32 zero for a persistent grid's item counter: the workspace's next ticket, or
    a new tensor without one."""
    if workspace is not None:
        return workspace.ticket()
    return torch.zeros(1, dtype=torch.int32, device=device)


def zeroed_accumulator(
    workspace: PackWorkspace | None, shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """A float32 buffer set to zero now (an atomics accumulator): the workspace's, or a new
    tensor without one."""
    if workspace is not None:
        return workspace.empty("accumulator", shape, torch.float32).zero_()
    return torch.zeros(shape, dtype=torch.float32, device=device)


def pack_constant(
    workspace: PackWorkspace | None, name: Hashable, build: Callable[[], torch.Tensor]
) -> torch.Tensor:
    """``build()``'s tensor, made once per workspace (``PackWorkspace.cached``), or at every
    call without one."""
    return build() if workspace is None else workspace.cached(name, build)
