"""Baichuan-13B and Baichuan2-13B -> ALiBi GPT-2 is exact: the float64 forward of their architecture
(`baichuan_checkpoints.their_logits`) past `model_max_length`, left-padded and cached, on eager, SDPA, FlexAttention
and the certified-skipping SDPA path, greedy generation included; read from their pickle shards without running any
of their code, from a folder or a Hub id; Baichuan-7B (rotary) and what their code does that ours cannot refused by
name, before any weight is read."""

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch
from torch.nn import functional as F

from baichuan_checkpoints import (
    GENERATIONS,
    HEADS,
    MAX_LENGTH,
    VOCAB,
    save_source,
    their_greedy,
    their_logits,
    their_slopes,
    tiny_checkpoint,
)
from hf_alibi import convert, get_alibi_slopes
from hf_alibi.cli import main
from hf_alibi.conversion import convert_baichuan
from hf_alibi.conversion.baichuan import folded_norm_head, has_norm_head, is_normalised
from hf_alibi.models.alibi.transformers_compat import output_cache

EOS = 2  # their config's eos_token_id
RTOL = 1e-5  # of the logits' scale (their largest magnitude): fp32 against float64, measured ~2e-6
LENGTH = 3 * MAX_LENGTH  # past model_max_length, where their code regrows its mask cache
# path -> (attn_implementation, config overrides that select it, the attention path the plans name)
BACKENDS = {
    "eager": ("eager", {}, "eager"),
    "sdpa": ("sdpa", {"alibi_skip_eps": 0.0}, "sdpa_split"),
    "sdpa_certified": ("sdpa", {"alibi_skip_eps": 1e-7}, "sdpa_split_certified"),
    "flex_attention": ("flex_attention", {}, "flex_attention"),
}


def assert_close_to_theirs(got, expected, rows, what: str) -> None:
    scale = expected[rows].abs().max().item()
    error = (got.double() - expected)[rows].abs().max().item()
    assert error <= RTOL * scale, f"{what}: differs from their forward by {error:.2e} at logits of {scale:.1f}"


def left_padded(length: int = LENGTH, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    ids[0, :7] = 0
    return ids, mask


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """Each generation's checkpoint, written as their folder (pickle shards) and imported from it."""
    models = {}
    for generation in GENERATIONS:
        checkpoint = tiny_checkpoint(generation)
        folder = tmp_path_factory.mktemp(generation) / "source"
        save_source(checkpoint, folder)
        models[generation] = (checkpoint, convert(str(folder)))
    return models


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("generation", sorted(GENERATIONS))
def test_import_matches_their_forward_past_model_max_length_padded_and_cached(
    imported, record_plans, generation, backend
):
    checkpoint, model = imported[generation]
    implementation, overrides, path = BACKENDS[backend]
    model.set_attn_implementation(implementation)
    for name, value in {"alibi_skip_eps": "auto", **overrides}.items():
        setattr(model.config, name, value)
    ids, mask = left_padded()
    expected = their_logits(checkpoint, ids, mask)  # (B, L, V) float64
    with record_plans(model) as plans, torch.no_grad():
        got = model(ids, attention_mask=mask).logits
    assert {plan.path for plan in plans} == {path}
    assert_close_to_theirs(got, expected, mask.bool(), f"{generation} on {backend}, {LENGTH} tokens")
    with torch.no_grad():
        out = model(ids[:, :20], attention_mask=mask[:, :20], use_cache=True)
        steps = []
        for step in range(20, LENGTH):
            out = model(ids[:, step : step + 1], attention_mask=mask[:, : step + 1], cache=output_cache(out))
            steps.append(out.logits[:, -1])
    assert_close_to_theirs(torch.stack(steps, 1), expected[:, 20:], slice(None), f"{generation} cached, {backend}")


@pytest.mark.parametrize("generation", sorted(GENERATIONS))
def test_greedy_generation_left_padded_equals_their_greedy_decoding(imported, generation):
    checkpoint, model = imported[generation]
    model.set_attn_implementation("sdpa")
    ids, mask = left_padded(length=MAX_LENGTH + 4, seed=3)
    with torch.no_grad():
        generated = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    for row in range(2):
        prompt = ids[row][mask[row].bool()].tolist()
        new = their_greedy(checkpoint, prompt, 8)[len(prompt) :]
        if EOS in new:  # generate() ends a row at eos and pads the rest
            new = new[: new.index(EOS) + 1] + [0] * (len(new) - new.index(EOS) - 1)
        assert generated[row, ids.shape[1] :].tolist() == new, f"row {row}: prompt {prompt}"


def test_import_sets_the_switches_baichuan_needs_and_their_slopes():
    model = convert_baichuan(tiny_checkpoint("baichuan_13b"))
    config = model.config
    assert (config.norm_type, config.bias, config.tie_word_embeddings, config.gated_mlp) == (
        "rms_norm",
        False,
        False,
        True,
    )
    assert (config.activation_function, config.n_inner, config.layer_norm_epsilon) == ("silu", 428, 1e-6)
    assert config.n_positions == MAX_LENGTH and config.alibi_slopes is None  # metadata; the paper's rule
    torch.testing.assert_close(model.transformer.alibi_slopes, torch.tensor(their_slopes(HEADS)), atol=0, rtol=0)
    for n in range(1, 129):  # their _get_interleave in fp32 is get_alibi_slopes, bit for bit
        assert torch.equal(torch.tensor(their_slopes(n), dtype=torch.float32), get_alibi_slopes(n)), n


def test_baichuan2_head_is_folded_as_their_norm_head_and_folding_is_idempotent():
    checkpoint = tiny_checkpoint("baichuan2_13b")
    raw = checkpoint.state_dict["lm_head.weight"]
    assert not is_normalised(raw)
    head = convert_baichuan(checkpoint).lm_head.weight
    assert torch.equal(head, F.normalize(raw, dim=-1)) and is_normalised(head)
    for dtype in (torch.float32, torch.bfloat16):
        once = folded_norm_head(raw.to(dtype))
        assert folded_norm_head(once) is once  # kept bit for bit: renormalising would only re-round it
    assert has_norm_head({"vocab_size": 125696}) and has_norm_head({"vocab_size": 64000, "z_loss_weight": 0})
    assert not has_norm_head({"vocab_size": 64000})  # Baichuan-13B's config
    v1 = tiny_checkpoint("baichuan_13b")  # no z_loss_weight: a plain head, used as stored
    assert torch.equal(convert_baichuan(v1).lm_head.weight, v1.state_dict["lm_head.weight"])


def test_baichuan_7b_is_refused_in_one_line_naming_rotary_before_any_weight_is_read(tmp_path, capsys):
    folder = tmp_path / "baichuan-7b"  # no weights at all: the config alone is refused
    folder.mkdir()
    config = {"model_type": "baichuan", "hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="hidden_size=4096.*rotary"):
        convert(str(folder))
    assert main(["convert", str(folder), str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert len(error.strip().splitlines()) == 1 and "rotary position embeddings, not ALiBi" in error
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "overrides, named",
    [
        (dict(hidden_act="swishy"), "hidden_act='swishy'"),
        (dict(tie_word_embeddings=True), "tie_word_embeddings=True"),
        (dict(num_key_value_heads=8), "num_key_value_heads=8"),
        (dict(num_attention_heads=7), "not divisible by num_attention_heads=7"),
    ],
)
def test_what_their_code_does_that_ours_cannot_is_refused_by_name(overrides, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        convert_baichuan(tiny_checkpoint("baichuan_13b", **overrides))


def test_checkpoint_defects_are_refused_by_name():
    checkpoint = tiny_checkpoint("baichuan_13b")
    checkpoint.state_dict["model.norm.weight"] = checkpoint.state_dict["model.norm.weight"].half()
    with pytest.raises(ValueError, match=r"mixes weight dtypes \['torch.float16', 'torch.float32'\]"):
        convert_baichuan(checkpoint)
    checkpoint = tiny_checkpoint("baichuan_13b")
    checkpoint.state_dict["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(2)
    with pytest.raises(ValueError, match="unused.*rotary_emb"):
        convert_baichuan(checkpoint)


class _RunsCode:
    """A pickled object whose loading would run code (write a file): what weights_only=True refuses."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_their_files_are_read_as_tensors_only_and_their_code_never_runs(tmp_path):
    source, marker = tmp_path / "source", tmp_path / "their code ran"
    save_source(tiny_checkpoint("baichuan_13b"), source)
    (source / "modeling_baichuan.py").write_text(f"open({str(marker)!r}, 'w')\nraise RuntimeError('imported')\n")
    (source / "configuration_baichuan.py").write_text((source / "modeling_baichuan.py").read_text())
    convert(str(source))  # their code files are beside the weights, as published: never imported
    shard = source / "pytorch_model-00001-of-00003.bin"
    state = torch.load(shard, weights_only=True)
    with open(shard, "wb") as file:  # the same tensors, and one object that would run code when unpickled
        pickle.dump({**state, "model.extra": _RunsCode(marker)}, file)
    with pytest.raises(ValueError, match="pytorch_model-00001-of-00003.bin: not a plain pickle of tensors"):
        convert(str(source))
    assert not marker.exists()


def test_a_hub_id_is_read_from_the_local_hub_cache_offline(tmp_path, monkeypatch):
    from huggingface_hub import constants

    checkpoint = tiny_checkpoint("baichuan2_13b")
    repo = tmp_path / "hub" / "models--baichuan-inc--Baichuan2-13B-Base"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    save_source(checkpoint, repo / "snapshots" / ("0" * 40))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    model = convert("baichuan-inc/Baichuan2-13B-Base")
    ids = torch.randint(3, VOCAB, (1, 20))
    with torch.no_grad():
        got = model(ids).logits
    assert_close_to_theirs(got, their_logits(checkpoint, ids), slice(None), "from the Hub cache")


_LOADER = r"""
import sys
sys.modules["hf_alibi"] = None  # everything comes from the folder's own code, RMSNorm included
import torch
from transformers import AutoModelForCausalLM

torch.set_num_threads(1)
folder, inputs, output = sys.argv[1:]
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
with torch.no_grad():
    torch.save({"logits": model(torch.load(inputs)).logits, "module": type(model).__module__}, output)
"""


@pytest.mark.slow
def test_converted_folder_runs_without_hf_alibi_through_its_own_code(tmp_path):
    """trust_remote_code users get the RMSNorm too: save_pretrained copies normalization.py with the model's code."""
    checkpoint = tiny_checkpoint("baichuan2_13b")
    save_source(checkpoint, tmp_path / "source")
    convert(str(tmp_path / "source"), tmp_path / "alibi")
    assert (tmp_path / "alibi" / "normalization.py").is_file()
    ids = torch.randint(3, VOCAB, (1, LENGTH))
    torch.save(ids, tmp_path / "ids.pt")
    (tmp_path / "cwd").mkdir()
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    env.pop("PYTHONPATH", None)
    command = [
        sys.executable,
        "-P",
        "-c",
        _LOADER,
        str(tmp_path / "alibi"),
        str(tmp_path / "ids.pt"),
        str(tmp_path / "out.pt"),
    ]
    run = subprocess.run(command, cwd=tmp_path / "cwd", env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    result = torch.load(tmp_path / "out.pt")
    assert result["module"].startswith("transformers_modules")
    assert_close_to_theirs(result["logits"], their_logits(checkpoint, ids), slice(None), "loaded by its own code")
