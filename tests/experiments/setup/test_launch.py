"""Launch checks: a launch whose processes would not form one process group, and a second run into a folder a live
run holds, are refused before anything is written; a lock left by a dead run is taken over."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from hf_alibi.experiments.setup import launch
from hf_alibi.experiments.setup.arguments import ExperimentArguments, apply_smoke, parse_args
from hf_alibi.experiments.setup.launch import LOCK_FILE, output_dir_lock, portable_command
from hf_alibi.experiments.training.runner import run_experiment

REPO = Path(__file__).resolve().parents[3]
SMOKE_YAML = "smoke"  # the shipped config, by name
# The lock holder loads launch.py by path: a real second process that holds the lock, without importing torch.
HOLDER = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("launch", sys.argv[1])
launch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launch)
with launch.output_dir_lock(sys.argv[2]):
    print("locked", flush=True)
    time.sleep(300)
"""


def _args(output_dir, *extra):
    experiment, training = parse_args(
        ["--config", SMOKE_YAML, "--output_dir", str(output_dir), "--models", "alibi", *extra],
        ExperimentArguments,
    )
    apply_smoke(experiment, training)
    return experiment, training


def test_launch_of_two_processes_without_use_cpu_is_refused_before_the_output_folder_exists(tmp_path, monkeypatch):
    # No LOCAL_RANK: with it accelerate would rendezvous with a second process that does not exist here (the real
    # torchrun launch below covers that path).
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    experiment, training = _args(tmp_path / "run")
    with pytest.raises(ValueError, match=r"started 2 processes \(WORLD_SIZE=2\).*add --use_cpu true"):
        run_experiment(experiment, training)
    assert not (tmp_path / "run").exists()


def test_accelerate_cpu_launcher_asked_for_two_processes_is_refused(tmp_path, monkeypatch):
    # `accelerate launch --cpu --num_processes 2` starts one process with exactly these variables (checked here)
    for name, value in {"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    experiment, training = _args(tmp_path / "run")
    with pytest.raises(ValueError, match=r"starts one process only.*--multi_gpu --num_processes N"):
        run_experiment(experiment, training)
    assert not (tmp_path / "run").exists()


def test_launcher_world_size_that_is_not_a_number_is_named():
    with pytest.raises(ValueError, match=r"WORLD_SIZE='two'"):
        launch.launched_world_size({"WORLD_SIZE": "two"})
    assert launch.launched_world_size({}) == (1, None)
    assert launch.launched_world_size({"OMPI_COMM_WORLD_SIZE": "4"}) == (4, "OMPI_COMM_WORLD_SIZE")


@pytest.mark.slow
def test_real_two_process_torchrun_without_use_cpu_exits_non_zero_naming_the_fix_and_writes_nothing(tmp_path):
    output_dir = tmp_path / "ddp"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        "29531",
        "-m",
        "recipes.train_short_test_long",
        "--config",
        SMOKE_YAML,
        "--output_dir",
        str(output_dir),
        "--models",
        "alibi",
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "add --use_cpu true" in done.stderr, done.stderr[-3000:]
    assert not output_dir.exists()


@pytest.fixture
def live_holder(tmp_path):
    """A real, sleeping process holding the lock of `tmp_path / "run"`; killed (SIGKILL) at the end if still alive."""
    folder = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, launch.__file__, str(folder)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield folder, holder
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow
def test_second_run_into_a_folder_held_by_a_live_run_refuses_naming_folder_and_pid(live_holder):
    folder, holder = live_holder
    experiment, training = _args(folder)
    with pytest.raises(ValueError, match=rf"output folder {folder} is in use .*pid {holder.pid} on host"):
        run_experiment(experiment, training)
    assert sorted(p.name for p in folder.iterdir()) == [LOCK_FILE], "the refused run wrote something"
    assert json.loads((folder / LOCK_FILE).read_text())["pid"] == holder.pid


@pytest.mark.slow
def test_lock_left_by_a_killed_run_is_taken_over_with_a_warning_and_released(live_holder, caplog):
    folder, holder = live_holder
    holder.kill()  # SIGKILL: no cleanup runs, the lock file stays behind with the dead pid
    holder.wait()
    assert json.loads((folder / LOCK_FILE).read_text())["pid"] == holder.pid
    with caplog.at_level(logging.WARNING, logger=launch.__name__), output_dir_lock(folder) as lock:
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert f"no longer alive (pid {holder.pid}" in caplog.text
    assert not (folder / LOCK_FILE).exists()
    assert folder.is_dir(), "a folder that existed before the run is kept"


def test_lock_is_released_when_the_run_raises_and_a_folder_it_created_is_removed(tmp_path):
    folder = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt), output_dir_lock(folder):
        assert (folder / LOCK_FILE).exists()
        raise KeyboardInterrupt
    assert not folder.exists()
    with output_dir_lock(folder):  # free again for the resuming run
        (folder / "kept.txt").write_text("x")
    assert sorted(p.name for p in folder.iterdir()) == ["kept.txt"]


def test_shard_model_on_a_transformers_older_than_5_24_refuses_before_saving_or_loading(monkeypatch, tmp_path):
    import transformers
    from packaging.version import Version

    from hf_alibi import _transformers_compat

    monkeypatch.setattr(_transformers_compat, "TRANSFORMERS_VERSION", Version("5.23.0"))
    monkeypatch.setattr(transformers, "__version__", "5.23.0")
    experiment = SimpleNamespace(tp_size=2, fsdp_size=1)  # as a caller other than the arguments' check may pass it
    with pytest.raises(ImportError, match=r"DistributedConfig\) needs transformers>=5\.24; .* has 5\.23\.0"):
        launch.shard_model(model=None, experiment=experiment, folder=tmp_path / "initial", state=None)
    assert not (tmp_path / "initial").exists()


def test_the_recorded_command_holds_no_machine_path():
    argv = ["/home/me/venv/bin/hf-alibi", "train", "--config", "retrieval", "--output_dir", "/work/clone/runs/r"]
    assert portable_command(argv, cwd="/work/clone") == "hf-alibi train --config retrieval --output_dir runs/r"
    argv = ["/somewhere/recipes/train_short_test_long.py", "--output_dir=/tmp/x/run", "--data_files", "/data/a.txt"]
    assert portable_command(argv, cwd="/work/clone") == (
        "train_short_test_long.py --output_dir=<outside>/run --data_files <outside>/a.txt"
    )
