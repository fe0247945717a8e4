"""hf_alibi: ALiBi models for transformers. Importing registers model types "alibi_gpt2" (the GPT-2-style decoder) and
"alibi_bert" (the encoder of jina-embeddings-v2 / MosaicBERT) with the Auto classes.

Only the model loads here: `convert`, `convert_gpt2` and `export` load the conversion layer (and transformers' BLOOM,
MPT, Falcon and GPT-2 code) on first use; `hf_alibi.experiments` needs the `experiments` extra.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from .models.alibi.alibi_bias import alibi_causal_bias, get_alibi_slopes
from .models.alibi.configuration_alibi_bert import AlibiBertConfig
from .models.alibi.configuration_alibi_gpt2 import AlibiGPT2Config
from .models.alibi.modeling_alibi_bert import (
    AlibiBertForMaskedLM,
    AlibiBertForSequenceClassification,
    AlibiBertForTokenClassification,
    AlibiBertModel,
    AlibiBertPreTrainedModel,
)
from .models.alibi.modeling_alibi_gpt2 import (
    AlibiGPT2ForQuestionAnswering,
    AlibiGPT2ForSequenceClassification,
    AlibiGPT2ForTokenClassification,
    AlibiGPT2LMHeadModel,
    AlibiGPT2Model,
    AlibiGPT2PreTrainedModel,
)
from .route_inspection import AttentionRouteReport, attention_route

AUTO_CLASSES = {
    AutoModel: AlibiGPT2Model,
    AutoModelForCausalLM: AlibiGPT2LMHeadModel,
    AutoModelForSequenceClassification: AlibiGPT2ForSequenceClassification,
    AutoModelForTokenClassification: AlibiGPT2ForTokenClassification,
    AutoModelForQuestionAnswering: AlibiGPT2ForQuestionAnswering,
}

ENCODER_AUTO_CLASSES = {
    AutoModel: AlibiBertModel,
    AutoModelForMaskedLM: AlibiBertForMaskedLM,
    AutoModelForSequenceClassification: AlibiBertForSequenceClassification,
    AutoModelForTokenClassification: AlibiBertForTokenClassification,
}

for _config_class, _classes in ((AlibiGPT2Config, AUTO_CLASSES), (AlibiBertConfig, ENCODER_AUTO_CLASSES)):
    AutoConfig.register(_config_class.model_type, _config_class, exist_ok=True)
    _config_class.register_for_auto_class("AutoConfig")  # save_pretrained ships the code beside the weights
    for _auto_class, _model_class in _classes.items():
        _auto_class.register(_config_class, _model_class, exist_ok=True)
        _model_class.register_for_auto_class(_auto_class.__name__)

_CONVERSION = ("convert", "convert_gpt2", "export")


def __getattr__(name: str):
    """`hf_alibi.convert` and friends: import `hf_alibi.conversion` on first use, not with the package."""
    if name in _CONVERSION:
        from . import conversion

        return getattr(conversion, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AlibiBertConfig",
    "AlibiBertModel",
    "AlibiBertForMaskedLM",
    "AlibiBertForSequenceClassification",
    "AlibiBertForTokenClassification",
    "AlibiBertPreTrainedModel",
    "AlibiGPT2Config",
    "AlibiGPT2Model",
    "AlibiGPT2LMHeadModel",
    "AlibiGPT2ForSequenceClassification",
    "AlibiGPT2ForTokenClassification",
    "AlibiGPT2ForQuestionAnswering",
    "AlibiGPT2PreTrainedModel",
    "AttentionRouteReport",
    "alibi_causal_bias",
    "attention_route",
    "convert",
    "convert_gpt2",
    "export",
    "get_alibi_slopes",
]
