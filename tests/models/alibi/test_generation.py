"""generate(): left-padded batches decode like single prompts, past n_positions, and the same with or without cache."""

import pytest
import torch

from conftest import PAD

NEW_TOKENS = 10


@pytest.fixture
def peaked_model(make_model):
    # Larger weights than GPT-2's init make next-token distributions peaked, so ties cannot flip a comparison
    return make_model(initializer_range=0.3)


def generate(model, ids, mask=None, **kwargs):
    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD) | kwargs
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask if mask is not None else torch.ones_like(ids), **kwargs)


def left_padded(prompts):
    length = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), length), PAD)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, length - len(prompt) :], mask[row, length - len(prompt) :] = prompt, 1
    return ids, mask


@pytest.mark.parametrize("num_beams", [1, 3], ids=["greedy", "beam_search"])
def test_left_padded_batch_generates_what_each_prompt_generates_alone(num_beams, peaked_model, random_ids):
    prompts = [random_ids(1, n)[0] for n in (9, 4, 6)]
    ids, mask = left_padded(prompts)
    batched = generate(peaked_model, ids, mask, num_beams=num_beams)[:, ids.shape[1] :]
    for row, prompt in enumerate(prompts):
        alone = generate(peaked_model, prompt[None], num_beams=num_beams)[0, len(prompt) :]
        assert torch.equal(batched[row], alone), f"prompt {row}: batched {batched[row].tolist()} vs {alone.tolist()}"


def test_generation_beyond_n_positions_matches_greedy_full_forwards(peaked_model, random_ids):
    prompt = random_ids(1, 12)
    new = 2 * peaked_model.config.n_positions  # ends at 44 tokens, n_positions is 16
    generated = generate(peaked_model, prompt, max_new_tokens=new, min_new_tokens=new)
    assert generated.shape == (1, 12 + new)
    expected = prompt
    with torch.no_grad():  # reference: argmax of a full forward, no cache, one token at a time
        for _ in range(new):
            next_token = peaked_model(expected, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            expected = torch.cat([expected, next_token], dim=1)
    assert torch.equal(generated, expected), f"{generated.tolist()} vs {expected.tolist()}"


@pytest.mark.parametrize("num_beams", [1, 3], ids=["greedy", "beam_search"])
def test_generation_with_cache_equals_generation_without(num_beams, peaked_model, random_ids):
    ids, mask = left_padded([random_ids(1, n)[0] for n in (14, 7)])
    settings = dict(num_beams=num_beams, max_new_tokens=12, min_new_tokens=12)
    cached = generate(peaked_model, ids, mask, **settings)
    uncached = generate(peaked_model, ids, mask, use_cache=False, **settings)
    assert torch.equal(cached, uncached), f"{cached.tolist()} vs {uncached.tolist()}"
