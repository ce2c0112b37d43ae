"""`peer export --initial-peers ADDR`: a live swarm's model, downloaded and checked like a state sync.

A client-only DHT node (as `peer status` starts one) reads the run's manifest and checks it
against this build (peer.node.manifest), then reads every stage's holders — stage peers and full
replicas, which publish a `stage.{s}` record for each stage they hold — and their state claims
(peer.node.round.claims). The outer step t (`pick_step`, a pure rule):

    default          the newest step that a strict majority of each stage's live holders claims,
                     the same step for every stage (a stage in the middle of a commit splits the
                     vote or runs ahead: read again until they agree, until the deadline);
    --outer-step T   wait until every stage's majority claims T; a holder one round past T
                     vouches for T with its link's `prev` (the state its round T started from), so
                     a swarm that commits T + 1 while the export reads still exports T; refused when
                     a stage is further on, since holders keep only their current state (export T
                     from checkpoints).

The majority only names the target: each stage's state at t is then reached as a joiner reaches it,
by replaying the committed rounds from a state it trusts — the canonical initial state, or past the
history window the state the bootstrap (or a run's named attester) attests — recomputing every
round from its genuine payloads (`Resync.sync_state(..., until=t)`, docs/protocol.md "Joining by
replay"); it is exported only when the replayed state id is the one the majority claims. A majority
of colluding identities therefore never decides what is exported; when the replay ends elsewhere
(the swarm moved on, or the claim is false) the claims are read again, until the deadline.
The tokenizer comes from the bootstrap (or a live peer), sha256-checked against the manifest, as
a joining peer gets it. The states end in peer.export.model, like the checkpoint exports.

Invariants: every wait has a deadline (`timeout_s` for the DHT, the manifest and agreement on one
state; `swarm.rpc_timeout_s` per call); nothing is published to the swarm; the DHT node and the
gRPC clients are closed on every path out.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from peer.config import RunConfig
from peer.errors import CheckpointError, NetworkError, PeerError
from peer.export.model import CommittedStage, ExportResult, read_back, write_stages
from peer.net.dht import SwarmDHT
from peer.net.pool import ClientPool
from peer.net.records import StageRecord
from peer.net.transport import auth
from peer.net.transport.dialer import Outbound
from peer.node.data.fetch import fetch_tokenizer  # the joiners' tokenizer download, bootstrap first
from peer.node.manifest import verify_manifest, wait_for_manifest
from peer.node.metrics import MetricsWriter
from peer.node.presence import Presence
from peer.node.round.claims import Claim, Majority, majority, parse_claims, swarm_clock
from peer.node.round.context import RoundContext
from peer.node.round.payloads import PayloadStore
from peer.node.round.refusals import Refusals
from peer.node.round.resync import Resync
from peer.node.stage.worker import StageWorker

log = logging.getLogger(__name__)

__all__ = ["Pick", "export_live", "pick_step"]

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Pick:
    """The decision on one reading of the claims: fetch `outer_step` from `winners`, wait, or refuse."""

    outer_step: int | None = None  # fetch every stage at this step (None: wait or refuse)
    winners: Mapping[int, Majority] = field(default_factory=dict)
    wait: str = ""  # why not yet (while the deadline allows another reading)
    refuse: str = ""  # a one-line refusal: waiting cannot help


def pick_step(claims: Mapping[int, Collection[Claim]], clock: int, wanted: int | None = None) -> Pick:
    """Which outer step to export from each stage's holders' claims (module docstring).

    `claims`: every stage's live holders' claims; `clock`: the swarm's clock (`swarm_clock`), past
    which a claim is not believed (`majority`); `wanted`: `--outer-step`.
    """
    winners: dict[int, Majority] = {}
    for s, stage_claims in sorted(claims.items()):
        if wanted is not None:
            stage_claims = [_back_to(c, wanted) for c in stage_claims]
            lowest = min((c.outer_step for c in stage_claims), default=wanted)
            if lowest > wanted:
                return Pick(refuse=_past(s, wanted, lowest))
        if not stage_claims:
            return Pick(wait=f"stage {s} has no live holder")
        win = majority(stage_claims, clock)
        if win is None:
            seen = sorted({c.outer_step for c in stage_claims})
            return Pick(
                wait=f"no state of stage {s} is claimed by a strict majority of its {len(stage_claims)} "
                f"holder(s) (at outer steps {seen})"
            )
        if wanted is not None and win.outer_step > wanted:
            return Pick(refuse=_past(s, wanted, win.outer_step))
        winners[s] = win
    steps = {s: w.outer_step for s, w in winners.items()}
    if not steps:
        return Pick(wait="the run has no stage to read")
    if wanted is not None and any(t < wanted for t in steps.values()):
        return Pick(wait=f"waiting for outer step {wanted}: the stages are at {_by_stage(steps)}")
    if len(set(steps.values())) > 1:
        return Pick(wait=f"the stages are at different outer steps ({_by_stage(steps)}): a round is being committed")
    return Pick(outer_step=next(iter(steps.values())), winners=winners)


def _back_to(claim: Claim, wanted: int) -> Claim:
    """A claim one round past `wanted` read as its vouch for the state round `wanted` started from (its
    link's prev); any other claim as it is. The replay still checks the state it reaches."""
    link = claim.link
    if claim.outer_step == wanted + 1 and link is not None and link.t == wanted:
        return Claim(claim.peer, wanted, link.prev, None)
    return claim


def _past(stage: int, wanted: int, at: int) -> str:
    return (
        f"stage {stage}'s holders are at outer step {at}, past {wanted}: peers hold only their current state; "
        f"export outer step {wanted} from checkpoints (`peer export DATA_DIR… --outer-step {wanted}`)"
    )


def _by_stage(steps: Mapping[int, int]) -> str:
    return ", ".join(f"stage {s} at {t}" for s, t in sorted(steps.items()))


@dataclass
class _Swarm:
    """What the export reads the swarm through: the run's config, its DHT, a pool of gRPC clients, one
    worker per stage to replay into, and the joiners' replay (`Resync`) with the manifest's signer as
    its attester; `folder` holds the replay's metrics file."""

    cfg: RunConfig
    dht: SwarmDHT
    clients: ClientPool
    folder: Path
    workers: dict[int, StageWorker] = field(init=False)
    resync: Resync = field(init=False)

    def __post_init__(self) -> None:
        self.workers = {s: StageWorker(self.cfg, s, device="cpu", precision="fp32") for s in range(self.cfg.stages)}
        me, metrics = Presence(self.dht.peer_id, "export"), MetricsWriter(self.folder, "export")
        signer = [self.dht.manifest_signer] if self.dht.manifest_signer else []
        store = PayloadStore(history=self.cfg.swarm.history_rounds)
        ctx = RoundContext(self.cfg, self.dht, self.clients, store, me, Refusals(), metrics, lambda: None)
        self.resync = Resync(ctx, None, signer)  # type: ignore[arg-type]  # no checkpoints: an export never resumes

    def claims(self) -> tuple[dict[int, dict[str, StageRecord]], dict[int, dict[str, Claim]], int]:
        """Every stage's holders, their claims, and the swarm's clock, read now."""
        holders = {s: self.dht.get_stage_peers(s) for s in range(self.cfg.stages)}
        claims = {s: parse_claims(h) for s, h in holders.items()}
        return holders, claims, swarm_clock(self.dht.get_replicas())

    def fetch(self, s: int, win: Majority) -> str:
        """Replay stage s to the majority's outer step (module docstring): "" when the replayed state is
        the claimed one, else why not."""
        worker = self.workers[s]
        if worker.outer_step > win.outer_step or not worker.verified:
            worker.reset_initial()  # replayed past the target on an earlier reading: from the start again
        try:
            self.resync.sync_state(worker, "export", wait_s=0.0, until=win.outer_step)
        except NetworkError as exc:
            return str(exc)
        if (worker.outer_step, worker.state_id()) != (win.outer_step, win.state):
            return f"stage {s}'s replay reached {worker.state_id()} at outer step {worker.outer_step}, not {win.state}"
        return ""


def _fetch_all(
    swarm: _Swarm, wanted: int | None, deadline: float, timeout_s: float, say: Progress
) -> tuple[dict[int, CommittedStage], dict[int, tuple[str, str]]]:
    """Every stage's checked state at one outer step (`pick_step`); the (peer id, address) it came from."""
    while True:
        holders, claims, clock = swarm.claims()
        pick = pick_step({s: list(c.values()) for s, c in claims.items()}, clock, wanted)
        if pick.refuse:
            raise CheckpointError(pick.refuse)
        why = pick.wait
        if pick.outer_step is not None:
            got: dict[int, CommittedStage] = {}
            sources: dict[int, tuple[str, str]] = {}
            for s, win in sorted(pick.winners.items()):
                failed = swarm.fetch(s, win)
                if failed:
                    why = failed
                    break
                got[s] = read_back(swarm.workers[s])
                pid = win.holders[0]
                sources[s] = (pid, holders[s][pid].address if pid in holders[s] else "")
                say(f"stage {s}: state {win.state} at outer step {win.outer_step}, replayed and checked")
            else:
                return got, sources
        if time.monotonic() >= deadline:
            raise NetworkError(
                f"no export within {timeout_s:.0f} s: {why}; retry when the swarm's holders agree (or pass --timeout-s)"
            )
        log.info("not yet: %s", why)
        time.sleep(min(1.0, swarm.cfg.swarm.announce_interval_s))


def _outbound(dht: SwarmDHT) -> Outbound:
    """The admission proof of this export's calls under the swarm's policy (no link caps)."""
    admission = dht.admission
    _, credentials = auth.for_swarm(admission.mode, admission.allowlist, dht.peer_id, *dht.auth_material)
    return Outbound(credentials)


def export_live(
    initial_peers: Sequence[str],
    out: Path,
    outer_step: int | None = None,
    timeout_s: float = 120.0,
    swarm_secret: bytes | None = None,
    progress: Progress | None = None,
    identity: Path | None = None,
) -> ExportResult:
    """Export the live swarm's model at one outer step (module docstring) to `out`.

    `swarm_secret`: a secret-mode swarm's secret; `identity`: this node's key file (an allow-list
    swarm serves its state only to admitted peers); `progress`: where progress lines go.
    """
    say = progress or log.info
    deadline = time.monotonic() + timeout_s
    where = ", ".join(initial_peers)
    with SwarmDHT(
        initial_peers, client_mode=True, start_timeout_s=timeout_s, identity_path=identity, swarm_secret=swarm_secret
    ) as dht:
        manifest = wait_for_manifest(dht, max(1.0, deadline - time.monotonic()), where)
        cfg = verify_manifest(manifest)
        dht.set_run(manifest["run_id"], cfg.stages)
        say(f"run {manifest['run_id']}: {cfg.stages} stage(s); reading the holders' claims")
        outbound = _outbound(dht)
        clients = ClientPool(cfg.swarm.rpc_timeout_s, cfg.subspace.wire_dtype, outbound)
        try:
            with tempfile.TemporaryDirectory(prefix="peer-export-replay-") as replay:
                swarm = _Swarm(cfg, dht, clients, Path(replay))
                stages, sources = _fetch_all(swarm, outer_step, deadline, timeout_s, say)
        finally:
            clients.close()
        addresses = [address for _, address in sources.values()]
        described = [f"stage {s}: {pid} at {address}" for s, (pid, address) in sorted(sources.items())]
        with tempfile.TemporaryDirectory(prefix="peer-export-") as tmp:
            tokenizer = _tokenizer(cfg, manifest, Path(tmp), timeout_s, addresses, outbound)
            return write_stages(out, cfg, stages, tokenizer, "live", described)


def _tokenizer(
    cfg: RunConfig, manifest: dict, folder: Path, timeout_s: float, peers: Sequence[str], outbound: Outbound
) -> Path | None:
    """The run's tokenizer from the bootstrap (else from `peers`), sha256-checked against the manifest;
    None (warned) when none serves it."""
    try:
        got = fetch_tokenizer(cfg, manifest, folder, min(timeout_s, 30.0), peers, outbound).data.tokenizer
    except PeerError as exc:
        log.warning("exporting the model without its tokenizer: %s", exc)
        return None
    return Path(got) if got is not None else None
