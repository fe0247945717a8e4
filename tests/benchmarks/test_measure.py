"""benchmarks.measure, the one clock and peak-memory reader every benchmark uses: warm-up untimed, rounds
interleaved in order, growth of the resident set seen."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.measure import (  # noqa: E402
    competing_load,
    group_memory_kib,
    peak_memory,
    process_peak_bytes,
    time_call,
    time_calls,
    timed,
)


def test_warm_up_is_untimed_and_rounds_interleave_in_order():
    order = []
    calls = {name: (lambda name=name: order.append(name)) for name in ("a", "b", "c")}
    times = time_calls(calls, repeats=3, warmup=2)
    assert order == ["a", "b", "c"] * 5, "2 warm-up rounds, then 3 timed ones, every call once per round"
    assert {name: len(seconds) for name, seconds in times.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(s >= 0 for seconds in times.values() for s in seconds)


def test_time_call_times_each_repeat_and_the_clock_is_choosable():
    ticks = iter(range(100))
    seconds = time_calls({"x": lambda: None}, repeats=2, warmup=0, clock=lambda: next(ticks))["x"]
    assert seconds == [1, 1]
    calls = []
    assert len(time_call(lambda: calls.append(1), repeats=4, warmup=1)) == 4 and len(calls) == 5


def test_timed_syncs_before_and_after_and_returns_the_result():
    events = []
    seconds, result = timed(lambda: events.append("call") or 7, sync=lambda: events.append("sync"))
    assert events == ["sync", "call", "sync"] and result == 7 and seconds >= 0


def test_peak_memory_sees_an_allocation_and_the_process_peak_keeps_it():
    mib = 2**20
    block = []
    growth, method = peak_memory(lambda: block.append(b"\x01" * (64 * mib)), "cpu")  # every page written
    assert growth >= 60 * mib, (growth / mib, method)
    assert process_peak_bytes("cpu") >= growth


def test_competing_load_runs_busy_processes_only_inside_its_block():
    def busy_children():
        children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split()
        return [pid for pid in children if "while True" in Path(f"/proc/{pid}/cmdline").read_text()]

    with competing_load(2):
        time.sleep(0.05)
        assert len(busy_children()) == 2
    assert busy_children() == [], "the busy processes outlive the block"
    with pytest.raises(ValueError, match="-1"), competing_load(-1):
        pass


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux's /proc")
def test_group_memory_sums_every_process_of_the_group():
    """A group of two processes (as a server whose model runs in a process of its own), each holding 64 MB."""
    hold = "import sys, time; held = bytearray(64 << 20); print('ready', flush=True); time.sleep(60)"
    spawn_child = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {hold!r}]); exec({hold!r})"
    leader = subprocess.Popen(
        [sys.executable, "-c", spawn_child], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert leader.stdout.readline() == "ready\n" and leader.stdout.readline() == "ready\n"
        group = group_memory_kib(leader.pid)
        with open(f"/proc/{leader.pid}/status") as status:
            alone = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
        assert group["VmRSS"] >= alone + (64 << 10), (group, alone)  # the child's 64 MB beside the leader's own
        assert group["VmHWM"] >= group["VmRSS"]
    finally:
        os.killpg(leader.pid, 9)
        leader.wait()
