"""A BERT encoder with symmetric ALiBi and a GLU MLP: the layout of jina-embeddings-v2, jina-reranker-v1, MosaicBERT
and DNABERT-2, under jina-embeddings-v2's parameter names (a Jina checkpoint's state dict loads key for key).

Forward: `h = LN(word[x] + type[t])`; per layer `s = q.k / sqrt(d_head) - m_h |i - j|` (padded keys masked),
`h = LN(dense(softmax(s) v) + h)`, `g = gated_layers(h)`, `h = LN(wo(act(g[..., :I]) * g[..., I:]) + h)`
(`layer_layout="jina_code"`, jina-embeddings-v2-base-code: see `AlibiBertLayer`). Attention
goes through the decoder's shared core (`attention_alibi.py`) with a bidirectional plan, so every backend (eager,
SDPA, flex, FlashAttention-2) and packed rows work at any length. Classes in transformers' order: embeddings,
attention, MLP, layer, encoder, pooler, pretrained base, model, heads.
"""

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_outputs import (
    BaseModelOutputWithPooling,
    MaskedLMOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)

from .alibi_bias import get_alibi_slopes
from .attention_alibi import AlibiAttentionBackends, alibi_attention, plan_alibi_attention
from .attention_plan import AlibiAttentionPlan
from .configuration_alibi_bert import AlibiBertConfig
from .transformers_compat import (
    GradientCheckpointingLayer,
    OutputRecorder,
    TiedHeadLoading,
    can_return_tuple,
    init,
    model_inputs,
    was_loaded,
)

# isort: split
# transformers before 5.10 copies into its module cache only the files a remote-code entry file imports itself, not
# what those import in turn: the attention core's other modules are named here, so that a saved folder loads on 4.57-5.9
# too (tests/models/alibi/test_hub.py checks that this file imports its whole closure directly).
from .attention_certified import skipping_pays  # noqa: F401
from .attention_eager import FullBias  # noqa: F401
from .attention_flash import FlashVarlen  # noqa: F401
from .attention_flex import FlexBlocks  # noqa: F401
from .attention_packed import PackedDocuments  # noqa: F401
from .attention_paged import is_paged_cache  # noqa: F401
from .attention_routes import ROUTES  # noqa: F401
from .attention_sdpa import BiasBank  # noqa: F401
from .attention_sdpa_split import split_plan  # noqa: F401
from .attention_sdpa_split_calls import SplitCall  # noqa: F401
from .attention_sdpa_split_floor import bias_floors  # noqa: F401
from .attention_skip import KeyRanges  # noqa: F401
from .attention_skip_terms import _grouped_starts  # noqa: F401
from .configuration_alibi_gpt2 import AlibiGPT2Config  # noqa: F401
from .cpu_flash_kernels import split_kernels_work  # noqa: F401
from .packed_documents import packed_documents  # noqa: F401

# Flash-attention style descriptions of one flattened row of documents (transformers' DataCollatorWithFlattening)
FLATTENED_BATCH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


class AlibiBertEmbeddings(nn.Module):
    """Token plus segment embeddings, LayerNorm, dropout: BERT's without the position table."""

    def __init__(self, config: AlibiBertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids=None, token_type_ids=None, inputs_embeds=None) -> torch.Tensor:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids must be 2-D (batch, length), got shape {tuple(input_ids.shape)}")
            inputs_embeds = self.word_embeddings(input_ids)  # (B, L, C)
        elif inputs_embeds.dim() != 3:
            raise ValueError(f"inputs_embeds must be 3-D (batch, length, hidden), got {tuple(inputs_embeds.shape)}")
        shape = tuple(inputs_embeds.shape[:2])
        if shape[1] == 0:
            raise ValueError(f"the input has no tokens (shape {shape}): pass at least one token per row")
        if token_type_ids is None:  # BERT's default: every token in segment 0
            token_type_ids = torch.zeros(shape, dtype=torch.long, device=inputs_embeds.device)
        elif tuple(token_type_ids.shape) != shape:
            raise ValueError(f"token_type_ids has shape {tuple(token_type_ids.shape)}, the input {shape}")
        embeddings = inputs_embeds + self.token_type_embeddings(token_type_ids)  # (B, L, C)
        return self.dropout(self.LayerNorm(embeddings))


class AlibiBertSelfAttention(nn.Module):
    """Queries, keys and values (optionally LayerNormed, jina base-code's `layer_norm_q/k`) attended through the
    shared ALiBi core with the forward's bidirectional plan."""

    is_causal = False  # as transformers' BERT: an encoder's attention sees every key (the plan is built from this)

    def __init__(self, config: AlibiBertConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        if config.qk_layer_norm:
            self.layer_norm_q = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
            self.layer_norm_k = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.qk_layer_norm = config.qk_layer_norm

    def forward(self, hidden_states, plan: AlibiAttentionPlan, output_attentions: bool = False):
        batch, length, _ = hidden_states.shape
        query, key = self.query(hidden_states), self.key(hidden_states)  # (B, L, C) each
        if self.qk_layer_norm:
            query, key = self.layer_norm_q(query), self.layer_norm_k(key)
        query, key, value = (
            t.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
            for t in (query, key, self.value(hidden_states))
        )  # 3 x (B, H, L, D)
        output, weights = alibi_attention(query, key, value, plan, self.scaling, output_attentions)  # (B, L, H, D)
        return output.reshape(batch, length, -1), weights  # (B, L, C)


class AlibiBertSelfOutput(nn.Module):
    """BERT's: `LN(dropout(dense(a)) + h)`."""

    def __init__(self, config: AlibiBertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(attended)) + residual)


class AlibiBertAttention(nn.Module):
    def __init__(self, config: AlibiBertConfig):
        super().__init__()
        self.self = AlibiBertSelfAttention(config)
        self.output = AlibiBertSelfOutput(config)

    def forward(self, hidden_states, plan, output_attentions=False):
        attended, weights = self.self(hidden_states, plan, output_attentions)
        return self.output(attended, hidden_states), weights


class AlibiBertGLU(nn.Module):
    """What both layouts' GLUs share: the width `I`, the activation (`config.glu_activation`), the dropout before the
    down projection; each layout's GLU adds its own projections under its source's names."""

    def __init__(self, config: AlibiBertConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.act = ACT2FN[config.glu_activation]
        self.dropout = nn.Dropout(config.hidden_dropout_prob)


class AlibiBertGLUMLP(AlibiBertGLU):
    """Jina's GLU: `LN(wo(dropout(act(g[..., :I]) * g[..., I:])) + h)`, `g = gated_layers(h)` (no bias)."""

    def __init__(self, config: AlibiBertConfig):
        super().__init__(config)
        self.gated_layers = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.wo = nn.Linear(config.intermediate_size, config.hidden_size)
        self.layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gated, plain = self.gated_layers(hidden_states).split(self.intermediate_size, dim=-1)  # 2 x (B, L, I)
        return self.layernorm(self.wo(self.dropout(self.act(gated) * plain)) + hidden_states)


class AlibiBertCodeGLUMLP(AlibiBertGLU):
    """jina-embeddings-v2-base-code's GLU, the activation on the SECOND half and no LayerNorm of its own:
    `down_layer(dropout(u[..., :I] * act(u[..., I:])))`, `u = up_gated_layer(h)` (no bias)."""

    def __init__(self, config: AlibiBertConfig):
        super().__init__(config)
        self.up_gated_layer = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_layer = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        up, gated = self.up_gated_layer(hidden_states).split(self.intermediate_size, dim=-1)  # 2 x (B, L, I)
        return self.down_layer(self.dropout(up * self.act(gated)))


class AlibiBertLayer(GradientCheckpointingLayer):
    """`layer_layout="jina"`: `a = LN(dense(attn(h)) + h)`, then the GLU with its own residual LayerNorm.
    `"jina_code"` (jina-bert-v2-qk-post-norm, read in their `JinaBertLayer.forward` and TEI's `jina_code.rs`): the
    input added a second time, `a = layer_norm_1(h + LN(dense(attn(h)) + h))`, `h = layer_norm_2(a + mlp(a))`."""

    def __init__(self, config: AlibiBertConfig):
        super().__init__()
        self.attention = AlibiBertAttention(config)
        self.double_residual = config.layer_layout == "jina_code"
        if self.double_residual:
            self.layer_norm_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
            self.mlp = AlibiBertCodeGLUMLP(config)
            self.layer_norm_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        else:
            self.mlp = AlibiBertGLUMLP(config)

    def forward(self, hidden_states, plan, output_attentions=False):
        attended, weights = self.attention(hidden_states, plan, output_attentions)  # (B, L, C)
        if not self.double_residual:
            return self.mlp(attended), weights
        hidden_states = self.layer_norm_1(hidden_states + attended)
        return self.layer_norm_2(hidden_states + self.mlp(hidden_states)), weights


class AlibiBertEncoder(nn.Module):
    def __init__(self, config: AlibiBertConfig):
        super().__init__()
        self.layer = nn.ModuleList([AlibiBertLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, hidden_states, plan, output_attentions=False):
        for layer in self.layer:
            hidden_states, _ = layer(hidden_states, plan, output_attentions)
        return hidden_states


class AlibiBertPooler(nn.Module):
    """BERT's: `tanh(dense(h[:, 0]))`."""

    def __init__(self, config: AlibiBertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(hidden_states[:, 0]))  # (B, C)


class AlibiBertPreTrainedModel(TiedHeadLoading, AlibiAttentionBackends, PreTrainedModel):
    config_class = AlibiBertConfig
    base_model_prefix = "bert"
    supports_gradient_checkpointing = True
    _no_split_modules = ["AlibiBertLayer"]
    _can_compile_fullgraph = True  # tested: the whole forward compiles without graph breaks (the bias bank's path)
    # What `output_hidden_states` / `output_attentions` record: each layer's input and output, each attention's weights
    _can_record_outputs = {
        "hidden_states": AlibiBertLayer,
        "attentions": OutputRecorder(AlibiBertSelfAttention, index=1),
    }

    def _init_weights(self, module):
        """BERT's initialisation; refills the fixed slopes (built on the meta device by `from_pretrained`)."""
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.padding_idx is not None and not was_loaded(module.weight):  # a row is a new tensor: unflagged
                init.zeros_(module.weight[module.padding_idx])
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        if isinstance(module, AlibiBertModel):
            init.copy_(module.alibi_slopes, get_alibi_slopes(self.config.num_attention_heads))


class AlibiBertModel(AlibiBertPreTrainedModel):
    """The bare encoder: `last_hidden_state` and BERT's pooler output (`add_pooling_layer=False`: None)."""

    def __init__(self, config: AlibiBertConfig, add_pooling_layer: bool = True):
        super().__init__(config)
        self.embeddings = AlibiBertEmbeddings(config)
        self.encoder = AlibiBertEncoder(config)
        self.pooler = AlibiBertPooler(config) if add_pooling_layer else None
        # Fixed, never trained: a non-persistent fp32 buffer (not in checkpoints, not seen by optimizers)
        self.register_buffer("alibi_slopes", get_alibi_slopes(config.num_attention_heads), persistent=False)  # (H,)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value):
        self.embeddings.word_embeddings = value

    def _apply(self, fn, recurse=True):
        # `model.to(bfloat16)` would round slopes such as 2**-0.5: they stay fp32
        super()._apply(fn, recurse)
        if self.alibi_slopes.dtype != torch.float32:
            self.alibi_slopes = get_alibi_slopes(self.config.num_attention_heads).to(self.alibi_slopes.device)
        return self

    @model_inputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPooling | tuple:
        r"""
        input_ids (`torch.LongTensor` of shape `(batch, length)`): token ids, of any length (no position table).
        attention_mask (`torch.Tensor` of shape `(batch, length)`, *optional*): 1 for real tokens, 0 for padding;
            padded keys are masked out (padded rows still get outputs, as in BERT).
        token_type_ids (`torch.LongTensor` of shape `(batch, length)`, *optional*): segment ids; zeros by default.
        position_ids (`torch.LongTensor` of shape `(batch, length)`, *optional*): ALiBi takes distances from token
            order, so positions matter only for packed rows: where they restart (transformers' padding-free
            collators), each document attends only to itself. Read without an `attention_mask`; `cu_seq_lens_q`
            (flash-attention style, one flattened row) marks documents too.
        `output_hidden_states`, `output_attentions` and `return_dict` are transformers' (attention weights come from
        the eager path, planned once).
        """
        kwargs.pop("output_hidden_states", None)  # recorded by capture_outputs' hooks
        output_attentions = kwargs.pop("output_attentions", None)
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        hidden_states = self.embeddings(input_ids, token_type_ids, inputs_embeds)  # (B, L, C)
        plan = self._plan(hidden_states, attention_mask, position_ids, output_attentions, kwargs.get("cu_seq_lens_q"))
        hidden_states = self.encoder(hidden_states, plan, output_attentions)  # (B, L, C)
        pooled = self.pooler(hidden_states) if self.pooler is not None else None  # (B, C)
        return BaseModelOutputWithPooling(last_hidden_state=hidden_states, pooler_output=pooled)

    @torch.no_grad()
    def attention_route_plan(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        output_attentions=None,
        **kwargs,
    ) -> AlibiAttentionPlan:
        """The route plan (`path`, `reason` and the facts; no payload) a forward with these inputs takes, without
        running its layers: the forward's own planning call with `prepare=False` (`hf_alibi.attention_route`)."""
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        hidden_states = self.embeddings(input_ids, token_type_ids, inputs_embeds)  # (B, L, C)
        cu_seq_lens = kwargs.get("cu_seq_lens_q")
        return self._plan(hidden_states, attention_mask, position_ids, output_attentions, cu_seq_lens, prepare=False)

    def _plan(self, hidden_states, attention_mask, position_ids, output_attentions, cu_seq_lens, prepare=True):
        """The forward's one bidirectional attention plan, validated and built once; every layer only reads it."""
        batch, length = hidden_states.shape[:2]
        device = hidden_states.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden_states.dtype
        return plan_alibi_attention(
            self.config._attn_implementation or "sdpa",
            self.alibi_slopes,
            batch,
            length,
            length,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cu_seq_lens=cu_seq_lens,
            dtype=dtype,
            dropout=self.config.attention_probs_dropout_prob if self.training else 0.0,
            output_attentions=output_attentions,
            skip_eps=self.config.alibi_skip_eps,
            causal=AlibiBertSelfAttention.is_causal,
            prepare=prepare,
        )


def _encode(model: AlibiBertPreTrainedModel, input_ids, attention_mask, token_type_ids, kwargs):
    """The heads' call of their `bert`: a model output whatever `config.return_dict` says; the flattened-row
    descriptions and transformers' recording flags passed on, the rest (`num_items_in_batch`) left for the loss."""
    passed = {name: kwargs.pop(name) for name in (*FLATTENED_BATCH_KWARGS, "position_ids") if name in kwargs}
    for name in ("inputs_embeds", "output_attentions", "output_hidden_states"):
        passed[name] = kwargs.pop(name, None)
    return model.bert(input_ids, attention_mask, token_type_ids, return_dict=True, **passed)


class AlibiBertPredictionHeadTransform(nn.Module):
    def __init__(self, config: AlibiBertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.transform_act_fn = ACT2FN[config.hidden_act]
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.transform_act_fn(self.dense(hidden_states)))


class AlibiBertLMPredictionHead(nn.Module):
    def __init__(self, config: AlibiBertConfig):
        super().__init__()
        self.transform = AlibiBertPredictionHeadTransform(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)  # weight tied to the word embeddings

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.transform(hidden_states))


class AlibiBertOnlyMLMHead(nn.Module):
    def __init__(self, config: AlibiBertConfig):
        super().__init__()
        self.predictions = AlibiBertLMPredictionHead(config)

    def forward(self, sequence_output: torch.Tensor) -> torch.Tensor:
        return self.predictions(sequence_output)


class AlibiBertForMaskedLM(AlibiBertPreTrainedModel):
    _tied_weights_keys = {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight"}

    def __init__(self, config: AlibiBertConfig):
        super().__init__(config)
        self.bert = AlibiBertModel(config, add_pooling_layer=False)
        self.cls = AlibiBertOnlyMLMHead(config)
        self.loss_type = "ForMaskedLM"  # -100 labels ignored; `num_items_in_batch` honoured
        self.post_init()

    def get_output_embeddings(self):
        return self.cls.predictions.decoder

    def set_output_embeddings(self, new_embeddings):
        self.cls.predictions.decoder = new_embeddings

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, labels=None, **kwargs):
        r"""labels (`(batch, length)`, *optional*): the masked tokens' ids, -100 elsewhere (ignored), as in BERT."""
        outputs = _encode(self, input_ids, attention_mask, token_type_ids, kwargs)
        logits = self.cls(outputs.last_hidden_state)  # (B, L, V)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, vocab_size=self.config.vocab_size, **kwargs)
        return MaskedLMOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


def _classifier_dropout(config: AlibiBertConfig) -> nn.Dropout:
    """BERT's: `classifier_dropout`, or `hidden_dropout_prob` when it is None."""
    rate = config.classifier_dropout
    return nn.Dropout(config.hidden_dropout_prob if rate is None else rate)


def _add_classifier(model: AlibiBertPreTrainedModel, config: AlibiBertConfig, pooled: bool, loss_type: str) -> None:
    """BERT's classification heads' parts on `model`: the encoder (with its pooler if `pooled`), dropout, classifier."""
    model.num_labels = config.num_labels
    model.bert = AlibiBertModel(config, add_pooling_layer=pooled)
    model.dropout = _classifier_dropout(config)
    model.classifier = nn.Linear(config.hidden_size, config.num_labels)
    model.loss_type = loss_type
    model.post_init()


class AlibiBertForSequenceClassification(AlibiBertPreTrainedModel):
    """BERT's: the pooler output -> dropout -> `classifier`; `problem_type` as in BERT (regression for one label)."""

    def __init__(self, config: AlibiBertConfig):
        super().__init__(config)
        _add_classifier(self, config, pooled=True, loss_type="ForSequenceClassification")

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, labels=None, **kwargs):
        outputs = _encode(self, input_ids, attention_mask, token_type_ids, kwargs)
        logits = self.classifier(self.dropout(outputs.pooler_output))  # (B, num_labels)
        loss = None if labels is None else self.loss_function(labels, logits, self.config, **kwargs)
        return SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


class AlibiBertForTokenClassification(AlibiBertPreTrainedModel):
    """BERT's: the hidden states -> dropout -> `classifier`, one prediction per token (-100 labels ignored)."""

    def __init__(self, config: AlibiBertConfig):
        super().__init__(config)
        _add_classifier(self, config, pooled=False, loss_type="ForTokenClassification")

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, labels=None, **kwargs):
        outputs = _encode(self, input_ids, attention_mask, token_type_ids, kwargs)
        logits = self.classifier(self.dropout(outputs.last_hidden_state))  # (B, L, num_labels)
        loss = None if labels is None else self.loss_function(logits, labels, self.config, **kwargs)
        return TokenClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


__all__ = [
    "AlibiBertPreTrainedModel",
    "AlibiBertModel",
    "AlibiBertForMaskedLM",
    "AlibiBertForSequenceClassification",
    "AlibiBertForTokenClassification",
]
