"""Pretraining entry point: packing, held-out split, tokenizer cache, per-document masks,
a CPU smoke run (loss finite and falling, JSON keys) and merging results."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("tokenizers")

from flamia_serve.train import data as pdata
from flamia_serve.train import pretrain

SMOKE_SOURCE = Path(sysconfig.get_paths()["stdlib"]) / "json"  # 5 real files, ~48 kB


def _flamia_available() -> str | None:
    """None when flamia_serve.train.hf imports, else why not."""
    try:
        from flamia_serve.train.hf import register  # noqa: F401
    except ImportError as e:
        return f"flamia_serve.train.hf not importable: {e}"
    return None


FLAMIA_SKIP = _flamia_available()
ATTENTIONS = [
    "bf16",
    pytest.param("mxfp8", marks=pytest.mark.skipif(FLAMIA_SKIP is not None,
                                                     reason=str(FLAMIA_SKIP))),
]


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny matmuls: several threads on a shared CPU cost 10-30x in spin-waits.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _docs(lengths, seed=0, vocab=512):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=n).astype(np.int32) for n in lengths]


def _tiny_cfg(**overrides) -> pretrain.TrainConfig:
    args = pretrain.build_parser().parse_args(["--model-size", "tiny"])
    cfg = pretrain.config_from_args(args)
    return cfg.__class__(**{**cfg.__dict__, **overrides})


# ---------------------------------------------------------------- packing


def test_pack_cuts_last_document_and_restarts_positions():
    docs = _docs([5, 9, 3, 20, 2])  # 39 tokens
    before = [d.copy() for d in docs]
    batches = list(pdata.pack_documents(docs, 8, drop_last=False))
    assert [len(b.input_ids) for b in batches] == [8, 8, 8, 8, 7]
    # No token lost or reordered.
    assert torch.equal(torch.cat([b.input_ids for b in batches]),
                       torch.from_numpy(np.concatenate(docs)).long())
    # Batch 0: doc0 (5) + first 3 of doc1 (cut); batch 1 opens with doc1's other 6.
    assert batches[0].cu_seqlens.tolist() == [0, 5, 8]
    assert batches[0].position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert batches[1].cu_seqlens.tolist() == [0, 6, 8]
    assert batches[1].position_ids.tolist() == [0, 1, 2, 3, 4, 5, 0, 1]
    # doc3 (20 tokens) spans batches 2..4 as pieces 7 | 8 | 5.
    assert batches[2].cu_seqlens.tolist() == [0, 1, 8]
    assert batches[3].cu_seqlens.tolist() == [0, 8] and batches[3].max_seqlen == 8
    assert batches[4].cu_seqlens.tolist() == [0, 5, 7]
    for b in batches:
        assert b.cu_seqlens.dtype == torch.int32 and b.input_ids.dtype == torch.int64
        starts = torch.zeros(len(b.input_ids), dtype=torch.bool)
        starts[b.cu_seqlens[:-1].long()] = True
        assert torch.equal(b.position_ids == 0, starts)
        assert b.max_seqlen == int((b.cu_seqlens[1:] - b.cu_seqlens[:-1]).max())
    assert all(np.array_equal(a, b) for a, b in zip(docs, before, strict=True))
    assert len(list(pdata.pack_documents(docs, 8))) == 4  # drop_last drops the 7


def test_labels_never_cross_a_document_start():
    b = next(pdata.pack_documents(_docs([3, 5]), 8))
    labels = b.labels()
    assert labels.tolist()[0] == pdata.IGNORE_INDEX and labels.tolist()[3] == pdata.IGNORE_INDEX
    keep = torch.ones(8, dtype=torch.bool)
    keep[[0, 3]] = False
    assert torch.equal(labels[keep], b.input_ids[keep])
    assert pretrain.n_targets(b) == 6


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="seq_len"):
        list(pdata.pack_documents(_docs([3]), 0))
    with pytest.raises(ValueError, match="docs"):
        list(pdata.pack_documents([np.zeros((2, 2), np.int32)], 4))
    with pytest.raises(ValueError, match="docs"):
        next(pdata.train_batches(_docs([3]), 8, seed=0))


def test_train_batches_follow_the_seed():
    docs = _docs([50, 70, 30, 90, 20])

    def first(seed, n=12):
        it = pdata.train_batches(docs, 16, seed)
        return torch.cat([next(it).input_ids for _ in range(n)])

    assert torch.equal(first(0), first(0))
    assert not torch.equal(first(0), first(1))
    # Epoch e packs the documents in the order drawn from (seed, e); 260 tokens give 16
    # full microbatches (the last 4 tokens are dropped), then epoch 1 starts afresh.
    it = pdata.train_batches(docs, 16, 0)
    got = torch.cat([next(it).input_ids for _ in range(17)])
    for epoch, span in ((0, slice(0, 256)), (1, slice(256, 272))):
        order = np.random.default_rng([0, epoch]).permutation(len(docs))
        flat = np.concatenate([docs[i] for i in order])
        assert got[span].tolist() == flat[: span.stop - span.start].tolist()


# ---------------------------------------------------------------- files, split, tokenizer


def test_split_is_by_path_hash():
    files = pdata.list_source_files([SMOKE_SOURCE])
    assert [f.rel for f in files] == sorted(f.rel for f in files)
    train, held = pdata.split_files(files, 0.5)
    by_hash = {f.rel for f in files if pdata.heldout_fraction(f.rel) < 0.5}
    assert 0 < len(by_hash) < len(files)  # this corpus needs no fallback at 0.5
    assert {f.rel for f in held} == by_hash
    assert {f.rel for f in train} == {f.rel for f in files} - by_hash
    # The side of a file does not depend on the order of the files.
    _, held_r = pdata.split_files(files[::-1], 0.5)
    assert {f.rel for f in held_r} == by_hash
    # Tiny fraction: the smallest hash is held out so neither side is empty.
    train, held = pdata.split_files(files, 1e-12)
    assert [f.rel for f in held] == [min(files, key=lambda f: pdata.heldout_fraction(f.rel)).rel]
    assert len(train) == len(files) - 1
    with pytest.raises(ValueError, match="eval_fraction"):
        pdata.split_files(files, 1.5)


def test_tokenizer_round_trips_and_is_cached(tmp_path):
    a = pdata.load_corpus([SMOKE_SOURCE], vocab_size=400, eval_fraction=0.2,
                          cache_dir=tmp_path, max_files=3)
    assert sorted(p.name.split("-")[0] for p in tmp_path.iterdir()) == ["bpe", "docs", "docs"]
    text = pdata.read_text(pdata.list_source_files([SMOKE_SOURCE], max_files=3)[0])
    ids = a.tokenizer.encode(text, add_special_tokens=False).ids
    assert a.tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode()) / 1.5  # merges were learnt
    eos = a.tokenizer.token_to_id(pdata.EOS)
    assert all(d[-1] == eos and (d[:-1] != eos).all() for d in a.train_docs + a.eval_docs)
    b = pdata.load_corpus([SMOKE_SOURCE], vocab_size=400, eval_fraction=0.2,
                          cache_dir=tmp_path, max_files=3)
    assert b.info == a.info
    assert all(np.array_equal(x, y)
               for x, y in zip(a.train_docs + a.eval_docs, b.train_docs + b.eval_docs,
                               strict=True))


def test_end_of_text_written_in_a_source_is_not_a_document_end(tmp_path):
    # transformers' sources hold the string "<|endoftext|>"; it was encoded as the EOS id,
    # an end-of-document token in the middle of a document.
    corpus = pdata.load_corpus([SMOKE_SOURCE], vocab_size=400, eval_fraction=0.2,
                               cache_dir=tmp_path, max_files=3)
    tok, eos = corpus.tokenizer, corpus.tokenizer.token_to_id(pdata.EOS)
    text = f'SPECIAL = "{pdata.EOS}"  # GPT-2\n'
    (doc,) = pdata.encode_documents(tok, [text])
    assert doc[-1] == eos and (doc[:-1] != eos).all(), doc
    assert tok.decode(doc[:-1].tolist()) == text
    assert tok.encode_special_tokens is False  # the tokenizer is left as it was


def test_cache_never_reuses_another_split(tmp_path):
    # Three files a < b < c (sorted) with hash keys a > b > c: eval fraction f1 holds out
    # [c], f2 holds out [b, c]; both splits list the files as a, b, c. The cache was keyed
    # by that list, so the second load read the first one's tokenizer and documents with its
    # n_train = 2: held-out b was also a training document.
    names = sorted(f"m{i:03d}.py" for i in range(200))
    a, b, c = next((x, y, z) for x, y, z in zip(names, names[1:], names[2:], strict=False)
                   if pdata.heldout_fraction(x) > pdata.heldout_fraction(y)
                   > pdata.heldout_fraction(z))
    src = tmp_path / "src"
    src.mkdir()
    for i, name in enumerate((a, b, c)):
        (src / name).write_text(f"def f{i}(x):\n    return x * {i} + {i * 7}  # file {name}\n" * 40)
    ka, kb, kc = (pdata.heldout_fraction(x) for x in (a, b, c))
    for fraction, n_held in (((kc + kb) / 2, 1), ((kb + ka) / 2, 2)):
        corpus = pdata.load_corpus([src], vocab_size=320, eval_fraction=fraction,
                                   cache_dir=tmp_path / "cache")
        assert corpus.info["files_eval"] == n_held
        assert len(corpus.train_docs) == corpus.info["files_train"] == 3 - n_held
        assert len(corpus.eval_docs) == n_held
        train = {d.tobytes() for d in corpus.train_docs}
        assert not any(d.tobytes() in train for d in corpus.eval_docs)


# ---------------------------------------------------------------- per-document masks


def _pack_two_docs(seed: int) -> pdata.PackedBatch:
    return next(pdata.pack_documents(_docs([40, 24], seed=seed), 64))


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_a_document_does_not_see_the_other_documents(attention):
    cfg = _tiny_cfg()
    model = pretrain.build_model(cfg, attention, 512).eval()
    a, b = _pack_two_docs(1), _pack_two_docs(2)
    # Same second document, different first document.
    mixed = pdata.PackedBatch(torch.cat([b.input_ids[:40], a.input_ids[40:]]), a.position_ids,
                              a.cu_seqlens, a.max_seqlen)
    with torch.no_grad():
        la, lm = pretrain.token_losses(model, a), pretrain.token_losses(model, mixed)
    # Entry t predicts token t+1: entries 40.. belong to the second document.
    assert torch.equal(la[40:], lm[40:])
    assert not torch.equal(la[:39], lm[:39])
    if attention == "bf16":
        # Control: with a KV cache transformers ignores the packing and the documents mix.
        def with_cache(batch):
            out = model(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None],
                        use_cache=True)
            return out.logits[0, 40:]

        with torch.no_grad():
            assert not torch.allclose(with_cache(a), with_cache(mixed))


def test_same_initial_weights_for_every_attention():
    cfg = _tiny_cfg()
    ref = pretrain.build_model(cfg, "bf16", 512).state_dict()
    again = pretrain.build_model(cfg, "bf16", 512).state_dict()
    assert all(torch.equal(ref[k], again[k]) for k in ref)
    other = pretrain.build_model(_tiny_cfg(seed=1), "bf16", 512).state_dict()
    assert not torch.equal(ref["model.layers.0.mlp.up_proj.weight"],
                           other["model.layers.0.mlp.up_proj.weight"])
    if FLAMIA_SKIP is None:
        fl = pretrain.build_model(cfg, "mxfp8", 512)
        assert fl.config._attn_implementation == "flamia"
        assert fl.config.flamia_recipe == "mxfp8"
        assert all(torch.equal(ref[k], v) for k, v in fl.state_dict().items())


def test_flamia_choice_without_integration_is_a_clear_error():
    if FLAMIA_SKIP is None:
        pytest.skip("flamia_serve.train.hf is importable")
    with pytest.raises(pretrain.SetupError, match=r"flamia_serve\.train\.hf"):
        pretrain.attention_setup("mxfp8", False)
    assert pretrain.main(["--attention", "mxfp8", "--model-size", "tiny", "--device", "cpu",
                          "--source", str(SMOKE_SOURCE)]) == 2


# ---------------------------------------------------------------- smoke run


def _smoke(tmp_path: Path, attentions: list[str], name: str) -> dict:
    out = tmp_path / f"{name}.json"
    rc = pretrain.main(["--attention", *attentions, "--model-size", "tiny", "--device", "cpu",
                        "--steps", "20", "--eval-every", "10", "--source", str(SMOKE_SOURCE),
                        "--cache-dir", str(tmp_path / "cache"), "--json", str(out),
                        "--no-progress"])
    assert rc == 0
    return json.loads(out.read_text())


def test_smoke_run_loss_falls_and_json_has_the_keys(tmp_path):
    attentions = ["bf16"] if FLAMIA_SKIP is not None else ["bf16", "mxfp8"]
    res = _smoke(tmp_path, attentions, "both")
    for key in ("benchmark", "gpu", "torch", "transformers", "date", "config", "data", "runs",
                "params", "final_eval_loss", "final_eval_loss_rel_to_bf16"):
        assert key in res, key
    assert res["benchmark"] == "pretrain" and res["gpu"] == "cpu"
    assert set(res["final_eval_loss"]) == set(attentions)
    assert res["config"]["steps"] == 20 and res["data"]["files_eval"] >= 1
    for name in attentions:
        run = res["runs"][name]
        loss = np.asarray(run["loss"])
        assert loss.shape == (20,) and np.isfinite(loss).all()
        assert loss[-5:].mean() < loss[:5].mean() - 0.2, loss
        assert [e["step"] for e in run["eval"]] == [10, 20]
        assert run["final_eval_loss"] == run["eval"][-1]["loss"]
        assert np.isfinite(run["final_eval_loss"]) and run["final_eval_loss"] < np.log(512)
        assert len(run["lr"]) == 20 and run["lr"][0] < run["lr"][2] > run["lr"][-1]
        assert run["diverged_at"] is None
    if "mxfp8" in attentions:
        rel = res["final_eval_loss_rel_to_bf16"]["mxfp8"]
        assert rel == pytest.approx(res["final_eval_loss"]["mxfp8"]
                                    / res["final_eval_loss"]["bf16"] - 1)
        assert np.isfinite(res["runs"]["mxfp8"]["final_eval_loss_sdpa"])


def test_diverged_at_is_the_first_non_finite_step(tmp_path, monkeypatch):
    # The loss is read on the host every 10 steps; diverged_at was that check's step (10),
    # not the step whose loss first went non-finite.
    real, calls = pretrain.token_losses, []

    def nan_from_step_3(model, batch):
        calls.append(None)
        out = real(model, batch)
        return out * float("nan") if len(calls) > 4 else out  # 2 microbatches per step

    monkeypatch.setattr(pretrain, "token_losses", nan_from_step_3)
    out = tmp_path / "d.json"
    assert pretrain.main(["--model-size", "tiny", "--device", "cpu", "--steps", "20",
                          "--source", str(SMOKE_SOURCE), "--cache-dir", str(tmp_path / "c"),
                          "--json", str(out), "--no-progress"]) == 1
    run = json.loads(out.read_text())["runs"]["bf16"]
    loss = np.asarray(run["loss"], dtype=float)
    assert np.isfinite(loss[:2]).all() and not np.isfinite(loss[2])
    assert run["diverged_at"] == 3 and run["final_eval_loss"] is None


def test_merge_combines_runs_of_one_config(tmp_path):
    a = {"benchmark": "pretrain", "config": {"seed": 0}, "data": {"x": 1}, "params": 5,
         "runs": {"bf16": {"final_eval_loss": 2.0}}}
    b = {**a, "runs": {"mxfp8": {"final_eval_loss": 2.01}}}
    c = {**a, "config": {"seed": 1}, "runs": {"mixed_nvfp4": {"final_eval_loss": 2.1}}}
    for name, obj in (("a", a), ("b", b), ("c", c)):
        (tmp_path / f"{name}.json").write_text(json.dumps(obj))
    out = tmp_path / "m.json"
    assert pretrain.main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                          "--json", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert merged["final_eval_loss"] == {"bf16": 2.0, "mxfp8": 2.01}
    assert merged["final_eval_loss_rel_to_bf16"]["mxfp8"] == pytest.approx(0.005)
    with pytest.raises(ValueError, match="config"):
        pretrain.merge_results([tmp_path / "a.json", tmp_path / "c.json"])
    with pytest.raises(ValueError, match="twice"):
        pretrain.merge_results([tmp_path / "a.json", tmp_path / "a.json"])


def test_bad_arguments_are_refused():
    assert pretrain.main(["--steps", "0", "--model-size", "tiny"]) == 2
    assert pretrain.main(["--min-lr-ratio", "2", "--model-size", "tiny"]) == 2
    assert pretrain.main(["--merge", "x.json"]) == 2  # no --json
    with pytest.raises(SystemExit):
        pretrain.main(["--attention", "fp16"])


@pytest.mark.parametrize(("argv", "needles"), [
    (["--seed", "-1"], ("--seed",)),
    (["--seq-len", "1"], ("--seq-len",)),  # was a NaN loss reported as a divergence
    (["--weight-decay", "-0.1"], ("--weight-decay",)),
    (["--eval-fraction", "0"], ("--eval-fraction",)),
    (["--device", "tpu"], ("--device", "'tpu'")),
    (["--json", "/proc/no/such/dir/p.json"], ("--json", "cannot write")),
    (["--merge", "/no/such/file.json", "--json", "m.json"], ("--merge", "cannot read")),
])
def test_bad_arguments_fail_by_name_before_any_work(argv, needles, capsys, monkeypatch):
    # Each of these used to pass the checks and fail later: a traceback after the whole
    # run (--json, --device), or a message naming no flag after data preparation (--seed).
    monkeypatch.setattr(pdata, "load_corpus", lambda *a, **k: pytest.fail("did work"))
    assert pretrain.main(["--model-size", "tiny", "--no-progress", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    for needle in needles:
        assert needle in err[0], (needle, err[0])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_cuda_device_without_a_gpu_is_refused(capsys, monkeypatch):
    monkeypatch.setattr(pdata, "load_corpus", lambda *a, **k: pytest.fail("did work"))
    assert pretrain.main(["--model-size", "tiny", "--device", "cuda"]) == 2
    assert "--device 'cuda'" in capsys.readouterr().err


def test_plot_script_draws_the_json(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from benchmarks import plot_pretrain

    steps = list(range(1, 21))
    runs = {name: {"loss": [5.0 - 0.1 * s * f for s in steps],
                   "eval": [{"step": 10, "loss": 4.0 * f}, {"step": 20, "loss": 3.0 * f}],
                   "final_eval_loss": 3.0 * f, "ms_per_step": 1.0}
            for name, f in (("bf16", 1.0), ("mxfp8", 1.005))}
    res = {"benchmark": "pretrain", "gpu": "cpu", "date": "2026-01-01", "params": 1000,
           "config": {"seq_len": 8, "micro_batches": 2, "seed": 0}, "runs": runs,
           "final_eval_loss": {"bf16": 3.0, "mxfp8": 3.015},
           "final_eval_loss_rel_to_bf16": {"mxfp8": 0.005}}
    path = tmp_path / "pretrain.json"
    path.write_text(json.dumps(res))
    assert plot_pretrain.main([str(path)]) == 0
    assert (tmp_path / "pretrain.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| mxfp8 | 3.0150 | +0.50% |" in capsys.readouterr().out
    assert plot_pretrain.main([str(tmp_path / "missing.json")]) == 2
