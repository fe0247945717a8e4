"""The experiment commands, the top of the experiments: `train_short_test_long` (`hf-alibi train`), `evaluate_length`
(`hf-alibi evaluate`) and `budget_sweep` (`hf-alibi sweep`). Nothing in the experiments imports them."""
