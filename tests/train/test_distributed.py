"""Data-parallel training with FLAMIA attention (``flamia_serve.train.distributed``) on a CPU:
two spawned processes over gloo, the tiny Llama on the reference attention, 2 steps under
DDP and FSDP2 against a single process on the same global batches; a negative control
(per-rank token means) that must fail; argument errors. ~40 s on 2 cores."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("tokenizers")
if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from flamia_serve.train import distributed as dp
from flamia_serve.train import pretrain

WORLD = 2
CFG = dp.CheckConfig(modes=dp.MODES, model_size="tiny", attention="mxfp8", steps=2,
                     seq_len=128, global_micro_batches=4, device="cpu", threads=1,
                     repeat_single=True)
# The stated CPU tolerances (float32, reference path): step-1 loss and gradients 1e-6.
LOSS_RTOL, GRAD_RTOL = 1e-6, 1e-6


@pytest.fixture(scope="module")
def result() -> dict:
    return dp.spawn_check(CFG, WORLD)


def _param_names() -> set[str]:
    tcfg = dp.train_config(dp.resolve(CFG, WORLD), pretrain.PRESETS["tiny"].vocab_size)
    return {n for n, _ in pretrain.build_model(tcfg, "mxfp8", tcfg.vocab_size).named_parameters()}


def test_setup_is_flamia_on_two_ranks(result):
    assert result["world_size"] == WORLD and result["backend"] == "gloo"
    assert result["attn_implementation"] == "flamia"
    assert result["check"]["flamia_path"] == "reference"
    assert result["tolerances"]["loss_rtol"] == LOSS_RTOL
    assert result["tolerances"]["grad_rtol"] == GRAD_RTOL
    assert result["global_batch"]["micro_batches_per_rank"] == 2  # accumulation is exercised
    assert len(result["single"]["loss"]) == CFG.steps
    assert all(np.isfinite(result["single"]["loss"]))


@pytest.mark.parametrize("mode", dp.MODES)
def test_matches_single_process(result, mode):
    run = result["runs"][mode]
    single = result["single"]["loss"]
    assert len(run["loss"]) == CFG.steps
    # step 1: the same forward per microbatch, only the sum over microbatches is reordered
    assert abs(run["loss"][0] - single[0]) <= LOSS_RTOL * abs(single[0])
    assert run["loss_step1_rel_diff"] <= LOSS_RTOL
    # every parameter's gradient is compared, and none is trivially zero
    assert set(run["grads"]) == _param_names()
    assert all(g["grad_norm"] > 0 for g in run["grads"].values())
    assert all(g["rel_norm_diff"] <= GRAD_RTOL for g in run["grads"].values())
    assert run["grad_max_rel_norm_diff"] <= GRAD_RTOL
    assert run["curve_window"] == CFG.steps  # shorter than CURVE_WINDOW
    assert run["curve_max_rel_diff"] <= result["tolerances"]["curve_rtol"]
    assert run["passed"] and result["passed"]


def test_single_run_repeats_bit_for_bit_on_a_cpu(result):
    """The noise baseline: on a CPU (float32, reference path) the single run is deterministic,
    so its repeat differs by exactly nothing."""
    noise = result["single_repeat"]
    assert noise["loss_max_rel_diff"] == 0.0 and noise["grad_max_abs_diff"] == 0.0
    assert not any(k.startswith("passed") for k in noise)
    assert dp.summary(result)["single_repeat"]["grad_max_rel_norm_diff"] == 0.0


def test_curve_is_compared_as_running_means():
    single = {"loss": [4.0] * 20, "grads": {"w": torch.ones(3)}}
    spiky = {"loss": [4.0] * 9 + [4.4] + [4.0] * 10, "grads": {"w": torch.ones(3)},
             "seconds": 0.0}  # one step 10% off
    res = dp.compare(single, spiky, 1e-6, 1e-6, 0.02)
    assert res["loss_max_rel_diff"] == pytest.approx(0.1)
    assert res["curve_window"] == dp.CURVE_WINDOW == 10
    assert res["curve_max_rel_diff"] == pytest.approx(0.01)  # the spike over 10 steps
    assert res["passed_curve"] and res["passed"]
    drift = {**spiky, "loss": [4.0] * 10 + [4.2] * 10}  # a lasting 5% offset is caught
    assert not dp.compare(single, drift, 1e-6, 1e-6, 0.02)["passed_curve"]
    np.testing.assert_allclose(dp.running_mean(np.arange(5.0), 2), [0.5, 1.5, 2.5, 3.5])


def test_per_rank_mean_is_caught():
    """Negative control: each rank's own token mean (ranks predict different numbers of
    tokens, since documents start at different places) must fail the gradient check."""
    cfg = dp.resolve(CFG, WORLD)
    steps = dp.global_batches(cfg, None, pretrain.PRESETS["tiny"].vocab_size)
    counts = [sum(pretrain.n_targets(b) for b in dp.rank_share(steps[0], r, WORLD))
              for r in range(WORLD)]
    assert counts[0] != counts[1]  # the precondition of a visible difference
    bad = dp.spawn_check(dp.CheckConfig(**{**CFG.__dict__, "modes": ("ddp",), "steps": 1,
                                           "normalisation": "local"}), WORLD)
    run = bad["runs"]["ddp"]
    assert not run["passed"] and not bad["passed"]
    assert run["grad_max_rel_norm_diff"] > 100 * GRAD_RTOL


def test_global_batch_split():
    cfg = dp.resolve(dp.CheckConfig(**{**CFG.__dict__, "global_micro_batches": 6}), 3)
    steps = dp.global_batches(cfg, None, 512)
    again = dp.global_batches(cfg, None, 512)
    assert len(steps) == cfg.steps and all(len(m) == 6 for m in steps)
    for micro, micro2 in zip(steps, again, strict=True):
        shares = [dp.rank_share(micro, r, 3) for r in range(3)]
        assert [len(s) for s in shares] == [2, 2, 2]
        assert [b for s in shares for b in s] == micro  # contiguous, complete, in order
        for b, b2 in zip(micro, micro2, strict=True):  # the same on every rank
            assert torch.equal(b.input_ids, b2.input_ids)
            assert torch.equal(b.cu_seqlens, b2.cu_seqlens)
            assert b.input_ids.numel() == cfg.seq_len
    assert any(m.cu_seqlens.numel() > 2 for m in steps[0])  # packed: several documents


@pytest.mark.parametrize(("override", "world", "match"), [
    ({"global_micro_batches": 4}, 3, "--global-micro-batches: 4 microbatches do not split"),
    ({"modes": ("ddp", "zero")}, 2, "--mode"),
    ({"modes": ("ddp", "ddp")}, 2, "--mode: repeated"),
    ({"steps": 0}, 2, "--steps"),
    ({"seq_len": 1}, 2, "--seq-len"),
    ({"model_size": "huge"}, 2, "--model-size"),
    ({"attention": "fp4"}, 2, "--attention"),
    ({"data": "web"}, 2, "--data"),
    ({"flamia_path": "fast"}, 2, "--flamia-path"),
    ({"grad_rtol": 0.0}, 2, "--grad-rtol"),
    ({"curve_rtol": float("nan")}, 2, "--curve-rtol"),
    ({"normalisation": "none"}, 2, "--normalisation"),
    ({}, 0, "world size"),
    ({"seed": -1}, 2, "--seed"),
    ({"source": ("/tmp",)}, 2, "--source: only with --data stdlib"),
    ({"max_files": 3}, 2, "--max-files: only with --data stdlib"),
    ({"data": "stdlib", "source": ("/no/such/dir",)}, 2, "--source '/no/such/dir'"),
])  # fmt: skip
def test_bad_arguments(override, world, match):
    cfg = dp.CheckConfig(**{**CFG.__dict__, **override})
    with pytest.raises(ValueError, match=match):
        dp.resolve(cfg, world)
    assert cfg == dp.CheckConfig(**{**CFG.__dict__, **override})  # not modified


def test_bad_devices(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="--flamia-path kernel on a CPU needs TRITON_INTERPRET"):
        dp.resolve(dp.CheckConfig(**{**CFG.__dict__, "flamia_path": "kernel"}), 2)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device cuda: no CUDA GPU"):
            dp.resolve(dp.CheckConfig(**{**CFG.__dict__, "device": "cuda"}), 2)


def test_cli_errors(monkeypatch, capsys):
    # An unwritable --json used to fail only after the whole check, with a traceback.
    monkeypatch.setattr(dp, "spawn_check", lambda *a: pytest.fail("ran the check"))
    assert dp.main(["--device", "cpu", "--json", "/proc/no/such/dir/dp.json"]) == 2
    assert "error: --json /proc/no/such/dir/dp.json: cannot write" in capsys.readouterr().err
    monkeypatch.undo()
    assert dp.main(["--spawn", "3", "--global-micro-batches", "4", "--device", "cpu"]) == 2
    assert "error: --global-micro-batches: 4 microbatches" in capsys.readouterr().err
    assert dp.main(["--spawn", "0", "--device", "cpu"]) == 2
    assert "error: --spawn: must be >= 1" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert dp.main(["--spawn", "2", "--device", "cpu"]) == 2
    assert "error: --spawn: not under torchrun" in capsys.readouterr().err
