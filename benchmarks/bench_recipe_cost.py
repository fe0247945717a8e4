"""The recipe's training-cost measurement alone, for any config's models, without training anything.

    HF_HUB_OFFLINE=1 python -m benchmarks.bench_recipe_cost --config cpu_demo --models alibi learned
    HF_HUB_OFFLINE=1 python -m benchmarks.bench_recipe_cost --config headline --steps 20

Fresh models, the optimizer Trainer creates, one batch as the recipe's collator makes it, untimed warm-up steps,
then interleaved training steps in rotating order (`hf_alibi.experiments.training.training_cost`, what every recipe run
records in its `results.md`). Prints each model's median step, its ratio to the first model named, tokens/s and
peak memory: set it beside `benchmarks.bench_alibi --suite train` at the same shape (BENCHMARKS.md, "Recipe
training cost").
"""

import argparse

from accelerate import PartialState

from hf_alibi.experiments.setup.arguments import parse_args
from hf_alibi.experiments.training.runner import ExperimentArguments, measure_costs, prepare_data


def main(argv: list[str] | None = None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a shipped config's name or a YAML file")
    parser.add_argument("--models", nargs="+", help="models to time (default: the config's)")
    parser.add_argument("--steps", type=int, default=20, help="interleaved timed steps per model")
    args = parser.parse_args(argv)
    overrides = ["--cost_steps", str(args.steps), "--output_dir", "runs/bench_recipe_cost"]
    overrides += ["--models", *args.models] if args.models else []
    experiment, training = parse_args(["--config", args.config, *overrides], ExperimentArguments)
    _ = training.device  # TrainingArguments sets up the (single) process state first
    _, tokenizer, train_blocks, _ = prepare_data(experiment, PartialState())
    costs = measure_costs(experiment, training, tokenizer, train_blocks)
    first = next(iter(costs.values()))["step_seconds_median"]
    for name, cost in costs.items():
        step = cost["step_seconds_median"]
        print(
            f"{name:>16}: {step * 1000:7.1f} ms a step ({step / first:.3f}x), "
            f"{cost['tokens_per_second']:8,.0f} tokens/s, peak {cost['peak_memory_mib']} MiB"
        )
    return costs


if __name__ == "__main__":
    main()
