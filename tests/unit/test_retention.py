from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from wildtrain.checkpoint.format import MANIFEST, CheckpointManifest, checkpoint_name
from wildtrain.checkpoint.restore import Candidate, list_candidates
from wildtrain.checkpoint.retention import RetentionPolicy, apply_retention, plan_retention, to_delete
from wildtrain.checkpoint.store import Store, commit, upload


@given(
    steps=st.sets(st.integers(0, 200), max_size=30),
    keep_last=st.integers(0, 6),
    keep_every=st.integers(0, 50),
    good_pool=st.sets(st.integers(0, 200)),
)
def test_kept_is_exactly_the_last_k_and_the_multiples_and_a_good_one(steps, keep_last, keep_every, good_pool):
    good = steps & good_pool
    deleted = to_delete(list(steps), keep_last, keep_every, good)
    kept = steps - set(deleted)

    assert deleted == sorted(deleted) and set(deleted) <= steps
    expected = set(sorted(steps)[-keep_last:]) if keep_last else set()
    expected |= {s for s in steps if keep_every and s % keep_every == 0}
    if good and not expected & good:
        expected.add(max(good))
    assert kept == expected
    if good:
        assert kept & good, "the only good checkpoint was deleted"


def test_the_only_good_checkpoint_survives_even_with_keep_last_1():
    assert to_delete([80, 100], keep_last=1, keep_every=0, good={80}) == []
    assert to_delete([60, 80, 100], keep_last=1, keep_every=0, good={60, 80}) == [60]
    assert to_delete([60, 80, 100], keep_last=1, keep_every=0, good={100}) == [60, 80]


def test_permanent_checkpoints_every_n_steps():
    assert to_delete([10, 20, 30, 40, 50], keep_last=1, keep_every=20, good=set()) == [10, 30]


def _candidate(name: str, step: int, created: float = 1.0, committed: bool = True, problem=None) -> Candidate:
    manifest = CheckpointManifest(step, "t", 1, 1, (), {}, "", created) if committed else None
    return Candidate("store", 0, name, step, manifest, problem)


def test_plan_deletes_superseded_duplicates_and_old_leftovers_but_not_unreadable_folders():
    candidates = [
        _candidate("step_000000010-a", 10),
        _candidate("step_000000020-a", 20, created=1.0),
        _candidate("step_000000020-b", 20, created=2.0),  # step 20 saved again by attempt b
        _candidate("step_000000015-a", 15, committed=False),  # a failed save
        _candidate("step_000000030-b", 30, committed=False),  # the save in flight
        _candidate("step_000000005-z", 5, committed=False, problem="manifest format 2"),
    ]
    plan = plan_retention(candidates, RetentionPolicy(keep_last=5), good=set())
    assert sorted(plan.delete) == ["step_000000015-a", "step_000000020-a"]
    assert dict(zip(plan.delete, plan.reasons))["step_000000020-a"] == "superseded by step_000000020-b"


def test_plan_keeps_the_good_copy_of_a_step_saved_twice():
    candidates = [_candidate("step_000000020-a", 20, created=1.0), _candidate("step_000000020-b", 20, created=2.0)]
    plan = plan_retention(candidates, RetentionPolicy(keep_last=1), good={"step_000000020-a"})
    assert plan.delete == ("step_000000020-b",)


def _commit(tmp_path: Path, store: Store, step: int) -> str:
    name = checkpoint_name(step, "a")
    local = tmp_path / "staging" / name
    local.mkdir(parents=True)
    (local / "model.pt").write_bytes(b"x" * step)
    files = upload(str(local), store, name)
    commit(store, name, step=step, tag="t", world_size=1, zero_stage=0, files=files, data_position={}, config_hash="")
    return name


def test_apply_removes_manifests_and_folders_and_keeps_the_only_good_one(tmp_path):
    store = Store.from_uri(str(tmp_path / "store"))
    names = [_commit(tmp_path, store, step) for step in (10, 20, 30, 40)]

    plan = apply_retention(store, RetentionPolicy(keep_last=1, keep_every=20), good={names[0]})

    assert sorted(plan.delete) == [names[2]]
    assert sorted(c.name for c in list_candidates([store])) == [names[0], names[1], names[3]]
    assert not (tmp_path / "store" / names[2]).exists()
    assert all((tmp_path / "store" / n / MANIFEST).is_file() for n in (names[0], names[1], names[3]))


def test_a_commit_whose_manifest_read_answers_404_once_is_not_deleted(tmp_path):
    import pyarrow.fs as pafs

    from tests.helpers.faulty_fs import Faults, faulty_filesystem

    local = Store.from_uri(str(tmp_path / "store"))
    names = [_commit(tmp_path, local, step) for step in (10, 20)]
    # An eventually consistent store answers 404 once for step 10's manifest, which exists.
    flaky = Faults(read_match=lambda path: path.endswith(f"{names[0]}/{MANIFEST}"), lost_reads=1)
    store = Store(faulty_filesystem(pafs.LocalFileSystem(), flaky), local.root, local.uri)

    plan = apply_retention(store, RetentionPolicy(keep_last=2), good=set())

    assert plan.delete == ()
    assert sorted(c.name for c in list_candidates([local])) == names
    assert all(c.manifest is not None for c in list_candidates([local]))


def test_a_folder_without_a_manifest_on_two_reads_is_deleted(tmp_path):
    store = Store.from_uri(str(tmp_path / "store"))
    names = [_commit(tmp_path, store, step) for step in (10, 20)]
    (tmp_path / "store" / names[0] / MANIFEST).unlink()  # a save that never committed

    plan = apply_retention(store, RetentionPolicy(keep_last=2), good=set())

    assert plan.delete == (names[0],) and plan.uncommitted == (names[0],)
    assert not (tmp_path / "store" / names[0]).exists()


def test_a_deleted_checkpoint_takes_its_universal_copies_with_it(tmp_path):
    from wildtrain.checkpoint.reshard import copies_of

    store = Store.from_uri(str(tmp_path / "store"))
    names = [_commit(tmp_path, store, step) for step in (10, 20)]
    (tmp_path / "store" / f"{names[0]}.ua1b2").mkdir()  # a conversion cut short
    (tmp_path / "store" / f"{names[0]}.ua1b2" / "part.pt").write_bytes(b"x")
    (tmp_path / "store" / f"{names[1]}.uc3d4").mkdir()

    apply_retention(store, RetentionPolicy(keep_last=1), good=set())

    assert copies_of(store, names[0]) == [] and not (tmp_path / "store" / names[0]).exists()
    assert copies_of(store, names[1]) == [f"{names[1]}.uc3d4"]


def test_a_folder_the_store_lists_after_its_objects_are_gone_does_not_stop_retention(tmp_path):
    import pyarrow.fs as pafs

    from tests.helpers.faulty_fs import Faults, FaultyHandler

    class EmptiedFolderListed(FaultyHandler):
        # SeaweedFS lists a folder whose objects were all deleted, and answers 404 for deleting it.
        def delete_dir(self, path):
            if path.endswith(ghost):
                raise FileNotFoundError(f"Path does not exist '{path}/'")
            super().delete_dir(path)

    local = Store.from_uri(str(tmp_path / "store"))
    names = [_commit(tmp_path, local, step) for step in (10, 20, 30)]
    ghost = checkpoint_name(5, "a")
    (tmp_path / "store" / ghost).mkdir()
    store = Store(pafs.PyFileSystem(EmptiedFolderListed(pafs.LocalFileSystem(), Faults())), local.root, local.uri)

    plan = apply_retention(store, RetentionPolicy(keep_last=2), good=set())

    assert set(plan.delete) == {names[0], ghost}
    assert sorted(c.name for c in list_candidates([local]) if c.manifest) == names[1:]
