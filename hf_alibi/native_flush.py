"""An opt-in switch, outside the model: denormal floats flushed to zero on every thread of torch's CPU pool inside a
`with` block.

    from hf_alibi.native_flush import flushing_denormals

    with flushing_denormals():  # a forward, a generate() call, or a whole trainer.train()
        loss = model(ids, labels=ids).loss
        loss.backward()

Why. An attention call computes each probability as exp(s - l) (l: the row's running or merged log-sum-exp). ALiBi's
bias puts a band of every row's keys 87 to 103 nats below l (about 16 / slope keys per head: 64 keys at slope 1/4,
1024 at 1/64), and there exp lands in fp32's denormal range (2^-149 .. 2^-126), on which x86 arithmetic takes a
microcode assist and is ~100x slower. Measured on the CPU flash kernels (Intel Xeon, 2 threads, 4 heads of dim 32,
slopes 1/4 .. 1/256, one 1024-row call over 7168 keys): the backward 0.29 s with denormals, 0.038 s flushed; the
forward 0.030 s and 0.018 s. Those probabilities are the true softmax weights of far keys: the model computes them
exactly in fp32 (what `hf_alibi/models/alibi/`, the code a checkpoint ships, does: it never changes a thread's
floating-point mode), and only the hardware's flush-to-zero mode avoids their cost. That is the caller's choice, so
it lives here, not in the model.

Why every thread. `torch.set_flush_denormal` sets the calling thread's floating-point mode (MXCSR on x86) only, and
torch's intra-op worker threads (an OpenMP team) keep the mode they started with. So the mode is copied to every
thread of the calling thread's OpenMP team by running C's `fesetenv` in one OpenMP parallel region (`GOMP_parallel`,
which GNU's, LLVM's and Intel's OpenMP runtimes export): ~2 us per switch, no Python in the workers. It is found in
the runtime torch loaded (Linux only; elsewhere, or for another parallel backend, the calling thread alone is
switched, as `torch.set_flush_denormal` does). A script that calls `torch.set_flush_denormal(True)` as its first
line, before torch starts its threads, gets the same for the whole process without this module (threads inherit
their creator's mode).

What it changes. Only values below 2^-126 ~ 1.2e-38, read or written as zero, everywhere inside the block (not only
in attention). A probability that small is < 1.2e-38 of its row's mass, so an output or gradient moves by
< 1.2e-38 * (keys) * max|v| in absolute terms: below fp32's resolution of anything it adds to. Afterwards every
thread of the team gets the caller's previous mode back.
"""

import contextlib
import ctypes
import functools
import os
import sys

import torch

_ENV_BYTES = 512  # >= sizeof(fenv_t) on every libc (32 bytes on x86-64 glibc, 8 on aarch64)


class _Team:
    """`GOMP_parallel(fesetenv, env, threads)` of the OpenMP runtime torch runs on: a mode set on the calling thread
    and every worker of its OpenMP team (the team torch's next op runs on)."""

    def __init__(self, parallel, fesetenv, fegetenv):
        self.parallel, self.fesetenv, self.fegetenv = parallel, fesetenv, fegetenv

    def environment(self) -> ctypes.Array:
        """The calling thread's floating-point environment."""
        env = ctypes.create_string_buffer(_ENV_BYTES)
        if self.fegetenv(env) != 0:
            raise OSError("fegetenv failed")
        return env

    def set_everywhere(self, env: ctypes.Array) -> None:
        self.parallel(self.fesetenv, env, torch.get_num_threads(), 0)


class _CallingThread:
    """Where no OpenMP team can be reached: the calling thread's mode alone, as `torch.set_flush_denormal` sets it."""

    @staticmethod
    def environment() -> bool:
        """Whether the calling thread flushes denormals now (torch has no getter: a denormal input reads as zero)."""
        return float(torch.tensor([1e-39]) * 2.0) == 0.0

    @staticmethod
    def set_everywhere(flushing: bool) -> None:
        torch.set_flush_denormal(flushing)


@functools.cache
def _openmp_team() -> _Team | None:
    """The team switcher, or None where torch's pool is not an OpenMP runtime this process can reach."""
    if not sys.platform.startswith("linux") or "OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        with open("/proc/self/maps") as maps:
            loaded = {line.split()[-1] for line in maps if "/lib" in line and "omp" in line.rsplit("/", 1)[-1]}
    except OSError:
        return None
    runtimes = [path for path in loaded if os.path.basename(path).startswith(("libgomp", "libomp", "libiomp"))]
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    candidates = [path for path in runtimes if path.startswith(torch_lib)] or runtimes  # torch's own first
    if len(candidates) != 1:
        return None  # no OpenMP runtime, or several and none is torch's: which pool torch uses is unknown
    try:
        runtime, libc = ctypes.CDLL(candidates[0]), ctypes.CDLL(None)
        parallel, fesetenv, fegetenv = runtime.GOMP_parallel, libc.fesetenv, libc.fegetenv
    except (OSError, AttributeError):
        return None
    parallel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    parallel.restype = None
    return _Team(parallel, ctypes.cast(fesetenv, ctypes.c_void_p), fegetenv)


@contextlib.contextmanager
def flushing_denormals():
    """Denormals flushed to zero on the calling thread and its OpenMP workers inside the block; the caller's mode
    (on every thread of the team) afterwards."""
    threads = _openmp_team() or _CallingThread
    before = threads.environment()
    if not torch.set_flush_denormal(True):  # a CPU without the mode
        yield
        return
    threads.set_everywhere(threads.environment())  # the calling thread's new mode, copied to its workers
    try:
        yield
    finally:
        threads.set_everywhere(before)
