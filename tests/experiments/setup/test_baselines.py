"""The position-encoding baselines (hf_alibi.experiments.setup.baselines): shapes, fixed tables, training, loading."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2LMHeadModel, GPTNeoXForCausalLM, Trainer, TrainingArguments

from hf_alibi.experiments.setup.baselines import (
    BASELINES,
    build_model,
    freeze_sinusoidal_table,
    max_supported_length,
    restore_position_encoding,
    sinusoidal_table,
)
from hf_alibi.models.alibi.modeling_alibi_gpt2 import AlibiGPT2LMHeadModel

TRAIN, MAX = 16, 64
TINY = dict(vocab_size=97, n_embd=32, n_layer=2, n_head=4, train_length=TRAIN, max_length=MAX)
IDS = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)


def tiny(name: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(name, **{**TINY, **IDS, **overrides}).eval()


def tokens(length: int, batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, TINY["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", [name for name in BASELINES if name != "sinusoidal_paper"])  # fairseq init: below
def test_every_baseline_builds_and_gives_a_finite_loss_near_uniform(name):
    model = tiny(name)
    x = tokens(TRAIN)
    loss = model(input_ids=x, labels=x).loss
    assert torch.isfinite(loss)
    # GPT-2's small init: the first loss is close to that of a uniform guess.
    assert abs(loss.item() - math.log(TINY["vocab_size"])) < 0.5, loss.item()
    assert model.config.position_encoding == name and model.config.train_length == TRAIN


def test_unknown_baseline_error_lists_the_valid_names():
    with pytest.raises(ValueError, match=r"'xpos'.*'alibi'.*'rotary'"):
        build_model("xpos", **TINY)


def test_models_are_the_classes_each_baseline_promises():
    assert isinstance(tiny("alibi"), AlibiGPT2LMHeadModel) and tiny("alibi").config.alibi_slopes is None
    assert tiny("alibi").config.n_positions == TRAIN
    assert type(tiny("learned")) is GPT2LMHeadModel and type(tiny("sinusoidal")) is GPT2LMHeadModel
    assert type(tiny("rotary")) is GPTNeoXForCausalLM


def test_nope_has_zero_slopes_and_ignores_token_order():
    nope, alibi = tiny("nope"), tiny("alibi")
    assert nope.config.alibi_slopes == [0.0] * TINY["n_head"]
    # One layer and no position signal: the last position sees its prefix as a set, so permuting it changes nothing.
    one_nope, one_alibi = tiny("nope", n_layer=1), tiny("alibi", n_layer=1)
    x = tokens(12, batch=1)
    permuted = torch.cat([x[:, :-1].flip(1), x[:, -1:]], dim=1)
    with torch.no_grad():
        diff_nope = (one_nope(permuted).logits[:, -1] - one_nope(x).logits[:, -1]).abs().max()
        diff_alibi = (one_alibi(permuted).logits[:, -1] - one_alibi(x).logits[:, -1]).abs().max()
    assert diff_nope < 1e-5, f"NoPE changed by {diff_nope}"
    assert diff_alibi > 1e-4, f"ALiBi unchanged ({diff_alibi}): it should see order"
    assert alibi.config.alibi_slopes is None


def test_sinusoidal_table_equals_the_vaswani_formula():
    num_positions, dim = 50, 16
    expected = torch.tensor(
        [
            [(math.sin if i % 2 == 0 else math.cos)(p / 10000 ** ((i - i % 2) / dim)) for i in range(dim)]
            for p in range(num_positions)
        ]
    )
    diff = (sinusoidal_table(num_positions, dim) - expected).abs().max()
    assert diff < 1e-6, f"largest difference {diff}"
    model = tiny("sinusoidal")
    table = sinusoidal_table(MAX, TINY["n_embd"], scale=model.config.initializer_range)
    assert torch.equal(model.transformer.wpe.weight, table)


def test_sinusoidal_table_is_not_changed_by_trainer(tmp_path):
    model = tiny("sinusoidal").train()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    rows = [{"input_ids": ids, "labels": ids} for ids in tokens(TRAIN, batch=8)]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        weight_decay=0.1,
        save_strategy="no",
        logging_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert id(model.transformer.wpe.weight) not in optimized
    assert torch.equal(model.transformer.wpe.weight, before["transformer.wpe.weight"])
    assert not torch.equal(model.transformer.wte.weight, before["transformer.wte.weight"]), "nothing trained"


@pytest.mark.parametrize("name", ["learned", "sinusoidal"])
def test_position_tables_cover_max_length(name):
    model = tiny(name)
    assert model.transformer.wpe.num_embeddings == MAX == max_supported_length(model)
    x = tokens(MAX, batch=1)
    assert torch.isfinite(model(input_ids=x, labels=x).loss)


@pytest.mark.parametrize("name", ["alibi", "nope", "rotary"])
def test_models_without_a_table_run_past_max_length(name):
    model = tiny(name)
    assert max_supported_length(model) is None
    x = tokens(2 * MAX, batch=1)
    assert torch.isfinite(model(input_ids=x, labels=x).loss)


def test_rotary_is_gpt_neox_with_full_rotary_shaped_like_gpt2():
    model = tiny("rotary")
    config, layer = model.config, model.gpt_neox.layers[0]
    assert config.rope_parameters["partial_rotary_factor"] == 1.0
    assert layer.attention.rotary_ndims == TINY["n_embd"] // TINY["n_head"]
    assert config.use_parallel_residual is False and config.hidden_act == "gelu_new"
    assert config.intermediate_size == 4 * TINY["n_embd"] and config.layer_norm_eps == 1e-5
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight, "embeddings not tied"


def test_rotary_checkpoint_loads_back_with_full_rotary_and_identical_logits(tmp_path):
    """transformers 5.0-5.4 rebuild a saved GPT-NeoX config at a rotary share of 0.25 unless config.json holds
    `rotary_pct`: the checkpoint must come back as it was trained, on every release."""
    model = tiny("rotary")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.rope_parameters["partial_rotary_factor"] == 1.0
    assert loaded.gpt_neox.layers[0].attention.rotary_ndims == TINY["n_embd"] // TINY["n_head"]
    x = tokens(MAX)
    with torch.no_grad():
        diff = (loaded(x).logits - model(x).logits).abs().max()
    assert diff == 0, f"largest logit difference {diff}"


def test_parameter_counts_differ_only_by_position_tables():
    def count(model, trainable_only=False):
        return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)

    reference = count(tiny("alibi"))
    assert count(tiny("nope")) == count(tiny("rotary")) == reference
    assert count(tiny("sinusoidal"), trainable_only=True) == reference
    assert count(tiny("learned")) == reference + MAX * TINY["n_embd"]


def test_sinusoidal_checkpoint_loads_as_plain_gpt2_with_identical_logits(tmp_path):
    model = tiny("sinusoidal")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is GPT2LMHeadModel and loaded.config.position_encoding == "sinusoidal"
    assert torch.equal(loaded.transformer.wpe.weight, model.transformer.wpe.weight)
    x = tokens(MAX)
    with torch.no_grad():
        diff = (loaded(x).logits - model(x).logits).abs().max()
    assert diff == 0, f"largest logit difference {diff}"
    freeze_sinusoidal_table(loaded)  # loading turns requires_grad back on
    assert not loaded.transformer.wpe.weight.requires_grad
    assert torch.equal(loaded.transformer.wpe.weight, model.transformer.wpe.weight)


def test_sinusoidal_paper_adds_the_unscaled_table_to_sqrt_d_scaled_token_embeddings():
    model = tiny("sinusoidal_paper")
    d = TINY["n_embd"]
    wte, wpe = model.transformer.wte, model.transformer.wpe
    assert torch.equal(wpe.weight, sinusoidal_table(MAX, d)) and not wpe.weight.requires_grad
    x = tokens(TRAIN)
    diff = (wte(x) - math.sqrt(d) * wte.weight[x]).abs().max()  # the input embedding is scaled...
    assert diff < 1e-6, f"largest difference {diff}"
    assert model.lm_head.weight is wte.weight  # ...the tied output layer reads the unscaled weight
    std = wte.weight.std().item()  # fairseq's init: std d ** -0.5, so sqrt(d) * embedding has unit variance
    assert abs(std * math.sqrt(d) - 1) < 0.1, std
    loss = model(input_ids=x, labels=x).loss
    assert torch.isfinite(loss)


def test_sinusoidal_paper_checkpoint_needs_restore_to_give_identical_logits(tmp_path):
    model = tiny("sinusoidal_paper")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    x = tokens(MAX)
    with torch.no_grad():
        expected = model(x).logits
        unscaled = loaded(x).logits  # a plain GPT-2 load has no embedding multiplier
        restore_position_encoding(loaded)
        restore_position_encoding(loaded)  # idempotent: the scale is applied once
        diff = (loaded(x).logits - expected).abs().max()
    assert (unscaled - expected).abs().max() > 1e-2, "the multiplier should matter"
    assert diff == 0, f"largest logit difference {diff}"
    assert loaded.config.embedding_scale == math.sqrt(TINY["n_embd"])
