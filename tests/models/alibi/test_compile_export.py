"""Static caches on every backend, torch.export with a mask and a dynamic length, and torch.compile(fullgraph=True)
for a training forward and a static-cache decoding step (what transformers' compiled generation runs)."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from test_generation import generate, left_padded
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import StaticCache


@pytest.mark.parametrize("output_attentions", [False, True], ids=["plain", "output_attentions"])
@pytest.mark.parametrize("backend", ["eager", "sdpa", "flex_attention"])
def test_static_cache_generates_the_dynamic_cache_tokens(backend, output_attentions, make_model, random_ids):
    model = make_model(backend, initializer_range=0.3)  # peaked next-token distributions: no ties to flip
    ids, mask = left_padded([random_ids(1, n)[0] for n in (9, 4)])
    settings = dict(output_attentions=output_attentions, return_dict_in_generate=True)
    dynamic = generate(model, ids, mask, **settings)
    static = generate(model, ids, mask, cache_implementation="static", **settings)
    assert torch.equal(static.sequences, dynamic.sequences), f"{static.sequences} vs {dynamic.sequences}"
    if output_attentions:  # a static cache returns its whole buffer: weights cover it, and sum to one per row
        weights = static.attentions[-1][0]  # last step, first layer: (B, H, 1, max_cache_len)
        torch.testing.assert_close(weights.sum(-1), torch.ones_like(weights.sum(-1)))


def test_static_cache_generates_the_dynamic_cache_tokens_with_prompts_past_one_split_block(make_model, random_ids):
    """300- and 170-token prompts: the prefill runs the split's 256-row blocks over the filled part of the buffer."""
    model = make_model("sdpa", initializer_range=0.3)
    ids, mask = left_padded([random_ids(1, n)[0] for n in (300, 170)])
    settings = dict(max_new_tokens=4, min_new_tokens=4)
    dynamic = generate(model, ids, mask, **settings)
    static = generate(model, ids, mask, cache_implementation="static", **settings)
    assert torch.equal(static, dynamic), f"{static[:, 300:]} vs {dynamic[:, 300:]}"


def test_static_cache_forward_gives_the_full_forward_logits_of_a_left_padded_batch(tiny_model, random_ids):
    ids, mask = left_padded([random_ids(1, n)[0] for n in (14, 9)])
    cache = StaticCache(config=tiny_model.config, max_cache_len=24)
    with torch.no_grad():
        full = tiny_model(ids, attention_mask=mask).logits
        prefix = tiny_model(ids[:, :10], attention_mask=mask[:, :10], cache=cache).logits
        rest = [
            tiny_model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache).logits for t in range(10, 14)
        ]
    real = mask.bool()
    torch.testing.assert_close(torch.cat([prefix, *rest], dim=1)[real], full[real], atol=1e-5, rtol=0)


class ShapeRecorder(TorchDispatchMode):
    """Records the shape of every tensor any aten op returns (the bias, masks, scores, kernel outputs)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in torch.utils._pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
        return result


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flex_attention"])
def test_static_cache_prefill_builds_nothing_of_prompt_by_buffer_size_and_matches_full_logits(
    backend, make_model, random_ids, record_plans
):
    """Keys past the prompt are unwritten slots of the buffer: a prefill that sized anything by them (a (q, buffer)
    bias, mask or scores per head) would cost what the buffer costs, whatever the prompt."""
    model = make_model(backend)
    prompt, buffer = 40, 300  # neither is a batch, head, head-dim or vocabulary size of the tiny model
    ids, mask = left_padded([random_ids(1, n)[0] for n in (prompt, 23)])
    cache = StaticCache(config=model.config, max_cache_len=buffer)
    # FlexAttention is a higher-order op that a dispatch mode cannot see into: its block mask's size is checked instead
    recorder = ShapeRecorder() if backend != "flex_attention" else contextlib.nullcontext(None)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        with recorder, record_plans(model) as prepared:
            logits = model(ids, attention_mask=F.pad(mask, (0, buffer - prompt), value=1), cache=cache).logits
    assert prepared[-1].key_length == prompt, f"the prefill attends {prepared[-1].key_length} keys, not {prompt}"
    if backend == "flex_attention":
        assert prepared[-1].payload.block_mask.seq_lengths == (prompt, prompt)
    else:
        sized_by_both = sorted({s for s in recorder.shapes if prompt in s and buffer in s})
        assert not sized_by_both, f"the prefill built tensors sized by prompt and buffer: {sized_by_both}"
        assert any(buffer in s for s in recorder.shapes), "the recorder saw no cache buffer: it recorded nothing"
    real = mask.bool()
    torch.testing.assert_close(logits[real], expected[real], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_export_with_an_attention_mask_and_a_dynamic_length_matches_eager(make_model, random_ids):
    model = make_model("sdpa", use_cache=False)
    ids, mask = left_padded([random_ids(1, n)[0] for n in (9, 5)])
    length = torch.export.Dim("length", min=2, max=4096)
    program = torch.export.export(
        model,
        (),
        kwargs=dict(input_ids=ids, attention_mask=mask),
        dynamic_shapes=dict(input_ids={1: length}, attention_mask={1: length}),
    )
    targets = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert not any("flash_attention_for_cpu" in t for t in targets), "a private CPU kernel entered the exported graph"
    for new_length in (3, 40, 300):  # 300 runs two 256-row SDPA chunks in eager mode
        ids, mask = left_padded([random_ids(1, n)[0] for n in (new_length, new_length - 2)])
        with torch.no_grad():
            exported = program.module()(input_ids=ids, attention_mask=mask).logits
            expected = model(ids, attention_mask=mask).logits
        real = mask.bool()
        torch.testing.assert_close(exported[real], expected[real], atol=1e-5, rtol=0)


def test_model_declares_that_it_compiles_with_fullgraph(tiny_model):
    assert tiny_model._can_compile_fullgraph


@pytest.mark.slow
def test_fullgraph_compiled_training_step_matches_eager(make_model, random_ids):
    ids, mask = left_padded([random_ids(1, n)[0] for n in (20, 13)])
    ids, mask = ids.flip(1), mask.flip(1)  # right padding, as in training (a left pad's row has no keys to see)
    labels = ids.masked_fill(mask == 0, -100)
    eager, compiled = make_model("sdpa").train(), make_model("sdpa").train()
    expected = eager(ids, attention_mask=mask, labels=labels).loss
    loss = torch.compile(compiled, fullgraph=True)(ids, attention_mask=mask, labels=labels).loss  # raises on a break
    expected.backward()
    loss.backward()
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=0)
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=0, msg=f"gradient of {name}")


@pytest.mark.slow
def test_fullgraph_compiled_static_cache_decoding_is_one_graph_and_matches_generate(make_model, random_ids):
    model = make_model("sdpa", initializer_range=0.3)
    ids, mask = left_padded([random_ids(1, n)[0] for n in (9, 4)])
    expected = generate(model, ids, mask, max_new_tokens=6, min_new_tokens=6)
    cache = StaticCache(config=model.config, max_cache_len=32)
    step_mask = F.pad(mask, (0, 32 - mask.shape[1]), value=1)  # one shape for every step, as generate() pads it
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    step = torch.compile(model.forward, fullgraph=True)
    with torch.no_grad():
        tokens = [model(ids, attention_mask=step_mask, cache=cache).logits[:, -1:].argmax(-1)]
        for _ in range(5):
            tokens.append(step(tokens[-1], attention_mask=step_mask, cache=cache).logits[:, -1:].argmax(-1))
    assert torch.equal(torch.cat([ids, *tokens], dim=1), expected)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, "decoding steps recompiled"


@pytest.mark.slow
def test_transformers_executorch_recipe_exports_a_static_cache_decoder_that_matches_eager(tiny_model, random_ids):
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    tiny_model.generation_config.cache_implementation = "static"
    exportable = TorchExportableModuleForDecoderOnlyLM(tiny_model, batch_size=1, max_cache_len=24)
    ids = random_ids(1, 12)
    program = exportable.export(input_ids=ids[:, :1], cache_position=torch.tensor([0])).module()
    with torch.no_grad():  # one token per call, as ExecuTorch's runner decodes
        decoded = torch.cat(
            [program(input_ids=ids[:, t : t + 1], cache_position=torch.tensor([t])) for t in range(12)], 1
        )
        expected = tiny_model(ids).logits
    torch.testing.assert_close(decoded, expected, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_compiled_flex_model_with_a_padding_mask_or_packed_rows_matches_eager_on_cpu(make_model, random_ids):
    """What the README advises for FlexAttention: `torch.compile(model)`. On CPU torch 2.13 lowers a mask_mod only if
    it reads the mask as given (not a tensor the graph computed, `.bool()` included) and inputs laid out as
    (B, H, L, D)."""
    model = make_model("flex_attention")
    ids, mask = left_padded([random_ids(1, n)[0] for n in (40, 23)])
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        compiled = torch.compile(model)(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(compiled[real], expected[real], atol=1e-5, rtol=0)
    packed, positions = random_ids(1, 40), torch.cat([torch.arange(25), torch.arange(15)])[None]  # two documents
    with torch.no_grad():
        expected = model(packed, position_ids=positions).logits
        compiled = torch.compile(model)(packed, position_ids=positions).logits
    torch.testing.assert_close(compiled, expected, atol=1e-5, rtol=0)
