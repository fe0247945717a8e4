"""Train short, test long (Press et al., 2022): train position encodings at one length, evaluate at up to 16x.

`hf-alibi train` runs `main`; so do `python -m hf_alibi.experiments.commands.train_short_test_long` and, in a clone,
`python -m recipes.train_short_test_long`. `--config` takes a YAML file or the name of a shipped config
(`hf_alibi/experiments/configs/`: smoke, cpu_demo, headline, retrieval, finetune_gpt2, wikitext103_512). A config
with `retrieval: true` runs the retrieval experiment (`hf_alibi.experiments.retrieval.experiment`) instead.

CPU-sized, offline (Python-stdlib corpus, locally trained tokenizer; ALiBi, learned, sinusoidal and rotary
positions; about 15 minutes on 2 cores):

    HF_HUB_OFFLINE=1 hf-alibi train --config cpu_demo

The whole pipeline in under a minute (tiny model; what the tests run):

    HF_HUB_OFFLINE=1 hf-alibi train --config cpu_demo --smoke --output_dir runs/smoke

The paper's setting (WikiText-103, L=512, GPUs; network needed for the data and the GPT-2 tokenizer):

    torchrun --nproc_per_node 8 -m hf_alibi.experiments.commands.train_short_test_long --config wikitext103_512

Any YAML key can be overridden on the command line (`--max_steps 100`). Two processes on CPU (gloo DDP; without
`--use_cpu true` the launch is refused, since transformers would run two separate experiments):

    torchrun --nproc_per_node 2 -m hf_alibi.experiments.commands.train_short_test_long --config smoke --use_cpu true

A second run into an output folder that a live run is using refuses to start (`<output_dir>/.hf_alibi.lock`).
"""

import logging
import sys

from ..setup.arguments import ExperimentArguments, apply_smoke, parse_args
from ..training.runner import run_experiment


def main(argv: list[str] | None = None) -> None:
    """Parse `argv` (default `sys.argv[1:]`), shrink to the smoke budget if asked, and run the experiment."""
    argv = sys.argv[1:] if argv is None else argv
    experiment, training = parse_args(argv, ExperimentArguments, prog="hf-alibi train")
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    if experiment.smoke:
        apply_smoke(experiment, training)
    if experiment.retrieval:  # configs retrieval / retrieval_smoke: perplexity and passkey retrieval per arm
        from ..retrieval.experiment import run_retrieval

        run_retrieval(experiment, training)
    else:
        run_experiment(experiment, training)


if __name__ == "__main__":
    from ...command_errors import run_command

    sys.exit(run_command(main))
