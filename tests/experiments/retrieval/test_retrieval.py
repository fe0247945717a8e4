"""The retrieval experiment (hf_alibi.experiments.retrieval.experiment) end to end on retrieval_smoke.yaml, its training mix,
and the ALiBi arms' dropped-keys measurement (kept_context)."""

import json
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from hf_alibi.experiments.data.tokenization import train_tokenizer
from hf_alibi.experiments.length.kept_context import dropped_fraction, slopes_at
from hf_alibi.experiments.retrieval.experiment import run_retrieval, with_passkeys
from hf_alibi.experiments.retrieval.passkey import PasskeyTemplate
from hf_alibi.experiments.setup.arguments import ExperimentArguments, parse_args
from hf_alibi.experiments.setup.baselines import build_model


@pytest.fixture(scope="module")
def template():
    return PasskeyTemplate.from_tokenizer(train_tokenizer(["abc"], vocab_size=257))


def test_passkey_documents_replace_the_share_of_blocks_and_keep_the_block_count(template):
    blocks = Dataset.from_dict({"input_ids": [[7] * 128] * 400, "labels": [[7] * 128] * 400})
    mixed = with_passkeys(blocks, template, 128, share=0.25, seed=0)
    assert len(mixed) == 400 and {len(row) for row in mixed["input_ids"]} == {128}
    needle = list(template.needle_head)
    with_needle = [row for row in mixed["input_ids"] if any(row[i : i + len(needle)] == needle for i in range(128))]
    assert len(with_needle) == 100
    assert mixed["labels"] == mixed["input_ids"]


def test_slope_interpolation_s_slopes_shrink_by_the_key_length_past_train_seq_len_only():
    torch.manual_seed(0)
    model = build_model("alibi", vocab_size=97, n_embd=32, n_layer=2, n_head=4, train_length=32, max_length=256)
    base = model.transformer.alibi_slopes.double()
    torch.testing.assert_close(slopes_at(model, 128), base)
    model.config.alibi_scaling = {"type": "linear", "train_seq_len": 32}
    torch.testing.assert_close(slopes_at(model, 32), base)
    torch.testing.assert_close(slopes_at(model, 128), base / 4)


def test_smaller_slopes_let_fewer_keys_be_dropped():
    """The certificate reads the slopes the forward uses: at twice `train_seq_len`, interpolated slopes (halved) drop
    a smaller share of the causal keys than the trained ones, and both drop some."""
    torch.manual_seed(0)
    model = build_model("alibi", vocab_size=97, n_embd=32, n_layer=2, n_head=4, train_length=32, max_length=256).eval()
    ids = torch.randint(1, 97, (2, 256), generator=torch.Generator().manual_seed(0))
    plain = dropped_fraction(model, ids, eps=1e-7)
    model.config.alibi_scaling = {"type": "linear", "train_seq_len": 128}
    interpolated = dropped_fraction(model, ids, eps=1e-7)
    assert 0 < interpolated["overall"] < plain["overall"] < 1
    assert len(plain["per_head"]) == 4


@pytest.mark.slow
def test_retrieval_smoke_config_runs_end_to_end_and_resumes_from_its_records(tmp_path):
    output_dir = tmp_path / "run"
    experiment, training = parse_args(
        ["--config", "retrieval_smoke", "--output_dir", str(output_dir)], ExperimentArguments
    )
    records = run_retrieval(experiment, training)
    assert list(records) == experiment.eval_arms
    for name in ("results.md", "perplexity_vs_length.png", "retrieval.md", "retrieval.json", "retrieval_vs_length.png"):
        assert (output_dir / name).stat().st_size > 0, name
    lengths = [str(n) for n in experiment.eval_lengths]
    for arm, record in records.items():
        assert [r["length"] for r in record["evaluation"]["lengths"]] == experiment.eval_lengths, arm
        assert list(record["retrieval"]) == lengths, arm
        for cells in record["retrieval"].values():
            assert cells["all"]["n"] == experiment.passkey_samples * len(experiment.passkey_depths)
            assert cells["all"]["low"] <= cells["all"]["accuracy"] <= cells["all"]["high"]
        assert bool(record["dropped"]) == arm.startswith("alibi"), arm
    markdown = (output_dir / "retrieval.md").read_text()
    assert "| rotary+yarn |" in markdown and "## Context certified skipping drops" in markdown
    # the copy's learning curve: every 2 steps, on the 1x probes, so its last point is the 1x retrieval
    metadata = json.loads((output_dir / "retrieval.json").read_text())["metadata"]
    for model in experiment.models:
        curve = metadata[f"{model}_copy_curve"]
        assert [point["step"] for point in curve] == [2, 4], model
        assert curve[-1]["exact"] == records[model]["retrieval"][str(experiment.train_length)]["all"]["accuracy"]
        assert curve[-1]["n"] == experiment.passkey_samples * len(experiment.passkey_depths)
    assert "## The copy's learning curve at the training length" in markdown
    # a second run reuses the trained models and every arm's record: nothing is trained or measured again
    (output_dir / "arms" / "rotary+yarn.json").unlink()
    again, training = parse_args(
        ["--config", "retrieval_smoke", "--output_dir", str(output_dir), "--resume_from_checkpoint", "true"],
        ExperimentArguments,
    )
    stamp = (output_dir / "arms" / "alibi.json").stat().st_mtime_ns
    resumed = run_retrieval(again, training)
    assert (output_dir / "arms" / "alibi.json").stat().st_mtime_ns == stamp
    expected = json.loads(json.dumps(records))
    remeasured, first = resumed.pop("rotary+yarn"), expected.pop("rotary+yarn")
    assert resumed == expected
    # the removed arm is measured again on the reloaded model: the same figures (only its clock differs)
    assert remeasured["retrieval"] == first["retrieval"]
    assert [r["nll_nonoverlapping"] for r in remeasured["evaluation"]["lengths"]] == pytest.approx(
        [r["nll_nonoverlapping"] for r in first["evaluation"]["lengths"]], rel=1e-9
    )
    assert Path(output_dir / "arms" / "rotary+yarn.json").exists()


class BatchRecorder(TrainerCallback):
    """Every batch a Trainer feeds its model, as the model receives it (a forward pre-hook), per model folder."""

    def __init__(self):
        self.batches: dict[str, list[dict]] = {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        seen = self.batches.setdefault(Path(args.output_dir).name, [])

        def record(module, positional, keywords):
            if module.training:
                seen.append({key: keywords[key].clone() for key in ("input_ids", "labels")})

        model.register_forward_pre_hook(record, with_kwargs=True)


@pytest.mark.slow
def test_every_model_trains_on_the_same_batches_with_passkey_documents_and_their_labels(tmp_path, template):
    """Issue 45's question: did each arm's model actually see the passkey documents, with labels on the copied key?"""
    models = ["alibi", "nope", "rotary", "learned", "sinusoidal"]
    argv = ["--config", "retrieval_smoke", "--output_dir", str(tmp_path), "--models", *models]
    experiment, training = parse_args([*argv, "--eval_arms", *models, "--eval_factors", "1"], ExperimentArguments)
    recorder = BatchRecorder()
    run_retrieval(experiment, training, callbacks=[recorder])
    assert sorted(recorder.batches) == sorted(models)
    reference = recorder.batches["alibi"]
    assert len(reference) == training.max_steps
    needle, question = list(template.needle_head), list(template.question)

    def holds(row, piece):
        return any(row[i : i + len(piece)] == piece for i in range(len(row) - len(piece) + 1))

    passkey_rows = 0
    for batch in reference:
        for ids, labels in zip(batch["input_ids"].tolist(), batch["labels"].tolist()):
            if holds(ids, needle) and holds(ids, question):
                passkey_rows += 1
                key = ids[-template.digits :]  # the answer: the document's last digits, copied from the needle
                assert holds(ids[: -template.digits - len(question)], key) and labels == ids  # loss on every token
    assert passkey_rows > 0
    for model in models:  # one dataset, one seed: the very same rows in the very same order for every model
        assert len(recorder.batches[model]) == len(reference), model
        for mine, theirs in zip(recorder.batches[model], reference):
            assert torch.equal(mine["input_ids"], theirs["input_ids"]) and torch.equal(mine["labels"], theirs["labels"])


def test_a_passkey_share_of_one_trains_on_passkey_documents_alone_and_more_is_refused(template):
    blocks = Dataset.from_dict({"input_ids": [[7] * 64] * 10, "labels": [[7] * 64] * 10})
    alone = with_passkeys(blocks, template, 64, share=1.0, seed=0)
    needle = list(template.needle_head)
    assert len(alone) == 10 and all(any(row[i : i + 10] == needle for i in range(54)) for row in alone["input_ids"])
    with pytest.raises(ValueError, match=r"passkey_share must be in \[0, 1\], got 1.5"):
        parse_args(["--config", "retrieval_smoke", "--passkey_share", "1.5"], ExperimentArguments)
