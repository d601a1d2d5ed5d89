"""``dq_fragment_index`` against an emulation of the Hopper accumulator and staging copy."""

import pytest
import torch

from flamia_serve.kernels.attn_bwd.dq_layout import dq_fragment_index


def _block_offsets(step: int, d: int) -> dict[tuple[int, int], int]:
    """(query, head-dim column) -> offset in a step's block, by walking the registers: thread
    t, value e of piece p holds row (t % 32) // 4 + 16·(t // 32) + 8·((e // 2) % 2) and column
    2·(t % 4) + e % 2 + 8·(e // 4) of the 64 x step accumulator (CUTLASS's 64xN GMMA C
    layout); the staging copy puts its four-value group n = e // 4 at 512·n + 4·t + e % 4."""
    offsets = {}
    for p in range(d // 64):
        for t in range(128):
            for e in range(step // 2):
                row = (t % 32) // 4 + 16 * (t // 32) + 8 * ((e // 2) % 2)
                col = 2 * (t % 4) + e % 2 + 8 * (e // 4)
                offsets[(col, 64 * p + row)] = p * 64 * step + (e // 4) * 512 + 4 * t + e % 4
    return offsets


@pytest.mark.parametrize(("step", "d"), [(64, 128), (32, 128), (64, 64)])
def test_dq_fragment_index_matches_the_register_walk(step, d):
    offsets = _block_offsets(step, d)
    assert sorted(offsets.values()) == list(range(step * d))  # a permutation of a block
    columns = torch.tensor([0, 5, step - 1, step, 3 * step + 7, 4 * step + 1])
    got = dq_fragment_index(columns, step, d).view(len(columns), d)
    for i, col in enumerate(columns.tolist()):
        block, q = divmod(col, step)
        want = [block * step * d + offsets[(q, c)] for c in range(d)]
        assert got[i].tolist() == want


def test_dq_fragment_index_refuses_other_shapes():
    with pytest.raises(ValueError, match="step 12"):
        dq_fragment_index(torch.arange(4), 12, 128)
