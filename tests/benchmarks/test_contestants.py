"""Benchmark contestants that must time a stated function: `alibi-from-bloom` / `alibi-from-jais` the very function
`bloom-eager` / `jais-eager` times (`jais-eager` held to the float64 reference of their code), and
`alibi-sdpa-gpt2-gelu` hf_alibi with GPT-2's unfused GELU (the attention-only ratio)."""

import copy
import sys
from pathlib import Path

import pytest
import torch
from transformers.activations import ACT2FN

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `benchmarks` is a folder of the repository, not part of the installed package
    sys.path.insert(0, str(ROOT))

from benchmarks import report  # noqa: E402
from benchmarks.contestants import Shape, build_model, imported_bloom, imported_jais  # noqa: E402
from benchmarks.jais_eager import EMBEDDINGS_SCALE, WIDTH_SCALE, JaisEager  # noqa: E402
from benchmarks.targets import evaluate_targets  # noqa: E402
from hf_alibi.models.alibi.transformers_compat import output_cache  # noqa: E402

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

    cells = [
        {
            "suite": "forward",
            "length": 8192,
            "results": {"bloom-eager": result(4.4, 800), "alibi-from-bloom": result(1.0, 90)},
        },
        {"suite": "forward", "length": 16384, "results": {"alibi-from-bloom": result(2.0, 180)}},
    ]
    rows = {row["target"]: row for row in evaluate_targets(cells, "alibi-from-bloom")}
    assert rows["forward L=8192 >= 4x faster than bloom-eager, <= 1/8 its memory"]["status"] == "met"
    assert rows["forward L=16384 runs"]["status"] == "met"
    assert rows["forward L=32768 runs"]["status"] == "n/a"


def test_attention_only_twin_is_alibi_sdpa_with_gpt2s_unfused_gelu():
    shipped, _ = build_model("alibi-sdpa", SHAPE, 128)
    twin, _ = build_model("alibi-sdpa-gpt2-gelu", SHAPE, 128)
    assert twin.config.to_dict() == shipped.config.to_dict()  # same config, "gelu_new" in both
    by_hand = copy.deepcopy(shipped)
    for block in by_hand.transformer.h:  # what GPT2LMHeadModel's MLP runs for "gelu_new"
        block.mlp.act = ACT2FN["gelu_new"]
    ids = torch.randint(3, 512, (1, 100))
    with torch.no_grad():
        assert torch.equal(twin(ids).logits, by_hand(ids).logits)  # same weights, GPT-2's kernel: bit for bit
        torch.testing.assert_close(twin(ids).logits, shipped(ids).logits, atol=1e-5, rtol=0)  # fp32 rounding apart


def test_markdown_says_which_ratio_is_the_model_and_which_attention_only():
    machine = {
        "cpu": "cpu",
        "cpu_count": 2,
        "device": "cpu",
        "threads": 1,
        "torch": "t",
        "transformers": "t",
        "python": "p",
        "date": "d",
    }
    settings = {
        "shape": {"n_embd": 8, "n_layer": 1, "n_head": 1, "vocab_size": 8},
        "dtype": "fp32",
        "suites": [],
        "processes": 0,
        "warmup": 0,
        "repeats": 1,
        "memory_method": "m",
        "reference": "gpt2-sdpa",
    }
    document = {"command": "c", "machine": machine, "settings": settings, "cells": [], "targets": []}
    names = ["gpt2-sdpa", "alibi-sdpa", "alibi-sdpa-gpt2-gelu"]
    text = report.render_markdown({**document, "contestants": names})
    assert "`alibi-sdpa` is hf_alibi as shipped" in text and "`alibi-sdpa-gpt2-gelu` is the same model" in text
    assert "attention-only" not in report.render_markdown({**document, "contestants": names[:2]})


JAIS_SHAPE = Shape(n_embd=48, n_layer=2, n_head=6, vocab_size=512)  # 6 heads: the interleaved slopes


def test_jais_eager_computes_what_the_float64_reference_of_their_code_does():
    from alibi_reference import reference_logits

    jais, _ = build_model("jais-eager", JAIS_SHAPE, 128)
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in jais.parameters():  # off the init: every weight's place matters
            if parameter.requires_grad:
                parameter.add_(0.2 * torch.randn_like(parameter))
    ids, mask = torch.randint(3, 512, (2, 40)), torch.ones(2, 40, dtype=torch.long)
    mask[0, :6] = 0
    slopes = jais.transformer.relative_pe.slopes.double().flatten()
    expected = reference_logits(
        jais.state_dict(),
        ids,
        n_layer=2,
        n_head=6,
        slopes=slopes,
        attn_scale=1 / 8,
        activation="silu",
        gated=True,
        embedding_scale=EMBEDDINGS_SCALE,
        logit_scale=WIDTH_SCALE,
        attention_mask=mask,
    )
    with torch.no_grad():
        got = jais.eval()(ids, attention_mask=mask).logits
    error = (got.double() - expected)[mask.bool()].abs().max().item()
    assert error < 2e-5, f"jais-eager differs from the reference of their code by {error:.2e}"
    # 6 heads: the 4-head slopes, then every other one of the 8-head slopes (the paper's interleave)
    assert torch.equal(slopes.float(), torch.tensor([2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]))


def test_alibi_from_jais_holds_jais_eagers_weights_and_logits_and_runs_past_its_cap():
    jais, _ = build_model("jais-eager", JAIS_SHAPE, 128)
    alibi, _ = build_model("alibi-from-jais", JAIS_SHAPE, 128)
    assert alibi.config._attn_implementation == "sdpa" and alibi.config.gated_mlp
    ids = torch.randint(3, 512, (1, 100))
    with torch.no_grad():
        torch.testing.assert_close(alibi(ids).logits, jais.eval()(ids).logits, atol=2e-5, rtol=0)
    capped = JaisEager(512, 48, 2, 6, n_positions=32)
    long_ids = torch.randint(3, 512, (1, 40))
    with torch.no_grad(), pytest.raises(RuntimeError):
        capped(long_ids)  # their tril(ones(n_positions)) buffer stops at 32
    with torch.no_grad():
        assert torch.isfinite(imported_jais(capped)(long_ids).logits).all()


def test_imported_jais_refuses_to_benchmark_a_different_function():
    jais, _ = build_model("jais-eager", JAIS_SHAPE, 128)
    jais.transformer.h[0].mlp.register_forward_hook(lambda module, args, out: out * 2)
    with pytest.raises(RuntimeError, match="differ"):
        imported_jais(jais)


@pytest.mark.parametrize("n_layer", [1, 2])
def test_slope_interpolation_imports_as_jais_eager_computes_it_past_train_seq_len(n_layer):
    """jais-eager with `alibi_scaling = {"type": "linear", "train_seq_len": 16}` (their rule, in fp32): the import
    gives its logits at K = 40 keys; with one layer (the same keys and values either way) a cached step at K keys
    gives the last row of jais-eager's forward over those K."""
    jais = JaisEager(512, 48, n_layer, 6, n_positions=128, alibi_scaling={"type": "linear", "train_seq_len": 16})
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in jais.parameters():  # off the init: every weight's place matters
            if parameter.requires_grad:
                parameter.add_(0.2 * torch.randn_like(parameter))
    model = imported_jais(jais.eval())
    assert model.config.alibi_scaling == {"type": "linear", "train_seq_len": 16}
    ids = torch.randint(3, 512, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, jais(ids).logits, atol=2e-5, rtol=0)
        if n_layer == 1:
            out = model(ids[:, :30], use_cache=True)
            for step in range(30, 40):
                out = model(ids[:, step : step + 1], cache=output_cache(out), use_cache=True)
                expected = jais(ids[:, : step + 1]).logits[:, -1]
                torch.testing.assert_close(out.logits[:, -1], expected, atol=2e-5, rtol=0)
