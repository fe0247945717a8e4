"""The imported-BLOOM benchmark contestant: `alibi-from-bloom` times the very function `bloom-eager` times."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `benchmarks` is a folder of the repository, not part of the installed package
    sys.path.insert(0, str(ROOT))

from benchmarks import report  # noqa: E402
from benchmarks.contestants import Shape, build_model, imported_bloom  # noqa: E402

SHAPE = Shape(n_embd=64, n_layer=2, n_head=16, vocab_size=512)  # bloom-560m's 16 heads, tiny otherwise


def test_alibi_from_bloom_holds_bloom_eagers_weights_and_logits():
    bloom, _ = build_model("bloom-eager", SHAPE, 128)
    alibi, _ = build_model("alibi-from-bloom", SHAPE, 128)
    assert alibi.config._attn_implementation == "sdpa"
    ids = torch.randint(3, 512, (1, 100))
    with torch.no_grad():
        torch.testing.assert_close(alibi(ids).logits, bloom(ids).logits, atol=2e-5, rtol=0)


def test_imported_bloom_refuses_to_benchmark_a_different_function():
    bloom, _ = build_model("bloom-eager", SHAPE, 128)
    bloom.transformer.word_embeddings_layernorm.register_forward_hook(lambda module, args, out: out * 2)
    with pytest.raises(RuntimeError, match="differ"):
        imported_bloom(bloom)


def test_issue_8_targets_read_bloom_eager_of_the_same_cell():
    def result(seconds, mib):
        return {"status": "ok", "median_s": seconds, "peak_mem_bytes": mib * 2**20}

    cells = [{"suite": "forward", "length": 8192, "results": {"bloom-eager": result(4.4, 800),
                                                              "alibi-from-bloom": result(1.0, 90)}},
             {"suite": "forward", "length": 16384, "results": {"alibi-from-bloom": result(2.0, 180)}}]  # fmt: skip
    rows = {row["target"]: row for row in report.evaluate_targets(cells, "alibi-from-bloom")}
    assert rows["forward L=8192 >= 4x faster than bloom-eager, <= 1/8 its memory"]["status"] == "met"
    assert rows["forward L=16384 runs"]["status"] == "met"
    assert rows["forward L=32768 runs"]["status"] == "n/a"
