"""`alibi_skip_eps="auto"`, the default: certified skipping with eps 1e-7 exactly where it was measured to pay (the
`sdpa` backend on CPU, long enough prefills and decoding steps for the heads' slopes), dense elsewhere; an explicit
eps stays as asked, and a saved config keeps what it names."""

import json

import pytest
import torch
from test_attention_skip_ranges import assert_close_to_dense, steep_model

from hf_alibi import AlibiGPT2Config, AlibiGPT2LMHeadModel, get_alibi_slopes
from hf_alibi.models.alibi.attention_alibi import plan_alibi_attention
from hf_alibi.models.alibi.attention_certified import (
    AUTO_EPS,
    AUTO_REACH,
    ROWS,
    near_widths,
    predicted_kept,
    skipping_pays,
)

DEMO_SLOPES = get_alibi_slopes(4)  # the demo checkpoint's: 1/4, 1/16, 1/64, 1/256


@pytest.mark.parametrize(
    "length, measured",
    [(8192, (0.062, 0.125, 0.386, 0.955)), (32768, (0.016, 0.032, 0.106, 0.359))],
)
def test_the_predicted_kept_work_follows_what_the_demo_checkpoint_certified(length, measured):
    """results/skip/auto_prefill_decode*.md: the kept fraction of causal work per head on real held-out text."""
    for slope, kept in zip(DEMO_SLOPES, measured):
        predicted = predicted_kept(slope[None], length, length)
        assert abs(predicted - kept) <= 0.03, f"slope {slope:.4g} at {length}: predicted {predicted:.3f}, kept {kept}"


@pytest.mark.parametrize(
    "query_length, key_length, pays",
    [
        (512, 512, False),
        (1024, 1024, False),
        (2048, 2048, False),
        (4096, 4096, False),
        (6144, 6144, False),
        (8192, 8192, False),
        (11008, 11008, False),
        (11264, 11264, True),
        (16384, 16384, True),
        (32768, 32768, True),
        (1, 1024, False),
        (1, 8192, False),
        (1, 16384, True),
        (1, 32768, True),
    ],
)
def test_auto_skips_the_demo_shape_where_the_benchmark_measured_a_gain(query_length, key_length, pays):
    """Measured on the demo checkpoint (skip / dense, AMD EPYC; Intel Xeon): prefill 2k 1.09x; 0.86x, 4k -; 0.67x,
    8k 0.70x; 0.43x; decoding 8k 1.16x; 1.52x, 16k 0.84x; 0.65x. On the Xeon with two busy processes beside it
    (results/skip/auto_under_load*.md): prefill 4k 1.27x and 1.61x (so 4k stays dense), 8k 0.57x; on a host shared with other test processes
    (results/skip/auto_shared_host_8k_16k.md) 8k 1.15x, 16k 0.61x: prefills skip from ~11.3k."""
    assert skipping_pays(DEMO_SLOPES, query_length, key_length) == pays


def test_flat_slopes_never_pay_where_steep_ones_do():
    assert skipping_pays(torch.tensor([0.5, 0.25]), 8192, 8192)
    assert not skipping_pays(torch.tensor([2.0**-12, 2.0**-14]), 8192, 8192)


def test_auto_takes_the_certified_path_on_cpu_sdpa_for_long_enough_inputs():
    with torch.no_grad():
        assert (
            plan_alibi_attention("sdpa", DEMO_SLOPES, 1, 12288, 12288, skip_eps="auto").path == "sdpa_split_certified"
        )
        plan = plan_alibi_attention("sdpa", DEMO_SLOPES, 1, 12288, 12288, skip_eps="auto")
        assert plan.payload.eps == AUTO_EPS
        assert plan_alibi_attention("sdpa", DEMO_SLOPES, 1, 512, 512, skip_eps="auto").path == "sdpa_split"
        step = plan_alibi_attention("sdpa", DEMO_SLOPES, 1, 1, 16384, skip_eps="auto")
        assert step.path == "sdpa_decode_certified" and step.payload.segmented
        assert plan_alibi_attention("sdpa", DEMO_SLOPES, 1, 1, 4096, skip_eps="auto").path == "sdpa_bank"
        assert plan_alibi_attention("flex_attention", DEMO_SLOPES, 1, 8192, 8192, skip_eps="auto").path == (
            "flex_attention"
        )  # not measured: dense
    # a training step (autograd recording) by the same rule as a prefill
    assert plan_alibi_attention("sdpa", DEMO_SLOPES, 1, 12288, 12288, skip_eps="auto").path == "sdpa_split_certified"
    assert plan_alibi_attention("sdpa", DEMO_SLOPES, 1, 2048, 2048, skip_eps="auto").path == "sdpa_split"


def test_the_default_skips_a_long_prefill_and_equals_dense(record_plans):
    model = steep_model()  # no alibi_skip_eps: the default
    assert model.config.alibi_skip_eps == "auto"
    ids = torch.randint(0, 64, (1, 12288), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), record_plans(model) as plans:
        skipping = model(ids).logits
    assert {plan.path for plan in plans} == {"sdpa_split_certified"}
    model.config.alibi_skip_eps = 0.0
    with torch.no_grad(), record_plans(model) as plans:
        dense = model(ids).logits
    assert {plan.path for plan in plans} == {"sdpa_split"}
    assert_close_to_dense(skipping, dense)


def test_a_saved_eps_is_kept_and_a_config_naming_none_gets_auto(tmp_path):
    with pytest.raises(ValueError, match="alibi_skip_eps.*'sometimes'"):
        AlibiGPT2Config(alibi_skip_eps="sometimes")
    config = AlibiGPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64)
    AlibiGPT2LMHeadModel(config).save_pretrained(tmp_path / "default")
    path = tmp_path / "default" / "config.json"
    assert json.loads(path.read_text())["alibi_skip_eps"] == "auto"
    assert AlibiGPT2Config.from_pretrained(tmp_path / "default").alibi_skip_eps == "auto"
    written = {key: value for key, value in json.loads(path.read_text()).items() if key != "alibi_skip_eps"}
    path.write_text(json.dumps(written))  # a config that names no eps (written before the field existed, or by hand)
    assert AlibiGPT2Config.from_pretrained(tmp_path / "default").alibi_skip_eps == "auto"
    AlibiGPT2LMHeadModel(AlibiGPT2Config(**{**config.to_dict(), "alibi_skip_eps": 0.0})).save_pretrained(
        tmp_path / "dense"
    )
    assert AlibiGPT2Config.from_pretrained(tmp_path / "dense").alibi_skip_eps == 0.0


def test_near_keys_are_read_first_by_the_heads_predicted_to_keep_them_anyway():
    """`near_widths`: a block's worth of keys before each block for the heads whose predicted reach beyond the block
    (`AUTO_REACH / slope`) is at least that; none for a steep head, and None when no head qualifies."""
    demo = torch.tensor([1 / 4, 1 / 16, 1 / 64, 1 / 256])  # reach 96, 384, 1536, 6144 keys beyond the block
    assert near_widths(demo) == (0, ROWS, ROWS, ROWS)
    assert near_widths(torch.tensor([0.0, 1 / 4])) == (ROWS, 0), "a flat head (slope 0) reads every key"
    assert near_widths(torch.tensor([1.0, 0.5])) is None
    assert near_widths(demo, rows=16) == (16, 16, 16, 16) and AUTO_REACH >= 16 / 4
