"""`bench_observed_layers`' report: each path's min and median, and the median of the paired rounds' ratios, which a
slow spell falling on both paths of one round does not move."""

import pytest

from benchmarks.bench_observed_layers import main, markdown


def test_the_paired_ratio_is_the_median_of_each_rounds_unobserved_over_hooked():
    slow_spell = [1.0, 1.0, 3.0]  # the third round slow for both paths
    cells = [{"length": 4096, "seconds": {"unobserved": [0.9, 0.95, 2.7], "hooked": slow_spell}}]
    row = next(line for line in markdown(cells, "python -m x").splitlines() if line.startswith("| 4,096"))
    assert row == "| 4,096 | 0.900 | 0.950 | 1.000 | 1.000 | 0.900 |"


def test_processes_repeats_and_lengths_must_be_positive():
    with pytest.raises(SystemExit, match="at least 1"):
        main(["--processes", "0"])
    with pytest.raises(SystemExit, match="positive"):
        main(["--lengths", "0"])
