"""The train-short/test-long experiment: corpus, tokenizer, baselines, Trainer runner, length evaluation, results
and model cards. Not shipped with checkpoints; the recipes in `recipes/` are thin `main()`s over it."""
