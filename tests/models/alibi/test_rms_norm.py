"""What Baichuan (and any Llama-shaped ALiBi model) needs of the config: `norm_type="rms_norm"`, `bias=False`, an
untied head, with the gated SiLU MLP Jais already uses. Every backend computes the float64 reference model with those
switches, padded and cached; the RMSNorm rounds as Baichuan's does in half precision; bad values are refused by name."""

import pytest
import torch

from alibi_reference import reference_logits
from hf_alibi import AlibiGPT2Config, AlibiGPT2LMHeadModel, get_alibi_slopes
from hf_alibi.models.alibi.normalization import AlibiRMSNorm
from hf_alibi.models.alibi.transformers_compat import output_cache

ATOL = 2e-5  # fp32 against float64
LLAMA_SHAPED = dict(
    norm_type="rms_norm",
    bias=False,
    tie_word_embeddings=False,
    gated_mlp=True,
    activation_function="silu",
    n_inner=100,
    layer_norm_epsilon=1e-6,
    n_head=6,
    n_embd=48,
)
# backend -> (attn_implementation, config overrides) that select it
BACKENDS = {
    "eager": ("eager", {}),
    "sdpa_split": ("sdpa", {}),
    "sdpa_bank": ("sdpa", {"alibi_sdpa_split": False, "alibi_sdpa_query_chunk": 4}),
    "sdpa_certified": ("sdpa", {"alibi_skip_eps": 1e-7}),
    "flex_attention": ("flex_attention", {}),
}


def llama_shaped(make_model, backend: str = "sdpa_split") -> AlibiGPT2LMHeadModel:
    implementation, switches = BACKENDS[backend]
    model = make_model(implementation, **LLAMA_SHAPED, **switches)
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():  # norm weights off 1, so each weight's place matters
            parameter.add_(0.1 * torch.randn_like(parameter))
    return model.eval()


def expected_logits(model, ids, mask=None) -> torch.Tensor:
    config = model.config
    return reference_logits(
        model.state_dict(),
        ids,
        n_layer=config.n_layer,
        n_head=config.n_head,
        slopes=get_alibi_slopes(config.n_head),
        attn_scale=(config.n_embd // config.n_head) ** -0.5,
        activation="silu",
        gated=True,
        eps=config.layer_norm_epsilon,
        attention_mask=mask,
        norm="rms_norm",
    )


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_rms_norm_no_bias_untied_model_matches_the_float64_reference_padded_and_cached(make_model, random_ids, backend):
    model = llama_shaped(make_model, backend)
    ids = random_ids(2, 13)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    with torch.no_grad():
        got = model(ids, attention_mask=mask).logits
        out = model(ids[:, :6], attention_mask=mask[:, :6], use_cache=True)
        steps = []
        for step in range(6, ids.shape[1]):
            out = model(ids[:, step : step + 1], attention_mask=mask[:, : step + 1], cache=output_cache(out))
            steps.append(out.logits[:, -1])
    expected = expected_logits(model, ids, mask)
    error = (got.double() - expected)[mask.bool()].abs().max().item()
    assert error < ATOL, f"{backend}: full forward differs from the reference by {error:.2e}"
    error = (torch.stack(steps, 1).double() - expected[:, 6:]).abs().max().item()
    assert error < ATOL, f"{backend}: cached decoding differs from the reference by {error:.2e}"


def test_rms_norm_is_not_layer_norm_and_has_no_bias_parameters(make_model, random_ids):
    model = llama_shaped(make_model)
    state = model.state_dict()
    assert not [name for name in state if name.endswith(".bias")]
    assert isinstance(model.transformer.ln_f, AlibiRMSNorm) and "lm_head.weight" in state
    layer_norm = make_model(**{**LLAMA_SHAPED, "norm_type": "layer_norm"})
    layer_norm.load_state_dict(state)
    ids = random_ids(1, 9)
    with torch.no_grad():
        assert (model(ids).logits - layer_norm.eval()(ids).logits).abs().max() > 100 * ATOL, "norm_type changes nothing"


def test_untied_head_is_its_own_weight_and_survives_save_and_load(make_model, tmp_path, random_ids):
    model = llama_shaped(make_model)
    assert model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr()
    model.save_pretrained(tmp_path)
    loaded = AlibiGPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert (loaded.config.norm_type, loaded.config.bias, loaded.config.tie_word_embeddings) == (
        "rms_norm",
        False,
        False,
    )
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    assert not torch.equal(loaded.lm_head.weight, loaded.transformer.wte.weight)
    ids = random_ids(2, 9)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_rounds_as_baichuans_code_does(dtype):
    """Baichuan's `RMSNorm.forward`, written out: the variance in fp32, `x * rsqrt(...)` promoted to fp32, cast to the
    half-precision weight's dtype, then times the weight."""
    torch.manual_seed(0)
    x = (3 * torch.randn(4, 7, 64)).to(dtype)
    norm = AlibiRMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(64))
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    theirs = x * torch.rsqrt(variance + 1e-6)
    if dtype != torch.float32:
        theirs = theirs.to(dtype)
    with torch.no_grad():
        assert torch.equal(norm(x), norm.weight * theirs)
        exact = x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * norm.weight.double()
    if dtype == torch.float32:
        torch.testing.assert_close(norm(x).double(), exact, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize(
    "field, value", [("norm_type", "rmsnorm"), ("norm_type", None), ("tie_word_embeddings", "no"), ("bias", 0)]
)
def test_bad_values_raise_naming_the_field_and_value(field, value):
    with pytest.raises(ValueError, match=rf"{field}.*{value!r}"):
        AlibiGPT2Config(**{field: value})
