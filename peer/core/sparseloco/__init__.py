"""SparseLoCo and the outer round's math: the algorithm (`algorithm`), the payload codec (`codec/`),
the portable arithmetic (`portable`) and commit (`commit`), error feedback (`feedback`), outlier
screening (`robust`) and range-sharded rounds (`ranges/`)."""
