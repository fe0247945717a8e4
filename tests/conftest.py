"""Shared fixtures: tiny ALiBi GPT-2 configs and models (CPU, fp32, dropout 0), no network, a fixed seed."""

import contextlib
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before huggingface_hub is imported: nothing in the tests may reach the Hub

import pytest
import torch

from hf_alibi import AlibiBertConfig, AlibiBertModel, AlibiGPT2Config, AlibiGPT2LMHeadModel  # registers both types
from hf_alibi.models.alibi.transformers_compat import CONTINUOUS_BATCHING_MINIMUM, transformers_at_least

# Tiny models: one thread is fastest, and on a shared 2-core machine several threads spin against other jobs
# (measured here: a 10-token generate() took 2.8 s with 2 threads, 0.13 s with 1).
torch.set_num_threads(1)

PAD = 0  # pad_token_id of the tiny configs; random_ids never draws it
# Continuous batching runs on the transformers releases the model reads it from; older ones refuse it in one line
# (tests/models/alibi/test_transformers_range.py), so its tests skip there.
CONTINUOUS_BATCHING = transformers_at_least(CONTINUOUS_BATCHING_MINIMUM)
NO_CONTINUOUS_BATCHING = f"continuous batching needs transformers>={CONTINUOUS_BATCHING_MINIMUM}"
# Whole folders of a feature newer than the oldest supported release (hf-alibi serve; tensor parallelism and FSDP2):
# not collected on an older one, where their modules would not even import; the report's header says so.
NEWER_FEATURE_FOLDERS = {"serving": "5.24", "distributed": "5.24"}


def pytest_ignore_collect(collection_path, config):
    minimum = NEWER_FEATURE_FOLDERS.get(collection_path.name) if collection_path.parent.name == "tests" else None
    return True if minimum is not None and not transformers_at_least(minimum) else None


def pytest_report_header(config):
    skipped = sorted(
        f"tests/{name}" for name, minimum in NEWER_FEATURE_FOLDERS.items() if not transformers_at_least(minimum)
    )
    if skipped:
        return f"not collected on this transformers (their features need 5.24+): {', '.join(skipped)}"
    return None


def tiny_config_kwargs(**overrides) -> dict:
    """2 layers, 12 heads (the paper's non-power-of-two slopes), head_dim 8, n_positions 16, no dropout."""
    kwargs = dict(
        vocab_size=256,
        n_positions=16,
        n_embd=96,
        n_layer=2,
        n_head=12,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        classifier_dropout=0.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=PAD,
    )
    kwargs.update(overrides)
    return kwargs


@pytest.fixture(autouse=True)
def _fixed_seed():
    torch.manual_seed(0)


@pytest.fixture
def make_config():
    """`make_config(**overrides)` -> a tiny `AlibiGPT2Config`."""

    def make(**overrides) -> AlibiGPT2Config:
        return AlibiGPT2Config(**tiny_config_kwargs(**overrides))

    return make


@pytest.fixture
def make_model(make_config):
    """`make_model(attn_implementation="sdpa", **config_overrides)` -> a tiny `AlibiGPT2LMHeadModel` in eval mode."""

    def make(attn_implementation: str = "sdpa", **overrides) -> AlibiGPT2LMHeadModel:
        torch.manual_seed(0)  # the same weights whichever backend is asked for
        config = make_config(**overrides)
        return AlibiGPT2LMHeadModel._from_config(config, attn_implementation=attn_implementation).eval()

    return make


@pytest.fixture
def tiny_model(make_model):
    return make_model()


@pytest.fixture
def random_ids():
    """`random_ids(batch, length, vocab=256)` -> int64 token ids in [3, vocab): never pad, bos or eos."""

    def make(batch: int, length: int, vocab: int = 256) -> torch.Tensor:
        return torch.randint(3, vocab, (batch, length))

    return make


@pytest.fixture
def make_evaluation():
    """`make_evaluation(name, {length: nonoverlapping perplexity}, train_length)` -> a `ModelEvaluation`."""
    import math

    from hf_alibi.experiments.length.length_eval import DocumentSelection, LengthResult, ModelEvaluation

    def make(name: str, perplexities: dict[int, float], train_length: int) -> ModelEvaluation:
        selection = DocumentSelection(
            documents=1, skipped=0, min_tokens=1, tokens_used=1000, tokens_dropped=0, fingerprint="0" * 64
        )
        lengths = [
            LengthResult(
                length=n,
                factor=n / train_length,
                ppl_nonoverlapping=p,
                nll_nonoverlapping=math.log(p) * 999,
                tokens_nonoverlapping=999,
            )
            for n, p in sorted(perplexities.items())
        ]
        return ModelEvaluation(
            model=name, train_length=train_length, max_length=None, selection=selection, lengths=lengths
        )

    return make


@contextlib.contextmanager
def recorded_plans(model):
    """The attention plan each attention layer reads, recorded with forward pre-hooks (public torch API)."""
    from hf_alibi.models.alibi.modeling_alibi_gpt2 import AlibiGPT2Attention

    plans = []
    hooks = [
        module.register_forward_pre_hook(lambda module, args: plans.append(args[1]))  # forward(hidden, plan, ...)
        for module in model.modules()
        if isinstance(module, AlibiGPT2Attention)
    ]
    try:
        yield plans
    finally:
        for hook in hooks:
            hook.remove()


@pytest.fixture
def record_plans():
    return recorded_plans


# Tiny ALiBi encoders (the `alibi_bert` family): CPU, fp32, dropout 0, a fixed seed.


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
