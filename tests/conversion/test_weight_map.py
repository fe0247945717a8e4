"""The declarative weight map: applied both ways it uses every key exactly once and round-trips bit for bit."""

import pytest
import torch
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
    assert sorted(ours) == ["h.0.c_attn.bias", "h.0.c_attn.weight", "h.1.c_attn.bias", "h.1.c_attn.weight",
                            "wte.weight"]  # fmt: skip
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
