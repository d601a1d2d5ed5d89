"""CPU checks of what ``benchmarks/train_attention.py`` times and records: the fwd+bwd and
bwd passes run the same backward, ``--check`` compares O and dQ/dK/dV through each impl's
prep and flags a wrong problem, rows say how inputs were laid out, results carry versions
and workload definitions."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.common import MIN_TIMED_CALLS, library_versions, timing_summary, write_results
from benchmarks.train_attention import (
    CHECK_FLOOR_BASELINE,
    Impl,
    _dense,
    _dense_expanded,
    _expand_kv,
    _identity,
    _prep_facts,
    _thd,
    bwd_step,
    check_floor,
    check_impls,
    fwd_bwd_step,
    main,
    make_inputs,
    reference_fwd,
)
from benchmarks.workloads import SEED, Workload, training_workload

CPU = torch.device("cpu")
TINY = Workload("tiny", 80, [48, 31, 1], "test", hq=4, hkv=2, head_dim=16)


def _builder(prep, scale: float = 1.0, leak: bool = False, layout_in: bool = False):
    """An impl over the FP32 reference, with its output in BF16: ``scale`` multiplies the
    softmax scale (a wrong call), ``leak`` attends across documents, ``layout_in``: the
    inputs arrive as ``[1, H, T, d]`` (dense prep)."""

    def build(wl: Workload, cu: torch.Tensor, sample):
        lens = [wl.total_tokens] if leak else wl.seqlens

        def run(q, k, v):
            if layout_in:
                q, k, v = _thd(q), _thd(k), _thd(v)
            return reference_fwd(q * scale, k, v, lens).to(torch.bfloat16)

        return prep, run

    return build


def test_fwd_bwd_step_returns_the_bwd_steps_gradients_and_accumulates_nothing() -> None:
    q, k, v = (x.requires_grad_() for x in make_inputs(TINY, seed=3, device=CPU))
    d_out = torch.randn(q.shape, dtype=q.dtype)

    def run(q, k, v):
        return reference_fwd(q, k, v, TINY.seqlens).to(q.dtype)

    first = fwd_bwd_step(run, q, k, v, d_out)
    again = fwd_bwd_step(run, q, k, v, d_out)
    assert q.grad is None and k.grad is None and v.grad is None  # no add into .grad
    out = run(q, k, v)
    alone = bwd_step(out, q, k, v, d_out)
    twice = bwd_step(out, q, k, v, d_out)  # the graph is kept for the next rotation
    for a, b, c, d in zip(first, again, alone, twice, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(c, d)
    assert [g.shape for g in first] == [q.shape, k.shape, v.shape]


def test_check_passes_the_same_problem_through_every_prep() -> None:
    impls = [
        Impl("same-thd", "fwd", _builder(_identity)),
        Impl("same-expanded", "fwd", _builder(_expand_kv)),
        Impl("same-dense", "fwd", _builder(_dense, layout_in=True)),
        Impl("same-dense-expanded", "fwd", _builder(_dense_expanded, layout_in=True)),
    ]
    got = check_impls(impls, CPU, [TINY], grads=True)
    assert got["suspect"] == [] and got["failed"] == []
    for impl in impls:
        assert got["cos"][impl.name]["tiny"] > CHECK_FLOOR_BASELINE
        grads = got["grad_cos"][impl.name]["tiny"]
        assert set(grads) == {"dQ", "dK", "dV"}
        assert min(grads.values()) > CHECK_FLOOR_BASELINE


def test_check_flags_a_wrong_scale_and_a_leak_across_documents() -> None:
    impls = [
        Impl("wrong-scale", "fwd", _builder(_identity, scale=1.1)),
        Impl("leak", "fwd", _builder(_identity, leak=True)),
        Impl("quant-only", "quant", _builder(_identity)),  # no attention output: not checked
    ]
    got = check_impls(impls, CPU, [TINY], grads=False)
    flagged = {line.split()[0] for line in got["suspect"]}
    assert flagged == {"wrong-scale", "leak"}
    assert "quant-only" not in got["cos"] and got["grad_cos"] == {}
    # a 10% softmax-scale error stays above the old 0.99 floor: the baseline floor must not
    assert 0.99 < got["cos"]["wrong-scale"]["tiny"] < CHECK_FLOOR_BASELINE


def test_check_skips_impls_not_timed_on_a_workload_and_reports_failures() -> None:
    def broken(wl, cu, sample):
        raise RuntimeError("refused")

    impls = [Impl("single-only", "fwd", _builder(_identity), single_doc_only=True),
             Impl("broken", "fwd", broken)]  # fmt: skip
    got = check_impls(impls, CPU, [TINY])  # default: impl.applies (three documents here)
    assert got["cos"] == {} and len(got["failed"]) == 1 and got["failed"][0].startswith("broken")
    # main passes the same filter the timed rows use (flex-docmask: --flex-workloads)
    got = check_impls(impls, CPU, [TINY], include=lambda i, wl: i.name == "single-only")
    assert list(got["cos"]) == ["single-only"] and got["failed"] == []


def test_check_floors_are_strict_for_baselines_and_per_tensor_for_flamia() -> None:
    assert check_floor("fa4") == check_floor("cudnn-sdpa", "dQ") == CHECK_FLOOR_BASELINE
    assert check_floor("flamia-mxfp8") > check_floor("flamia-mxfp8", "dK")


def test_rows_record_layout_expansion_and_flamia_configs() -> None:
    def run(q, k, v):
        return q

    assert _prep_facts(_identity, run) == {"layout": "[T, H, d]", "kv_expanded": False}
    assert _prep_facts(_expand_kv, run)["kv_expanded"]
    assert _prep_facts(_dense, run) == {"layout": "[1, H, T, d] copies", "kv_expanded": False}
    assert _prep_facts(_dense_expanded, run)["kv_expanded"]
    run.facts = lambda: {"fwd_config": {"kernel": "cute"}}  # type: ignore[attr-defined]
    assert _prep_facts(_identity, run)["fwd_config"] == {"kernel": "cute"}


def test_timing_summary_interpolates_like_do_bench_and_counts_calls() -> None:
    got = timing_summary([5.0, 1.0, 3.0, 2.0, 4.0])
    assert got == pytest.approx({"ms": 3.0, "ms_p20": 1.8, "ms_p80": 4.2, "n_timed": 5})
    assert timing_summary([2.0, 4.0])["ms"] == 3.0
    assert MIN_TIMED_CALLS >= 5
    with pytest.raises(ValueError, match="at least one"):
        timing_summary([])


def test_results_carry_versions_and_workload_definitions(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FLAMIA_RESULTS_DIR", str(tmp_path))
    assert library_versions()["flamia-serve"]
    w7 = training_workload("W7")
    path = write_results("unit", [], {"workload_seed": SEED, "workloads": {"W7": w7.definition()}})
    doc = json.loads(path.read_text())
    for key in ("benchmark", "gpu", "torch", "triton", "date", "cuda", "libraries", "rows"):
        assert key in doc
    assert "flamia-serve" in doc["libraries"]
    d = doc["workloads"]["W7"]
    assert d["seqlens"] == w7.seqlens and sum(d["seqlens"]) == d["total_tokens"] == 8192
    assert (d["hq"], d["hkv"], d["d"], d["docs"]) == (32, 8, 128, w7.num_docs)
    assert d["fwd_flops"] == pytest.approx(4 * 32 * 128 * sum(n * n / 2 for n in w7.seqlens))


def test_main_refuses_unknown_names_before_needing_a_gpu() -> None:
    with pytest.raises(SystemExit, match="unknown passes: back"):
        main(["--passes", "fwd,back"])
    with pytest.raises(SystemExit, match="unknown workloads: W10"):
        main(["--workloads", "W10"])


def test_reference_is_causal_per_document() -> None:
    q, k, v = make_inputs(TINY, seed=5, device=CPU)
    out = reference_fwd(q, k, v, TINY.seqlens)
    # the last document (1 token) attends to itself only: its output is its own V row
    g = TINY.hq // TINY.hkv
    assert torch.allclose(out[-1], v[-1].float().repeat_interleave(g, dim=0), atol=1e-6)
    # the first document does not see the second
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    k2[48:], v2[48:] = 0, 0
    assert torch.equal(reference_fwd(q2, k2, v2, TINY.seqlens)[:48], out[:48])


def test_flamia_impl_is_checked_with_gradients_and_records_its_configs(device: str) -> None:
    from benchmarks.train_attention import _flamia_loader

    wl = Workload("tiny-flamia", 40, [33, 7], "test", hq=2, hkv=1, head_dim=64)
    impl = Impl("flamia-mxfp8", "fwd", _flamia_loader("mxfp8")())
    got = check_impls([impl], torch.device(device), [wl], grads=True)
    assert got["suspect"] == [] and got["failed"] == []
    assert set(got["grad_cos"]["flamia-mxfp8"]["tiny-flamia"]) == {"dQ", "dK", "dV"}
    prep, run = impl.build(wl, wl.cu_seqlens(device), None)
    with torch.no_grad():
        run(*make_inputs(wl, seed=0, device=torch.device(device)))
    facts = _prep_facts(prep, run)
    assert facts["fwd_config"]["kernel"] in ("triton", "cute")
    assert "kernel" in facts["bwd_config"] and facts["kv_expanded"] is False


def test_rounds_alternate_the_impl_order_and_merge_to_medians() -> None:
    """``--rounds``: each round times the impls in the other order; a row per (workload,
    pass, impl) keeps the median ms (every round's beside it), the rounds' widest p20/p80,
    and TFLOP/s rescaled to the median; one round leaves the rows as they are."""
    from benchmarks.common import in_rounds, merge_rounds

    orders: list[list[str]] = []
    times = {"a": iter([1.0, 3.0, 2.0, 5.0]), "b": iter([4.0, 4.0, 7.0])}

    def bench(impls: list) -> list[dict]:
        orders.append([i.name for i in impls])
        rows = []
        for impl in impls:
            ms = next(times[impl.name])
            rows.append({"workload": "W1", "pass": "fwd", "impl": impl.name, "ms": ms,
                         "ms_p20": ms - 0.5, "ms_p80": ms + 0.5, "tflops": 12.0 / ms,
                         "graph_ms": ms / 2, "graph_tflops": 24.0 / ms})  # fmt: skip
        return rows

    impls = [Impl(name, "fwd", lambda: None) for name in ("a", "b")]
    rows = {r["impl"]: r for r in in_rounds(bench, impls, 3)}
    assert orders == [["a", "b"], ["b", "a"], ["a", "b"]]
    assert rows["a"]["ms"] == 2.0 and rows["a"]["ms_rounds"] == [1.0, 3.0, 2.0]
    assert (rows["a"]["ms_p20"], rows["a"]["ms_p80"]) == (0.5, 3.5)
    assert rows["a"]["tflops"] == pytest.approx(6.0) and rows["b"]["tflops"] == pytest.approx(3.0)
    assert rows["a"]["graph_ms"] == 1.0 and rows["a"]["graph_tflops"] == pytest.approx(12.0)
    one = bench(impls[:1])
    assert merge_rounds([one]) is one


@pytest.mark.parametrize("bad", ["0", "-1", "two"])
def test_rounds_below_one_are_refused_by_name(bad: str, capsys) -> None:
    """``--rounds`` (train_attention, prefill, decode, the variant A/Bs) takes an integer of
    at least 1: argparse refuses anything else, naming the option, before any timing."""
    from benchmarks.common import positive_int

    with pytest.raises(SystemExit):
        main(["--rounds", bad])
    assert "--rounds" in capsys.readouterr().err
    assert positive_int("3") == 3
