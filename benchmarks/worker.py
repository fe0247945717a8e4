"""One contestant in its own process: builds the model once, then answers the parent's measurement requests
(`serve`); `Worker` is the parent's handle on such a process.

Protocol: the parent writes one JSON request per line on stdin; the worker answers each (and announces itself once
with `{"event": "ready", ...}`) on a line starting with `@@bench ` on the stdout it had at start. Everything else a
library prints goes to stderr (fd 1 is pointed at fd 2), which the parent keeps in a log file.

Requests: `{"op": "prepare", "cell": {...}, "warmup": n}` builds the cell's inputs, runs `n` warm-up calls and one
memory probe; `{"op": "time", "cell": {...}}` times one call; `{"op": "exit"}`.

Every answer to `time` also carries `process_peak_bytes`, the process's peak resident set over its whole life so
far, and `prepare`'s memory probe is the growth of the resident set during one call: both as `benchmarks.measure`
reads them. With one process per cell (`--processes`) the former is the whole-process peak memory of that cell.

Fault injection for the harness's own tests: `HF_ALIBI_BENCH_FAULT="contestant:suite:kind[,...]"` makes `prepare`
fail for that contestant and suite with kind `error` (exception), `oom` (MemoryError), `crash` (the process dies)
or `hang` (never answers).
"""

import contextlib
import gc
import json
import os
import resource
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from .measure import peak_memory, process_peak_bytes, timed

FAULT_ENV = "HF_ALIBI_BENCH_FAULT"
PROTOCOL_PREFIX = "@@bench "
ROOT = Path(__file__).resolve().parents[1]
PAD, FIRST_REAL_ID = 0, 3  # ids 0-2 are pad/bos/eos in every contestant's config; inputs never use them


class WorkerFailure(Exception):
    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


class Worker:
    """A worker process and its line protocol; every wait is bounded by a timeout."""

    def __init__(self, argv: list[str], log_path: Path, env: dict | None = None):
        self.log_path = log_path
        self.log = open(log_path, "ab")  # noqa: SIM115 (kept open for the process's life, closed in stop())
        self.process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            cwd=ROOT,
            env=env,
            start_new_session=True,  # its own process group: a timeout kills it and anything it spawned
        )
        self.buffer = b""

    def receive(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        fd = self.process.stdout.fileno()
        while True:
            while b"\n" in self.buffer:
                line, self.buffer = self.buffer.split(b"\n", 1)
                text = line.decode(errors="replace")
                if text.startswith(PROTOCOL_PREFIX):
                    return json.loads(text[len(PROTOCOL_PREFIX) :])
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.kill()
                raise WorkerFailure("timeout", f"no answer within {timeout:g} s")
            readable, _, _ = select.select([fd], [], [], remaining)
            if readable:
                chunk = os.read(fd, 65536)
                if not chunk:
                    code = self.process.wait()
                    if code == 1:  # an uncaught Python exception: its traceback is in the log
                        raise WorkerFailure("error", "worker raised" + self._log_tail())
                    why = " (killed, likely by the OS out of memory)" if code in (-signal.SIGKILL, 137) else ""
                    raise WorkerFailure("crashed", f"worker exited with code {code}{why}" + self._log_tail())
                self.buffer += chunk

    def request(self, message: dict, timeout: float) -> dict:
        try:
            self.process.stdin.write((json.dumps(message) + "\n").encode())
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # receive() reports how it died
        return self.receive(timeout)

    def alive(self) -> bool:
        return self.process.poll() is None

    def _log_tail(self) -> str:
        self.log.flush()
        lines = self.log_path.read_text(errors="replace").strip().splitlines()[-3:]
        return ("; log: " + " | ".join(lines)) if lines else ""

    def kill(self) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def close(self) -> None:
        if self.alive():
            try:
                self.process.stdin.write(b'{"op": "exit"}\n')
                self.process.stdin.flush()
                self.process.wait(timeout=10)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.kill()
        self.log.close()


class Contestant:
    """A built model plus the inputs and callables of the cell being measured."""

    def __init__(self, spec: dict):
        import torch

        from .contestants import Shape, build_model

        self.name, self.device = spec["contestant"], spec["device"]
        self.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[spec["dtype"]]
        self.shape = Shape(**spec["shape"])
        self.optimizer_name = spec.get("optimizer", "none")

        def build():
            model, forward = build_model(self.name, self.shape, spec["max_length"])
            return model.to(device=self.device, dtype=self.dtype), forward

        self.build_s, (self.model, self.forward) = timed(build)
        self.cell_key, self.call = None, None

    def _sync(self):
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()

    def _ids(self, batch: int, length: int, seed: int):
        import torch

        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(FIRST_REAL_ID, self.shape.vocab_size, (batch, length), generator=generator)
        return ids.to(self.device)

    def prepare(self, cell: dict) -> None:
        """Build the inputs and the zero-argument call that one repeat of `cell` times."""
        import torch

        suite, batch = cell["suite"], cell["batch"]
        self.model.zero_grad(set_to_none=True)
        if suite == "train":
            self.model.train()
            ids = self._ids(batch, cell["length"], seed=1)
            optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-6) if self.optimizer_name == "sgd" else None
            # mask=ones: the all-ones attention_mask Trainer's collators send; none: the reference's fastest path
            masks = {"attention_mask": torch.ones_like(ids)} if cell.get("mask") == "ones" else {}

            def call():
                loss = self.forward(input_ids=ids, labels=ids, use_cache=False, **masks).loss  # full logits
                loss.backward()
                if optimizer is not None:
                    optimizer.step()
                self.model.zero_grad(set_to_none=True)

        elif suite == "forward":
            self.model.eval()
            ids = self._ids(batch, cell["length"], seed=2)

            def call():
                with torch.no_grad():  # logits for the last position only: memory is attention + activations
                    self.forward(input_ids=ids, use_cache=False, logits_to_keep=1)

        elif suite == "generate":
            self.model.eval()
            ids, mask = self._left_padded_prompts(batch, cell["prefill"])
            decode = cell["decode"]
            from .contestants import exact_generation_config

            # t(prefill + 1 token) and t(prefill + `decode` tokens): their difference is `decode - 1` decode steps.
            first, full = exact_generation_config(1), exact_generation_config(decode)

            def generate(config):
                with torch.no_grad():
                    out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
                if out.shape[1] != ids.shape[1] + config.max_new_tokens:
                    raise RuntimeError(
                        f"generated {out.shape[1] - ids.shape[1]} tokens, wanted {config.max_new_tokens}"
                    )

            def call():
                prefill_s, _ = timed(lambda: generate(first), self._sync)
                total_s, _ = timed(lambda: generate(full), self._sync)
                return {"prefill_s": prefill_s, "total_s": total_s}

        else:
            raise ValueError(f"unknown suite {suite!r}")
        self.call = call

    def _left_padded_prompts(self, batch: int, prefill: int):
        """`batch` prompts, the longest `prefill` tokens, the others evenly shorter down to half, padded on the left."""
        import torch

        ids = self._ids(batch, prefill, seed=3)
        lengths = [prefill - (i * (prefill // 2)) // max(batch - 1, 1) for i in range(batch)]
        mask = torch.zeros(batch, prefill, dtype=torch.long, device=self.device)
        for row, length in enumerate(lengths):
            mask[row, prefill - length :] = 1
        return ids.masked_fill(mask == 0, PAD), mask

    def timed_call(self) -> dict:
        elapsed, extra = timed(self.call, self._sync)
        return extra if isinstance(extra, dict) else {"seconds": elapsed}


def _inject_fault(contestant: str, suite: str) -> None:
    for entry in filter(None, os.environ.get(FAULT_ENV, "").split(",")):
        name, fault_suite, kind = entry.split(":")
        if (name, fault_suite) != (contestant, suite):
            continue
        if kind == "crash":
            os._exit(137)
        if kind == "hang":
            time.sleep(10**6)
        if kind == "oom":
            raise MemoryError("injected fault")
        raise RuntimeError("injected fault")


def failure_status(error: BaseException) -> str:
    message = str(error).lower()
    oom = ("out of memory", "can't allocate memory", "cannot allocate memory", "not enough memory")
    if isinstance(error, MemoryError) or any(text in message for text in oom):
        return "oom"
    return "error"


def serve(spec: dict) -> None:
    """The worker's main loop (see the module docstring)."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # library prints must not corrupt the protocol
    sys.stdout = sys.stderr

    def send(message: dict) -> None:
        protocol.write(PROTOCOL_PREFIX + json.dumps(message) + "\n")

    if spec.get("memory_limit_bytes"):
        # An allocation past the limit raises (recorded as "oom") instead of summoning the kernel's OOM killer.
        resource.setrlimit(resource.RLIMIT_AS, (spec["memory_limit_bytes"], resource.RLIM_INFINITY))
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    with contextlib.ExitStack() as switches:
        if spec.get("native_flush"):  # the opt-in switch for the whole worker (`--native-flush`)
            from hf_alibi.native_flush import flushing_denormals

            switches.enter_context(flushing_denormals())
        contestant = Contestant(spec)
        device_name = torch.cuda.get_device_name() if contestant.device == "cuda" else None
        send(
            {
                "event": "ready",
                "threads": torch.get_num_threads(),
                "torch": torch.__version__,
                "parameters": sum(p.numel() for p in contestant.model.parameters()),
                "build_s": contestant.build_s,
                "device_name": device_name,
            }
        )
        for line in sys.stdin:
            request = json.loads(line)
            if request["op"] == "exit":
                break
            try:
                if request["op"] == "prepare":
                    cell = request["cell"]
                    contestant.call = None
                    _inject_fault(contestant.name, cell["suite"])
                    contestant.prepare(cell)
                    for _ in range(request.get("warmup", 1)):
                        contestant.call()
                    peak, method = peak_memory(contestant.call, contestant.device)
                    send({"ok": True, "peak_mem_bytes": peak, "mem_method": method})
                elif request["op"] == "time":
                    timing = contestant.timed_call()
                    send({"ok": True, **timing, "process_peak_bytes": process_peak_bytes(contestant.device)})
                else:
                    raise ValueError(f"unknown op {request['op']!r}")
            except Exception as error:  # noqa: BLE001 - every failure is a result to record, not a crash
                contestant.call = None
                contestant.model.zero_grad(set_to_none=True)
                gc.collect()
                if contestant.device == "cuda":
                    torch.cuda.empty_cache()
                send({"ok": False, "status": failure_status(error), "reason": f"{type(error).__name__}: {error}"[:500]})
