"""Jais (both config generations) and BTLM -> ALiBi GPT-2 is exact: the float64 reference of what their code computes
(`jais_checkpoints.their_logits`), left-padded and cached, past their `n_positions` cap; what it cannot hold is
refused by name; their tokenizer files come through unchanged."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from family_checks import left_padded_batch
from hf_alibi import AlibiGPT2LMHeadModel, convert, get_alibi_slopes
from hf_alibi.cli import run
from hf_alibi.conversion import convert_cerebras
from hf_alibi.models.alibi.transformers_compat import output_cache
from jais_checkpoints import (
    GENERATIONS,
    N_POSITIONS,
    VOCAB,
    byte_level_tokenizer,
    paper_slopes,
    save_source,
    their_logits,
    tiny_checkpoint,
)

ATOL = 2e-5  # fp32 against float64, logits of order 10; measured up to 4e-6
BACKENDS = ("eager", "sdpa", "flex_attention")


def assert_matches_their_code(model, checkpoint, backend: str, length: int = 14) -> None:
    """Full forward and cached decoding of a left-padded batch: ours (on `backend`) == theirs at every real token."""
    model.set_attn_implementation(backend)
    ids, mask = left_padded_batch(length)
    expected = their_logits(checkpoint, ids, mask)  # (B, L, V), float64
    cached = their_logits(checkpoint, ids, mask, forward_lengths=[8] + [1] * (length - 8))  # their cached run
    with torch.no_grad():
        got = model(ids, attention_mask=mask).logits
        out = model(ids[:, :8], attention_mask=mask[:, :8], use_cache=True)
        steps = []
        for step in range(8, length):
            out = model(
                ids[:, step : step + 1], attention_mask=mask[:, : step + 1], cache=output_cache(out), use_cache=True
            )
            steps.append(out.logits[:, -1])
    error = (got.double() - expected)[mask.bool()].abs().max().item()
    assert error < ATOL, f"{backend}: full forward differs from their code's by {error:.2e}"
    error = (torch.stack(steps, 1).double() - cached[:, 8:]).abs().max().item()
    assert error < ATOL, f"{backend}: cached decoding differs from their code's by {error:.2e}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("generation", sorted(GENERATIONS))
def test_imported_checkpoint_matches_their_code_padded_and_cached(tmp_path, generation, backend):
    checkpoint = tiny_checkpoint(generation)
    save_source(checkpoint, tmp_path / "source", shards=2 if generation == "jais_13b" else 1)  # jais-13b ships .bin
    assert_matches_their_code(convert(str(tmp_path / "source")), checkpoint, backend)


def test_import_sets_the_switches_their_keys_name():
    switches = ("gated_mlp", "activation_function", "attn_scale_power", "embedding_scale", "logit_scale")
    got = {
        generation: tuple(getattr(convert_cerebras(tiny_checkpoint(generation)).config, name) for name in switches)
        for generation in GENERATIONS
    }
    assert got == {
        "jais_13b": (True, "silu", 1.0, 14.6, 0.111),
        "jais_family": (True, "silu", 1.0, 9.17, 1.1 * 0.25),
        "btlm": (True, "silu", 1.0, 14.6, 2.22 * 0.1),  # mup_output_alpha * mup_width_scale: 0.222, not 0.1
    }


def test_imported_model_runs_past_their_n_positions_cap():
    checkpoint = tiny_checkpoint("btlm")
    model = convert_cerebras(checkpoint)
    ids = torch.randint(3, VOCAB, (1, 3 * N_POSITIONS))  # their tril(ones(n_positions)) mask buffer stops at 32
    with torch.no_grad():
        got = model(ids).logits
    error = (got.double() - their_logits(checkpoint, ids)).abs().max().item()
    assert error < ATOL, f"at {ids.shape[1]} tokens the import differs from the reference by {error:.2e}"


def test_their_slopes_parameter_is_what_is_used_and_equals_the_papers_rule():
    checkpoint = tiny_checkpoint("jais_family")
    torch.testing.assert_close(torch.tensor(paper_slopes(6)), get_alibi_slopes(6), atol=0, rtol=0)
    checkpoint.state_dict["transformer.relative_pe.slopes"] *= 1.5  # their code loads the stored values: so do we
    model = convert_cerebras(checkpoint)
    torch.testing.assert_close(model.transformer.alibi_slopes, 1.5 * get_alibi_slopes(6), atol=0, rtol=0)
    assert_matches_their_code(model, checkpoint, "sdpa")


def test_static_alibi_scaling_divides_the_slopes():
    checkpoint = tiny_checkpoint("jais_family", alibi_scaling={"type": "linear", "factor": 4.0})
    model = convert_cerebras(checkpoint)
    assert model.config.alibi_scaling == {"type": "linear", "factor": 4.0}
    torch.testing.assert_close(model.transformer.alibi_slopes, get_alibi_slopes(6) / 4, atol=0, rtol=0)
    assert_matches_their_code(model, checkpoint, "sdpa")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("generation", ["jais_family", "btlm"])
def test_length_dependent_alibi_scaling_imports_and_matches_their_code_past_train_seq_len(generation, backend):
    """`{"type": "linear", "train_seq_len": 6}`: prefill at K = 14 and every cached step at its own K, as theirs."""
    scaling = {"type": "linear", "train_seq_len": 6}
    checkpoint = tiny_checkpoint(generation, alibi_scaling=scaling)
    model = convert_cerebras(checkpoint)
    assert model.config.alibi_scaling == scaling
    torch.testing.assert_close(model.transformer.alibi_slopes, get_alibi_slopes(6), atol=0, rtol=0)
    assert_matches_their_code(model, checkpoint, backend)
    ids, mask = left_padded_batch(14)
    unscaled = their_logits(tiny_checkpoint(generation), ids, mask)
    assert (unscaled - their_logits(checkpoint, ids, mask))[mask.bool()].abs().max() > 100 * ATOL, "cannot tell"


def test_plain_gelu_jais_imports_without_a_gate():
    checkpoint = tiny_checkpoint("jais_family", activation_function="gelu_new")
    model = convert_cerebras(checkpoint)
    assert not model.config.gated_mlp and "transformer.h.0.mlp.c_fc2.weight" not in model.state_dict()
    assert_matches_their_code(model, checkpoint, "sdpa")


def test_bf16_checkpoint_imports_in_bf16_bit_for_bit():
    checkpoint = tiny_checkpoint("btlm")
    checkpoint = checkpoint._replace(
        state_dict={k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in checkpoint.state_dict.items()}
    )
    model = convert_cerebras(checkpoint)
    assert model.dtype == torch.bfloat16 and model.transformer.alibi_slopes.dtype == torch.float32
    state = model.state_dict()
    for name, tensor in checkpoint.state_dict.items():
        if name in state:
            assert torch.equal(state[name], tensor), name


def refusal(name, generation="jais_family", **overrides):
    return pytest.param(generation, overrides, name, id=name.split(".")[0] if "=" not in name else name)


@pytest.mark.parametrize(
    "generation, overrides, named",
    [
        refusal("position_embedding_type", position_embedding_type="learned"),
        refusal("activation_function", activation_function="geglu"),
        refusal("scale_attn_by_inverse_layer_idx", scale_attn_by_inverse_layer_idx=True),
        refusal("add_cross_attention", add_cross_attention=True),
        refusal("alibi_scaling.type", alibi_scaling={"type": "dynamic", "factor": 2.0}),
        refusal("alibi_scaling.train_seq_len", alibi_scaling={"type": "linear", "train_seq_len": 0}),
        refusal(
            "alibi_scaling", "jais_13b", alibi_scaling={"type": "linear", "factor": 2.0}
        ),  # jais-13b's code ignores it
        refusal("width_scale", "jais_13b", mup_output_alpha=1.0, mup_width_scale=0.5),  # the generations disagree
        refusal("output_logits_scale", "btlm", output_logits_scale=0.1),  # not what BTLM's code multiplies by
    ],
)
def test_what_their_code_does_that_ours_cannot_is_refused_by_name(generation, overrides, named):
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        convert_cerebras(tiny_checkpoint(generation, **overrides))


def test_checkpoint_defects_are_refused_by_name():
    checkpoint = tiny_checkpoint("btlm")
    checkpoint.state_dict["transformer.relative_pe.slopes"] = torch.ones(5, 1)
    with pytest.raises(ValueError, match=r"relative_pe\.slopes has shape \(5, 1\)"):
        convert_cerebras(checkpoint)
    checkpoint = tiny_checkpoint("btlm")
    checkpoint.state_dict["lm_head.weight"] = checkpoint.state_dict["transformer.wte.weight"] + 1
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        convert_cerebras(checkpoint)
    checkpoint = tiny_checkpoint("btlm")
    checkpoint.state_dict["transformer.ln_f.bias"] = checkpoint.state_dict["transformer.ln_f.bias"].half()
    with pytest.raises(ValueError, match=r"mixes weight dtypes \['torch.float16', 'torch.float32'\]"):
        convert_cerebras(checkpoint)
    checkpoint = tiny_checkpoint("btlm")
    checkpoint.state_dict["transformer.h.0.attn.rotary.inv_freq"] = torch.ones(4)
    with pytest.raises(ValueError, match="unused.*rotary"):
        convert_cerebras(checkpoint)


def test_cli_convert_writes_an_exact_folder_with_their_tokenizer_files_unchanged(tmp_path, capsys):
    checkpoint = tiny_checkpoint("jais_13b")
    save_source(checkpoint, tmp_path / "source")
    byte_level_tokenizer().save_pretrained(tmp_path / "source")
    (tmp_path / "source" / "generation_config.json").write_text(json.dumps({"max_new_tokens": 7, "eos_token_id": 0}))
    run(["convert", str(tmp_path / "source"), str(tmp_path / "alibi")])
    assert "exact import of the jais model" in capsys.readouterr().out
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "alibi" / name).read_bytes() == (tmp_path / "source" / name).read_bytes(), name
    text = "مرحبا hello"
    ids = AutoTokenizer.from_pretrained(tmp_path / "alibi")(text)["input_ids"]
    assert ids == AutoTokenizer.from_pretrained(tmp_path / "source")(text)["input_ids"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "alibi").eval()
    assert type(loaded) is AlibiGPT2LMHeadModel and loaded.generation_config.max_new_tokens == 7
    assert_matches_their_code(loaded, checkpoint, "sdpa")
