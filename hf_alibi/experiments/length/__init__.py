"""Length generalization measured: perplexity at multiples of the training length (`length_eval`), the attention
window of ALiBi slopes (`attention_window`) and the context kept by certified skipping (`kept_context`)."""
