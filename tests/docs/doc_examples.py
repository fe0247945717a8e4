"""The docs' examples: every fenced `python` or `bash` block of README.md and docs/*.md, parsed and run.

A block runs as written, in document order, with the page's other blocks: all of one page in one fresh temporary
directory holding a symlink to each top-level entry of the repository except `runs/`; its Python blocks share one
process and one namespace (like a notebook), each bash block runs under `bash -euo pipefail`, and background jobs
are killed when the page ends. An HTML comment on the line directly above a fence changes that:

    <!-- example: skip, needs a GPU -->            (or: needs the network, needs many processes, is the test suite)
    <!-- example: skip, needs transformers>=5.24 -->  (skipped only where the installed transformers is older)
    <!-- example: replace "OLD" "NEW" -->          (may repeat, `;`-separated: the tiny-size switch)

Any other marker, a marker that is not directly above a runnable block, or a replacement whose OLD text is not in
the block is an `ExampleError` naming the page and line. tests/docs/test_doc_examples.py runs this module's pages.
"""

import contextlib
import dataclasses
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hf_alibi._transformers_compat import transformers_at_least
from serving.server_process import free_port  # tests/serving: the serving tests' own

REPOSITORY = Path(__file__).resolve().parents[2]
RUNNABLE = ("python", "bash")
SKIP_REASONS = ("needs a GPU", "needs the network", "needs many processes", "is the test suite")
# A feature newer than the oldest supported transformers (continuous batching, hf-alibi serve: 5.24): the block runs
# on that release or newer and is skipped, with this reason, on an older one.
NEEDS_TRANSFORMERS = re.compile(r"needs transformers>=(?P<minimum>\d+\.\d+)")
BLOCK_TIMEOUT_S = 300
TAIL_CHARS = 3000

FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")
MARKER = re.compile(r"^\s*<!--\s*example:(?P<body>.*?)-->\s*$")
MARKER_START = re.compile(r"<!--\s*example\b")
QUOTED = r'"(?P<{}>(?:[^"\\]|\\.)*)"'  # a double-quoted string; \" and \\ inside it are escapes
DIRECTIVE = re.compile(
    rf"\s*(?:skip,\s*(?P<reason>[^;]*?)|replace\s+{QUOTED.format('old')}\s+{QUOTED.format('new')})\s*(?:;|$)"
)


class ExampleError(ValueError):
    """A page's markers or blocks do not follow the convention above; the message starts with `page:line`."""


@dataclasses.dataclass(frozen=True)
class Example:
    page: str  # the page's path relative to the repository, e.g. "docs/model.md"
    line: int  # 1-based line of the opening fence
    language: str  # "python" or "bash"
    code: str  # the block's text with the marker's replacements applied
    skip: str | None = None  # one of SKIP_REASONS, or a transformers release newer than the installed; None: it runs

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text)


def _directives(body: str, where: str) -> tuple[str | None, list[tuple[str, str]]]:
    """A marker's body -> (skip reason or None, [(old, new), ...]); anything else raises ExampleError."""
    skip, replacements, position = None, [], 0
    body = body.strip()
    while position < len(body):
        match = DIRECTIVE.match(body, position)
        if match is None or match.end() == position:
            raise ExampleError(
                f"{where}: cannot read the marker at {body[position:]!r}: write "
                f'"skip, <reason>" or replace "OLD" "NEW" (";"-separated)'
            )
        if match["reason"] is not None:
            skip = _skip_reason(match["reason"], where)
        else:
            replacements.append((_unescape(match["old"]), _unescape(match["new"])))
        position = match.end()
    return skip, replacements


def _skip_reason(reason: str, where: str) -> str | None:
    """A marker's skip reason: one of `SKIP_REASONS`; or "needs transformers>=X.Y", a skip only on an older one."""
    version = NEEDS_TRANSFORMERS.fullmatch(reason)
    if version is not None:
        return None if transformers_at_least(version["minimum"]) else reason
    if reason not in SKIP_REASONS:
        raise ExampleError(f"{where}: skip reason {reason!r} is not one of {SKIP_REASONS} or 'needs transformers>=X.Y'")
    return reason


def parse_examples(text: str, page: str) -> list[Example]:
    """Every `python` / `bash` block of one page's markdown, with its marker applied; raises ExampleError."""
    lines = text.splitlines()
    examples, pending, index = [], None, 0  # pending: (line, body) of a marker waiting for its fence
    while index < len(lines):
        line, number = lines[index], index + 1
        fence = FENCE.match(line)
        if MARKER_START.search(line) and not fence:
            marker = MARKER.match(line)
            if marker is None:
                raise ExampleError(f"{page}:{number}: a marker is one line `<!-- example: ... -->`, got {line!r}")
            if pending is not None:
                raise ExampleError(f"{page}:{pending[0]}: marker not directly above a fence")
            pending = (number, marker["body"])
            index += 1
            continue
        if pending is not None and not fence:
            raise ExampleError(f"{page}:{pending[0]}: marker not directly above a fence")
        if not fence:
            index += 1
            continue
        indent, mark, info = fence["indent"], fence["fence"], fence["info"].lower()
        body, index = [], index + 1  # the block ends at a fence of the same kind, at least as long
        while index < len(lines) and not re.match(rf"^\s*{re.escape(mark[0])}{{{len(mark)},}}\s*$", lines[index]):
            body.append(lines[index][len(indent) :] if lines[index].startswith(indent) else lines[index].lstrip())
            index += 1
        if index == len(lines):
            raise ExampleError(f"{page}:{number}: the block opened here is never closed")
        index += 1
        skip, replacements = _directives(pending[1], f"{page}:{pending[0]}") if pending else (None, [])
        if pending is not None and info not in RUNNABLE:
            raise ExampleError(f"{page}:{pending[0]}: marker above a {info or 'plain'!r} block, which never runs")
        pending = None
        if info not in RUNNABLE:
            continue
        code = "\n".join(body) + "\n"
        for old, new in replacements:
            if old not in code:
                raise ExampleError(f"{page}:{number}: replace {old!r}: that text is not in the block")
            code = code.replace(old, new)
        examples.append(Example(page, number, info, code, skip))
    if pending is not None:
        raise ExampleError(f"{page}:{pending[0]}: marker not directly above a fence")
    return examples


def pages() -> list[str]:
    """The pages whose examples run: README.md and every docs/*.md, relative to the repository."""
    return ["README.md"] + sorted(p.relative_to(REPOSITORY).as_posix() for p in (REPOSITORY / "docs").glob("*.md"))


def page_examples(page: str) -> list[Example]:
    return parse_examples((REPOSITORY / page).read_text(encoding="utf-8"), page)


def example_environment() -> dict[str, str]:
    environment = dict(
        os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPOSITORY), HF_ALIBI_EXAMPLE_PORT=str(free_port())
    )
    environment["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{environment.get('PATH', '')}"
    # Tiny models: one thread is fastest on a shared 2-core machine (tests/conftest.py's measurement).
    environment.setdefault("OMP_NUM_THREADS", "1")
    return environment


# The shared Python process of a page: it reads `<length>\n<where>\n<code>` from stdin, runs the code in one
# namespace and answers "ok" or "error" on the result pipe; output (stdout, stderr, its subprocesses') goes to a log.
DRIVER = r"""
import os, sys, traceback
results = os.fdopen(int(sys.argv[1]), "w")
namespace = {"__name__": "__main__"}
while header := sys.stdin.buffer.readline():
    where = sys.stdin.buffer.readline().decode().strip()
    code = sys.stdin.buffer.read(int(header)).decode()
    try:
        exec(compile(code, where, "exec"), namespace)
        status = "ok"
    except BaseException:
        traceback.print_exc()
        status = "error"
    sys.stdout.flush(); sys.stderr.flush()
    results.write(status + "\n"); results.flush()
"""


class PageRun:
    """One page's run: its temporary directory, its environment, its Python process and its background jobs."""

    def __init__(self, page: str):
        self.page = page
        self.directory = Path(tempfile.mkdtemp(prefix="doc-example-"))
        for entry in REPOSITORY.iterdir():
            if entry.name != "runs":
                (self.directory / entry.name).symlink_to(entry)
        self.environment = example_environment()
        self.log_path = self.directory / ".example-output.log"
        # Open for the page's whole life (closed in close()); append mode: background jobs' writes never overwrite
        # a block's.
        self.log = open(self.log_path, "ab")  # noqa: SIM115
        self.processes: list[subprocess.Popen] = []  # each leads a process group killed when the page ends
        self.python = None

    def _start(self, command: list[str], **kwargs) -> subprocess.Popen:
        process = subprocess.Popen(
            command,
            cwd=self.directory,
            env=self.environment,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **kwargs,
        )
        self.processes.append(process)  # a session of its own: its pid is its jobs' process group
        return process

    def _output_since(self, offset: int) -> str:
        with open(self.log_path, "rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")[-TAIL_CHARS:]

    def run(self, example: Example) -> str | None:
        """Runs one block; returns None, or the failure's message (where, why, the output's tail)."""
        offset = self.log_path.stat().st_size
        status = self._run_python(example) if example.language == "python" else self._run_bash(example)
        if status is None:
            return None
        return f"{example.where}: the {example.language} block {status}; its output ends with:\n{self._output_since(offset)}"

    def _run_bash(self, example: Example) -> str | None:
        process = self._start(["bash", "-euo", "pipefail", "-c", example.code, example.where], stdin=subprocess.DEVNULL)
        try:
            code = process.wait(timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return f"ran past {BLOCK_TIMEOUT_S} s"
        return None if code == 0 else f"exited with status {code}"

    def _run_python(self, example: Example) -> str | None:
        if self.python is None:
            read, write = os.pipe()
            self.python = self._start(
                [sys.executable, "-c", DRIVER, str(write)], stdin=subprocess.PIPE, pass_fds=(write,)
            )
            os.close(write)
            self.results = os.fdopen(read)
        payload = example.code.encode()
        self.python.stdin.write(b"%d\n%s\n%s" % (len(payload), example.where.encode(), payload))
        self.python.stdin.flush()
        ready, _, _ = select.select([self.results], [], [], BLOCK_TIMEOUT_S)
        if not ready:
            return f"ran past {BLOCK_TIMEOUT_S} s"
        status = self.results.readline().strip()
        if status == "ok":
            return None
        return "raised" if status == "error" else f"ended its Python process (exit status {self.python.wait()})"

    def close(self) -> None:
        """Ends the Python process and kills every process group the page started, background jobs included."""
        if self.python is not None and self.python.poll() is None:
            self.python.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.python.wait(timeout=10)
        groups = [process.pid for process in self.processes]
        for sig in (signal.SIGTERM, signal.SIGKILL):  # SIGKILL what is left 5 s after SIGTERM
            groups = [group for group in groups if _signal_group(group, sig)]
            deadline = time.monotonic() + 5
            while groups and time.monotonic() < deadline:
                time.sleep(0.1)
                for process in self.processes:
                    process.poll()  # reaps a finished leader: a zombie would keep its group alive
                groups = [group for group in groups if _signal_group(group, 0)]
        self.log.close()
        shutil.rmtree(self.directory, ignore_errors=True)  # unlinks the symlinks, never follows them


def _signal_group(group: int, sig: int) -> bool:
    """Sends `sig` to a process group (0: only checks); False when the group has no process left."""
    try:
        os.killpg(group, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def run_page(page: str) -> tuple[list[Example], str | None]:
    """Runs a page's examples in order, stopping at the first failure: (the examples run, the failure or None)."""
    examples = [example for example in page_examples(page) if example.skip is None]
    run = PageRun(page)
    try:
        for position, example in enumerate(examples):
            failure = run.run(example)
            if failure is not None:
                return examples[: position + 1], failure
        return examples, None
    finally:
        run.close()
