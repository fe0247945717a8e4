"""Certified skipping in training (`alibi_skip_eps` with gradients on): the forward drops only mass certified from
that step's own queries and keys, and the backward is the exact gradient of the attention it computed (the causal
attention restricted to the kept keys), held to a float64 reference of that same truncated attention."""

import torch
from hypothesis import given
from hypothesis import strategies as st
from test_attention_skip import CHECKS, dropped_mass, exact_weights, problems, real_rows, split_problem

from alibi_reference import reference_attention
from hf_alibi import AlibiGPT2Config, AlibiGPT2LMHeadModel, get_alibi_slopes
from hf_alibi.models.alibi.attention_alibi import alibi_attention, plan_alibi_attention
from hf_alibi.models.alibi.attention_certified import certified_split


def truncated_gradients(p, row_starts, grad_output):
    """Float64 output and (dq, dk, dv) of the reference attention with keys before each row's start masked."""
    exact = [p[name].double().requires_grad_() for name in ("query", "key", "value")]
    output, _, has_keys = reference_attention(
        *exact, p["slopes"], scale=p["scaling"], offset=p["offset"], key_padding=p["key_padding"], first_key=row_starts
    )
    output.backward(grad_output.double() * has_keys)
    return output.detach(), [t.grad for t in exact]


@CHECKS
@given(problems(), st.integers(2, 16))
def test_training_forward_certifies_its_own_step_and_backward_is_the_truncated_attentions_gradient(p, rows):
    p, plan = split_problem(p)  # gradients on: the training path
    if plan is None:
        return  # no certified split for this problem
    q_len = p["query"].shape[2]
    leaves = [p[name].clone().requires_grad_() for name in ("query", "key", "value")]
    output, ranges = certified_split(*leaves, plan, p["scaling"], rows=rows, key_block=p["key_block"])
    row_starts = ranges.first_key.repeat_interleave(rows, dim=1)[:, :q_len]  # (H, q)
    mass = dropped_mass(exact_weights(p), row_starts).masked_fill(~real_rows(p), 0.0)  # (B, H, q)
    assert float(mass.max()) <= p["eps"], f"largest dropped mass {float(mass.max()):.3e} > eps {p['eps']:.0e}"
    grad_output = torch.randn(output.shape, generator=torch.Generator().manual_seed(0)) * real_rows(p)[..., None]
    output.backward(grad_output)
    expected, grads = truncated_gradients(p, row_starts, grad_output)
    rows_ok = real_rows(p)[..., None]
    difference = float(((output.detach().double() - expected).abs() * rows_ok).max())
    assert difference <= 1e-4 * (1 + float(expected.abs().max())), f"output: largest difference {difference:.3g}"
    for name, got, want in zip(("query", "key", "value"), (t.grad for t in leaves), grads):
        scale = 1 + float(want.abs().max())
        difference = float((got.double() - want).abs().max())
        assert difference <= 2e-4 * scale, f"d{name}: largest difference {difference:.3g} (scale {scale:.3g})"


def test_steep_heads_skip_far_keys_in_training_and_the_gradient_is_that_of_the_kept_keys():
    generator = torch.Generator().manual_seed(0)
    slopes = get_alibi_slopes(4)  # 1/4 .. 1/256: the steepest drops most of 1024 keys
    query, key, value = (torch.randn(1, 4, 1024, 16, generator=generator) for _ in range(3))
    plan = plan_alibi_attention("sdpa", slopes, 1, 1024, 1024, skip_eps=1e-7)
    assert plan.path == "sdpa_split_certified"
    leaves = [t.clone().requires_grad_() for t in (query, key, value)]
    output, ranges = certified_split(*leaves, plan, 0.25)
    assert ranges.first_key[0, -1] > 512, f"slope 1/4 must skip most of the 768 earlier keys: {ranges.first_key[0]}"
    grad_output = torch.randn(output.shape, generator=generator)
    output.backward(grad_output)
    p = dict(query=query, key=key, value=value, slopes=slopes, scaling=0.25, offset=0, key_padding=None)
    row_starts = ranges.first_key.repeat_interleave(ranges.rows, dim=1)[:, :1024]  # (H, q)
    _, grads = truncated_gradients(p, row_starts, grad_output)
    for got, want in zip((t.grad for t in leaves), grads):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)
    dense_plan = plan_alibi_attention("sdpa", slopes, 1, 1024, 1024)
    with torch.no_grad():
        dense = alibi_attention(query, key, value, dense_plan, 0.25)[0].transpose(1, 2)  # (1, H, q, D)
    bound = 2 * 1e-7 * float(value.abs().max()) + 1e-5  # Theorem 1, and fp32 rounding
    assert float((output.detach() - dense).abs().max()) <= bound


def test_a_short_training_run_with_skipping_tracks_dense_training(record_plans):
    """Two copies of a model trained on the same batches, one skipping (eps 1e-7): each step's loss of the skipping
    model equals the dense loss of the same weights within fp32 rounding, and the runs stay together."""
    torch.manual_seed(0)
    config = AlibiGPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=64, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0
    )
    models = {
        eps: AlibiGPT2LMHeadModel(AlibiGPT2Config(**{**config.to_dict(), "alibi_skip_eps": eps})) for eps in (0.0, 1e-7)
    }
    models[1e-7].load_state_dict(models[0.0].state_dict())
    optimizers = {eps: torch.optim.SGD(model.parameters(), lr=0.05) for eps, model in models.items()}
    generator = torch.Generator().manual_seed(1)
    losses = {eps: [] for eps in models}
    for _ in range(8):
        ids = torch.randint(0, 64, (1, 768), generator=generator)
        for eps, model in models.items():
            with record_plans(model) as plans:
                loss = model(ids, labels=ids).loss
            assert {plan.path for plan in plans} == {"sdpa_split_certified" if eps else "sdpa_split"}
            losses[eps].append(loss.item())
            if eps:  # the dense loss at the skipping model's own weights: Theorem 1's bound, through the network
                with torch.no_grad():
                    model.config.alibi_skip_eps = 0.0
                    same_weights = model(ids, labels=ids).loss.item()
                    model.config.alibi_skip_eps = eps
                assert abs(loss.item() - same_weights) <= 1e-5, (loss.item(), same_weights)
            optimizers[eps].zero_grad()
            loss.backward()
            optimizers[eps].step()
    for dense, skipping in zip(losses[0.0], losses[1e-7]):
        assert abs(dense - skipping) <= 1e-4, (losses[0.0], losses[1e-7])
