"""Certified skipping while decoding on a cache that is reset, cropped, refilled, reordered or reused for another
request: the cache's running summary of key norms (`RunningKeyNorms`) must bound every key the step reads (the premise
N_K >= max |k_j| of the certificate), and the logits must equal dense attention's.

The model is built so that a stale summary fails loudly: layer 0's key of token `LOW` is ~0 and every other token's
key points along `LOW`'s query, so a summary remembering a run of `LOW` keys certifies that far keys of another
request, which hold most of the softmax mass, are negligible.
"""

import copy
import functools
import gc
import pickle

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import Cache, DynamicCache, DynamicLayer, StaticCache

from hf_alibi import AlibiGPT2Config, AlibiGPT2LMHeadModel
from hf_alibi.models.alibi.attention_certified import KEY_BLOCK
from hf_alibi.models.alibi.attention_key_norms import KeyNormSummaries, RunningKeyNorms
from hf_alibi.models.alibi.attention_skip import key_block_norms

EPS = 1e-7
VOCAB, WIDTH, HEADS = 64, 32, 4
LOW = 5  # the token whose layer-0 key is ~0
LOGIT = 30.0  # nats: q_LOW . k_t * scale of the token most aligned with LOW's query
MAX_CACHE = 400


@functools.cache
def blind_spot_model() -> tuple[AlibiGPT2LMHeadModel, int]:
    """The model (slopes 1/4 .. 1/256) and the token whose layer-0 key scores highest against `LOW`'s query.

    Layer 0's key projection is rank one: k_t = c (x_t . d) u, x_t the token's layer-0 input, d a unit direction
    orthogonal to x_LOW (so k_LOW = 0 up to rounding) and u, per head, the unit direction of LOW's query."""
    config = AlibiGPT2Config(
        n_embd=WIDTH,
        n_layer=2,
        n_head=HEADS,
        vocab_size=VOCAB,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = AlibiGPT2LMHeadModel(config).eval()
    attn = model.transformer.h[0].attn
    with torch.no_grad():
        x = model.transformer.h[0].ln_1(model.transformer.ln_embd(model.transformer.wte.weight))  # (V, C)
        d = torch.randn(WIDTH, generator=torch.Generator().manual_seed(1))
        d -= (d @ x[LOW]) / (x[LOW] @ x[LOW]) * x[LOW]
        d /= d.norm()
        query = (x[LOW] @ attn.c_attn.weight[:, :WIDTH] + attn.c_attn.bias[:WIDTH]).view(HEADS, -1)  # (H, D)
        along = query / query.norm(dim=-1, keepdim=True)  # (H, D)
        high = int((x @ d).argmax())
        c = LOGIT / (float(x[high] @ d) * float(query.norm(dim=-1).min()) * attn.scaling)
        attn.c_attn.weight[:, WIDTH : 2 * WIDTH] = c * d[:, None] * along.reshape(1, WIDTH)  # (C, C)
        attn.c_attn.bias[WIDTH : 2 * WIDTH] = 0.0
    return model, high


def make_cache(kind: str, batch: int):
    if kind == "dynamic":
        return DynamicCache(config=blind_spot_model()[0].config)
    return StaticCache(config=blind_spot_model()[0].config, max_cache_len=MAX_CACHE, max_batch_size=batch)


def forward(cache, ids, mask, eps):
    """Logits of the last position, (B, V), of one forward on `cache` with `alibi_skip_eps=eps`."""
    model = blind_spot_model()[0]
    model.config.alibi_skip_eps = eps
    with torch.no_grad():
        return model(ids, attention_mask=mask, cache=cache, use_cache=True).logits[:, -1]


def assert_summary_bounds_the_cache(cache, mask=None):
    """The premise of the certificate: each layer's summary is >= the largest norm of every real key (under the
    step's `mask`) it covers, now."""
    summary = blind_spot_model()[0].transformer.key_norms[cache]  # the model keeps each cache's summary
    for layer, (norms, covered, *_) in summary.layers.items():
        keys = cache.layers[layer].keys[:, :, :covered]  # (B, H, covered, D)
        real = None if mask is None else mask[:, :covered].bool()  # (B, covered)
        true = key_block_norms(keys, KEY_BLOCK, real).amax(0, keepdim=True)  # (1, H, blocks)
        short = (true - norms[..., : true.shape[-1]]).max().item()
        assert short <= 0, f"layer {layer}: a block's key norm exceeds its summary by {short:.3g}"


def assert_logits_equal_dense(skipping, dense):
    difference = (skipping - dense).abs().max().item()
    scale = dense.abs().max().item()
    assert difference <= 1e-6 * scale, f"largest difference {difference:.3g} at scale {scale:.3g}"


def reset_empties_a_dynamic_cache() -> bool:
    """transformers before 5.18 zeroes a `DynamicCache`'s keys on `reset()` and keeps their length, so the next
    request would follow zeros (for any model): there, only a static cache is reused for another request."""
    cache = DynamicCache()
    cache.update(torch.zeros(1, 1, 2, 1), torch.zeros(1, 1, 2, 1), 0)
    cache.reset()
    return cache.get_seq_length() == 0


REUSABLE = ["dynamic", "static"] if reset_empties_a_dynamic_cache() else ["static"]


def croppable(kind: str) -> bool:
    """Whether transformers' cache of `kind` has `crop` (a static cache's layers: from 5.24)."""
    return hasattr(make_cache(kind, 1).layers[0], "crop")


@pytest.mark.parametrize("kind", REUSABLE)
def test_a_reset_cache_refilled_with_another_request_certifies_against_the_new_keys(kind):
    """The issue's attack: a first request of LOW keys, `reset()`, then one whose far keys dominate and whose key at
    the first request's last position is LOW's again (the last key alone cannot tell them apart)."""
    length = 300
    first = torch.full((1, length), LOW)
    second = torch.full((1, length), LOW)
    second[0, : length - 130] = blind_spot_model()[1]  # far keys: at distance >= 130 from the decoding step
    cache = make_cache(kind, 1)
    forward(cache, first[:, :-1], None, 0.0)
    forward(cache, first[:, -1:], None, EPS)  # a skipping step: the cache now carries a summary of LOW keys
    cache.reset()
    forward(cache, second[:, :-1], None, EPS)
    skipping = forward(cache, second[:, -1:], None, EPS)
    assert_summary_bounds_the_cache(cache)
    reference = make_cache(kind, 1)
    forward(reference, second[:, :-1], None, 0.0)
    assert_logits_equal_dense(skipping, forward(reference, second[:, -1:], None, 0.0))


def test_the_summary_keeps_what_precedes_a_crop_and_folds_in_only_new_keys():
    keys = torch.randn(2, HEADS, 200, 8, generator=torch.Generator().manual_seed(0))
    norms = RunningKeyNorms(written=0)
    norms.note_write(0, 150)
    norms(0, keys[:, :, :150])
    norms.note_write(90, 1)  # cropped to 90, then one step: keys [0, 90) are kept, [90, 91) folded in
    assert norms.layers[0][1] == 90
    refilled = keys[:, :, :91].clone()
    refilled[:, :, 90] *= 100
    expected = key_block_norms(keys[:, :, :128], KEY_BLOCK).amax(0, keepdim=True)  # the straddling block: as seen
    expected[..., 1] = torch.maximum(expected[..., 1], key_block_norms(refilled, KEY_BLOCK).amax(0)[..., 1])
    torch.testing.assert_close(norms(0, refilled), expected, rtol=0, atol=0)
    norms.note_write(120, 1)  # keys appended unseen (a foreign write): nothing is kept
    assert norms.layers == {}


def test_no_summary_for_a_cache_whose_keys_may_change_unwritten_and_one_for_plain_caches():
    class AgingLayer(DynamicLayer):  # e.g. a quantized layer: old keys come back requantized
        pass

    summaries = KeyNormSummaries()
    assert RunningKeyNorms.for_forward(summaries, Cache(layer_class_to_replicate=AgingLayer), 0, 1)() is None
    assert RunningKeyNorms.for_forward(summaries, None, 0, 1)() is None
    for cache in (make_cache("dynamic", 1), make_cache("static", 1), DynamicCache()):
        summary = RunningKeyNorms.for_forward(summaries, cache, 7, 1)()
        assert summary is summaries[cache] and summary.written == 8
        assert not hasattr(cache, "hf_alibi_key_norms"), "the summary is the model's, not an attribute of the cache"


def test_a_summary_lives_as_long_as_its_cache_and_a_copied_model_starts_without_any():
    summaries = KeyNormSummaries()
    cache = DynamicCache()
    RunningKeyNorms.for_forward(summaries, cache, 0, 4)()
    assert len(summaries) == 1
    assert len(copy.deepcopy(summaries)) == 0 and len(pickle.loads(pickle.dumps(summaries))) == 0
    del cache
    gc.collect()
    assert len(summaries) == 0, "a dropped cache's summary outlived it"


# --- hypothesis: sequences of cache operations, each step against a dense model fed the same inputs -----------------

TOKENS = st.sampled_from(["low", "high", "other"])  # keys ~0, keys along LOW's query, an ordinary token's keys


def token(kind: str) -> int:
    return {"low": LOW, "high": blind_spot_model()[1], "other": 17}[kind]


RUN = 32  # tokens per run of one token in a request


@st.composite
def scripts(draw):
    """(cache kind, batch, operations). Requests are runs of one token each; a refill (another request of the same
    length after `reset()`, or new tokens for cropped ones) ends with the token fed last, so that layer 0's key where
    the summary's keys ended is unchanged while the keys before it differ: what the last key alone cannot tell."""
    kind, batch = draw(st.sampled_from(REUSABLE)), draw(st.integers(1, 2))
    runs = st.lists(TOKENS, min_size=3, max_size=8)
    crops = croppable(kind)
    reuse = st.one_of(
        st.tuples(st.just("request"), runs, st.booleans()),  # reset (if used), then prefill; left-padded or not
        st.tuples(st.just("same_length_request"), runs, st.booleans()),
        *([st.tuples(st.just("crop_and_refill"), st.floats(0.05, 0.95), runs)] if crops else []),
    )
    operation = st.one_of(
        reuse,
        st.tuples(st.just("extend"), runs.map(lambda r: r[:2])),  # several rows at the offset: chunked prefill
        st.tuples(st.just("decode"), st.lists(TOKENS, min_size=1, max_size=3)),
        st.tuples(st.just("reset")),
        *([st.tuples(st.just("crop"), st.floats(0.05, 0.95))] if crops else []),
        st.tuples(st.just("reorder"), st.lists(st.integers(0, 1), min_size=2, max_size=2)),
        *([st.tuples(st.just("select"), st.integers(0, 1)), st.tuples(st.just("repeat"))] if kind == "dynamic" else []),
    )
    first = (draw(st.tuples(st.just("request"), runs, st.booleans())), ("decode", ["low"]))
    return kind, batch, [*first, *draw(st.lists(operation, max_size=5)), draw(reuse), ("decode", ["low"])]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scripts())
def test_decoding_after_resets_crops_reorders_and_new_requests_certifies_and_equals_dense(script):
    """Every decoding step of a skipping cache: its summary bounds its keys, and its logits are a dense cache's, fed
    the same inputs and operations."""
    kind, batch, operations = script
    caches = {eps: make_cache(kind, batch) for eps in (EPS, 0.0)}
    state = dict(length=0, mask=None, rows=batch, last="low")

    def run(ids, mask, check):
        logits = {eps: forward(cache, ids, mask, eps) for eps, cache in caches.items()}
        if check:
            assert_summary_bounds_the_cache(caches[EPS], mask)
            assert_logits_equal_dense(logits[EPS], logits[0.0])

    def feed(tokens, check, padded=False):  # n kinds of token for every row, at the current offset
        if state["length"] + len(tokens) > MAX_CACHE:
            return
        if state["length"] == 0:
            state.update(mask=None, rows=batch)
        ids = torch.tensor([token(kind) for kind in tokens]).expand(state["rows"], -1)  # (B, n)
        mask = torch.ones_like(ids) if state["mask"] is None else torch.cat([state["mask"], torch.ones_like(ids)], 1)
        if padded and state["rows"] > 1:
            mask[1, : len(tokens) // 3] = 0  # the second row left-padded
        run(ids, mask, check)
        state.update(length=state["length"] + len(tokens), mask=mask, last=tokens[-1])

    def refill(runs, n):  # n tokens of `runs`, ending with the token fed last
        return ([kind for kind in runs for _ in range(RUN)] * n)[: n - 1] + [state["last"]]

    def crop(removed):
        each_cache("crop", -removed)
        state.update(length=state["length"] - removed, mask=state["mask"][:, : state["length"] - removed])

    def each_cache(method, *args):
        for cache in caches.values():
            getattr(cache, method)(*args)

    for name, *args in operations:
        length, rows = state["length"], state["rows"]
        if name == "request":
            each_cache("reset")
            state.update(length=0)
            feed([kind for kind in args[0] for _ in range(RUN)], check=False, padded=args[1])
        elif name == "same_length_request" and length > 1:
            each_cache("reset")
            state.update(length=0)
            feed(refill(args[0], length), check=False, padded=args[1])
        elif name == "crop_and_refill" and length > 1:
            removed = max(1, int(args[0] * length))
            crop(removed)
            feed(refill(args[1], removed), check=False)
        elif name == "extend":
            feed([kind for kind in args[0] for _ in range(RUN // 4)], check=False)
        elif name == "decode":
            for kind in args[0]:
                feed([kind], check=True)
        elif name == "reset":
            each_cache("reset")
            state.update(length=0)
        elif name == "crop" and length > 1:
            crop(max(1, int(args[0] * length)))
        elif name in ("reorder", "select", "repeat") and length and rows <= 2:
            index = {
                "reorder": lambda: torch.tensor(args[0][:rows]).clamp(max=rows - 1),  # noqa: B023 (called at once, below)
                "select": lambda: torch.tensor([min(args[0], rows - 1)]),  # noqa: B023 (called at once, below)
                "repeat": lambda: torch.arange(rows).repeat_interleave(2),  # noqa: B023 (called at once, below)
            }[name]()
            if name == "reorder":
                each_cache("reorder_cache", index)
            elif name == "select":
                each_cache("batch_select_indices", index)
            else:
                each_cache("batch_repeat_interleave", 2)
            state.update(mask=state["mask"][index], rows=len(index))
