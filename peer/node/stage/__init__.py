"""One stage as a holder keeps it: the worker that trains it (`worker`), its committed state
(`state`), the portable commit (`commit`), the outer optimizer and error feedback (`optimizer`), the
round ledger (`ledger`), a ranges round's side (`ranges`) and the epoch gate (`epoch_gate`)."""
