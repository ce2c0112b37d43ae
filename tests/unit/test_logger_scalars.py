"""`peer.node.loggers.scalars`: one mapping from metrics events to logger scalars, for W&B and TensorBoard."""

from __future__ import annotations

import math

from peer.node.loggers import INNER, OUTER, _Axes, scalars


def test_steps_rounds_and_other_events_land_on_their_axes():
    axes = _Axes()
    assert scalars({"event": "start", "config": {"train": {"inner_steps": 5}}}, axes) == []
    (axis, x, values), *_ = scalars({"event": "step", "t": 2, "h": 3, "loss": 4.5, "tokens": 256, "step_s": 0.5}, axes)
    assert (axis, x) == (INNER, 2 * 5 + 3)
    assert values == {"train/loss": 4.5, "train/tokens": 256.0, "train/step_s": 0.5, "train/tokens_per_s": 512.0}
    scalars({"event": "step", "t": 2, "h": 4, "loss": 4.4, "tokens": 256}, axes)
    rnd = {
        "event": "round",
        "t": 2,
        "train_loss": 4.4,
        "val_loss": 4.6,
        "round_wall_s": 3.0,
        "bytes": {"activations": 10, "pseudo_gradients": 20},
        "stages": {"0": {"participants": 3, "clipped": 1, "dropped": ["ab"]}},
    }
    [(axis, x, values)] = scalars(rnd, axes)
    assert (axis, x) == (OUTER, 2)
    assert values["round/val_loss"] == 4.6 and values["bytes/pseudo_gradients"] == 20.0
    assert values["stage0/participants"] == 3.0 and values["stage0/dropped"] == 1.0
    assert scalars({"event": "sync", "t": 2}, axes) == [(OUTER, 2, {"events/sync": 1.0})]
    assert scalars({"event": "sync"}, axes) == [(OUTER, 2, {"events/sync": 2.0})]
    assert scalars({"event": "exit", "reason": "done"}, axes) == []


def test_values_that_are_not_finite_numbers_are_left_out():
    axes = _Axes()
    rnd = {"event": "round", "t": 0, "train_loss": math.nan, "val_loss": None, "round_wall_s": "<b>x</b>",
           "bytes": "not a mapping", "stages": {"0": "junk", "1": {"participants": True}}}  # fmt: skip
    [(_, _, values)] = scalars(rnd, axes)
    assert values == {}
    step = {"event": "step", "t": "0", "h": 1, "loss": 1.0}
    assert scalars(step, axes) == [(OUTER, 0, {"events/step": 1.0})]  # no usable (t, h): only counted
