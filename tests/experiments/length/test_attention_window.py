"""The effective attention window (hf_alibi.experiments.length.attention_window) and the bias figure (plots, plot-bias).

The reference: with zero query/key weights every attention logit is the bias alone, so head h weights distance k by
exp(-m_h k) and its window at eps is ceil(ln(1/eps) / m_h), exactly.
"""

import json
import math

import pytest
import torch

from hf_alibi import AlibiGPT2Config, AlibiGPT2LMHeadModel
from hf_alibi.cli import run as cli_run
from hf_alibi.experiments.length.attention_window import (
    EffectiveWindow,
    mass_beyond_distance,
    measure_effective_window,
    theoretical_window,
    window_table,
)
from hf_alibi.experiments.reporting.plots import bias_heads, plot_alibi_bias, plot_effective_window

SLOPES = [1.0, 0.5, 0.25, 0.125]  # windows ceil(ln(100) / m) = 5, 10, 19, 37 at eps = 0.01
LENGTH = 512  # queries from 256 on: exp(-0.125 * 257) ~ 1e-14, the context is as good as infinite


def pure_bias_model(slopes=SLOPES, n_layer=2) -> AlibiGPT2LMHeadModel:
    """An ALiBi model whose q and k are zero (weights and biases): attention = softmax of the bias alone."""
    torch.manual_seed(0)
    config = AlibiGPT2Config(
        vocab_size=64,
        n_embd=8 * len(slopes),
        n_layer=n_layer,
        n_head=len(slopes),
        n_positions=16,
        alibi_slopes=list(slopes),
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = AlibiGPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight[:, : 2 * config.n_embd] = 0.0  # Conv1D (in, 3 * out): [q | k | v] columns
            block.attn.c_attn.bias[: 2 * config.n_embd] = 0.0
    return model


def documents(count=2, length=LENGTH + 10):
    return [torch.randint(1, 64, (length,), generator=torch.Generator().manual_seed(i)) for i in range(count)]


def reference_mass_beyond(slope: float, length: int) -> list[float]:
    """float64 formula: mean over queries i in [L/2, L) of sum_{k >= d} e^{-mk} / sum_{k <= i} e^{-mk}."""
    curve = []
    for d in range(length // 2 + 1):
        per_query = []
        for i in range(length // 2, length):
            weights = [math.exp(-slope * k) for k in range(i + 1)]
            per_query.append(sum(weights[d:]) / sum(weights))
        curve.append(sum(per_query) / len(per_query))
    return curve


def test_pure_bias_model_has_the_measured_window_of_the_formula_to_the_token():
    window = measure_effective_window(pure_bias_model(), documents(), length=LENGTH, eps=0.01)
    expected = [math.ceil(math.log(100) / m) for m in SLOPES]
    assert expected == [5, 10, 19, 37]
    for layer, measured in enumerate(window.measured):
        assert measured == expected, f"layer {layer}: measured {measured}, formula {expected}"
    assert window.theory == pytest.approx([math.log(100) / m for m in SLOPES])
    assert window.windows == 2 and window.max_distance == LENGTH // 2


def test_pure_bias_mass_beyond_distance_equals_the_float64_formula():
    length = 64  # short: the finite context matters here, and the reference includes it
    slopes = [0.5, 0.0625, 0.0, 0.25]
    window = measure_effective_window(pure_bias_model(slopes, n_layer=1), documents(1, 80), length=length, eps=0.01)
    for h, slope in enumerate(slopes):
        expected = torch.tensor(reference_mass_beyond(slope, length), dtype=torch.float64)
        diff = (torch.tensor(window.mass_beyond[0][h], dtype=torch.float64) - expected).abs().max()
        assert diff < 1e-6, f"head {h} (m={slope}): largest difference {diff}"
    assert window.theory[2] is None and window.measured[0][2] is None  # zero slope: no decay, no window


def test_mass_beyond_distance_counts_every_key_beyond_d_for_one_hot_attention():
    length = 8
    attention = torch.zeros(1, 1, length, length)
    attention[0, 0, torch.arange(length), 0] = 1.0  # every query attends only to the first token: distance i
    mass = mass_beyond_distance(attention)[0]  # queries 4..7 at distances 4..7
    expected = torch.tensor([1.0] * 5, dtype=torch.float64)  # every query's distance is >= 4 >= d for d = 0..4
    assert torch.equal(mass, expected), mass


def test_window_wider_than_half_the_input_is_reported_as_not_measured():
    window = measure_effective_window(pure_bias_model([0.5, 2**-8]), documents(1, 70), length=64, eps=0.01)
    assert window.measured[0] == [10, None]  # ln(100) * 256 = 1179 tokens: beyond the 32 measurable
    assert "> 32" in window_table(window)


def test_effective_window_round_trips_through_json_and_draws(tmp_path):
    window = measure_effective_window(pure_bias_model(), documents(1), length=LENGTH, eps=0.05)
    loaded = EffectiveWindow.from_dict(json.loads(json.dumps(window.to_dict())))
    assert loaded == window
    assert loaded.measured[0] == [math.ceil(math.log(20) / m) for m in SLOPES]
    table = window_table(loaded)
    assert "ln(1/0.05) / m_h" in table and table.count("\n") == 1 + len(SLOPES)
    path = plot_effective_window({"alibi": loaded}, tmp_path / "window.png")
    assert path.stat().st_size > 0 and not list(tmp_path.glob("*.tmp"))


def test_measurement_rejects_documents_shorter_than_the_window():
    with pytest.raises(ValueError, match="512"):
        measure_effective_window(pure_bias_model(), documents(1, 100), length=LENGTH)


@pytest.mark.parametrize("eps", [0.0, 1.0, -0.1])
def test_theoretical_window_rejects_eps_outside_zero_one(eps):
    with pytest.raises(ValueError, match=str(eps)):
        theoretical_window([0.5], eps)


def test_bias_heads_pick_the_steepest_middle_and_flattest_slope():
    slopes = torch.tensor(
        [0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.0078125, 0.00390625, 0.7071, 0.3536, 0.1768, 0.0884]
    )  # the paper's 12-head interleave
    picks = bias_heads(slopes)
    assert picks[0] == 8 and picks[-1] == 7 and len(picks) == 3


def test_plot_bias_from_a_saved_model_and_from_a_head_count(tmp_path):
    pure_bias_model().save_pretrained(tmp_path / "model")
    cli_run(["plot-bias", str(tmp_path / "model"), "--output", str(tmp_path / "saved.png"), "--heads", "0", "3"])
    cli_run(["plot-bias", "--n-head", "12", "--output", str(tmp_path / "twelve.png")])
    assert (tmp_path / "saved.png").stat().st_size > 0 and (tmp_path / "twelve.png").stat().st_size > 0
    assert not list(tmp_path.glob("*.tmp"))


def test_plot_bias_rejects_missing_or_double_sources_and_bad_heads(tmp_path):
    with pytest.raises(ValueError, match="not both or neither"):
        cli_run(["plot-bias", "--output", str(tmp_path / "x.png")])
    with pytest.raises(ValueError, match=r"\[4\]"):
        plot_alibi_bias(SLOPES, tmp_path / "x.png", heads=[4])
    assert not (tmp_path / "x.png").exists()
