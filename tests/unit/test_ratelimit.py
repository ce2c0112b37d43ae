"""Token buckets of the upload/download caps (peer.net.ratelimit), on a fake clock where time matters."""

from __future__ import annotations

import threading

import pytest

from peer.errors import ConfigError
from peer.net.ratelimit import HIGH, LOW, MBIT, Link, LinkCaps, TokenBucket, mbps_to_bytes
from peer.node.link_config import LinkConfig, build_link_config


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, dt: float) -> None:
        self.now += dt


def test_an_uncapped_bucket_never_waits_and_counts():
    clock = FakeClock()
    bucket = TokenBucket(None, clock=clock, sleep=clock.sleep)
    for _ in range(100):
        assert bucket.acquire(1 << 20) == 0.0
    assert bucket.total == 100 << 20
    assert clock.now == 100.0


@pytest.mark.parametrize("size", [1_000, 100_000, 3_000_000])  # below, at and far above the burst
def test_the_long_run_rate_is_the_cap_whatever_the_message_size(size):
    clock = FakeClock()
    rate, burst = 1_000_000.0, 100_000.0
    bucket = TokenBucket(rate, burst=burst, clock=clock, sleep=clock.sleep)
    total = 30_000_000
    for _ in range(total // size):
        bucket.acquire(size)
    elapsed = clock.now - 100.0
    sent = (total // size) * size
    # the burst is free; the last message may leave the bucket in debt (not waited for yet)
    low = (sent - burst - size) / rate
    assert low <= elapsed <= (sent - burst) / rate + 0.01
    assert bucket.total == sent


def test_a_message_larger_than_the_burst_goes_through_and_leaves_debt():
    clock = FakeClock()
    bucket = TokenBucket(1000.0, burst=16_384, clock=clock, sleep=clock.sleep)
    assert bucket.acquire(1_000_000) == 0.0  # not refused, not delayed: it takes the debt
    waited = bucket.acquire(1)
    assert waited == pytest.approx((1_000_000 - 16_384) / 1000.0, abs=0.01)


def test_low_priority_waits_while_high_priority_waits():
    bucket = TokenBucket(200_000.0, burst=16_384)
    bucket.acquire(40_000)  # ~0.12 s of debt: both callers below have to wait
    order: list[str] = []

    def take(name: str, prio: int) -> None:
        bucket.acquire(1_000, prio)
        order.append(name)

    low = threading.Thread(target=take, args=("low", LOW))
    low.start()
    ready = threading.Event()
    for _ in range(2000):  # until the low caller is queued (bounded)
        with bucket._cond:
            if bucket._waiting[LOW] == 1:
                ready.set()
                break
        ready.wait(0.001)
    assert ready.is_set()
    high = threading.Thread(target=take, args=("high", HIGH))
    high.start()
    low.join(timeout=10)
    high.join(timeout=10)
    assert order == ["high", "low"]


def test_link_caps_throttle_counts_and_reconfigure():
    clock = FakeClock()
    link = Link(LinkCaps(upload_mbps=8.0), clock=clock)
    assert link.up.rate == pytest.approx(1_000_000.0) and link.down.rate is None
    items = [b"x" * 1000] * 10
    assert list(link.throttle(items, link.down, LOW, len)) == items
    assert link.snapshot()["bytes_down"] == 10_000
    link.configure(LinkCaps(download_mbps=1.0))
    assert link.up.rate is None and link.down.rate == pytest.approx(MBIT)
    assert mbps_to_bytes(0) is None and mbps_to_bytes(-1) is None and mbps_to_bytes(None) is None


def test_link_config_env_then_flags_and_strict_errors():
    env = {"PEER_LINK__MAX_UPLOAD_MBPS": "5", "PEER_LINK__RELAY": "true"}
    assert build_link_config(env) == LinkConfig(max_upload_mbps=5.0, relay=True)
    assert build_link_config(env, 7.5, None, False) == LinkConfig(max_upload_mbps=7.5, relay=False)
    with pytest.raises(ConfigError, match="link.max_download_mbps"):
        build_link_config({}, None, -1.0)
    with pytest.raises(ConfigError, match="unknown key 'link.upload'"):
        build_link_config({"PEER_LINK__UPLOAD": "1"})
    with pytest.raises(ConfigError, match="expected float"):
        build_link_config({"PEER_LINK__MAX_UPLOAD_MBPS": "fast"})
