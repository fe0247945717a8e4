"""The architecture switches that imported checkpoints need: embedding_layernorm (BLOOM), bias and clip_qkv (MPT)."""

import pytest
import torch
from torch import nn

from hf_alibi import AlibiGPT2Config, AlibiGPT2LMHeadModel

BASELINE_KEYS = {"transformer.wte.weight", "transformer.ln_f.weight", "transformer.ln_f.bias", "lm_head.weight"}


def test_defaults_keep_the_state_dict_keys_of_existing_checkpoints(make_model):
    keys = set(make_model().state_dict())
    per_block = {
        f"transformer.h.0.{name}"
        for name in (
            "ln_1.weight",
            "ln_1.bias",
            "attn.c_attn.weight",
            "attn.c_attn.bias",
            "attn.c_proj.weight",
            "attn.c_proj.bias",
            "ln_2.weight",
            "ln_2.bias",
            "mlp.c_fc.weight",
            "mlp.c_fc.bias",
            "mlp.c_proj.weight",
            "mlp.c_proj.bias",
        )
    }
    assert {k for k in keys if ".h.1." not in k} == BASELINE_KEYS | per_block


def test_bias_false_leaves_no_bias_parameter_anywhere(make_model, random_ids):
    model = make_model(bias=False, embedding_layernorm=True)
    assert not [k for k in model.state_dict() if k.endswith(".bias")]
    assert model.transformer.h[0].attn.c_attn.weight.shape == (96, 288)  # Conv1D (in, out) layout kept
    ids = random_ids(2, 9)
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all()


def test_bias_false_equals_bias_true_with_zero_biases(make_model, random_ids):
    with_bias = make_model()
    without = make_model(bias=False)
    state = {k: v for k, v in with_bias.state_dict().items() if not k.endswith(".bias")}
    without.load_state_dict(state, strict=True)
    for name, parameter in with_bias.named_parameters():
        if name.endswith(".bias"):
            nn.init.zeros_(parameter)
    ids = random_ids(2, 11)
    with torch.no_grad():
        torch.testing.assert_close(without(ids).logits, with_bias(ids).logits, atol=1e-5, rtol=1e-5)


def test_embedding_layernorm_normalises_passed_in_embeddings_too(make_model, random_ids):
    model = make_model(embedding_layernorm=True)
    assert "transformer.ln_embd.weight" in model.state_dict()
    with torch.no_grad():
        model.transformer.ln_embd.weight.mul_(3.0)  # not the identity, so skipping it would show
        ids = random_ids(2, 7)
        from_ids = model(ids).logits
        from_embeds = model(inputs_embeds=model.transformer.wte(ids)).logits
        plain = make_model()(ids).logits
    torch.testing.assert_close(from_embeds, from_ids, atol=0, rtol=0)
    assert (from_ids - plain).abs().max() > 1e-3


def test_clip_qkv_clamps_the_fused_projection(make_model, random_ids):
    model = make_model(clip_qkv=0.05)
    seen = {}
    model.transformer.h[0].attn.clip_qkv.register_forward_hook(lambda m, i, o: seen.update(raw=i[0], out=o))
    with torch.no_grad():
        model(random_ids(1, 8))
    assert seen["raw"].abs().max() > 0.05  # the clamp has something to do
    torch.testing.assert_close(seen["out"], seen["raw"].clamp(-0.05, 0.05), atol=0, rtol=0)


@pytest.mark.parametrize(
    "field, value",
    [
        ("embedding_layernorm", 1),
        ("bias", "no"),
        ("clip_qkv", 0.0),
        ("clip_qkv", -1.0),
        ("clip_qkv", float("inf")),
        ("clip_qkv", True),
    ],
)
def test_bad_switch_values_raise_naming_the_field(make_config, field, value):
    with pytest.raises(ValueError, match=field):
        make_config(**{field: value})


def test_switches_survive_save_and_load(make_model, tmp_path, random_ids):
    model = make_model(embedding_layernorm=True, bias=False, clip_qkv=2.5)
    model.save_pretrained(tmp_path)
    loaded = AlibiGPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert isinstance(loaded.config, AlibiGPT2Config)
    assert (loaded.config.embedding_layernorm, loaded.config.bias, loaded.config.clip_qkv) == (True, False, 2.5)
    ids = random_ids(2, 10)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=0, rtol=0)
