"""Standard training-attention workloads W1..W9 (DESIGN.md section 7).

Nine packed microbatches of causal attention, Hq=32, Hkv=8, d=128, BF16 inputs:

| T     | one document | uniform in [256, 4096] | skewed: T/2 + power law in [64, 512] |
|-------|--------------|------------------------|--------------------------------------|
| 8192  | W1           | W4                     | W7                                   |
| 16384 | W2           | W5                     | W8                                   |
| 32768 | W3           | W6                     | W9                                   |

Lengths are drawn with numpy from a generator seeded by ``(SEED, T, kind)``, so each
workload is the same on every machine and independent of the order it is built in. The
last document of a microbatch is cut so the lengths sum to T exactly (it may be short,
even a single token).

Skewed power law: after the first document of T/2, lengths follow a bounded continuous
power law ``p(L) ∝ L^-POWER_LAW_ALPHA`` on [64, 512] (alpha = 1.5, sampled by inverse CDF
and floored to an integer), so short documents dominate while a tail reaches 512.

Pack families beyond W1–W9 (issue 16: shapes a new user brings), each with its own heads
and head dim:

| name | heads Hq/Hkv, d | T | documents |
|------|-----------------|---|-----------|
| P1 | 32/8, 64 | 16384 | thousands of short ones: power law on [1, 2048], alpha 1.8 |
| P2 | 32/8, 256 | 8192 | one |
| P3 | 16/16 (MHA), 128 | 16384 | odd lengths uniform in [1, 4097] |
| P4 | 32/8, 128 | 32768 | heavy-tailed: power law on [1, 8192], alpha 1.5 |
| P5 | 32/8, 128 | 65536 | one |

Documents per pack (``E1``, ``E4``, ``E16``, ``E64``, ``E128``): T = 16384 cut into that many
documents of one length (16384 .. 128 tokens), Hq/Hkv 32/8, d = 128. Fitting a kernel's time
against key tiles and items over them separates what an item costs beside its key tiles.

Imports only numpy and torch (no GPU, no triton needed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

HQ = 32
HKV = 8
HEAD_DIM = 128
SEED = 20261129
POWER_LAW_ALPHA = 1.5

# name -> (total tokens T, kind)
_TABLE: dict[str, tuple[int, str]] = {
    "W1": (8192, "single"),
    "W2": (16384, "single"),
    "W3": (32768, "single"),
    "W4": (8192, "uniform"),
    "W5": (16384, "uniform"),
    "W6": (32768, "uniform"),
    "W7": (8192, "skewed"),
    "W8": (16384, "skewed"),
    "W9": (32768, "skewed"),
}
_KIND_ID = {"single": 0, "uniform": 1, "skewed": 2, "short": 3, "odd": 4, "heavy": 5}

WORKLOADS: tuple[str, ...] = tuple(_TABLE)

# name -> (T, kind, Hq, Hkv, d): the pack families
_FAMILIES: dict[str, tuple[int, str, int, int, int]] = {
    "P1": (16384, "short", 32, 8, 64),
    "P2": (8192, "single", 32, 8, 256),
    "P3": (16384, "odd", 16, 16, 128),
    "P4": (32768, "heavy", 32, 8, 128),
    "P5": (65536, "single", 32, 8, 128),
}
PACK_FAMILIES: tuple[str, ...] = tuple(_FAMILIES)

#: documents per pack, all of one length (issue 16: what an item costs beside its key
#: tiles): ``E<n>`` is T = 16384 in n equal documents, Hq/Hkv 32/8, d = 128
EQUAL_TOKENS = 16384
EQUAL_PACKS: tuple[str, ...] = ("E1", "E4", "E16", "E64", "E128")


@dataclass
class Workload:
    """One packed microbatch: document lengths that sum to ``total_tokens``, and the heads
    and head dim of its attention."""

    name: str
    total_tokens: int
    seqlens: list[int]
    kind: str = "single"
    hq: int = HQ
    hkv: int = HKV
    head_dim: int = HEAD_DIM

    @property
    def max_seqlen(self) -> int:
        """Longest document in the microbatch."""
        return max(self.seqlens)

    @property
    def num_docs(self) -> int:
        """Number of documents B."""
        return len(self.seqlens)

    def cu_seqlens(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Cumulative lengths, shape ``[B + 1]``, dtype ``torch.int32``, starting at 0."""
        cu = np.concatenate([[0], np.cumsum(self.seqlens)])
        return torch.tensor(cu, dtype=torch.int32, device=device)

    def flops(self) -> float:
        """Causal forward FLOPs of this workload (DESIGN section 6)."""
        return causal_flops(self.seqlens, self.hq, self.head_dim)

    def definition(self) -> dict:
        """What a results file records of the workload: tokens, kind, heads, head dim, the
        document lengths and the forward FLOPs its TFLOP/s divide."""
        return {"total_tokens": self.total_tokens, "kind": self.kind, "hq": self.hq,
                "hkv": self.hkv, "d": self.head_dim, "docs": self.num_docs,
                "fwd_flops": self.flops(), "seqlens": list(self.seqlens)}  # fmt: skip


def causal_flops(seqlens: list[int], hq: int, d: int) -> float:
    """Causal forward FLOPs ``2·2·Σ_doc(L²/2)·Hq·d`` (score + PV); backward is 2.5x."""
    return 2.0 * 2.0 * sum(float(n) * float(n) / 2.0 for n in seqlens) * hq * d


def _fill(first: list[int], total: int, draw: Callable[[], int]) -> list[int]:
    """Append ``draw()`` lengths until ``total`` is reached, cutting the last one."""
    lens = list(first)
    used = sum(lens)
    while used < total:
        n = min(int(draw()), total - used)
        lens.append(n)
        used += n
    return lens


def _power_law(rng: np.random.Generator, lo: int, hi: int, alpha: float) -> int:
    """One draw from ``p(L) ∝ L^-alpha`` on [lo, hi] (alpha != 1), floored."""
    a, b, e = float(lo), float(hi), 1.0 - alpha
    u = rng.random()
    x = (a**e + u * (b**e - a**e)) ** (1.0 / e)
    return int(min(max(np.floor(x), lo), hi))


def document_lengths(total: int, kind: str, seed: int = SEED) -> list[int]:
    """Deterministic document lengths for one microbatch of ``total`` tokens."""
    rng = np.random.default_rng([seed, total, _KIND_ID[kind]])
    if kind == "single":
        return [total]
    if kind == "uniform":
        return _fill([], total, lambda: int(rng.integers(256, 4096, endpoint=True)))
    if kind == "skewed":
        return _fill([total // 2], total, lambda: _power_law(rng, 64, 512, POWER_LAW_ALPHA))
    if kind == "short":
        return _fill([], total, lambda: _power_law(rng, 1, 2048, 1.8))
    if kind == "odd":
        return _fill([], total, lambda: 2 * int(rng.integers(0, 2048, endpoint=True)) + 1)
    if kind == "heavy":
        return _fill([], total, lambda: _power_law(rng, 1, 8192, POWER_LAW_ALPHA))
    raise ValueError(f"unknown workload kind {kind!r}")


def training_workload(name: str) -> Workload:
    """Build workload ``name``: standard (``"W1"`` .. ``"W9"``) or a pack family (``"P1"`` ..)."""
    if name in _TABLE:
        total, kind = _TABLE[name]
        heads = (HQ, HKV, HEAD_DIM)
    elif name in EQUAL_PACKS:
        n = int(name[1:])
        return Workload(name, EQUAL_TOKENS, [EQUAL_TOKENS // n] * n, "equal")
    elif name in _FAMILIES:
        total, kind, *heads = _FAMILIES[name]
    else:
        raise ValueError(
            f"unknown workload {name!r}; expected one of "
            f"{', '.join(WORKLOADS + PACK_FAMILIES + EQUAL_PACKS)}"
        )
    lens = document_lengths(total, kind)
    assert sum(lens) == total and min(lens) >= 1
    return Workload(name, total, lens, kind, *heads)


if __name__ == "__main__":
    for _name in WORKLOADS + PACK_FAMILIES + EQUAL_PACKS:
        _w = training_workload(_name)
        print(
            f"{_w.name}: T={_w.total_tokens:6d} kind={_w.kind:8s} docs={_w.num_docs:4d} "
            f"max={_w.max_seqlen:6d} min={min(_w.seqlens):5d} "
            f"fwd GFLOP={_w.flops() / 1e9:9.1f}"
        )
