"""`compare_lse_bounds`' growth of the kept key work from one length to the next: causal work is L^2 / 2, so a
doubling multiplies it by 4 x (kept fraction at 2L) / (kept fraction at L)."""

import pytest

from benchmarks.compare_lse_bounds import markdown, work_growth


def record(length, bound, overall):
    return dict(length=length, eps=1e-7, bound=bound, per_head=[overall, overall], overall=overall)


def test_kept_work_growth_is_the_length_ratio_squared_times_the_kept_fraction_ratio_per_bound():
    records = [
        record(1024, "exact LSE", 0.40),
        record(1024, "oracle", 0.30),
        record(2048, "exact LSE", 0.21),
        record(2048, "oracle", 0.15),
    ]
    growth = work_growth(records)
    assert [(g["bound"], g["lengths"]) for g in growth] == [("exact LSE", (1024, 2048)), ("oracle", (1024, 2048))]
    assert growth[0]["growth"] == pytest.approx(4 * 0.21 / 0.40)
    assert growth[1]["growth"] == pytest.approx(2.0)  # a constant number of keys per row: linear
    text = markdown("python -m x", "ckpt", 1e-7, [0.5, 0.25], records)
    assert "| 1024 | oracle | **0.300** | 0.300 | 0.300 |" in text
    assert "| exact LSE | 1024 -> 2048 | x2.100 |" in text


def test_one_length_has_no_growth_table():
    assert work_growth([record(1024, "oracle", 0.3)]) == []
    assert "growth" not in markdown("python -m x", "ckpt", 1e-7, [0.5, 0.25], [record(1024, "oracle", 0.3)])
