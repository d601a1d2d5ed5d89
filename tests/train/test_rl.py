"""RL entry point: reward, tokenizer, advantages, loss, log-prob mismatch (zero when the
rollout engine is the trainer), the model directory, a 2-step CPU loop with its JSON, merging,
the plot, bad arguments; the vLLM path on a GPU (``gpu`` marker)."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

from flamia_serve.train import rl


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny matmuls: several threads on a shared CPU cost 10-30x in spin-waits.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _tiny_cfg(*argv: str) -> rl.RLConfig:
    return rl.config_from_args(rl.build_parser().parse_args(["--model-size", "tiny", *argv]))


def _one_line_error(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# ---------------------------------------------------------------- reward and task


def test_reward_values():
    assert rl.reward("321", "321") == 1.0
    assert rl.reward("321", "321", partial=False) == 1.0
    # Exact text without </s>: not the answer; partial credit caps at 0.5.
    assert rl.reward("321", "321", stopped=False) == 0.5
    assert rl.reward("321", "321", stopped=False, partial=False) == 0.0
    assert rl.reward("123", "321") == pytest.approx(0.5 * 1 / 3)  # only the middle '2'
    assert rl.reward("3210", "321") == pytest.approx(0.5 * 3 / 4)  # too long
    assert rl.reward("32", "321") == pytest.approx(0.5 * 2 / 3)  # too short
    assert rl.reward("", "321") == 0.0
    assert rl.reward("?21", "321") == pytest.approx(0.5 * 2 / 3)
    assert rl.reward("999", "321") == 0.0
    assert rl.reward("3210", "321", partial=False) == 0.0
    with pytest.raises(ValueError, match="target"):
        rl.reward("1", "")


def test_completion_text_stops_at_eos_and_marks_specials():
    tok = rl.DigitTokenizer()
    ids = [*tok.encode("12"), rl.EOS, *tok.encode("9")]
    assert rl.completion_text(ids) == ("12", True)
    assert rl.completion_text(tok.encode("12")) == ("12", False)
    assert rl.completion_text([rl.BOS, *tok.encode("3"), rl.PAD]) == ("?3?", False)
    assert rl.completion_text([rl.EOS]) == ("", True)
    with pytest.raises(ValueError, match="token id 16"):
        rl.completion_text([16])
    # The exact answer scores 1 through the whole chain.
    text, stopped = rl.completion_text(tok.answer_ids("40719"))
    assert rl.reward(text, rl.target_of("40719"), stopped=stopped) == 1.0


def test_sample_digits_follows_the_seed_and_the_bounds():
    a = rl.sample_digits(50, 2, 5, torch.Generator().manual_seed(3))
    b = rl.sample_digits(50, 2, 5, torch.Generator().manual_seed(3))
    assert a == b and all(s.isdigit() and 2 <= len(s) <= 5 for s in a)
    assert {len(s) for s in a} == {2, 3, 4, 5}


def test_tokenizer_round_trip(tmp_path):
    tok = rl.DigitTokenizer()
    assert tok.vocab_size == len(rl.VOCAB) == 16
    text = "0123456789=,"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("7x") == [tok.encode("7")[0], rl.UNK]
    prompt = tok.prompt_ids("5021")
    answer = tok.answer_ids("5021")
    assert prompt[0] == rl.BOS and prompt[-1] == rl.SEP and answer[-1] == rl.EOS
    assert tok.decode(prompt + answer) == "<s>5021=1205</s>"
    with pytest.raises(ValueError, match="digits"):
        tok.prompt_ids("12a")
    with pytest.raises(ValueError, match="digits"):
        tok.prompt_ids("")
    # The saved transformers tokenizer: the same ids both ways.
    from transformers import AutoTokenizer

    rl.hf_tokenizer().save_pretrained(str(tmp_path))
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(hf) == 16
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (rl.BOS, rl.EOS, rl.PAD)
    assert hf("<s>5021=1205</s>", add_special_tokens=False)["input_ids"] == prompt + answer
    assert hf.decode(prompt + answer) == "<s>5021=1205</s>"
    assert hf.convert_ids_to_tokens(list(range(16))) == list(rl.VOCAB)


def test_vllm_loads_the_saved_tokenizer(tmp_path):
    pytest.importorskip("vllm")
    try:
        from vllm.tokenizers import get_tokenizer
    except Exception as e:  # vLLM's CPU import needs its pure-Python dependencies
        pytest.skip(f"vllm.tokenizers does not import here: {e}")
    rl.hf_tokenizer().save_pretrained(str(tmp_path))
    tok = get_tokenizer(str(tmp_path))
    assert tok.eos_token_id == rl.EOS
    assert tok.encode("<s>12=", add_special_tokens=False) == rl.DigitTokenizer().prompt_ids("12")


# ---------------------------------------------------------------- GRPO pieces


def test_group_advantages():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [1.0, 0.0, 0.0, 0.0]])
    adv = rl.group_advantages(rewards, eps=1e-6)
    assert adv.dtype == torch.float32 and adv.shape == (3, 4)
    # Row 0: mean 0.5, population std 0.5.
    assert torch.allclose(adv[0], torch.tensor([1.0, -1.0, -1.0, 1.0]) * 0.5 / (0.5 + 1e-6))
    assert torch.equal(adv[1], torch.zeros(4))  # equal rewards: no signal
    std = math.sqrt(3) / 4  # mean 0.25: deviations 0.75, -0.25 x3
    assert torch.allclose(adv[2], torch.tensor([0.75, -0.25, -0.25, -0.25]) / (std + 1e-6))
    assert torch.allclose(adv.sum(1), torch.zeros(3), atol=1e-6)
    before = rewards.clone()
    rl.group_advantages(rewards)
    assert torch.equal(rewards, before)  # the input is not modified
    with pytest.raises(ValueError, match="rewards"):
        rl.group_advantages(torch.ones(4))
    with pytest.raises(ValueError, match="finite"):
        rl.group_advantages(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="eps"):
        rl.group_advantages(rewards, eps=0.0)


def test_group_advantages_are_zero_for_any_equal_group():
    # Partial-credit rewards such as 0.5 * 1/3 are not exact in float32; their group mean
    # rounds, and dividing that rounding by std + eps (std ~1e-9) gave advantages up to 0.49
    # (one sign for the whole group) where GRPO has no signal.
    values = [0.5 * m / n for n in range(1, 10) for m in range(n + 1)] + [0.1, 0.7, 1 / 3]
    for group in (2, 3, 5, 7, 8, 16):
        rewards = torch.tensor(values)[:, None].expand(-1, group)
        for eps in (1e-6, 1e-8):
            assert torch.equal(rl.group_advantages(rewards, eps), torch.zeros_like(rewards))


def test_policy_loss_is_the_token_mean():
    logp = torch.tensor([-1.0, -2.0, -0.5, -0.25, -4.0], requires_grad=True)
    adv = torch.tensor([2.0, -1.0])
    loss = rl.policy_loss(logp, adv, [2, 3])
    expected = -(2.0 * (-1.0 - 2.0) + -1.0 * (-0.5 - 0.25 - 4.0)) / 5
    assert loss.item() == pytest.approx(expected)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([-2.0, -2.0, 1.0, 1.0, 1.0]) / 5)
    with pytest.raises(ValueError, match="lengths"):
        rl.policy_loss(logp, adv, [2, 2])
    with pytest.raises(ValueError, match="lengths"):
        rl.policy_loss(logp, adv, [5])


def test_tis_weights_truncate_the_importance_ratio():
    trainer = torch.tensor([-1.0, -2.0, -0.1, -3.0], requires_grad=True)
    rollout = torch.tensor([-1.0, -1.0, -2.0, -3.0 + math.log(1.5)], dtype=torch.float64)
    w = rl.tis_weights(trainer, rollout, cap=2.0)
    assert not w.requires_grad and w.dtype == torch.float32
    assert torch.allclose(w, torch.tensor([1.0, math.exp(-1.0), 2.0, 1 / 1.5]))
    with pytest.raises(ValueError, match="cap"):
        rl.tis_weights(trainer, rollout, cap=0.0)


def test_policy_loss_with_weights_scales_each_token():
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    adv = torch.tensor([2.0, -1.0])
    w = torch.tensor([0.5, 2.0, 1.0])
    loss = rl.policy_loss(logp, adv, [2, 1], w)
    assert loss.item() == pytest.approx(-(2.0 * (0.5 * -1.0 + 2.0 * -2.0) + -1.0 * -0.5) / 3)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([-1.0, -4.0, 1.0]) / 3)
    ones = rl.policy_loss(logp, adv, [2, 1], torch.ones(3))
    assert ones.item() == pytest.approx(rl.policy_loss(logp, adv, [2, 1]).item())
    with pytest.raises(ValueError, match="weights"):
        rl.policy_loss(logp, adv, [2, 1], torch.ones(2))


def test_tis_on_trainer_rollouts_is_the_on_policy_step(tmp_path):
    """With the trainer as its own rollout engine the importance ratio is 1 (up to float
    rounding), so TIS changes nothing: the same losses as without it; the run is named
    ``+tis=C``."""
    torch.set_num_threads(1)
    results = []
    for extra in ([], ["--tis-cap", "2"]):
        path = tmp_path / f"r{len(extra)}.json"
        assert rl.main(["--setup", "cpu", "--model-size", "tiny", "--steps", "2",
                        "--sft-steps", "1", "--device", "cpu", "--no-progress", "--json",
                        str(path), *extra]) == 0  # fmt: skip
        results.append(json.loads(path.read_text()))
    plain, tis = results[0]["runs"]["cpu"], results[1]["runs"]["cpu+tis=2"]
    assert tis["tis_cap"] == 2.0 and plain["tis_cap"] is None
    for a, b in zip(plain["steps"], tis["steps"], strict=True):
        assert a["tis_weight_mean"] is None
        assert b["tis_weight_mean"] == pytest.approx(1.0, abs=1e-5) and b["tis_capped_frac"] == 0
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)


def test_mismatch_stats_values():
    rollout = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    trainer = rollout + torch.tensor([0.0, 0.1, -0.2], dtype=torch.float64)
    s = rl.mismatch_stats(rollout, trainer)
    assert s["tokens"] == 3
    assert s["mismatch_abs_mean"] == pytest.approx(0.1)
    assert s["mismatch_abs_max"] == pytest.approx(0.2)
    assert s["logprob_diff_mean"] == pytest.approx(-0.1 / 3)
    k3 = (math.exp(0.1) - 1 - 0.1 + math.exp(-0.2) - 1 + 0.2) / 3
    assert s["kl_k3"] == pytest.approx(k3)
    assert rl.mismatch_stats(rollout, rollout.clone())["kl_k3"] == 0.0
    with pytest.raises(ValueError):
        rl.mismatch_stats(rollout, trainer[:2])


# ---------------------------------------------------------------- setups and config


def test_setups_are_the_issues_comparisons():
    a = rl.resolve_setup("flamia-fp8")[1]
    b = rl.resolve_setup("flamia-nvfp4")[1]
    c = rl.resolve_setup("bf16-fa-fp8")[1]
    assert (a.trainer_attention, a.exact_causal, a.vllm_backend, a.kv_cache_dtype) == (
        "mxfp8", True, "FLAMIA", "fp8_per_token_head")
    assert (b.trainer_attention, b.exact_causal, b.vllm_backend, b.kv_cache_dtype) == (
        "mxfp8", True, "FLAMIA", "nvfp4")
    assert (c.trainer_attention, c.exact_causal, c.vllm_backend, c.kv_cache_dtype) == (
        "bf16", None, "FLASH_ATTN", "fp8")
    assert rl.resolve_setup("cpu")[1].engine == "trainer"
    name, s = rl.resolve_setup("flamia-fp8", engine="trainer", kv_cache_dtype=None)
    assert name == "flamia-fp8+engine=trainer" and s.kv_cache_dtype is None
    name, s = rl.resolve_setup("cpu", exact_causal=False)
    assert name == "cpu+exact_causal=off" and s.exact_causal is False


def test_model_dir_loads_in_transformers_with_the_trainers_weights(tmp_path):
    from transformers import LlamaForCausalLM

    cfg = _tiny_cfg()
    model = rl.build_model(cfg, rl.resolve_setup("cpu", trainer_attention="bf16")[1]).eval()
    path = rl.write_model_dir(tmp_path / "m", model, cfg)
    files = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 16
    assert config["max_position_embeddings"] == cfg.max_model_len >= 2 * cfg.max_digits + 3
    loaded = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                              attn_implementation="sdpa").eval()
    ids = torch.tensor([rl.DigitTokenizer().prompt_ids("3141")])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    # Same seed: the same initial weights for every setup.
    other = rl.build_model(cfg, rl.resolve_setup("cpu")[1])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), other.parameters(),
                                                  strict=True))  # fmt: skip


# ---------------------------------------------------------------- rollout = trainer


def _rollout_and_recompute(model, engine, cfg, seed=1):
    tok = rl.DigitTokenizer()
    digits = rl.sample_digits(4, cfg.min_digits, cfg.max_digits, torch.Generator().manual_seed(0))
    prompts = [tok.prompt_ids(d) for d in digits for _ in range(3)]
    comps = engine.generate(prompts, cfg.max_tokens, seed=seed)
    assert len(comps) == len(prompts)
    for c in comps:
        assert 1 <= len(c.token_ids) <= cfg.max_tokens
        assert len(c.logprobs) == len(c.token_ids)
        assert c.stopped == (c.token_ids[-1] == rl.EOS) and rl.EOS not in c.token_ids[:-1]
    logp, entropy = rl.completion_logprobs(model, prompts, [c.token_ids for c in comps],
                                           torch.device("cpu"))  # fmt: skip
    assert logp.requires_grad and torch.isfinite(entropy).all()
    rollout = torch.tensor([x for c in comps for x in c.logprobs], dtype=torch.float64)
    return comps, rl.mismatch_stats(rollout, logp.detach())


def test_kept_model_dir_holds_the_trained_model(tmp_path, monkeypatch):
    """``--model-dir``: after the run the directory holds the final weights (what
    ``benchmarks/vllm_tp.py --model`` serves), not the ones written before the RL steps."""
    from safetensors.torch import load_file

    built, after_sft = [], {}
    build, warmup = rl.build_model, rl.sft_warmup

    def build_and_keep(*args, **kwargs):
        built.append(build(*args, **kwargs))
        return built[-1]

    def warmup_and_snapshot(model, *args, **kwargs):
        out = warmup(model, *args, **kwargs)
        after_sft.update({k: v.detach().clone() for k, v in model.state_dict().items()})
        return out

    monkeypatch.setattr(rl, "build_model", build_and_keep)
    monkeypatch.setattr(rl, "sft_warmup", warmup_and_snapshot)
    torch.set_num_threads(1)
    assert rl.main(["--setup", "cpu", "--model-size", "tiny", "--steps", "2", "--sft-steps", "1",
                    "--device", "cpu", "--no-progress", "--model-dir", str(tmp_path)]) == 0
    saved = load_file(str(tmp_path / "cpu" / "model.safetensors"))
    final = built[0].state_dict()
    assert set(saved) == set(final)
    assert all(torch.equal(saved[k], final[k].float()) for k in final)
    assert any(not torch.equal(saved[k], after_sft[k].float()) for k in final)


@pytest.mark.parametrize("attention", ["mxfp8", "bf16"])
def test_mismatch_is_zero_when_the_trainer_rolls_out(attention):
    cfg = _tiny_cfg()
    model = rl.build_model(cfg, rl.resolve_setup("cpu", trainer_attention=attention)[1])
    engine = rl.TrainerEngine(model)
    comps, stats = _rollout_and_recompute(model, engine, cfg)
    assert stats["tokens"] == sum(len(c.token_ids) for c in comps) > len(comps)
    assert stats["mismatch_abs_max"] <= 1e-6 and abs(stats["kl_k3"]) <= 1e-9
    # Same seed, same completions; another seed, other completions.
    again, _ = _rollout_and_recompute(model, engine, cfg)
    other, _ = _rollout_and_recompute(model, engine, cfg, seed=2)
    assert again == comps and other != comps


def test_mismatch_shows_a_different_rollout_attention():
    cfg = _tiny_cfg()
    model = rl.build_model(cfg, rl.resolve_setup("cpu")[1])  # mxfp8, exact_causal
    engine = rl.TrainerEngine(model, attention="bf16")
    _, stats = _rollout_and_recompute(model, engine, cfg)
    assert stats["mismatch_abs_mean"] > 1e-4 and stats["kl_k3"] > 0
    # The engine put the trainer's attention back.
    assert model.config._attn_implementation == "flamia"
    assert model.config.flamia_recipe == "mxfp8"


def test_sft_warmup_lowers_the_loss():
    cfg = _tiny_cfg("--sft-steps", "12")
    model = rl.build_model(cfg, rl.resolve_setup("cpu")[1])
    sft = rl.sft_warmup(model, cfg, torch.device("cpu"))
    losses = sft["loss"]
    assert sft["steps_done"] == len(losses) == 12 and sft["checks"] == []  # tiny: no target
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1


def test_sft_warmup_stops_at_the_target(monkeypatch):
    cfg = _tiny_cfg("--sft-steps", "9", "--sft-target", "0.5")
    model = rl.build_model(cfg, rl.resolve_setup("cpu")[1])
    rates = iter([0.25, 0.5, 1.0])
    monkeypatch.setattr(rl, "SFT_CHECK_EVERY", 2)
    monkeypatch.setattr(rl, "probe_exact", lambda m, c: next(rates))
    sft = rl.sft_warmup(model, cfg, torch.device("cpu"))
    assert sft["steps_done"] == 4 and len(sft["loss"]) == 4
    assert sft["checks"] == [{"step": 2, "exact_frac": 0.25}, {"step": 4, "exact_frac": 0.5}]


def test_probe_exact_counts_exact_sampled_answers(monkeypatch):
    cfg = _tiny_cfg()
    model = rl.build_model(cfg, rl.resolve_setup("cpu")[1])
    assert rl.probe_exact(model, cfg) == 0.0  # untrained: no exact answer
    tok = rl.DigitTokenizer()

    def half_right(self, prompts, max_tokens, seed):
        out = []
        for i, p in enumerate(prompts):
            digits = tok.decode(p[1:-1])
            ids = tok.answer_ids(digits) if i % 2 == 0 else tok.encode(digits)  # no </s>
            out.append(rl.Completion(tuple(ids), (0.0,) * len(ids), ids[-1] == rl.EOS))
        return out

    monkeypatch.setattr(rl.TrainerEngine, "generate", half_right)
    assert rl.probe_exact(model, cfg) == 0.5


# ---------------------------------------------------------------- the loop and its JSON


@pytest.fixture(scope="module")
def smoke_json(tmp_path_factory) -> tuple:
    path = tmp_path_factory.mktemp("rl") / "rl.json"
    torch.set_num_threads(1)
    code = rl.main(["--setup", "cpu", "--model-size", "tiny", "--steps", "2", "--sft-steps", "3",
                    "--device", "cpu", "--no-progress", "--json", str(path)])  # fmt: skip
    return code, path


def test_two_step_loop_writes_the_documented_json(smoke_json):
    code, path = smoke_json
    assert code == 0
    result = json.loads(path.read_text())
    for key in ("benchmark", "gpu", "device", "torch", "transformers", "vllm", "python",
                "date", "config", "task", "runs", "summary"):  # fmt: skip
        assert key in result, key
    assert result["benchmark"] == "rl" and result["gpu"] == "cpu"
    assert result["config"]["model_size"] == "tiny" and result["config"]["steps"] == 2
    run = result["runs"]["cpu"]
    assert run["setup"] == {"trainer_attention": "mxfp8", "exact_causal": True,
                            "engine": "trainer", "vllm_backend": None,
                            "kv_cache_dtype": None}  # fmt: skip
    assert run["attn_implementation"] == "flamia" and run["params"] > 0
    assert len(run["sft"]["loss"]) == run["sft"]["steps_done"] == 3
    assert run["diverged_at"] is None and run["time_limited_at"] is None
    assert [s["step"] for s in run["steps"]] == [1, 2]
    cfg = result["config"]
    for s in run["steps"]:
        assert set(s) == set(rl.STEP_KEYS)
        assert math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"])
        assert 0.0 <= s["reward_mean"] <= 1.0 and 0.0 <= s["exact_frac"] <= 1.0
        assert s["mismatch_abs_max"] <= 1e-6  # the trainer rolled out
        assert s["tokens"] >= cfg["prompts"] * cfg["group"]
    assert set(run["summary"]) == set(rl.SUMMARY_KEYS)
    assert result["summary"] == {"cpu": run["summary"]}


def test_time_limit_ends_the_rl_steps_early(tmp_path):
    path = tmp_path / "rl.json"
    torch.set_num_threads(1)
    code = rl.main(["--setup", "cpu", "--model-size", "tiny", "--steps", "5", "--sft-steps", "1",
                    "--time-limit", "1e-9", "--device", "cpu", "--no-progress", "--json",
                    str(path)])  # fmt: skip
    assert code == 0
    run = json.loads(path.read_text())["runs"]["cpu"]
    assert run["time_limited_at"] == 1 and [s["step"] for s in run["steps"]] == [1]
    assert run["summary"]["steps_done"] == 1


def test_merge_combines_runs_of_one_config(smoke_json, tmp_path, capsys):
    _, path = smoke_json
    other = json.loads(path.read_text())
    other["runs"] = {"cpu+x": other["runs"]["cpu"]}
    other["summary"] = {"cpu+x": other["summary"]["cpu"]}
    (tmp_path / "b.json").write_text(json.dumps(other))
    out = tmp_path / "m.json"
    assert rl.main(["--merge", str(path), str(tmp_path / "b.json"), "--json", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert list(merged["runs"]) == ["cpu", "cpu+x"] and list(merged["summary"]) == ["cpu", "cpu+x"]
    other["config"]["time_limit"] = 30.0  # a run-level setting: merges, kept per run
    other["runs"]["cpu+x"]["time_limit"] = 30.0
    (tmp_path / "t.json").write_text(json.dumps(other))
    assert rl.main(["--merge", str(path), str(tmp_path / "t.json"), "--json", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert [r["time_limit"] for r in merged["runs"].values()] == [None, 30.0]
    assert "time_limit" not in merged["config"]
    other["config"]["time_limit"] = other["runs"]["cpu+x"]["time_limit"] = None
    assert rl.main(["--merge", str(path), str(path), "--json", str(out)]) == 2
    _one_line_error(capsys, "--merge", "twice")
    other["config"]["seed"] = 5
    (tmp_path / "c.json").write_text(json.dumps(other))
    assert rl.main(["--merge", str(path), str(tmp_path / "c.json"), "--json", str(out)]) == 2
    _one_line_error(capsys, "different config")


def test_plot_script_draws_the_json(smoke_json, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from benchmarks import plot_rl

    _, path = smoke_json
    out = tmp_path / "rl.png"
    assert plot_rl.main([str(path), "--out", str(out)]) == 0
    assert out.stat().st_size > 10_000
    text = capsys.readouterr().out
    assert "| cpu | trainer mxfp8 exact_causal / rollout trainer model |" in text
    assert plot_rl.main([str(tmp_path / "missing.json")]) == 2
    (tmp_path / "x.json").write_text(json.dumps({"benchmark": "pretrain", "runs": {"a": {}}}))
    assert plot_rl.main([str(tmp_path / "x.json")]) == 2


# ---------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--group", "1"], ("--group", ">= 2")),
        (["--steps", "0"], ("--steps", ">= 1")),
        (["--min-digits", "4", "--max-digits", "3"], ("--max-digits",)),
        (["--lr", "0"], ("--lr", "> 0")),
        (["--sft-target", "1.5"], ("--sft-target", "[0, 1]")),
        (["--gpu-memory-utilization", "1.5"], ("--gpu-memory-utilization",)),
        (["--time-limit", "0"], ("--time-limit",)),
        (["--tis-cap", "0"], ("--tis-cap",)),
        (["--tis-cap", "inf"], ("--tis-cap",)),
        (["--setup", "cpu", "--kv-cache-dtype", "nvfp4"], ("--kv-cache-dtype", "--engine vllm")),
        (["--setup", "cpu", "--vllm-backend", "FLAMIA"], ("--vllm-backend", "--engine vllm")),
        (["--setup", "cpu", "--trainer-attention", "bf16", "--exact-causal"],
         ("--exact-causal", "bf16")),
        (["--setup", "cpu", "--engine", "vllm"], ("--vllm-backend",)),
        (["--setup", "flamia-fp8", "--device", "cpu"], ("flamia-fp8", "CUDA GPU", "--setup cpu")),
        (["--device", "tpu"], ("--device",)),
        (["--merge", "x.json"], ("--merge", "--json")),
        (["--merge", "/no/such/file.json", "--json", "m.json"], ("--merge", "cannot read")),
    ],
)
def test_bad_arguments_are_one_line_errors(argv, needles, capsys):
    assert rl.main(["--model-size", "tiny", "--no-progress", *argv]) == 2
    _one_line_error(capsys, *needles)


def test_missing_vllm_names_the_extra(monkeypatch, capsys):
    real = rl.importlib.util.find_spec
    monkeypatch.setattr(rl.importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real(name, *a))
    assert rl.main(["--setup", "bf16-fa-fp8", "--model-size", "tiny", "--device", "cpu"]) == 2
    _one_line_error(capsys, "bf16-fa-fp8", "'vllm' extra", "pip install")


def test_unknown_choices_are_refused_by_argparse():
    for argv in (["--setup", "fp16"], ["--kv-cache-dtype", "int4"], ["--model-size", "huge"]):
        with pytest.raises(SystemExit) as exc:
            rl.main(argv)
        assert exc.value.code == 2


def test_cli_dispatches_rl():
    from flamia_serve import cli

    assert cli.LAZY_COMMANDS["rl"][0] == rl.__name__ and callable(rl.main)


# ---------------------------------------------------------------- GPU (vLLM)


@pytest.mark.gpu
def test_vllm_weight_push_reaches_the_engine(tmp_path):
    """vLLM with the FLAMIA fp8_per_token_head cache samples from the trainer's weights
    after a push, and not before it."""
    pytest.importorskip("vllm")
    cfg = _tiny_cfg("--gpu-memory-utilization", "0.1")
    device = torch.device("cuda")
    name, setup = rl.resolve_setup("flamia-fp8")
    model = rl.build_model(cfg, setup).to(device)
    rl.sft_warmup(model, dataclasses_replace(cfg, sft_steps=20), device)
    engine = rl.make_engine(setup, model, rl.write_model_dir(tmp_path / name, model, cfg), cfg)
    try:
        tok = rl.DigitTokenizer()
        prompts = [tok.prompt_ids(d) for d in rl.sample_digits(
            32, cfg.min_digits, cfg.max_digits, torch.Generator().manual_seed(0))]

        def mismatch() -> float:
            comps = engine.generate(prompts, cfg.max_tokens, seed=0)
            logp, _ = rl.completion_logprobs(model, prompts, [c.token_ids for c in comps],
                                             device)  # fmt: skip
            rollout = torch.tensor([x for c in comps for x in c.logprobs], dtype=torch.float64)
            return rl.mismatch_stats(rollout, logp.detach())["mismatch_abs_mean"]

        loaded = mismatch()
        assert loaded < 0.05
        with torch.no_grad():
            model.lm_head.weight.mul_(3.0)
        assert mismatch() > 10 * loaded  # the engine still has the old weights
        engine.update_weights(model)
        assert mismatch() < 0.05
    finally:
        engine.close()


def dataclasses_replace(cfg: rl.RLConfig, **changes) -> rl.RLConfig:
    import dataclasses

    return dataclasses.replace(cfg, **changes)


@pytest.mark.gpu
def test_vllm_rl_steps_on_the_gpu(tmp_path):
    """Three steps of (a) and (c) with the tiny model: finite losses, the JSON, mismatch."""
    pytest.importorskip("vllm")
    path = tmp_path / "rl.json"
    code = rl.main(["--setup", "flamia-fp8", "bf16-fa-fp8", "--model-size", "tiny",
                    "--steps", "3", "--sft-steps", "20", "--gpu-memory-utilization", "0.1",
                    "--device", "cuda", "--no-progress", "--json", str(path)])  # fmt: skip
    assert code == 0
    result = json.loads(path.read_text())
    for name in ("flamia-fp8", "bf16-fa-fp8"):
        steps = result["runs"][name]["steps"]
        assert len(steps) == 3
        for s in steps:
            assert math.isfinite(s["loss"]) and 0 <= s["mismatch_abs_mean"] < 0.1
