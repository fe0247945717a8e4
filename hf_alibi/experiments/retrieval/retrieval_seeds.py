"""The retrieval experiment over several seeds, and the spread between them.

    HF_HUB_OFFLINE=1 hf-alibi train --config retrieval --seeds 1 2 3

Each seed is a whole retrieval run (`retrieval.run_retrieval`) in `<output_dir>/seed_<S>/` with `seed` S: the
models' initialisation, the order of their batches and which blocks become passkey documents all change with it. A
finished seed is read back from its `retrieval.json` (resume: rerun the same command). The top level then holds the
pooled results, written atomically beside the seeds' folders:

- `retrieval.json`: `metadata["seeds"]`, each seed's training facts and copy curves (`<model>@seed<S>_...`), and per
  arm the pooled records: retrieval as the probes of every seed together (`correct`, `n`, `accuracy` and its 95%
  Wilson interval) with each seed's accuracy and their min and max (`by_seed`, `seed_min`, `seed_max`); perplexity
  from the summed log-likelihood of every seed (the geometric mean of their perplexities: each seed scores the same
  tokens) with each seed's in `perplexity_by_seed`; certified skipping's dropped share, the mean over seeds;
- `retrieval.md`, `results.{json,csv,md}` and the figures, from the pooled records (`retrieval_results`).
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import TrainingArguments

from .passkey import wilson_interval


def seed_dir(output_dir: str | Path, seed: int) -> Path:
    """Where seed `seed`'s whole run lives."""
    return Path(output_dir) / f"seed_{seed}"


def seed_training(training: TrainingArguments, seed: int) -> TrainingArguments:
    """`training` with `seed` and the seed's folder as its output folder."""
    values = {**training.to_dict(), "seed": seed, "output_dir": str(seed_dir(training.output_dir, seed))}
    return TrainingArguments(**values)


def pool_retrieval(by_seed: dict[int, dict]) -> dict:
    """`{length: {depth: cell}}` of every seed's probes together, each cell with the seeds' own accuracies."""
    first = next(iter(by_seed.values()))
    pooled = {}
    for length, depths in first.items():
        pooled[length] = {}
        for depth in depths:
            cells = {seed: retrieval[length][depth] for seed, retrieval in by_seed.items()}
            correct, n = sum(c["correct"] for c in cells.values()), sum(c["n"] for c in cells.values())
            low, high = wilson_interval(correct, n)
            accuracies = {str(seed): cell["accuracy"] for seed, cell in cells.items()}
            pooled[length][depth] = {
                "correct": correct,
                "n": n,
                "accuracy": correct / n,
                "low": low,
                "high": high,
                "seed_min": min(accuracies.values()),
                "seed_max": max(accuracies.values()),
                "by_seed": accuracies,
            }
    return pooled


def pool_evaluation(by_seed: dict[int, dict]) -> tuple[dict, dict]:
    """`(evaluation, {length: {seed: perplexity}})`: a `ModelEvaluation` dict whose nonoverlapping log-likelihood and
    token counts are the seeds' sums (its perplexity: the geometric mean of theirs), position losses dropped."""
    from ..length.length_eval import perplexity

    first = next(iter(by_seed.values()))
    lengths, spread = [], {}
    for index, result in enumerate(first["lengths"]):
        results = {seed: evaluation["lengths"][index] for seed, evaluation in by_seed.items()}
        pooled = {**result, "position_loss": None, "seconds": sum(r["seconds"] for r in results.values())}
        if not result["unsupported"]:
            nll = sum(r["nll_nonoverlapping"] for r in results.values())
            tokens = sum(r["tokens_nonoverlapping"] for r in results.values())
            pooled.update(
                nll_nonoverlapping=nll, tokens_nonoverlapping=tokens, ppl_nonoverlapping=perplexity(nll, tokens)
            )
            spread[str(result["length"])] = {str(seed): r["ppl_nonoverlapping"] for seed, r in results.items()}
        lengths.append(pooled)
    return {**first, "lengths": lengths}, spread


def pool_dropped(by_seed: dict[int, dict]) -> dict:
    """`{length: {"overall", "seed_min", "seed_max"}}`: certified skipping's dropped share over seeds ({} if none)."""
    first = next(iter(by_seed.values()))
    pooled = {}
    for length in first:
        shares = [dropped[length]["overall"] for dropped in by_seed.values()]
        pooled[length] = {"overall": sum(shares) / len(shares), "seed_min": min(shares), "seed_max": max(shares)}
    return pooled


def pool_seeds(records_by_seed: dict[int, dict[str, dict]]) -> dict[str, dict]:
    """`{arm: pooled record}` from `{seed: {arm: record}}` (module docstring). Every seed must hold the same arms."""
    seeds = list(records_by_seed)
    arms = list(records_by_seed[seeds[0]])
    for seed in seeds:
        if list(records_by_seed[seed]) != arms:
            raise ValueError(f"seed {seed} holds arms {list(records_by_seed[seed])}, seed {seeds[0]} holds {arms}")
    pooled = {}
    for arm in arms:
        records = {seed: records_by_seed[seed][arm] for seed in seeds}
        evaluation, spread = pool_evaluation({seed: r["evaluation"] for seed, r in records.items()})
        pooled[arm] = {
            "evaluation": evaluation,
            "perplexity_by_seed": spread,
            "retrieval": pool_retrieval({seed: r["retrieval"] for seed, r in records.items()}),
            "dropped": pool_dropped({seed: r["dropped"] for seed, r in records.items()}),
        }
    return pooled


def seeded_metadata(metadata_by_seed: dict[int, dict]) -> dict:
    """The first seed's run metadata with `seeds`, and each seed's per-model facts keyed `<model>@seed<S>_...`."""
    seeds = list(metadata_by_seed)
    per_model = ("_training", "_copy_curve")
    first = metadata_by_seed[seeds[0]]
    metadata = {key: value for key, value in first.items() if not key.endswith(per_model)}
    metadata["seeds"] = seeds
    for seed, seed_metadata in metadata_by_seed.items():
        for key, value in seed_metadata.items():
            for suffix in per_model:
                if key.endswith(suffix):
                    metadata[f"{key.removesuffix(suffix)}@seed{seed}{suffix}"] = value
    return metadata


def read_seed(output_dir: str | Path, seed: int) -> tuple[dict, dict] | None:
    """`(records, metadata)` of a finished seed's run, or None if it has not finished."""
    path = seed_dir(output_dir, seed) / "retrieval.json"
    if not path.exists():
        return None
    payload = json.loads(path.read_text())
    return payload["arms"], payload["metadata"]


__all__ = [
    "pool_dropped",
    "pool_evaluation",
    "pool_retrieval",
    "pool_seeds",
    "read_seed",
    "seed_dir",
    "seed_training",
    "seeded_metadata",
]
