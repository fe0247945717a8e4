"""Which attention backend and SDPA path the model runs: `attn_implementation` at build, load and switch time, the
config's `alibi_sdpa_split`, and clear errors for backends it cannot run."""

import pytest
import torch

from hf_alibi import AlibiGPT2LMHeadModel, attention_alibi


class BackendSpy:
    """Records which backend function each attention call reaches."""

    def __init__(self, monkeypatch):
        self.calls = []
        for name in ("eager_alibi_attention", "sdpa_alibi_attention", "flex_alibi_attention"):
            monkeypatch.setattr(attention_alibi, name, self._wrap(name, getattr(attention_alibi, name)))

    def _wrap(self, name, function):
        def spy(*args, **kwargs):
            self.calls.append(name.removesuffix("_alibi_attention"))
            return function(*args, **kwargs)

        return spy

    def backends_used_by(self, model, ids):
        self.calls.clear()
        with torch.no_grad():
            model(ids)
        return set(self.calls)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flex_attention"])
def test_attn_implementation_selects_backend_in_from_config_and_from_pretrained(
    backend, make_config, random_ids, tmp_path, monkeypatch
):
    from transformers import AutoModelForCausalLM

    spy = BackendSpy(monkeypatch)
    expected = {backend.removesuffix("_attention")}
    model = AutoModelForCausalLM.from_config(make_config(), attn_implementation=backend)
    assert model.config._attn_implementation == backend
    assert spy.backends_used_by(model, random_ids(1, 9)) == expected
    model.save_pretrained(tmp_path)
    loaded = AlibiGPT2LMHeadModel.from_pretrained(tmp_path, attn_implementation=backend)
    assert spy.backends_used_by(loaded, random_ids(1, 9)) == expected


def test_set_attn_implementation_switches_backend(tiny_model, random_ids, monkeypatch):
    spy = BackendSpy(monkeypatch)
    ids = random_ids(1, 9)
    for backend in ("eager", "flex_attention", "sdpa", "eager"):
        tiny_model.set_attn_implementation(backend)
        assert spy.backends_used_by(tiny_model, ids) == {backend.removesuffix("_attention")}


def test_unsupported_attn_implementation_raises_clear_error(make_config, random_ids):
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="not_a_backend"):
        AutoModelForCausalLM.from_config(make_config(), attn_implementation="not_a_backend")
    # transformers accepts its paged names; the model must refuse them by name rather than compute garbage
    model = AutoModelForCausalLM.from_config(make_config(), attn_implementation="paged|eager")
    with pytest.raises(ValueError, match=r"paged\|eager"):
        model(random_ids(1, 5))


def test_flash_attention_2_without_flash_attn_or_cuda_raises_clear_error(make_config, random_ids):
    from transformers import AutoModelForCausalLM

    # flash-attn missing: transformers refuses at build time; installed but CPU tensors: the model refuses
    with pytest.raises((ImportError, ValueError), match="(?i)flash"):
        model = AutoModelForCausalLM.from_config(make_config(), attn_implementation="flash_attention_2")
        model(random_ids(1, 5))


@pytest.mark.parametrize("split", [True, False])
def test_config_alibi_sdpa_split_selects_the_sdpa_path(split, make_model, random_ids, monkeypatch):
    calls, real_split = [], attention_alibi.sdpa_alibi_split
    monkeypatch.setattr(attention_alibi, "sdpa_alibi_split", lambda *args: calls.append(1) or real_split(*args))
    model = make_model("sdpa", alibi_sdpa_split=split, alibi_sdpa_query_chunk=16)
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :17] = 0  # left padding
    with torch.no_grad():
        model(random_ids(2, 40), attention_mask=mask)
    assert len(calls) == (model.config.n_layer if split else 0), f"the split ran {len(calls)} times"
