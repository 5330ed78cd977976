import hashlib
import threading
import time
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from tests.helpers.faulty_fs import Faults, faulty_filesystem
from wildtrain.checkpoint import store as store_module
from wildtrain.checkpoint.format import (
    MANIFEST,
    CheckpointManifest,
    FileEntry,
    checkpoint_name,
    files_for_rank,
    step_of,
)
from wildtrain.checkpoint.restore import Candidate, NoGoodCheckpoint, choose_restore, list_candidates, restore
from wildtrain.checkpoint.store import (
    HELD_POLL_S,
    Cancelled,
    CommitError,
    DeadlineExceeded,
    PartFailed,
    Store,
    commit,
    commit_when_complete,
    poll_parts,
    read_manifest,
    upload,
    verify,
    write_part,
)

SHARED = "step/mp_rank_00_model_states.pt"
WAIT_S = 30  # a bound for waits that should end at once; never waited out in a passing run


def rank_file(rank: int) -> str:
    return f"step/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def stage(folder: Path, files: dict[str, bytes]) -> str:
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    return str(folder)


def save(tmp_path: Path, store, step: int, attempt: str = "a", world_size: int = 1, do_commit: bool = True) -> str:
    """Every rank of a `world_size` group uploads its files; rank 0 commits."""
    name = checkpoint_name(step, attempt)
    for rank in range(world_size):
        files = {rank_file(rank): f"optim {rank} at {step}".encode() * 100}
        if rank == 0:
            files |= {SHARED: f"model at {step}".encode() * 100, "latest": b"step"}
        local = stage(tmp_path / "staging" / f"{name}.{rank}", files)
        write_part(store, name, rank, upload(local, store, name))
    if do_commit:

        def commit_step(store, files):
            commit(
                store,
                name,
                step=step,
                tag="step",
                world_size=world_size,
                zero_stage=1,
                files=files,
                data_position={"epoch": 0, "step": step},
                config_hash="c0ffee",
            )

        assert commit_when_complete([(store, time.monotonic() + WAIT_S)], name, world_size, commit_step) == {}
    return name


def commit_error(store, name: str, world_size: int, deadline: float, **options) -> Exception:
    """What stopped rank 0 from committing `name` in `store`."""
    errors = commit_when_complete([(store, deadline)], name, world_size, lambda store, files: None, **options)
    return errors[store.uri]


@pytest.fixture
def store(tmp_path) -> Store:
    return Store.from_uri(str(tmp_path / "primary"))


def test_commit_writes_a_manifest_listing_every_rank_file_with_size_and_sha256(tmp_path, store):
    name = save(tmp_path, store, 100, world_size=2)
    manifest = read_manifest(store, name)
    assert (manifest.step, manifest.world_size, manifest.zero_stage, manifest.config_hash) == (100, 2, 1, "c0ffee")
    assert manifest.data_position == {"epoch": 0, "step": 100}
    assert {f.path for f in manifest.files} == {SHARED, "latest", rank_file(0), rank_file(1)}
    for entry in manifest.files:
        data = (tmp_path / "primary" / name / entry.path).read_bytes()
        assert entry.bytes == len(data) and entry.sha256 == hashlib.sha256(data).hexdigest()
    assert CheckpointManifest.from_json(manifest.to_json(), "here") == manifest
    assert verify(store, name, manifest).ok


def test_uploaded_files_without_a_manifest_are_never_restored(tmp_path, store):
    save(tmp_path, store, 100, do_commit=False)
    assert restore([store], str(tmp_path / "local"), rank=0, world_size=1) is None

    older = save(tmp_path, store, 80)
    restored = restore([store], str(tmp_path / "local"), rank=0, world_size=1)
    assert restored.candidate.name == older
    assert [(s.step, s.reason) for s in restored.skipped] == [(100, "not committed (no manifest)")]


def test_a_corrupt_file_in_the_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, store):
    older = save(tmp_path, store, 80)
    newest = save(tmp_path, store, 100)
    victim = tmp_path / "primary" / newest / SHARED
    data = bytearray(victim.read_bytes())
    data[10] ^= 0xFF  # same size: only the checksum can tell
    victim.write_bytes(bytes(data))

    restored = restore([store], str(tmp_path / "local"), rank=0, world_size=1)
    assert restored.candidate.name == older and restored.manifest.step == 80
    [skipped] = restored.skipped
    assert skipped.name == newest and SHARED in skipped.reason and "sha256" in skipped.reason
    assert (Path(restored.folder) / SHARED).read_bytes() == (tmp_path / "primary" / older / SHARED).read_bytes()
    assert not (tmp_path / "local" / newest).exists()  # no half-verified leftovers to load by mistake


@pytest.mark.parametrize("damage", ["delete_file", "truncate_file", "delete_folder"])
def test_a_damaged_or_deleted_newest_checkpoint_falls_back(tmp_path, store, damage):
    older = save(tmp_path, store, 80)
    newest = save(tmp_path, store, 100)
    folder = tmp_path / "primary" / newest
    if damage == "delete_file":
        (folder / rank_file(0)).unlink()
    elif damage == "truncate_file":
        (folder / rank_file(0)).write_bytes(b"short")
    else:
        for path in sorted(folder.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        folder.rmdir()

    restored = restore([store], str(tmp_path / "local"), rank=0, world_size=1)
    assert restored.candidate.name == older
    reasons = " ".join(s.reason for s in restored.skipped)
    expected = {"delete_file": "missing", "truncate_file": "5 bytes", "delete_folder": ""}[damage]
    assert expected in reasons
    assert bool(restored.skipped) == (damage != "delete_folder")


def test_no_good_checkpoint_left_is_an_error_not_a_fresh_start(tmp_path, store):
    name = save(tmp_path, store, 100)
    (tmp_path / "primary" / name / SHARED).write_bytes(b"rotten")
    with pytest.raises(NoGoodCheckpoint, match=name):
        restore([store], str(tmp_path / "local"), rank=0, world_size=1)


def test_restore_uses_the_replica_when_the_primary_copy_is_gone(tmp_path, store):
    replica = Store.from_uri(str(tmp_path / "replica"))
    name = checkpoint_name(100, "a")
    local = stage(tmp_path / "staging", {SHARED: b"model", rank_file(0): b"optim"})
    for target in (store, replica):
        files = upload(local, target, name)
        commit(
            target,
            name,
            step=100,
            tag="step",
            world_size=1,
            zero_stage=1,
            files=files,
            data_position={},
            config_hash="",
        )
    (tmp_path / "primary" / name / SHARED).unlink()

    restored = restore([store, replica], str(tmp_path / "local"), rank=0, world_size=1)
    assert (restored.candidate.store, restored.candidate.name) == (replica.uri, name)
    assert [s.store for s in restored.skipped] == [store.uri]


def test_restore_falls_back_when_another_rank_rejects_a_checkpoint(tmp_path, store):
    older = save(tmp_path, store, 80)
    newest = save(tmp_path, store, 100)
    verdicts = iter([False, True])  # what the all-reduce would say: another rank saw a bad file

    restored = restore([store], str(tmp_path / "local"), rank=0, world_size=1, agree=lambda ok: ok and next(verdicts))
    assert restored.candidate.name == older
    assert restored.skipped[0].name == newest and "another rank" in restored.skipped[0].reason


def test_each_rank_downloads_only_the_files_it_reads(tmp_path, store):
    name = save(tmp_path, store, 100, world_size=2)
    manifest = read_manifest(store, name)
    assert {f.path for f in files_for_rank(manifest, 1, 2)} == {SHARED, "latest", rank_file(1)}
    assert files_for_rank(manifest, 0, 3) == manifest.files  # resharding converts from all of them

    restored = restore([store], str(tmp_path / "local"), rank=1, world_size=2)
    downloaded = {p.relative_to(restored.folder).as_posix() for p in Path(restored.folder).rglob("*") if p.is_file()}
    assert downloaded == {SHARED, "latest", rank_file(1)}
    assert restored.bytes_read == sum(f.bytes for f in files_for_rank(manifest, 1, 2))


def test_commit_refuses_files_that_are_not_in_the_store(tmp_path, store):
    name = checkpoint_name(100, "a")
    files = list(upload(stage(tmp_path / "staging", {SHARED: b"model"}), store, name))
    files.append(FileEntry(rank_file(0), 5, "0" * 64))
    with pytest.raises(CommitError, match=rank_file(0)):
        commit(
            store, name, step=100, tag="step", world_size=1, zero_stage=1, files=files, data_position={}, config_hash=""
        )
    assert read_manifest(store, name) is None


def test_ranks_that_disagree_about_a_shared_file_cannot_commit(tmp_path, store):
    name = checkpoint_name(100, "a")
    write_part(store, name, 0, [FileEntry("latest", 4, "a" * 64)])
    write_part(store, name, 1, [FileEntry("latest", 4, "b" * 64)])
    error = commit_error(store, name, 2, time.monotonic() + WAIT_S)
    assert isinstance(error, CommitError) and "ranks 0 and 1" in str(error)


def test_waiting_for_a_missing_rank_gives_up_at_the_deadline(tmp_path, store):
    name = checkpoint_name(100, "a")
    write_part(store, name, 0, [FileEntry("latest", 4, "a" * 64)])
    error = commit_error(store, name, 2, time.monotonic())
    assert isinstance(error, DeadlineExceeded) and "ranks [1] of 2" in str(error)


def test_waiting_for_parts_stops_when_cancelled(tmp_path, store):
    cancelled = threading.Event()
    cancelled.set()
    error = commit_error(store, checkpoint_name(100, "a"), 1, time.monotonic() + WAIT_S, wait=cancelled.wait)
    assert isinstance(error, Cancelled) and "cancelled" in str(error)


def test_a_commit_held_once_its_parts_are_in_reads_the_store_once_and_asks_again_at_a_short_pace(
    tmp_path, store, monkeypatch
):
    # A store is polled with a growing interval (it notifies nobody), but what holds a
    # complete checkpoint (its step's report, collected at the controller's next poll) is
    # local: the commit should follow it within HELD_POLL_S, not within the store's backoff.
    name = checkpoint_name(100, "a")
    write_part(store, name, 0, [FileEntry("latest", 4, "a" * 64)])
    polls, waits, holds = [], [], iter(["waiting for the report of step 100 to be collected"] * 8)
    real_poll = store_module.poll_parts
    monkeypatch.setattr(store_module, "poll_parts", lambda *args: polls.append(args) or real_poll(*args))
    committed = []
    errors = commit_when_complete(
        [(store, time.monotonic() + WAIT_S)],
        name,
        1,
        lambda store, files: committed.append(files),
        held_by=lambda: next(holds, None),
        wait=lambda seconds: waits.append(seconds),
    )
    assert errors == {} and committed == [(FileEntry("latest", 4, "a" * 64),)]
    assert len(polls) == 1
    assert waits == [HELD_POLL_S] * 8


def test_waiting_for_parts_reads_each_part_record_once(tmp_path, store, monkeypatch):
    # Rank 0 polls until the last part is in: reading every record again at each poll would
    # make the wait's requests grow with the ranks times the polls.
    name = checkpoint_name(100, "a")
    for rank in range(3):
        write_part(store, name, rank, [FileEntry(f"r{rank}", 4, "a" * 64)])
    reads = []
    real_read = store_module._read_text
    monkeypatch.setattr(store_module, "_read_text", lambda store, path: reads.append(path) or real_read(store, path))
    polls = iter([None, None, lambda: write_part(store, name, 3, [FileEntry("r3", 4, "a" * 64)])])

    def wait(seconds):
        late_part = next(polls, None)
        if late_part:
            late_part()

    errors = commit_when_complete([(store, time.monotonic() + WAIT_S)], name, 4, lambda store, files: None, wait=wait)

    assert errors == {}
    assert sorted(path.rsplit("/", 1)[1] for path in reads) == [f"rank_{rank:05d}.json" for rank in range(4)]


def test_a_part_record_written_again_is_read_again(tmp_path, store):
    name = checkpoint_name(100, "a")
    cache = {}
    write_part(store, name, 0, [FileEntry("r0", 4, "a" * 64)])
    assert poll_parts(store, name, 2, cache).missing == (1,)
    write_part(store, name, 0, [], failed="connection reset")
    assert poll_parts(store, name, 2, cache).failed == ("rank 0: connection reset",)


def test_a_commit_that_fails_against_a_store_is_retried_with_the_stores_backoff(tmp_path, store):
    name = checkpoint_name(100, "a")
    write_part(store, name, 0, [FileEntry("latest", 4, "a" * 64)])
    outcomes, waits = iter([OSError("store down")] * 3), []

    def commit(store, files):
        error = next(outcomes, None)
        if error:
            raise error

    assert (
        commit_when_complete(
            [(store, time.monotonic() + WAIT_S)], name, 1, commit, wait=lambda seconds: waits.append(seconds)
        )
        == {}
    )
    assert waits == [0.05, 0.1, 0.2]


def test_an_upload_that_the_store_silently_truncates_fails_verification(tmp_path):
    faults = Faults(corrupt="truncate", match=lambda path: path.endswith(".pt"))
    faulty = Store(faulty_filesystem(pafs.LocalFileSystem(), faults), str(tmp_path / "primary"), "faulty://primary")
    local = stage(tmp_path / "staging", {SHARED: b"model" * 1000})
    with pytest.raises(CommitError, match=SHARED):
        upload(local, faulty, checkpoint_name(100, "a"))


def test_an_unreadable_manifest_is_skipped_with_its_path(tmp_path, store):
    older = save(tmp_path, store, 80)
    newest = save(tmp_path, store, 100)
    (tmp_path / "primary" / newest / MANIFEST).write_text("{not json")
    restored = restore([store], str(tmp_path / "local"), rank=0, world_size=1)
    assert restored.candidate.name == older
    assert MANIFEST in restored.skipped[0].reason and newest in restored.skipped[0].reason


def _candidate(step, store_index=0, created=1.0, committed=True, name=None) -> Candidate:
    manifest = CheckpointManifest(step, "t", 1, 1, (), {}, "", created) if committed else None
    return Candidate(f"store{store_index}", store_index, name or checkpoint_name(step, "a"), step, manifest)


def test_choose_restore_asks_to_verify_the_newest_committed_candidate_first():
    candidates = [_candidate(80), _candidate(120, committed=False), _candidate(100), _candidate(100, store_index=1)]
    decision = choose_restore(candidates, {})
    assert decision.restore is None and decision.verify_next.key == ("store0", checkpoint_name(100, "a"))
    assert [(s.step, s.reason) for s in decision.skipped] == [(120, "not committed (no manifest)")]

    verified = {("store0", checkpoint_name(100, "a")): "bad file"}
    decision = choose_restore(candidates, verified)
    assert decision.verify_next.key == ("store1", checkpoint_name(100, "a"))  # the replica of the same step

    verified[("store1", checkpoint_name(100, "a"))] = "also bad"
    verified[("store0", checkpoint_name(80, "a"))] = None
    decision = choose_restore(candidates, verified)
    assert decision.restore.step == 80 and decision.verify_next is None
    assert [s.reason for s in decision.skipped] == ["not committed (no manifest)", "bad file", "also bad"]


def test_choose_restore_prefers_the_later_commit_of_a_step_saved_twice():
    first = _candidate(100, created=1.0, name=checkpoint_name(100, "a"))
    again = _candidate(100, created=2.0, name=checkpoint_name(100, "b"))
    assert choose_restore([first, again], {}).verify_next == again


def test_choose_restore_with_nothing_committed_has_nothing_to_do():
    decision = choose_restore([_candidate(100, committed=False)], {})
    assert decision.restore is None and decision.verify_next is None and len(decision.skipped) == 1


def test_names_carry_the_step_and_foreign_folders_are_ignored(tmp_path, store):
    assert step_of(checkpoint_name(1234, "ab12")) == 1234
    assert step_of("step_100") is None
    with pytest.raises(ValueError, match="attempt"):
        checkpoint_name(1, "a/b")
    (tmp_path / "primary" / "not-a-checkpoint").mkdir(parents=True)
    name = save(tmp_path, store, 5)
    assert [c.name for c in list_candidates([store])] == [name]


def test_a_rank_that_records_a_failed_part_ends_the_wait_at_once(tmp_path, store):
    name = checkpoint_name(100, "a")
    write_part(store, name, 0, [FileEntry("latest", 4, "a" * 64)])
    write_part(store, name, 1, [], failed="s3://b/x: connection reset")
    error = commit_error(store, name, 2, time.monotonic() + WAIT_S)
    assert isinstance(error, PartFailed) and "rank 1: s3://b/x: connection reset" in str(error)


def test_at_another_world_size_a_rank_downloads_only_the_universal_copy(tmp_path, store):
    from wildtrain.checkpoint import reshard

    name = save(tmp_path, store, 100, world_size=2)
    copy_name = f"{name}.uc0ffee"
    local = stage(tmp_path / "copy", {"step_universal/zero/w/fp32.pt": b"w" * 50, "client_state.json": b"{}"})
    files = upload(local, store, copy_name)
    commit(
        store,
        copy_name,
        step=100,
        tag="step_universal",
        world_size=2,
        zero_stage=1,
        files=files,
        data_position={},
        config_hash="c0ffee",
    )
    asked = []

    def universal_copy(s, candidate):
        asked.append(candidate.name)
        return reshard.find_universal(s, candidate.name)

    restored = restore([store], str(tmp_path / "local"), rank=0, world_size=3, universal_copy=universal_copy)
    downloaded = {p.relative_to(restored.folder).as_posix() for p in Path(restored.folder).rglob("*") if p.is_file()}
    assert asked == [name] and restored.candidate.name == name and restored.manifest.world_size == 2
    assert downloaded == {"step_universal/zero/w/fp32.pt", "client_state.json"}
    assert [c.name for c in list_candidates([store])] == [name], "a copy is no restore candidate by itself"
