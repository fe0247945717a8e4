"""The switches Jais and BTLM need (gated MLP, attention scale power, embedding and logit multipliers, a static slope
scale) compute what the float64 reference model computes, on every backend, padded and cached, and change nothing
when left at their defaults."""

import pytest
import torch

from alibi_reference import reference_logits
from hf_alibi import AlibiGPT2LMHeadModel, get_alibi_slopes
from hf_alibi.models.alibi.modeling_alibi_gpt2 import scaled
from hf_alibi.models.alibi.transformers_compat import output_cache

ATOL = 2e-5  # fp32 against float64; measured ~2e-6
# Every switch away from its default, at values that move the logits well beyond ATOL (6 heads: interleaved slopes)
SWITCHES = dict(
    gated_mlp=True,
    activation_function="silu",
    n_inner=100,
    attn_scale_power=1.0,
    embedding_scale=3.0,
    logit_scale=0.4,
    alibi_scaling={"type": "linear", "factor": 2.0},
)
# backend -> config overrides that select it (sdpa: the split path and the bias bank)
BACKENDS = {
    "eager": {},
    "sdpa_split": {},
    "sdpa_bank": {"alibi_sdpa_split": False, "alibi_sdpa_query_chunk": 4},
    "flex_attention": {},
    "sdpa_certified_skip": {"alibi_skip_eps": 1e-7},
}


def switched_model(make_model, backend: str = "sdpa_split", **switches) -> AlibiGPT2LMHeadModel:
    implementation = "eager" if backend == "eager" else "flex_attention" if backend == "flex_attention" else "sdpa"
    model = make_model(implementation, n_head=6, n_embd=48, **switches, **BACKENDS[backend])
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():  # off the LayerNorms' 1/0 and zero biases, so every weight's place matters
            parameter.add_(0.1 * torch.randn_like(parameter))
    return model.eval()


def expected_logits(model, ids, mask=None) -> torch.Tensor:
    """The float64 reference with the model's weights and its config's switches read as the docs describe them."""
    config = model.config
    head_dim = config.n_embd // config.n_head
    factor = (config.alibi_scaling or {}).get("factor", 1.0)
    slopes = get_alibi_slopes(config.n_head).double() / factor
    return reference_logits(
        model.state_dict(),
        ids,
        n_layer=config.n_layer,
        n_head=config.n_head,
        slopes=slopes,
        attn_scale=head_dim**-config.attn_scale_power,
        activation=config.activation_function,
        gated=config.gated_mlp,
        embedding_scale=config.embedding_scale,
        logit_scale=config.logit_scale,
        eps=config.layer_norm_epsilon,
        attention_mask=mask,
    )


def padded_batch(random_ids, length: int = 13) -> tuple[torch.Tensor, torch.Tensor]:
    ids = random_ids(2, length)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    return ids, mask


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_every_switch_at_once_matches_the_float64_reference_padded_and_cached(make_model, random_ids, backend):
    model = switched_model(make_model, backend, **SWITCHES)
    ids, mask = padded_batch(random_ids)
    real = mask.bool()
    with torch.no_grad():
        got = model(ids, attention_mask=mask).logits  # (B, L, V)
        out = model(ids[:, :6], attention_mask=mask[:, :6], use_cache=True)
        steps = []
        for step in range(6, ids.shape[1]):
            out = model(
                ids[:, step : step + 1], attention_mask=mask[:, : step + 1], cache=output_cache(out), use_cache=True
            )
            steps.append(out.logits[:, -1])
    expected = expected_logits(model, ids, mask)
    error = (got.double() - expected)[real].abs().max().item()
    assert error < ATOL, f"{backend}: full forward differs from the reference by {error:.2e}"
    error = (torch.stack(steps, 1).double() - expected[:, 6:]).abs().max().item()
    assert error < ATOL, f"{backend}: cached decoding differs from the reference by {error:.2e}"


@pytest.mark.parametrize("switch", sorted(set(SWITCHES) - {"activation_function", "n_inner"}))
def test_each_switch_alone_matches_the_reference_and_moves_the_logits(make_model, random_ids, switch):
    switches = {switch: SWITCHES[switch]}
    if switch == "gated_mlp":
        switches.update(activation_function="silu", n_inner=100)
    model, plain = switched_model(make_model, **switches), switched_model(make_model)
    ids = random_ids(2, 11)
    with torch.no_grad():
        got, without = model(ids).logits, plain(ids).logits
    error = (got.double() - expected_logits(model, ids)).abs().max().item()
    assert error < ATOL, f"{switch}: differs from the reference by {error:.2e}"
    if switch != "gated_mlp":  # the same weights: only the switch differs
        assert (got - without).abs().max() > 100 * ATOL, f"{switch} did not change the logits"


def test_gated_mlp_has_its_gate_as_c_fc2_of_the_same_width(make_model):
    model = make_model(gated_mlp=True, activation_function="silu", n_inner=100)
    mlp = model.transformer.h[0].mlp
    assert mlp.c_fc.weight.shape == mlp.c_fc2.weight.shape == (96, 100) and mlp.c_proj.weight.shape == (100, 96)
    assert "transformer.h.1.mlp.c_fc2.bias" in model.state_dict()
    assert "transformer.h.0.mlp.c_fc2.weight" not in make_model().state_dict()


def test_slopes_buffer_holds_the_slopes_divided_by_the_scaling_factor(make_model, tmp_path):
    model = make_model(
        alibi_scaling={"type": "linear", "factor": 4.0}, alibi_slopes=[0.5, 0.25, 0.125, 0.0625] + [0.03] * 8
    )
    model.save_pretrained(tmp_path)
    loaded = AlibiGPT2LMHeadModel.from_pretrained(tmp_path)
    expected = torch.tensor([0.5, 0.25, 0.125, 0.0625] + [0.03] * 8) / 4.0
    torch.testing.assert_close(loaded.transformer.alibi_slopes, expected, atol=0, rtol=0)
    assert loaded.config.alibi_scaling == {"type": "linear", "factor": 4.0}


def test_multipliers_round_the_scale_to_the_activations_dtype_as_jais_does():
    x = torch.randn(5, 3).to(torch.bfloat16)
    assert torch.equal(scaled(x, 14.6), x * torch.tensor(14.625, dtype=torch.bfloat16))  # bf16(14.6) = 14.625
    assert scaled(x, 1.0) is x


def test_switches_survive_save_and_load_and_defaults_change_nothing(make_model, make_config, tmp_path, random_ids):
    defaults = make_config()
    assert (
        defaults.gated_mlp,
        defaults.attn_scale_power,
        defaults.embedding_scale,
        defaults.logit_scale,
        defaults.alibi_scaling,
    ) == (False, 0.5, 1.0, 1.0, None)
    model = switched_model(make_model, **SWITCHES)
    model.save_pretrained(tmp_path)
    loaded = AlibiGPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert {name: getattr(loaded.config, name) for name in SWITCHES} == SWITCHES
    ids = random_ids(2, 9)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=0, rtol=0)


@pytest.mark.parametrize(
    "field, value",
    [
        ("gated_mlp", 1),
        ("attn_scale_power", -0.5),
        ("attn_scale_power", float("nan")),
        ("embedding_scale", 0.0),
        ("logit_scale", -2.0),
        ("logit_scale", float("inf")),
        ("alibi_scaling_factor", 0),
        ("embedding_scale", True),
    ],
)
def test_bad_switch_values_raise_naming_field_and_value(make_config, field, value):
    with pytest.raises(ValueError, match=rf"{field}.*{value!r}"):
        make_config(**{field: value})
