"""The recipe on transformers' engine: `--fsdp_size` / `--tp_size` (ExperimentArguments) are validated, and under
`torchrun --nproc_per_node 2 ... --use_cpu true` FSDP2 trains what the DDP launch trains; tensor parallelism under
Trainer is refused on CPU by accelerate (the error is checked, so the day it runs this test says so)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_alibi.experiments.setup.arguments import ExperimentArguments

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["tp_size", "fsdp_size"])
@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_sharding_sizes_must_be_positive_integers(name, bad):
    with pytest.raises(ValueError, match=rf"{name} must be a positive integer, got {bad!r}"):
        ExperimentArguments(models=["alibi"], **{name: bad})


def test_sharding_refuses_the_baselines_naming_the_models():
    with pytest.raises(ValueError, match=r"fsdp_size=2 shard ALiBi models only.*\['alibi', 'learned'\]"):
        ExperimentArguments(models=["alibi", "learned"], fsdp_size=2)


def recipe(tmp_path: Path, *options: str) -> subprocess.CompletedProcess:
    """The smoke recipe, ALiBi only, on 2 gloo processes."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "recipes.train_short_test_long",
        "--config",
        "smoke",
        "--use_cpu",
        "true",
        "--models",
        "alibi",
        "--cost_steps",
        "0",
        "--output_dir",
        str(tmp_path),
        *options,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)


@pytest.mark.slow
def test_recipe_with_fsdp_size_2_trains_what_the_ddp_launch_trains(tmp_path):
    ddp, fsdp = recipe(tmp_path / "ddp"), recipe(tmp_path / "fsdp", "--fsdp_size", "2")
    assert ddp.returncode == 0 and fsdp.returncode == 0, (ddp.stderr[-3000:], fsdp.stderr[-3000:])
    first = json.loads((tmp_path / "ddp" / "alibi" / "evaluation.json").read_text())
    second = json.loads((tmp_path / "fsdp" / "alibi" / "evaluation.json").read_text())
    assert first["training"]["steps"] == second["training"]["steps"] > 0
    for got, expected in zip(second["evaluation"]["lengths"], first["evaluation"]["lengths"], strict=True):
        assert got["ppl_nonoverlapping"] == pytest.approx(expected["ppl_nonoverlapping"], rel=1e-4), (got, expected)


@pytest.mark.slow
def test_recipe_with_tp_size_2_is_refused_by_accelerate_on_cpu(tmp_path):
    run = recipe(tmp_path, "--tp_size", "2")
    assert run.returncode != 0
    output = run.stdout + run.stderr
    assert "ParallelismConfig is only compatible" in output and "got DistributedType.MULTI_CPU" in output, output[
        -3000:
    ]
