"""The retrieval experiment over several seeds (hf_alibi.experiments.retrieval.retrieval_seeds): how seeds are pooled, and a
whole seeded run that resumes from its finished seeds."""

import json
import math

import pytest

from hf_alibi.experiments.retrieval.experiment import run_retrieval
from hf_alibi.experiments.retrieval.passkey import wilson_interval
from hf_alibi.experiments.retrieval.retrieval_seeds import pool_seeds, seeded_metadata
from hf_alibi.experiments.setup.arguments import ExperimentArguments, parse_args


def record(correct: int, nll: float, dropped: float) -> dict:
    """One arm's record at one length (64), 93 probes at one depth, 1000 scored tokens."""
    cell = {"correct": correct, "n": 93, "accuracy": correct / 93, "low": 0.0, "high": 1.0}
    result = {
        "length": 64,
        "factor": 1.0,
        "unsupported": None,
        "stride": None,
        "ppl_nonoverlapping": math.exp(nll / 1000),
        "ppl_sliding": None,
        "nll_nonoverlapping": nll,
        "nll_sliding": None,
        "tokens_nonoverlapping": 1000,
        "tokens_sliding": 0,
        "windows_nonoverlapping": 16,
        "windows_sliding": 0,
        "position_loss": {"x": 1},
        "seconds": 1.0,
    }
    evaluation = {
        "model": "alibi",
        "train_length": 64,
        "max_length": None,
        "lengths": [result],
        "selection": {"documents": 4, "skipped": 0, "min_tokens": 65},
    }
    return {
        "evaluation": evaluation,
        "retrieval": {"64": {"0.0": cell, "all": cell}},
        "dropped": {"64": {"overall": dropped, "per_head": [dropped]}},
    }


def test_seeds_pool_their_probes_keep_each_seed_s_accuracy_and_average_perplexity_geometrically():
    pooled = pool_seeds({1: {"alibi": record(84, 1500.0, 0.1)}, 2: {"alibi": record(93, 1300.0, 0.3)}})["alibi"]
    cell = pooled["retrieval"]["64"]["all"]
    assert (cell["correct"], cell["n"]) == (177, 186) and cell["accuracy"] == 177 / 186
    assert (cell["low"], cell["high"]) == wilson_interval(177, 186)  # the pooled probes' interval
    assert (cell["seed_min"], cell["seed_max"]) == (84 / 93, 1.0) and cell["by_seed"] == {"1": 84 / 93, "2": 1.0}
    length = pooled["evaluation"]["lengths"][0]
    assert length["ppl_nonoverlapping"] == pytest.approx(math.sqrt(math.exp(1.5) * math.exp(1.3)))  # geometric mean
    assert (length["tokens_nonoverlapping"], length["position_loss"]) == (2000, None)
    assert pooled["perplexity_by_seed"]["64"] == {"1": pytest.approx(math.exp(1.5)), "2": pytest.approx(math.exp(1.3))}
    assert pooled["dropped"]["64"] == {"overall": pytest.approx(0.2), "seed_min": 0.1, "seed_max": 0.3}


def test_seeds_holding_other_arms_are_refused():
    with pytest.raises(ValueError, match="seed 2 holds arms"):
        pool_seeds({1: {"alibi": record(1, 1.0, 0.0)}, 2: {"rotary": record(1, 1.0, 0.0)}})


def test_seeded_metadata_names_each_seed_s_model_facts():
    metadata = seeded_metadata(
        {1: {"corpus": "c", "alibi_training": {"steps": 3}}, 2: {"alibi_training": {"steps": 4}}}
    )
    assert metadata == {
        "corpus": "c",
        "seeds": [1, 2],
        "alibi@seed1_training": {"steps": 3},
        "alibi@seed2_training": {"steps": 4},
    }


def test_repeated_seeds_are_refused_by_name():
    with pytest.raises(ValueError, match=r"seeds must be distinct, got \[1, 1\]"):
        parse_args(["--config", "retrieval_smoke", "--seeds", "1", "1"], ExperimentArguments)


@pytest.mark.slow
def test_a_seeded_run_writes_each_seed_s_run_and_pools_them_and_resumes_from_finished_seeds(tmp_path):
    argv = ["--config", "retrieval_smoke", "--output_dir", str(tmp_path), "--models", "alibi", "rotary"]
    argv += ["--eval_arms", "alibi", "rotary", "--eval_factors", "1", "--seeds", "1", "2"]
    experiment, training = parse_args(argv, ExperimentArguments)
    pooled = run_retrieval(experiment, training)
    probes = experiment.passkey_samples * len(experiment.passkey_depths)
    payload = json.loads((tmp_path / "retrieval.json").read_text())
    assert payload["metadata"]["seeds"] == [1, 2] and payload["arms"] == pooled
    for seed in (1, 2):
        seed_run = json.loads((tmp_path / f"seed_{seed}" / "retrieval.json").read_text())
        assert seed_run["metadata"]["training"]["seed"] == seed
        assert len(payload["metadata"][f"alibi@seed{seed}_copy_curve"]) == 2  # every 2 of the smoke's 4 steps
    for arm in ("alibi", "rotary"):
        cell = pooled[arm]["retrieval"]["48"]["all"]
        assert cell["n"] == 2 * probes and sorted(cell["by_seed"]) == ["1", "2"]
    assert "(seeds " in (tmp_path / "retrieval.md").read_text()
    # a rerun reads the finished seeds back: nothing is trained or measured again
    stamp = (tmp_path / "seed_1" / "retrieval.json").stat().st_mtime_ns
    experiment, training = parse_args([*argv, "--resume_from_checkpoint", "true"], ExperimentArguments)
    assert run_retrieval(experiment, training) == pooled
    assert (tmp_path / "seed_1" / "retrieval.json").stat().st_mtime_ns == stamp
