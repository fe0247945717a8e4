"""The copy's learning curve (hf_alibi.experiments.retrieval.copy_curve): its metrics on models whose answers are known, and the
callback's points through a Trainer run and a resumed one."""

import json
import math

import pytest
import torch
from datasets import Dataset
from transformers import Trainer, TrainingArguments

from hf_alibi.experiments.data.tokenization import train_tokenizer
from hf_alibi.experiments.retrieval.copy_curve import (
    CURVE_FILE,
    CopyCurve,
    copy_attention,
    copy_metrics,
    first_step_at,
    read_curve,
)
from hf_alibi.experiments.retrieval.passkey import PasskeyTemplate, probe_examples
from hf_alibi.experiments.setup.baselines import build_model

VOCAB = 257


@pytest.fixture(scope="module")
def examples():
    template = PasskeyTemplate.from_tokenizer(train_tokenizer(["abc"], vocab_size=VOCAB))
    stream = torch.arange(200) % 7 + 100  # filler holding no digit
    return probe_examples(stream, template, 48, depths=[0.0, 0.5, 1.0], samples=5, seed=0)


class DigitGuesser(torch.nn.Module):
    """Uniform over the ten digits everywhere; with `copies`, sure of the key's digit at each answer position."""

    def __init__(self, examples, copies: bool):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(()))  # a device to report
        self.examples, self.copies = examples, copies
        self.digit_ids = sorted({t for e in examples for t in e.input_ids[e.answer_position :]})

    def forward(self, input_ids, use_cache=False):
        logits = torch.full((*input_ids.shape, VOCAB), -30.0)  # (B, L, V)
        logits[..., self.digit_ids] = 0.0
        for row, ids in enumerate(input_ids.tolist()):
            example = next(e for e in self.examples if list(e.input_ids[: len(ids)]) == ids)
            if self.copies:
                for k, token in enumerate(example.input_ids[example.answer_position :]):
                    logits[row, example.answer_position - 1 + k, token] = 30.0
        return type("Output", (), {"logits": logits})()


def test_a_model_that_copies_has_exact_match_and_no_loss_on_the_copy_but_chance_on_the_needle(examples):
    metrics = copy_metrics(DigitGuesser(examples, copies=True), examples, batch_size=4)
    assert metrics["exact"] == 1.0 and metrics["per_digit"] == 1.0 and metrics["n"] == len(examples)
    assert metrics["copy_loss"] < 1e-9
    assert metrics["needle_loss"] == pytest.approx(math.log(10), rel=1e-6)  # random digits: ln 10 is the floor


def test_a_model_that_only_knows_a_digit_comes_sits_at_ln_10_on_both(examples):
    metrics = copy_metrics(DigitGuesser(examples, copies=False), examples, batch_size=4)
    assert metrics["exact"] == 0.0
    assert metrics["copy_loss"] == pytest.approx(math.log(10), rel=1e-6)
    assert metrics["needle_loss"] == pytest.approx(math.log(10), rel=1e-6)


def test_examples_of_mixed_lengths_or_none_are_refused(examples):
    model = DigitGuesser(examples, copies=True)
    with pytest.raises(ValueError, match="at least one"):
        copy_metrics(model, [])
    shorter = probe_examples(
        torch.arange(200) % 7 + 100,
        PasskeyTemplate.from_tokenizer(train_tokenizer(["abc"], vocab_size=VOCAB)),
        40,
        depths=[0.0],
        samples=1,
        seed=0,
    )
    with pytest.raises(ValueError, match="one length"):
        copy_metrics(model, [examples[0], shorter[0]])


@pytest.mark.parametrize("every", [0, -3, 2.5, True])
def test_the_step_interval_must_be_a_positive_integer(examples, every):
    with pytest.raises(ValueError, match="positive integer"):
        CopyCurve(examples, every)


def test_first_step_at_names_the_first_point_at_the_accuracy():
    curve = [{"step": 10, "exact": 0.2}, {"step": 20, "exact": 0.95}, {"step": 30, "exact": 0.8}]
    assert first_step_at(curve) == 20 and first_step_at(curve, 0.99) is None


def test_the_callback_records_every_interval_and_the_last_step_and_a_resumed_run_goes_on(tmp_path, examples):
    model = build_model("alibi", vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, train_length=48, max_length=48)
    blocks = Dataset.from_dict({"input_ids": [list(e.input_ids) for e in examples]})
    blocks = blocks.map(lambda row: {"labels": row["input_ids"]})

    def train(max_steps, resume):
        args = TrainingArguments(
            output_dir=str(tmp_path),
            max_steps=max_steps,
            per_device_train_batch_size=4,
            save_steps=4,
            learning_rate=1e-3,
            use_cpu=True,
            report_to="none",
            logging_steps=1,
            seed=0,
        )
        trainer = Trainer(model=model, args=args, train_dataset=blocks, callbacks=[CopyCurve(examples, every=3)])
        trainer.train(resume_from_checkpoint=resume)

    train(5, None)
    curve = read_curve(tmp_path / CURVE_FILE)
    assert [point["step"] for point in curve] == [3, 5]  # every 3 steps, and the last
    assert curve[0]["learning_rate"] > curve[1]["learning_rate"] >= 0  # linear decay, read as Trainer logs it
    assert json.loads((tmp_path / CURVE_FILE).read_text()) == curve
    train(7, str(tmp_path / "checkpoint-4"))  # resumed past step 3: the step-5 point is dropped and measured again
    assert [point["step"] for point in read_curve(tmp_path / CURVE_FILE)] == [3, 6, 7]


@pytest.mark.parametrize("encoding", ["alibi", "learned"])
def test_copy_attention_reads_each_answer_query_s_weight_on_the_needle_digit_it_copies(examples, encoding):
    model = build_model(encoding, vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, train_length=48, max_length=48)
    model.set_attn_implementation("eager")
    scores = copy_attention(model.eval(), examples, batch_size=4)
    with torch.no_grad():  # the same weights read one example, one digit at a time
        expected = torch.zeros(2, 2)
        for e in examples:
            attentions = model(input_ids=torch.tensor([e.input_ids[:-1]]), output_attentions=True).attentions
            for k in range(len(e.key)):
                for layer, weights in enumerate(attentions):  # (1, heads, L, L)
                    expected[layer] += weights[0, :, e.answer_position - 1 + k, e.needle_position + k]
    expected /= len(examples) * len(examples[0].key)
    assert torch.tensor(scores) == pytest.approx(expected, abs=1e-6)
