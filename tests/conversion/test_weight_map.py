"""The declarative conversion tables: a weight map applied both ways uses every key exactly once and round-trips bit
for bit; a requirement table refuses by field name. Each family with an export round-trips both ways."""

from types import SimpleNamespace

import pytest
import torch
from transformers import BloomConfig, BloomForCausalLM, MptConfig, MptForCausalLM

from family_checks import VOCAB, assert_same_weights, perturb
from hf_alibi.conversion import convert_bloom, convert_mpt, export_bloom, export_mpt
from hf_alibi.conversion.common import Requirement, require
from hf_alibi.conversion.weight_map import TRANSPOSE, Entry, map_weights, per_head_qkv

N_HEAD, HEAD_DIM = 3, 2
TABLE = (
    Entry("wte.weight", "embed.weight"),
    Entry("h.{i}.c_attn.weight", "layers.{i}.qkv.weight", per_head_qkv(N_HEAD).then(TRANSPOSE)),
    Entry("h.{i}.c_attn.bias", "layers.{i}.qkv.bias", per_head_qkv(N_HEAD)),
)


def their_state(n_layer: int = 2) -> dict[str, torch.Tensor]:
    width = N_HEAD * HEAD_DIM
    state = {"embed.weight": torch.randn(5, width)}
    for i in range(n_layer):
        state[f"layers.{i}.qkv.weight"] = torch.randn(3 * width, width)  # (3C, C)
        state[f"layers.{i}.qkv.bias"] = torch.randn(3 * width)  # (3C,)
    return state


def test_a_map_applied_both_ways_gives_back_every_tensor_bit_for_bit():
    theirs = their_state()
    ours = map_weights(TABLE, theirs, 2, to="ours", what="toy")
    assert sorted(ours) == [
        "h.0.c_attn.bias",
        "h.0.c_attn.weight",
        "h.1.c_attn.bias",
        "h.1.c_attn.weight",
        "wte.weight",
    ]
    assert ours["h.1.c_attn.weight"].shape == (6, 18)  # Conv1D (in, out)
    back = map_weights(TABLE, ours, 2, to="theirs", what="toy")
    assert sorted(back) == sorted(theirs)
    assert all(torch.equal(back[key], tensor) for key, tensor in theirs.items())


def test_per_head_qkv_groups_rows_of_each_head_into_all_q_all_k_all_v():
    rows = torch.arange(3 * N_HEAD * HEAD_DIM)  # BLOOM's order: head 0's q, k, v rows, then head 1's, ...
    grouped = per_head_qkv(N_HEAD).to_ours(rows).reshape(3, N_HEAD, HEAD_DIM)  # (qkv, h, d)
    for head in range(N_HEAD):
        for part in range(3):  # q, k, v
            start = (head * 3 + part) * HEAD_DIM
            assert grouped[part, head].tolist() == list(range(start, start + HEAD_DIM))


def test_a_key_the_map_does_not_read_is_refused_by_name():
    theirs = their_state() | {"layers.0.rotary.inv_freq": torch.ones(2)}
    with pytest.raises(ValueError, match=r"toy: .*unused \['layers.0.rotary.inv_freq'\]"):
        map_weights(TABLE, theirs, 2, to="ours", what="toy")


def test_a_key_the_map_reads_but_the_state_lacks_is_refused_by_name():
    theirs = their_state()
    del theirs["layers.1.qkv.bias"]
    with pytest.raises(ValueError, match=r"missing \['layers.1.qkv.bias'\]"):
        map_weights(TABLE, theirs, 2, to="ours", what="toy")
    with pytest.raises(ValueError, match=r"missing \['h.2.c_attn.weight', 'h.2.c_attn.bias'\]"):
        map_weights(TABLE, map_weights(TABLE, their_state(), 2, to="ours", what="toy"), 3, to="theirs", what="toy")


def test_a_map_naming_a_key_twice_is_refused_by_name():
    table = (*TABLE, Entry("lm_head.weight", "embed.weight"))  # read twice on import
    with pytest.raises(ValueError, match=r"read more than once: \['embed.weight'\]"):
        map_weights(table, their_state(), 2, to="ours", what="toy")
    with pytest.raises(ValueError, match=r"written more than once: \['embed.weight'\]"):
        map_weights(table, {"wte.weight": torch.ones(1)}, 2, to="theirs", what="toy")
    with pytest.raises(ValueError, match="'sideways'"):
        map_weights(TABLE, their_state(), 2, to="sideways", what="toy")


def test_requirements_refuse_the_first_unmet_field_by_name_and_accept_an_absent_one():
    config = SimpleNamespace(n_head=4, hidden_size=32, activation="gelu", n_layer=2)
    table = (
        Requirement("no_such_field", True),  # a config object without the field: nothing to refuse
        Requirement("n_head", frozenset({2, 4})),
        Requirement("hidden_size", lambda config: 8 * config.n_head),
        Requirement("activation", "tanh", "{family} wants {accepted!r} for {field}, not {value!r} ({config.n_head})"),
        Requirement("n_layer", 99),
    )
    with pytest.raises(ValueError, match=r"^Toy wants 'tanh' for activation, not 'gelu' \(4\)$"):
        require(config, table, "Toy", "{family} needs {field}={accepted!r}")
    with pytest.raises(ValueError, match=r"^Toy needs n_layer=99$"):
        require(config, table[:3] + table[4:], "Toy", "{family} needs {field}={accepted!r}")
    require({"attn": {"alibi": True}}, (Requirement("attn.alibi", True),), "Toy", "")  # dotted into dicts


def tiny_bloom() -> BloomForCausalLM:
    return perturb(BloomForCausalLM(BloomConfig(vocab_size=VOCAB, hidden_size=48, n_layer=2, n_head=6)))


def tiny_mpt() -> MptForCausalLM:
    config = MptConfig(
        vocab_size=VOCAB, d_model=48, n_layers=2, n_heads=6, max_seq_len=16, attn_config={"clip_qkv": 2.0}
    )
    return perturb(MptForCausalLM(config))


# family -> (a source model of that family, import, export)
FAMILIES = {"bloom": (tiny_bloom, convert_bloom, export_bloom), "mpt": (tiny_mpt, convert_mpt, export_mpt)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_export_of_an_import_and_import_of_an_export_give_back_every_weight(family, dtype):
    make_source, to_alibi, to_family = FAMILIES[family]
    source = make_source().to(dtype)
    assert_same_weights(source, to_family(to_alibi(source)))
    alibi = perturb(to_alibi(source))  # any ALiBi model of a shape the family holds, not only an imported one
    assert_same_weights(alibi, to_alibi(to_family(alibi)))
