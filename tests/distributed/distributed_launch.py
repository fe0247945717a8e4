"""Run `distributed_worker.py` in N gloo processes (`torchrun --standalone`) and collect what each rank saved.

Shared by the tests of tests/distributed/: inputs and one-process references are made in the test process, the
sharded model runs in the workers, the comparison happens back in the test.
"""

import os
import subprocess
import sys
from pathlib import Path

import torch

WORKER = Path(__file__).with_name("distributed_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def run_workers(nproc: int, case: str, out: Path, timeout: float = 600, expect_failure: bool = False, **options):
    """`torchrun --nproc_per_node nproc distributed_worker.py case --out out --key value ...`; returns each rank's
    saved dict (rank order), or, with `expect_failure`, the combined output of the failed launch."""
    out.mkdir(parents=True, exist_ok=True)
    args = [f"--{key}={value}" for key, value in options.items()]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(WORKER),
        case,
        f"--out={out}",
        *args,
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(ROOT),
        "TOKENIZERS_PARALLELISM": "false",
    }
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=out)
    if expect_failure:
        assert result.returncode != 0, f"{case} was expected to fail but ran:\n{result.stdout[-3000:]}"
        return result.stdout + result.stderr
    assert result.returncode == 0, f"{case} failed:\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(nproc)]


def save_model_and_rows(folder: Path) -> torch.Tensor:
    """What the workers load: a tiny ALiBi model (seed 0) at `folder/model` and 4 training rows of 16 tokens at
    `folder/in.pt`; returns the rows."""
    from conftest import tiny_config_kwargs
    from hf_alibi import AlibiGPT2Config, AlibiGPT2LMHeadModel

    torch.manual_seed(0)
    AlibiGPT2LMHeadModel(AlibiGPT2Config(**tiny_config_kwargs())).save_pretrained(folder / "model")
    rows = torch.randint(3, 256, (4, 16), generator=torch.Generator().manual_seed(4))
    torch.save({"train": rows}, folder / "in.pt")
    return rows


def max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def train_steps(model, optimizer, rows: torch.Tensor, steps: int) -> list[float]:
    """`steps` optimizer steps of `model` on `rows` as its own labels; the loss of each. Shared by the workers and
    the tests' one-process references, so both sides train the same way."""
    losses = []
    for _ in range(steps):
        loss = model(rows, labels=rows).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses
