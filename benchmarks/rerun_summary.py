"""Re-run every command the BENCHMARKS.md summary cites, on this machine, one after another, into one dated folder.

    python -m benchmarks.rerun_summary --list                          # the commands, numbered, nothing run
    python -m benchmarks.rerun_summary --out results/rerun/2026-12-03 --only 1,2,9 \
        --replace runs/cpu_demo/alibi/final=/work/ckpt/cpu_demo/alibi/final

Each command's `--out` / `--markdown` path is moved under `--out` (the same relative path), so a re-run never
overwrites the figures the page cites; `--replace OLD=NEW` rewrites a piece of every command (a checkpoint's folder,
the llama-cpp-python interpreter of `bench_serve`). Commands run back to back, never two at once, each with the
1-minute load average at its start and its wall time recorded in `<out>/index.md` (what ran, what failed, what was
left out), so the figures of one sitting can be read side by side with the page's. Run it alone on the machine:
every figure is a ratio from one run, and any other job shows in it.
"""

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from hf_alibi.atomic_files import write_text_atomically

SUMMARY = re.compile(r"`((?:OMP_NUM_THREADS=1 )?python -m benchmarks\.[^`]+)`")
OUTPUTS = ("--out", "--markdown")


def summary_commands(page: Path) -> list[str]:
    """The distinct commands of the summary table of `page`, in the order they first appear."""
    text = page.read_text()
    start = text.index("## Summary")
    end = text.index("\n## ", start + 1)
    commands = []
    for command in SUMMARY.findall(text[start:end]):
        if command not in commands:
            commands.append(command)
    return commands


def redirected(command: str, out: Path, replacements: list[tuple[str, str]]) -> list[str]:
    """`command` as argv, with its output paths under `out` and each replacement applied."""
    for old, new in replacements:
        command = command.replace(old, new)
    words = shlex.split(command)
    for index, word in enumerate(words[:-1]):
        if word in OUTPUTS:
            words[index + 1] = str(out / words[index + 1])
    return words


def run(words: list[str], log: Path, timeout: float) -> tuple[int, float]:
    """Run one command (its environment assignments first), its output into `log`: (exit code, seconds)."""
    env = dict(os.environ)
    while words and "=" in words[0] and not words[0].startswith("-"):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    if words[0] == "python":
        words[0] = sys.executable
    start = time.perf_counter()
    with log.open("w") as stream:
        try:
            code = subprocess.run(words, stdout=stream, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = 124
    return code, time.perf_counter() - start


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page", default="BENCHMARKS.md")
    parser.add_argument("--out", default=f"results/rerun/{time.strftime('%Y-%m-%d')}")
    parser.add_argument("--only", default="", help="command numbers (see --list), run in that order; default: all")
    parser.add_argument("--replace", action="append", default=[], help="OLD=NEW, applied to every command")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per command")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args(argv)
    bad = [r for r in args.replace if "=" not in r]
    if bad:
        raise ValueError(f"--replace takes OLD=NEW, got {bad[0]!r}")
    args.replace = [tuple(r.split("=", 1)) for r in args.replace]
    args.only = [int(n) for n in args.only.split(",") if n]
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    commands = summary_commands(Path(args.page))
    if args.list:
        for number, command in enumerate(commands, 1):
            print(f"{number:>2}. {command}")
        return
    unknown = [n for n in args.only if not 1 <= n <= len(commands)]
    if unknown:
        raise ValueError(f"--only names command {unknown[0]}; the summary cites {len(commands)} (see --list)")
    out = Path(args.out)
    done = earlier_rows(out / "index.md")  # a sitting continued: the rows of commands run before are kept
    order = args.only or list(range(1, len(commands) + 1))  # in the order asked: the ones that matter most first
    for number in order:
        words = redirected(commands[number - 1], out, args.replace)
        for word, following in zip(words, words[1:]):
            if word in OUTPUTS:
                Path(following).parent.mkdir(parents=True, exist_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        load = os.getloadavg()[0]
        code, seconds = run(words, out / f"command_{number:02d}.log", args.timeout)
        done[number] = f"| {number} | `{shlex.join(words)}` | {code} | {seconds:.0f} | {load:.1f} |"
        print(done[number], flush=True)
        write_index(out / "index.md", commands, done)


def earlier_rows(index: Path) -> dict[int, str]:
    """The rows of an earlier `index.md` for commands that ran (number -> row)."""
    if not index.exists():
        return {}
    rows = [line for line in index.read_text().splitlines() if re.match(r"\| \d+ \| `", line)]
    return {int(row.split("|")[1]): row for row in rows if "| not run |" not in row}


def write_index(index: Path, commands: list[str], done: dict[int, str]) -> None:
    rows = ["| # | command | exit | seconds | load average at start |", "|---|---|---|---|---|"]
    for number, command in enumerate(commands, 1):
        rows.append(done.get(number, f"| {number} | `{command}` | not run | | |"))
    write_text_atomically(index, "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
