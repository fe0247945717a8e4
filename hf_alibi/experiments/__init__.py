"""The train-short/test-long experiment: corpus, tokenizer, baselines, arguments, Trainer runner, length evaluation,
results, model cards, the ALiBi bias figure (`plots`) and the measured attention window (`attention_window`). Not
shipped with checkpoints; the recipes in `recipes/` are thin `main()`s over it."""
