"""Conversions into ALiBi GPT-2 (and, later, exports out of it). Not shipped with checkpoints."""

from .gpt2 import alibi_config_from_gpt2, convert_gpt2

__all__ = ["alibi_config_from_gpt2", "convert_gpt2"]
