"""The data: documents (`corpus`), the tokenizer, preparing token shards (`prepare*`, `shards`), the
shuffle (`permutation`) and the one loader (`loader`)."""
