"""Training the models of a run: one model (`train_model`), the whole train-short/test-long run (`runner`), the data
it trains on (`recipe_data`), the cost measurements (`training_cost`, `peak_memory`) and the masked-LM encoder run
(`masked_lm`)."""
