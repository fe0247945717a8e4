"""The train-short/test-long experiment: corpus, tokenizer, baselines, arguments, Trainer runner, length evaluation,
results, model cards, every figure (`plots`) and the measured attention window (`attention_window`); the
two commands (`train_short_test_long`, `evaluate_length`: `hf-alibi train`, `hf-alibi evaluate`) and their shipped
configs (`configs/*.yaml`). Not shipped with checkpoints; needs the `experiments` extra."""

from ..import_utils import require_extra

require_extra("experiments", "hf_alibi.experiments (hf-alibi train, evaluate, plot-bias; model cards)")
