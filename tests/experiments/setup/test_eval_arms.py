"""The retrieval experiment's evaluation arms (hf_alibi.experiments.setup.eval_arms): each extension is set through the
model's own config, changes nothing where its method says so (within the training length, or at factor 1) and
changes the outputs past the training length; bad arm names are refused by name."""

import pytest
import torch

from hf_alibi.experiments.setup.baselines import build_model
from hf_alibi.experiments.setup.eval_arms import arm_model, parse_arm

TRAIN = 32
SHAPE = dict(
    vocab_size=97,
    n_embd=32,
    n_layer=2,
    n_head=4,
    train_length=TRAIN,
    max_length=8 * TRAIN,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)


def trained_like(name: str) -> torch.nn.Module:
    """A baseline with random weights large enough that positions matter in its outputs."""
    torch.manual_seed(0)
    model = build_model(name, **SHAPE)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(10.0)
    return model.eval()


def logits(model, length: int) -> torch.Tensor:
    ids = torch.randint(1, 97, (2, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(input_ids=ids).logits.double()


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "yarn"])
def test_rope_arm_is_transformers_own_rope_type_with_the_length_ratio_as_factor(rope_type):
    rotary = trained_like("rotary")
    variant = arm_model(rotary, f"rotary+{rope_type}", TRAIN, 4 * TRAIN)
    parameters = variant.config.rope_parameters
    assert parameters["rope_type"] == rope_type and parameters["factor"] == 4.0
    assert variant.gpt_neox.rotary_emb.rope_type == rope_type  # transformers' own rotary module reads it
    if rope_type == "yarn":
        assert parameters["original_max_position_embeddings"] == TRAIN
    assert rotary.config.rope_parameters["rope_type"] == "default", "the trained model must stay untouched"
    for name, weight in rotary.state_dict().items():
        assert torch.equal(variant.state_dict()[name], weight), name


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "yarn"])
def test_rope_arms_differ_from_plain_rotary_past_the_training_length(rope_type):
    rotary = trained_like("rotary")
    variant = arm_model(rotary, f"rotary+{rope_type}", TRAIN, 4 * TRAIN)
    difference = (logits(variant, 4 * TRAIN) - logits(rotary, 4 * TRAIN)).abs().max().item()
    assert difference > 1e-2, f"{rope_type} at 4x changed the logits by only {difference}"


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "yarn"])
def test_rope_arms_equal_plain_rotary_at_the_training_length(rope_type):
    """At 1x the factor is 1: linear and YaRN reduce to plain rotary; dynamic NTK never rescales up to the
    training length, whatever its factor (checked with the 4x factor too)."""
    rotary = trained_like("rotary")
    reference = logits(rotary, TRAIN)
    at_1x = arm_model(rotary, f"rotary+{rope_type}", TRAIN, TRAIN)
    torch.testing.assert_close(logits(at_1x, TRAIN), reference, rtol=0, atol=1e-5)
    if rope_type == "dynamic":
        at_4x = arm_model(rotary, "rotary+dynamic", TRAIN, 4 * TRAIN)
        torch.testing.assert_close(logits(at_4x, TRAIN), reference, rtol=0, atol=1e-5)
    else:  # a factor of 4 rescales every position: not plain rotary even within the training length
        at_4x = arm_model(rotary, f"rotary+{rope_type}", TRAIN, 4 * TRAIN)
        assert (logits(at_4x, TRAIN) - reference).abs().max() > 1e-2


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "yarn"])
def test_rope_arm_of_a_reloaded_checkpoint_equals_the_trained_models(tmp_path, rope_type):
    """The retrieval recipe evaluates the arms of checkpoints it reloads: the variant is rebuilt from the loaded
    config, whose rotary share transformers 5.0-5.4 would reset to 0.25 (a `from_dict` without `rotary_pct`)."""
    from transformers import AutoModelForCausalLM

    rotary = trained_like("rotary")
    rotary.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    expected = logits(arm_model(rotary, f"rotary+{rope_type}", TRAIN, 4 * TRAIN), 4 * TRAIN)
    assert torch.equal(logits(arm_model(reloaded, f"rotary+{rope_type}", TRAIN, 4 * TRAIN), 4 * TRAIN), expected)


def test_slope_interpolation_equals_alibi_within_the_training_length_and_widens_past_it():
    alibi = trained_like("alibi")
    variant = arm_model(alibi, "alibi+slope_interp", TRAIN, 4 * TRAIN)
    assert variant.config.alibi_scaling == {"type": "linear", "train_seq_len": TRAIN}
    torch.testing.assert_close(logits(variant, TRAIN), logits(alibi, TRAIN), rtol=0, atol=1e-5)
    assert (logits(variant, 4 * TRAIN) - logits(alibi, 4 * TRAIN)).abs().max() > 1e-2


def test_plain_arms_are_the_trained_model_itself():
    learned = trained_like("learned")
    assert arm_model(learned, "learned", TRAIN, 4 * TRAIN) is learned


@pytest.mark.parametrize(
    ("arm", "message"),
    [
        ("rotary+ntk", "unknown extension 'ntk'"),
        ("alibi+yarn", "'yarn' extends 'rotary' models, not 'alibi'"),
        ("learned+slope_interp", "extends 'alibi'"),
        ("nope", "not trained"),
    ],
)
def test_bad_arms_are_refused_by_name(arm, message):
    with pytest.raises(ValueError, match=message):
        parse_arm(arm, ["alibi", "rotary", "learned"])
