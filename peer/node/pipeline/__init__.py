"""The head's pipeline: stage 0 here, stages 1 … S−1 on claimed stage peers (docs/pipeline.md).

- `driver`: `PipelineDriver`, what the head's training loop calls (inner steps, validation, reports).
- `step`: the one step executor: K micro-batches in flight (K = 1: the sequential schedule, the
  head relays every hop), the one replay loop, the head's forward chain over remote stages.
- `routing`: who to call for each stage (claims, exclusions) and the retry knobs.
- `failures`: the one classifier: a failed call's typed refusal -> wait, replace, replay, re-sync.
- `schedule`: K from the measured links and compute (`choose_in_flight`, `LinkEstimator`).
- `accounting`: the uncompressed-equivalent activation bytes.

Imports run one way: driver -> step -> routing -> failures; step and driver -> schedule, accounting.
"""
