"""The SparseLoCo codec: a participant's Δ̂ as bytes and back, and the norms read off a payload.

Modules, each importing only the ones before it (no circle):
  fused    whole-tensor numba kernels (plain Python) and the thread pool that splits them
  kernels  binomial tables, enumerative index coding, and the numba loader that compiles
           its own kernels and `fused`'s
  index    chunk geometry, bit packing and the index coding of a payload
  format   the wire format (`Payload`, `TensorEntry`) and the `[sparseloco]` settings
           (`SparseLoCoConfig`) it is encoded with
  decode   an entry's Δ̂ as receivers read it: values, positions, writes into dense accumulators
  encode   one error-feedback buffer → top-k, sign-true quantization, e − Δ̂
  clip     exactly rounded norms and clipping to the round's median norm
  scratch  reused float32 buffers (decode targets, the commit's accumulators) and who owns them

The algorithm that uses it (error feedback over a model, aggregation) is `peer.core.sparseloco.algorithm`.
This package imports nothing from it, nor from `peer.config`.
"""
