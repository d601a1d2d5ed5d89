"""The column-layout copies and the dQ read-back against their torch twins, bit for bit
(CPU: Triton's interpreter; GPU: the kernels)."""

import pytest
import torch

from flamia_serve.kernels.attn_bwd.dq_layout import dq_fragment_index
from flamia_serve.kernels.columns import (
    DQReadBack,
    columns_from_rows,
    columns_from_rows_launch,
    columns_from_rows_torch,
    dq_from_fragments,
    dq_from_fragments_torch,
    rows_from_columns,
    rows_from_columns_launch,
    rows_from_columns_torch,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _columns(lens: list[int], align: int = 128) -> tuple[torch.Tensor, int]:
    """Each document's tokens at consecutive columns from a multiple of ``align``."""
    cols, start = [torch.zeros(0, dtype=torch.int64)], 0
    for n in lens:
        cols.append(torch.arange(start, start + n))
        start += -(-n // align) * align
    return torch.cat(cols).to(device=DEV, dtype=torch.int64), start + align


def _codes(shape: tuple[int, ...]) -> torch.Tensor:
    """Random E4M3 bytes, NaN codes included (a copy must move them bit for bit)."""
    return torch.randint(0, 256, shape, dtype=torch.uint8, device=DEV).view(torch.float8_e4m3fn)


@pytest.mark.parametrize(
    ("lens", "heads", "d"), [((5, 130, 1), 2, 64), ((70,), 1, 128), ((), 2, 64)]
)
def test_column_copies_match_torch(lens, heads, d) -> None:
    cols, t_pad = _columns(list(lens))
    src = _codes((heads, d, t_pad))
    got = rows_from_columns(src, cols.to(torch.int32))
    assert torch.equal(got.view(torch.uint8), rows_from_columns_torch(src, cols).view(torch.uint8))
    rows = _codes((cols.numel(), heads, d))
    fill = _codes((heads, d, t_pad))
    out, want = fill.clone(), fill.clone()
    columns_from_rows(rows, cols, out)
    columns_from_rows_torch(rows, cols, want)
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))  # others untouched


@pytest.mark.parametrize("align", [16, 128])
def test_column_copies_on_a_plan_layout(align) -> None:
    """The layout a plan builds (tokens permuted within each 16-column group, documents at
    multiples of ``align``): ``column_tokens`` inverts ``columns`` and both copies, with the
    map passed in or built, match their twins bit for bit."""
    from flamia_serve import plan_varlen
    from flamia_serve.kernels.columns import column_tokens

    lens = [1, 47, 200, 16, 3]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    cols = plan_varlen(cu, sum(lens), max(lens)).token_columns(align)
    t_pad = (int(cols.max()) // align + 1) * align + 64
    assert not torch.equal(cols, cols.sort().values)  # permuted within the groups
    tokens = column_tokens(cols, t_pad)
    assert tokens.dtype == torch.int32 and int((tokens >= 0).sum()) == sum(lens)
    assert torch.equal(tokens[cols].long(), torch.arange(sum(lens), device=DEV))
    src = _codes((3, 64, t_pad))
    want = rows_from_columns_torch(src, cols).view(torch.uint8)
    for kw in ({}, {"tokens": tokens}):
        assert torch.equal(rows_from_columns(src, cols, **kw).view(torch.uint8), want)
        rows, fill = _codes((sum(lens), 3, 64)), _codes((3, 64, t_pad))
        out, ref = fill.clone(), fill.clone()
        columns_from_rows(rows, cols, out, **kw)
        columns_from_rows_torch(rows, cols, ref)
        assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))
    with pytest.raises(ValueError, match="tokens must be an int32"):
        rows_from_columns(src, cols, tokens=tokens[:-1])


def test_prepared_copies_and_read_back_follow_their_buffers() -> None:
    """The prepared forms (the eager path keeps them per pack) copy the buffers' values at
    each call, not the values they were prepared with; the read-back returns a new dQ per
    call."""
    cols, t_pad = _columns([5, 130, 1])
    src, rows = _codes((2, 64, t_pad)), _codes((cols.numel(), 2, 64))
    out_rows = torch.empty(cols.numel(), 2, 64, dtype=torch.uint8, device=DEV)
    out_cols = torch.zeros(2, 64, t_pad, dtype=torch.uint8, device=DEV)
    gather = rows_from_columns_launch(src, cols, out_rows)
    scatter = columns_from_rows_launch(rows.view(torch.uint8), cols, out_cols)
    at = dq_fragment_index(cols, 64, 64)
    acc = torch.randn(2, t_pad // 64, 64 * 64, device=DEV)
    read = DQReadBack(acc, at, 64, torch.bfloat16)
    firsts = []
    for _ in range(2):
        gather()
        scatter()
        assert torch.equal(out_rows, rows_from_columns_torch(src, cols).view(torch.uint8))
        want = torch.zeros_like(out_cols)
        columns_from_rows_torch(rows.view(torch.uint8), cols, want)
        assert torch.equal(out_cols, want)
        got = read()
        assert torch.equal(got, dq_from_fragments_torch(acc, at, 64, torch.bfloat16))
        firsts.append(got)
        src.copy_(_codes(src.shape))  # new values in the same buffers
        rows.copy_(_codes(rows.shape))
        acc.normal_()
    assert firsts[0].data_ptr() != firsts[1].data_ptr()
    assert not torch.equal(firsts[0], firsts[1])
    with pytest.raises(ValueError, match="out must be a contiguous 1-byte"):
        rows_from_columns_launch(src, cols, out_rows[:-1])
    with pytest.raises(ValueError, match="rows must be a contiguous"):
        columns_from_rows_launch(rows.transpose(0, 1).contiguous().transpose(0, 1), cols, out_cols)
    assert DQReadBack(acc, at[:0], 64, torch.bfloat16)().shape == (0, 2, 64)


def test_dq_from_fragments_refuses_bad_arguments() -> None:
    at = dq_fragment_index(torch.arange(3, device=DEV), 64, 128)
    with pytest.raises(ValueError, match="at must hold"):
        dq_from_fragments(torch.zeros(2, 1, 64 * 128, device=DEV), at[:-1], 128, torch.float32)
    with pytest.raises(ValueError, match="contiguous"):
        dq_from_fragments(torch.zeros(2, 1, 2 * 64 * 128, device=DEV)[:, :, ::2], at, 128,
                          torch.float32)  # fmt: skip
    acc = torch.zeros(2, 1, 64 * 128, device=DEV)
    with pytest.raises(ValueError, match="block_t 24"):
        dq_from_fragments(acc, at, 128, torch.float32, block_t=24)
    with pytest.raises(ValueError, match="heads_per_program 0"):
        dq_from_fragments(acc, at, 128, torch.float32, heads_per_program=0)


def test_column_copies_refuse_bad_arguments() -> None:
    cols, t_pad = _columns([4])
    with pytest.raises(ValueError, match="columns must be"):
        rows_from_columns(_codes((1, 64, t_pad)), cols.float())
    with pytest.raises(ValueError, match="out must be"):
        columns_from_rows(_codes((4, 1, 64)), cols, _codes((2, 64, t_pad)))
    with pytest.raises(ValueError, match="head dim 96"):
        rows_from_columns(_codes((1, 96, t_pad)), cols)
    with pytest.raises(ValueError, match="src must be"):
        rows_from_columns(_codes((1, t_pad, 64)).transpose(1, 2), cols)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    ("lens", "step", "d"),
    [((3, 200, 61), 64, 128), ((33,), 32, 128), ((9, 70), 64, 64), ((), 64, 128)],
)
@pytest.mark.parametrize(
    ("heads", "per_program", "block_t"), [(3, None, 32), (3, 4, 32), (8, 4, 64), (6, 2, 32)]
)
def test_dq_from_fragments_matches_torch(
    lens, step, d, out_dtype, heads, per_program, block_t
) -> None:
    cols, t_pad = _columns(list(lens))
    acc = torch.randn(heads, t_pad // step, step * d, device=DEV) * 1e3
    at = dq_fragment_index(cols, step, d)
    got = dq_from_fragments(acc, at, d, out_dtype, block_t=block_t, heads_per_program=per_program)
    want = dq_from_fragments_torch(acc, at, d, out_dtype)
    assert got.shape == (cols.numel(), heads, d) and got.dtype == out_dtype
    assert torch.equal(got, want)


def test_dq_heads_per_program_divides_heads_and_fills_the_gpu(monkeypatch) -> None:
    from flamia_serve.kernels import columns

    monkeypatch.setattr(columns, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    # H200-sized grids: 32k tokens keep all heads per program, 8k tokens take 8
    assert columns.dq_heads_per_program(32768, 32, cuda) == 32
    assert columns.dq_heads_per_program(8192, 32, cuda) == 8
    for tokens, heads in [(1, 32), (100, 12), (8192, 24), (5000, 7), (10**6, 64)]:
        group = columns.dq_heads_per_program(tokens, heads, cuda)
        assert heads % group == 0
        programs = -(-tokens // columns.DQ_BLOCK_T) * (heads // group)
        assert group == 1 or programs >= columns.DQ_PROGRAMS_PER_SM * 132


def test_pack_column_tokens_is_made_once_per_workspace_and_layout() -> None:
    """With a workspace the map is built once per (alignment, t_pad) and shared by callers;
    without one it is built at every call; either way it is ``column_tokens``."""
    from flamia_serve.kernels.columns import column_tokens, pack_column_tokens
    from flamia_serve.kernels.workspace import PackWorkspace

    cols, t_pad = _columns([5, 130, 1])
    ws = PackWorkspace(torch.device(DEV))
    first = pack_column_tokens(ws, cols, 128, t_pad)
    assert torch.equal(first, column_tokens(cols, t_pad))
    assert pack_column_tokens(ws, cols, 128, t_pad) is first
    assert pack_column_tokens(ws, cols, 16, t_pad) is not first  # another layout's entry
    assert pack_column_tokens(None, cols, 128, t_pad) is not first
