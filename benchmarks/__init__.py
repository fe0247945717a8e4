"""Benchmarks of hf_alibi against GPT-2 (SDPA), BLOOM and MPT: `python -m benchmarks.bench_alibi --help`."""
