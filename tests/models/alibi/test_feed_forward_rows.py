"""Inference over long inputs runs each block's norm and MLP a block of rows at a time, added into the residual in
place (`FEED_FORWARD_ROWS`): the same numbers as one call over every row, in every hidden state, with autograd too."""

import pytest
import torch

from hf_alibi.models.alibi import modeling_alibi_gpt2


@pytest.mark.parametrize("gated", [False, True], ids=["gelu_mlp", "gated_mlp"])
def test_rows_at_a_time_give_every_hidden_state_and_logit_of_one_call(make_model, monkeypatch, gated):
    model = make_model(gated_mlp=gated)
    ids = torch.randint(0, model.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # a left-padded row
    with torch.enable_grad():  # autograd on: the whole input at once
        whole = model(ids, attention_mask=mask, output_hidden_states=True)
    monkeypatch.setattr(modeling_alibi_gpt2, "FEED_FORWARD_ROWS", 8)  # 37 rows: 5 parts, the last one short
    with torch.no_grad():
        parts = model(ids, attention_mask=mask, output_hidden_states=True)
    for index, (got, want) in enumerate(zip(parts.hidden_states, whole.hidden_states)):
        torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-6, msg=f"hidden state {index}")
    torch.testing.assert_close(parts.logits, whole.logits.detach(), rtol=1e-6, atol=1e-6)


def test_rows_at_a_time_leave_the_blocks_input_untouched(make_model, monkeypatch):
    monkeypatch.setattr(modeling_alibi_gpt2, "FEED_FORWARD_ROWS", 4)
    model = make_model()
    block = model.transformer.h[0]
    ids = torch.randint(0, model.config.vocab_size, (1, 11))
    captured = {}
    handle = block.register_forward_hook(lambda module, args, output: captured.update(args=args, output=output))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        handle.remove()
    hidden_in = captured["args"][0]
    assert hidden_in.data_ptr() != captured["output"][0].data_ptr(), "the block writes into its own tensor"
    with torch.no_grad():
        expected = model.transformer.wte(ids)  # the first block's input is the embedding, unchanged by the block
    torch.testing.assert_close(hidden_in, expected)
