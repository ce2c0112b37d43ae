"""A dishonest holder, for tests: `peer` unchanged, except that it publishes forged states.

`python -m tests.e2e.forger join ...` runs the real CLI with one change to `StageWorker.commit_round`
(the one commit path of a round's contributions):
after every commit it negates its stage's parameters (θ and θ_start: the state it serves and
claims) and lists `FAKE_REPLICAS` made-up replicas beside the real ones in its committed set (the
link and "committed" of its records). That is the attack of issue 20: a holder whose record claims
more committed replicas than anyone, for a state no honest commit produces. Honest holders must
refuse it (its set names payloads no replica announced; its state does not follow from its set)
and never adopt its state. `FORGER_FAKE_REPLICAS=0` keeps the genuine set and forges the state
alone (refused because that set gives another state).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os

import torch

from peer.cli.main import main
from peer.node.round.claims import entry
from peer.node.stage.worker import StageWorker

FAKE_REPLICAS = int(os.environ.get("FORGER_FAKE_REPLICAS", "8"))  # 0: altered parameters, the genuine set
_honest_commit = StageWorker.commit_round


def _forged_commit(self: StageWorker, *args, **kwargs):
    done = _honest_commit(self, *args, **kwargs)
    with self.lock, torch.no_grad():
        for p in self.module.parameters():
            p.neg_()
        self.cache.set({name: -value for name, value in self.start.items()})
        fake = tuple(
            entry(f"madeup{i:02d}".ljust(16, "x"), hashlib.sha256(f"{self.outer_step}/{i}".encode()).hexdigest())
            for i in range(FAKE_REPLICAS)
        )
        ledger = self.ledger
        assert ledger.link is not None
        ledger.link = dataclasses.replace(ledger.link, entries=ledger.link.entries + fake, state=self.state_id())
        ledger.last_committed = ledger.last_committed + [r for r, _ in fake]
    return done


StageWorker.commit_round = _forged_commit  # type: ignore[method-assign]

if __name__ == "__main__":
    main()  # the `peer` CLI (it reads sys.argv and exits)
