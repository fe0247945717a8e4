"""Masked-LM training of the ALiBi encoder on the recipe's offline corpus (`hf_alibi.experiments.training.masked_lm`).

    HF_HUB_OFFLINE=1 python -m recipes.train_mlm --config mlm_demo --output_dir /work/ckpt/mlm_demo   # minutes, CPU
    HF_HUB_OFFLINE=1 python -m recipes.train_mlm --config mlm_demo --smoke --output_dir runs/mlm_smoke  # seconds

`--config NAME` is `hf_alibi/experiments/configs/NAME.yaml`; every key can be overridden (`--max_steps 100`). The
model and its tokenizer land in `<output_dir>/final`, the held-out masked-LM losses in `<output_dir>/results.json`.
"""

import logging
import sys

from hf_alibi.experiments.setup.arguments import ExperimentArguments, apply_smoke, parse_args
from hf_alibi.experiments.training.masked_lm import train_masked_lm


def main(argv: list[str] | None = None) -> dict:
    """Parse `argv` (default `sys.argv[1:]`), shrink to the smoke budget if asked, train and save."""
    experiment, training = parse_args(sys.argv[1:] if argv is None else argv, ExperimentArguments, prog="train_mlm")
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    if experiment.smoke:
        apply_smoke(experiment, training)
    return train_masked_lm(experiment, training)


if __name__ == "__main__":
    main()
