"""CPU checks of the benchmark helpers whose results feed the README's tables."""

from __future__ import annotations

import pytest

from benchmarks.common import output_and_grads, parse_settings, time_ms, write_results
from benchmarks.decode import parse
from benchmarks.decode_overhead import fit_line
from benchmarks.exp_bound import parse_pack
from benchmarks.fwd_items import fit, tiles_and_items
from benchmarks.workloads import training_workload


def test_fit_line_recovers_fixed_cost_and_slope() -> None:
    xs = [512.0, 2048.0, 8192.0, 32768.0]
    fixed, slope = fit_line(xs, [13.0 + 0.008 * x for x in xs])
    assert fixed == pytest.approx(13.0)
    assert slope == pytest.approx(0.008)


def test_parse_pack_reads_counts_and_lengths() -> None:
    assert parse_pack("8192") == [8192]
    assert parse_pack("4x2048") == [2048] * 4


def test_decode_workload_names_parse_or_fail_clearly() -> None:
    assert parse("B16-L8192") == (16, 8192)
    assert parse("B1-L1024") == (1, 1024)
    with pytest.raises(ValueError, match="B<sequences>-L<keys>"):
        parse("16x8192")


def test_write_results_refuses_a_pass_outside_design(tmp_path, monkeypatch) -> None:
    """DESIGN section 8 names the passes a row may have; others are refused before any file
    is written."""
    monkeypatch.setenv("FLAMIA_RESULTS_DIR", str(tmp_path))
    row = {"workload": "W1", "pass": "forward", "impl": "flamia-mxfp8", "ms": 1.0,
           "tflops": None, "gbps": None}  # fmt: skip
    with pytest.raises(ValueError, match="pass 'forward'"):
        write_results("bad", [row])
    assert not list(tmp_path.iterdir())


def test_time_ms_names_a_bad_flush_mode() -> None:
    with pytest.raises(ValueError, match="l2"):
        time_ms(lambda: None, l2="warm")


def test_fwd_items_counts_causal_tiles_and_items() -> None:
    # E4: four documents of 4096 tokens = 32 tiles of 128 each; 32 heads
    assert tiles_and_items(training_workload("E4")) == (4 * 32 * 33 // 2 * 32, 4 * 32 * 32)
    # a document of 129 tokens takes two query tiles (the second masked past its end)
    wl = training_workload("W1")
    wl.seqlens = [129, 8192 - 129]
    n = -(-(8192 - 129) // 128)
    assert tiles_and_items(wl) == ((3 + n * (n + 1) // 2) * 32, (2 + n) * 32)


def test_fwd_items_fit_recovers_tile_item_and_call_costs() -> None:
    names = ["W1", "W3", "E1", "E16", "E128"]
    rows = []
    for name in names:
        tiles, items = tiles_and_items(training_workload(name))
        rows.append({"tiles": tiles, "items": items, "us": 0.01 * tiles + 0.3 * items + 7.0})
    got = fit(rows, "us")
    assert got is not None
    assert got["us_per_tile"] == pytest.approx(0.01)
    assert got["us_per_item"] == pytest.approx(0.3)
    assert got["us_per_call"] == pytest.approx(7.0, abs=1e-6)
    assert fit(rows[:2], "us") is None  # fewer points than unknowns: no fit



def test_launch_settings_parse_or_fail_clearly() -> None:
    assert parse_settings("4x32", "WARPSxPROGRAMS_PER_SM") == [(4, 32)]
    assert parse_settings("4x32,8x8", "WARPSxPROGRAMS_PER_SM") == [(4, 32), (8, 8)]
    assert parse_settings("8x2x1,4x2x2", "WARPSxSTAGESxPARTS") == [(8, 2, 1), (4, 2, 2)]
    for bad in ("4", "4x", "x32", "4*32", "4x32x1"):
        with pytest.raises(ValueError, match="WARPSxPROGRAMS_PER_SM"):
            parse_settings(bad, "WARPSxPROGRAMS_PER_SM")
    with pytest.raises(ValueError, match="WARPSxSTAGESxPARTS"):
        parse_settings("8x2", "WARPSxSTAGESxPARTS")


def test_per_launch_splits_a_kernel_launched_twice_per_call() -> None:
    from benchmarks.common import per_launch

    # two calls: quantize, pass B, pass A (the same name), read-back
    launches = [("q", 1.0), ("bwd", 10.0), ("bwd", 4.0), ("rb", 2.0)] * 2
    assert per_launch(launches, 2) == {"q": 1.0, "bwd #1": 10.0, "bwd #2": 4.0, "rb": 2.0}
    # a name whose count does not divide by the calls is summed as one
    assert per_launch([("a", 1.0), ("a", 3.0), ("a", 2.0)], 2) == {"a": 3.0}


def test_output_and_grads_runs_on_copies_and_matches_autograd() -> None:
    import torch

    gen = torch.Generator().manual_seed(0)
    q, k, v, d_out = (torch.randn(5, 3, generator=gen) for _ in range(4))

    def fn(a, b, c):
        return (a * b).softmax(-1) * c

    o, dq, dk, dv = output_and_grads(fn, q, k, v, d_out)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    expected = torch.autograd.grad(fn(*leaves), leaves, d_out)
    assert torch.equal(o, fn(q, k, v)) and not o.requires_grad
    for got, want in zip((dq, dk, dv), expected, strict=True):
        assert torch.allclose(got, want)
    assert not any(x.requires_grad or x.grad is not None for x in (q, k, v))
