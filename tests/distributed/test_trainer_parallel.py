"""Trainer on 2 CPU processes (torchrun, gloo) with transformers' engine, and what accelerate does not run on CPU.

- A model sharded at loading by `DistributedConfig(fsdp_size=2)` trains under Trainer to one process's result.
- `cpu_ram_efficient_loading` (ranks > 0 get zero placeholders for non-persistent buffers): the slopes are right on
  every rank.
- Not on CPU (accelerate 1.x, checked here so that the day it changes these tests say so):
  `--fsdp full_shard` silently runs DDP (accelerate sets `DistributedType.FSDP` only for accelerator devices, so the
  FSDP plugin is dropped on `MULTI_CPU`), and Trainer refuses a `DistributedConfig(tp_size=2)` model ("ParallelismConfig
  is only compatible DistributedType.FSDP (version 2) or DistributedType.Multi{Device} or DistributedType.DEEPSPEED,
  but got DistributedType.MULTI_CPU").
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from distributed_launch import max_difference, run_workers, save_model_and_rows, train_steps
from hf_alibi import get_alibi_slopes

STEPS = 2
ATOL = 1e-5  # fp32, AdamW; measured ~5e-6


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trainer")
    save_model_and_rows(tmp)
    return tmp


def one_process_adamw(tmp) -> tuple[list[float], dict]:
    """Trainer's step in one process on the whole batch: AdamW, constant lr 1e-3, no weight decay, no clipping."""
    rows = torch.load(tmp / "in.pt")["train"]
    model = AutoModelForCausalLM.from_pretrained(tmp / "model").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    losses = train_steps(model, optimizer, rows, STEPS)
    return losses, {name: p.detach() for name, p in model.named_parameters()}


def assert_trained_like_one_process(tmp, ranks) -> None:
    losses, final = one_process_adamw(tmp)
    for rank, result in enumerate(ranks):
        torch.testing.assert_close(result["slopes"], get_alibi_slopes(12), atol=0, rtol=0, msg=f"rank {rank}")
        assert max_difference(torch.tensor(result["losses"]), torch.tensor(losses)) < ATOL, (result["losses"], losses)
        for name, parameter in final.items():
            error = max_difference(result["final"][name], parameter)
            assert error < ATOL, f"rank {rank}: {name} differs from one process's by {error:.2e}"


def test_trainer_on_an_fsdp2_sharded_model_matches_one_process(saved):
    ranks = run_workers(
        2, "trainer", saved / "fsdp", folder=saved / "model", inputs=saved / "in.pt", mode="fsdp", steps=STEPS
    )
    assert_trained_like_one_process(saved, ranks)


def test_slopes_are_real_and_right_on_every_rank_after_cpu_ram_efficient_loading(saved):
    ranks = run_workers(2, "ram_efficient_loading", saved / "ram", folder=saved / "model")
    assert all(result["fsdp_loading"] for result in ranks)  # transformers took its FSDP loading path on every rank
    for rank, result in enumerate(ranks):
        torch.testing.assert_close(result["slopes"], get_alibi_slopes(12), atol=0, rtol=0, msg=f"rank {rank}")


@pytest.mark.slow
def test_trainer_fsdp_flag_on_cpu_runs_ddp_instead(saved):
    ranks = run_workers(
        2,
        "trainer",
        saved / "accelerate",
        folder=saved / "model",
        inputs=saved / "in.pt",
        mode="accelerate",
        steps=STEPS,
    )
    assert [(r["distributed_type"], r["is_fsdp_enabled"]) for r in ranks] == [("DistributedType.MULTI_CPU", False)] * 2
    assert_trained_like_one_process(saved, ranks)  # DDP: still one process's result, but nothing is sharded


@pytest.mark.slow
def test_trainer_refuses_a_tensor_parallel_model_on_cpu(saved):
    output = run_workers(
        2,
        "trainer",
        saved / "tp",
        folder=saved / "model",
        inputs=saved / "in.pt",
        mode="tp",
        steps=STEPS,
        expect_failure=True,
    )
    assert "ParallelismConfig is only compatible" in output and "got DistributedType.MULTI_CPU" in output, output[
        -3000:
    ]
