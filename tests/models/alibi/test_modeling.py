"""Model behaviour against references: GPT-2's parameter layout, padded vs alone, cached vs full, losses, heads."""

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoModel,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    GPT2Config,
    GPT2ForQuestionAnswering,
    GPT2ForSequenceClassification,
    GPT2ForTokenClassification,
    GPT2LMHeadModel,
    GPT2Model,
)

from conftest import PAD, tiny_config_kwargs
from hf_alibi import (
    AlibiGPT2Config,
    AlibiGPT2ForQuestionAnswering,
    AlibiGPT2ForSequenceClassification,
    AlibiGPT2ForTokenClassification,
    AlibiGPT2LMHeadModel,
    AlibiGPT2Model,
)
from hf_alibi.models.alibi.transformers_compat import output_cache

PAIRS = [
    (AlibiGPT2LMHeadModel, GPT2LMHeadModel),
    (AlibiGPT2Model, GPT2Model),
    (AlibiGPT2ForSequenceClassification, GPT2ForSequenceClassification),
    (AlibiGPT2ForTokenClassification, GPT2ForTokenClassification),
    (AlibiGPT2ForQuestionAnswering, GPT2ForQuestionAnswering),
]


@pytest.mark.parametrize("ours, gpt2", PAIRS, ids=[gpt2.__name__ for _, gpt2 in PAIRS])
def test_parameter_names_and_shapes_equal_gpt2_minus_wpe(ours, gpt2):
    kwargs = tiny_config_kwargs(num_labels=3)
    expected = {k: tuple(v.shape) for k, v in gpt2(GPT2Config(**kwargs)).state_dict().items() if "wpe" not in k}
    actual = {k: tuple(v.shape) for k, v in ours(AlibiGPT2Config(**kwargs)).state_dict().items()}
    assert actual == expected, f"only ours: {set(actual) - set(expected)}; only GPT-2: {set(expected) - set(actual)}"


def test_runs_at_16x_n_positions_with_finite_logits(tiny_model, random_ids):
    length = 16 * tiny_model.config.n_positions
    with torch.no_grad():
        logits = tiny_model(random_ids(1, length)).logits
    assert logits.shape == (1, length, tiny_model.config.vocab_size)
    assert torch.isfinite(logits).all()


def pad_batch(sequences, side):
    """Stack 1-D id tensors into a (B, L) batch padded with PAD on `side`, and its 0/1 attention mask."""
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), PAD)
    mask = torch.zeros(len(sequences), length, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        span = slice(length - len(sequence), length) if side == "left" else slice(0, len(sequence))
        ids[row, span], mask[row, span] = sequence, 1
    return ids, mask


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flex_attention"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_gives_each_sequences_own_logits(backend, side, make_model, random_ids):
    model = make_model(backend)
    sequences = [random_ids(1, n)[0] for n in (23, 14, 5)]
    ids, mask = pad_batch(sequences, side)
    with torch.no_grad():
        batched = model(ids, attention_mask=mask).logits
        for row, sequence in enumerate(sequences):
            alone = model(sequence[None]).logits[0]
            torch.testing.assert_close(batched[row][mask[row].bool()], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flex_attention"])
@pytest.mark.parametrize("steps", [[1] * 15, [7, 8]], ids=["one_token_at_a_time", "multi_token_chunks"])
def test_cached_decoding_gives_the_full_forward_logits(backend, steps, make_model, random_ids):
    model = make_model(backend)
    ids = random_ids(2, 10 + sum(steps))  # runs past n_positions (16)
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :10], use_cache=True)
        pieces, start = [out.logits], 10
        for step in steps:
            out = model(ids[:, start : start + step], cache=output_cache(out))
            pieces.append(out.logits)
            start += step
    assert output_cache(out).get_seq_length() == ids.shape[1]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=0)


def test_cached_decoding_of_a_left_padded_batch_gives_the_full_forward_logits(tiny_model, random_ids):
    ids, mask = pad_batch([random_ids(1, n)[0] for n in (20, 9)], "left")
    with torch.no_grad():
        full = tiny_model(ids, attention_mask=mask).logits
        out = tiny_model(ids[:, :12], attention_mask=mask[:, :12], use_cache=True)
        pieces = [out.logits]
        for t in range(12, 20):
            out = tiny_model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=output_cache(out))
            pieces.append(out.logits)
    real = mask.bool()
    torch.testing.assert_close(torch.cat(pieces, dim=1)[real], full[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_output_attentions_are_causal_softmax_weights_and_leave_logits_alone(backend, make_model, random_ids):
    model = make_model(backend)
    ids = random_ids(2, 13)
    with torch.no_grad():
        plain = model(ids, use_cache=True)
        out = model(ids, output_attentions=True)
        step = model(random_ids(2, 3), cache=output_cache(plain), output_attentions=True)  # 3 queries over 16 keys
    torch.testing.assert_close(out.logits, plain.logits, atol=1e-5, rtol=0)
    heads = model.config.n_head
    for attentions, q, kv in ((out.attentions, 13, 13), (step.attentions, 3, 16)):
        assert len(attentions) == model.config.n_layer
        for weights in attentions:
            assert weights.shape == (2, heads, q, kv)
            row_sums = weights.sum(-1)
            assert (row_sums - 1).abs().max() < 1e-5, f"rows sum to {row_sums.min()}..{row_sums.max()}"
            future = torch.ones(q, kv, dtype=torch.bool).triu(kv - q + 1)  # keys after each query
            assert weights[..., future].abs().max() == 0, "attention to future keys"


def test_output_hidden_states_gives_n_layer_plus_one_states(tiny_model, random_ids):
    out = tiny_model.transformer(random_ids(2, 9), output_hidden_states=True)
    assert len(out.hidden_states) == tiny_model.config.n_layer + 1
    assert all(h.shape == (2, 9, tiny_model.config.n_embd) for h in out.hidden_states)
    torch.testing.assert_close(out.hidden_states[-1], out.last_hidden_state, atol=0, rtol=0)


def test_return_dict_false_returns_tuples(tiny_model, random_ids):
    ids = random_ids(2, 9)
    as_dict = tiny_model(ids, labels=ids)
    as_tuple = tiny_model(ids, labels=ids, return_dict=False)
    assert isinstance(as_tuple, tuple)
    torch.testing.assert_close(as_tuple[0], as_dict.loss)
    torch.testing.assert_close(as_tuple[1], as_dict.logits)
    base = tiny_model.transformer(ids, return_dict=False)
    assert isinstance(base, tuple)
    torch.testing.assert_close(base[0], tiny_model.transformer(ids).last_hidden_state)


def test_bf16_autocast_forward_is_close_to_fp32(tiny_model, random_ids):
    ids = random_ids(2, 40)
    with torch.no_grad():
        expected = tiny_model(ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = tiny_model(ids).logits
    assert torch.isfinite(logits).all()
    # bf16 keeps 8 mantissa bits; logits here reach ~1
    torch.testing.assert_close(logits.float(), expected, atol=3e-2, rtol=0)


def test_labels_give_mean_token_loss_and_num_items_in_batch_gives_sum_over_items(tiny_model, random_ids):
    ids = random_ids(2, 12)
    labels = ids.clone()
    labels[1, :5] = -100
    out = tiny_model(ids, labels=labels)
    # the model shifts internally: logits at t predict labels at t + 1
    token_losses = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="none")
    real = labels[:, 1:].flatten() != -100
    torch.testing.assert_close(out.loss, token_losses[real].mean())
    summed = tiny_model(ids, labels=labels, num_items_in_batch=torch.tensor(50)).loss
    torch.testing.assert_close(summed, token_losses[real].sum() / 50)


def test_gradient_checkpointing_gives_the_same_gradients(make_model, random_ids):
    ids = random_ids(2, 20)
    gradients = []
    for checkpointing in (False, True):
        model = make_model("eager").train()
        if checkpointing:
            # transformers 5.23 renamed gradient_checkpointing_enable (the old name warns from then on)
            (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        model(ids, labels=ids).loss.backward()  # use_cache stays at its default (True): the replay must not reuse it
        gradients.append({name: p.grad for name, p in model.named_parameters()})
    for name, expected in gradients[0].items():
        torch.testing.assert_close(
            gradients[1][name], expected, atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )


HEADS = [
    (AutoModelForSequenceClassification, AlibiGPT2ForSequenceClassification, "logits", (2, 3)),
    (AutoModelForTokenClassification, AlibiGPT2ForTokenClassification, "logits", (2, 9, 3)),
    (AutoModelForQuestionAnswering, AlibiGPT2ForQuestionAnswering, "start_logits", (2, 9)),
]


@pytest.mark.parametrize("auto, expected_class, field, shape", HEADS, ids=[h[1].__name__ for h in HEADS])
def test_task_head_builds_through_auto_class_and_returns_a_scalar_loss(auto, expected_class, field, shape, make_config):
    model = auto.from_config(make_config(num_labels=3))
    assert type(model) is expected_class
    ids = torch.randint(3, 256, (2, 9))
    if expected_class is AlibiGPT2ForQuestionAnswering:
        out = model(ids, start_positions=torch.tensor([1, 4]), end_positions=torch.tensor([2, 8]))
    elif expected_class is AlibiGPT2ForTokenClassification:
        out = model(ids, labels=torch.randint(0, 3, (2, 9)))
    else:
        out = model(ids, labels=torch.tensor([0, 2]))
    assert getattr(out, field).shape == shape
    assert out.loss.shape == () and torch.isfinite(out.loss)
    out.loss.backward()


def test_auto_model_builds_the_base_model(make_config, random_ids):
    model = AutoModel.from_config(make_config())
    assert type(model) is AlibiGPT2Model
    assert model(random_ids(2, 9)).last_hidden_state.shape == (2, 9, 96)


@pytest.mark.parametrize("side", ["left", "right"])
def test_sequence_classification_pools_the_last_real_token(side, make_config, random_ids):
    model = AutoModelForSequenceClassification.from_config(make_config(num_labels=3)).eval()
    sequences = [random_ids(1, n)[0] for n in (11, 6)]
    ids, mask = pad_batch(sequences, side)
    with torch.no_grad():
        batched = model(ids, attention_mask=mask).logits
        alone = torch.cat([model(s[None]).logits for s in sequences])
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=0)
