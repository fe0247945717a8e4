"""Launch checks for the recipes: every launched process joins one process group, one live run per output folder.

    _ = training.device                         # transformers sets up the process group here
    state = PartialState()
    check_process_group(state, use_cpu=training.use_cpu)
    with output_dir_lock(training.output_dir, state):
        ...                                     # train, evaluate, write

Two launch mistakes that are silent otherwise, both caught before anything is written:
- `torchrun --nproc_per_node 2 -m hf_alibi.experiments.commands.train_short_test_long ...` on CPU without `--use_cpu true`:
  transformers sets up the gloo process group only with `use_cpu`, so two separate one-process experiments run and
  write the same output folder at once.
- `accelerate launch --cpu --num_processes 2 ...`: accelerate's CPU launcher starts one process, not two.

`final_dir` is where a run keeps each trained model (`<output_dir>/<name>/final`): training writes it, cards,
the Hub push and the evaluations read it.

`shard_model` hands a recipe's fresh ALiBi model to transformers' engine (`--tp_size`, `--fsdp_size`).

The lock is `<output_dir>/.hf_alibi.lock`, held with `fcntl.flock` for the run's lifetime (the kernel releases it
when the process dies, however it dies) and holding the owner's pid, host and command for the refusal message.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

LOCK_FILE = ".hf_alibi.lock"
# The launchers' world-size variables, in accelerate's order: torchrun / accelerate, then the MPI launchers.
WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
TORCHRUN_FIX = "torchrun --nproc_per_node N -m hf_alibi.experiments.commands.train_short_test_long ... --use_cpu true"


def final_dir(output_dir: Path, name: str) -> Path:
    """Where model `name` of a run into `output_dir` is saved when trained: what cards describe and the Hub gets."""
    return output_dir / name / "final"


def launched_world_size(environ: Mapping[str, str] = os.environ) -> tuple[int, str | None]:
    """How many processes the launcher says it started, and the variable that says so ((1, None) if none does)."""
    for name in WORLD_SIZE_VARIABLES:
        value = environ.get(name, "").strip()
        if value:
            if not value.isdigit():
                raise ValueError(f"{name}={value!r} set by the launcher is not a process count")
            return int(value), name
    return 1, None


def check_process_group(state, *, use_cpu: bool, environ: Mapping[str, str] = os.environ) -> None:
    """Raise `ValueError` naming the fix if the launched processes did not form one process group.

    `state` is accelerate's `PartialState` after `TrainingArguments.device` has set it up (its `num_processes` is the
    size of the group this process joined).
    """
    launched, variable = launched_world_size(environ)
    if launched > 1 and state.num_processes != launched:
        cpu = state.device.type == "cpu"
        fix = (
            f"on CPU add --use_cpu true (transformers sets up gloo DDP only then): {TORCHRUN_FIX}"
            if cpu and not use_cpu
            else "check the launcher's settings (devices, backend) against the process count"
        )
        raise ValueError(
            f"the launcher started {launched} processes ({variable}={launched}) but this one joined a process group "
            f"of {state.num_processes}: each would run the whole experiment alone and write the same output folder; "
            f"{fix}"
        )
    if launched == 1 and _truthy(environ.get("ACCELERATE_USE_CPU")) and "MASTER_PORT" in environ:
        # accelerate's simple launcher sets MASTER_ADDR/PORT only when asked for more than one process, then starts one
        raise ValueError(
            "`accelerate launch --cpu --num_processes N` starts one process only; launch N CPU processes with "
            f"`accelerate launch --multi_gpu --num_processes N ... --use_cpu true` or `{TORCHRUN_FIX}`"
        )


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


@contextmanager
def output_dir_lock(output_dir: str | os.PathLike, state=None) -> Iterator[Path | None]:
    """Hold `<output_dir>/.hf_alibi.lock` for the block; refuse with `ValueError` while another live run holds it.

    Only the main process (rank 0) takes the lock; with several processes its outcome is broadcast so every rank
    raises the same error. A lock file left by a dead run (the flock is free) is taken over with a warning, so an
    interrupted run resumes. If the block leaves `output_dir` empty and it did not exist before, it is removed:
    a run that fails early leaves nothing behind (nor the empty parents it created). Yields the lock path on the main
    process, else None.
    """
    folder = Path(output_dir)
    is_main = state is None or state.is_main_process
    handle, error, created = None, None, []
    if is_main:
        created = [path for path in (folder, *folder.parents) if not path.exists()]  # deepest first
        try:
            handle = _acquire(folder)
        except ValueError as exc:
            error = str(exc)
    if state is not None and state.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        error = broadcast_object_list([error], from_process=0)[0]
    if error is not None:
        _remove_if_empty(created)
        raise ValueError(error)
    try:
        yield folder / LOCK_FILE if is_main else None
    finally:
        if handle is not None:
            _release(folder / LOCK_FILE, handle)
        _remove_if_empty(created)


def _acquire(folder: Path) -> int | None:
    folder.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows
        logger.warning("no fcntl on this platform: %s is not locked against a second run", folder)
        return None
    path = folder / LOCK_FILE
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            owner = _read_owner(path)
            raise ValueError(
                f"output folder {folder} is in use by another live run (pid {owner.get('pid', '?')} on host "
                f"{owner.get('host', '?')}, command: {owner.get('command', '?')}); wait for it, stop it, or choose "
                "another --output_dir"
            ) from None
        try:
            same_file = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same_file = False
        if same_file:  # else the previous owner unlinked it between our open and flock: lock the new file instead
            break
        os.close(fd)
    stale = _read_owner(path)
    if stale:
        logger.warning(
            "taking over the lock of %s left by a run that is no longer alive (pid %s on host %s)",
            folder,
            stale.get("pid"),
            stale.get("host"),
        )
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv)}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(owner) + "\n").encode(), 0)
    return fd


def _release(path: Path, fd: int) -> None:
    try:
        os.unlink(path)  # while still holding the flock, so no one locks the file we are removing
    finally:
        os.close(fd)


def _read_owner(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def _remove_if_empty(folders: list[Path]) -> None:
    """Remove `folders` (deepest first) while they are empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except FileNotFoundError:
            continue
        except OSError:
            return  # not empty: something else lives there now


def shard_model(model, experiment, folder: Path, state):
    """`model` as transformers' engine shards it (`from_pretrained(..., distributed_config=...)`: tensor parallel over
    `tp_size` ranks, FSDP2 over `fsdp_size`), through `folder`, which the main process writes once."""
    from ..._transformers_compat import distributed_config, require_transformers
    from ...models.alibi.transformers_compat import TENSOR_PARALLEL_TRANSFORMERS

    # before DistributedConfig is imported: 4.57-5.12 have one without tp_size / fsdp_size, and the styles need 5.24
    require_transformers(TENSOR_PARALLEL_TRANSFORMERS, "Sharding a model on transformers' engine (DistributedConfig)")
    from ...models.alibi.modeling_alibi_gpt2 import AlibiGPT2LMHeadModel

    if experiment.tp_size * experiment.fsdp_size != state.num_processes:
        raise ValueError(
            f"tp_size={experiment.tp_size} x fsdp_size={experiment.fsdp_size} must equal the {state.num_processes} "
            "launched processes (torchrun --nproc_per_node)"
        )
    if state.is_main_process and not (folder / "config.json").is_file():
        model.save_pretrained(folder)
    state.wait_for_everyone()
    config = distributed_config(tp_size=experiment.tp_size, fsdp_size=experiment.fsdp_size)
    return AlibiGPT2LMHeadModel.from_pretrained(folder, distributed_config=config)


def portable_command(argv: list[str] | None = None, cwd: str | Path | None = None) -> str:
    """The command line (default `sys.argv`) as results record it, without this machine's paths: the program by its
    name (`hf-alibi` for the CLI, else the script's file name), paths inside the working folder relative to it, and
    any other absolute path as `<outside>/` and its last part."""
    argv = list(sys.argv if argv is None else argv)
    cwd = Path.cwd() if cwd is None else Path(cwd)
    program = Path(argv[0]).name
    program = "hf-alibi" if program in ("cli.py", "hf-alibi", "__main__.py") else program

    def portable(argument: str) -> str:
        name, sep, value = argument.partition("=") if argument.startswith("--") else ("", "", argument)
        path = Path(value)
        if path.is_absolute():
            value = str(path.relative_to(cwd)) if path.is_relative_to(cwd) else f"<outside>/{path.name}"
        return f"{name}{sep}{value}"

    return " ".join([program, *map(portable, argv[1:])])


__all__ = [
    "LOCK_FILE",
    "check_process_group",
    "final_dir",
    "launched_world_size",
    "output_dir_lock",
    "portable_command",
    "shard_model",
]
