"""The retrieval diagnosis table (hf_alibi.experiments.retrieval.retrieval_diagnosis) over a finished smoke run."""

import pytest

from hf_alibi.experiments.retrieval.experiment import run_retrieval
from hf_alibi.experiments.retrieval.retrieval_diagnosis import main
from hf_alibi.experiments.setup.arguments import ExperimentArguments, parse_args


@pytest.mark.slow
def test_the_table_has_a_row_per_trained_model_with_its_curve_and_one_copy_attention_per_layer(tmp_path):
    models = ["alibi", "rotary", "learned"]
    argv = ["--config", "retrieval_smoke", "--models", *models, "--eval_arms", *models, "--eval_factors", "1"]
    experiment, training = parse_args([*argv, "--output_dir", str(tmp_path / "run")], ExperimentArguments)
    run_retrieval(experiment, training)
    table = main(["--runs", str(tmp_path / "run"), "--diagnosis_markdown", str(tmp_path / "table.md"), *argv])
    assert (tmp_path / "table.md").read_text() == table
    for model in models:
        [row] = [line for line in table.splitlines() if line.startswith(f"| run | {model} |")]
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[3].startswith("4: ")  # the curve's last point: the smoke's 4th step
        weights = [float(w) for w in cells[5].split(", ")]
        assert len(weights) == experiment.n_layer and all(0 <= w <= 1 for w in weights)
    assert table.startswith("| run | model | first step >= 90% |")


def test_a_folder_without_trained_models_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="holds no trained model"):
        main(["--runs", str(tmp_path), "--config", "retrieval_smoke"])
    with pytest.raises(ValueError, match="at least one"):
        main(["--config", "retrieval_smoke"])
