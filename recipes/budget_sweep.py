"""When does position use set in? The clone's name for `hf-alibi sweep` (`hf_alibi.experiments.commands.budget_sweep`).

HF_HUB_OFFLINE=1 python -m recipes.budget_sweep --config hf_alibi/experiments/configs/budget_sweep.yaml   # or: budget_sweep
"""

import sys

from hf_alibi.cli import main as cli_main
from hf_alibi.experiments.commands.budget_sweep import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(cli_main(["sweep", *sys.argv[1:]]))
