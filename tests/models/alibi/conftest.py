"""Tiny ALiBi encoders (the `alibi_bert` family) for the encoder's tests: CPU, fp32, dropout 0, a fixed seed."""

import pytest
import torch

from hf_alibi import AlibiBertConfig, AlibiBertModel


def tiny_encoder_kwargs(**overrides) -> dict:
    """2 layers, 6 heads (the paper's interleaved slopes), head_dim 8, a GLU of width 40, no dropout."""
    kwargs = dict(
        vocab_size=100,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=6,
        intermediate_size=40,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=64,
    )
    kwargs.update(overrides)
    return kwargs


@pytest.fixture
def make_encoder():
    """`make_encoder(model_class=AlibiBertModel, attn_implementation="sdpa", **config_overrides)` -> a tiny encoder
    in eval mode, with the same weights whichever backend is asked for. Every parameter is redrawn with std 0.3
    (BERT's 0.02 leaves q.k near zero, where attention is the bias alone and a wrong score would go unseen)."""

    def make(model_class=AlibiBertModel, attn_implementation: str = "sdpa", **overrides):
        torch.manual_seed(0)
        config = AlibiBertConfig(**tiny_encoder_kwargs(**overrides))
        model = model_class._from_config(config, attn_implementation=attn_implementation).eval()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.normal_(0.0, 0.3)
        return model

    return make
