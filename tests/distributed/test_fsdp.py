"""FSDP2 on transformers' engine (`DistributedConfig(fsdp_size=N)`, torchrun, gloo on CPU): training steps equal one
process's on the whole batch, the fixed slopes are right on every rank after meta-device loading, and a sharded
(DCP) checkpoint reloads in one process bit for bit and resumes training bit for bit.

Run: `HF_HUB_OFFLINE=1 python -m pytest -q tests/distributed/test_fsdp.py` (`-m "not slow"`: one 2-rank launch).
"""

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.distributed import consolidate_distributed_checkpoint

from distributed_launch import max_difference, run_workers, save_model_and_rows, train_steps
from hf_alibi import get_alibi_slopes

STEPS, MORE_STEPS = 2, 2  # before and after the sharded checkpoint
ATOL = 1e-5  # fp32; measured ~1e-7 (the reduce-scatter averages the ranks' gradients in another order)


def one_process_training(folder, rows: torch.Tensor, steps: int) -> tuple[list[float], torch.nn.Module]:
    """The workers' SGD with momentum on the whole batch in one process: (losses, the trained model)."""
    model = AutoModelForCausalLM.from_pretrained(folder).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return train_steps(model, optimizer, rows, steps), model


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """2 ranks: STEPS steps, a sharded checkpoint (model and optimizer), MORE_STEPS steps."""
    tmp = tmp_path_factory.mktemp("fsdp")
    save_model_and_rows(tmp)
    ranks = run_workers(
        2,
        "fsdp",
        tmp / "out",
        folder=tmp / "model",
        inputs=tmp / "in.pt",
        steps=STEPS,
        more_steps=MORE_STEPS,
        save=tmp / "sharded",
    )
    return tmp, ranks


def test_slopes_are_right_on_every_rank_after_meta_device_loading(fsdp_run):
    _, ranks = fsdp_run
    for rank, result in enumerate(ranks):  # a non-persistent buffer: not in the checkpoint, refilled by _init_weights
        torch.testing.assert_close(result["slopes"], get_alibi_slopes(12), atol=0, rtol=0, msg=f"rank {rank}")


def test_each_rank_holds_half_of_every_parameter(fsdp_run):
    tmp, ranks = fsdp_run
    full = AutoModelForCausalLM.from_pretrained(tmp / "model")
    for name, parameter in full.named_parameters():
        held = [result["sharded"][name] for result in ranks]
        assert sum(shape[0] for shape in held) == parameter.shape[0] and all(
            shape[1:] == parameter.shape[1:] for shape in held
        ), f"{name} {tuple(parameter.shape)} is held as {held}"


def test_training_steps_match_one_process_on_the_whole_batch(fsdp_run):
    tmp, ranks = fsdp_run
    rows = torch.load(tmp / "in.pt")["train"]
    losses, model = one_process_training(tmp / "model", rows, STEPS + MORE_STEPS)
    final = {name: p.detach() for name, p in model.named_parameters()}
    sharded_losses = torch.tensor([result["losses"] for result in ranks]).mean(0)  # equal tokens a rank: the mean
    assert max_difference(sharded_losses, torch.tensor(losses)) < ATOL, (sharded_losses, losses)
    for name, parameter in final.items():
        error = max_difference(ranks[0]["final"][name], parameter)
        assert error < ATOL, f"{name} differs from one process's by {error:.2e} after {STEPS + MORE_STEPS} steps"


def test_sharded_checkpoint_reloads_in_one_process_bit_for_bit(fsdp_run, tmp_path):
    tmp, ranks = fsdp_run
    consolidate_distributed_checkpoint(tmp / "sharded", tmp_path)  # one file from the ranks' shards
    for extra in (tmp / "sharded").glob("*.json"):
        shutil.copy(extra, tmp_path)
    for extra in (tmp / "sharded").glob("*.py"):
        shutil.copy(extra, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    torch.testing.assert_close(model.transformer.alibi_slopes, get_alibi_slopes(12), atol=0, rtol=0)
    loaded = dict(model.named_parameters())
    assert set(loaded) == set(ranks[0]["saved"])
    differing = [name for name, saved in ranks[0]["saved"].items() if not torch.equal(loaded[name], saved)]
    assert not differing, f"not bit for bit after the one-process reload: {differing}"


@pytest.mark.slow
def test_resuming_the_sharded_checkpoint_continues_training_bit_for_bit(fsdp_run):
    tmp, ranks = fsdp_run
    resumed = run_workers(2, "fsdp", tmp / "resumed", resume=tmp / "sharded", inputs=tmp / "in.pt", steps=MORE_STEPS)
    for rank in range(2):
        assert resumed[rank]["losses"] == ranks[rank]["losses"][STEPS:], f"rank {rank}: other losses after resuming"
    differing = [name for name, p in resumed[0]["final"].items() if not torch.equal(p, ranks[0]["final"][name])]
    assert not differing, f"resumed training is not bit for bit the uninterrupted one: {differing}"


@pytest.mark.slow
def test_tensor_parallel_times_fsdp_on_four_processes_trains_like_one_process(tmp_path):
    """4 ranks: TP over pairs, FSDP2 across them; the losses (mean over FSDP groups) and the trained model's logits
    equal one process's. (The trained weights are compared through their logits: `full_tensor()` of c_attn's bias,
    sharded twice on one dimension (strided q|k|v by TP, then by FSDP), does not reassemble it in this torch.)"""
    rows = save_model_and_rows(tmp_path)
    ranks = run_workers(
        4, "tp_fsdp", tmp_path / "out", folder=tmp_path / "model", inputs=tmp_path / "in.pt", steps=STEPS
    )
    assert [r["heads"][0] for r in ranks] == [(0, 6), (6, 12), (0, 6), (6, 12)], "TP pairs must hold both halves"
    losses, model = one_process_training(tmp_path / "model", rows, STEPS)
    with torch.no_grad():
        logits = model.eval()(rows).logits
    sharded_losses = torch.tensor([ranks[0]["losses"], ranks[2]["losses"]]).mean(0)  # one rank per FSDP group
    assert max_difference(sharded_losses, torch.tensor(losses)) < ATOL, (sharded_losses, losses)
    for rank, result in enumerate(ranks):
        error = max_difference(result["logits"], logits)
        assert error < ATOL, f"rank {rank}: the trained model's logits differ from one process's by {error:.2e}"
