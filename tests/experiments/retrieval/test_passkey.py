"""The passkey probe (hf_alibi.experiments.retrieval.passkey): where the needle goes, determinism by seed, the key never in the
filler, the scorer against real greedy decoding, and the Wilson interval and its sample size."""

import random

import pytest
import torch

from hf_alibi.experiments.data.tokenization import train_tokenizer
from hf_alibi.experiments.retrieval.passkey import (
    PasskeyTemplate,
    filler_stream,
    key_ids,
    make_example,
    passkey_blocks,
    probe_examples,
    samples_for_half_width,
    score_examples,
    wilson_interval,
)
from hf_alibi.experiments.setup.baselines import build_model


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(["def f(x):\n    return x + 1\n"], vocab_size=257)  # bytes only: one token a byte


@pytest.fixture(scope="module")
def template(tokenizer):
    return PasskeyTemplate.from_tokenizer(tokenizer)


def digit_rich_stream(tokenizer, size=20_000, seed=0) -> torch.Tensor:
    """Filler full of digits (every 5-digit string is likely somewhere in it), documents joined by EOS."""
    rng = random.Random(seed)
    docs = [" ".join(str(rng.randrange(10**6)) for _ in range(200)) for _ in range(size // 1400 + 1)]
    ids = [torch.tensor(tokenizer(doc, add_special_tokens=False)["input_ids"]) for doc in docs]
    return filler_stream(ids, tokenizer.eos_token_id)


def occurrences(ids, pattern) -> list[int]:
    n = len(pattern)
    return [i for i in range(len(ids) - n + 1) if tuple(ids[i : i + n]) == tuple(pattern)]


def test_example_text_reads_as_the_template_with_the_key_twice(tokenizer, template):
    filler = tokenizer("x = 1\n" * 40, add_special_tokens=False)["input_ids"]
    example = make_example(filler, template, 200, 0.5, random.Random(0))
    text = tokenizer.decode(example.input_ids)
    assert len(example.input_ids) == 200
    assert f"\npass key {example.key}.\n" in text
    assert text.endswith(f"\npass key {example.key}")
    assert text.count("pass key") == 2
    assert example.answer_position == 200 - template.digits


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 1.0])
def test_the_needle_sits_after_depth_of_the_filler(tokenizer, template, depth):
    length = 400
    stream = digit_rich_stream(tokenizer)
    example = probe_examples(stream, template, length, [depth], samples=1, seed=3)[0]
    filler_tokens = length - template.overhead
    before = example.needle_position - len(template.needle_head)  # filler tokens before the needle
    assert before == round(depth * filler_tokens)
    assert example.input_ids[before : example.needle_position] == template.needle_head
    assert example.input_ids[example.needle_position : example.needle_position + 5] == key_ids(template, example.key)
    if depth == 1.0:  # right before the question
        tail = example.needle_position + template.digits + len(template.needle_tail)
        assert example.input_ids[tail : tail + len(template.question)] == template.question


def test_the_key_occurs_only_in_the_needle_and_the_answer_even_in_digit_rich_filler(tokenizer, template):
    stream = digit_rich_stream(tokenizer)
    examples = probe_examples(stream, template, 1024, [0.0, 0.5, 1.0], samples=20, seed=0)
    redrawn = 0
    for example in examples:
        digits = key_ids(template, example.key)
        assert occurrences(example.input_ids, digits) == [example.needle_position, example.answer_position]
        window = example.input_ids[: example.needle_position - len(template.needle_head)]
        redrawn += any(tuple(window[i : i + 4]) == digits[:4] for i in range(len(window) - 3))
    assert redrawn, "the filler should hold near misses, or this test proves nothing about the redraw"


def test_examples_are_deterministic_in_the_seed_and_share_windows_across_depths(tokenizer, template):
    stream = digit_rich_stream(tokenizer)
    first = probe_examples(stream, template, 300, [0.0, 1.0], samples=5, seed=7)
    assert first == probe_examples(stream, template, 300, [0.0, 1.0], samples=5, seed=7)
    assert first != probe_examples(stream, template, 300, [0.0, 1.0], samples=5, seed=8)
    shallow, deep = first[:5], first[5:]
    for a, b in zip(shallow, deep):  # the same filler at both depths, the needle moved
        assert (a.depth, b.depth) == (0.0, 1.0) and a.needle_position < b.needle_position
        assert filler_of(a, template) == filler_of(b, template)


def filler_of(example, template) -> tuple:
    """The example's ids without its needle and its question + answer."""
    start = example.needle_position - len(template.needle_head)
    end = example.needle_position + template.digits + len(template.needle_tail)
    ids = example.input_ids[: example.answer_position - len(template.question)]
    return ids[:start] + ids[end:]


def test_training_blocks_fit_the_length_with_depths_spread(tokenizer, template):
    filler = [tokenizer("abc def\n" * 30, add_special_tokens=False)["input_ids"]] * 200
    blocks = passkey_blocks(filler, template, 128, seed=0)
    assert {len(block) for block in blocks} == {128}
    heads = [occurrences(block, template.needle_head)[0] for block in blocks]
    assert min(heads) < 5 and max(heads) > 128 - template.overhead - 5  # near depth 0 and near depth 1


def test_an_example_shorter_than_the_template_is_refused_by_name(template, tokenizer):
    with pytest.raises(ValueError, match="shorter than the passkey template"):
        make_example([1] * 100, template, template.overhead - 1, 0.5, random.Random(0))
    with pytest.raises(ValueError, match="depth"):
        make_example([1] * 100, template, 120, 1.5, random.Random(0))


def test_scorer_equals_greedy_generate_right_wrong_and_wrong_late(tokenizer, template):
    """One teacher-forced forward gives exactly generate()'s greedy exact match (checked on a tiny ALiBi model):
    answers set to the model's own greedy continuation score True, the same with its last token changed False."""
    torch.manual_seed(0)
    model = build_model(
        "alibi",
        vocab_size=257,
        n_embd=32,
        n_layer=2,
        n_head=4,
        train_length=128,
        max_length=256,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    ).eval()
    examples = probe_examples(digit_rich_stream(tokenizer), template, 128, [0.0, 1.0], samples=6, seed=1)
    rebuilt, expected = [], []
    for index, example in enumerate(examples):
        prompt = list(example.input_ids[: example.answer_position])
        greedy = model.generate(
            torch.tensor([prompt]), max_new_tokens=template.digits, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
        answer = {0: greedy, 1: greedy[:-1] + [(greedy[-1] + 1) % 257]}.get(index % 3, list(example.input_ids[-5:]))
        rebuilt.append(
            type(example)(
                tuple(prompt + answer), example.key, example.depth, example.needle_position, example.answer_position
            )
        )
        expected.append(answer == greedy)
    assert expected.count(True) >= 4 and expected.count(False) >= 4
    assert score_examples(model, rebuilt, batch_size=4) == expected


def test_wilson_interval_matches_its_closed_form_and_the_sample_size_rule():
    low, high = wilson_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(0.27753, abs=1e-5)  # 1.96^2 / (10 + 1.96^2)
    low, high = wilson_interval(50, 100)
    assert (low, high) == (pytest.approx(0.40383, abs=1e-5), pytest.approx(0.59617, abs=1e-5))
    n = samples_for_half_width(0.10)
    assert n == 93
    widest = max(wilson_interval(k, n)[1] - wilson_interval(k, n)[0] for k in range(n + 1))
    tighter_than_n = max(wilson_interval(k, n - 1)[1] - wilson_interval(k, n - 1)[0] for k in range(n))
    assert widest < 0.20 <= tighter_than_n
