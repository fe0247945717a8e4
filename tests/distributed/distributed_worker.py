"""One rank of the tests' multi-process runs (started by `distributed_launch.run_workers` under torchrun, gloo, CPU).

Each case loads the checkpoint the test saved with transformers' engine (`from_pretrained(...,
distributed_config=DistributedConfig(...))`), runs it on the test's inputs, and saves `rank{N}.pt` for the test to
compare against one process.
"""

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

import hf_alibi  # noqa: F401  (registers "alibi_gpt2")
from distributed_launch import train_steps  # this folder is on sys.path: the worker runs as a script from it

torch.set_num_threads(1)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (DTensor shards gathered)."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def attention_heads(model) -> list:
    return [
        (block.attn.heads.start, block.attn.heads.stop) if block.attn.heads else None for block in model.transformer.h
    ]


def in_rows(model, *args, **kwargs):
    """`model(*args, **kwargs)` with inference's row-wise layers 4 rows at a time (`INFERENCE_ROWS`): a rank's q, k
    and v heads from its c_attn columns, written into head-major buffers its layers share (no cache) a few rows at a
    time."""
    from hf_alibi.models.alibi import modeling_alibi_gpt2

    rows, modeling_alibi_gpt2.INFERENCE_ROWS = modeling_alibi_gpt2.INFERENCE_ROWS, 4
    try:
        return model(*args, **kwargs)
    finally:
        modeling_alibi_gpt2.INFERENCE_ROWS = rows


def tensor_parallel(args) -> dict:
    """Logits (padded, packed), gradients and greedy generation of a TP-sharded model, per backend."""
    inputs = torch.load(args.inputs)
    result = {}
    for backend in args.backends.split(","):
        config = DistributedConfig(tp_size=args.size) if args.plan == "size" else DistributedConfig(tp_plan="auto")
        model = AutoModelForCausalLM.from_pretrained(
            args.folder, distributed_config=config, attn_implementation=backend
        ).eval()
        if args.wrong_heads:  # what Megatron-DeepSpeed issue 227 did: every rank takes the first heads' slopes
            for block in model.transformer.h:
                width = block.attn.heads.stop - block.attn.heads.start
                block.attn.heads = slice(0, width)
        out = {"heads": attention_heads(model), "slopes": model.transformer.alibi_slopes.clone()}
        with torch.no_grad():
            out["padded"] = model(inputs["ids"], attention_mask=inputs["mask"]).logits
            out["packed"] = model(inputs["packed"], position_ids=inputs["positions"]).logits
            out["padded_in_rows"] = in_rows(model, inputs["ids"], attention_mask=inputs["mask"], use_cache=False).logits
            out["generated"] = model.generate(
                inputs["ids"],
                attention_mask=inputs["mask"],
                max_new_tokens=6,
                do_sample=False,
                pad_token_id=model.config.pad_token_id,
            )
        if backend != "flex_attention":  # no FlexAttention backward on CPU
            loss = model(inputs["ids"], attention_mask=inputs["mask"], labels=inputs["labels"]).loss
            loss.backward()
            out["grads"] = {name: full(p.grad) for name, p in model.named_parameters()}
        result[backend] = out
    return result


def fsdp(args) -> dict:
    """FSDP2 through `DistributedConfig(fsdp_size=N)`: slopes after meta-device loading, `steps` SGD-with-momentum
    steps on this rank's rows; with `--save`, then a sharded checkpoint (model and optimizer, DCP) and `more_steps`
    steps; with `--resume`, training continues from such a checkpoint."""
    from transformers.distributed.checkpoint import load_optimizer_distributed, save_optimizer_distributed

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rows = torch.load(args.inputs)["train"].chunk(size)[rank]  # (B / N, L): this rank's share of the batch
    model = AutoModelForCausalLM.from_pretrained(
        args.resume or args.folder, distributed_config=DistributedConfig(fsdp_size=size)
    ).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if args.resume:
        load_optimizer_distributed(model, optimizer, f"{args.resume}/optimizer")
    out = {
        "slopes": model.transformer.alibi_slopes.clone(),
        "sharded": {name: tuple(p.to_local().shape) for name, p in model.named_parameters() if isinstance(p, DTensor)},
    }
    out["losses"] = train_steps(model, optimizer, rows, args.steps)
    if args.save:
        model.save_pretrained(args.save, distributed_checkpoint=True)
        save_optimizer_distributed(model, optimizer, f"{args.save}/optimizer")
        out["saved"] = {name: full(p) for name, p in model.named_parameters()}
        out["losses"] += train_steps(model, optimizer, rows, args.more_steps)
    out["final"] = {name: full(p) for name, p in model.named_parameters()}
    return out


def tp_fsdp(args) -> dict:
    """TP x FSDP2 (`DistributedConfig(tp_size=2, fsdp_size=N / 2)`): `steps` SGD-with-momentum steps; the ranks of
    one TP group (rank // 2: transformers' mesh is (fsdp, tp), tp innermost) share their FSDP group's rows."""
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rows = torch.load(args.inputs)["train"].chunk(size // 2)[rank // 2]  # (B / fsdp, L)
    config = DistributedConfig(tp_size=2, fsdp_size=size // 2)
    model = AutoModelForCausalLM.from_pretrained(args.folder, distributed_config=config).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out = {"heads": attention_heads(model), "losses": train_steps(model, optimizer, rows, args.steps)}
    with torch.no_grad():  # the trained weights, judged by what they compute: every rank, the whole batch
        out["logits"] = full(model.eval()(torch.load(args.inputs)["train"]).logits)
    return out


class SlopesAtTrainBegin:
    """A Trainer callback recording the slopes of the model Trainer trains (after accelerate prepared it)."""

    def __init__(self):
        self.slopes = None

    def __getattr__(self, name):  # every other TrainerCallback event: nothing to do
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.slopes = model.transformer.alibi_slopes.detach().clone()


def trainer(args) -> dict:
    """Trainer on a model sharded at loading by `DistributedConfig(fsdp_size=N)` or `(tp_size=N)`, or (`accelerate`)
    on a plain model with `--fsdp full_shard` (accelerate's FSDP2); constant-lr AdamW, no clipping."""
    from transformers import Trainer, TrainingArguments

    rows = torch.load(args.inputs)["train"]
    size = int(os.environ["WORLD_SIZE"])
    fsdp = dict(fsdp="full_shard", fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["AlibiGPT2Block"]})
    training = TrainingArguments(
        output_dir=str(args.out / "trainer"),
        use_cpu=True,
        max_steps=args.steps,
        learning_rate=1e-3,
        per_device_train_batch_size=rows.shape[0] // size if args.mode != "tp" else rows.shape[0],  # TP: one batch
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        **(fsdp if args.mode == "accelerate" else {}),
    )
    sizes = {"fsdp": {"fsdp_size": size}, "tp": {"tp_size": size}}.get(args.mode)
    loading = {"distributed_config": DistributedConfig(**sizes)} if sizes else {}
    model = AutoModelForCausalLM.from_pretrained(args.folder, **loading)
    run = Trainer(model=model, args=training, train_dataset=[{"input_ids": row, "labels": row} for row in rows])
    run.train()
    return {
        "distributed_type": str(run.accelerator.distributed_type),
        "is_fsdp_enabled": run.is_fsdp_enabled,
        "slopes": run.model.transformer.alibi_slopes.clone(),
        "losses": [log["loss"] for log in run.state.log_history if "loss" in log],
        "final": {name: full(p) for name, p in run.model.named_parameters()},
    }


def ram_efficient_loading(args) -> dict:
    """`from_pretrained` under accelerate's `cpu_ram_efficient_loading` settings (`is_fsdp_enabled()`): ranks > 0 get
    zero placeholders for non-persistent buffers, to be refilled by `_init_weights`; the slopes must be right."""
    from transformers.distributed import is_fsdp_enabled

    os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_CPU_RAM_EFFICIENT_LOADING="true")
    dist.init_process_group("gloo")
    model = AutoModelForCausalLM.from_pretrained(args.folder)
    return {"slopes": model.transformer.alibi_slopes.clone(), "fsdp_loading": is_fsdp_enabled()}


CASES = {
    "tp": tensor_parallel,
    "fsdp": fsdp,
    "tp_fsdp": tp_fsdp,
    "trainer": trainer,
    "ram_efficient_loading": ram_efficient_loading,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--folder")
    parser.add_argument("--inputs")
    parser.add_argument("--size", type=int, default=int(os.environ.get("WORLD_SIZE", 1)))
    parser.add_argument("--backends", default="sdpa")
    parser.add_argument("--plan", choices=["size", "auto"], default="size")
    parser.add_argument("--wrong_heads", type=int, default=0)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--more_steps", type=int, default=0)
    parser.add_argument("--save")
    parser.add_argument("--resume")
    parser.add_argument("--mode", choices=["fsdp", "tp", "accelerate"], default="fsdp")
    args = parser.parse_args()
    result = CASES[args.case](args)
    torch.save(result, args.out / f"rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
