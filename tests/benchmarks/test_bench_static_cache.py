"""benchmarks/bench_static_cache.py from known numbers (the benchmark itself is the lead's to run)."""

from benchmarks import bench_static_cache

MIB = 2**20


def test_table_has_medians_spreads_and_static_over_dynamic_ratio_per_prompt():
    runs = [
        {"cache": cache, "prompt": prompt, "process_peak_bytes": peak * MIB, "call_growth_bytes": growth * MIB}
        for cache, prompt, peak, growth in [
            ("static", 4096, 460, 100),
            ("static", 4096, 470, 90),
            ("static", 4096, 465, 95),
            ("dynamic", 4096, 450, 90),
            ("dynamic", 4096, 455, 80),
            ("dynamic", 4096, 440, 85),
        ]
    ]
    (row,) = bench_static_cache.summarise(runs, [4096])
    assert row["static_process_peak_bytes"] == 465 * MIB and row["dynamic_process_peak_bytes"] == 450 * MIB
    assert row["static_process_peak_bytes_range"] == [460 * MIB, 470 * MIB]
    assert abs(row["peak_ratio"] - 465 / 450) < 1e-12 and abs(row["growth_ratio"] - 95 / 85) < 1e-12
    table = bench_static_cache.markdown([row], bench_static_cache.parse_args([]))
    assert "| 4096 | 465 [460, 470] | 450 [440, 455] | 1.03x |" in table


def test_defaults_are_issue_16s_measurement():
    args = bench_static_cache.parse_args([])
    assert (args.prompts, args.n_head, args.n_embd, args.n_layer) == ("4096,16384", 8, 128, 2)
