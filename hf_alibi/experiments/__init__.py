"""The train-short/test-long experiment, one sub-package per job, each importing only those below it
(tests/test_layers.py): `data` (corpus, tokenizer) and `length` (length evaluation, attention window, kept context);
`setup` (arguments, configs, token budget, launch, baselines); `reporting` (results, every figure, model cards,
the Hub); `training` (one model, a whole run); `retrieval` (the passkey experiment); `commands`, the entry points
(`train_short_test_long`, `evaluate_length`, `budget_sweep`: `hf-alibi train`, `evaluate`, `sweep`). The shipped
configs are `configs/*.yaml`. Not shipped with checkpoints; needs the `experiments` extra."""

from ..import_utils import require_extra

require_extra("experiments", "hf_alibi.experiments (hf-alibi train, evaluate, plot-bias; model cards)")
