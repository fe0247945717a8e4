"""A real `hf-alibi serve` process for the serving tests: started on a free port of 127.0.0.1 in its own session,
ready once /health answers, stopped with SIGTERM (SIGKILL after a deadline), and checked to leave no process
behind. Its output goes to a file (a pipe nobody reads would fill and stall the server) shown when it fails."""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import hf_alibi

START_DEADLINE_S = 120  # loading torch, transformers and the model on 2 busy cores
STOP_DEADLINE_S = 20  # SIGTERM to exit: uvicorn's graceful shutdown gives open connections 5 s
GROUP_EXIT_S = 5  # the server's exit to its group's: multiprocessing's resource tracker exits once the server has


def free_port() -> int:
    """A port the kernel just handed out for 127.0.0.1 (bound to 0, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def request(port: int, method: str, path: str, body: bytes | dict | None = None, timeout: float = 30):
    """(status, parsed JSON or text) of one HTTP request; `body` is sent as given when bytes, else as JSON."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        payload = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        connection.request(method, path, body=payload, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        text = response.read().decode()
        try:
            return response.status, json.loads(text)
        except json.JSONDecodeError:
            return response.status, text
    finally:
        connection.close()


def group_members(pgid: int) -> dict[int, str]:
    """{pid: state letter ("R", "S", "Z", ...)} of each process of the group `pgid`, from Linux's /proc."""
    members = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (name)": state, ppid, pgrp, ...
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) == pgid:
            members[int(stat.parent.name)] = fields[0]
    return members


def group_alive(pgid: int) -> bool:
    """Whether any process of the group `pgid` (the server's session) is still running. A zombie does not count: it
    has exited and holds nothing, only init has not reaped it yet (transformers 5.25+'s server leaves one,
    multiprocessing's resource tracker, which exits once the server has). Without /proc, any member counts."""
    if not Path("/proc/self/stat").exists():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    return any(state != "Z" for state in group_members(pgid).values())


def group_gone(pgid: int, deadline_s: float = GROUP_EXIT_S) -> bool:
    """Whether every process of the group `pgid` has exited within `deadline_s` (polled)."""
    end = time.monotonic() + deadline_s
    while group_alive(pgid):
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


def group_peak_resident_kb(pgid: int) -> dict[int, int]:
    """{pid: peak resident set (VmHWM, KiB)} of each running process of the group `pgid`: the server's process and
    those it started (transformers 5.25+ runs the model in a process of its own). Linux's /proc only."""
    peaks = {}
    for pid in group_members(pgid):
        try:
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
            peaks[pid] = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
        except (OSError, StopIteration):  # gone meanwhile, or a zombie, which has no memory left
            continue
    return peaks


class ServerProcess:
    """`python -m hf_alibi.cli serve MODEL --host 127.0.0.1 --port P *flags`, one thread of torch."""

    def __init__(self, model: Path, log: Path, *flags: str):
        self.port = free_port()
        self.log = log
        command = [
            sys.executable,
            "-m",
            "hf_alibi.cli",
            "serve",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *flags,
        ]
        # The hf_alibi these tests import, whatever the working folder (`-m` puts the working folder first).
        source = str(Path(hf_alibi.__file__).resolve().parents[1])
        path = os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")]))
        env = os.environ | {
            "PYTHONPATH": path,
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        with open(log, "wb") as output:
            self.process = subprocess.Popen(
                command, stdout=output, stderr=subprocess.STDOUT, env=env, cwd=log.parent, start_new_session=True
            )
        self.pgid = self.process.pid  # start_new_session: the server leads its own process group

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def wait_until_healthy(self, deadline_s: float = START_DEADLINE_S) -> None:
        """Poll /health until it answers 200; fail with the server's output if it exits or the deadline passes."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited with {self.process.returncode}:\n{self.output()}")
            try:
                if request(self.port, "GET", "/health", timeout=2)[0] == 200:
                    return
            except OSError:  # not listening yet
                pass
            time.sleep(0.2)
        raise AssertionError(f"no /health within {deadline_s} s:\n{self.output()}")

    def stop(self, deadline_s: float = STOP_DEADLINE_S) -> tuple[int, float]:
        """SIGTERM, then SIGKILL to the whole group after `deadline_s`; (exit status, seconds SIGTERM took)."""
        start = time.monotonic()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(deadline_s)
            except subprocess.TimeoutExpired:
                if group_alive(self.pgid):
                    os.killpg(self.pgid, signal.SIGKILL)
                self.process.wait(10)
        return self.process.returncode, time.monotonic() - start


def started(model: Path, log: Path, *flags: str):
    """A generator for a pytest fixture: yields a healthy `ServerProcess`, then stops it and checks that its
    process and every process of its group are gone."""
    server = ServerProcess(model, log, *flags)
    try:
        server.wait_until_healthy()
        yield server
    finally:
        status, _ = server.stop()
        leftover = not group_gone(server.pgid)
        if leftover:
            os.killpg(server.pgid, signal.SIGKILL)
        assert not leftover, f"processes of the server's group survived it:\n{server.output()}"
        # uvicorn re-raises the SIGTERM it handled once it has shut down: ended by that signal, not killed
        assert status in (0, -signal.SIGTERM), f"the server exited with {status} after SIGTERM:\n{server.output()}"
