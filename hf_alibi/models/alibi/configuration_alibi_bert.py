"""Configuration of the ALiBi encoder family: BERT's post-LayerNorm encoder with a GLU MLP and symmetric ALiBi
(jina-embeddings-v2, jina-reranker-v1, MosaicBERT, DNABERT-2), under Jina's config key names."""

from transformers.activations import ACT2FN

from .transformers_compat import ConfigBase

# Written into every saved config, so a Hub user without hf_alibi loads any head with `trust_remote_code=True`.
AUTO_MAP = {
    "AutoConfig": "configuration_alibi_bert.AlibiBertConfig",
    "AutoModel": "modeling_alibi_bert.AlibiBertModel",
    "AutoModelForMaskedLM": "modeling_alibi_bert.AlibiBertForMaskedLM",
    "AutoModelForSequenceClassification": "modeling_alibi_bert.AlibiBertForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_alibi_bert.AlibiBertForTokenClassification",
}

# `feed_forward_type` -> the GLU's activation (None: the config's `hidden_act`)
FEED_FORWARD_ACTIVATIONS = {"geglu": "gelu", "reglu": "relu", "glu": None}
# `layer_layout` values: jina-embeddings-v2's (and MosaicBERT's) layer, and jina-embeddings-v2-base-code's
LAYER_LAYOUTS = ("jina", "jina_code")


class AlibiBertConfig(ConfigBase):
    r"""
    Configuration for [`AlibiBertModel`] and its heads: a BERT encoder (post-LayerNorm layers) whose MLP is a GLU and
    whose attention has no position table but the symmetric ALiBi bias `q_i . k_j / sqrt(d) - m_h * |i - j|` over
    every key (no causal mask), with the paper's slopes. Key names are jina-embeddings-v2's, so their configs (and
    MosaicBERT's) carry over.

    Args:
        vocab_size (`int`, *optional*, defaults to 30528):
            Size of the vocabulary: rows of `embeddings.word_embeddings` and outputs of the masked-LM head.
        hidden_size (`int`, *optional*, defaults to 768):
            Width of the hidden states. Must be divisible by `num_attention_heads`.
        num_hidden_layers (`int`, *optional*, defaults to 12):
            Number of encoder layers.
        num_attention_heads (`int`, *optional*, defaults to 12):
            Number of attention heads, each with its own ALiBi slope (the paper's rule, interleaved for counts that
            are not powers of two).
        intermediate_size (`int`, *optional*, defaults to 3072):
            Width of the GLU: `mlp.gated_layers` has `2 * intermediate_size` outputs, `act(first half) * second half`.
        hidden_act (`str`, *optional*, defaults to `"gelu"`):
            The masked-LM head's transform activation (as in Jina's code), and the GLU's when
            `feed_forward_type="glu"`. Any key of `transformers.activations.ACT2FN`.
        feed_forward_type (`str`, *optional*, defaults to `"geglu"`):
            The GLU's activation: `"geglu"` the exact (erf) GELU, `"reglu"` ReLU, `"glu"` `hidden_act`.
        hidden_dropout_prob (`float`, *optional*, defaults to 0.1):
            Dropout on the embeddings and on each sublayer's output before its residual LayerNorm.
        attention_probs_dropout_prob (`float`, *optional*, defaults to 0.0):
            Dropout on the attention probabilities (training only).
        type_vocab_size (`int`, *optional*, defaults to 2):
            Rows of `embeddings.token_type_embeddings` (segment ids; zeros when not given).
        initializer_range (`float`, *optional*, defaults to 0.02):
            Standard deviation of the normal initialisation of weights (BERT's scheme).
        layer_norm_eps (`float`, *optional*, defaults to 1e-12):
            Epsilon of every LayerNorm.
        pad_token_id (`int`, *optional*, defaults to 0):
            The padding token id (rows of `word_embeddings` it indexes get no gradient from padding alone).
        classifier_dropout (`float`, *optional*):
            Dropout before the classification heads; `None` means `hidden_dropout_prob`, as in BERT.
        qk_layer_norm (`bool`, *optional*, defaults to `False`):
            A LayerNorm on the queries and on the keys (`attention.self.layer_norm_q`, `layer_norm_k`) before the
            scores, as jina-embeddings-v2-base-code has.
        layer_layout (`str`, *optional*, defaults to `"jina"`):
            The layer around the attention: `"jina"` (jina-embeddings-v2, MosaicBERT): `a = LN(dense(attn(h)) + h)`,
            `g = gated_layers(a)`, `h = layernorm(wo(act(g[..., :I]) * g[..., I:]) + a)`. `"jina_code"`
            (jina-embeddings-v2-base-code's `jina-bert-v2-qk-post-norm`): the layer's input is added a second time,
            `a = layer_norm_1(h + LN(dense(attn(h)) + h))`, the GLU is `u = up_gated_layer(a)` with the activation
            on the second half, `h = layer_norm_2(a + down_layer(u[..., :I] * act(u[..., I:])))`.
        max_position_embeddings (`int`, *optional*, defaults to 8192):
            The length the source model names (informational only): ALiBi has no position table and inputs of any
            length run.
        alibi_skip_eps (`float` or `"auto"`, *optional*, defaults to `"auto"`):
            Certified key skipping on both sides of each row (the `sdpa` backend on CPU, outside torch.compile): per
            head and block of 256 query rows, the far keys left and right whose softmax mass is provably <= eps in
            all are not computed, which changes each output by at most `2 * eps * max|v|`. `"auto"` skips with eps
            `1e-7` (exact to fp32 rounding) where it was measured to pay for the heads' slopes and the length
            (`attention_certified.skipping_pays`), dense elsewhere; a number in `(0, 1)` skips with that eps wherever
            it applies; `0.0` is dense attention. A runtime choice, e.g. `from_pretrained(..., alibi_skip_eps=0.0)`.

    Example:

    ```python
    >>> from transformers import AutoConfig, AutoModel
    >>> import hf_alibi  # registers "alibi_bert" with the Auto classes
    >>> config = AutoConfig.for_model("alibi_bert", hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    >>> model = AutoModel.from_config(config)
    ```
    """

    model_type = "alibi_bert"

    vocab_size: int = 30528
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    feed_forward_type: str = "geglu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.0
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: int | None = 0
    classifier_dropout: float | None = None
    qk_layer_norm: bool = False
    layer_layout: str = "jina"
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    alibi_skip_eps: float | str = "auto"

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self._check_arguments()
        if getattr(self, "auto_map", None) is None:
            self.auto_map = dict(AUTO_MAP)

    def _check_arguments(self) -> None:
        """Raise a `ValueError` naming the first bad argument, before any model is built from this config."""
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "type_vocab_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads ({self.num_attention_heads})"
            )
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"hidden_act {self.hidden_act!r} is unknown; choose one of {sorted(ACT2FN)}")
        if self.feed_forward_type not in FEED_FORWARD_ACTIVATIONS:
            raise ValueError(
                f"feed_forward_type {self.feed_forward_type!r} is unknown; choose one of {list(FEED_FORWARD_ACTIVATIONS)}"
            )
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout"):
            value = getattr(self, name)
            if value is None and name == "classifier_dropout":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value!r}")
        eps = self.layer_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ValueError(f"layer_norm_eps must be a positive number, got {eps!r}")
        if not isinstance(self.qk_layer_norm, bool):
            raise ValueError(f"qk_layer_norm must be True or False, got {self.qk_layer_norm!r}")
        if self.layer_layout not in LAYER_LAYOUTS:
            raise ValueError(f"layer_layout {self.layer_layout!r} is unknown; choose one of {list(LAYER_LAYOUTS)}")
        skip = self.alibi_skip_eps
        if skip != "auto" and (isinstance(skip, bool) or not isinstance(skip, (int, float)) or not 0.0 <= skip < 1.0):
            raise ValueError(f"alibi_skip_eps must be 'auto' or a number in [0, 1), got {skip!r}")
        self.alibi_skip_eps = skip if skip == "auto" else float(skip)

    @property
    def glu_activation(self) -> str:
        """The `ACT2FN` name of the GLU's activation (`feed_forward_type`'s, or `hidden_act` for `"glu"`)."""
        return FEED_FORWARD_ACTIVATIONS[self.feed_forward_type] or self.hidden_act


__all__ = ["AUTO_MAP", "AlibiBertConfig"]
