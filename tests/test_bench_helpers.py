"""CPU checks of the benchmark helpers whose results feed the README's tables."""

from __future__ import annotations

import pytest

from benchmarks.common import time_ms
from benchmarks.decode import parse
from benchmarks.decode_overhead import fit_line
from benchmarks.exp_bound import parse_pack


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


def test_time_ms_names_a_bad_flush_mode() -> None:
    with pytest.raises(ValueError, match="l2"):
        time_ms(lambda: None, l2="warm")
