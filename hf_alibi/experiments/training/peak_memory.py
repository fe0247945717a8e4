"""Peak memory of a block of work (training one model), on CPU and on CUDA, without a profiler.

    with PeakMemory(device) as peak:
        trainer.train()
    peak.result()  # {"peak_memory_mib": ..., "memory_source": ...}

- CUDA: `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`: the tensors' peak, exact.
- CPU (Linux): the process's resident-set high-water mark (`VmHWM` in `/proc/self/status`), reset at entry by
  writing `5` to `/proc/self/clear_refs`, minus the resident set at entry. Freed heap is returned to the system
  first (`malloc_trim`), so memory cached from an earlier model is not mistaken for this one's. The figure is the
  growth of the whole process while the block ran: weights, gradients, optimizer state, activations, and anything
  else the block allocated (data loader buffers); comparable between models run the same way. The first block
  in a process also carries one-time growth (lazily imported modules, thread pools: ~16 MiB in the smoke run, where
  the first model's figure was 26 MiB against 9-10 MiB for the others); small against a real model's activations.
- Elsewhere: no figure (`peak_memory_mib` None, `memory_source` says why).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])  # "VmHWM:    123456 kB"
    except OSError:
        return None
    return None


def _release_free_heap() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakMemory:
    """Context manager measuring the peak memory added while its block runs (see the module docstring)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.start_kib: int | None = None
        self.peak_mib: float | None = None
        self.source = "unavailable"

    def __enter__(self) -> PeakMemory:
        _release_free_heap()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_bytes = torch.cuda.memory_allocated(self.device)
            self.source = "cuda max_memory_allocated"
            return self
        try:
            _CLEAR_REFS.write_text("5")  # resets VmHWM to the current resident set (Linux >= 4.0)
        except OSError as error:
            self.source = f"unavailable ({error.__class__.__name__}: cannot reset the RSS high-water mark)"
            return self
        self.start_kib = _status_kib("VmRSS")
        self.source = "process RSS high-water mark (VmHWM) growth"
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_mib = (torch.cuda.max_memory_allocated(self.device) - self.start_bytes) / 2**20
        elif self.start_kib is not None:
            peak = _status_kib("VmHWM")
            self.peak_mib = None if peak is None else max(0, peak - self.start_kib) / 1024

    def result(self) -> dict:
        peak = None if self.peak_mib is None else round(self.peak_mib, 1)
        return {"peak_memory_mib": peak, "memory_source": self.source}


__all__ = ["PeakMemory"]
