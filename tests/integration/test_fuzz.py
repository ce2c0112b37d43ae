"""Hostile input against a live training peer: it rejects, keeps serving and still trains right.

A real PeerServer(PeerService) serves stage 1 (the last) of a 2-stage tiny run, built as
`Swarm.serve` builds it. Thousands of random and mutated messages go through the real gRPC
channel: random Chunk streams, mutated serialized requests (bit flips, truncation, garbage),
hand-built protobuf with wrong dtypes/shapes, and valid-looking dataclasses via PeerClient that are
wrong for this peer. SparseLoCo payload bytes are fuzzed into `Payload.from_bytes`. Afterwards
the peer trains micro-batches bit-identically to a reference StageWorker with the same init.

Run with `-s` to see the status histogram.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from peer.config import WIRE_DTYPES, build_config
from peer.core.sparseloco.algorithm import compress, decompress
from peer.core.sparseloco.codec.format import Payload, PayloadError
from peer.errors import NetworkError
from peer.net.transport import (
    ArtifactRequest,
    BackwardRequest,
    ForwardRequest,
    PayloadRequest,
    PeerClient,
    PeerServer,
    RemoteError,
    StateRequest,
    StepRequest,
    TransportError,
    codec,
    framing,
    tensors,
)
from peer.net.transport import peer_pb2 as pb
from peer.net.transport import peer_pb2_grpc as pb_grpc
from peer.node.round.payloads import PayloadStore
from peer.node.service import PeerService
from peer.node.stage.worker import StageWorker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

LEGIT = "legit-head-0001"  # the pipeline that claims the peer (as a real head would)
FUZZ = "fuzz-pipeline-xyz"  # hostile requests that would otherwise be well formed
B, L = 2, 16  # one micro-batch


def _cfg(stages: int = 2):
    return build_config(
        overrides={
            "stages": stages,
            "train.batch_size": 4,
            "train.microbatches": 2,
            "train.seq_len": L,
            "train.inner_steps": 10,
            "train.outer_steps": 2,
        }
    )


class Tally:
    """Status histogram of every message sent, by category."""

    def __init__(self) -> None:
        self.by_cat: dict[str, Counter] = {}
        self.internal: list[str] = []

    def add(self, cat: str, code: str, details: str = "") -> None:
        self.by_cat.setdefault(cat, Counter())[code] += 1
        # No hostile request may reach INTERNAL, not even bytes that are not the RPC's protobuf
        # type at all: PeerServer parses requests with the codec (INVALID_ARGUMENT), not grpcio.
        if code == "INTERNAL":
            self.internal.append(f"{cat}: {details[:200]}")

    @property
    def total(self) -> Counter:
        out: Counter = Counter()
        for c in self.by_cat.values():
            out.update(c)
        return out

    @property
    def sent(self) -> int:
        return sum(self.total.values())


class Fuzzer:
    def __init__(self, address: str, cfg, tally: Tally, seed: int) -> None:
        self.cfg, self.tally = cfg, tally
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.PeerStub(self.channel)
        self.raw_unary = {m: self.channel.unary_unary(f"/peer.v1.Peer/{m}") for m in ("Step", "Info")}
        self.raw_unary_stream = {
            m: self.channel.unary_stream(f"/peer.v1.Peer/{m}") for m in ("GetPayload", "GetState", "GetArtifact")
        }
        self.raw_stream = {m: self.channel.stream_stream(f"/peer.v1.Peer/{m}") for m in ("Forward", "Backward")}
        self.client = PeerClient(address, timeout_s=10, retries=0, vocab_size=None)
        self.client16 = PeerClient(address, timeout_s=10, retries=0, wire_dtype="fp16")

    def close(self) -> None:
        self.client.close()
        self.client16.close()
        self.channel.close()

    # ------------------------------------------------------------------ sending
    def _rpc(self, cat: str, fn) -> None:
        try:
            out = fn()
            if hasattr(out, "__iter__") and not isinstance(out, (bytes, pb.StepReply, pb.InfoReply)):
                for _ in out:
                    pass
            self.tally.add(cat, "OK")
        except grpc.RpcError as exc:
            self.tally.add(cat, exc.code().name, exc.details() or "")

    def chunks(self, cat: str, method: str, chunks: list[pb.Chunk]) -> None:
        rpc = getattr(self.stub, method)
        self._rpc(cat, lambda: rpc(iter(chunks), timeout=10))

    def message(self, cat: str, method: str, data: bytes) -> None:
        self.chunks(cat, method, list(framing.split(data)))

    def raw(self, cat: str, method: str, data: bytes) -> None:
        """Bytes as the request message itself (a Chunk for streams), parsed by PeerServer's codec."""
        if method in self.raw_unary:
            self._rpc(cat, lambda: self.raw_unary[method](data, timeout=10))
        elif method in self.raw_unary_stream:
            self._rpc(cat, lambda: self.raw_unary_stream[method](data, timeout=10))
        else:
            self._rpc(cat, lambda: self.raw_stream[method](iter([data]), timeout=10))

    def client_call(self, cat: str, fn) -> None:
        try:
            fn()
            self.tally.add(cat, "OK")
        except RemoteError as exc:  # includes NotFoundError
            self.tally.add(cat, exc.code, str(exc))
        except NetworkError as exc:
            self.tally.add(cat, "NETWORK", str(exc))
        except TransportError as exc:  # refused by the client's own encoder: never left this process
            self.tally.add(cat, "CLIENT_REJECTED", str(exc))

    # ------------------------------------------------------------------ material
    def tokens(self, b: int = B, n: int = L, hi: int | None = None) -> torch.Tensor:
        hi = self.cfg.model.vocab_size if hi is None else hi
        return torch.randint(0, hi, (b, n), generator=self.gen, dtype=torch.int32)

    def hidden(self, b: int = B, n: int = L, k: int | None = None) -> torch.Tensor:
        k = self.cfg.k if k is None else k
        return torch.randn(b, n, k, generator=self.gen)

    def valid_forward(self, pipeline: str = FUZZ, **kw) -> ForwardRequest:
        fields = dict(
            pipeline_id=pipeline,
            microbatch=0,
            outer_step=0,
            inner_step=0,
            stage=1,
            tokens=self.tokens(),
            hidden=self.hidden(),
            targets=self.tokens(),
            train=True,
        )
        fields.update(kw)
        return ForwardRequest(**fields)

    def mutate(self, data: bytes) -> bytes:
        return _mutate(self.rng, data)

    # ------------------------------------------------------------------ campaigns
    def random_chunk_streams(self, n: int) -> None:
        r = self.rng
        for _ in range(n):
            method = r.choice(("Forward", "Backward"))
            count = r.choice((0, 1, 1, 1, 2, 3))
            chunks = [
                pb.Chunk(data=r.randbytes(r.choice((0, 1, 7, 64, 700, 3000))), last=r.random() < 0.5)
                for _ in range(count)
            ]
            if chunks and r.random() < 0.7:
                chunks[-1].last = True
            self.chunks("random-chunks", method, chunks)

    def oversized(self, n: int) -> None:
        """Single chunks beyond the gRPC frame limit, and tensors declaring absurd sizes."""
        big = pb.Chunk(data=b"\0" * (framing.GRPC_MESSAGE_LIMIT + 1024), last=True)
        for _ in range(n):
            self.chunks("oversized", "Forward", [big])
            huge = pb.ForwardRequest(
                pipeline_id=FUZZ,
                stage=1,
                tokens=pb.Tensor(dtype="int32", shape=[1 << 31, 1 << 31], data=b"\0" * 8),
                hidden=pb.Tensor(dtype="float32", shape=[1 << 40, 1 << 40, 1 << 40], data=b""),
            )
            self.message("oversized", "Forward", huge.SerializeToString())

    def mutated_messages(self, n: int, workers: int = 4) -> None:
        """Mutations of valid serialized requests, sent from several threads at once."""
        bases = [
            ("Forward", codec.to_bytes(self.valid_forward())),
            ("Forward", codec.to_bytes(self.valid_forward(train=False))),
            ("Backward", codec.to_bytes(BackwardRequest(FUZZ, 0, 0, 0, 1, self.hidden()))),
        ]
        unary = [
            ("Step", codec.to_bytes(StepRequest(FUZZ, 0, 0, 2, B * L))),
            ("GetPayload", codec.to_bytes(PayloadRequest(0, 1, "sender"))),
            ("GetState", codec.to_bytes(StateRequest(3))),
            ("GetArtifact", codec.to_bytes(ArtifactRequest("manifest"))),
        ]
        jobs = []
        for i in range(n):
            if i % 4 == 3:
                method, data = self.rng.choice(unary)
                jobs.append(("raw-mutated-unary", method, self.mutate(data), True))
            else:
                method, data = self.rng.choice(bases)
                jobs.append(("mutated-stream", method, self.mutate(data), False))

        def send(job):
            cat, method, data, raw = job
            (self.raw if raw else self.message)(cat, method, data)

        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(send, jobs))

    def undecodable(self, n: int) -> None:
        """Bytes that are not even a protobuf of the RPC's request type."""
        r = self.rng
        for _ in range(n):
            method = r.choice(("Step", "GetPayload", "GetState", "GetArtifact", "Forward", "Backward"))
            data = b"\xff" + r.randbytes(r.randint(0, 40))  # field number 0x7f... wire type 7: never valid
            self.raw("raw-undecodable", method, data)

    def handmade_protobuf(self, reps: int) -> None:
        """Well-framed protobuf whose tensors lie about dtype, rank, size or contents."""
        k, V = self.cfg.k, self.cfg.model.vocab_size
        good_tok = tensors.tensor_to_proto(self.tokens())
        good_hid = tensors.tensor_to_proto(self.hidden())

        def f32(shape: list[int], data: bytes | None = None) -> pb.Tensor:
            return pb.Tensor(
                dtype="float32", shape=shape, data=data if data is not None else b"\0" * (4 * _prod(shape))
            )

        lies = {
            "tokens int64": (pb.Tensor(dtype="int64", shape=[B, L], data=b"\0" * 8 * B * L), good_hid),
            "tokens float": (f32([B, L]), good_hid),
            "tokens rank 3": (pb.Tensor(dtype="int32", shape=[B, L, 1], data=b"\0" * 4 * B * L), good_hid),
            "tokens negative": (tensors.tensor_to_proto(torch.full((B, L), -5, dtype=torch.int32)), good_hid),
            "tokens >= vocab": (tensors.tensor_to_proto(torch.full((B, L), V, dtype=torch.int32)), good_hid),
            "hidden int32": (good_tok, pb.Tensor(dtype="int32", shape=[B, L, k], data=b"\0" * 4 * B * L * k)),
            "hidden float64": (good_tok, pb.Tensor(dtype="float64", shape=[B, L, k], data=b"\0" * 8 * B * L * k)),
            "hidden no dtype": (good_tok, pb.Tensor(shape=[B, L, k], data=b"\0" * 4 * B * L * k)),
            "hidden complex": (good_tok, pb.Tensor(dtype="complex64", shape=[B, L, k], data=b"\0" * 8 * B * L * k)),
            "hidden rank 2": (good_tok, f32([B, L * k])),
            "hidden short data": (good_tok, f32([B, L, k], b"\0" * (4 * B * L * k - 3))),
            "hidden long data": (good_tok, f32([B, L, k], b"\0" * (4 * B * L * k + 4))),
            "hidden negative dim": (good_tok, f32([B, -L, k], b"")),
            "hidden (b, L) mismatch": (good_tok, f32([B + 1, L, k])),
            "hidden nan": (good_tok, f32([B, L, k], b"\0\0\xc0\x7f" * (B * L * k))),
            "hidden inf": (good_tok, f32([B, L, k], b"\0\0\x80\x7f" + b"\0" * (4 * B * L * k - 4))),
            "hidden rank 9": (good_tok, f32([1] * 9, b"\0" * 4)),
        }
        for _ in range(reps):
            for tok, hid in lies.values():
                msg = pb.ForwardRequest(
                    pipeline_id=self.rng.choice((LEGIT, FUZZ)),
                    stage=1,
                    tokens=tok,
                    hidden=hid,
                    targets=good_tok,
                    train=self.rng.random() < 0.5,
                )
                self.message("handmade-pb", "Forward", msg.SerializeToString())
            for grad in (
                f32([B, L]),
                pb.Tensor(dtype="int8", shape=[B, L, k], data=b"\0" * B * L * k),
                f32([B, L, k], b"\0\0\xc0\x7f" * (B * L * k)),
                pb.Tensor(),
            ):
                msg = pb.BackwardRequest(pipeline_id=LEGIT, stage=1, grad=grad)
                self.message("handmade-pb", "Backward", msg.SerializeToString())
            for text in ("", "x" * 2000, "../../etc/passwd", ".hidden", "a/b", "ok-but-absent"):
                self.raw("handmade-pb", "GetArtifact", pb.ArtifactRequest(name=text).SerializeToString())
            self.raw("handmade-pb", "Step", pb.StepRequest(pipeline_id="p" * 5000).SerializeToString())

    def hostile_dataclasses(self, reps: int) -> None:
        """Requests the client encodes fine but that are wrong for this peer."""
        cfg, V, k, d = self.cfg, self.cfg.model.vocab_size, self.cfg.k, self.cfg.model.d_model
        H, M = cfg.train.inner_steps, cfg.train.microbatches

        def nan_hidden(value: float) -> torch.Tensor:
            h = self.hidden()
            h.view(-1)[self.rng.randrange(h.numel())] = value
            return h

        for _ in range(reps):
            pid = self.rng.choice((LEGIT, FUZZ))  # the claim holder's bad requests must not touch state either
            fwd = functools.partial(self.valid_forward, pipeline=pid)
            cases = {
                "nan hidden": fwd(hidden=nan_hidden(float("nan"))),
                "inf hidden": fwd(hidden=nan_hidden(float("-inf"))),
                "huge finite hidden": fwd(hidden=nan_hidden(3e38)),
                "large hidden": fwd(hidden=nan_hidden(1e30)),
                "hidden k+1": fwd(hidden=self.hidden(k=k + 1)),
                "hidden k-1": fwd(hidden=self.hidden(k=k - 1)),
                "hidden uncompressed d": fwd(hidden=self.hidden(k=d)),
                "hidden (b, L) mismatch": fwd(hidden=self.hidden(b=B + 1)),
                "b > batch_size": fwd(tokens=self.tokens(b=5), hidden=self.hidden(b=5), targets=self.tokens(b=5)),
                "L > max_seq_len": fwd(
                    tokens=self.tokens(n=cfg.model.max_seq_len + 1),
                    hidden=self.hidden(n=cfg.model.max_seq_len + 1),
                    targets=self.tokens(n=cfg.model.max_seq_len + 1),
                ),
                "empty batch": fwd(tokens=self.tokens(b=0), hidden=self.hidden(b=0), targets=self.tokens(b=0)),
                "empty sequence": fwd(tokens=self.tokens(n=0), hidden=self.hidden(n=0), targets=self.tokens(n=0)),
                "tokens >= vocab": fwd(tokens=self.tokens() + V),
                "tokens negative": fwd(tokens=-1 - self.tokens()),
                "targets >= vocab": fwd(targets=self.tokens() + V),
                "targets shape": fwd(targets=self.tokens(n=L - 1)),
                "no targets on last stage": fwd(targets=None),
                "eval without targets": fwd(targets=None, train=False),
                "wrong stage 0": fwd(stage=0),
                "wrong stage 2": fwd(stage=2),
                "wrong stage huge": fwd(stage=1 << 40),
                "outer step ahead": fwd(outer_step=1),
                "outer step far": fwd(outer_step=1 << 50),
                "inner step >= H": fwd(inner_step=H),
                "micro-batch >= M": fwd(microbatch=M + self.rng.randrange(1000)),
            }
            for req in cases.values():
                self.client_call("client-forward", lambda r=req: self.client.forward(r))
            half = self.valid_forward(pipeline=pid, hidden=nan_hidden(float("inf")))
            self.client_call("client-forward", lambda h=half: self.client16.forward(h))
            self.client_call(
                "client-forward",
                lambda p=pid: self.client16.forward(self.valid_forward(pipeline=p, hidden=self.hidden() * 1e5)),
            )  # fp16 overflow -> inf on the wire
            for req in (
                BackwardRequest(pid, self.rng.randrange(4), 0, 0, 1, self.hidden()),
                BackwardRequest(pid, 0, 0, 0, 1, self.hidden(k=k + 3)),
                BackwardRequest(pid, 0, 0, 0, 1, nan_hidden(float("nan"))),
                BackwardRequest(pid, 0, 0, 0, 2, self.hidden()),
                BackwardRequest(pid, 0, 7, 0, 1, self.hidden()),
            ):
                self.client_call("client-backward", lambda r=req: self.client.backward(r))
            for req in (
                StepRequest(FUZZ, 0, 0, M, 64),
                StepRequest(FUZZ, 0, H - 1, M, 64),
                StepRequest(LEGIT, 0, H, M, 64),
                StepRequest(LEGIT, 0, 1 << 40, M, 64),
                StepRequest(LEGIT, 3, 0, M, 64),
                StepRequest(pid, 1 << 60, 0, 0, 0),
            ):
                self.client_call("client-step", lambda r=req: self.client.step(r))
            for req in (
                PayloadRequest(self.rng.randrange(100), self.rng.randrange(4), "x"),
                PayloadRequest(1 << 61, 1, "y" * 1000),
            ):
                self.client_call("client-reads", lambda r=req: self.client.get_payload(r))
            for stage in (0, 2, 1 << 50):
                self.client_call("client-reads", lambda s=stage: self.client.get_state(StateRequest(s)))
            for name in ("tokenizer", "manifest", "x" * 129, "", "..", "a b"):
                self.client_call("client-reads", lambda n=name: self.client.get_artifact(ArtifactRequest(n)))
            self.client_call("client-reads", lambda: self.client.info())


def _mutate(r: random.Random, data: bytes) -> bytes:
    """One random mutation: bit flips, truncation, appended garbage, overwrite, insert or delete."""
    buf = bytearray(data)
    op = r.randrange(6)
    if op == 0 and buf:
        for _ in range(r.randint(1, 8)):
            i = r.randrange(len(buf))
            buf[i] ^= 1 << r.randrange(8)
    elif op == 1:
        buf = buf[: r.randrange(len(buf) + 1)]
    elif op == 2:
        buf += r.randbytes(r.randint(1, 64))
    elif op == 3 and buf:
        i = r.randrange(len(buf))
        n = r.randint(1, 16)
        buf[i : i + n] = r.randbytes(n)
    elif op == 4:
        i = r.randrange(len(buf) + 1)
        buf[i:i] = r.randbytes(r.randint(1, 8))
    elif buf:
        i = r.randrange(len(buf))
        del buf[i : i + r.randint(1, 16)]
    return bytes(buf)


def _prod(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _params(worker: StageWorker) -> dict[str, torch.Tensor]:
    out = {n: p.detach().clone() for n, p in worker.module.named_parameters()}
    out.update({f"buffer:{n}": b.detach().clone() for n, b in worker.module.named_buffers()})
    return out


def _assert_same(live: StageWorker, ref: StageWorker, when: str) -> None:
    a, b = _params(live), _params(ref)
    assert a.keys() == b.keys()
    diff = [n for n in a if not torch.equal(a[n], b[n])]
    assert not diff, f"{when}: live peer differs from the reference in {diff[:5]}"


def _assert_untouched(worker: StageWorker, svc: PeerService) -> None:
    """Nothing the hostile requests sent left state behind in the worker."""
    assert worker.pending == {}
    assert worker.microbatches_seen == 0
    assert all(p.grad is None for p in worker.module.parameters())
    assert svc.claimed_by == LEGIT and not svc.in_round
    assert worker.outer_step == 0


@pytest.fixture
def live_peer():
    cfg = _cfg()
    worker = StageWorker(cfg, 1)
    store = PayloadStore()
    svc = PeerService(cfg, {1: worker}, store, "peer-under-test-0000", "stage")
    server = PeerServer(
        svc, host="127.0.0.1", port=0, vocab_size=cfg.model.vocab_size, wire_dtype=cfg.subspace.wire_dtype
    )
    try:
        yield cfg, worker, svc, store, server
    finally:
        server.stop(grace_s=1.0)


def test_fuzzed_peer_keeps_serving_and_trains_bit_identically(live_peer, caplog):
    cfg, worker, svc, store, server = live_peer
    caplog.set_level(logging.WARNING)
    ref = StageWorker(cfg, 1)  # identical init (deterministic per parameter name)
    head = StageWorker(cfg, 0)
    _assert_same(worker, ref, "at start")
    # A real payload is served for round 0, so payload reads have something to find.
    delta = {n: torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 1e-3 for n, p in ref.start.items()}
    payload, _ = compress(delta, None, cfg.sparseloco)
    store.put(0, 1, payload.to_bytes())

    tally = Tally()
    fz = Fuzzer(server.address, cfg, tally, seed=1234)
    try:
        # The legit head claims the peer with an evaluation pass (changes no state), as it would
        # with its first forward; hostile well-formed requests from other pipelines are then refused (CLAIMED).
        x, y = fz.tokens(), fz.tokens()
        hid = head.evaluate(x.long(), None, None).hidden
        fz.client.forward(ForwardRequest(LEGIT, 10_000, 0, 0, 1, x, hid, targets=y, train=False))
        assert svc.claimed_by == LEGIT

        t0 = time.monotonic()
        fz.random_chunk_streams(800)
        fz.undecodable(150)
        fz.oversized(5)
        fz.handmade_protobuf(8)
        fz.hostile_dataclasses(12)
        fz.mutated_messages(1500)
        fuzz_s = time.monotonic() - t0

        _assert_untouched(worker, svc)
        _assert_same(worker, ref, "after fuzzing")
        assert fz.client.info()["claimed_by"] == LEGIT  # still serving

        # Legit training through the live peer and the reference, hostile messages in between.
        M = cfg.train.microbatches
        for h in range(3):
            xb = torch.randint(0, cfg.model.vocab_size, (B * M, L), generator=torch.Generator().manual_seed(h))
            yb = torch.roll(xb, -1, dims=1)
            for mb, (mx, my) in enumerate(zip(xb.chunk(M), yb.chunk(M), strict=True)):
                key = (LEGIT, mb)
                hidden = head.forward(key, mx, None, None).hidden  # (b, L, k)
                req = ForwardRequest(LEGIT, mb, 0, h, 1, mx.to(torch.int32), hidden, targets=my.to(torch.int32))
                reply = fz.client.forward(req)
                want = ref.forward(key, mx.to(torch.int32), hidden, my.to(torch.int32))
                on_wire = want.grad.to(WIRE_DTYPES[cfg.subspace.wire_dtype]).float()  # the peer's reply dtype
                assert reply.loss == want.loss and torch.equal(reply.grad.float(), on_wire)
                head.backward(key, reply.grad)
                fz.hostile_dataclasses(1)  # mid-step: pending gradients must survive rejections
                fz.mutated_messages(40, workers=2)
            fz.client.step(StepRequest(LEGIT, 0, h, M, xb.numel()))
            ref.step(0, h)
            head.step(0, h)
            _assert_same(worker, ref, f"after inner step {h}")
        assert not torch.equal(_params(worker)["norm.weight"], StageWorker(cfg, 1).module.norm.weight.detach())
    finally:
        fz.close()

    # Payload decoder fuzz: random and mutated SparseLoCo bytes (no network involved).
    good = payload.to_bytes()
    n_elem = sum(v.numel() for v in ref.start.values())
    payload_stats: Counter = Counter()
    rng = random.Random(99)
    for i in range(2000):
        data = rng.randbytes(rng.randrange(200)) if i % 4 == 0 else _mutate(rng, good)
        if i % 50 == 0:
            data = b"SLCO\x01" + data  # a plausible header start
        try:
            p = Payload.from_bytes(data, max_elements=n_elem, cfg=cfg.sparseloco)
        except PayloadError:
            payload_stats["PayloadError"] += 1
            continue
        payload_stats["accepted"] += 1
        assert p.to_bytes() == data  # only the canonical form is accepted
        assert all(bool(torch.isfinite(t).all()) for t in decompress(p).values())

    hist = tally.total
    print(
        f"\nfuzz: {tally.sent} gRPC messages (main campaign {fuzz_s:.1f}s, rest between legit micro-batches), "
        "crashes: 0"
    )
    print("status histogram:", dict(sorted(hist.items())))
    for cat, c in sorted(tally.by_cat.items()):
        print(f"  {cat:20s} {sum(c.values()):5d} {dict(sorted(c.items()))}")
    print("payload decoder:", dict(payload_stats))

    assert tally.sent >= 3000
    assert not tally.internal and "INTERNAL" not in hist, tally.internal[:5]
    assert tally.by_cat["raw-undecodable"] == Counter(INVALID_ARGUMENT=150)
    assert "NETWORK" not in hist and "UNAVAILABLE" not in hist and "DEADLINE_EXCEEDED" not in hist
    # well-formed-but-wrong requests were judged by the peer, not just dropped by the codec
    assert hist["INVALID_ARGUMENT"] > 1000 and hist["FAILED_PRECONDITION"] > 100 and hist["NOT_FOUND"] > 100
    # only reads (info, payload, state) may succeed; no hostile forward, backward or step ever did
    assert not [cat for cat, c in tally.by_cat.items() if c["OK"] and cat not in ("client-reads", "raw-mutated-unary")]
    assert payload_stats["PayloadError"] > 1500
    # no logged traceback, neither ours nor grpcio's (a hostile peer must not be able to flood the log)
    bugs = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith(("peer", "grpc"))]
    assert not bugs, [r.getMessage()[:200] for r in bugs[:3]]


def test_middle_stage_rejects_bad_backward_and_keeps_pending_state():
    """Stage 1 of 3 (not last): backward grads must match the pending forward; the service checks
    token ids itself (this server is started without a vocabulary, so the codec does not)."""
    cfg = _cfg(stages=3)
    worker, ref, head = StageWorker(cfg, 1), StageWorker(cfg, 1), StageWorker(cfg, 0)
    svc = PeerService(cfg, {1: worker}, PayloadStore(), "middle-0000", "stage")
    server = PeerServer(svc, host="127.0.0.1", port=0, vocab_size=None)
    client = PeerClient(server.address, timeout_s=10, retries=0)
    k, V = cfg.k, cfg.model.vocab_size
    gen = torch.Generator().manual_seed(5)
    try:
        x = torch.randint(0, V, (B, L), generator=gen)
        hidden = head.forward((LEGIT, 0), x, None, None).hidden  # (b, L, k)
        tok = x.to(torch.int32)

        def code_of(fn) -> str:
            try:
                fn()
            except RemoteError as exc:
                return exc.code
            return "OK"

        assert code_of(lambda: client.forward(ForwardRequest(LEGIT, 0, 0, 0, 1, tok + V, hidden))) == "INVALID_ARGUMENT"
        assert (
            code_of(lambda: client.forward(ForwardRequest(LEGIT, 0, 0, 0, 1, tok, hidden, targets=tok)))
            == "INVALID_ARGUMENT"
        )  # targets only go to the last stage
        assert worker.pending == {} and svc.claimed_by is None  # rejected before claiming
        assert code_of(lambda: client.backward(BackwardRequest(LEGIT, 0, 0, 0, 1, hidden))) == "FAILED_PRECONDITION"

        out = client.forward(ForwardRequest(LEGIT, 0, 0, 0, 1, tok, hidden))
        want = ref.forward((LEGIT, 0), tok, hidden, None)
        assert torch.equal(out.hidden, want.hidden)
        g = torch.randn(B, L, k, generator=gen) * 1e-3
        bad = {
            "wrong k": torch.randn(B, L, k + 1),
            "wrong b": torch.randn(B + 1, L, k),
            "uncompressed d": torch.randn(B, L, cfg.model.d_model),
            "huge": g + 1e30,
            "nan": g * float("nan"),
        }
        for name, grad in bad.items():
            code = code_of(lambda gr=grad: client.backward(BackwardRequest(LEGIT, 0, 0, 0, 1, gr)))
            assert code == "INVALID_ARGUMENT", name
        assert code_of(lambda: client.backward(BackwardRequest(LEGIT, 1, 0, 0, 1, g))) == "FAILED_PRECONDITION"
        assert code_of(lambda: client.backward(BackwardRequest("other", 0, 0, 0, 1, g))) == "FAILED_PRECONDITION"
        assert code_of(lambda: client.step(StepRequest("other", 0, 0, 1, 1))) == "FAILED_PRECONDITION"
        assert list(worker.pending) == [(LEGIT, 0)]
        assert all(p.grad is None for p in worker.module.parameters())

        back = client.backward(BackwardRequest(LEGIT, 0, 0, 0, 1, g))
        assert torch.equal(back.grad, ref.backward((LEGIT, 0), g))
        client.step(StepRequest(LEGIT, 0, 0, 1, B * L))
        ref.step(0, 0)
        _assert_same(worker, ref, "after the step")
        assert code_of(lambda: client.backward(BackwardRequest(LEGIT, 0, 0, 0, 1, g))) == "FAILED_PRECONDITION"
    finally:
        client.close()
        server.stop(grace_s=1.0)
