"""Commits a lost rank 0 never reported (`elastic.missed_commits`): which are missed, and the
controller's callback finding them in a real (local) checkpoint store after a recovery, as the
controller's polls would hand it the reports. No Ray: the callback is called as Ray's report
handler calls it."""

from __future__ import annotations

import time

from tests.helpers.reports import first_report, report
from tests.helpers.runs import commit_checkpoint
from wildtrain.checkpoint.restore import Candidate, list_candidates
from wildtrain.config import load_config
from wildtrain.elastic.missed_commits import MissedCommits, missed_commits, restored_after_a_loss
from wildtrain.events import Recovered
from wildtrain.layout import RunLayout, checkpoint_stores
from wildtrain.worker_report import WorkerReport


def candidate(step: int, store_index: int = 0, committed: bool = True) -> Candidate:
    manifest = object() if committed else None  # only whether there is one matters here
    return Candidate(f"s3://store{store_index}", store_index, f"step_{step:09d}-ab", step, manifest)


def test_missed_are_the_committed_unnoticed_steps_within_the_bounds_oldest_first_primary_first():
    candidates = [
        candidate(12, 1),
        candidate(12),
        candidate(4),
        candidate(8),
        candidate(16),
        candidate(10, committed=False),
        candidate(6),
    ]
    missed = missed_commits(candidates, after_step=4, through_step=12, noticed={6})
    assert missed == ["s3://store0/step_000000008-ab", "s3://store0/step_000000012-ab", "s3://store1/step_000000012-ab"]
    assert missed_commits(candidates, after_step=16, through_step=20, noticed=set()) == []


def test_a_loss_looks_up_to_the_step_restored_and_a_join_not_at_all():
    def recovered(kind: str) -> Recovered:
        return Recovered(time.time(), kind, 2, 1, 0.1, 0.1, 0.0, 0.5, restored_step=8, steps_lost=0)

    assert restored_after_a_loss(WorkerReport(step=9, tokens_seen=0, world_size=1, events=(recovered("failure"),))) == 8
    # Members carry their unreported commits over a join.
    assert (
        restored_after_a_loss(WorkerReport(step=9, tokens_seen=0, world_size=2, events=(recovered("resize"),))) is None
    )
    assert restored_after_a_loss(first_report(9, 1, restored_step=4, started_at=0.0, first_step_at=1.0)) == 4
    assert restored_after_a_loss(report(9, 2)) is None


def polls(callback: MissedCommits, reports: list[WorkerReport]) -> list[list[str]]:
    """Each report as the callbacks after this one see its notices."""
    seen = []
    for one in reports:
        metrics = [one.to_dict()]
        callback.after_report(None, metrics)
        seen.append(metrics[0]["committed_checkpoints"])
    return seen


def noticing(step: int, *checkpoints: str) -> WorkerReport:
    return WorkerReport(step=step, tokens_seen=64 * step, world_size=1, committed_checkpoints=checkpoints)


def test_a_commit_whose_notice_was_lost_with_rank_zero_is_noticed_after_the_recovery(tmp_path):
    cfg = load_config([f"run.storage={tmp_path / 'runs'}", "run.name=r"])
    primary = RunLayout.of(cfg.run, cfg.checkpoint).checkpoint_uris[0]
    commit_checkpoint(cfg, tmp_path, 2)  # a resubmission's: restored from, not this run's to notice
    commit_checkpoint(cfg, tmp_path, 4)
    callback = MissedCommits(RunLayout.of(cfg.run, cfg.checkpoint), cfg.storage)
    assert polls(
        callback,
        [
            first_report(3, 2, restored_step=2, started_at=0.0, first_step_at=1.0),
            noticing(5, f"{primary}/step_000000004-ab"),
        ],
    ) == [[], [f"{primary}/step_000000004-ab"]]
    # Rank 0 commits step 8 and is lost before its report of it is collected; a save of
    # step 10 never committed. The survivors re-form and report their recovery.
    commit_checkpoint(cfg, tmp_path, 8)
    commit_checkpoint(cfg, tmp_path, 10, committed=False)
    recovered = Recovered(time.time(), "failure", 2, 1, 0.1, 0.1, 0.0, 0.5, 9, 0)
    assert polls(callback, [WorkerReport(step=9, tokens_seen=576, world_size=1, events=(recovered,))]) == [[]]
    # The next commit is noticed as ever, while the stores are listed in the background.
    commit_checkpoint(cfg, tmp_path, 12)
    late = [f"{primary}/step_000000008-ab"]
    deadline = time.monotonic() + 30
    seen: list[str] = []
    step = 12
    while seen != late + [f"{primary}/step_000000012-ab"] and time.monotonic() < deadline:
        [seen] = polls(callback, [noticing(step, f"{primary}/step_000000012-ab")])
        step += 1
    assert seen == late + [f"{primary}/step_000000012-ab"]
    # Once only.
    assert polls(callback, [report(step, 1)]) == [[]]
    assert sorted(
        c.step for c in list_candidates(checkpoint_stores(RunLayout.of(cfg.run, cfg.checkpoint), cfg.storage))
    ) == [2, 4, 8, 10, 12]


def test_a_restarted_groups_first_report_looks_too(tmp_path):
    cfg = load_config([f"run.storage={tmp_path / 'runs'}", "run.name=r"])
    primary = RunLayout.of(cfg.run, cfg.checkpoint).checkpoint_uris[0]
    callback = MissedCommits(RunLayout.of(cfg.run, cfg.checkpoint), cfg.storage)
    commit_checkpoint(cfg, tmp_path, 4)
    polls(callback, [first_report(1, 2, restored_step=0, started_at=0.0, first_step_at=1.0), report(5, 2)])
    # The group restarts from step 4, whose notice its lost rank 0 took with it.
    polls(callback, [first_report(5, 1, restored_step=4, started_at=10.0, first_step_at=11.0)])
    deadline = time.monotonic() + 30
    seen: list[str] = []
    while not seen and time.monotonic() < deadline:
        [seen] = polls(callback, [report(6, 1)])
    assert seen == [f"{primary}/step_000000004-ab"]
