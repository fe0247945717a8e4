"""MPT -> ALiBi GPT-2 is exact (logits of transformers' MptForCausalLM), has no length cap, and round-trips."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, MptConfig, MptForCausalLM

from family_checks import BACKENDS, VOCAB, assert_same_logits, assert_same_weights, left_padded_batch, perturb
from hf_alibi import convert, export
from hf_alibi.conversion import convert_mpt, export_mpt

HEADS = (4, 12)
MAX_SEQ_LEN = 32


def tiny_mpt(n_head: int, attn_config: dict | None = None, **overrides) -> MptForCausalLM:
    config = MptConfig(
        vocab_size=VOCAB,
        d_model=8 * n_head,
        n_layers=2,
        n_heads=n_head,
        max_seq_len=MAX_SEQ_LEN,
        attn_config=attn_config or {},
        **overrides,
    )
    return perturb(MptForCausalLM(config))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n_head", HEADS)
def test_imported_mpt_matches_transformers_mpt_padded_and_cached(n_head, backend):
    mpt = tiny_mpt(n_head)
    assert_same_logits(convert(mpt), mpt, backend)


@pytest.mark.parametrize("attn_config", [{"clip_qkv": 0.3}, {"softmax_scale": 0.2}], ids=["clip_qkv", "softmax_scale"])
def test_mpt_clip_qkv_and_softmax_scale_import_exactly(attn_config):
    mpt = tiny_mpt(12, attn_config)
    alibi = convert_mpt(mpt)
    assert alibi.config.clip_qkv == attn_config.get("clip_qkv")
    assert_same_logits(alibi, mpt, "sdpa")


def test_mpt_import_has_no_bias_and_the_erf_gelu():
    alibi = convert_mpt(tiny_mpt(4))
    assert not alibi.config.bias and alibi.config.activation_function == "gelu"
    assert not [key for key in alibi.state_dict() if key.endswith(".bias")]


def test_imported_mpt_runs_past_max_seq_len_where_transformers_mpt_cannot():
    mpt = tiny_mpt(4)
    alibi = convert_mpt(mpt)
    ids = torch.randint(3, VOCAB, (1, 3 * MAX_SEQ_LEN))
    with torch.no_grad(), pytest.raises(RuntimeError):
        mpt(ids)  # transformers' MPT slices a bias built for max_seq_len
    with torch.no_grad():
        long_logits = alibi(ids).logits  # (1, 96, V)
        short_logits = mpt(ids[:, :MAX_SEQ_LEN]).logits
    assert torch.isfinite(long_logits).all()
    torch.testing.assert_close(long_logits[:, :MAX_SEQ_LEN], short_logits, atol=2e-5, rtol=0)  # causal: prefix equal


@pytest.mark.parametrize("n_head", HEADS)
def test_mpt_to_alibi_to_mpt_gives_back_the_original_weights(n_head):
    mpt = tiny_mpt(n_head, {"clip_qkv": 6.0})
    back = export_mpt(convert_mpt(mpt), max_seq_len=MAX_SEQ_LEN)
    assert_same_weights(mpt, back)
    assert back.config.attn_config.clip_qkv == 6.0


@pytest.mark.parametrize(
    "field, attn_config, overrides",
    [
        ("qk_ln", {"qk_ln": True}, {}),
        ("attn_type", {"attn_type": "multiquery_attention"}, {}),
        ("alibi", {"alibi": False}, {}),
        ("prefix_lm", {"prefix_lm": True}, {}),
        ("alibi_bias_max", {"alibi_bias_max": 16}, {}),
        ("logit_scale", {}, {"logit_scale": 0.5}),
        ("softmax_scale", {"softmax_scale": 0.2, "clip_qkv": 1.0}, {}),
    ],
)
def test_mpt_features_outside_alibi_gpt2_are_refused_by_name(field, attn_config, overrides):
    with pytest.raises(ValueError, match=field):
        convert(tiny_mpt(4, attn_config, **overrides))


def test_mpt_checkpoint_with_learned_position_weights_is_refused(tmp_path):
    mpt = tiny_mpt(4)
    mpt.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["transformer.wpe.weight"] = torch.randn(MAX_SEQ_LEN, 32)  # what llm-foundry writes for learned_pos_emb
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="transformer.wpe.weight"):
        convert(str(tmp_path))


def test_export_to_mpt_refuses_models_mpt_cannot_hold(make_model):
    with pytest.raises(ValueError, match="bias"):
        export_mpt(make_model(activation_function="gelu"))
    with pytest.raises(ValueError, match="activation_function"):
        export_mpt(make_model(bias=False))
    with pytest.raises(ValueError, match="embedding_layernorm"):
        export_mpt(make_model(bias=False, activation_function="gelu", embedding_layernorm=True))
    with pytest.raises(ValueError, match="max_seq_len"):
        export_mpt(convert_mpt(tiny_mpt(4)), max_seq_len=0)


def test_export_folder_loads_as_mpt_with_the_requested_serving_length(tmp_path):
    mpt = tiny_mpt(12)
    alibi = convert_mpt(mpt)
    folder = export(alibi, "mpt", tmp_path / "mpt", max_seq_len=64)
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(loaded) is MptForCausalLM and loaded.config.max_seq_len == 64
    ids, mask = left_padded_batch(40)  # longer than the source's max_seq_len, within the export's
    with torch.no_grad():
        expected = alibi(ids, attention_mask=mask).logits
        got = loaded(ids, attention_mask=mask).logits
    error = (got - expected)[mask.bool()].abs().max().item()
    assert error < 2e-5, error
