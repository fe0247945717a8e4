"""The text a run reads: corpora, held-out split and packing (`corpus`) and the locally trained tokenizer
(`tokenization`)."""
