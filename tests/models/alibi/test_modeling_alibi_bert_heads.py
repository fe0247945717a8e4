"""The encoder's heads and checkpoints: the masked-LM loss with -100 labels and its tied decoder, sequence
classification's problem types and token classification as in BERT, the state dict's names (jina-embeddings-v2's),
and a safetensors round trip through the Auto classes."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification

from hf_alibi import (
    AlibiBertForMaskedLM,
    AlibiBertForSequenceClassification,
    AlibiBertForTokenClassification,
    AlibiBertModel,
)


def interface_names(layers: int, qk_layer_norm: bool = False) -> set[str]:
    """The bare model's parameter names as the interface lists them (jina-embeddings-v2's own)."""
    names = {"embeddings.word_embeddings.weight", "embeddings.token_type_embeddings.weight"}
    names |= {"embeddings.LayerNorm.weight", "embeddings.LayerNorm.bias", "pooler.dense.weight", "pooler.dense.bias"}
    for i in range(layers):
        p = f"encoder.layer.{i}."
        for module in ["attention.self.query", "attention.self.key", "attention.self.value"] + [
            "attention.output.dense",
            "attention.output.LayerNorm",
            "mlp.wo",
            "mlp.layernorm",
        ]:
            names |= {f"{p}{module}.weight", f"{p}{module}.bias"}
        if qk_layer_norm:
            names |= {f"{p}attention.self.layer_norm_{x}.{w}" for x in "qk" for w in ("weight", "bias")}
        names.add(f"{p}mlp.gated_layers.weight")
    return names


@pytest.mark.parametrize("qk_layer_norm", [False, True])
def test_state_dict_names_are_jina_embeddings_v2s(make_encoder, qk_layer_norm):
    model = make_encoder(qk_layer_norm=qk_layer_norm)
    assert set(model.state_dict()) == interface_names(2, qk_layer_norm)
    assert model.encoder.layer[0].mlp.gated_layers.weight.shape == (80, 48)  # 2 x intermediate_size outputs
    heads = make_encoder(AlibiBertForMaskedLM).state_dict()
    bare = interface_names(2) - {"pooler.dense.weight", "pooler.dense.bias"}  # BERT's MLM model has no pooler
    mlm = {"cls.predictions.transform.dense", "cls.predictions.transform.LayerNorm", "cls.predictions.decoder"}
    assert set(heads) == {f"bert.{name}" for name in bare} | {f"{m}.{w}" for m in mlm for w in ("weight", "bias")}


def test_masked_lm_loss_ignores_minus_100_labels_and_the_decoder_is_tied(make_encoder):
    model = make_encoder(AlibiBertForMaskedLM)
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    ids = torch.randint(1, 100, (2, 20))
    labels = torch.full_like(ids, -100)
    labels[0, 3], labels[1, 7], labels[1, 19] = 5, 9, 11
    with torch.no_grad():
        out = model(ids, labels=labels)
        scaled = model(ids, labels=labels, num_items_in_batch=torch.tensor(6)).loss  # Trainer's count of labels
    expected = F.cross_entropy(out.logits[labels != -100], labels[labels != -100])
    torch.testing.assert_close(out.loss, expected)
    torch.testing.assert_close(scaled, expected * 3 / 6)  # summed over the 3 labels, divided by the batch's count
    assert out.logits.shape == (2, 20, 100)


@pytest.mark.parametrize(
    "num_labels, labels, problem_type, loss",
    [
        (1, torch.tensor([0.5, -1.0]), "regression", lambda logits, y: F.mse_loss(logits.squeeze(-1), y)),
        (3, torch.tensor([2, 0]), "single_label_classification", F.cross_entropy),
        (3, torch.tensor([[1.0, 0, 1], [0, 1, 0]]), "multi_label_classification", F.binary_cross_entropy_with_logits),
    ],
)
def test_sequence_classification_pools_the_first_token_and_picks_the_problem_type_as_bert(
    make_encoder, num_labels, labels, problem_type, loss
):
    model = make_encoder(AlibiBertForSequenceClassification, num_labels=num_labels)
    ids = torch.randint(1, 100, (2, 12))
    with torch.no_grad():
        out = model(ids, labels=labels)
        pooled = model.bert(ids).pooler_output
    expected_logits = model.classifier(pooled)  # BERT: pooler output -> dropout (off in eval) -> classifier
    torch.testing.assert_close(out.logits, expected_logits)
    torch.testing.assert_close(pooled, torch.tanh(model.bert.pooler.dense(model.bert(ids).last_hidden_state[:, 0])))
    assert model.config.problem_type == problem_type
    torch.testing.assert_close(out.loss, loss(out.logits, labels))


def test_token_classification_predicts_each_token_and_ignores_minus_100(make_encoder):
    model = make_encoder(AlibiBertForTokenClassification, num_labels=4)
    ids = torch.randint(1, 100, (2, 9))
    labels = torch.randint(0, 4, (2, 9))
    labels[1, 5:] = -100
    with torch.no_grad():
        out = model(ids, labels=labels)
        hidden = model.bert(ids).last_hidden_state
    torch.testing.assert_close(out.logits, model.classifier(hidden))
    kept = labels != -100
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits[kept], labels[kept]))
    assert model.bert.pooler is None  # as BERT's token classifier: no pooler weights


@pytest.mark.parametrize(
    "model_class, auto_class",
    [
        (AlibiBertModel, AutoModel),
        (AlibiBertForMaskedLM, AutoModelForMaskedLM),
        (AlibiBertForSequenceClassification, AutoModelForSequenceClassification),
    ],
)
def test_saved_folder_is_safetensors_and_loads_through_the_auto_class(make_encoder, tmp_path, model_class, auto_class):
    model = make_encoder(model_class, qk_layer_norm=True)
    model.save_pretrained(tmp_path)
    files = {p.name for p in tmp_path.iterdir()}
    assert "model.safetensors" in files and not any(name.endswith(".bin") for name in files)
    assert {"configuration_alibi_bert.py", "modeling_alibi_bert.py"} <= files
    loaded = auto_class.from_pretrained(tmp_path).eval()
    assert type(loaded) is model_class
    ids = torch.randint(1, 100, (2, 15))
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    with torch.no_grad():
        expected, got = model(ids, attention_mask=mask), loaded(ids, attention_mask=mask)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=0, rtol=0)
    if model_class is AlibiBertForMaskedLM:  # still tied after loading
        assert loaded.cls.predictions.decoder.weight is loaded.bert.embeddings.word_embeddings.weight
