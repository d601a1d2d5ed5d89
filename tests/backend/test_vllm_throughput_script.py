"""``benchmarks/vllm_throughput.py`` without a GPU: its workloads from the arguments and the
merge of several runs into one results document."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import vllm_throughput as vt

ENV = {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "triton": "3.6.0", "cuda": "13.0",
       "date": "2026-12-01", "vllm": "0.26.0"}  # fmt: skip


def _doc(rows: list[tuple[str, str]], errors: dict, **env: str) -> dict:
    return {**ENV, **env, "model": vt.LLAMA3_8B, "settings": {}, "total_s": 1.0,
            "workloads": {w: {"requests": 1} for _, w in rows} or {"b": {"requests": 1}},
            "rows": [{"impl": i, "workload": w, "output_tok_s": 1.0, "kv_tokens": 16,
                      "requests": 1, "input_len": 8, "output_len": 8} for i, w in rows],
            "engines": [{"impl": i, "workload": w} for i, w in rows], "errors": errors,
            "skipped": []}  # fmt: skip


def test_workloads_default_to_the_issue_shapes() -> None:
    args = vt.argparse.Namespace(a_requests=256, a_in=1024, a_out=1024, a_kv_gib=72.0)
    assert vt.workload(args, "a") == {"requests": 256, "in": 1024, "out": 1024, "kv_gib": 72.0}


def test_merge_keeps_rows_and_drops_errors_measured_later(tmp_path: Path) -> None:
    paths = []
    docs = [_doc([("flamia-nvfp4", "a")], {}),
            _doc([("flamia-nvfp4", "b")], {"triton_attn-fp8_per_token_head/b": "timeout",
                                           "flamia-auto/b": "timeout"}),
            _doc([("triton_attn-fp8_per_token_head", "b")], {})]  # fmt: skip
    for i, doc in enumerate(docs):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(doc))
    merged = vt.merge(paths)
    assert [(r["impl"], r["workload"]) for r in merged["rows"]] == [
        ("flamia-nvfp4", "a"), ("flamia-nvfp4", "b"), ("triton_attn-fp8_per_token_head", "b")]
    assert merged["errors"] == {"flamia-auto/b": "timeout"}
    assert set(merged["workloads"]) == {"a", "b"} and len(merged["runs"]) == 3
    assert merged["gpu"] == "NVIDIA H200" and merged["date"] == "2026-12-01"


def test_merge_refuses_runs_from_another_gpu(tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_doc([("flamia-nvfp4", "a")], {})))
    b.write_text(json.dumps(_doc([("flamia-nvfp4", "b")], {}, gpu="NVIDIA H100")))
    with pytest.raises(ValueError, match="another GPU"):
        vt.merge([a, b])
