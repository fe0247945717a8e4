"""`bench_length_scaling --train`: one training step as Trainer runs it, its time, working memory and (`--profile`)
its operators, and the table of each doubling (`doubling`, which the forward's table uses too; and `profiled` and
`profile_lines`, which its `--profile` uses). The command and what it measures: `bench_length_scaling`'s docstring.
"""

import contextlib

# `--profile`: the operators kept per length (by self CPU time)
PROFILE_OPERATORS = 12


def training_step(model, ids, args) -> dict:
    """One training step's working memory (`--memory`) or its time (min of `--repeats`), warmed up once."""
    import torch

    from benchmarks.measure import peak_memory, time_call
    from hf_alibi.native_flush import flushing_denormals

    model.train()
    ones = torch.ones_like(ids)  # Trainer's all-ones mask

    def step():
        model.zero_grad(set_to_none=False)  # the gradients' memory is held from the warm-up on, as in training
        model(ids, attention_mask=ones, labels=ids).loss.backward()

    with flushing_denormals() if args.native_flush else contextlib.nullcontext():
        step()  # warm-up
        if args.memory:
            return {"step_bytes": peak_memory(step, "cpu")[0]}
        result = {"step_s": time_call(step, repeats=args.repeats, warmup=0), "threads": torch.get_num_threads()}
        if args.profile:  # one more step, profiled
            result["profile"] = profiled(step, calls=1)
        return result


def profiled(call, calls: int) -> dict:
    """`calls` more calls of `call`, profiled: each operator's self CPU seconds per call, the top `PROFILE_OPERATORS`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for _ in range(calls):
            call()
    totals = {event.key: event.self_cpu_time_total / 1e6 / calls for event in profiler.key_averages()}
    return dict(sorted(totals.items(), key=lambda item: -item[1])[:PROFILE_OPERATORS])


def training_markdown(args, cells: list[dict], command: str) -> str:
    """A training step's time and working memory by length, each doubling's ratio beside them, and `--profile`'s
    operators."""
    ratio = lambda r: "" if r is None else f" (x{r:.2f})"  # noqa: E731
    seconds = doubling(cells, lambda c: min(c["step_s"]))
    memory = doubling(cells, lambda c: c["step_bytes"])
    lines = [
        "# One training step by context length (each length a fresh process)",
        "",
        f"Forward with labels and backward, train mode, {cells[0]['threads']} threads; command: `{command}`.",
        f"Denormals flushed: {'yes' if args.native_flush else 'no'}; timed processes' heap kept: "
        f"{'yes' if args.keep_heap else 'no'}.",
        "",
        "| tokens | step, min (s) | step working memory (MiB) |",
        "|---:|---:|---:|",
    ]
    for c, t, m in zip(cells, seconds, memory):
        lines.append(
            f"| {c['length']:,} | {min(c['step_s']):.3f}{ratio(t)} | {c['step_bytes'] / 2**20:,.0f}{ratio(m)} |"
        )
    return "\n".join(lines + profile_lines(cells, "step")) + "\n"


def profile_lines(cells: list[dict], profiled_calls: str) -> list[str]:
    """`--profile`'s table: the longest length's top operators, their self CPU seconds at every length and each
    doubling's ratio; `profiled_calls` names what was profiled ("step", "forwards")."""
    if not all("profile" in c for c in cells):
        return []
    heading = f"Profiled {profiled_calls}, self CPU seconds by operator (the longest length's top ones; with several"
    lines = ["", heading + " rounds, each operator's least over them):", ""]
    lines += ["| operator | " + " | ".join(f"{c['length']:,}" for c in cells) + " |", "|---|" + "---:|" * len(cells)]
    for name in cells[-1]["profile"]:
        seconds = [c["profile"].get(name) for c in cells]
        text = [
            "-" if t is None else f"{t:.3f}" + ("" if i == 0 or not seconds[i - 1] else f" (x{t / seconds[i - 1]:.2f})")
            for i, t in enumerate(seconds)
        ]
        lines.append(f"| `{name}` | " + " | ".join(text) + " |")
    return lines


def doubling(cells: list[dict], value) -> list[float | None]:
    """Each length's figure over the previous length's (None for the first)."""
    figures = [value(c) for c in cells]
    return [None] + [b / a if a else None for a, b in zip(figures, figures[1:])]
