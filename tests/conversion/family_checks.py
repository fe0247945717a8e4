"""Checks shared by the BLOOM, MPT and Falcon import tests: an imported model against transformers' own class."""

import torch

from hf_alibi.models.alibi.transformers_compat import output_cache, with_cache

BACKENDS = ("eager", "sdpa", "flex_attention")
VOCAB = 96
ATOL = 2e-5  # fp32 rounding of different (equal in exact arithmetic) summation orders; measured ~1e-6


def perturb(model: torch.nn.Module) -> torch.nn.Module:
    """Move every parameter off its initial value (LayerNorms at 1/0, zero biases) so each weight's place matters."""
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    return model.eval()


def left_padded_batch(length: int = 14) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of random ids, the first left-padded by 5 (ids and `(B, L)` attention mask)."""
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(3, VOCAB, (2, length), generator=generator)  # (B, L)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    ids[0, :5] = 0
    return ids, mask


def assert_same_logits(ours, theirs, backend: str) -> None:
    """Full forward and cached decoding, on a left-padded batch: ours (on `backend`) == theirs at every real token."""
    ours.set_attn_implementation(backend)
    ids, mask = left_padded_batch()
    real = mask.bool()  # (B, L): padded query rows are garbage in every implementation
    with torch.no_grad():
        expected = theirs(ids, attention_mask=mask).logits  # (B, L, V)
        got = ours(ids, attention_mask=mask).logits
        error = (got - expected)[real].abs().max().item()
        assert error < ATOL, f"{backend}: full forward differs by {error:.2e}"
        prefix = 8
        our_out = ours(ids[:, :prefix], attention_mask=mask[:, :prefix], use_cache=True)
        their_out = theirs(ids[:, :prefix], attention_mask=mask[:, :prefix], use_cache=True)
        for step in range(prefix, ids.shape[1]):
            token, step_mask = ids[:, step : step + 1], mask[:, : step + 1]
            our_out = ours(token, attention_mask=step_mask, cache=output_cache(our_out), use_cache=True)
            their_out = theirs(token, attention_mask=step_mask, **with_cache(output_cache(their_out)), use_cache=True)
            error = (our_out.logits - their_out.logits).abs().max().item()
            assert error < ATOL, f"{backend}: cached decoding differs by {error:.2e} at step {step}"
            step_error = (our_out.logits[:, -1] - expected[:, step]).abs().max().item()
            assert step_error < ATOL, f"{backend}: cached step {step} differs from the full forward by {step_error:.2e}"


def assert_same_weights(original: torch.nn.Module, round_trip: torch.nn.Module) -> None:
    """Every tensor of `original` comes back bit for bit, and nothing else."""
    before, after = original.state_dict(), round_trip.state_dict()
    assert set(before) == set(after), f"keys differ: {set(before) ^ set(after)}"
    differing = [key for key, tensor in before.items() if not torch.equal(after[key], tensor)]
    assert not differing, f"weights changed in the round trip: {differing}"
