"""How every benchmark measures: the clock (warm-up, repeats, interleaving) and the process's peak memory.

One place for both, so that two benchmarks' figures are measured alike and a fix reaches them all.

Time: `time_calls({name: call}, repeats=5, warmup=1)` warms every call up, then runs `repeats` rounds, each timing
every call once in turn (A B C A B C ...: a drift in the machine's load hits all of them alike), and returns each
call's seconds per round; benchmarks report their median (`statistics.median`), and spreads from the same lists.
`timed(call, sync)` times one call, `sync` (e.g. `torch.cuda.synchronize`) before and after.

Peak memory: `process_peak_bytes(device)` is the process's peak resident set over its whole life so far (VmHWM,
with the part before a probe's reset kept), i.e. torch, the model, its build and every call. `peak_memory(fn,
device)` is the growth of the resident set while `fn()` runs, over a baseline taken just before it: unused heap is
handed back first (`malloc_trim`), the kernel's high-water mark is reset to the current RSS (writing `5` to
/proc/self/clear_refs, Linux >= 4.0), and the probe reads `VmHWM - VmRSS(before)`. Without clear_refs a thread
samples VmRSS every millisecond instead (misses spikes shorter than that). On CUDA: `max_memory_allocated` minus
`memory_allocated` before the call, after `reset_peak_memory_stats`.

Another process's memory: `group_memory_kib(pgid)` is the resident set (VmRSS) and peak (VmHWM) of a process group,
summed over its processes: a server whose model runs in a process of its own (transformers 5.25+'s) counts both.

Load: `competing_load(n)` runs `n` busy processes (one pure-Python spin loop each, no memory traffic) while its
block runs: what a shared machine does to a measurement (other jobs, a browser, data loaders), on demand.

Standard library only at import: workers import this before torch.
"""

import contextlib
import ctypes
import gc
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping


@contextlib.contextmanager
def competing_load(processes: int) -> Iterator[None]:
    """Run `processes` busy processes (each spinning on one core, unpinned: the scheduler places them) for the
    duration of the block, and stop them after it."""
    if processes < 0:
        raise ValueError(f"processes must be >= 0, got {processes}")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for process in busy:
            process.kill()
            process.wait()


def timed(call: Callable[[], object], sync: Callable[[], object] | None = None) -> tuple[float, object]:
    """`(seconds, call())`: wall time (perf_counter) of one call, with `sync()` before and after when given."""
    if sync is not None:
        sync()
    start = time.perf_counter()
    result = call()
    if sync is not None:
        sync()
    return time.perf_counter() - start, result


def time_calls(
    calls: Mapping[str, Callable[[], object]],
    *,
    repeats: int,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """`{name: [seconds per round]}`: `warmup` untimed rounds, then `repeats` timed ones, every call once per round in
    the mapping's order (module docstring). `clock`: `time.process_time` for CPU time on a busy machine."""
    for _ in range(warmup):
        for call in calls.values():
            call()
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = clock()
            call()
            times[name].append(clock() - start)
    return times


def time_call(call: Callable[[], object], *, repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `repeats` calls of `call`, after `warmup` untimed ones."""
    return time_calls({"call": call}, repeats=repeats, warmup=warmup)["call"]


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_high_water_mark() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def _malloc_trim() -> None:
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL(None).malloc_trim(0)  # glibc: return free heap pages, so reusing them cannot hide growth


def group_memory_kib(pgid: int) -> dict:
    """{"VmRSS": now, "VmHWM": peak} in KiB, summed over the processes of the group `pgid` (Linux's /proc). The summed
    peaks bound the group's peak from above: each process's may come at a different time."""
    total = {"VmRSS": 0, "VmHWM": 0}
    for stat in os.scandir("/proc"):
        if not stat.name.isdigit():
            continue
        try:
            with open(f"/proc/{stat.name}/stat") as file:
                if int(file.read().rsplit(")", 1)[1].split()[2]) != pgid:  # after "pid (name)": state, ppid, pgrp
                    continue
            with open(f"/proc/{stat.name}/status") as file:
                fields = dict(line.split(":", 1) for line in file if ":" in line)
        except OSError:  # gone meanwhile
            continue
        for key in total:
            total[key] += int(fields[key].split()[0]) if key in fields else 0  # a zombie has no memory left
    return total


def process_peak_bytes(device: str) -> int:
    """The process's peak memory so far: VmHWM on CPU (the reset in `peak_memory` keeps its earlier value in
    `_EARLIER_PEAK`), max_memory_allocated on CUDA (likewise)."""
    if device == "cuda":
        import torch

        return max(_EARLIER_PEAK[0], torch.cuda.max_memory_allocated())
    return max(_EARLIER_PEAK[0], _status_kib("VmHWM") * 1024)


_EARLIER_PEAK = [0]  # the process peak before the last reset of the high-water mark


def peak_memory(fn, device: str) -> tuple[int, str]:
    """Run `fn()` once; return (peak memory growth in bytes over the state just before it, method name)."""
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        _EARLIER_PEAK[0] = process_peak_bytes(device)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, "cuda max_memory_allocated"
    _malloc_trim()
    _EARLIER_PEAK[0] = process_peak_bytes(device)
    if _reset_high_water_mark():
        base = _status_kib("VmRSS")
        fn()
        return (_status_kib("VmHWM") - base) * 1024, "VmHWM growth (clear_refs reset)"
    page = os.sysconf("SC_PAGE_SIZE")
    base, peak, done = _status_kib("VmRSS") * 1024, [0], threading.Event()

    def sample():
        while not done.is_set():
            with open("/proc/self/statm") as statm:
                peak[0] = max(peak[0], int(statm.read().split()[1]) * page)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        fn()
    finally:
        done.set()
        sampler.join()
    return max(peak[0] - base, 0), "VmRSS sampled every 1 ms"
