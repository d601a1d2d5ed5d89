"""Prefill from the fp8 cache through the training forward's CuTe kernel (sm_90, extend mode
on operands laid out from the cache) against the reference twin and the Triton prefill: run
on the H200 (``pytest -m gpu``) with the ``cute`` extra; skipped elsewhere."""

from __future__ import annotations

import pytest
import torch

from flamia_serve.kernels import paged as kernels
from flamia_serve.kernels._common import cute_available
from flamia_serve.kernels.paged import ops
from flamia_serve.reference import paged as ref
from tests.kernels.paged_cases import make_batch
from tests.kernels.test_paged import _assert_close, poisoned_cache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not cute_available(torch.device("cuda")),
        reason="needs an sm_90 GPU with nvidia-cutlass-dsl and flash-attn-4",
    ),
]


@pytest.fixture(autouse=True)
def _cute_prefill_really_runs():
    """The CuTe prefill falls back to Triton on an import or compile error (a warning):
    here that is a failure."""
    yield
    assert "prefill" not in ops.CUTE_FAILURES, ops.CUTE_FAILURES


def _triton_prefill(fmt, heads_q: int, heads_kv: int) -> kernels.PagedConfig:
    group_p2 = 1 << (heads_q // heads_kv - 1).bit_length()
    return ops.default_configs(group_p2, fmt.head_dim, fmt.dtype)[1]


@pytest.mark.parametrize(
    ("new", "cached", "heads_q", "heads_kv", "head_dim", "page_size"),
    [
        ([300, 1, 77, 129], [0, 50, 1000, 128], 32, 8, 128, 16),  # a 1-token prefill too
        ([1, 1, 200, 64], [100, 7, 33, 0], 32, 8, 128, 16),  # two decodes first
        ([513, 40], [255, 2000], 8, 8, 64, 32),  # MHA, d = 64, 32-slot pages
        ([130, 17], [70, 0], 16, 2, 256, 16),  # group 8, d = 256
        ([250], [3], 24, 4, 128, 16),  # group 6
    ],
)
def test_cute_prefill_matches_reference_and_triton(
    new: list[int], cached: list[int], heads_q: int, heads_kv: int, head_dim: int,
    page_size: int,
) -> None:  # fmt: skip
    b = make_batch(new, cached, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim,
                   page_size=page_size, dtype="fp8", device="cuda", seed=sum(new))  # fmt: skip
    cache = b.cache.clone()
    ref.write_kv_cache(cache, b.key, b.value, b.slot_mapping, b.fmt)
    args = (b.q, cache, b.fmt, b.block_table, b.seq_lens, b.query_start_loc)
    plan = kernels.plan_paged(b.fmt, heads_q, heads_kv, b.query_start_loc.cpu(),
                              int(b.seq_lens.max()), seq_lens_host=b.seq_lens.cpu())  # fmt: skip
    assert plan.prefill.kernel == "cute" and plan.prefill_keys > 0
    q_before = b.q.clone()
    out = kernels.paged_attention(*args)
    assert torch.equal(b.q, q_before)
    expected = ref.paged_attention(*args, softmax_scale=head_dim**-0.5)
    _assert_close(out, expected, b.fmt)
    triton = kernels.paged_attention(*args,
                                     prefill_config=_triton_prefill(b.fmt, heads_q, heads_kv))
    _assert_close(out, triton, b.fmt)
    # the planned, host-read-free path (what the vLLM backend and the benchmarks run)
    decodes = plan.num_decodes
    fast = kernels.paged_attention(*args, validate=False, num_decodes=decodes,
                                   max_seq_len=int(b.seq_lens.max()),
                                   prefill_keys=int(b.seq_lens[decodes:].sum()))  # fmt: skip
    assert torch.equal(fast, out)


@pytest.mark.parametrize("exp_mode", ["mitchell", "exact"])
def test_cute_prefill_exp_modes(exp_mode: str) -> None:
    """Mitchell-P in the CuTe prefill (FMA and integer operations, no exponential) against
    the reference's Mitchell-P and the Triton prefill's, and close to exact (cos-sim >= 0.999,
    the bar for an inference default)."""
    b = make_batch([200, 333], [1000, 60], heads_q=32, heads_kv=8, head_dim=128, dtype="fp8",
                   device="cuda", seed=7)  # fmt: skip
    cache = b.cache.clone()
    ref.write_kv_cache(cache, b.key, b.value, b.slot_mapping, b.fmt)
    args = (b.q, cache, b.fmt, b.block_table, b.seq_lens, b.query_start_loc)
    out = kernels.paged_attention(*args, exp_mode=exp_mode)
    _assert_close(out, ref.paged_attention(*args, softmax_scale=128**-0.5, exp_mode=exp_mode),
                  b.fmt)  # fmt: skip
    triton = kernels.paged_attention(*args, exp_mode=exp_mode,
                                     prefill_config=_triton_prefill(b.fmt, 32, 8))  # fmt: skip
    _assert_close(out, triton, b.fmt)
    exact = kernels.paged_attention(*args).float().flatten()
    cos = torch.nn.functional.cosine_similarity(out.float().flatten(), exact, dim=0)
    assert cos >= 0.999, cos


def test_cute_prefill_no_future_leakage() -> None:
    """Each new token's output is bit-identical when later tokens' K/V are replaced."""
    b = make_batch([300, 200], [20, 500], dtype="fp8", device="cuda", heads_q=32, heads_kv=8,
                   head_dim=128)  # fmt: skip
    cache = b.cache.clone()
    ref.write_kv_cache(cache, b.key, b.value, b.slot_mapping, b.fmt)
    args = (b.fmt, b.block_table, b.seq_lens, b.query_start_loc)
    out = kernels.paged_attention(b.q, cache, *args)
    key, value = b.key.clone(), b.value.clone()
    cut = 20 + 150  # first sequence: positions >= 170 changed (its keys come first)
    key[cut:320] *= 1024.0
    value[cut:320] = -value[cut:320] * 1024.0
    other = b.cache.clone()
    ref.write_kv_cache(other, key, value, b.slot_mapping, b.fmt)
    out2 = kernels.paged_attention(b.q, other, *args)
    assert torch.equal(out[:150], out2[:150])  # positions 20..169 see no changed key
    assert not torch.equal(out[150:300], out2[150:300])
    assert torch.equal(out[300:], out2[300:])  # the other sequence is untouched


def test_cute_prefill_never_reads_unwritten_slots() -> None:
    """Slots past a sequence's end and spare pages full of NaN bytes: bit-identical output
    (whole 128-key tiles are laid out with zero codes past each sequence's end)."""
    b = make_batch([100, 37, 1], [29, 0, 250], dtype="fp8", device="cuda", heads_q=16,
                   heads_kv=4, head_dim=128)  # fmt: skip
    clean, poisoned, table, _ = poisoned_cache(b)
    outs = [kernels.paged_attention(b.q, c, b.fmt, table, b.seq_lens, b.query_start_loc)
            for c in (clean, poisoned)]  # fmt: skip
    assert torch.isfinite(outs[1].float()).all()
    assert torch.equal(outs[0], outs[1])


def test_cute_prefill_same_bits_in_either_order(monkeypatch) -> None:
    """The extend lists by document (the default) and by cost: each query tile is computed
    alone, so the output is the same bits; the two lists are checked to differ."""
    from flamia_serve.kernels import schedule

    b = make_batch([300, 1, 77, 129, 513], [0, 50, 1000, 128, 2000], heads_q=32, heads_kv=8,
                   head_dim=128, dtype="fp8", device="cuda", seed=3)  # fmt: skip
    cache = b.cache.clone()
    ref.write_kv_cache(cache, b.key, b.value, b.slot_mapping, b.fmt)
    args = (b.q, cache, b.fmt, b.block_table, b.seq_lens, b.query_start_loc)
    outs, lists = [], []
    for by in ("document", "cost"):
        monkeypatch.setattr(schedule, "EXTEND_WORK_ORDER", by)
        plan = kernels.plan_paged(b.fmt, 32, 8, b.query_start_loc.cpu(), int(b.seq_lens.max()),
                                  seq_lens_host=b.seq_lens.cpu())  # fmt: skip
        work = ops.plan_prefill_schedule(plan, b.seq_lens, b.query_start_loc).work
        lists.append(work.doc[: int(work.count)].tolist())
        outs.append(kernels.paged_attention(*args))
    assert lists[0] != lists[1] and sorted(lists[0]) == sorted(lists[1])
    assert torch.equal(outs[0], outs[1])


def test_cute_prefill_quantizing_q_itself_gives_the_launchs_bits(monkeypatch) -> None:
    """Q quantized per token inside the forward (``q_quantized_in_kernel``: BF16/FP16 rows by
    TMA) gives the bits of the Q launch's codes: decodes before the prefills (the rows start
    past them), FP16, Q as strided views of wider buffers; a Q whose rows are not 16-byte
    aligned, and d = 256, take the launch (no CuTe failure); NaN in one token's Q (the kernel
    loads 128-row tiles across sequence ends) changes no other row's bits."""
    new, cached = [1, 1, 200, 64, 300], [100, 7, 33, 0, 900]
    b = make_batch(new, cached, heads_q=32, heads_kv=8, head_dim=128, dtype="fp8",
                   device="cuda", seed=11)  # fmt: skip
    cache = b.cache.clone()
    ref.write_kv_cache(cache, b.key, b.value, b.slot_mapping, b.fmt)
    rest = (cache, b.fmt, b.block_table, b.seq_lens, b.query_start_loc)
    deferred: list[bool] = []
    operands = ops.prefill_operands

    def recording(*args, **kwargs):
        deferred.append(kwargs.get("defer_q", False))
        return operands(*args, **kwargs)

    monkeypatch.setattr(ops, "prefill_operands", recording)
    rows = b.q.shape[0]
    fused = torch.empty(rows, 48, 128, dtype=torch.bfloat16, device="cuda")  # Q, K, V heads
    fused[:, :32] = b.q
    wide = torch.empty(rows, 32, 136, dtype=torch.bfloat16, device="cuda")
    wide[:, :, 8:] = b.q
    shifted = torch.empty(b.q.numel() + 1, dtype=torch.bfloat16, device="cuda")
    shifted[1:] = b.q.flatten()
    bad = b.q.clone()
    bad[2 + 150] = float("nan")  # the third sequence's 151st token
    bad[2 + 151, 5, :7] = float("inf")
    outs = {}
    for name, q, in_kernel in (
        ("bf16", b.q, True), ("fp16", b.q.half(), True), ("fused", fused[:, :32], True),
        ("wide", wide[:, :, 8:], True), ("misaligned", shifted[1:].view(b.q.shape), False),
        ("nan", bad, True),
    ):  # fmt: skip
        q_before = q.clone()
        pair = []
        for defers in (False, True):
            monkeypatch.setattr(ops, "CUTE_PREFILL_DEFERS_Q", defers)
            deferred.clear()
            pair.append(kernels.paged_attention(q, *rest))
            assert deferred == [defers and in_kernel], name
        assert torch.equal(pair[0].view(torch.int16), pair[1].view(torch.int16)), name
        assert torch.equal(q.view(torch.int16), q_before.view(torch.int16)), name
        outs[name] = pair[1]
    assert torch.equal(outs["bf16"], outs["fused"]) and torch.equal(outs["bf16"], outs["wide"])
    assert torch.equal(outs["bf16"], outs["misaligned"])
    hit = torch.zeros(rows, dtype=torch.bool)
    hit[[152, 153]] = True
    assert not torch.isfinite(outs["nan"][152].float()).any()
    assert torch.equal(outs["nan"][~hit], outs["bf16"][~hit])
    # d = 256: Q quantized by the launch (the in-kernel path holds d <= 128)
    b = make_batch([130, 17], [70, 0], heads_q=16, heads_kv=2, head_dim=256, dtype="fp8",
                   device="cuda", seed=5)  # fmt: skip
    cache = b.cache.clone()
    ref.write_kv_cache(cache, b.key, b.value, b.slot_mapping, b.fmt)
    args = (b.q, cache, b.fmt, b.block_table, b.seq_lens, b.query_start_loc)
    deferred.clear()
    out = kernels.paged_attention(*args)
    assert deferred == [False]
    _assert_close(out, ref.paged_attention(*args, softmax_scale=256**-0.5), b.fmt)
