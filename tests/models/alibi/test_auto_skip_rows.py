"""`alibi_skip_eps="auto"` applies one rule to a row wherever it runs: a decoding row skips under continuous batching
exactly where it skips under `generate()` (the same rows, counted by their plans' paths), and a packed row's
documents skip as each would alone; results equal dense attention within the certificate's bound, and equal the
documents run separately."""

import sys
from pathlib import Path

import pytest
import torch

from conftest import CONTINUOUS_BATCHING, NO_CONTINUOUS_BATCHING
from hf_alibi import attention_route, get_alibi_slopes
from hf_alibi.models.alibi.attention_alibi import alibi_attention, plan_alibi_attention
from hf_alibi.models.alibi.attention_plan import AUTO_EPS

sys.path.insert(0, str(Path(__file__).parents[3] / "tests"))  # tests/: the skipping tests' steep model
from test_attention_skip_ranges import assert_close_to_dense, steep_model  # noqa: E402

DEMO_SLOPES = get_alibi_slopes(4)  # 1/4 .. 1/256: "auto" skips a decoding row from ~15.3k keys, a prefill from 4k
LONG = 16_500  # a decoding row "auto" skips
NEW_TOKENS = 4


@pytest.mark.skipif(not CONTINUOUS_BATCHING, reason=NO_CONTINUOUS_BATCHING)
def test_a_long_requests_decoding_row_skips_in_the_paged_plan_and_short_ones_stay_batched():
    """Against the request's dense attention in float64: within 2 * eps * max|v| plus fp32 rounding."""
    requests = [(1, LONG), (1, 40), (1, 9)]  # (new tokens, keys)
    cu_q = torch.tensor([0] + [q for q, _ in requests]).cumsum(0)
    cu_k = torch.tensor([0] + [k for _, k in requests]).cumsum(0)
    kwargs = {"cu_seq_lens_q": cu_q, "cu_seq_lens_k": {"full_attention": cu_k}, "read_index": [], "write_index": []}
    generator = torch.Generator().manual_seed(0)
    query = 3 * torch.randn(1, 4, 3, 16, generator=generator)
    key, value = 3 * torch.randn(2, 1, 4, int(cu_k[-1]), 16, generator=generator)
    plan = plan_alibi_attention("sdpa", DEMO_SLOPES, 1, 3, 3, paged_kwargs=kwargs, skip_eps="auto")
    (segment,) = plan.payload.segments
    assert segment.plan.path.startswith("sdpa_decode_certified") and segment.plan.payload.eps == AUTO_EPS
    assert plan.payload.decode.rows.tolist() == [1, 2]  # the short requests share the batched dense call
    got = alibi_attention(query, key, value, plan, 0.25)[0][:, 0]  # (1, H, D) of the long request
    dense = plan_alibi_attention("eager", DEMO_SLOPES, 1, 1, LONG)
    want = alibi_attention(
        query[:, :, :1].double(), key[:, :, :LONG].double(), value[:, :, :LONG].double(), dense, 0.25
    )[0][:, 0]
    bound = 2 * AUTO_EPS * value[:, :, :LONG].abs().max() + 1e-5
    assert (got.double() - want).abs().max() <= bound


@pytest.mark.skipif(not CONTINUOUS_BATCHING, reason=NO_CONTINUOUS_BATCHING)
def test_continuous_batching_skips_the_decoding_rows_generate_skips(record_plans):
    """A 16.5k-token request beside a short one: `generate()` and `generate_batch` skip the same decoding rows (all
    of the long request's, none of the short one's) and give the same tokens, which dense decoding gives too."""
    from test_continuous_batching import greedy_config
    from transformers import ContinuousBatchingConfig

    model = steep_model()
    assert model.config.alibi_skip_eps == "auto"
    generator = torch.Generator().manual_seed(1)
    long_prompt, short_prompt = (torch.randint(3, 64, (n,), generator=generator).tolist() for n in (LONG, 20))
    alone, skipped_alone = [], 0
    for prompt in (long_prompt, short_prompt):
        with torch.no_grad(), record_plans(model) as plans:
            out = model.generate(torch.tensor([prompt]), generation_config=greedy_config(NEW_TOKENS))
        alone.append(out[0, len(prompt) :].tolist())
        skipped_alone += sum(p.query_length == 1 and "certified" in p.path for p in plans)
    cb = ContinuousBatchingConfig(num_blocks=(LONG + 128) // 64 + 8, page_size=64, max_batch_tokens=4096)
    with record_plans(model) as plans:
        outputs = model.generate_batch(
            inputs=[long_prompt, short_prompt],
            generation_config=greedy_config(NEW_TOKENS),
            continuous_batching_config=cb,
            progress_bar=False,
        )
    batched = [outputs[f"req_{i}"].generated_tokens for i in range(2)]
    segments = [s.plan for p in plans if p.path == "paged" for s in p.payload.segments if s.plan.query_length == 1]
    skipped_batched = sum("certified" in plan.path for plan in segments)
    assert batched == alone
    # the first new token comes from the prefill: each later one from a decoding row, in every layer
    assert skipped_alone == skipped_batched == (NEW_TOKENS - 1) * model.config.n_layer
    model.config.alibi_skip_eps = 0.0
    with torch.no_grad():
        dense = model.generate(torch.tensor([long_prompt]), generation_config=greedy_config(NEW_TOKENS))
    assert dense[0, LONG:].tolist() == alone[0]


def packed(documents):
    ids = torch.cat(documents)[None]  # (1, total)
    positions = torch.cat([torch.arange(len(d)) for d in documents])[None]  # restarting at 0
    return ids, positions


DOCUMENTS = (11776, 300, 1, 700)  # one long enough for "auto" to skip, short ones that stay dense


def test_a_packed_rows_long_document_skips_and_every_document_equals_its_own_forward(record_plans):
    model = steep_model()
    generator = torch.Generator().manual_seed(2)
    documents = [torch.randint(0, 64, (n,), generator=generator) for n in DOCUMENTS]
    ids, positions = packed(documents)
    with torch.no_grad(), record_plans(model) as plans:
        skipping = model(ids, position_ids=positions).logits[0]  # (total, V)
        alone = torch.cat([model(d[None]).logits[0] for d in documents])
    route = attention_route(model, ids, position_ids=positions)
    assert {plan.path for plan in plans[:1]} == {route.name} == {"sdpa_packed"}
    expected = ["sdpa_split_certified", "sdpa_split", "sdpa_bank", "sdpa_split"]
    assert [route.document_routes[n] for n in DOCUMENTS] == expected
    torch.testing.assert_close(skipping, alone, atol=1e-6, rtol=0)  # the same calls on the same tokens
    model.config.alibi_skip_eps = 0.0
    with torch.no_grad(), record_plans(model) as plans:
        dense = model(ids, position_ids=positions).logits[0]
    dense_route = attention_route(model, ids, position_ids=positions)
    assert plans[0].path == dense_route.name == "sdpa_packed"  # dense too: each document alone, not one mask
    assert set(dense_route.document_routes.values()) <= {"sdpa_split", "sdpa_bank"}
    assert_close_to_dense(skipping, dense)
    reference = model.double()
    with torch.no_grad():
        exact = torch.cat([reference(d[None]).logits[0] for d in documents])  # float64, dense, each document alone
    fp32_error = (dense.double() - exact).abs().max().item()
    skip_error = (skipping.double() - exact).abs().max().item()
    assert skip_error <= fp32_error + 1e-6 * exact.abs().max().item(), (skip_error, fp32_error)


def test_a_packed_training_step_that_skips_gives_the_documents_own_gradients(record_plans):
    documents = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(3)) for n in (11776, 90)]
    ids, positions = packed(documents)
    packed_model, alone_model = steep_model(), steep_model()
    with record_plans(packed_model) as plans:
        packed_model(ids, position_ids=positions).logits.square().mean(-1).sum().backward()
    assert plans[0].payload.parts[0][3].path == "sdpa_split_certified"
    sum(alone_model(d[None]).logits.square().mean(-1).sum() for d in documents).backward()
    for (name, got), (_, want) in zip(packed_model.named_parameters(), alone_model.named_parameters()):
        difference = (got.grad - want.grad).abs().max().item()
        assert difference <= 1e-5 * want.grad.abs().max().item() + 1e-7, f"{name}: {difference:.3g}"
