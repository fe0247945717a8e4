"""The encoder benchmark's contestants time the functions they claim: `jina-eager` (the re-implementation of
jina-embeddings-v2's eager forward) equals `AlibiBertModel` on the same weights, `alibi-bert-sdpa` holds its very
weights, the BERT floors have the widths stated, and the encoder targets read `jina-eager` of the same cell."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `benchmarks` is a folder of the repository, not part of the installed package
    sys.path.insert(0, str(ROOT))

from benchmarks.contestants import Shape, encoder_model, unsupported_reason  # noqa: E402
from benchmarks.jina_eager import JinaEager, alibi_tensor  # noqa: E402
from benchmarks.targets import evaluate_targets  # noqa: E402
from conftest import tiny_encoder_kwargs  # noqa: E402
from hf_alibi import AlibiBertConfig, AlibiBertModel  # noqa: E402

SHAPE = Shape(n_embd=48, n_layer=2, n_head=6, vocab_size=128)  # 6 heads: the interleaved slopes


def _pair(alibi_size: int):
    config = AlibiBertConfig(**tiny_encoder_kwargs(vocab_size=128, max_position_embeddings=alibi_size))
    jina = JinaEager(config, alibi_size).eval()
    for parameter in jina.parameters():  # non-trivial LayerNorms and biases too
        torch.nn.init.normal_(parameter, std=0.3)
    model = AlibiBertModel._from_config(config, attn_implementation="sdpa", add_pooling_layer=False).eval()
    model.load_state_dict(jina.state_dict(), strict=True)  # their names are ours, key for key
    return jina, model


@pytest.mark.parametrize("length", [40, 100])  # 100 > the prebuilt 64: their rebuild
def test_jina_eager_equals_alibi_bert_on_the_same_weights_padded_or_not(length):
    jina, model = _pair(64)
    ids = torch.randint(1, 128, (2, length))
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, length - 13 :] = 0  # right padding
    with torch.inference_mode():
        for attention_mask in (torch.ones_like(mask), mask):
            expected = model(ids, attention_mask=attention_mask).last_hidden_state
            got = jina(ids, attention_mask=attention_mask)
            real = attention_mask.bool()
            error = (got - expected)[real].abs().max().item()
            assert error < 1e-5, f"largest difference {error:.2e}"
    assert jina.encoder.alibi.shape[-1] == max(64, length)


def test_their_alibi_tensor_is_minus_slope_times_distance():
    tensor = alibi_tensor(6, 5)  # (1, H, S, S)
    slopes = AlibiBertModel(AlibiBertConfig(num_attention_heads=6, hidden_size=48, num_hidden_layers=1)).alibi_slopes
    distance = (torch.arange(5)[None] - torch.arange(5)[:, None]).abs()
    assert torch.equal(tensor[0], -slopes[:, None, None] * distance)


def test_contestants_have_the_stated_widths_and_weights():
    bert, wide = encoder_model("bert-sdpa", SHAPE, 300), encoder_model("bert-sdpa-mlp4608", SHAPE, 300)
    assert bert.config.intermediate_size == 4 * 48 and wide.config.intermediate_size == 6 * 48
    assert bert.config._attn_implementation == "sdpa" and bert.config.max_position_embeddings >= 300
    alibi = encoder_model("alibi-bert-sdpa", SHAPE, 300)
    assert alibi.config._attn_implementation == "sdpa" and alibi.config.intermediate_size == 4 * 48
    assert unsupported_reason("jina-eager", "forward", "cpu") and unsupported_reason("gpt2-sdpa", "encode", "cpu")
    assert unsupported_reason("alibi-bert-sdpa", "encode", "cpu") is None


def test_encoder_targets_read_jina_eager_of_the_same_cell():
    def result(seconds, mib, ratio=None):
        return {"status": "ok", "median_s": seconds, "peak_mem_bytes": mib * 2**20, "time_ratio": ratio}

    cells = [
        {
            "suite": "encode",
            "name": "encode L=2048 B=1",
            "length": 2048,
            "results": {"alibi-bert-sdpa": result(1.0, 10, 1.2)},
        },
        {
            "suite": "encode",
            "name": "encode L=8192 B=1",
            "length": 8192,
            "results": {"jina-eager": result(9.0, 4000), "alibi-bert-sdpa": result(2.0, 200, 1.01)},
        },
    ]
    rows = {row["target"]: row for row in evaluate_targets(cells, "alibi-bert-sdpa", "encoder", "bert-sdpa")}
    assert rows["encode L=2048 B=1 within 1.05x bert-sdpa time"]["status"] == "not met"
    assert rows["encode L=8192 B=1 within 1.05x bert-sdpa time"]["status"] == "met"
    assert rows["encode L=8192 >= 3x faster than jina-eager, <= 0.25x its memory"]["status"] == "met"
    cells[1]["results"]["jina-eager"] = {"status": "oom"}
    rows = {row["target"]: row for row in evaluate_targets(cells, "alibi-bert-sdpa", "encoder", "bert-sdpa")}
    assert (
        rows["encode L=8192 >= 3x faster than jina-eager, <= 0.25x its memory"]["detail"]
        == "jina-eager ran out of memory"
    )
