"""The ``flamia`` command line: help, version, one-line errors (exit 2, no traceback) checked
before any work, closed pipes, lazy subcommands, and the probe's tables and JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

import flamia_serve
import flamia_serve.reference
from flamia_serve import cli
from flamia_serve.numerics.checks import check_device
from flamia_serve.probes import AccuracySetup, LeakageSetup

ROOT = Path(__file__).resolve().parents[1]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse's --help / --version / usage errors
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def _fake_result(backward: bool = True) -> dict:
    leak = [
        {"method": m, "layout": lay, "future_leak": 0.0449, "cross_doc_leak": 0.0,
         "future_leak_dq": 0.0 if backward else None,
         "cross_doc_leak_grads": 0.0 if backward else None}
        for m in ("mxfp8", "mxfp8 exact_causal", "mixed_nvfp4", "mixed_nvfp4 exact_causal",
                  "per-tensor fp8 (leaky)")
        for lay in ("packed", "batched")
    ]  # fmt: skip
    acc = [
        {"recipe": r, "tensor": t, "cos_sim": 0.998888, "rel_err": 0.0471}
        for r in ("mxfp8", "mixed_nvfp4", "mixed_nvfp4_hadamard")
        for t in ("O", "dQ", "dK", "dV")
    ]
    return {
        "attention": "flamia_serve.reference.quantized.attention",
        "backward": backward,
        "setup": {"leakage": asdict(LeakageSetup()), "accuracy": asdict(AccuracySetup())},
        "leakage": leak,
        "accuracy": acc,
    }


@pytest.fixture
def fake_probe(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Replace the probe's work by a canned result; records the calls' arguments."""
    calls: list[dict] = []

    def probe(**kwargs: object) -> dict:
        calls.append(kwargs)
        return _fake_result(bool(kwargs.get("backward", True)))

    monkeypatch.setattr("flamia_serve.probes.probe", probe)
    return calls


@pytest.mark.parametrize("argv", [["--help"], ["probe", "--help"]])
def test_help_is_plain_text(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(argv, capsys)
    assert code == 0 and "usage: flamia" in out
    for markup in ("``", ":func:", ":class:", ".. "):
        assert markup not in out
    if argv == ["--help"]:
        for command in ("probe", "serve-demo", "pretrain", "rl"):
            assert command in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(["--version"], capsys)
    assert code == 0
    assert out.startswith(f"flamia {flamia_serve.__version__} (torch ")
    assert "triton" in out


def _assert_one_line_error(code: int, out: str, err: str, *needles: str) -> None:
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flamia: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.mark.parametrize(
    ("device", "needles"),
    [
        ("tpu", ("--device", "'tpu'", "cpu or cuda")),
        ("cuda:x", ("--device", "'cuda:x'")),
        ("meta", ("--device", "'meta'", "not supported")),
        ("cuda:99", ("--device 'cuda:99'",)),
    ],
)
def test_bad_device(device: str, needles: tuple, capsys, fake_probe, tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    code, out, err = _run(["probe", "--device", device, "--json", str(path)], capsys)
    _assert_one_line_error(code, out, err, *needles)
    assert fake_probe == [] and not path.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda(capsys, fake_probe) -> None:
    code, out, err = _run(["probe", "--device", "cuda", "--json", ""], capsys)
    _assert_one_line_error(code, out, err, "--device 'cuda'", "no CUDA GPU", "use cpu")
    assert fake_probe == []


def test_check_device() -> None:
    """The library helper behind --device (numerics.checks): errors name the argument."""
    assert check_device("cpu") == torch.device("cpu")
    assert check_device(torch.device("cpu"), "where") == torch.device("cpu")
    with pytest.raises(TypeError, match=r"^device must be a str or torch\.device, got int"):
        check_device(0)
    with pytest.raises(ValueError, match=r"^where 'gpu': unknown device"):
        check_device("gpu", "where")
    with pytest.raises(ValueError, match=r"^device 'meta': not supported"):
        check_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"^device 'cuda:0': this torch .* sees no CUDA GPU"):
            check_device("cuda:0")
    else:
        assert check_device("cuda").type == "cuda"
        with pytest.raises(ValueError, match=r"only .* CUDA device"):
            check_device("cuda:99")


def test_default_device_is_what_exists(capsys, fake_probe, tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    code, _, _ = _run(["probe", "--json", str(path)], capsys)
    assert code == 0
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert fake_probe[0]["device"] == expected
    assert json.loads(path.read_text())["device"] == expected


def _unwritable(tmp_path: Path) -> list[tuple[str, str]]:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    return [
        (str(tmp_path / "missing" / "p.json"), "cannot write"),
        (str(tmp_path), "is a directory"),
        (str(a_file / "p.json"), "cannot write"),
    ]


def test_unwritable_json_fails_before_the_work(capsys, fake_probe, tmp_path: Path) -> None:
    for path, needle in _unwritable(tmp_path):
        code, out, err = _run(["probe", "--device", "cpu", "--json", path], capsys)
        _assert_one_line_error(code, out, err, f"--json {path}", needle)
    assert fake_probe == []  # nothing ran
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing created


def test_writable_json_check_leaves_no_file_when_the_work_fails(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def broken(**kwargs: object) -> dict:
        raise RuntimeError("boom")

    monkeypatch.setattr("flamia_serve.probes.probe", broken)
    path = tmp_path / "p.json"
    with pytest.raises(RuntimeError, match="boom"):
        cli.main(["probe", "--device", "cpu", "--json", str(path)])
    assert not path.exists()


def test_forward_only_and_no_json(capsys, fake_probe, tmp_path: Path) -> None:
    os.chdir(tmp_path)
    code, out, _ = _run(["probe", "--device", "cpu", "--json", "", "--forward-only"], capsys)
    assert code == 0 and fake_probe[0]["backward"] is False
    assert "dQ future" not in out and "wrote" not in out
    assert list(tmp_path.iterdir()) == []


def test_impl_kernel(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    calls: list[dict] = []

    def probe(**kwargs: object) -> dict:
        calls.append(kwargs)
        return _fake_result(bool(kwargs["backward"]))

    monkeypatch.setattr("flamia_serve.probes.probe", probe)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernels interpreted on the CPU
    code, out, _ = _run(["probe", "--impl", "kernel", "--device", "cpu", "--json", ""], capsys)
    assert code == 0 and calls[-1]["impl"] is flamia_serve.flamia_attn_varlen
    assert calls[-1]["backward"] is True
    code, out, _ = _run(["probe", "--json", "", "--forward-only"], capsys)
    assert code == 0 and calls[-1]["impl"] is flamia_serve.reference.attention
    assert calls[-1]["backward"] is False
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU without the interpreter: refused
    n = len(calls)
    code, out, err = _run(["probe", "--impl", "kernel", "--device", "cpu", "--json", ""], capsys)
    _assert_one_line_error(code, out, err, "--impl kernel", "--device cuda", "TRITON_INTERPRET")
    assert len(calls) == n


def test_probe_output_has_legend_shapes_and_fits_80_columns(capsys, fake_probe) -> None:
    code, out, _ = _run(["probe", "--device", "cpu", "--json", ""], capsys)
    assert code == 0
    for line in out.splitlines():
        assert len(line) <= 80, line
    # the legend explains the default mode's allowed residue and exact_causal's zero
    assert "Legend" in out and "exact_causal must be 0" in out
    assert "32-token block" in out and "up to 31 later tokens" in out
    # which shapes were probed
    assert "Hq=4, Hkv=2, d=64" in out and "packed (45, 97, 70)" in out
    assert "Hq=8, Hkv=2, d=128" in out and "(1, 63, 200, 120)" in out
    for header in ("O future", "O docs", "dQ future", "grad docs", "cos-sim", "rel. error"):
        assert header in out


def test_closed_pipe_is_quiet(tmp_path: Path) -> None:
    code = (
        "import sys, flamia_serve.probes as p, tests.test_cli as t\n"
        "p.probe = lambda **kw: t._fake_result()\n"
        "from flamia_serve.cli import main\n"
        "sys.exit(main(['probe', '--device', 'cpu', '--json', '']))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader goes away before anything is printed
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


@pytest.mark.parametrize("command", list(cli.LAZY_COMMANDS))
def test_lazy_command_forwards_its_arguments(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module_name = cli.LAZY_COMMANDS[command][0]
    seen: list[list[str]] = []
    fake = types.ModuleType(module_name)
    fake.main = lambda argv: seen.append(argv) or 3  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module_name, fake)
    assert cli.main([command, "--help", "--steps", "5"]) == 3
    assert seen == [["--help", "--steps", "5"]]


@pytest.mark.parametrize(
    ("command", "missing", "needles"),
    [
        ("serve-demo", "vllm", ("serve-demo", "'vllm' extra", "flamia-serve[vllm]", "'vllm'")),
        ("pretrain", "transformers", ("pretrain", "'train' extra", "flamia-serve[train]")),
        ("rl", "vllm", ("rl", "'vllm' extra")),
        ("rl", "flamia_serve.train.rl", ("rl", "has no flamia_serve.train.rl")),
    ],
)
def test_lazy_command_missing_dependency(
    command: str, missing: str, needles: tuple, monkeypatch, capsys
) -> None:
    def fail(name: str) -> None:
        raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)

    monkeypatch.setattr(cli.importlib, "import_module", fail)
    code, out, err = _run([command, "--x"], capsys)
    _assert_one_line_error(code, out, err, *needles)


def test_unknown_command_exits_2(capsys) -> None:
    code, _, err = _run(["bogus"], capsys)
    assert code == 2 and "invalid choice" in err


@pytest.fixture(scope="module")
def real_probe(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """One real ``flamia probe`` on the CPU (forward and backward)."""
    path = tmp_path_factory.mktemp("probe") / "probe.json"
    proc = subprocess.run(
        [sys.executable, "-m", "flamia_serve.cli", "probe", "--device", "cpu", "--json",
         str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(path.read_text())


def test_real_probe_output(real_probe: tuple[str, dict]) -> None:
    out, _ = real_probe
    assert all(len(line) <= 80 for line in out.splitlines())
    assert "Legend" in out and out.rstrip().endswith(".json")


def test_real_probe_leakage_follows_the_contract(real_probe: tuple[str, dict]) -> None:
    _, result = real_probe
    assert result["backward"] is True and result["device"] == "cpu"
    rows = result["leakage"]
    assert len(rows) == 12
    for r in rows:
        if r["method"].startswith("per-tensor"):
            assert r["future_leak"] > 0 and r["cross_doc_leak"] > 0
            assert r["future_leak_dq"] > 0 and r["cross_doc_leak_grads"] > 0
            continue
        assert r["cross_doc_leak"] == 0 and r["cross_doc_leak_grads"] == 0, r
        assert r["future_leak_dq"] == 0, r
        if "exact_causal" in r["method"]:
            assert r["future_leak"] == 0, r
    # the default mxfp8 residue inside a token block is there (and allowed)
    assert all(r["future_leak"] > 0 for r in rows if r["method"] == "mxfp8")


def test_real_probe_accuracy(real_probe: tuple[str, dict]) -> None:
    _, result = real_probe
    got = {(r["recipe"], r["tensor"]): r["cos_sim"] for r in result["accuracy"]}
    assert set(got) >= {(r, t) for r in ("mxfp8", "mixed_nvfp4") for t in ("O", "dQ", "dK", "dV")}
    # floors as in tests/reference/test_attention.py (reference vs float64)
    for tensor in ("O", "dV"):
        assert got[("mxfp8", tensor)] >= 0.998
    for tensor in ("dQ", "dK"):
        assert got[("mxfp8", tensor)] >= 0.9975
    for tensor in ("O", "dQ", "dK", "dV"):
        assert got[("mixed_nvfp4", tensor)] >= 0.985
    # the unquantized Q/K in dK/dQ: the same O and dV, closer dQ and dK (DESIGN N6)
    for tensor in ("O", "dV"):
        assert got[("mxfp8_grad_input", tensor)] == got[("mxfp8", tensor)]
    for tensor in ("dQ", "dK"):
        assert got[("mxfp8_grad_input", tensor)] > got[("mxfp8", tensor)] + 2e-4
