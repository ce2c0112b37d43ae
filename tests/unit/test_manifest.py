"""verify_manifest: a genuine manifest passes; every tampered or foreign one is a ManifestMismatch."""

from __future__ import annotations

import copy
import json
import re

import pytest

from peer.config import build_config
from peer.errors import ManifestMismatch
from peer.node.manifest import PROTOCOL_VERSION, build_manifest, verify_manifest

TOKENIZER_SHA = "ab" * 32
# A message "says what to do" when a clause starts with an instruction ("...; install peer X").
ACTION = re.compile(r"[;:]\s*(install|upgrade|use|restart|check|ask|rebuild|start)\b", re.IGNORECASE)


@pytest.fixture(scope="module")
def cfg():
    return build_config(overrides={"stages": 2, "seed": 3, "subspace.k_ratio": "1/4", "train.inner_steps": 7})


@pytest.fixture
def manifest(cfg):
    return build_manifest(cfg, TOKENIZER_SHA, "127.0.0.1:5000")


def _mismatch(manifest: dict) -> str:
    with pytest.raises(ManifestMismatch) as info:
        verify_manifest(manifest)
    message = str(info.value)
    assert "\n" not in message and message
    return message


def test_genuine_manifest_is_accepted_also_after_a_json_round_trip(cfg, manifest):
    for m in (manifest, json.loads(json.dumps(manifest, sort_keys=True))):  # as the DHT carries it
        got = verify_manifest(m)
        assert got.fingerprint() == cfg.fingerprint() == m["fingerprint"]
        assert (got.stages, got.seed, got.k, got.train.inner_steps) == (2, 3, cfg.k, 7)


@pytest.mark.parametrize("protocol", [PROTOCOL_VERSION + 1, 0, None, str(PROTOCOL_VERSION)])
def test_wrong_protocol(manifest, protocol):
    manifest["protocol"] = protocol
    message = _mismatch(manifest)
    assert "protocol" in message and "install the peer version" in message


def test_missing_protocol(manifest):
    del manifest["protocol"]
    assert "protocol None" in _mismatch(manifest)


@pytest.mark.parametrize("key", ["config", "fingerprint", "u_hash", "tokenizer_sha256", "bootstrap_address", "run_id"])
def test_missing_key(manifest, key):
    del manifest[key]
    message = _mismatch(manifest)
    assert f"'{key}'" in message and "bootstrap" in message


def test_tampered_fingerprint(manifest):
    manifest["fingerprint"] = "0" * 16
    message = _mismatch(manifest)
    assert "fingerprint" in message and "0" * 16 in message


def test_tampered_config_value_breaks_the_fingerprint(manifest):
    manifest["config"]["train"]["lr"] = manifest["config"]["train"]["lr"] * 10
    assert "fingerprint" in _mismatch(manifest)


def test_tampered_u_hash(manifest):
    manifest["u_hash"] = "f" * 16
    message = _mismatch(manifest)
    assert "subspace basis hash" in message and "f" * 16 in message and ACTION.search(message)


def test_a_build_whose_portable_arithmetic_differs_is_refused(manifest):
    assert manifest["arithmetic"] and len(manifest["arithmetic"]) == 16  # the bootstrap's, computed
    manifest["arithmetic"] = "0" * 16  # a build that would compute other initial states and commits
    message = _mismatch(manifest)
    assert "portable arithmetic" in message and "0" * 16 in message and ACTION.search(message)


@pytest.mark.parametrize("where", [("train", "bogus_steps"), (None, "bogus_section_key")])
def test_unknown_config_key(manifest, where):
    section, key = where
    (manifest["config"][section] if section else manifest["config"])[key] = 1
    message = _mismatch(manifest)
    assert key in message and "upgrade peer" in message


def test_config_value_of_wrong_type(manifest):
    manifest["config"]["train"]["inner_steps"] = "many"
    message = _mismatch(manifest)
    assert "train.inner_steps" in message and "upgrade peer" in message


def test_verify_does_not_modify_the_manifest(manifest):
    before = copy.deepcopy(manifest)
    verify_manifest(manifest)
    assert manifest == before


@pytest.mark.parametrize("tamper", ["missing key", "fingerprint"])
def test_every_rejection_says_what_to_do(manifest, tamper):
    if tamper == "missing key":
        del manifest["u_hash"]
    else:
        manifest["fingerprint"] = "0" * 16
    assert ACTION.search(_mismatch(manifest))


def test_fingerprint_mismatch_with_another_peer_version_names_the_version_to_install(manifest):
    manifest["peer_version"] = "9.9.9"
    manifest["fingerprint"] = "0" * 16
    message = _mismatch(manifest)
    assert ACTION.search(message) and "install peer 9.9.9 like the swarm" in message
