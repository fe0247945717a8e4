"""Train short, test long: the clone's name for `hf-alibi train` (`hf_alibi.experiments.commands.train_short_test_long`).

    HF_HUB_OFFLINE=1 python -m recipes.train_short_test_long --config hf_alibi/experiments/configs/cpu_demo.yaml   # or: cpu_demo
    HF_HUB_OFFLINE=1 python -m recipes.train_short_test_long --config smoke --output_dir runs/smoke   # < 1 minute
    torchrun --nproc_per_node 2 -m recipes.train_short_test_long --config smoke --use_cpu true       # 2 CPU processes

`--config NAME` (a bare name) is the config shipped as `hf_alibi/experiments/configs/NAME.yaml`.
"""

import sys

from hf_alibi.cli import main as cli_main
from hf_alibi.experiments.commands.train_short_test_long import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(cli_main(["train", *sys.argv[1:]]))
