"""`bench_length_scaling`'s figures from its processes' results: the doubling ratios (also round by round), the
per-token working memory through the two longest lengths, and the largest context a memory budget holds (checkpoint
and 1.3B shape)."""

import pytest

from benchmarks.bench_length_scaling import SHAPE_1_3B, main, memory_limits, shaped_weights_bytes
from benchmarks.length_report import doubling, markdown, median_interval, paired_doublings, round_medians, round_minima

MIB = 1 << 20


def cell(length, seconds, working):
    return {
        "length": length,
        "resting_bytes": 600 * MIB,
        "forward_bytes": working,
        "forward_bytes_default_allocator": working + MIB,
        "forward_s": [seconds, seconds * 1.1],
        "decode_s": [seconds / 100, seconds / 90],
        "threads": 2,
        "rounds": 1,
    }


def test_doublings_are_each_length_over_the_previous_and_memory_fits_a_line_through_the_two_longest():
    cells = [cell(1024, 1.0, 10 * MIB), cell(2048, 2.2, 18 * MIB), cell(4096, 4.4, 34 * MIB)]
    assert doubling(cells, lambda c: min(c["forward_s"])) == [None, pytest.approx(2.2), pytest.approx(2.0)]
    config = {"n_layer": 4, "n_embd": 128}
    limits = memory_limits(cells, [], config, budget=1 << 30)["checkpoint"]
    assert limits["working_bytes_per_token"] == 16 * MIB / 2048  # (34 - 18) MiB over 2048 more tokens
    assert limits["cache_bytes_per_token"] == 2 * 4 * 128 * 4
    assert limits["forward_tokens"] == (1024 - 600) * MIB // (8 * 1024)
    assert limits["generate_tokens"] == (1024 - 600) * MIB // (8 * 1024 + 4096)
    text = markdown(
        {
            "checkpoint_name": "alibi/final",
            "command": "python -m x",
            "memory_gib": 1.0,
            "repeats": 2,
            "cells": cells,
            "limits": {"checkpoint": limits},
        }
    )
    assert "| 2,048 | 2.200 (x2.20) | 2.200 (x2.20) | 18 (x1.80) | 19 |" in text
    assert f"**{limits['forward_tokens']:,} tokens**" in text


def test_the_median_of_the_processes_minima_is_immune_to_one_fast_process():
    # three rounds of one forward each; the second 2k process caught a fast spell of the host
    cells = [cell(1024, 1.0, 10 * MIB), cell(2048, 2.0, 18 * MIB)]
    cells[0]["forward_s"], cells[1]["forward_s"] = [1.0, 1.02, 1.01], [2.1, 1.7, 2.08]
    report = {"checkpoint_name": "c", "command": "x", "memory_gib": 1.0, "repeats": 1, "cells": cells, "limits": {}}
    assert "| 2,048 | 1.700 (x1.70) | 2.080 (x2.06) |" in markdown(report)
    assert round_minima(cells[1], repeats=1) == [2.1, 1.7, 2.08]
    assert round_minima({"forward_s": [3.0, 2.0, 5.0, 4.0]}, repeats=2) == [2.0, 4.0]


def test_the_1_3b_shape_counts_its_weights_and_adds_every_other_layer_to_the_one_measured():
    weights = shaped_weights_bytes()
    assert 1.2e9 < weights / 4 < 1.5e9  # a 1.3B-parameter model, fp32
    cells = [cell(1024, 1.0, 10 * MIB), cell(2048, 2.0, 18 * MIB)]
    shaped = [cell(1024, 0, 100 * MIB), cell(2048, 0, 200 * MIB)]
    limits = memory_limits(cells, shaped, {"n_layer": 4, "n_embd": 128}, budget=24 << 30)["1.3B-shaped"]
    assert limits["cache_bytes_per_token"] == 2 * SHAPE_1_3B["n_layer"] * SHAPE_1_3B["n_embd"] * 4
    assert 0 < limits["generate_tokens"] < limits["forward_tokens"]


def test_lengths_must_be_two_or_more_increasing(capsys):
    with pytest.raises(SystemExit, match="at least two increasing lengths"):
        main(["--lengths", "4096,2048"])


def test_the_training_step_table_gives_each_doubling_of_time_and_working_memory(tmp_path, capsys):
    from types import SimpleNamespace

    from benchmarks.bench_length_scaling import write_report
    from benchmarks.length_training import training_markdown

    cells = [
        {"length": 1024, "step_s": [1.1, 1.0], "step_bytes": 10 * MIB, "threads": 2},
        {"length": 2048, "step_s": [2.1, 2.3], "step_bytes": 21 * MIB, "threads": 2},
    ]
    text = training_markdown(SimpleNamespace(native_flush=False, keep_heap=False), cells, "python -m x --train")
    write_report(str(tmp_path / "train"), {"command": "python -m x --train", "cells": cells}, text)
    text = (tmp_path / "train.md").read_text()
    assert "| 1,024 | 1.000 | 10 |" in text
    assert "| 2,048 | 2.100 (x2.10) | 21 (x2.10) |" in text
    assert (tmp_path / "train.json").exists()


def test_flushing_is_refused_without_the_training_step_and_rounds_and_repeats_must_be_positive():
    with pytest.raises(SystemExit, match="add --train"):
        main(["--lengths", "2048,4096", "--native-flush"])
    for option in ("--rounds", "--repeats"):
        with pytest.raises(SystemExit, match="at least 1"):
            main(["--lengths", "2048,4096", option, "0"])


def test_rounds_interleave_the_lengths_and_join_their_times_and_keep_each_operators_least(monkeypatch):
    from types import SimpleNamespace

    from benchmarks import bench_length_scaling

    order = []

    def fake_child(args, length, memory, **_):
        order.append((length, memory))
        if memory:
            return {"length": length, "forward_bytes": length}
        round_ = sum(1 for n, m in order if n == length and not m)  # 1, 2, ... for this length
        return {
            "length": length,
            "forward_s": [length / 1000 + round_],
            "decode_s": [round_ / 10],
            "profile": {"aten::mm": 1.0 / round_, f"only round {round_}": 1.0},
            "threads": 2,
        }

    monkeypatch.setattr(bench_length_scaling, "run_child", fake_child)
    cells = bench_length_scaling.timed_cells(SimpleNamespace(rounds=3), [1024, 2048])
    assert order == [(1024, True), (2048, True)] + [(1024, False), (2048, False)] * 3, "shortest first, every round"
    assert cells[1]["forward_s"] == [3.048, 4.048, 5.048] and cells[1]["decode_s"] == [0.1, 0.2, 0.3]
    assert cells[0]["forward_bytes"] == 1024 and cells[0]["rounds"] == 3
    assert cells[0]["profile"] == {"aten::mm": pytest.approx(1 / 3)}, "each operator's least, of those all rounds have"


def test_the_profile_table_follows_the_longest_lengths_operators_with_each_doubling():
    from benchmarks.length_training import profile_lines

    cells = [
        {"length": 1024, "profile": {"aten::mm": 1.0, "aten::gelu": 0.5}},
        {"length": 2048, "profile": {"aten::mm": 2.6, "aten::cat": 0.1}},
    ]
    text = "\n".join(profile_lines(cells, "step"))
    assert "| `aten::mm` | 1.000 | 2.600 (x2.60) |" in text
    assert "| `aten::cat` | - | 0.100 |" in text
    assert profile_lines([{"length": 1024}], "step") == []


def test_each_doubling_is_paired_round_by_round_with_a_distribution_free_interval_for_its_median():
    # two rounds of two forwards each: the host slowed down in the second round, on both lengths alike
    cells = [cell(1024, 1.0, 10 * MIB), cell(2048, 2.0, 18 * MIB)]
    cells[0].update(forward_s=[1.0, 1.1, 1.5, 1.6], decode_s=[0.01, 0.03, 0.02, 0.015, 0.015, 0.015], rounds=2)
    cells[1].update(forward_s=[2.1, 2.0, 3.2, 3.0], decode_s=[0.02, 0.06, 0.04, 0.03, 0.03, 0.03], rounds=2)
    forward = paired_doublings(cells, lambda c: round_minima(c, repeats=2))[0]
    assert forward["ratios"] == [pytest.approx(2.0), pytest.approx(2.0)], "the slow round's 2x is still 2x"
    assert round_medians(cells[1], "decode_s") == [0.04, 0.03]
    # n = 8: the 2nd least and 2nd largest cover the median with 1 - 2 (1 + 8) / 256 = 93%
    median, low, high, coverage = median_interval([2.3, 1.9, 2.0, 2.05, 2.1, 1.8, 2.02, 2.08])
    assert (median, low, high) == (pytest.approx(2.035), 1.9, 2.1) and coverage == pytest.approx(1 - 18 / 256)
    assert median_interval([2.0, 2.2, 2.1]) == (2.1, 2.0, 2.2, 0.75), "too few rounds: the range, its coverage said"
    report = {"checkpoint_name": "c", "command": "x", "memory_gib": 1.0, "repeats": 2, "cells": cells, "limits": {}}
    assert "| 1,024 -> 2,048 | 2.00, 2.00 | x2.000 | x2.000 - x2.000 (50%) | x2.000 |" in markdown(report)
