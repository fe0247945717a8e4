"""Train short, test long (Press et al., 2022): train position encodings at one length, evaluate at up to 16x.

CPU-sized default, offline (Python-stdlib corpus, locally trained tokenizer; ALiBi, learned and sinusoidal
positions; about 30 minutes on 2 cores):

    HF_HUB_OFFLINE=1 python -m recipes.train_short_test_long --config recipes/configs/cpu_demo.yaml

The whole pipeline in under a minute (tiny model; what the tests run):

    HF_HUB_OFFLINE=1 python -m recipes.train_short_test_long --config recipes/configs/cpu_demo.yaml --smoke \
        --output_dir runs/smoke

The paper's setting (WikiText-103, L=512, GPUs; network needed for the data and the GPT-2 tokenizer):

    torchrun --nproc_per_node 8 -m recipes.train_short_test_long --config recipes/configs/wikitext103_512.yaml

Any YAML key can be overridden on the command line (`--max_steps 100`). Two processes on CPU (gloo DDP; without
`--use_cpu true` the launch is refused, since transformers would run two separate experiments):

    torchrun --nproc_per_node 2 -m recipes.train_short_test_long --config recipes/configs/cpu_demo.yaml --smoke \
        --use_cpu true

A second run into an output folder that a live run is using refuses to start (`<output_dir>/.hf_alibi.lock`).
"""

import logging
import sys

from hf_alibi.experiments.runner import ExperimentArguments, apply_smoke, run_experiment
from hf_alibi.experiments.arguments import parse_args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    experiment, training = parse_args(argv if argv is not None else sys.argv[1:], ExperimentArguments)
    if experiment.smoke:
        apply_smoke(experiment, training)
    run_experiment(experiment, training)


if __name__ == "__main__":
    main()
