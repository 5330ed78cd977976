"""`wildtrain sync` between local folders (rclone needs no store for them): locations, the
cap's default, manifests last, and a copy that does not match its manifest."""

from __future__ import annotations

import hashlib
import json

import pytest

from tests.conftest import REPO
from wildtrain.checkpoint.format import CheckpointManifest, FileEntry
from wildtrain.clusters import registry
from wildtrain.clusters.sync import Location, SyncError, check_bwlimit, default_bwlimit, parse_location, sync
from wildtrain.config import ConfigError


@pytest.fixture
def clusters():
    return registry.load(REPO / "ray_clusters" / "clusters.yaml")


def test_cluster_locations_name_its_store_and_its_cap_and_uris_stay_uris(clusters):
    loc = parse_location("coreweave:runs/yolo-1", lambda: clusters)
    assert loc.uri == "s3://wildtrain-cw/runs/yolo-1" and loc.bwlimit == "500M"
    assert (
        loc.storage.endpoint == "https://object.lga1.coreweave.com" and loc.storage.access_key_env == "CW_ACCESS_KEY_ID"
    )
    assert parse_location("aws-p5:data", lambda: clusters).uri == "s3://wildtrain-aws/datasets"
    assert parse_location("s3://b/x", lambda: pytest.fail("a URI needs no registry")).uri == "s3://b/x"
    with pytest.raises(ConfigError, match=r"clusters\.nope: no such cluster"):
        parse_location("nope:runs/x", lambda: clusters)


def test_the_default_cap_is_the_lower_of_the_two_clusters_and_a_bad_cap_names_the_option(clusters):
    aws, cw = (parse_location(f"{name}:runs/x", lambda: clusters) for name in ("aws-p5", "coreweave"))
    assert default_bwlimit(aws, cw) == "500M" and default_bwlimit(cw, aws) == "500M"
    assert default_bwlimit(Location("s3://b/x"), Location("/tmp/y")) is None
    with pytest.raises(ConfigError, match=r"^--bwlimit: '2 MB/s' is not a rate"):
        check_bwlimit("2 MB/s")


def committed_checkpoint(root, step=4, parts=3):
    folder = root / "checkpoints" / f"step_{step:09d}-ab"
    files = []
    for i in range(parts):
        data = bytes([i]) * 1000
        (folder / "model").mkdir(parents=True, exist_ok=True)
        (folder / "model" / f"part{i}.bin").write_bytes(data)
        files.append(FileEntry(f"model/part{i}.bin", len(data), hashlib.sha256(data).hexdigest()))
    (folder / "manifest.json").write_text(CheckpointManifest(step, "t", 1, 1, tuple(files), {}, "h", 0.0).to_json())
    (root / "wildtrain_run.json").write_text(json.dumps({"run": "r"}))
    return folder


def test_sync_copies_manifests_last_and_a_second_sync_copies_nothing(tmp_path):
    committed_checkpoint(tmp_path / "src")
    order = []
    done = sync(Location(str(tmp_path / "src")), Location(str(tmp_path / "dst")), on_copied=order.append)
    assert set(order[-2:]) == {"checkpoints/step_000000004-ab/manifest.json", "wildtrain_run.json"}
    assert done.verified == 5 and done.copied_bytes == 3000
    assert sync(Location(str(tmp_path / "src")), Location(str(tmp_path / "dst"))).copied == ()


def test_a_source_that_does_not_match_its_manifest_is_not_committed_at_the_destination(tmp_path):
    folder = committed_checkpoint(tmp_path / "src")
    (folder / "model" / "part1.bin").write_bytes(b"x" * 1000)  # same size, other bytes
    with pytest.raises(SyncError, match=r"1 files did not match .*part1\.bin.*run the sync again"):
        sync(Location(str(tmp_path / "src")), Location(str(tmp_path / "dst")))
    dst = tmp_path / "dst" / "checkpoints" / "step_000000004-ab"
    assert not (dst / "manifest.json").exists() and not (dst / "model" / "part1.bin").exists()


def test_a_checkpoint_that_commits_during_the_sync_waits_for_the_next_one(tmp_path):
    """The manifests copied last are the ones listed when the sync planned its copy: a
    checkpoint committed at SRC meanwhile has files the sync did not copy or check."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    committed_checkpoint(src)
    late = []

    def commit_another(path: str) -> None:
        if not late:  # as the first file lands, the training run commits its next checkpoint
            late.append(committed_checkpoint(src, step=8))

    done = sync(Location(str(src)), Location(str(dst)), on_copied=commit_another)
    assert done.commit_files == ("checkpoints/step_000000004-ab/manifest.json", "wildtrain_run.json")
    assert (dst / "checkpoints/step_000000004-ab/manifest.json").is_file()
    assert not (dst / "checkpoints/step_000000008-ab/manifest.json").exists()
    again = sync(Location(str(src)), Location(str(dst)))
    assert "checkpoints/step_000000008-ab/manifest.json" in again.commit_files
    assert (dst / "checkpoints/step_000000008-ab/manifest.json").is_file()


def test_a_manifest_that_vanishes_during_the_sync_is_one_line_naming_it(tmp_path):
    folder = committed_checkpoint(tmp_path / "src")

    def retention_removes_it(path: str) -> None:
        (folder / "manifest.json").unlink(missing_ok=True)

    with pytest.raises(SyncError) as raised:
        sync(Location(str(tmp_path / "src")), Location(str(tmp_path / "dst")), on_copied=retention_removes_it)
    assert str(raised.value) == (f"{folder}/manifest.json: gone from SRC during the sync; run the sync again")
    assert not (tmp_path / "dst" / "checkpoints/step_000000004-ab/manifest.json").exists()


def test_store_keys_reach_rclone_through_its_environment_never_its_command_line(monkeypatch):
    from wildtrain.clusters.sync import _Rclone
    from wildtrain.config import StorageConfig

    monkeypatch.setenv("CW_SECRET", "not-on-argv")
    monkeypatch.setenv("CW_KEY", "key-id")
    store = StorageConfig(endpoint="https://object.example", access_key_env="CW_KEY", secret_key_env="CW_SECRET")
    rclone = _Rclone(Location("s3://bucket/runs/x", store), Location("/tmp/y"))
    assert (rclone.src, rclone.dst) == ("WTSRC:bucket/runs/x", "/tmp/y")
    assert rclone.env["RCLONE_CONFIG_WTSRC_SECRET_ACCESS_KEY"] == "not-on-argv"
    assert rclone.env["RCLONE_CONFIG_WTSRC_ENDPOINT"] == "https://object.example"
