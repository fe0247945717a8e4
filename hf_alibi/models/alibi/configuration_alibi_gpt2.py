"""Configuration of the ALiBi GPT-2 family: GPT-2's arguments, minus position embeddings, plus ALiBi's."""

import math

from transformers.activations import ACT2FN
from transformers.utils import logging

from .transformers_compat import ConfigBase

logger = logging.get_logger(__name__)

# Written into every saved config, so a Hub user without hf_alibi loads any head with `trust_remote_code=True`.
AUTO_MAP = {
    "AutoConfig": "configuration_alibi_gpt2.AlibiGPT2Config",
    "AutoModel": "modeling_alibi_gpt2.AlibiGPT2Model",
    "AutoModelForCausalLM": "modeling_alibi_gpt2.AlibiGPT2LMHeadModel",
    "AutoModelForSequenceClassification": "modeling_alibi_gpt2.AlibiGPT2ForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_alibi_gpt2.AlibiGPT2ForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_alibi_gpt2.AlibiGPT2ForQuestionAnswering",
}


class AlibiGPT2Config(ConfigBase):
    r"""
    Configuration for [`AlibiGPT2Model`] and its heads: GPT-2 (pre-LayerNorm blocks, `gelu_new` MLP, tied LM head)
    with no position embeddings. Attention logits get the fixed, non-learned bias of ALiBi (Press et al., 2022,
    "Train Short, Test Long"): `q_i . k_j / sqrt(d) - m_h * (i - j)` for key `j <= i` in head `h`.

    Argument names and defaults are GPT-2's, so `GPT2Config` keyword arguments carry over unchanged.

    Args:
        vocab_size (`int`, *optional*, defaults to 50257):
            Size of the vocabulary: the number of rows of `wte` and of outputs of the LM head.
        n_positions (`int`, *optional*, defaults to 1024):
            The sequence length the model is (or was) trained at. Metadata only: ALiBi has no position table, so
            inputs of any length run. `max_position_embeddings=` is accepted as an argument and stored here, but the
            config deliberately has no `max_position_embeddings` attribute (as BLOOM's has none): transformers'
            `generate` reads that attribute to warn past a "predefined maximum length", which ALiBi does not have.
            Tools that size their windows from `n_positions` (lm-evaluation-harness) take an explicit `max_length`.
        n_embd (`int`, *optional*, defaults to 768):
            Width of the residual stream. Must be divisible by `n_head`. Alias: `hidden_size`.
        n_layer (`int`, *optional*, defaults to 12):
            Number of transformer blocks. Alias: `num_hidden_layers`.
        n_head (`int`, *optional*, defaults to 12):
            Number of attention heads, each with its own ALiBi slope. Alias: `num_attention_heads`.
        n_inner (`int`, *optional*):
            Width of the MLP's hidden layer; `None` means `4 * n_embd`.
        activation_function (`str`, *optional*, defaults to `"gelu_new"`):
            MLP activation, any key of `transformers.activations.ACT2FN`. The tanh GELU, under any name that is
            exactly it (`gelu_new`, `gelu_pytorch_tanh`, ...), runs as torch's fused kernel (`activations.py`);
            the name is kept as given.
        resid_pdrop (`float`, *optional*, defaults to 0.1):
            Dropout on the outputs of attention and MLP before they join the residual stream.
        embd_pdrop (`float`, *optional*, defaults to 0.1):
            Dropout on the token embeddings.
        attn_pdrop (`float`, *optional*, defaults to 0.1):
            Dropout on the attention probabilities (training only).
        layer_norm_epsilon (`float`, *optional*, defaults to 1e-5):
            Epsilon of every norm, LayerNorm or RMSNorm (`norm_type`; Baichuan's `rms_norm_eps`).
        initializer_range (`float`, *optional*, defaults to 0.02):
            Standard deviation of the normal initialisation of weights (GPT-2's scheme, residual projections scaled
            by `1 / sqrt(2 * n_layer)`).
        scale_attn_weights (`bool`, *optional*, defaults to `True`):
            Divide `q . k` by `head_dim ** attn_scale_power` (`sqrt(head_dim)` by default). The ALiBi bias itself is
            never scaled.
        use_cache (`bool`, *optional*, defaults to `True`):
            Whether the model returns a key/value cache for incremental decoding.
        bos_token_id (`int`, *optional*, defaults to 50256):
            The beginning-of-sequence token id, as in GPT-2.
        eos_token_id (`int`, *optional*, defaults to 50256):
            The end-of-sequence token id, as in GPT-2.
        pad_token_id (`int`, *optional*):
            The padding token id, as in GPT-2.
        tie_word_embeddings (`bool`, *optional*, defaults to `True`):
            Tie the LM head to `wte`. `False`: `lm_head.weight` is a weight of its own, in the state dict (Jais's
            untied variants, Baichuan's).
        classifier_dropout (`float`, *optional*, defaults to 0.1):
            Dropout before the token-classification head.
        alibi_max_bias (`float`, *optional*, defaults to 8.0):
            The `8` in the paper's slope rule `m_h = 2 ** (-max_bias * h / n)` (MPT's `alibi_bias_max`). Must be
            positive and finite. Ignored when `alibi_slopes` is given.
        alibi_slopes (`list[float]`, *optional*):
            Explicit per-head slopes, one per head, each finite and >= 0, overriding the paper's rule. All zeros is
            the "no position information" ablation (a causal transformer with no position signal). Imports of MPT
            and Falcon checkpoints write their exact slopes here (Falcon's divided by `sqrt(head_dim)`).
        embedding_layernorm (`bool`, *optional*, defaults to `False`):
            Apply a LayerNorm (`transformer.ln_embd`) to the token embeddings before the first block, as BLOOM does
            (its `word_embeddings_layernorm`).
        bias (`bool`, *optional*, defaults to `True`):
            Give every linear layer and LayerNorm an additive bias. `False` is MPT's and Baichuan's architecture: no
            bias anywhere (the parameters are absent from the state dict, not zero). An RMSNorm has none either way.
        norm_type (`str`, *optional*, defaults to `"layer_norm"`):
            The norm of every block (`ln_1`, `ln_2`), of the final hidden states (`ln_f`) and of the embeddings
            (`ln_embd`, with `embedding_layernorm`): `"layer_norm"`, GPT-2's LayerNorm, or `"rms_norm"`, the RMSNorm
            of Baichuan and Llama, `weight * x / sqrt(mean(x^2) + eps)` with no bias and no mean subtracted, its mean
            of squares taken in fp32 whatever the activations' dtype (`normalization.py`). The state dict names are
            the same (`ln_1.weight`, ...).
        clip_qkv (`float`, *optional*):
            Clamp the fused query/key/value projection to `[-clip_qkv, clip_qkv]` before attention (MPT's
            `clip_qkv`, e.g. 6 in mpt-30b-chat). `None` means no clamp. Must be positive and finite.
        gated_mlp (`bool`, *optional*, defaults to `False`):
            A gated MLP, `c_proj(c_fc(x) * act(c_fc2(x)))` with `act` the `activation_function` and a second input
            projection `mlp.c_fc2` (the gate) of the same width `n_inner`. With `activation_function="silu"` this is
            SwiGLU, the MLP of Jais and BTLM (whose `n_inner` is not `4 * n_embd`: 13653 for jais-13b).
        attn_scale_power (`float`, *optional*, defaults to 0.5):
            With `scale_attn_weights`, `q . k` is divided by `head_dim ** attn_scale_power`: 0.5 is GPT-2's
            `1 / sqrt(head_dim)`, 1.0 muP's `1 / head_dim` (Jais's and BTLM's `scale_qk_dot_by_d`). The ALiBi bias is
            added after the scaling, unscaled. A finite number >= 0.
        embedding_scale (`float`, *optional*, defaults to 1.0):
            The token embeddings (or the `inputs_embeds` passed in) are multiplied by this, before segment
            embeddings are added (muP's input multiplier: Jais's and BTLM's `embeddings_scale`, 14.6 in jais-13b).
            The product is taken in the activations' dtype, with the scale rounded to it, as their code does.
            Positive and finite.
        logit_scale (`float`, *optional*, defaults to 1.0):
            The LM head's logits are multiplied by this (muP's output multiplier: Jais's `width_scale`, or
            `mup_output_alpha * mup_width_scale`, 0.222 in BTLM-3B-8K), in the logits' dtype. The loss is taken on the
            scaled logits. The other heads are not scaled. Positive and finite.
        alibi_scaling (`dict`, *optional*):
            Slope interpolation, in Jais's and BTLM's own format (imports copy it, exports write it back). `None`: the
            slopes as they are. `{"type": "linear", "factor": f}`: every slope divided by `f` (every distance is,
            linearly interpolated positions; the slopes buffer holds the divided slopes). `{"type": "linear",
            "train_seq_len": n}` (BTLM's "position interpolation", Al-Khateeb et al. 2023): in every forward the
            slopes are divided by `max(1, K / n)`, where `K` is the number of keys that forward attends (cached plus
            new tokens, padding included), exactly as Jais's and BTLM's code compute it. So a decoding step at `K`
            keys uses the scale of `K`, and every token is computed at the scale of the forward it was new in (the
            source's semantics): given the same keys and values, a cached step's row equals the last row of a full
            forward over those `K` keys, and only that row (the full forward's earlier rows use the scale of `K`
            too, the cached steps that made them their own). In a model of several layers the deeper layers' cached
            keys come from those earlier rows, so cached decoding past `n` is not a full forward's last row either:
            it is what the source's cached decoding computes. Under continuous batching each request uses its own
            `K`; a static cache its filled length, not its buffer; packed rows the row's length. Certified skipping
            certifies from the scaled slopes (smaller slopes: fewer keys skipped). `f` is a positive finite number,
            `n` a positive integer. `alibi_scaling_factor=f` (the former static switch) is a
            deprecated alias of `{"type": "linear", "factor": f}`, still read from older config files.
        alibi_sdpa_split (`bool`, *optional*, defaults to `True`):
            Which SDPA path serves multi-row, unpacked, dropout-free calls on CPU outside compilation: `True` the
            split (no bias tensor; `hf_alibi/models/alibi/attention_sdpa_split.py`), `False` the bias bank that every other SDPA
            call takes. Both compute the same attention (the tests compare them); a runtime choice.
        alibi_sdpa_query_chunk (`int`, *optional*, defaults to 256):
            Query rows per chunk of the bias-bank path: its mask is `(B|1, H, chunk, kv)` floats, built once per
            forward. A positive integer; a runtime choice (small values make tests cross chunk boundaries).
        alibi_skip_eps (`float` or `"auto"`, *optional*, defaults to `"auto"`):
            Certified key skipping (outside torch.compile): per head and block of 256 query rows, keys whose softmax
            mass is provably <= eps are not computed, which changes each output by at most `2 * eps * max|v|`
            (`attention_skip.py` proves the bound). `"auto"` skips with eps `1e-7` (exact to fp32 rounding) exactly
            where it was measured to pay: the `sdpa` backend on CPU, for prefills, training steps and decoding
            steps long enough for the heads' slopes (`attention_certified.skipping_pays`), dense elsewhere. A
            number in `(0, 1)` skips with that eps wherever skipping applies (the `sdpa` backend on CPU, prefill in
            training too, and decoding; `flex_attention`), `0.0` is dense attention. A runtime choice, e.g.
            `from_pretrained(..., alibi_skip_eps=0.0)`.

    Example:

    ```python
    >>> from transformers import AutoConfig, AutoModelForCausalLM
    >>> import hf_alibi  # registers "alibi_gpt2" with the Auto classes
    >>> config = AutoConfig.for_model("alibi_gpt2", n_layer=4, n_head=12, n_embd=384, vocab_size=8000, n_positions=256)
    >>> model = AutoModelForCausalLM.from_config(config)
    ```
    """

    model_type = "alibi_gpt2"
    keys_to_ignore_at_inference = ["cache"]
    # transformers' engine (`DistributedConfig`, `tp_plan="auto"`): Llama's plan in GPT-2's names. The conv1d_* and
    # alibi_heads styles (`tensor_parallel_alibi_gpt2.py`) split GPT-2's (in, out) Conv1D weights, c_attn's packed
    # q|k|v per block, and tell each rank's attention which global heads (hence slopes) it holds.
    _TP_PLAN = {
        "wte": "embedding_rowwise",
        "h.*.attn": "alibi_heads",
        "h.*.attn.c_attn": "conv1d_qkv_colwise",
        "h.*.attn.c_proj": "conv1d_rowwise",
        "h.*.mlp.c_fc": "conv1d_colwise",
        "h.*.mlp.c_fc2": "conv1d_colwise",  # the gate of a gated MLP: split like c_fc, so each rank gates its columns
        "h.*.mlp.c_proj": "conv1d_rowwise",
    }

    @property
    def base_model_tp_plan(self) -> dict[str, str]:
        """The plan for this config's modules: the gate's rule only where the MLP has a gate (`gated_mlp`);
        transformers warns about a rule that matches nothing in the model."""
        return {name: style for name, style in self._TP_PLAN.items() if self.gated_mlp or not name.endswith(".c_fc2")}

    @base_model_tp_plan.setter
    def base_model_tp_plan(self, plan) -> None:
        # transformers 5.15-5.20's `__post_init__` adds Llama's `embed_tokens` rule to a tied model's plan; this
        # model's embedding is `wte`, planned above, so the assignment changes nothing.
        pass

    # FSDP2 (`DistributedConfig(fsdp_size=N)`): Llama's default plan in GPT-2's names (one unit per block).
    base_model_fsdp_plan = {"wte": "free_full_weight", "h.*": "free_full_weight", "ln_f": "keep_full_weight"}
    attribute_map = {
        "hidden_size": "n_embd",
        "num_attention_heads": "n_head",
        "num_hidden_layers": "n_layer",
    }

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None
    activation_function: str = "gelu_new"
    resid_pdrop: float = 0.1
    embd_pdrop: float = 0.1
    attn_pdrop: float = 0.1
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    scale_attn_weights: bool = True
    use_cache: bool = True
    bos_token_id: int | None = 50256
    eos_token_id: int | list[int] | None = 50256
    pad_token_id: int | None = None
    tie_word_embeddings: bool = True
    classifier_dropout: float = 0.1
    alibi_max_bias: float = 8.0
    alibi_slopes: list[float] | None = None
    embedding_layernorm: bool = False
    bias: bool = True
    norm_type: str = "layer_norm"
    clip_qkv: float | None = None
    gated_mlp: bool = False
    attn_scale_power: float = 0.5
    embedding_scale: float = 1.0
    logit_scale: float = 1.0
    alibi_scaling: dict | None = None
    alibi_sdpa_split: bool = True
    alibi_sdpa_query_chunk: int = 256
    alibi_skip_eps: float | str = "auto"

    def __post_init__(self, **kwargs):
        if "max_position_embeddings" in kwargs:  # GPT-2-style name for the training length: not an attribute here
            self.n_positions = kwargs.pop("max_position_embeddings")
        if "alibi_scaling_factor" in kwargs:  # the former static switch (configs saved before `alibi_scaling`)
            self.alibi_scaling = _folded_factor(kwargs.pop("alibi_scaling_factor"), self.alibi_scaling)
        super().__post_init__(**kwargs)
        self._check_arguments()
        if getattr(self, "auto_map", None) is None:
            self.auto_map = dict(AUTO_MAP)

    def _check_arguments(self) -> None:
        """Raise a `ValueError` naming the first bad argument, before any model is built from this config."""
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.n_inner is not None and (not isinstance(self.n_inner, int) or self.n_inner <= 0):
            raise ValueError(f"n_inner must be a positive integer or None, got {self.n_inner!r}")
        if self.activation_function not in ACT2FN:
            raise ValueError(
                f"activation_function {self.activation_function!r} is unknown; choose one of {sorted(ACT2FN)}"
            )
        for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "classifier_dropout"):
            value = getattr(self, name)
            if not 0.0 <= float(value) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value!r}")
        if not (isinstance(self.alibi_max_bias, (int, float)) and math.isfinite(self.alibi_max_bias)) or (
            self.alibi_max_bias <= 0
        ):
            raise ValueError(f"alibi_max_bias must be a positive finite number, got {self.alibi_max_bias!r}")
        if self.alibi_slopes is not None:
            slopes = list(self.alibi_slopes)
            if len(slopes) != self.n_head:
                raise ValueError(
                    f"alibi_slopes has {len(slopes)} values but n_head is {self.n_head}: give one slope per head"
                )
            for slope in slopes:
                if not isinstance(slope, (int, float)) or not math.isfinite(slope) or slope < 0:
                    raise ValueError(f"alibi_slopes must be finite and >= 0, got {slope!r} in {slopes}")
            self.alibi_slopes = [float(s) for s in slopes]
        chunk = self.alibi_sdpa_query_chunk
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
            raise ValueError(f"alibi_sdpa_query_chunk must be a positive integer, got {chunk!r}")
        eps = self.alibi_skip_eps
        if eps != "auto" and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0.0 <= eps < 1.0):
            raise ValueError(f"alibi_skip_eps must be 'auto' or a number in [0, 1), got {eps!r}")
        self.alibi_skip_eps = eps if eps == "auto" else float(eps)
        if self.norm_type not in NORM_TYPES:
            raise ValueError(f"norm_type must be one of {list(NORM_TYPES)}, got {self.norm_type!r}")
        for name in ("embedding_layernorm", "bias", "alibi_sdpa_split", "gated_mlp", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        clip = self.clip_qkv
        if clip is not None and (
            isinstance(clip, bool) or not isinstance(clip, (int, float)) or not math.isfinite(clip) or clip <= 0
        ):
            raise ValueError(f"clip_qkv must be None or a positive finite number, got {clip!r}")
        power = self.attn_scale_power
        if isinstance(power, bool) or not isinstance(power, (int, float)) or not math.isfinite(power) or power < 0:
            raise ValueError(f"attn_scale_power must be a finite number >= 0, got {power!r}")
        self.attn_scale_power = float(power)
        self.alibi_scaling = checked_alibi_scaling(self.alibi_scaling)
        for name in ("embedding_scale", "logit_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
            setattr(self, name, float(value))

    @property
    def alibi_scaling_factor(self) -> float:
        """Deprecated: the static divisor of `alibi_scaling` (1.0 without one, or with the length-dependent form)."""
        logger.warning_once("`alibi_scaling_factor` is deprecated: read `alibi_scaling` instead")
        return static_scaling_factor(self.alibi_scaling)

    @alibi_scaling_factor.setter
    def alibi_scaling_factor(self, value) -> None:
        logger.warning_once('`alibi_scaling_factor` is deprecated: set `alibi_scaling={"type": "linear", "factor": f}`')
        self.alibi_scaling = checked_alibi_scaling(_folded_factor(value, None))


NORM_TYPES = ("layer_norm", "rms_norm")  # `norm_type`: GPT-2's LayerNorm, Baichuan's and Llama's RMSNorm
SCALING_KEYS = ("factor", "train_seq_len")  # the two forms of `alibi_scaling`, besides its "type": "linear"


def checked_alibi_scaling(scaling) -> dict | None:
    """`alibi_scaling` validated (a `ValueError` naming the field and the bad value) and normalised: `factor` a
    float, `train_seq_len` an int."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise ValueError(
            f"alibi_scaling must be None or a dict such as {{'type': 'linear', 'factor': 2.0}}, got {scaling!r}"
        )
    if scaling.get("type") != "linear":
        raise ValueError(
            f"alibi_scaling.type must be 'linear' (the only type Jais and BTLM define), got "
            f"{scaling.get('type')!r} in {scaling!r}"
        )
    unknown = sorted(set(scaling) - {"type", *SCALING_KEYS})
    given = [key for key in SCALING_KEYS if key in scaling]
    if unknown or len(given) != 1:
        raise ValueError(f"alibi_scaling takes 'type' and exactly one of {list(SCALING_KEYS)}, got {scaling!r}")
    value = scaling[given[0]]
    if given[0] == "factor":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"alibi_scaling.factor must be a positive finite number, got {value!r}")
        return {"type": "linear", "factor": float(value)}
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"alibi_scaling.train_seq_len must be a positive integer, got {value!r}")
    return {"type": "linear", "train_seq_len": value}


def static_scaling_factor(scaling: dict | None) -> float:
    """What every slope is divided by whatever the length: `alibi_scaling.factor`, else 1."""
    return float(scaling["factor"]) if scaling is not None and "factor" in scaling else 1.0


def train_seq_len(scaling: dict | None) -> int | None:
    """`alibi_scaling.train_seq_len` (slopes divided by `max(1, K / n)` in each forward), else None."""
    return scaling.get("train_seq_len") if scaling is not None else None


def _folded_factor(factor, scaling: dict | None) -> dict | None:
    """The deprecated `alibi_scaling_factor` as the `alibi_scaling` it means; 1.0 (what older configs all carry)
    means none."""
    if isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor == 1.0:
        return scaling
    if scaling is not None:
        raise ValueError(
            f"alibi_scaling_factor={factor!r} and alibi_scaling={scaling!r} both given: set "
            "alibi_scaling alone (alibi_scaling_factor is its deprecated alias)"
        )
    logger.warning_once('`alibi_scaling_factor` is deprecated: use `alibi_scaling={"type": "linear", "factor": f}`')
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"alibi_scaling_factor must be a positive finite number, got {factor!r}")
    return {"type": "linear", "factor": factor}


__all__ = ["AUTO_MAP", "AlibiGPT2Config"]
