"""verify_manifest: a genuine manifest passes; every tampered or foreign one is a ManifestMismatch."""

from __future__ import annotations

import copy
import hashlib
import json
import re

import pytest

from peer.config import build_config
from peer.core.data.shards import DatasetIndex, ShardInfo
from peer.errors import ManifestMismatch
from peer.node.manifest import (
    DATASET_KEYS,
    PROTOCOL_VERSION,
    build_manifest,
    check_dataset,
    dataset_index_sha256,
    verify_manifest,
)

TOKENIZER_SHA = "ab" * 32


def _index(train_sha: str = "cd" * 32, val_sha: str = "ef" * 32) -> DatasetIndex:
    """An index (no files needed): one train and one val shard named by their sha256."""
    shards = (ShardInfo("train-00000.bin", "train", 1000, train_sha), ShardInfo("val-00000.bin", "val", 100, val_sha))
    return DatasetIndex("uint16", 1024, 2, TOKENIZER_SHA, shards)


# A message "says what to do" when a clause starts with an instruction ("...; install peer X").
ACTION = re.compile(r"[;:]\s*(install|upgrade|use|restart|check|ask|rebuild|start)\b", re.IGNORECASE)


@pytest.fixture(scope="module")
def cfg():
    return build_config(overrides={"stages": 2, "seed": 3, "subspace.k_ratio": "1/4", "train.inner_steps": 7})


@pytest.fixture
def manifest(cfg):
    return build_manifest(cfg, TOKENIZER_SHA, "127.0.0.1:5000", _index())


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


@pytest.mark.parametrize(
    "key", ["config", "fingerprint", "u_hash", "tokenizer_sha256", "bootstrap_address", "run_id", *DATASET_KEYS]
)
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


def test_the_manifest_names_the_dataset_by_its_fingerprints_and_index_hash(manifest):
    index = _index()
    assert manifest["dataset_fingerprint"] == index.fingerprint
    assert manifest["dataset_val_fingerprint"] == index.val_fingerprint
    assert manifest["dataset_index_sha256"] == dataset_index_sha256(index)
    assert dataset_index_sha256(index) == hashlib.sha256(index.to_json()).hexdigest()
    assert manifest["dataset_tokens"] == {"train": 1000, "val": 100}
    check_dataset(manifest, index, "DIR", "do something")  # the run's own dataset passes


@pytest.mark.parametrize("other", ["train", "val"])
def test_another_corpus_is_refused_in_one_line_naming_both_fingerprints(manifest, other):
    theirs = _index(train_sha="00" * 32) if other == "train" else _index(val_sha="00" * 32)
    with pytest.raises(ManifestMismatch) as info:
        check_dataset(manifest, theirs, "/data/other", "pass the run's prepared dataset with --dataset")
    message = str(info.value)
    assert "\n" not in message and "/data/other" in message
    for fp in (theirs.fingerprint, theirs.val_fingerprint, manifest["dataset_fingerprint"]):
        assert fp[:12] in message
    assert message.endswith("pass the run's prepared dataset with --dataset")
