import errno
import threading
import time

import pyarrow.fs as pafs
import pytest
import torch

from tests.helpers.faulty_fs import Faults, faulty_filesystem
from wildtrain.checkpoint.async_save import AsyncSaver, CheckpointMeta
from wildtrain.checkpoint.format import checkpoint_name
from wildtrain.checkpoint.restore import list_candidates, restore
from wildtrain.checkpoint.retention import RetentionPolicy
from wildtrain.checkpoint.save_policy import InFlight, admit, metrics
from wildtrain.checkpoint.store import Store, read_manifest

WAIT_S = 30  # a bound for events that should come at once; never waited out in a passing run


def thread_saver(*args, **options) -> AsyncSaver:
    """A saver whose background half runs in a thread of this process, where these tests'
    faulty filesystems (their events and counters) can steer it; the save process has its
    own tests (test_save_process.py)."""
    return AsyncSaver(*args, background="thread", **options)


def meta(step: int, world_size: int = 1) -> CheckpointMeta:
    return CheckpointMeta(
        step=step,
        tag=f"step_{step}",
        world_size=world_size,
        zero_stage=0,
        data_position={"step": step},
        config_hash="c0ffee",
    )


def state(value: float) -> dict:
    return {"model": {"w": torch.full((64, 64), value), "b": torch.zeros(64)}, "step": int(value)}


@pytest.fixture
def faults() -> Faults:
    return Faults(match=lambda path: path.endswith(".pt"))


@pytest.fixture
def store(tmp_path, faults) -> Store:
    return Store(faulty_filesystem(pafs.LocalFileSystem(), faults), str(tmp_path / "store"), str(tmp_path / "store"))


@pytest.fixture
def make_saver(tmp_path, store):
    savers = []

    def make(**options) -> AsyncSaver:
        options = {"rank": 0, "world_size": 1, "attempt": "a1"} | options
        saver = thread_saver([store], str(tmp_path / f"staging{len(savers)}"), **options)
        savers.append(saver)
        return saver

    yield make
    for saver in savers:
        saver.close(timeout_s=WAIT_S)


def committed_steps(store: Store) -> list[int]:
    return sorted(c.manifest.step for c in list_candidates([store]) if c.manifest is not None)


def test_the_training_thread_returns_while_the_upload_is_still_blocked(tmp_path, store, faults, make_saver):
    faults.gate = threading.Event()
    saver = make_saver()

    admission = saver.save_state(meta(10), {"state.pt": state(1.0)})

    assert admission.action == "start"
    assert faults.write_blocked.wait(WAIT_S), "the upload never started"
    assert saver.busy and committed_steps(store) == []
    faults.gate.set()
    assert saver.flush(WAIT_S)

    [outcome] = saver.drain()
    assert outcome.status == "saved" and outcome.stored == (store.uri,)
    assert 0 < outcome.stall_s and outcome.bytes > 64 * 64 * 4
    assert committed_steps(store) == [10]
    restored = restore([store], str(tmp_path / "local"), rank=0, world_size=1)
    saved = torch.load(f"{restored.folder}/state.pt")
    assert torch.equal(saved["model"]["w"], torch.full((64, 64), 1.0)) and saved["step"] == 1


def test_a_save_holds_the_values_of_its_capture_while_training_changes_them(tmp_path, store, faults, make_saver):
    faults.gate = threading.Event()
    saver = make_saver(policy="queue")
    saver.save_state(meta(10), {"state.pt": state(1.0)})
    assert faults.write_blocked.wait(WAIT_S)
    weights = state(2.0)
    # Queued behind the blocked save, this one is written only after training changed the tensors.
    assert saver.save_state(meta(20), {"state.pt": weights}).action == "queue"
    weights["model"]["w"].add_(100.0)
    faults.gate.set()
    assert saver.flush(WAIT_S)

    restored = restore([store], str(tmp_path / "local"), rank=0, world_size=1)
    assert restored.manifest.step == 20
    saved = torch.load(f"{restored.folder}/state.pt")
    assert torch.equal(saved["model"]["w"], torch.full((64, 64), 2.0))


def test_skip_policy_records_the_save_due_while_one_is_in_flight(store, faults, make_saver):
    faults.gate = threading.Event()
    saver = make_saver(policy="skip")
    saver.save_state(meta(10), {"state.pt": state(1.0)})
    assert faults.write_blocked.wait(WAIT_S)

    admission = saver.save_state(meta(20), {"state.pt": state(2.0)})

    assert admission.action == "skip"
    faults.gate.set()
    assert saver.flush(WAIT_S)
    outcomes = {o.step: o for o in saver.drain()}
    assert outcomes[20].status == "skipped" and "step 10 is still in flight" in outcomes[20].reason
    assert outcomes[10].status == "saved"
    assert committed_steps(store) == [10]


def test_queue_policy_runs_the_newest_waiting_save_next(store, faults, make_saver):
    faults.gate = threading.Event()
    saver = make_saver(policy="queue")
    saver.save_state(meta(10), {"state.pt": state(1.0)})
    assert faults.write_blocked.wait(WAIT_S)

    assert saver.save_state(meta(20), {"state.pt": state(2.0)}).action == "queue"
    assert saver.save_state(meta(30), {"state.pt": state(3.0)}).action == "queue"
    faults.gate.set()
    assert saver.flush(WAIT_S)

    outcomes = {o.step: o for o in saver.drain()}
    assert {step: o.status for step, o in outcomes.items()} == {10: "saved", 20: "skipped", 30: "saved"}
    assert "superseded by the save of step 30" in outcomes[20].reason
    assert committed_steps(store) == [10, 30]


def test_a_failed_upload_is_recorded_and_the_next_save_succeeds(store, faults, make_saver):
    faults.fail_next = 1
    saver = make_saver()

    saver.save_state(meta(10), {"state.pt": state(1.0)})
    assert saver.flush(WAIT_S)
    saver.save_state(meta(20), {"state.pt": state(2.0)})
    assert saver.flush(WAIT_S)

    first, second = saver.drain()
    assert (first.status, first.failure) == ("failed", "storage")
    assert "injected I/O error" in first.reason and checkpoint_name(10, "a1") in first.reason
    assert second.status == "saved"
    assert committed_steps(store) == [20]


def test_a_store_that_truncates_silently_never_gets_a_commit(store, faults, make_saver):
    faults.corrupt = "truncate"
    saver = make_saver()
    saver.save_state(meta(10), {"state.pt": state(1.0)})
    assert saver.flush(WAIT_S)

    [outcome] = saver.drain()
    assert (outcome.status, outcome.failure) == ("failed", "verify") and "state.pt" in outcome.reason
    assert committed_steps(store) == []


def test_a_full_store_disk_is_reported_with_path_and_bytes(store, faults, make_saver):
    faults.fail_next = 1
    faults.error = OSError(errno.ENOSPC, "No space left on device")
    saver = make_saver()
    saver.save_state(meta(10), {"state.pt": state(1.0)})
    assert saver.flush(WAIT_S)

    [outcome] = saver.drain()
    assert outcome.failure == "disk_full"
    assert outcome.disk_full.path == store.describe(checkpoint_name(10, "a1"))
    assert outcome.disk_full.bytes_needed == outcome.bytes > 0
    assert "bytes needed" in outcome.reason


def test_a_full_staging_disk_fails_the_save_then_skips_until_there_is_room(tmp_path, store, make_saver):
    free = {"bytes": 1000}
    saver = make_saver(disk_free=lambda path: free["bytes"])

    saver.save_state(meta(10), {"state.pt": state(1.0)})
    assert saver.flush(WAIT_S)
    skipped = saver.save_state(meta(20), {"state.pt": state(2.0)})
    free["bytes"] = 10**12
    started = saver.save_state(meta(30), {"state.pt": state(3.0)})
    assert saver.flush(WAIT_S)

    first, second, third = saver.drain()
    assert (first.status, first.failure) == ("failed", "disk_full")
    assert first.disk_full.path.startswith(str(tmp_path / "staging0"))
    assert first.disk_full.bytes_needed >= 64 * 64 * 4 and first.disk_full.bytes_free == 1000
    assert skipped.action == "skip" and (second.status, second.failure) == ("skipped", "disk_full")
    assert started.action == "start" and third.status == "saved"


def test_a_save_past_its_timeout_fails_as_a_timeout(store, make_saver):
    saver = make_saver(timeout_s=1e-9)
    saver.save_state(meta(10), {"state.pt": state(1.0)})
    assert saver.flush(WAIT_S)
    [outcome] = saver.drain()
    assert (outcome.status, outcome.failure) == ("failed", "timeout") and "timed out" in outcome.reason
    assert committed_steps(store) == []


def test_a_replica_that_fails_makes_the_save_partial(tmp_path, store):
    broken = Faults(fail_next=10**6, match=lambda path: path.endswith(".pt"))
    replica = Store(faulty_filesystem(pafs.LocalFileSystem(), broken), str(tmp_path / "replica"), "replica")
    saver = thread_saver([store, replica], str(tmp_path / "staging"), rank=0, world_size=1, attempt="a1")
    saver.save_state(meta(10), {"state.pt": state(1.0)})
    assert saver.close(WAIT_S)

    [outcome] = saver.drain()
    assert outcome.status == "partial" and outcome.stored == (store.uri,) and "injected" in outcome.reason
    assert committed_steps(store) == [10]


def test_rank_0_commits_once_every_rank_has_uploaded(tmp_path, store):
    savers = [thread_saver([store], str(tmp_path / "staging"), rank=r, world_size=2, attempt="a1") for r in (0, 1)]
    savers[0].save_state(
        meta(10, world_size=2), {"shared.pt": state(1.0), "zero_pp_rank_0_mp_rank_00_x.pt": state(2.0)}
    )
    savers[1].save_state(meta(10, world_size=2), {"zero_pp_rank_1_mp_rank_00_x.pt": state(3.0)})
    assert all(s.close(WAIT_S) for s in savers)

    manifest = read_manifest(store, checkpoint_name(10, "a1"))
    assert {f.path for f in manifest.files} == {
        "shared.pt",
        "zero_pp_rank_0_mp_rank_00_x.pt",
        "zero_pp_rank_1_mp_rank_00_x.pt",
    }
    assert manifest.world_size == 2
    assert [o.status for s in savers for o in s.drain()] == ["saved", "saved"]


def test_rank_0_gives_up_on_a_rank_that_never_uploads(tmp_path, store):
    saver = thread_saver([store], str(tmp_path / "staging"), rank=0, world_size=2, attempt="a1", timeout_s=0.2)
    saver.save_state(meta(10, world_size=2), {"shared.pt": state(1.0)})
    assert saver.close(WAIT_S)
    [outcome] = saver.drain()
    assert outcome.failure == "timeout" and "ranks [1] of 2" in outcome.reason
    assert committed_steps(store) == []


def test_retention_runs_after_each_commit(store, make_saver):
    saver = make_saver(retention=RetentionPolicy(keep_last=2), attempt="b1")
    for step in (10, 20, 30):
        saver.save_state(meta(step), {"state.pt": state(float(step))})
        assert saver.flush(WAIT_S)
    assert committed_steps(store) == [20, 30]
    assert any("deleted" in note and checkpoint_name(10, "b1") in note for o in saver.drain() for note in o.notes)


def test_retention_keeps_the_restored_checkpoint_while_it_is_the_only_one_known_good(store, make_saver):
    first = make_saver(attempt="a0")
    first.save_state(meta(5), {"state.pt": state(5.0)})
    assert first.flush(WAIT_S)
    restored = (store.uri, checkpoint_name(5, "a0"))
    # Without read-back verification its own saves are not known good, so step 5 must stay.
    saver = make_saver(retention=RetentionPolicy(keep_last=1), attempt="b1", verify_upload=False, known_good=[restored])
    for step in (10, 20):
        saver.save_state(meta(step), {"state.pt": state(float(step))})
        assert saver.flush(WAIT_S)
    assert committed_steps(store) == [5, 20]


def test_admission_decisions():
    busy = InFlight(step=10, running_s=3.0, doing="uploading x")
    assert admit("skip", None, False, "/s", 10**9, 100).action == "start"
    assert admit("skip", busy, False, "/s", 10**9, 100).action == "skip"
    assert admit("queue", busy, False, "/s", 10**9, 100).action == "queue"
    # The capture is a collective: when another rank cannot save (its disk is full), no rank does.
    assert admit("queue", None, True, "/s", 10**9, 100).reason == "another rank cannot save now"
    assert admit("skip", None, True, "/s", 10**9, 100).action == "skip"
    full = admit("queue", None, False, "/s", 50, 100)
    assert full.action == "skip" and full.disk_full.bytes_needed == 100 and full.disk_full.bytes_free == 50


def test_metrics_summarize_the_outcomes_since_the_last_report(store, make_saver):
    saver = make_saver()
    saver.save_state(meta(10), {"state.pt": state(1.0)})
    assert saver.flush(WAIT_S)
    reported = metrics(saver.drain())
    assert reported["checkpoint/saved"] == 1.0 and reported["checkpoint/failed"] == 0.0
    assert reported["checkpoint/step"] == 10 and reported["checkpoint/bytes"] > 0 and reported["checkpoint/stall_s"] > 0


def test_a_gated_save_commits_only_once_its_step_is_released(store, make_saver):
    saver = make_saver(commit_when_released=True)
    saver.save_state(meta(4), {"state.pt": state(1.0)})
    assert not saver.flush(0.5), "uploaded, but waiting for the report of step 4 to be collected"
    assert committed_steps(store) == []
    saver.release(3)
    assert not saver.flush(0.5)
    saver.release(4)
    assert saver.flush(WAIT_S)
    assert committed_steps(store) == [4]


def two_ranks(tmp_path, store, rank1_faults: Faults, **options) -> list[AsyncSaver]:
    """Savers for ranks 0 and 1 of one group, writing into the same folder; rank 1 through `rank1_faults`."""
    rank1_store = Store(faulty_filesystem(pafs.LocalFileSystem(), rank1_faults), store.root, store.uri)
    return [
        thread_saver([s], str(tmp_path / f"staging{r}"), rank=r, world_size=2, attempt="a1", **options)
        for r, s in ((0, store), (1, rank1_store))
    ]


def save_both(savers: list[AsyncSaver], step: int) -> None:
    savers[0].save_state(meta(step, world_size=2), {"shared.pt": state(float(step))})
    savers[1].save_state(meta(step, world_size=2), {"zero_pp_rank_1_mp_rank_00_x.pt": state(float(step))})


def test_rank_0_gives_up_at_once_when_another_rank_records_a_failed_upload(tmp_path, store):
    broken = Faults(fail_next=1, match=lambda path: path.endswith(".pt"))
    savers = two_ranks(tmp_path, store, broken, timeout_s=600)
    save_both(savers, 10)
    # Well within the 600 s timeout: rank 0 learns of the failure from rank 1's part record.
    assert all(s.flush(WAIT_S) for s in savers)
    [outcome] = savers[0].drain()
    assert outcome.status == "failed" and outcome.failure == "storage"
    assert "rank 1: " in outcome.reason and "injected" in outcome.reason
    save_both(savers, 20)
    assert all(s.close(WAIT_S) for s in savers)
    assert committed_steps(store) == [20]


def test_after_an_outage_that_also_hid_the_failure_record_the_next_save_commits(tmp_path, store):
    # Rank 1's store fails every write, its part records included, until the outage ends.
    outage = Faults(fail_next=10**6)
    savers = two_ranks(tmp_path, store, outage, timeout_s=600)
    save_both(savers, 10)
    assert not savers[0].flush(1.0), "rank 0 waits for rank 1's part while the store is down"
    assert savers[0].admission().action == "skip"  # later saves are skipped meanwhile
    outage.fail_next = 0
    assert all(s.flush(WAIT_S) for s in savers), "once the store is back, rank 1's record ends the wait"
    assert [o.status for o in savers[0].drain()] == ["failed"]
    save_both(savers, 20)
    assert all(s.close(WAIT_S) for s in savers)
    assert committed_steps(store) == [20]


def test_each_store_has_its_own_deadline(tmp_path, store):
    # The primary's upload takes longer than timeout_s; the replica still gets its full time.
    slow = Faults(gate=threading.Event(), match=lambda path: path.endswith(".pt"))
    primary = Store(faulty_filesystem(pafs.LocalFileSystem(), slow), str(tmp_path / "primary"), "primary")
    saver = thread_saver([primary, store], str(tmp_path / "staging"), rank=0, world_size=1, attempt="a1", timeout_s=1.0)
    saver.save_state(meta(10), {"state.pt": state(1.0)})
    assert slow.write_blocked.wait(WAIT_S)
    time.sleep(1.2)  # past the primary's deadline; its next chunk check fails it
    slow.gate.set()
    assert saver.close(WAIT_S)
    [outcome] = saver.drain()
    assert outcome.status == "partial" and outcome.stored == (store.uri,) and outcome.failure == "timeout"
    assert committed_steps(store) == [10]


def test_a_save_commits_as_soon_as_the_controller_has_its_report(store, make_saver):
    collected = threading.Event()
    saver = make_saver(commit_when_released=True, reports_collected=collected.is_set)
    saver.save_state(meta(4), {"state.pt": state(1.0)})
    saver.reported(4)
    assert not saver.flush(0.5), "the report of step 4 is still in Ray's queue"
    collected.set()  # no later report needed: the controller took this one
    assert saver.flush(WAIT_S)
    assert committed_steps(store) == [4]


def test_a_save_in_flight_at_a_regroup_commits_as_its_group_s_and_the_next_as_the_new_one_s(
    tmp_path, store, faults, make_saver
):
    # In-process, workers joined: the group re-forms at a larger size while the alone rank's save uploads.
    faults.gate = threading.Event()
    saver = make_saver(rank=0, world_size=1, attempt="a1")
    saver.save_state(meta(4), {"state.pt": state(4.0)})
    assert faults.write_blocked.wait(WAIT_S)
    saver.regroup(rank=0, world_size=2, attempt="a2", reports_collected=lambda: False)
    faults.gate.set()
    assert saver.flush(WAIT_S), "the old group's save waits for no rank of the new group"
    assert [(o.step, o.name, o.status) for o in saver.drain()] == [(4, checkpoint_name(4, "a1"), "saved")]

    joiner = make_saver(rank=1, world_size=2, attempt="a2")
    saver.save_state(meta(8, world_size=2), {"shared.pt": state(8.0)})
    assert not saver.flush(1.0), "the next save is the new group's: rank 0 waits for rank 1's part"
    joiner.save_state(meta(8, world_size=2), {"zero_pp_rank_1_mp_rank_00_x.pt": state(8.0)})
    assert saver.flush(WAIT_S)
    assert [(o.step, o.name, o.status) for o in saver.drain()] == [(8, checkpoint_name(8, "a2"), "saved")]
    assert committed_steps(store) == [4, 8]
