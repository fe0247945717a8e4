"""Serving: generated tokens/s and latency of real OpenAI clients against `hf-alibi serve` (transformers' own server),
hf_alibi against GPT-2 of the same shape on the same server, with and without continuous batching, and llama.cpp's
OpenAI server on the GGUF export of the same checkpoint.

    python -m benchmarks.bench_serve --checkpoint runs/cpu_demo/alibi/final --out results/serving/serve_demo
    python -m benchmarks.bench_serve --checkpoint runs/cpu_demo/alibi/final --clients 1 --long --rounds 1 \
        --contestants alibi gpt2 --out /tmp/serve_smoke                                     # smoke, ~1 min
    # llama.cpp as a peer: a venv with `pip install 'llama-cpp-python[server]'`, named by --llama-python

Contestants, each a fresh server process on 127.0.0.1: `alibi` / `alibi-cb` (the checkpoint, `hf-alibi serve` without
/ with `--continuous-batching`, its paged cache sized to 32k tokens), `gpt2` / `gpt2-cb` (transformers' GPT-2 with
learned positions, the checkpoint's width, depth, heads, vocabulary and tokenizer, random weights: serving cost does
not depend on them), `llama.cpp` (`python -m llama_cpp.server` on `hf-alibi export --to gguf` of the checkpoint, 2
threads). Every request is a greedy (`temperature=0`) `/v1/completions` of `--max-tokens` tokens on held-out text (the
recipe's standard-library documents) cut to `--prompt-tokens`. For each concurrency in `--clients`, that many client
threads send `--requests` requests each, one after the other; a cell reports generated tokens/s (completion tokens
over the wall time of the whole cell) and the p50/p95 request latency. `--long` adds 4k- and 16k-token prompts (one
client, `--long-max-tokens` tokens, `--long-requests` requests) for `alibi` (the checkpoint's default, `"auto"`),
`alibi-dense` (`--alibi-skip-eps 0`) and `alibi-skip` (`--alibi-skip-eps 1e-7`) beside `gpt2`. Each server's resident
set (its processes' sum: the model's own process too, on transformers 5.25+) is read from /proc after its warm-up
request and after its last cell, with its peak (VmHWM): growth beyond the cache would show there. Rounds
(`--rounds`) rotate the contestants' order; cells report the median over rounds. hf_alibi's completions with and
without continuous batching are checked equal (greedy); llama.cpp's agreement with them is reported, not required
(ggml's GELU reads an fp16 table). Run alone: two cores, any other load shows in the figures.
"""

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from benchmarks.measure import group_memory_kib

# transformers sizes the paged cache from the machine's free memory unless told (9 GiB here): 32k tokens hold every
# cell's requests (16 clients x 160 tokens) many times over. Its eager/SDPA mask buffer is (batch tokens, cache + batch
# tokens) floats: 1.3 GiB at its default 8192 batch tokens, 138 MiB at 1024 (16 prompts prefill in two batches).
CB = ["--continuous-batching", "--cb-block-size", "32", "--cb-num-blocks", "1024", "--cb-max-batch-tokens", "1024"]
OURS = {
    "alibi": [],
    "alibi-cb": CB,
    "alibi-dense": ["--alibi-skip-eps", "0"],
    "alibi-skip": ["--alibi-skip-eps", "1e-7"],
    "gpt2": [],
    "gpt2-cb": CB,
}
CONTESTANTS = ("alibi", "alibi-cb", "gpt2", "gpt2-cb", "llama.cpp")
LONG_CONTESTANTS = ("alibi", "alibi-dense", "alibi-skip", "gpt2")
LONG_PROMPTS = (4096, 16384)
START_TIMEOUT = 180  # seconds for a server to load and answer /health
REQUEST_TIMEOUT = 600


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """One server process on 127.0.0.1 (its own process group), stopped with SIGTERM, then SIGKILL."""

    def __init__(self, command: list[str], health: str, log: Path):
        self.port = free_port()
        self.log = log.open("w")
        command = [part.replace("{port}", str(self.port)) for part in command]
        self.process = subprocess.Popen(
            command,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        self.base = f"http://127.0.0.1:{self.port}"
        self._wait(health)

    def _wait(self, health: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(self.base + health, timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:  # refused while it loads (URLError and timeouts are OSErrors)
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"no answer from {self.base}{health} within {START_TIMEOUT} s:\n{self.output()}")

    def output(self, lines: int = 20) -> str:
        self.log.flush()
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


def complete(client, model: str, prompt: str, max_tokens: int) -> tuple[float, int, str]:
    """One greedy completion: (latency s, completion tokens, text)."""
    start = time.perf_counter()
    response = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
    latency = time.perf_counter() - start
    return latency, response.usage.completion_tokens, response.choices[0].text


def load(base: str, model: str, prompts: list[str], clients: int, requests: int, max_tokens: int) -> dict:
    """`clients` threads, each sending `requests` completions in turn: tokens/s, p50/p95 latency, every text."""
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=REQUEST_TIMEOUT, max_retries=0)
    latencies, tokens, texts, errors = [], [], {}, []

    def run(worker: int) -> None:
        for r in range(requests):
            index = (worker * requests + r) % len(prompts)
            try:
                latency, count, text = complete(client, model, prompts[index], max_tokens)
            except Exception as error:  # noqa: BLE001  (reported, and the cell fails)
                errors.append(repr(error))
                return
            latencies.append(latency)
            tokens.append(count)
            texts[index] = text

    start = time.perf_counter()
    threads = [threading.Thread(target=run, args=(w,)) for w in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    if errors:
        return {"status": "failed", "errors": errors[:3]}
    latencies.sort()
    p95 = latencies[min(len(latencies) - 1, int(round(0.95 * (len(latencies) - 1))))]
    return {
        "status": "ok",
        "tokens_per_s": sum(tokens) / wall,
        "p50_s": statistics.median(latencies),
        "p95_s": p95,
        "tokens": sum(tokens),
        "wall_s": wall,
        "texts": texts,
    }


def prepare(args, work: Path) -> dict:
    """The served folders: the checkpoint (greedy generation config), GPT-2 of its shape, and its GGUF export."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

    import hf_alibi

    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint)
    longest = max(LONG_PROMPTS) + args.long_max_tokens + 16 if args.long else args.prompt_tokens + args.max_tokens
    folders = {"alibi": work / "alibi", "gpt2": work / "gpt2"}
    model.save_pretrained(folders["alibi"])
    c = model.config
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(
        GPT2Config(
            n_embd=c.n_embd,
            n_layer=c.n_layer,
            n_head=c.n_head,
            vocab_size=c.vocab_size,
            n_positions=longest,
            bos_token_id=c.bos_token_id,
            eos_token_id=c.eos_token_id,
        )
    )
    gpt2.save_pretrained(folders["gpt2"])
    for folder in folders.values():
        tokenizer.save_pretrained(folder)
    if args.llama_python:
        folders["llama.cpp"] = hf_alibi.export(folders["alibi"], "gguf", work / "alibi.gguf", max_seq_len=longest)
    return folders


def server_command(name: str, folders: dict, args) -> tuple[list[str], str]:
    """The command line of contestant `name` ({port} filled in by `Server`) and its health route."""
    if name == "llama.cpp":
        context = str(args.prompt_tokens + args.max_tokens + 64)
        command = [args.llama_python, "-m", "llama_cpp.server", "--model", str(folders["llama.cpp"])]
        command += ["--host", "127.0.0.1", "--port", "{port}", "--n_ctx", context]
        command += ["--n_threads", "2", "--n_batch", "512"]
        return command, "/v1/models"
    folder = folders["gpt2" if name.startswith("gpt2") else "alibi"]
    command = [sys.executable, "-m", "hf_alibi.cli", "serve", str(folder), "--host", "127.0.0.1", "--port", "{port}"]
    return [*command, "--device", "cpu", *OURS[name]], "/health"


def served_name(name: str, folders: dict) -> str:
    return str(folders["llama.cpp"] if name == "llama.cpp" else folders["gpt2" if name.startswith("gpt2") else "alibi"])


def run_contestant(name: str, folders: dict, cells: list[dict], work: Path, args) -> dict:
    """Start `name`'s server, warm it up, run its cells, read its memory; always stop it."""
    command, health = server_command(name, folders, args)
    server = Server(command, health, work / f"{name}.log")
    try:
        model = served_name(name, folders)
        load(server.base, model, cells[0]["prompts"][:1], 1, 1, 4)  # warm-up: first-call costs stay out
        before = group_memory_kib(server.process.pid)
        results = {
            cell["name"]: load(
                server.base, model, cell["prompts"], cell["clients"], cell["requests"], cell["max_tokens"]
            )
            for cell in cells
        }
        after = group_memory_kib(server.process.pid)
    finally:
        server.stop()
    return {"cells": results, "memory_kib": {"after_warmup": before, "after_run": after}}


def text_prompts(checkpoint: str, length: int, count: int) -> list[str]:
    """`count` prompts of `length` tokens of held-out text, consecutive slices of the recipe's validation documents."""
    from transformers import AutoTokenizer

    from benchmarks.measure_kept_fraction import heldout_stream

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = heldout_stream(tokenizer, length * count)[0]  # (length * count,)
    return [tokenizer.decode(ids[i * length : (i + 1) * length]) for i in range(count)]


def plan_cells(args) -> tuple[list[dict], list[dict]]:
    """(short cells for every contestant, long cells for `LONG_CONTESTANTS`)."""
    prompts = text_prompts(args.checkpoint, args.prompt_tokens, max(args.clients) * args.requests)
    short = [
        dict(name=f"{c} clients", clients=c, requests=args.requests, max_tokens=args.max_tokens, prompts=prompts)
        for c in args.clients
    ]
    long = (
        [
            dict(
                name=f"{n} prompt",
                clients=1,
                requests=args.long_requests,
                max_tokens=args.long_max_tokens,
                prompts=text_prompts(args.checkpoint, n, args.long_requests),
            )
            for n in LONG_PROMPTS
        ]
        if args.long
        else []
    )
    return short, long


def median_rounds(rounds: list[dict]) -> dict:
    """Per contestant and cell: the median over rounds of tokens/s and latencies (a failed round fails the cell)."""
    table = {}
    for name in rounds[0]:
        table[name] = {}
        for cell in rounds[0][name]["cells"]:
            runs = [r[name]["cells"][cell] for r in rounds]
            if any(run["status"] != "ok" for run in runs):
                table[name][cell] = next(run for run in runs if run["status"] != "ok")
                continue
            table[name][cell] = {
                key: statistics.median(run[key] for run in runs) for key in ("tokens_per_s", "p50_s", "p95_s")
            }
        table[name]["memory_kib"] = rounds[-1][name]["memory_kib"]
    return table


def agreement(rounds: list[dict], name: str, reference: str) -> float | None:
    """Fraction of prompts on which `name`'s greedy text equals `reference`'s (first round, every short cell)."""
    if name not in rounds[0] or reference not in rounds[0]:
        return None
    pairs = [
        (rounds[0][name]["cells"][c].get("texts", {}), rounds[0][reference]["cells"][c].get("texts", {}))
        for c in rounds[0][name]["cells"]
    ]
    same = [a[i] == b[i] for a, b in pairs for i in a if i in b]
    return sum(same) / len(same) if same else None


def markdown(table: dict, rounds: list[dict], args, command: str) -> str:
    lines = [
        f"`{command}`",
        "",
        "| contestant | cell | tokens/s | p50 s | p95 s | tokens/s vs gpt2 |",
        "|---|---|---|---|---|---|",
    ]
    for name, cells in table.items():
        reference = "gpt2 (long)" if name.endswith("(long)") else "gpt2-cb" if name.endswith("-cb") else "gpt2"
        for cell, result in cells.items():
            if cell == "memory_kib":
                continue
            if "tokens_per_s" not in result:
                lines.append(f"| {name} | {cell} | {result['status']} | | | |")
                continue
            base = table.get(reference, {}).get(cell, {}).get("tokens_per_s")
            ratio = f"{result['tokens_per_s'] / base:.2f}x" if base else ""
            lines.append(
                f"| {name} | {cell} | {result['tokens_per_s']:.1f} | {result['p50_s']:.3f} | "
                f"{result['p95_s']:.3f} | {ratio} |"
            )
    lines += ["", "| contestant | RSS after warm-up MiB | RSS after run MiB | peak MiB |", "|---|---|---|---|"]
    for name, cells in table.items():
        memory = cells["memory_kib"]
        lines.append(
            f"| {name} | {memory['after_warmup']['VmRSS'] / 1024:.0f} | {memory['after_run']['VmRSS'] / 1024:.0f}"
            f" | {memory['after_run']['VmHWM'] / 1024:.0f} |"
        )
    for name, reference in (("alibi-cb", "alibi"), ("llama.cpp", "alibi")):
        share = agreement(rounds, name, reference)
        if share is not None:
            lines.append(f"\n{name}: greedy text equal to {reference}'s on {share:.0%} of prompts")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="runs/cpu_demo/alibi/final", help="a trained ALiBi GPT-2 folder")
    parser.add_argument("--contestants", nargs="+", default=list(CONTESTANTS), choices=CONTESTANTS)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16], help="concurrent clients per cell")
    parser.add_argument("--requests", type=int, default=2, help="requests per client per cell")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--long", action="store_true", help="also 4k and 16k prompts: alibi, alibi-dense, alibi-skip, gpt2"
    )
    parser.add_argument("--long-requests", type=int, default=2)
    parser.add_argument("--long-max-tokens", type=int, default=16)
    parser.add_argument("--llama-python", help="python of a venv with llama-cpp-python[server] (else no llama.cpp)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the contestants, order rotated")
    parser.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md (atomically)")
    args = parser.parse_args(argv)
    if "llama.cpp" in args.contestants and not args.llama_python:
        args.contestants = [c for c in args.contestants if c != "llama.cpp"]
        print("no --llama-python: llama.cpp left out", file=sys.stderr)
    return args


def main(argv=None) -> None:
    from hf_alibi.atomic_files import write_text_atomically

    args = parse_args(argv)
    command = "python -m benchmarks.bench_serve " + " ".join(sys.argv[1:] if argv is None else argv)
    work = Path(tempfile.mkdtemp(prefix="bench_serve_"))
    try:
        folders = prepare(args, work)
        short, long = plan_cells(args)
        rounds = []
        for r in range(args.rounds):
            order = args.contestants[r % len(args.contestants) :] + args.contestants[: r % len(args.contestants)]
            results = {}
            for name in order:
                print(f"round {r + 1}: {name}", file=sys.stderr, flush=True)
                results[name] = run_contestant(name, folders, short, work, args)
            if long:
                for name in LONG_CONTESTANTS:
                    print(f"round {r + 1}: {name} (long prompts)", file=sys.stderr, flush=True)
                    results[f"{name} (long)"] = run_contestant(name, folders, long, work, args)
            rounds.append(results)
        table = median_rounds(rounds)
        reference_texts = agreement(rounds, "alibi-cb", "alibi")
        if reference_texts is not None and reference_texts < 1:
            raise RuntimeError(f"continuous batching changed hf_alibi's greedy text ({reference_texts:.0%} equal)")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {"command": command, "rounds": rounds, "table": table, "date": time.strftime("%Y-%m-%d")}
        write_text_atomically(args.out.with_suffix(".json"), json.dumps(report, indent=1))
        write_text_atomically(args.out.with_suffix(".md"), markdown(table, rounds, args, command))
        print(markdown(table, rounds, args, command))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
