"""Evaluate checkpoints at multiples of their training length: the clone's name for `hf-alibi evaluate`
(`hf_alibi.experiments.commands.evaluate_length`).

    HF_HUB_OFFLINE=1 python -m recipes.evaluate_length --model runs/alibi/final \
        --length_factors 1 2 4 --max_documents 4 --no_sliding --output_dir runs/length_eval_small
"""

import sys

from hf_alibi.cli import main as cli_main
from hf_alibi.experiments.commands.evaluate_length import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(cli_main(["evaluate", *sys.argv[1:]]))
