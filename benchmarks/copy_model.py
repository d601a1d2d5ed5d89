"""A small Llama trained to continue periodic token sequences: a model whose greedy tokens
are confident and come from attention over the whole context, for comparing attention
backends in vLLM.

Random-weight models have near-tied logits, so any numeric change flips some greedy token
after a few steps (``../shared/notes/vllm.md``): identical greedy tokens across backends
need a model that is sure of its next token *because of what attention retrieves*. This
one is trained on sequences that repeat a period of ``n`` distinct symbols (8 ≤ n ≤
``SYMBOLS``). Each token is a pair of symbols, ``a · SYMBOLS + b`` = (previous symbol, this
symbol): the next token's first half is this token's second half, and its second half is
found wherever in the context a token starts with that symbol (every earlier repeat of the
period holds one such token, all with the same answer) — content-based retrieval over all
the pages of the cache, which a 2-layer model learns in seconds on a GPU.

``copy_prompts`` builds prompts of several repeats of a period; the correct greedy
continuation (``expected``) keeps repeating it.
"""

from __future__ import annotations

import time

import torch

SYMBOLS = 48
COPY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "num_hidden_layers": 2, "vocab_size": SYMBOLS * SYMBOLS,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
}  # fmt: skip


def periodic_tokens(period: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, length]`` pair tokens of the sequences repeating ``period`` ``[B, n]`` symbols
    (token t = symbol t−1 · SYMBOLS + symbol t, the first token's predecessor being the
    period's last symbol)."""
    n = period.shape[1]
    sym = period.repeat(1, length // n + 2)[:, n - 1 : n + length]
    return sym[:, :-1] * SYMBOLS + sym[:, 1:]


def random_periods(batch: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """``[batch, n]`` periods of ``n`` distinct symbols each."""
    return torch.argsort(torch.rand(batch, SYMBOLS, generator=gen), dim=1)[:, :n]


def training_batch(batch: int, length: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Token ids ``[batch, length]`` of one random period length and the period length
    (the loss skips the first period: nothing predicts it)."""
    n = int(torch.randint(8, SYMBOLS + 1, (1,), generator=gen))
    return periodic_tokens(random_periods(batch, n, gen), length), n


def train_copy_model(*, steps: int = 2000, batch: int = 64, length: int = 1536, lr: float = 3e-3,
                     target_loss: float = 0.01, max_seconds: float = 90.0, seed: int = 0,
                     device: str = "cuda") -> tuple[dict[str, torch.Tensor], dict]:  # fmt: skip
    """Train ``COPY_LLAMA`` (transformers, SDPA attention, BF16 autocast) until the loss is
    below ``target_loss``, or ``steps`` / ``max_seconds`` run out. Returns the BF16 state
    dict (transformers names, what vLLM's ``load_weights`` takes) and a log."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    cfg = LlamaConfig(**{k: v for k, v in COPY_LLAMA.items() if k != "architectures"},
                      attn_implementation="sdpa")  # fmt: skip
    model = LlamaForCausalLM(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    losses, t0, step = [], time.time(), 0
    for step in range(1, steps + 1):
        ids, n = training_batch(batch, length, gen)
        ids = ids.to(device)
        labels = ids.clone()
        labels[:, :n] = -100
        with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == 1:
            losses.append([step, round(float(loss), 5)])
            if losses[-1][1] < target_loss or time.time() - t0 > max_seconds:
                break
    state = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    return state, {"steps": step, "seconds": round(time.time() - t0, 1), "loss": losses,
                   "batch": batch, "length": length, "lr": lr}  # fmt: skip


def copy_prompts(count: int, *, min_length: int, max_length: int, generate: int = 96,
                 seed: int = 1) -> tuple[list[list[int]], list[list[int]]]:  # fmt: skip
    """``count`` prompts of ``min_length..max_length`` tokens repeating a random period
    (8..``SYMBOLS`` distinct symbols) and each one's correct continuation of ``generate``
    tokens."""
    gen = torch.Generator().manual_seed(seed)
    prompts, expected = [], []
    for _ in range(count):
        n = int(torch.randint(8, SYMBOLS + 1, (1,), generator=gen))
        length = int(torch.randint(min_length, max_length + 1, (1,), generator=gen))
        ids = periodic_tokens(random_periods(1, n, gen), length + generate)[0].tolist()
        prompts.append(ids[:length])
        expected.append(ids[length:])
    return prompts, expected
