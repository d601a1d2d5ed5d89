"""``flamia serve-demo`` entry point: help and the no-GPU refusal work on a CPU machine."""

from __future__ import annotations

import sys

import pytest
import torch

import flamia_serve.backend
from flamia_serve.backend.demo import main


def test_help_runs_without_gpu_or_vllm(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--kv-cache-dtype" in out and "fp8_per_token_head" in out and "nvfp4" in out


def test_bad_option_is_rejected() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--kv-cache-dtype", "fp8_e5m2"])
    assert exc.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_refuses_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_backend_package_imports_without_vllm() -> None:
    assert flamia_serve.backend.BACKEND_NAME == "FLAMIA"
    assert callable(flamia_serve.backend.register)
    if "vllm" not in sys.modules:  # importing the package itself loaded no vLLM
        assert "flamia_serve.backend.vllm_backend" not in sys.modules
