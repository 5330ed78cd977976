"""The loop's saves that must commit (the last step, a planned regrow), against a real
AsyncSaver and a store that fails: the last one is retried until it commits, a regrow's
is tried once and reported as not committed, so the loop trains on instead."""

import pyarrow.fs as pafs
import pytest
import torch

from tests.helpers.faulty_fs import Faults, faulty_filesystem
from wildtrain.checkpoint.async_save import AsyncSaver
from wildtrain.checkpoint.restore import list_candidates
from wildtrain.checkpoint.store import Store
from wildtrain.config import Config, config_hash
from wildtrain.train import checkpointing
from wildtrain.train.state import TrainState


def thread_saver(*args, **options) -> AsyncSaver:
    """A saver whose background half runs in a thread of this process, where these tests'
    faulty filesystems (their events and counters) can steer it; the save process has its
    own tests (test_save_process.py)."""
    return AsyncSaver(*args, background="thread", **options)


class FakeEngine:
    """What `checkpoint.save` asks of a DeepSpeed engine: a save through its checkpoint engine."""

    def __init__(self) -> None:
        self.checkpoint_engine = None
        self.weights = torch.arange(16.0)

    def save_checkpoint(self, directory: str, tag: str) -> None:
        self.checkpoint_engine.save({"w": self.weights}, f"{directory}/{tag}/mp_rank_00_model_states.pt")


@pytest.fixture
def failing_store(tmp_path):
    faults = Faults(match=lambda path: path.endswith(".pt"))
    return faults, Store(faulty_filesystem(pafs.LocalFileSystem(), faults), str(tmp_path / "store"), "store")


def _settings(cfg: Config) -> checkpointing.SaveSettings:
    return checkpointing.SaveSettings(
        cfg.deepspeed.zero_stage, cfg.train.seed, config_hash(cfg), cfg.checkpoint.timeout_s
    )


def saver_for(tmp_path, store) -> AsyncSaver:
    return thread_saver([store], str(tmp_path / "staging"), rank=0, world_size=1, attempt="a1", timeout_s=30)


def committed(store: Store) -> list[str]:
    return [c.name for c in list_candidates([store]) if c.manifest is not None]


def test_the_last_save_is_retried_until_it_commits(tmp_path, failing_store, monkeypatch):
    monkeypatch.setattr(checkpointing, "FIRST_COMMIT_RETRY_S", 0.05)
    faults, store = failing_store
    faults.fail_next = 2  # two tries fail, the third commits
    saver = saver_for(tmp_path, store)
    cfg = Config()
    assert checkpointing.save(saver, FakeEngine(), _settings(cfg), TrainState(step=60), 1, must_commit=True, retry=True)
    # Each try has a folder of its own, so an earlier try's part records cannot mislead the next.
    assert committed(store) == ["step_000000060-a1t3"]
    assert [o.status for o in saver.drain()] == ["failed", "failed", "saved"]
    assert saver.last_commit == "store/step_000000060-a1t3"


def test_a_regrow_save_that_fails_is_tried_once(tmp_path, failing_store):
    faults, store = failing_store
    faults.fail_next = 1
    saver = saver_for(tmp_path, store)
    assert not checkpointing.save(
        saver, FakeEngine(), _settings(Config()), TrainState(step=40), 1, must_commit=True, retry=False
    )
    assert committed(store) == [] and [o.status for o in saver.drain()] == ["failed"]


def test_the_last_save_gives_up_at_checkpoint_timeout(tmp_path, failing_store, monkeypatch):
    monkeypatch.setattr(checkpointing, "FIRST_COMMIT_RETRY_S", 0.05)
    faults, store = failing_store
    faults.fail_next = 10**6
    cfg = Config()
    cfg.checkpoint.timeout_s = 1.0
    assert not checkpointing.save(
        saver_for(tmp_path, store), FakeEngine(), _settings(cfg), TrainState(step=60), 1, must_commit=True, retry=True
    )
    assert committed(store) == []
