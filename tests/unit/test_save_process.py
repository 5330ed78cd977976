"""The save process: one child per saver (spawned with it, or when told where deferred),
reused, gone with the saver or its parent, and killed (then replaced) when a storage call in
it never returns."""

import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pyarrow.fs as pafs
import torch

from tests.helpers.faulty_fs import HangingHandler
from wildtrain.checkpoint.async_save import AsyncSaver, CheckpointMeta
from wildtrain.checkpoint.restore import restore
from wildtrain.checkpoint.save_process import SaveProcess
from wildtrain.checkpoint.store import Store

WAIT_S = 60  # a bound for events that should come soon (a child imports torch); never waited out in a passing run


def meta(step: int) -> CheckpointMeta:
    return CheckpointMeta(step=step, tag=f"step_{step}", world_size=1, zero_stage=0, data_position={"step": step})


def save(saver: AsyncSaver, step: int, value: float):
    assert saver.save_state(meta(step), {"state.pt": {"w": torch.full((64, 64), value)}}).action == "start"
    assert saver.flush(WAIT_S)
    [outcome] = saver.drain()
    return outcome


def test_one_child_serves_every_save_and_goes_away_with_the_saver(tmp_path):
    saver = AsyncSaver([str(tmp_path / "store")], str(tmp_path / "staging"), rank=0, world_size=1, attempt="p1", nice=5)
    try:
        assert save(saver, 10, 1.0).status == "saved"
        child = saver._process.process
        assert save(saver, 20, 2.0).status == "saved"
        assert saver._process.process is child and child.is_alive()
        # Linux caps niceness at 19 (`make test` runs the unit tests at 19 already).
        assert psutil.Process(child.pid).nice() == min(psutil.Process().nice() + 5, 19)
    finally:
        assert saver.close(WAIT_S)
    assert not psutil.pid_exists(child.pid) or psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE
    restored = restore([str(tmp_path / "store")], str(tmp_path / "local"), rank=0, world_size=1)
    assert restored.manifest.step == 20
    assert torch.equal(torch.load(f"{restored.folder}/state.pt")["w"], torch.full((64, 64), 2.0))


def test_the_child_exits_when_its_parent_is_killed(tmp_path):
    script = textwrap.dedent(f"""
        import sys, torch
        from wildtrain.checkpoint.async_save import AsyncSaver, CheckpointMeta
        saver = AsyncSaver([{str(tmp_path / "store")!r}], {str(tmp_path / "staging")!r}, rank=0, world_size=1,
                           attempt="p1")
        saver.save_state(CheckpointMeta(1, "step_1", 1, 0), {{"state.pt": {{"w": torch.zeros(8)}}}})
        assert saver.flush({WAIT_S})
        print(saver._process.process.pid, flush=True)
        sys.stdin.read()  # until the test kills it
    """)
    parent = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        parent.send_signal(signal.SIGKILL)
        parent.wait(WAIT_S)
        child.wait(WAIT_S)  # raises TimeoutExpired if it stays, an orphan
    finally:
        parent.kill()
        parent.wait()


def test_the_child_does_not_run_its_parents_main_script(tmp_path):
    # A Ray worker's main script is Ray's default_worker.py, whose imports the child never uses.
    ran = tmp_path / "ran"
    script = tmp_path / "main_script.py"
    script.write_text(
        textwrap.dedent(f"""
        import os
        with open({str(ran)!r}, "a") as f:
            print(os.getpid(), file=f)
        if __name__ == "__main__":
            import torch
            from wildtrain.checkpoint.async_save import AsyncSaver, CheckpointMeta
            saver = AsyncSaver([{str(tmp_path / "store")!r}], {str(tmp_path / "staging")!r}, rank=0, world_size=1,
                               attempt="p1")
            saver.save_state(CheckpointMeta(1, "step_1", 1, 0), {{"state.pt": {{"w": torch.zeros(8)}}}})
            assert saver.flush({WAIT_S})
            [outcome] = saver.drain()
            assert outcome.status == "saved", outcome
            assert saver.close({WAIT_S})
    """)
    )
    parent = subprocess.Popen([sys.executable, str(script)], env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)})
    assert parent.wait(2 * WAIT_S) == 0
    assert ran.read_text().split() == [str(parent.pid)]


def test_a_store_call_that_never_returns_fails_the_save_and_the_next_one_works(tmp_path):
    marker = tmp_path / "hang"
    marker.touch()
    store = Store(
        pafs.PyFileSystem(HangingHandler(pafs.LocalFileSystem(), str(marker))),
        str(tmp_path / "store"),
        str(tmp_path / "store"),
    )
    saver = AsyncSaver([store], str(tmp_path / "staging"), rank=0, world_size=1, attempt="p1", timeout_s=1.0)
    try:
        hung = save(saver, 10, 1.0)
        assert (hung.status, hung.failure) == ("failed", "timeout")
        assert "uploading" in hung.reason and "state.pt" in hung.reason and "timeout_s=1" in hung.reason
        marker.unlink()
        assert save(saver, 20, 2.0).status == "saved"
    finally:
        assert saver.close(WAIT_S)
    assert restore([store], str(tmp_path / "local"), rank=0, world_size=1).manifest.step == 20


def test_a_saver_closed_idle_hands_its_child_to_the_next_saver_which_saves_with_its_own_settings(tmp_path):
    # An in-process re-form's attempt saves through the child of the attempt before it: no new imports.
    first = AsyncSaver([str(tmp_path / "first")], str(tmp_path / "staging"), rank=0, world_size=1, attempt="p1")
    assert save(first, 10, 1.0).status == "saved"
    child = first._process.process
    process = first.close_keeping_process(WAIT_S)
    assert process is not None and process.process is child and child.is_alive()
    second = AsyncSaver(
        [str(tmp_path / "second")], str(tmp_path / "staging"), rank=0, world_size=1, attempt="p2", process=process
    )
    try:
        assert save(second, 20, 2.0).status == "saved"
        assert second._process.process is child
    finally:
        assert second.close(WAIT_S)
    assert not psutil.pid_exists(child.pid) or psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE
    # Each save went to its own saver's store: the settings travel with the job, not with the child.
    for store, step in (("first", 10), ("second", 20)):
        assert (
            restore([str(tmp_path / store)], str(tmp_path / f"local-{store}"), rank=0, world_size=1).manifest.step
            == step
        )


def test_a_saver_closed_mid_save_hands_over_not_its_child_and_a_dead_one_given_is_replaced(tmp_path):
    marker = tmp_path / "hang"
    marker.touch()
    store = Store(
        pafs.PyFileSystem(HangingHandler(pafs.LocalFileSystem(), str(marker))),
        str(tmp_path / "store"),
        str(tmp_path / "store"),
    )
    saver = AsyncSaver([store], str(tmp_path / "staging"), rank=0, world_size=1, attempt="p1")
    assert saver.save_state(meta(10), {"state.pt": {"w": torch.zeros(8)}}).action == "start"
    child = saver._process.process
    # The save in flight is abandoned with its child, and a saver that is closing spawns no
    # other: the next saver starts its own (an in-process re-form's after its first step).
    handed = saver.close_keeping_process(0)
    child.join(WAIT_S)
    assert not child.is_alive()
    assert handed is None and saver._process is None
    [abandoned] = saver.drain()
    assert abandoned.status in ("failed", "skipped")

    given = SaveProcess()
    given.kill()
    marker.unlink()
    after = AsyncSaver([store], str(tmp_path / "staging"), rank=0, world_size=1, attempt="p2", process=given)
    try:
        assert after._process is not given
        assert save(after, 20, 2.0).status == "saved"
    finally:
        assert after.close(WAIT_S)


def test_a_deferred_child_starts_once_when_told_or_with_the_first_save(tmp_path):
    told = AsyncSaver(
        [str(tmp_path / "store")], str(tmp_path / "staging"), rank=0, world_size=1, attempt="p1", defer_process=True
    )
    try:
        assert told._process is None
        told.start_process()
        child = told._process.process
        told.start_process()
        assert told._process.process is child and child.is_alive()
        assert save(told, 10, 1.0).status == "saved"
        assert told._process.process is child
    finally:
        assert told.close(WAIT_S)
    untold = AsyncSaver(
        [str(tmp_path / "store")], str(tmp_path / "staging"), rank=0, world_size=1, attempt="p2", defer_process=True
    )
    try:
        assert save(untold, 20, 2.0).status == "saved"
    finally:
        assert untold.close(WAIT_S)
    assert restore([str(tmp_path / "store")], str(tmp_path / "local"), rank=0, world_size=1).manifest.step == 20
