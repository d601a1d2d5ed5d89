"""``attn_implementation="flamia"`` (``flamia_serve.train.hf``) on the reference path: the
masks transformers hands over."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flamia_serve.train.hf import flamia_attention_forward, register  # noqa: E402


def tiny_llama(**config: object) -> torch.nn.Module:
    """A one-layer GQA Llama (2/1 heads of d = 64, seeded) with ``attn_implementation=
    "flamia"``; ``config``: further config fields (default ``flamia_path="reference"``,
    ``num_hidden_layers=1``)."""
    register()
    fields = {"num_hidden_layers": 1, "flamia_path": "reference", **config}
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=128, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, use_cache=False, attn_implementation="flamia",
        **fields,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def test_a_custom_4d_mask_raises_instead_of_being_ignored() -> None:
    """transformers passes a user's 4-D mask through unchanged; flamia attended as if it
    were absent (a block-diagonal packing mask gave the second document the first one's
    keys). It raises, naming attention_mask; a 2-D padding mask is still honoured."""
    model = tiny_llama()
    ids = torch.randint(0, 64, (1, 12))
    doc = torch.tensor([0] * 5 + [1] * 7)
    block_diagonal = (doc[:, None] == doc[None, :]) & torch.ones(12, 12, dtype=torch.bool).tril()
    with pytest.raises(NotImplementedError, match=r"attention_mask .*got shape \(1, 1, 12, 12\)"):
        model(input_ids=ids, attention_mask=block_diagonal[None, None])
    module = SimpleNamespace(config=SimpleNamespace(flamia_path="reference"), is_causal=True)
    x = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="attention_mask"):
        flamia_attention_forward(module, x, x[:, :1], x[:, :1], torch.ones(1, 8, 8).bool())
    padding = torch.ones(2, 12, dtype=torch.long)
    padding[1, 7:] = 0
    two = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        padded = model(input_ids=two, attention_mask=padding).logits[1, :7]
        alone = model(input_ids=two[1:, :7]).logits[0]
    assert torch.allclose(padded, alone, atol=1e-5)


def test_packed_rows_of_a_larger_batch_keep_their_documents_apart() -> None:
    """Batch 2, each row packing documents (``position_ids`` restart at 0), no padding:
    SDPA/eager masks read them per row; flamia attended each row as one document. Each
    document's logits now equal those of the document alone."""
    model = tiny_llama()
    ids = torch.randint(0, 64, (2, 12))
    pos = torch.stack([torch.cat([torch.arange(5), torch.arange(7)]),
                       torch.cat([torch.arange(9), torch.arange(3)])])  # fmt: skip
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=pos).logits
        for row, cut in ((0, 5), (1, 9)):
            for a, b in ((0, cut), (cut, 12)):
                alone = model(input_ids=ids[row : row + 1, a:b]).logits[0]
                assert torch.allclose(out[row, a:b], alone, atol=1e-5), (row, a)
        plain = model(input_ids=ids).logits  # a document per row: the batched call
        assert torch.equal(plain, model(input_ids=ids, position_ids=torch.arange(12)[None]).logits)


def test_compiled_batches_of_several_rows_take_the_batched_call(monkeypatch) -> None:
    """Under torch.compile a batch of several rows is read as a document per row without
    reading position_ids from the device (a fullgraph trace of the batched call has no
    data-dependent step); batch size 1 still finds its documents."""
    import flamia_serve.train.hf as hf

    seen = []
    monkeypatch.setattr(hf, "_packed_plan", lambda *a: seen.append(a) or None)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    model = tiny_llama()
    pos = torch.cat([torch.arange(5), torch.arange(7)])
    with torch.no_grad():
        model(input_ids=torch.randint(0, 64, (2, 12)), position_ids=pos.expand(2, -1))
        assert seen == []
        model(input_ids=torch.randint(0, 64, (1, 12)), position_ids=pos[None])
    assert len(seen) == 1


def test_a_padding_mask_is_packed_once_per_forward(monkeypatch) -> None:
    """Every layer gets the same padding mask: its packing (token index, cu_seqlens, plan:
    host reads) is made at the first layer and reused by the others; a new mask (or one
    changed in place) is packed again; each padded row still equals the row alone."""
    import flamia_serve.train.hf as hf

    model = tiny_llama(num_hidden_layers=3)
    puts = []
    put = hf._UNPADDED.put

    def recorded(mask, value) -> None:
        puts.append(value)
        put(mask, value)

    monkeypatch.setattr(hf._UNPADDED, "put", recorded)
    ids = torch.randint(0, 64, (2, 12))
    padding = torch.ones(2, 12, dtype=torch.long)
    with torch.no_grad():
        for cut in (7, 4):
            padding[1, cut:] = 0
            padded = model(input_ids=ids, attention_mask=padding).logits[1, :cut]
            alone = model(input_ids=ids[1:, :cut]).logits[0]
            assert torch.allclose(padded, alone, atol=1e-5), cut
        model(input_ids=ids, attention_mask=torch.ones(2, 12, dtype=torch.long))
    # one packing per forward with a padded mask (three layers each); transformers hands an
    # all-ones mask over as None (the batched call: nothing packed)
    assert [p[0][1].tolist() for p in puts] == [[0, 12, 19], [0, 12, 16]]
    (idx, _cu, max_len, plan) = puts[1][0]
    assert idx.numel() == 16 and max_len == 12 and plan is None  # the reference path
