"""The data one run of the recipe trains and evaluates on, prepared once before any model trains.

`prepare_data` turns the experiment's data arguments into the corpus, the tokenizer, packed training blocks for
every training length and the held-out documents as token ids, using the corpus library (`data`) and the tokenizer
trainer (`tokenization`); every refusal (a missing `init_from`, a bad data file, an absent text column) happens
here, before the run writes anything. `heldout_bytes_per_token` turns the evaluation's bits per token into bits per
byte. A module of its own because `tokenization` imports `data`.
"""

from accelerate import PartialState
from transformers import AutoTokenizer

from ..data.corpus import heldout_token_ids, load_recipe_corpus, pack_documents
from ..data.tokenization import load_or_train_tokenizer
from ..length.length_eval import select_documents
from ..setup.arguments import ExperimentArguments


def prepare_data(experiment: ExperimentArguments, state: PartialState):
    """Load the corpus, get the tokenizer, pack training blocks per training length, tokenize held-out documents.

    Returns `(corpus, tokenizer, {training length: blocks}, held-out token ids)`. Blocks of every length come from
    the same training documents; `max_train_blocks` caps the blocks of `train_length` and the others to the same
    number of tokens.
    """
    if experiment.init_from is not None:
        from ...conversion.common import load_config

        load_config(experiment.init_from)  # a missing folder or an uncached Hub id fails here, by name
    corpus = load_recipe_corpus(experiment)
    if experiment.max_train_documents is not None:
        corpus["train"] = corpus["train"].select(range(min(experiment.max_train_documents, len(corpus["train"]))))
    with state.main_process_first():  # one process trains and caches the tokenizer; the others load it
        if experiment.init_from is not None:
            tokenizer = AutoTokenizer.from_pretrained(experiment.tokenizer_name or experiment.init_from)
        elif experiment.tokenizer_name is not None:
            tokenizer = AutoTokenizer.from_pretrained(experiment.tokenizer_name)
        else:
            tokenizer = load_or_train_tokenizer(corpus["train"], experiment.vocab_size)
        train_blocks = {
            length: pack_documents(corpus["train"], tokenizer, length) for length in experiment.train_lengths()
        }
    if experiment.max_train_blocks is not None:
        tokens = experiment.max_train_blocks * experiment.train_length
        for length, blocks in train_blocks.items():
            train_blocks[length] = blocks.select(range(min(max(1, tokens // length), len(blocks))))
    heldout = heldout_token_ids(corpus["validation"], tokenizer, max(experiment.eval_lengths) + 1)
    return corpus, tokenizer, train_blocks, heldout


def heldout_bytes_per_token(heldout, tokenizer, experiment) -> float:
    """Mean UTF-8 bytes per token of the evaluation text (the documents every length scores): bits per byte =
    bits per token / this. Exactly 1.0 for the byte-level vocabulary (`vocab_size: 257`)."""
    docs, _ = select_documents(heldout, experiment.eval_lengths, experiment.eval_max_documents)
    tokens = sum(doc.numel() for doc in docs)
    text_bytes = sum(len(tokenizer.decode(doc.tolist(), clean_up_tokenization_spaces=False).encode()) for doc in docs)
    return round(text_bytes / tokens, 6)


__all__ = ["heldout_bytes_per_token", "prepare_data"]
