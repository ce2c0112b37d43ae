"""The model: the LLaMA-style decoder and its stage views (`decoder`), the whole model as a chain of
stages (`chain`), the inner step (`inner`, `optim`, `precision`, `split_backward`) and a stage's
state by global name (`state`)."""
