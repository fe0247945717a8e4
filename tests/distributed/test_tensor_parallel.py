"""Tensor parallelism on transformers' engine (`DistributedConfig(tp_size=N)`, torchrun, gloo on CPU) equals one
process: logits (left-padded and packed rows), gradients and greedy generation with a cache, on eager, SDPA and
FlexAttention, with each rank using its own heads' global slopes. Imported BLOOM and MPT checkpoints shard the same way.

Run: `HF_HUB_OFFLINE=1 python -m pytest -q tests/distributed/test_tensor_parallel.py` (`-m "not slow"`: 2 ranks only).
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, BloomConfig, BloomForCausalLM, MptConfig, MptForCausalLM

from conftest import tiny_config_kwargs
from distributed_launch import max_difference, run_workers
from hf_alibi import AlibiGPT2Config, AlibiGPT2LMHeadModel, convert, get_alibi_slopes

BACKENDS = ("eager", "sdpa", "flex_attention")
ATOL = 1e-5  # fp32; measured ~4e-7 (all-reduce sums the heads' contributions in another order)


def make_inputs(vocab: int = 256) -> dict:
    """A left-padded batch (with labels), and one packed row of three documents (restarting position_ids)."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, vocab, (2, 10), generator=generator)  # (B, L)
    mask = torch.ones_like(ids)
    mask[0, :3], ids[0, :3] = 0, 0
    packed = torch.randint(3, vocab, (1, 12), generator=generator)  # (1, L)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])
    return dict(ids=ids, mask=mask, labels=ids.masked_fill(mask == 0, -100), packed=packed, positions=positions)


def one_process(folder, inputs: dict, backend: str, source=None) -> dict:
    """What `distributed_worker.tensor_parallel` computes, in this process (or, for logits, with `source`)."""
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=backend).eval()
    reference = source if source is not None else model
    with torch.no_grad():
        out = {
            "padded": reference(inputs["ids"], attention_mask=inputs["mask"]).logits,
            "packed": model(inputs["packed"], position_ids=inputs["positions"]).logits,
            "generated": model.generate(
                inputs["ids"],
                attention_mask=inputs["mask"],
                max_new_tokens=6,
                do_sample=False,
                pad_token_id=model.config.pad_token_id,
            ),
        }
    if backend != "flex_attention":
        model(inputs["ids"], attention_mask=inputs["mask"], labels=inputs["labels"]).loss.backward()
        out["grads"] = {name: p.grad for name, p in model.named_parameters()}
    return out


def sharded_run(tmp_path, model, nproc: int, backends=BACKENDS, **options):
    """Save `model`, run it tensor-parallel on `nproc` ranks; (folder, inputs, per-rank results)."""
    folder, inputs = tmp_path / "model", make_inputs(model.config.vocab_size)
    model.save_pretrained(folder)
    torch.save(inputs, tmp_path / "inputs.pt")
    ranks = run_workers(
        nproc,
        "tp",
        tmp_path / "out",
        folder=folder,
        inputs=tmp_path / "inputs.pt",
        backends=",".join(backends),
        **options,
    )
    return folder, inputs, ranks


def assert_matches_one_process(folder, inputs, ranks, backends=BACKENDS, source=None) -> None:
    real = inputs["mask"].bool()  # padded query rows are garbage in every implementation
    for backend in backends:
        expected = one_process(folder, inputs, backend, source)
        for rank, result in enumerate(ranks):
            got = result[backend]
            error = max_difference(got["padded"][real], expected["padded"][real])
            assert error < ATOL, f"{backend}, rank {rank}: padded logits differ by {error:.2e}"
            error = max_difference(got["padded_in_rows"][real], expected["padded"][real])
            assert error < ATOL, f"{backend}, rank {rank}: padded logits, 4 rows at a time, differ by {error:.2e}"
            error = max_difference(got["packed"], expected["packed"])
            assert error < ATOL, f"{backend}, rank {rank}: packed-row logits differ by {error:.2e}"
            assert torch.equal(got["generated"], expected["generated"]), f"{backend}, rank {rank}: other tokens"
            for name, grad in expected.get("grads", {}).items():
                error = max_difference(got["grads"][name], grad)
                assert error < ATOL, f"{backend}, rank {rank}: gradient of {name} differs by {error:.2e}"


def tiny_model(n_head: int) -> AlibiGPT2LMHeadModel:
    torch.manual_seed(0)
    config = AlibiGPT2Config(**tiny_config_kwargs(n_head=n_head, n_embd=8 * n_head))
    return AlibiGPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module")
def twelve_heads_on_two_ranks(tmp_path_factory):
    return sharded_run(tmp_path_factory.mktemp("tp2"), tiny_model(12), nproc=2)


def test_two_ranks_hold_half_the_heads_each_and_the_full_slopes_buffer(twelve_heads_on_two_ranks):
    _, _, ranks = twelve_heads_on_two_ranks
    for rank, result in enumerate(ranks):
        for backend in BACKENDS:
            assert result[backend]["heads"] == [(6 * rank, 6 * rank + 6)] * 2, result[backend]["heads"]
            torch.testing.assert_close(result[backend]["slopes"], get_alibi_slopes(12), atol=0, rtol=0)


def test_two_ranks_match_one_process_logits_gradients_and_generation(twelve_heads_on_two_ranks):
    assert_matches_one_process(*twelve_heads_on_two_ranks)


@pytest.mark.slow
def test_twelve_heads_on_four_ranks_match_one_process_and_wrong_slopes_would_not(tmp_path):
    # 3 heads a rank: rank 2 holds slopes 2^-7, 2^-8, 2^-0.5 and rank 3 2^-1.5 .. 2^-3.5 (the interleave)
    folder, inputs, ranks = sharded_run(tmp_path / "right", tiny_model(12), nproc=4)
    assert [r["sdpa"]["heads"][0] for r in ranks] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert_matches_one_process(folder, inputs, ranks)
    # The same run with every rank on the first heads' slopes (Megatron-DeepSpeed issue 227) fails that check.
    _, _, wrong = sharded_run(tmp_path / "wrong", tiny_model(12), nproc=4, backends=("sdpa",), wrong_heads=1)
    error = max_difference(wrong[0]["sdpa"]["padded"], one_process(folder, inputs, "sdpa")["padded"])
    assert error > 100 * ATOL, f"other ranks' slopes moved the logits by only {error:.2e}: the check is blind"


@pytest.mark.slow
@pytest.mark.parametrize("n_head", [8, 16])
@pytest.mark.parametrize("nproc", [2, 4])
def test_power_of_two_head_counts_match_one_process(tmp_path, n_head, nproc):
    assert_matches_one_process(*sharded_run(tmp_path, tiny_model(n_head), nproc=nproc))


@pytest.mark.slow
def test_tp_plan_auto_shards_like_tp_size(tmp_path):
    folder, inputs, ranks = sharded_run(tmp_path, tiny_model(12), nproc=2, backends=("sdpa",), plan="auto")
    assert ranks[1]["sdpa"]["heads"][0] == (6, 12)
    assert_matches_one_process(folder, inputs, ranks, backends=("sdpa",))


def perturbed(model):
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():  # off the LayerNorms' 1/0 and zero biases, so every weight's place matters
            parameter.add_(0.1 * torch.randn_like(parameter))
    return model.eval()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bloom", "mpt"])
def test_imported_bloom_and_mpt_shard_and_match_their_source(tmp_path, family):
    if family == "bloom":  # 12 heads: interleaved slopes; BLOOM's per-head interleaved qkv, its embedding norm
        source = BloomForCausalLM(BloomConfig(vocab_size=96, hidden_size=96, n_layer=2, n_head=12, pad_token_id=0))
    else:  # no biases anywhere, erf GELU, clip_qkv
        source = MptForCausalLM(
            MptConfig(
                vocab_size=96,
                d_model=96,
                n_layers=2,
                n_heads=12,
                max_seq_len=64,
                attn_config={"clip_qkv": 0.5},
                pad_token_id=0,
            )
        )
    source = perturbed(source)
    folder, inputs, ranks = sharded_run(tmp_path, convert(source), nproc=2, backends=("sdpa", "eager"))
    assert_matches_one_process(folder, inputs, ranks, backends=("sdpa", "eager"), source=source)


@pytest.mark.slow
def test_gated_mlp_and_mup_switches_shard_c_fc2_like_c_fc_and_match_one_process(tmp_path):
    torch.manual_seed(0)
    config = AlibiGPT2Config(
        **tiny_config_kwargs(
            n_head=6,
            n_embd=48,
            gated_mlp=True,
            activation_function="silu",
            n_inner=100,
            attn_scale_power=1.0,
            embedding_scale=3.0,
            logit_scale=0.4,
            alibi_scaling={"type": "linear", "factor": 2.0},
        )
    )
    folder, inputs, ranks = sharded_run(
        tmp_path, perturbed(AlibiGPT2LMHeadModel(config)), nproc=2, backends=("sdpa", "eager")
    )
    assert_matches_one_process(folder, inputs, ranks, backends=("sdpa", "eager"))


@pytest.mark.slow
def test_slope_interpolation_scales_each_ranks_heads_by_the_forwards_key_count(tmp_path):
    """`alibi_scaling.train_seq_len` 4: every forward (10-token prefill, cached steps to 16) runs past it; each rank's
    heads take the interpolated slopes of the forward's K, as one process does (itself held to the float64 reference
    in tests/models/alibi/test_alibi_scaling.py)."""
    torch.manual_seed(0)
    config = AlibiGPT2Config(**tiny_config_kwargs(alibi_scaling={"type": "linear", "train_seq_len": 4}))
    folder, inputs, ranks = sharded_run(tmp_path, perturbed(AlibiGPT2LMHeadModel(config)), nproc=2)
    assert_matches_one_process(folder, inputs, ranks)
