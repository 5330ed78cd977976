"""Checkpoint stores on S3 (the SeaweedFS fixture): what differs from a local folder is that
folders are only key prefixes, a move is a copy and a delete, and a missing key is an error
of the client; commit, listing, retention and fallback must work the same."""

from __future__ import annotations

import secrets

import pytest
import torch

from wildtrain.checkpoint.async_save import AsyncSaver, CheckpointMeta
from wildtrain.checkpoint.format import MANIFEST, checkpoint_name
from wildtrain.checkpoint.restore import list_candidates, restore
from wildtrain.checkpoint.retention import RetentionPolicy
from wildtrain.checkpoint.store import Store, read_manifest

pytestmark = [pytest.mark.integration, pytest.mark.standalone]

WAIT_S = 60


@pytest.fixture
def s3_store(object_store, monkeypatch) -> Store:
    for key, value in object_store.env().items():
        monkeypatch.setenv(key, value)
    return Store.from_uri(f"s3://{object_store.bucket}/checkpoints-{secrets.token_hex(4)}")


def _save(saver: AsyncSaver, step: int) -> None:
    meta = CheckpointMeta(step=step, tag=f"step_{step}", world_size=1, zero_stage=0, data_position={"step": step})
    saver.save_state(meta, {f"step_{step}/state.pt": {"w": torch.full((256,), float(step))}, "latest": b"x"})
    assert saver.flush(WAIT_S)


def test_async_saves_commit_retain_and_fall_back_on_s3(s3_store, tmp_path):
    saver = AsyncSaver(
        [s3_store],
        str(tmp_path / "staging"),
        rank=0,
        world_size=1,
        attempt="s3",
        retention=RetentionPolicy(keep_last=2),
    )
    for step in (10, 20, 30):
        _save(saver, step)
    assert [o.status for o in saver.drain()] == ["saved"] * 3
    assert sorted(c.manifest.step for c in list_candidates([s3_store]) if c.manifest) == [20, 30]

    newest = checkpoint_name(30, "s3")
    with s3_store.fs.open_output_stream(s3_store.path(newest, "step_30/state.pt")) as out:
        out.write(b"rotten")
    restored = restore([s3_store], str(tmp_path / "local"), rank=0, world_size=1)
    assert restored.manifest.step == 20
    assert restored.skipped[0].name == newest and "6 bytes" in restored.skipped[0].reason
    assert torch.equal(torch.load(f"{restored.folder}/step_20/state.pt")["w"], torch.full((256,), 20.0))

    s3_store.fs.delete_file(s3_store.path(newest, MANIFEST))  # what a provider deleting files can leave
    assert read_manifest(s3_store, newest) is None
    assert restore([s3_store], str(tmp_path / "again"), rank=0, world_size=1).skipped[0].reason == (
        "not committed (no manifest)"
    )
    saver.close(WAIT_S)
