"""jina-embeddings-v2, jina-reranker-v1, MosaicBERT and DNABERT-2 <-> ALiBi BERT (`AlibiBert*`), exactly.

All four are `trust_remote_code` checkpoints whose config says `model_type: "bert"` (DNABERT-2's says nothing): read
from their files, their code never runs. Which code a checkpoint belongs to shows in its `auto_map`
(`jina-bert-implementation`, MosaicBERT's `bert_layers`), its keys (separate `query/key/value` or one fused `Wqkv`,
`mlp.gated_layers`) and MosaicBERT's `alibi_starting_size`; a `bert` checkpoint with none of these signs is a plain
BERT with learned positions and is refused. Their function is ours (see `AlibiBertConfig`): post-LN BERT, no
position table, the symmetric bias `-m_h |i - j|` with the paper's slopes, a GLU MLP `wo(act(g[:I]) * g[I:])`.

- Jina: the same parameter names (bare for `JinaBertModel`, `bert.`-prefixed under a head, as ours); the GLU's
  activation is `feed_forward_type`'s (`geglu`: exact GELU, `reglu`: ReLU), `hidden_act` only drives the MLM head;
  `emb_pooler: "mean"` tells their `encode()` to mean-pool the last hidden states over the real tokens (the
  sentence-transformers Pooling an import writes); jina-reranker-v1 is BERT's classifier on the tanh pooler.
- MosaicBERT / DNABERT-2: `bert.`-prefixed, one fused `[q | k | v]` `Wqkv` (split into our query/key/value and fused
  back on export, both exact), the GLU's activation always the exact GELU (`geglu`); their config's
  `position_embedding_type: "absolute"` is ignored by their code, as here; their MLM head's LayerNorm has a fixed
  eps 1e-12.
- jina-embeddings-v2-base-code (`jina-bert-v2-qk-post-norm`, family "jina_code"): Jina's names plus q/k LayerNorms
  (`attention.self.layer_norm_q/k`), the layer's input added a second time after the attention block
  (`a = layer_norm_1(x + LN(dense(attn) + x))`), the GLU `mlp.up_gated_layer` / `mlp.down_layer` with the activation
  on the second half and the residual LayerNorm `layer_norm_2(a + mlp(a))`: `AlibiBertConfig(layer_layout="jina_code")`
  holds it under the same names, key for key.

q/k LayerNorm weights (`attention.self.layer_norm_q/k`) in a jina-bert-implementation or MosaicBERT checkpoint are
refused by name: their code has no such modules and ignores them, so applying them would not compute their model.

Their code caps inputs (Jina: `max_position_embeddings`-sized bias in TEI; MosaicBERT grows its table); ours runs at
any length.
"""

import torch
from transformers.activations import ACT2FN

from .common import EXPORT_REFUSAL, IMPORT_REFUSAL, Requirement, load_exactly, require
from .remote_code import Checkpoint
from .weight_map import Entry, WeightMap, map_weights

# layout -> (its name in `hf-alibi`, the code whose layout it is: what refusals name); every encoder list reads it
_LAYOUTS = {
    "jina": ("Jina", "jina-bert-implementation (jina-embeddings-v2, jina-reranker-v1)"),
    "jina_code": ("Jina", "jina-bert-v2-qk-post-norm (jina-embeddings-v2-base-code)"),
    "mosaic": ("MosaicBERT", "MosaicBERT/DNABERT-2"),
}
NAMES = {layout: code for layout, (_, code) in _LAYOUTS.items()}
SHORT_NAMES = {layout: short for layout, (short, _) in _LAYOUTS.items()}
LAYOUTS = tuple(_LAYOUTS)
HEADS = {  # our class -> the head it carries
    "AlibiBertModel": "base",
    "AlibiBertForMaskedLM": "masked_lm",
    "AlibiBertForSequenceClassification": "sequence_classification",
    "AlibiBertForTokenClassification": "token_classification",
}
# Their config classes' defaults (both derive from transformers' BertConfig) for keys a config.json leaves out
_DEFAULTS = {
    "vocab_size": 30522,
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "initializer_range": 0.02,
    "layer_norm_eps": 1e-12,
    "pad_token_id": 0,
    "classifier_dropout": None,
}
_LABEL_FIELDS = ("id2label", "label2id", "problem_type")
_INDEX_BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")
_JINA_NEEDS = (
    Requirement(
        "position_embedding_type",
        "alibi",
        "{family} config has {field}={value!r}: their code then adds a learned position table, not ALiBi",
    ),
    Requirement(
        "feed_forward_type",
        frozenset({"geglu", "reglu"}),
        "{family} config has {field}={value!r}: only the GLU MLPs geglu and reglu are ALiBi BERT's (original is "
        "BERT's plain MLP)",
    ),
)
_IMPORT_NEEDS = {"jina": _JINA_NEEDS, "jina_code": _JINA_NEEDS, "mosaic": ()}
_HIDDEN_ACT = Requirement(
    "hidden_act", frozenset(ACT2FN), "{family} config has {field}={value!r}, an activation transformers lacks"
)


def encoder_family(config: dict, keys) -> str:
    """ "jina", "jina_code" or "mosaic": whose code the checkpoint (`config` dict, its state dict's `keys`) belongs to;
    `ValueError` for a `bert` checkpoint with no sign of ALiBi."""
    code = " ".join(str(value) for value in (config.get("auto_map") or {}).values())
    keys = list(keys)
    if "jina-bert-v2-qk-post-norm" in code or any(".layer_norm_1." in k or ".up_gated_layer." in k for k in keys):
        return "jina_code"
    if "bert_layers" in code or "alibi_starting_size" in config or any(".attention.self.Wqkv." in k for k in keys):
        return "mosaic"
    if "jina-bert-implementation" in code or any(".mlp.gated_layers." in k for k in keys):
        return "jina"
    raise ValueError(
        f"a checkpoint of model_type {config.get('model_type')!r} with no sign of ALiBi (no auto_map to "
        "jina-bert-implementation or bert_layers, no Wqkv or mlp.gated_layers weights, no alibi_starting_size): a "
        "plain BERT with learned positions, not an ALiBi encoder"
    )


def their_bare_state(state: dict) -> tuple[dict, str]:
    """Their state dict with the `bert.` prefix of a head's checkpoint removed, and the head its keys carry
    ("base", "masked_lm" or "classifier")."""
    bare = {key.removeprefix("bert."): tensor for key, tensor in state.items()}
    if len(bare) != len(state):
        raise ValueError("checkpoint holds the same weight with and without the bert. prefix")
    for buffer in _INDEX_BUFFERS:  # saved by older transformers; index tables, not weights
        bare.pop(buffer, None)
    if any(key.startswith("cls.predictions.") for key in bare):
        return bare, "masked_lm"
    return bare, "classifier" if "classifier.weight" in bare else "base"


def head_of(config: dict, keys_head: str) -> str:
    """The head to build: the keys' head, the classifier told apart by the source's `architectures`."""
    if keys_head != "classifier":
        return keys_head
    tokens = any("TokenClassification" in name for name in config.get("architectures") or [])
    return "token_classification" if tokens else "sequence_classification"


def encoder_weights(config, head: str, pooler: bool) -> WeightMap:
    """(ours, theirs) for every tensor, both sides in the interface's names: ours `bert.`-prefixed under a head,
    theirs bare (their prefix is added or removed around it). Mosaic's fused `Wqkv` is split before."""
    attention = [f"attention.self.{name}.{part}" for name in ("query", "key", "value") for part in ("weight", "bias")]
    if config.qk_layer_norm:
        attention += [
            f"attention.self.{n}.{part}" for n in ("layer_norm_q", "layer_norm_k") for part in ("weight", "bias")
        ]
    output = [f"attention.output.{name}.{part}" for name in ("dense", "LayerNorm") for part in ("weight", "bias")]
    layer = attention + output + _LAYER_WEIGHTS[config.layer_layout]
    body = [
        "embeddings.word_embeddings.weight",
        "embeddings.token_type_embeddings.weight",
        "embeddings.LayerNorm.weight",
        "embeddings.LayerNorm.bias",
        *(f"encoder.layer.{{i}}.{part}" for part in layer),
    ] + (["pooler.dense.weight", "pooler.dense.bias"] if pooler else [])
    prefix = "" if head == "base" else "bert."
    entries = [Entry(prefix + name, name) for name in body]
    if head == "masked_lm":
        transform = ("dense.weight", "dense.bias", "LayerNorm.weight", "LayerNorm.bias")
        entries += [
            Entry(f"cls.predictions.transform.{name}", f"cls.predictions.transform.{name}") for name in transform
        ]
        entries.append(Entry("cls.predictions.decoder.bias", "cls.predictions.decoder.bias"))
    elif head != "base":
        entries += [Entry("classifier.weight", "classifier.weight"), Entry("classifier.bias", "classifier.bias")]
    return tuple(entries)


# `layer_layout` -> each layer's tensors after its attention block
_LAYER_WEIGHTS = {
    "jina": ["mlp.gated_layers.weight", "mlp.wo.weight", "mlp.wo.bias", "mlp.layernorm.weight", "mlp.layernorm.bias"],
    "jina_code": [
        "layer_norm_1.weight",
        "layer_norm_1.bias",
        "mlp.up_gated_layer.weight",
        "mlp.down_layer.weight",
        "mlp.down_layer.bias",
        "layer_norm_2.weight",
        "layer_norm_2.bias",
    ],
}


def split_qkv(state: dict, n_layer: int) -> dict:
    """MosaicBERT's fused `Wqkv` rows `[q | k | v]` -> separate query/key/value (views of it: exact)."""
    state = dict(state)
    for i in range(n_layer):
        for part in ("weight", "bias"):
            fused = state.pop(f"encoder.layer.{i}.attention.self.Wqkv.{part}", None)
            if fused is None:
                continue
            for name, tensor in zip(("query", "key", "value"), fused.chunk(3, 0)):
                state[f"encoder.layer.{i}.attention.self.{name}.{part}"] = tensor
    return state


def fuse_qkv(state: dict, n_layer: int) -> dict:
    """The inverse of `split_qkv`: query/key/value -> one `Wqkv`, rows `[q | k | v]`."""
    state = dict(state)
    for i in range(n_layer):
        for part in ("weight", "bias"):
            names = [f"encoder.layer.{i}.attention.self.{name}.{part}" for name in ("query", "key", "value")]
            state[f"encoder.layer.{i}.attention.self.Wqkv.{part}"] = torch.cat([state.pop(name) for name in names])
    return state


def _untie_head(state: dict, family: str) -> dict:
    """Their MLM head's tied decoder weight (checked equal to the word embeddings) dropped, and BERT's second name
    of the decoder bias (`cls.predictions.bias`, Jina's) folded into `cls.predictions.decoder.bias`."""
    state = dict(state)
    decoder = state.pop("cls.predictions.decoder.weight", None)
    if decoder is not None and not torch.equal(decoder, state["embeddings.word_embeddings.weight"]):
        raise ValueError(
            f"{family} checkpoint's cls.predictions.decoder.weight differs from the word embeddings it is tied to"
        )
    bias = state.pop("cls.predictions.bias", None)
    if bias is not None:
        other = state.setdefault("cls.predictions.decoder.bias", bias)
        if not torch.equal(other, bias):
            raise ValueError(f"{family} checkpoint's cls.predictions.bias and cls.predictions.decoder.bias differ")
    return state


def alibi_bert_config(config: dict, family: str, head: str, num_labels: int | None, qk_norm: bool):
    """Our `AlibiBertConfig` for their config dict (defaults filled); `ValueError` naming what it cannot hold."""
    from ..models.alibi.configuration_alibi_bert import AlibiBertConfig

    config = _DEFAULTS | {key: value for key, value in config.items() if value is not None or key not in _DEFAULTS}
    require(config, (*_IMPORT_NEEDS[family], _HIDDEN_ACT), NAMES[family], IMPORT_REFUSAL)
    if family == "mosaic" and head == "masked_lm" and config["layer_norm_eps"] != 1e-12:
        raise ValueError(
            f"{NAMES[family]} config has layer_norm_eps={config['layer_norm_eps']!r}, but their MLM head's LayerNorm "
            "always uses 1e-12: one eps cannot hold both"
        )
    fields = {name: config[name] for name in _DEFAULTS}
    labels = {name: config[name] for name in _LABEL_FIELDS if config.get(name) is not None}
    if num_labels is not None:
        labels["num_labels"] = num_labels
    feed_forward = config["feed_forward_type"] if family != "mosaic" else "geglu"  # Mosaic's GLU: nn.GELU() always
    layout = "jina_code" if family == "jina_code" else "jina"
    return AlibiBertConfig(
        **fields, **labels, feed_forward_type=feed_forward, qk_layer_norm=qk_norm, layer_layout=layout
    )


def convert_encoder(checkpoint: Checkpoint):
    """An `AlibiBert*` model (the head the checkpoint carries) computing what its own code computes (fp32 rounding
    apart), at any length; `ValueError` naming the config field or tensor it cannot hold exactly."""
    from ..models.alibi import modeling_alibi_bert

    family = encoder_family(checkpoint.config, checkpoint.state_dict)
    state, keys_head = their_bare_state(checkpoint.state_dict)
    head = head_of(checkpoint.config, keys_head)
    n_layer = checkpoint.config.get("num_hidden_layers", _DEFAULTS["num_hidden_layers"])
    state = _untie_head(split_qkv(state, n_layer) if family == "mosaic" else state, NAMES[family])
    if head == "masked_lm":  # their MLM classes build no pooler; a pooler saved beside is not part of the function
        state = {key: value for key, value in state.items() if not key.startswith("pooler.")}
    labels = state["classifier.weight"].shape[0] if "classifier.weight" in state else None
    _refuse_unread_qk_norms(state, family)
    # base-code's code always has them (a checkpoint without them is refused as missing weights)
    config = alibi_bert_config(checkpoint.config, family, head, labels, qk_norm=family == "jina_code")
    model_class = getattr(modeling_alibi_bert, {v: k for k, v in HEADS.items()}[head])
    model = (
        model_class(config) if head != "base" else model_class(config, add_pooling_layer="pooler.dense.weight" in state)
    )
    pooler = getattr(model, "bert", model).pooler is not None
    what = f"{family} -> alibi_bert"
    ours = map_weights(encoder_weights(config, head, pooler), state, config.num_hidden_layers, to="ours", what=what)
    dtypes = sorted({str(tensor.dtype) for tensor in ours.values()})
    if len(dtypes) != 1:
        raise ValueError(f"{NAMES[family]} checkpoint mixes weight dtypes {dtypes}: one model dtype is needed")
    ours = _with_tied_names(model, ours)
    return load_exactly(model.to(next(iter(ours.values())).dtype), ours, what)


def _refuse_unread_qk_norms(state: dict, family: str) -> None:
    """`ValueError` naming q/k LayerNorm weights in a checkpoint whose code has no such modules:
    jina-bert-implementation (and TEI's `jina.rs`) and MosaicBERT's `bert_layers` never build `layer_norm_q/k` (only
    base-code's jina-bert-v2-qk-post-norm does), so `from_pretrained` drops those keys and their model computes
    without them."""
    keys = sorted(key for key in state if ".attention.self.layer_norm_" in key)  # layer_norm_q, layer_norm_k
    if keys and family != "jina_code":
        raise ValueError(
            f"{NAMES[family]} checkpoint carries q/k LayerNorm weights ({keys[0]} and {len(keys) - 1} more) that their "
            "code has no module for and ignores; an import applying them would not compute their model"
        )


def _with_tied_names(model, ours: dict) -> dict:
    """`ours` plus the names our state dict gives tied tensors (the MLM decoder's weight is the word embeddings)."""
    names = set(model.state_dict())
    if "cls.predictions.decoder.weight" in names:
        ours["cls.predictions.decoder.weight"] = ours["bert.embeddings.word_embeddings.weight"]
    if "cls.predictions.bias" in names:  # BERT's second name of the decoder bias
        ours["cls.predictions.bias"] = ours["cls.predictions.decoder.bias"]
    return ours


_NO_QK_NORM = Requirement("qk_layer_norm", False, "{family} has no LayerNorm on q and k; {field}={value!r}")
_JINA_GLU = Requirement(
    "feed_forward_type", frozenset({"geglu", "reglu"}), "{family}'s GLU is geglu or reglu; {field}={value!r}"
)
_LAYOUT = "{family}'s layer is layer_layout={accepted!r}; the model has {field}={value!r}"
_EXPORT_NEEDS = {  # the layer's layout first: the refusal then names what differs most
    "jina": (Requirement("layer_layout", "jina", _LAYOUT), _NO_QK_NORM, _JINA_GLU),
    "jina_code": (
        Requirement("layer_layout", "jina_code", _LAYOUT),
        Requirement("qk_layer_norm", True, "{family} always has LayerNorms on q and k; {field}={value!r}"),
        _JINA_GLU,
    ),
    "mosaic": (
        Requirement("layer_layout", "jina", _LAYOUT),
        _NO_QK_NORM,
        Requirement("feed_forward_type", "geglu", "{family}'s GLU is always the exact GELU (geglu); {field}={value!r}"),
    ),
}
_JINA_CLASSES = {
    "base": ("JinaBertModel", "AutoModel"),
    "masked_lm": ("JinaBertForMaskedLM", "AutoModelForMaskedLM"),
    "sequence_classification": ("JinaBertForSequenceClassification", "AutoModelForSequenceClassification"),
    "token_classification": ("JinaBertForTokenClassification", "AutoModelForTokenClassification"),
}
_CLASSES = {  # layout -> head -> (their class, the auto_map entry that loads it)
    "jina": _JINA_CLASSES,
    "jina_code": _JINA_CLASSES,
    "mosaic": {
        "base": ("BertModel", "AutoModel"),
        "masked_lm": ("BertForMaskedLM", "AutoModelForMaskedLM"),
        "sequence_classification": ("BertForSequenceClassification", "AutoModelForSequenceClassification"),
    },
}
_JINA_CODE = {"jina": "jinaai/jina-bert-implementation--", "jina_code": "jinaai/jina-bert-v2-qk-post-norm--"}


def check_encoder_exportable(config, layout: str, head: str) -> None:
    """`ValueError` naming the field (or head) the `layout`'s code cannot hold."""
    require(config, _EXPORT_NEEDS[layout], NAMES[layout], EXPORT_REFUSAL)
    if head not in _CLASSES[layout]:
        raise ValueError(f"{NAMES[layout]} has no {head} class (it has {sorted(_CLASSES[layout])})")
    if layout == "mosaic" and head == "masked_lm" and config.layer_norm_eps != 1e-12:
        raise ValueError(
            f"{NAMES[layout]}'s MLM head LayerNorm uses eps 1e-12; layer_norm_eps={config.layer_norm_eps!r}"
        )


def their_encoder_config(config, layout: str, head: str, dtype: str) -> dict:
    """Their config.json for a model of our `config` carrying `head`, stored in `dtype`: the keys their code reads,
    `auto_map` naming their code (theirs to ship: Jina's from the Hub repo, MosaicBERT's files beside it)."""
    class_name, auto = _CLASSES[layout][head]
    theirs = {name: getattr(config, name) for name in _DEFAULTS} | {
        "model_type": "bert",
        "architectures": [class_name],
        "torch_dtype": dtype,
    }
    if head in ("sequence_classification", "token_classification"):
        theirs |= {"id2label": {str(k): v for k, v in config.id2label.items()}, "label2id": dict(config.label2id)}
        theirs |= {"problem_type": config.problem_type} if config.problem_type else {}
    if layout in _JINA_CODE:
        code = _JINA_CODE[layout]
        entries = {  # what jina-embeddings-v2's (base-code's) and jina-reranker-v1's auto_map name
            auto_name: f"{code}modeling_bert.{name}"
            for head_name, (name, auto_name) in _JINA_CLASSES.items()
            if head_name != "token_classification" or head == head_name
        }
        return theirs | {
            "auto_map": {"AutoConfig": f"{code}configuration_bert.JinaBertConfig"} | entries,
            "position_embedding_type": "alibi",
            "feed_forward_type": config.feed_forward_type,
            "emb_pooler": "mean" if head == "base" else None,
            "attn_implementation": "torch",
        }
    entries = {auto_name: f"bert_layers.{name}" for name, auto_name in _CLASSES["mosaic"].values()}
    return theirs | {
        "auto_map": {"AutoConfig": "configuration_bert.BertConfig"} | entries,
        "alibi_starting_size": 512,
        "position_embedding_type": "absolute",  # what their checkpoints say; their code uses ALiBi regardless
    }


def export_encoder(model, layout: str) -> Checkpoint:
    """`model` (an `AlibiBert*`) as a jina-bert-implementation (`layout="jina"`), jina-bert-v2-qk-post-norm
    (`"jina_code"`) or MosaicBERT checkpoint: their
    config dict and state dict. Jina: bare keys for a base model, `bert.` under a head, the MLM decoder bias under
    BERT's saved name `cls.predictions.bias`, the tied decoder weight left out (safetensors); MosaicBERT: `bert.`
    under a head, `Wqkv` fused, the tied decoder weight stored as their `.bin` files hold it."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    config, head = model.config, HEADS[type(model).__name__]
    check_encoder_exportable(config, layout, head)
    pooler = getattr(model, "bert", model).pooler is not None
    ours = {
        key: value
        for key, value in model.state_dict().items()
        if key not in ("cls.predictions.decoder.weight", "cls.predictions.bias")
    }
    what = f"alibi_bert -> {layout}"
    state = map_weights(encoder_weights(config, head, pooler), ours, config.num_hidden_layers, to="theirs", what=what)
    if layout == "mosaic":
        state = fuse_qkv(state, config.num_hidden_layers)
        if head == "masked_lm":
            state["cls.predictions.decoder.weight"] = state["embeddings.word_embeddings.weight"]
    elif head == "masked_lm":
        state["cls.predictions.bias"] = state.pop("cls.predictions.decoder.bias")
    if head != "base":
        state = {
            key if key.startswith(("cls.", "classifier.")) else "bert." + key: value for key, value in state.items()
        }
    theirs = their_encoder_config(config, layout, head, str(model.dtype).removeprefix("torch."))
    return Checkpoint(theirs, {name: tensor.detach().contiguous() for name, tensor in state.items()})
