"""When does position use set in? The 16L/L perplexity ratio of every encoding at three training budgets.

    HF_HUB_OFFLINE=1 python -m recipes.budget_sweep --config recipes/configs/budget_sweep.yaml

Each budget is a whole train-short/test-long experiment (`<output_dir>/steps_<budget>/`); the sweep's table, figure
and JSON go to `<output_dir>/budget_sweep.{md,png,json}`. In seconds, on a tiny model (what the tests run):

    HF_HUB_OFFLINE=1 python -m recipes.budget_sweep --config recipes/configs/budget_sweep.yaml --smoke \
        --budgets 2 4 --output_dir runs/sweep_smoke
"""

import logging
import sys

from hf_alibi.experiments.arguments import parse_args
from hf_alibi.experiments.budget_sweep import SweepArguments, run_budget_sweep
from hf_alibi.experiments.runner import ExperimentArguments, apply_smoke


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    experiment, sweep, training = parse_args(argv if argv is not None else sys.argv[1:], ExperimentArguments,
                                             SweepArguments)  # fmt: skip
    if experiment.smoke:
        budgets = sweep.budgets
        apply_smoke(experiment, training)
        sweep.budgets = budgets  # the smoke shrinks the model and data; the budgets stay as given
    run_budget_sweep(experiment, training, sweep)


if __name__ == "__main__":
    main()
