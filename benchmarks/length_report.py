"""`bench_length_scaling`'s report: its processes' figures by length, each doubling's ratio by three estimators (the
min over all processes, the median of the processes' mins, and round by round: the ratio of one round's two
processes, with a distribution-free interval for its median), the largest context in the memory budget, and the
exactness table."""

import math
import statistics

from benchmarks.length_training import doubling, profile_lines


def per_process(seconds: list[float], per: int, reduce) -> list[float]:
    """`reduce` of each timed process's figures: `seconds` holds `per` of them a process, one process after another."""
    return [reduce(seconds[start : start + per]) for start in range(0, len(seconds), per)]


def round_minima(cell: dict, repeats: int) -> list[float]:
    """Each timed process's least forward: `forward_s` holds the rounds' `repeats` forwards one round after another."""
    return per_process(cell["forward_s"], repeats, min)


def round_medians(cell: dict, key: str) -> list[float]:
    """Each timed process's median of `key`'s figures (`decode_s`: its decoding steps), one process after another."""
    return per_process(cell[key], len(cell[key]) // cell["rounds"], statistics.median)


def median_interval(values: list[float], confidence: float = 0.9) -> tuple[float, float, float, float]:
    """(median, low, high, the interval's coverage): the distribution-free interval for the median of `values`
    between its k-th least and k-th largest, k the largest whose coverage, 1 - 2 P(Binomial(n, 1/2) <= k - 1), is at
    least `confidence` (k = 1, the least and the largest, when none is)."""
    ordered, n = sorted(values), len(values)
    cover = lambda k: 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n  # noqa: E731
    k = max([k for k in range(1, (n + 1) // 2 + 1) if cover(k) >= confidence], default=1)
    return statistics.median(ordered), ordered[k - 1], ordered[n - k], cover(k)


def paired_doublings(cells: list[dict], per_round) -> list[dict]:
    """Each doubling round by round: the ratio of the two lengths' processes of one round (run one after the other,
    so a slow or fast spell of the host falls on both), `per_round(cell)` giving each round's figure; their median and
    its interval (`median_interval`)."""
    doublings = []
    for a, b in zip(cells, cells[1:]):
        ratios = [y / x for x, y in zip(per_round(a), per_round(b))]
        median, low, high, cover = median_interval(ratios)
        doublings.append(
            {
                "lengths": (a["length"], b["length"]),
                "ratios": ratios,
                "median": median,
                "interval": (low, high),
                "coverage": cover,
            }
        )
    return doublings


def paired_lines(report: dict) -> list[str]:
    """The forward's and the decoding step's doublings round by round (`paired_doublings`)."""
    forward = paired_doublings(report["cells"], lambda c: round_minima(c, report["repeats"]))
    decode = paired_doublings(report["cells"], lambda c: round_medians(c, "decode_s"))
    lines = [
        "",
        "## Each doubling round by round",
        "",
        "In each round every length ran once, shortest first, so a doubling's two processes ran one after the other: "
        "the ratio of their figures (the forward: each process's min; a decoding step: each process's median step), "
        "its median over the rounds, and a distribution-free interval for that median (between two of the ratios "
        "ranked by size: coverage 1 - 2 P(Binomial(rounds, 1/2) < k) for the k-th from each end).",
        "",
        "| doubling | forward, each round | median | interval (coverage) | decoding step, median | interval |",
        "|---|---|---:|---|---:|---|",
    ]
    for f, d in zip(forward, decode):
        low, high = f["interval"]
        lines.append(
            f"| {f['lengths'][0]:,} -> {f['lengths'][1]:,} | {', '.join(f'{r:.2f}' for r in f['ratios'])} "
            f"| x{f['median']:.3f} | x{low:.3f} - x{high:.3f} ({f['coverage']:.0%}) | x{d['median']:.3f} "
            f"| x{d['interval'][0]:.3f} - x{d['interval'][1]:.3f} ({d['coverage']:.0%}) |"
        )
    return lines


def markdown(report: dict) -> str:
    cells = report["cells"]
    ratio = lambda r: "" if r is None else f" (x{r:.2f})"  # noqa: E731
    forward = doubling(cells, lambda c: min(c["forward_s"]))
    median = lambda c: statistics.median(round_minima(c, report["repeats"]))  # noqa: E731
    typical = doubling(cells, median)
    memory = doubling(cells, lambda c: c["forward_bytes"])
    decode = doubling(cells, lambda c: min(c["decode_s"]))
    lines = [
        "# The default path by context length (each length a fresh process)",
        "",
        f'Checkpoint `{report["checkpoint_name"]}`, `alibi_skip_eps` as saved (`"auto"` by default), '
        f"{cells[0]['threads']} threads, min over {cells[0]['rounds']} fresh process(es) per length x "
        f"{report['repeats']} forwards; command: `{report['command']}`.",
        "",
        "| tokens | forward, min (s) | forward, median of the processes' mins (s) | forward working memory (MiB) |"
        " the same, default allocator (MiB) | one decoding step, min (s) | decoding step, median (s) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c, f, t, m, d in zip(cells, forward, typical, memory, decode):
        lines.append(
            f"| {c['length']:,} | {min(c['forward_s']):.3f}{ratio(f)} | {median(c):.3f}{ratio(t)} "
            f"| {c['forward_bytes'] / 2**20:,.0f}{ratio(m)} "
            f"| {c['forward_bytes_default_allocator'] / 2**20:,.0f} | {min(c['decode_s']):.4f}{ratio(d)} "
            f"| {statistics.median(c['decode_s']):.4f} |"
        )
    budget = report["memory_gib"]
    lines += ["", f"## The largest context in {budget} GiB", ""]
    for name, limit in report["limits"].items():
        lines.append(
            f"- {name}: forward (`logits_to_keep=1`, no cache) **{limit['forward_tokens']:,} tokens**; generation "
            f"(a `DynamicCache` of {limit['cache_bytes_per_token']:,} bytes a token, fp32) "
            f"**{limit['generate_tokens']:,} tokens**; working memory {limit['working_bytes_per_token']:,.0f} bytes a "
            "token."
        )
    paired = paired_lines(report) if cells[0]["rounds"] > 1 else []
    return "\n".join(lines + paired + profile_lines(cells, "forwards")) + "\n"


def exactness_markdown(cells: list[dict], command: str) -> str:
    """The default's logits against dense, by length."""
    lines = [
        "# The default's logits against dense attention, every position",
        "",
        f"Command: `{command}`.",
        "",
        "| tokens | largest logit difference | largest logit | greedy tokens equal |",
        "|---:|---:|---:|---:|",
    ]
    for c in cells:
        lines.append(
            f"| {c['length']:,} | {c['max_abs_logit_difference']:.2e} | {c['largest_logit']:.1f} "
            f"| {c['greedy_agreement']:.2%} |"
        )
    return "\n".join(lines) + "\n"
