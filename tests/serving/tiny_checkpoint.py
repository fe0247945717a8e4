"""The serving tests' checkpoint and reference: a tiny ALiBi GPT-2 (or GPT-2) saved with a byte-level BPE tokenizer
that has a chat template and greedy decoding in its generation config, and `Reference`, the same folder run offline
with `generate(do_sample=False)`, whose text a server must return exactly."""

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
)

from hf_alibi import AlibiGPT2Config, AlibiGPT2LMHeadModel

MAX_TOKENS = 12
EOS = "<|endoftext|>"
TEXT = [
    "the quick brown fox jumps over the lazy dog. ",
    "def add(x, y):\n    return x + y\n",
    "hello world! user: assistant: system: how are you today?",
]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE whose alphabet is the bytes of TEXT only (all ASCII): every token decodes to whole
    characters, so text streamed token by token is the text decoded at once (a lone byte of a multi-byte character
    would be held back by a stream and printed as U+FFFD by a decode)."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    bpe.train_from_iterator(TEXT * 20, trainers.BpeTrainer(vocab_size=128, special_tokens=[EOS], show_progress=False))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token=EOS, bos_token=EOS, pad_token=EOS, clean_up_tokenization_spaces=False
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


FAMILIES = {"alibi_gpt2": (AlibiGPT2Config, AlibiGPT2LMHeadModel), "gpt2": (GPT2Config, GPT2LMHeadModel)}


def save_tiny_checkpoint(folder: Path, family: str = "alibi_gpt2", chat_template: bool = True) -> Path:
    """2 layers, 4 heads, n_embd 64 (an ALiBi GPT-2, or a GPT-2 of the same shape); weights perturbed so that
    different prompts continue differently. `chat_template=False`: a base model's tokenizer, as the recipe saves."""
    tokenizer = tiny_tokenizer()
    if not chat_template:
        tokenizer.chat_template = None
    special = dict(
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id
    )
    config_class, model_class = FAMILIES[family]
    config = config_class(vocab_size=len(tokenizer), n_positions=64, n_embd=64, n_layer=2, n_head=4, **special)
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    model.generation_config = GenerationConfig(do_sample=False, **special)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class Reference:
    """The checkpoint at `folder` run offline: what a server must answer, token for token."""

    def __init__(self, folder: Path):
        self.model = AutoModelForCausalLM.from_pretrained(folder).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(folder)

    def _greedy(self, inputs, max_new_tokens: int) -> str:
        with torch.no_grad():
            ids = self.model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
        return self.tokenizer.decode(ids[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)

    def completion(self, prompt: str, max_new_tokens: int = MAX_TOKENS) -> str:
        return self._greedy(self.tokenizer(prompt, return_tensors="pt"), max_new_tokens)

    def chat(self, messages: list[dict], max_new_tokens: int = MAX_TOKENS) -> str:
        inputs = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )
        return self._greedy(inputs, max_new_tokens)


# Session fixtures, imported by the test modules that use them (a conftest.py here would shadow tests/conftest.py
# for the `from conftest import ...` of other test folders: pytest puts each conftest's folder on sys.path).
@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    """The tiny ALiBi checkpoint folder, saved once per session."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("serving") / "alibi-tiny")


@pytest.fixture(scope="session")
def reference(checkpoint) -> Reference:
    """`checkpoint` run offline: the text a server must return."""
    return Reference(checkpoint)
