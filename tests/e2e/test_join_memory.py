"""`peer join` refuses a stage that does not fit before it claims it (issue 22, "Memory that fits").

A real bootstrap on 127.0.0.1 and a real `peer join --stage 1 --max-memory 1MB` process: it exits
non-zero with one `error:` line naming the remedies (here none fits 1 MB, so it says so; the
remedies themselves are tested in tests/unit/test_memory_estimate.py), no traceback, and
`peer status --json` shows no holder of stage 1.
"""

from __future__ import annotations

import pytest


@pytest.mark.timeout(240)
def test_join_refuses_a_stage_that_does_not_fit(swarm_factory):
    sw = swarm_factory(outer_steps=2, min_replicas=1)
    sw.join("stage1", "--stage", "1", "--max-memory", "1MB", "--device", "cpu")
    code = sw.wait_exit("stage1", timeout_s=180)
    log = sw.log("stage1")
    assert code == 2, log
    errors = [ln for ln in log.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, log
    assert errors[0].startswith("error: stage 1 of 2 of tiny does not fit: needs ~"), log
    assert "nothing here makes it fit" in errors[0]
    assert "Traceback" not in log
    assert "stage 1 of 2 of tiny: needs ~" in log  # the estimate's line came first
    stages = sw.status()["stages"]
    assert not stages.get("1"), stages
