"""``benchmarks/fit_stage_parts.py``: the part size that fits one device call beside the tree."""

from __future__ import annotations

import pytest

from benchmarks.fit_stage_parts import CALL_BYTES, part_limit, tree_bytes


def test_part_limit_leaves_room_for_the_tree() -> None:
    tree = tree_bytes()
    assert 0 < tree < CALL_BYTES
    assert part_limit(tree, 1024) == CALL_BYTES - tree - 1024
    with pytest.raises(ValueError, match="no room"):
        part_limit(CALL_BYTES - 2**20, 0)
