"""``benchmarks/vllm_tp.py`` pieces that run on a CPU: the digit-task prompts a trained model
is asked under tensor parallelism, the cut at ``</s>``, and argument errors."""

from __future__ import annotations

import json

import pytest

from benchmarks import vllm_tp
from flamia_serve.train import rl


def test_digit_prompts_are_the_rl_tasks_prompts() -> None:
    prompts, max_tokens, eos = vllm_tp.digit_prompts(64)
    assert len(prompts) == 64 and eos == rl.EOS
    preset = rl.PRESETS["small"]
    assert max_tokens == preset.max_digits + 1
    tok = rl.DigitTokenizer()
    for p in prompts:
        text = tok.decode(p)
        digits = text.removeprefix("<s>").removesuffix("=")
        assert digits.isdigit() and preset.min_digits <= len(digits) <= preset.max_digits
        assert p == tok.prompt_ids(digits)
    assert vllm_tp.digit_prompts(64)[0] == prompts  # fixed seed: every engine asks the same


def test_until_eos_cuts_after_the_first_eos() -> None:
    rows = [{"tokens": [5, 6, 2, 7, 2], "finish": "length"}, {"tokens": [5, 6], "finish": "x"}]
    assert [r["tokens"] for r in vllm_tp.until_eos(rows, 2)] == [[5, 6, 2], [5, 6]]
    assert rows[0]["tokens"] == [5, 6, 2, 7, 2]  # not modified


def test_model_without_config_is_refused(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        vllm_tp.main(["--model", str(tmp_path)])
    assert exc.value.code == 2
    assert "--model" in capsys.readouterr().err


def test_model_config_reads_the_directory(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 32}))
    assert vllm_tp.model_config(tmp_path)["max_position_embeddings"] == 32
