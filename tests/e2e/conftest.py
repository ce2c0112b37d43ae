"""Fixtures of the end-to-end tier: `swarm_factory` makes CLI swarms (tests/e2e/cli_swarm.py)."""

from __future__ import annotations

import pytest

from tests.e2e.cli_swarm import Swarm


@pytest.fixture
def swarm_factory(tmp_path, reap_children):
    made = []

    def make(**kw) -> Swarm:
        made.append(Swarm(tmp_path, **kw))
        return made[-1]

    yield make
    for s in made:
        s.close()
