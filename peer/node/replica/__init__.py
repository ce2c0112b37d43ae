"""A full replica over torchrun ranks: rank 0 in the swarm and its followers (`ranks`), the
process group (`group`) and the data-parallel inner step (`data_parallel`)."""
