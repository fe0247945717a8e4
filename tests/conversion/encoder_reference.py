"""Tiny ALiBi encoder checkpoints in each source's own layout and config keys, and an independent float64 forward of
what their code computes (written from the layout, hf_alibi's modeling never imported).

Sources (read from their public code): jina-embeddings-v2 / jina-reranker-v1 (`jinaai/jina-bert-implementation`:
bare `embeddings.*`/`encoder.*` keys or `bert.`-prefixed under a head, separate query/key/value, `model.safetensors`,
`position_embedding_type: "alibi"`, `feed_forward_type` choosing the GLU's activation: geglu exact GELU, reglu ReLU),
MosaicBERT and DNABERT-2 (`bert_layers.py`: `bert.` prefix, one fused `[q | k | v]` `Wqkv`, `pytorch_model.bin`, the
GLU's activation always the exact GELU, `alibi_starting_size`; DNABERT-2's config without `model_type` and
`architectures`). All of them: post-LN BERT, `h = LN(word[x] + type[t])`; per layer `s = q.k / sqrt(d) - m_h |i - j|`
(+ padded keys masked), `h = LN(dense(softmax(s) v) + h)`, `g = gated_layers(h)`, `h = LN(wo(act(g[:I]) * g[I:]) + h)`.

jina-embeddings-v2-base-code (`jinaai/jina-bert-v2-qk-post-norm`, read in the transformers PR #35320 modular
`JinaBertSelfAttention` / `JinaBertGLUMLP` / `JinaBertLayer.forward` and TEI's `jina_code.rs`): Jina's config keys and
attention names plus `layer_norm_q/k` on the projected q and k (over the full hidden width, before the head split);
per layer `x` the input, `o = LN(dense(softmax(s) v) + x)` (BERT's SelfOutput), `a = layer_norm_1(x + o)`,
`u = up_gated_layer(a)` (no bias, 2I), `h = layer_norm_2(a + down_layer(u[:I] * act(u[I:])))`: the activation
(`feed_forward_type`'s, geglu the exact GELU) on the SECOND half, no `mlp.layernorm`.
"""

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

VOCAB, HIDDEN, HEADS, INTERMEDIATE, LAYERS = 64, 24, 6, 40, 2  # 6 heads: the slopes' interleave matters
JINA_CODE = "jinaai/jina-bert-implementation--"
JINA_BASE_CODE = "jinaai/jina-bert-v2-qk-post-norm--"  # the code jina-embeddings-v2-base-code's auto_map names
MOSAIC_AUTO_MAP = {
    "AutoConfig": "configuration_bert.BertConfig",
    "AutoModel": "bert_layers.BertModel",
    "AutoModelForMaskedLM": "bert_layers.BertForMaskedLM",
    "AutoModelForSequenceClassification": "bert_layers.BertForSequenceClassification",
}
SIZES = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "intermediate_size": INTERMEDIATE,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
    "pad_token_id": 0,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.0,
    "initializer_range": 0.02,
}


def jina_config(head: str = "base", feed_forward_type: str = "geglu", code: str = JINA_CODE) -> dict:
    """jina-embeddings-v2's config.json keys (`head="sequence_classification"`: jina-reranker-v1's; `code=JINA_BASE_CODE`:
    jina-embeddings-v2-base-code's, whose keys are the same but for the auto_map)."""
    classes = {
        "base": "JinaBertModel",
        "masked_lm": "JinaBertForMaskedLM",
        "sequence_classification": "JinaBertForSequenceClassification",
    }
    config = SIZES | {
        "model_type": "bert",
        "architectures": [classes[head]],
        "auto_map": {
            "AutoConfig": code + "configuration_bert.JinaBertConfig",
            "AutoModel": code + "modeling_bert.JinaBertModel",
            "AutoModelForMaskedLM": code + "modeling_bert.JinaBertForMaskedLM",
            "AutoModelForSequenceClassification": code + "modeling_bert.JinaBertForSequenceClassification",
        },
        "position_embedding_type": "alibi",
        "feed_forward_type": feed_forward_type,
        "max_position_embeddings": 8192,
        "emb_pooler": "mean" if head == "base" else None,
        "attn_implementation": "torch",
        "classifier_dropout": None,
    }
    if head == "sequence_classification":
        config |= {"num_labels": 1, "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}
    return config


def mosaic_config(dnabert2: bool = False, head: str = "masked_lm") -> dict:
    """MosaicBERT's config.json keys; `dnabert2`: DNABERT-2's (no model_type, no architectures)."""
    config = SIZES | {
        "alibi_starting_size": 512,
        "auto_map": MOSAIC_AUTO_MAP,
        "position_embedding_type": "absolute",  # what they say; their code ignores it
        "max_position_embeddings": 512,
    }
    if not dnabert2:
        classes = {"masked_lm": "BertForMaskedLM", "sequence_classification": "BertForSequenceClassification"}
        config |= {"model_type": "bert", "architectures": [classes[head]]}
    if head == "sequence_classification":
        config |= {"num_labels": 2}
    return config


def tiny_state(config: dict, head: str, fused: bool, qk_norm: bool = False, seed: int = 0) -> dict:
    """Random weights (LayerNorms off 1/0, every bias nonzero) in the source's layout: keys `bert.`-prefixed under a
    head (bare for a base model), `Wqkv` fused when `fused`; base-code's layer (and its q/k norms) when the config's
    auto_map names `JINA_BASE_CODE`."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.3, offset=0.0):
        return offset + scale * torch.randn(*shape, generator=generator)

    H, V = config["hidden_size"], config["vocab_size"]  # noqa: N806
    state = {
        "embeddings.word_embeddings.weight": rand(V, H),
        "embeddings.token_type_embeddings.weight": rand(config["type_vocab_size"], H),
        "embeddings.LayerNorm.weight": rand(H, scale=0.1, offset=1.0),
        "embeddings.LayerNorm.bias": rand(H, scale=0.1),
    }
    for i in range(config["num_hidden_layers"]):
        state |= _layer_state(f"encoder.layer.{i}.", config, rand, fused, qk_norm or is_base_code(config))
    if head != "masked_lm":
        state |= {"pooler.dense.weight": rand(H, H), "pooler.dense.bias": rand(H)}
    if head == "base":
        return state
    state = {"bert." + key: value for key, value in state.items()}
    if head == "masked_lm":
        return state | {
            "cls.predictions.transform.dense.weight": rand(H, H),
            "cls.predictions.transform.dense.bias": rand(H),
            "cls.predictions.transform.LayerNorm.weight": rand(H, scale=0.1, offset=1.0),
            "cls.predictions.transform.LayerNorm.bias": rand(H, scale=0.1),
            "cls.predictions.decoder.weight": state["bert.embeddings.word_embeddings.weight"],  # tied
            "cls.predictions.decoder.bias": rand(V),
        }
    labels = config.get("num_labels", 2)
    return state | {"classifier.weight": rand(labels, H), "classifier.bias": rand(labels)}


def _layer_state(layer: str, config: dict, rand, fused: bool, qk_norm: bool) -> dict:
    """One layer's weights under the prefix `layer`."""
    H, inner = config["hidden_size"], config["intermediate_size"]  # noqa: N806
    names = ["Wqkv"] if fused else ["query", "key", "value"]
    state = {}
    for name in names:
        rows = 3 * H if fused else H
        state |= {
            layer + f"attention.self.{name}.weight": rand(rows, H),
            layer + f"attention.self.{name}.bias": rand(rows),
        }
    for name in ("layer_norm_q", "layer_norm_k") if qk_norm else ():
        state |= {
            layer + f"attention.self.{name}.weight": rand(H, offset=1.0),
            layer + f"attention.self.{name}.bias": rand(H),
        }
    state |= {
        layer + "attention.output.dense.weight": rand(H, H),
        layer + "attention.output.dense.bias": rand(H),
        layer + "attention.output.LayerNorm.weight": rand(H, scale=0.1, offset=1.0),
        layer + "attention.output.LayerNorm.bias": rand(H, scale=0.1),
    }
    if is_base_code(config):
        return state | {
            layer + "layer_norm_1.weight": rand(H, scale=0.1, offset=1.0),
            layer + "layer_norm_1.bias": rand(H, scale=0.1),
            layer + "mlp.up_gated_layer.weight": rand(2 * inner, H),
            layer + "mlp.down_layer.weight": rand(H, inner),
            layer + "mlp.down_layer.bias": rand(H),
            layer + "layer_norm_2.weight": rand(H, scale=0.1, offset=1.0),
            layer + "layer_norm_2.bias": rand(H, scale=0.1),
        }
    return state | {
        layer + "mlp.gated_layers.weight": rand(2 * inner, H),
        layer + "mlp.wo.weight": rand(H, inner),
        layer + "mlp.wo.bias": rand(H),
        layer + "mlp.layernorm.weight": rand(H, scale=0.1, offset=1.0),
        layer + "mlp.layernorm.bias": rand(H, scale=0.1),
    }


def is_base_code(config: dict) -> bool:
    """Whether `config` is jina-embeddings-v2-base-code's (its auto_map names jina-bert-v2-qk-post-norm's code)."""
    return (config.get("auto_map") or {}).get("AutoModel", "").startswith(JINA_BASE_CODE)


def save_source(folder: Path, config: dict, state: dict, *, pickled: bool) -> Path:
    """The folder as the Hub holds it: config.json and `pytorch_model.bin` (`pickled`: MosaicBERT, DNABERT-2) or
    `model.safetensors` (Jina; a tied decoder stored once, as safetensors requires)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if pickled:
        torch.save(state, folder / "pytorch_model.bin")
    else:
        state = {key: value for key, value in state.items() if key != "cls.predictions.decoder.weight"}
        save_file({key: value.contiguous() for key, value in state.items()}, folder / "model.safetensors")
    return folder


def paper_slopes(n: int) -> list[float]:
    """The ALiBi paper's slopes, interleaved for a head count that is no power of two (their code's rule)."""
    if math.log2(n).is_integer():
        return [2 ** (-8 * (h + 1) / n) for h in range(n)]
    closest = 2 ** math.floor(math.log2(n))
    return paper_slopes(closest) + paper_slopes(2 * closest)[0::2][: n - closest]


def _layer_norm(x, weight, bias, eps):
    mean = x.mean(-1, keepdim=True)
    variance = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(variance + eps) * weight + bias


def _gelu(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def reference_forward(config: dict, state: dict, ids, mask=None, token_type_ids=None, chunk: int = 512) -> dict:
    """What their code computes, in float64: `hidden` (B, L, H), `pooled` (B, H) when the state has a pooler,
    `logits` (B, L, V) for an MLM head or (B, labels) for a classifier. Query rows go `chunk` at a time (the
    (H, chunk, L) scores of a long input stay small)."""
    s = {key.removeprefix("bert."): value.double() for key, value in state.items()}
    eps, n_head = config["layer_norm_eps"], config["num_attention_heads"]
    mask = torch.ones_like(ids) if mask is None else mask
    types = torch.zeros_like(ids) if token_type_ids is None else token_type_ids
    h = s["embeddings.word_embeddings.weight"][ids] + s["embeddings.token_type_embeddings.weight"][types]
    h = _layer_norm(h, s["embeddings.LayerNorm.weight"], s["embeddings.LayerNorm.bias"], eps)  # (B, L, H)
    glu_act = torch.relu if config.get("feed_forward_type") == "reglu" else _gelu
    slopes = torch.tensor(paper_slopes(n_head), dtype=torch.float64)  # (heads,)
    position = torch.arange(ids.shape[1])
    inner = config["intermediate_size"]
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        attended = _attention(s, p, h, mask, slopes, position, config, chunk)
        if p + "layer_norm_1.weight" in s:  # base-code: the input added again, the GLU's activation on the 2nd half
            a = _layer_norm(h + attended, s[p + "layer_norm_1.weight"], s[p + "layer_norm_1.bias"], eps)
            u = a @ s[p + "mlp.up_gated_layer.weight"].T  # (B, L, 2I)
            down, down_bias = s[p + "mlp.down_layer.weight"], s[p + "mlp.down_layer.bias"]
            out = (u[..., :inner] * glu_act(u[..., inner:])) @ down.T + down_bias
            h = _layer_norm(a + out, s[p + "layer_norm_2.weight"], s[p + "layer_norm_2.bias"], eps)
            continue
        g = attended @ s[p + "mlp.gated_layers.weight"].T  # (B, L, 2I)
        out = (glu_act(g[..., :inner]) * g[..., inner:]) @ s[p + "mlp.wo.weight"].T + s[p + "mlp.wo.bias"]
        h = _layer_norm(out + attended, s[p + "mlp.layernorm.weight"], s[p + "mlp.layernorm.bias"], eps)
    result = {"hidden": h}
    if "pooler.dense.weight" in s:
        result["pooled"] = torch.tanh(h[:, 0] @ s["pooler.dense.weight"].T + s["pooler.dense.bias"])
    if "cls.predictions.transform.dense.weight" in s:
        t = h @ s["cls.predictions.transform.dense.weight"].T + s["cls.predictions.transform.dense.bias"]
        t = _gelu(t) if config["hidden_act"] == "gelu" else torch.relu(t)
        t = _layer_norm(
            t, s["cls.predictions.transform.LayerNorm.weight"], s["cls.predictions.transform.LayerNorm.bias"], eps
        )
        result["logits"] = t @ s["embeddings.word_embeddings.weight"].T + s["cls.predictions.decoder.bias"]
    elif "classifier.weight" in s:
        result["logits"] = result["pooled"] @ s["classifier.weight"].T + s["classifier.bias"]
    return result


def _attention(s, p, h, mask, slopes, position, config, chunk):
    """One attention block, post-LN: `LN(dense(softmax(q.k / sqrt(d) - m |i - j| + pad) v) + h)`."""
    B, L, H = h.shape  # noqa: N806
    n_head = config["num_attention_heads"]
    d = H // n_head
    if p + "attention.self.Wqkv.weight" in s:
        q, k, v = (h @ s[p + "attention.self.Wqkv.weight"].T + s[p + "attention.self.Wqkv.bias"]).split(H, -1)
    else:
        q, k, v = (
            h @ s[p + f"attention.self.{n}.weight"].T + s[p + f"attention.self.{n}.bias"]
            for n in ("query", "key", "value")
        )
    if p + "attention.self.layer_norm_q.weight" in s:
        eps = config["layer_norm_eps"]
        q = _layer_norm(q, s[p + "attention.self.layer_norm_q.weight"], s[p + "attention.self.layer_norm_q.bias"], eps)
        k = _layer_norm(k, s[p + "attention.self.layer_norm_k.weight"], s[p + "attention.self.layer_norm_k.bias"], eps)
    q, k, v = (x.view(B, L, n_head, d).transpose(1, 2) for x in (q, k, v))  # (B, heads, L, d)
    padded = torch.where(mask.bool(), 0.0, float("-inf")).double()[:, None, None, :]  # (B, 1, 1, L)
    rows = []
    for start in range(0, L, chunk):
        distance = (position[start : start + chunk, None] - position[None, :]).abs().double()  # (rows, L)
        scores = q[:, :, start : start + chunk] @ k.transpose(-1, -2) / math.sqrt(d)  # (B, heads, rows, L)
        scores -= slopes[:, None, None] * distance
        if not mask.bool().all():
            scores += padded
        rows.append(torch.softmax(scores, -1) @ v)  # (B, heads, rows, d)
    a = torch.cat(rows, 2).transpose(1, 2).reshape(B, L, H)
    out = a @ s[p + "attention.output.dense.weight"].T + s[p + "attention.output.dense.bias"]
    return _layer_norm(
        out + h,
        s[p + "attention.output.LayerNorm.weight"],
        s[p + "attention.output.LayerNorm.bias"],
        config["layer_norm_eps"],
    )


def wordpiece_tokenizer(folder: Path):
    """A real WordPiece (BERT's kind, jina-embeddings-v2-base-en's) of `VOCAB` ids saved in `folder`, with the
    `vocab.txt` Jina's repositories ship beside `tokenizer.json`."""
    from transformers import BertTokenizer

    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world", "long", "text"]
    pieces = ["of", "many", "words", "##s", "##ing", "##ed", "##er"] + list("abcdefghijklmnopqrstuvwxyz.,!?")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words, *pieces]
    vocab += [f"[unused{n}]" for n in range(VOCAB - len(vocab))]
    tokenizer = BertTokenizer(vocab={token: index for index, token in enumerate(vocab)})
    assert len(tokenizer) == VOCAB and tokenizer.unk_token_id not in tokenizer("the quick brown fox")["input_ids"]
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(folder)
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    return tokenizer
