"""The copy model of the vLLM end-to-end check (``benchmarks/copy_model.py``): its token
sequences, prompts and a few training steps on the CPU."""

from __future__ import annotations

import pytest
import torch

from benchmarks.copy_model import (
    COPY_LLAMA,
    SYMBOLS,
    copy_prompts,
    periodic_tokens,
    random_periods,
    train_copy_model,
)


def test_pair_tokens_repeat_the_period_and_chain() -> None:
    gen = torch.Generator().manual_seed(0)
    period = random_periods(3, 11, gen)
    assert all(len(set(row.tolist())) == 11 for row in period)  # distinct symbols
    ids = periodic_tokens(period, 50)
    assert ids.shape == (3, 50) and int(ids.max()) < SYMBOLS * SYMBOLS
    prev, cur = ids // SYMBOLS, ids % SYMBOLS
    assert torch.equal(prev[:, 1:], cur[:, :-1])  # a token starts with its predecessor's symbol
    assert torch.equal(ids[:, 11:], ids[:, :-11])  # period 11
    assert torch.equal(cur[:, :11], period)
    assert torch.equal(prev[:, 0], period[:, -1])


def test_copy_prompts_continue_their_period() -> None:
    prompts, expected = copy_prompts(5, min_length=60, max_length=90, generate=20, seed=3)
    for p, e in zip(prompts, expected, strict=True):
        assert 60 <= len(p) <= 90 and len(e) == 20
        full = p + e
        # the period is the distance to the first repeat of the first token
        n = full.index(full[0], 1)
        assert 8 <= n <= SYMBOLS
        assert all(full[i] == full[i - n] for i in range(n, len(full)))
    assert copy_prompts(5, min_length=60, max_length=90, generate=20, seed=3)[0] == prompts


def test_training_returns_bf16_transformers_weights() -> None:
    pytest.importorskip("transformers")
    state, log = train_copy_model(steps=2, batch=2, length=64, device="cpu")
    assert log["steps"] == 2 and log["loss"][0][0] == 1
    assert state["model.embed_tokens.weight"].shape == (COPY_LLAMA["vocab_size"], 256)
    assert "model.layers.1.self_attn.q_proj.weight" in state
    assert all(v.dtype == torch.bfloat16 for v in state.values())
