"""Checkpoints whose commit notice a lost rank 0 took with it, found in the stores and noticed late.

Rank 0 alone commits a checkpoint, once the report of its step is collected, and the notice
("<store URI>/<name>", `WorkerReport.committed_checkpoints`) rides in its next report. Where
rank 0 is lost before the controller collects that one (its node died: the group restarts, or
in-process its peers re-form without it), the notice goes with it: nothing would evaluate that
checkpoint (`EvalEvery`), convert it ahead of a resize (`ReshardAhead`) or tag the MLflow run
with it, though it is committed and the run may restore from it."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional, Sequence

from wildtrain import ray_compat
from wildtrain.checkpoint.format import step_of
from wildtrain.checkpoint.restore import Candidate, list_candidates
from wildtrain.config import StorageConfig
from wildtrain.events import Recovered
from wildtrain.layout import RunLayout, checkpoint_stores
from wildtrain.worker_report import WorkerReport, rank_zero


def missed_commits(candidates: Sequence[Candidate], after_step: int, through_step: int, noticed: set[int]) -> list[str]:
    """The notices ("<store URI>/<name>") of the committed checkpoints among `candidates` of a
    step after `after_step` and up to `through_step` that no report noticed (`noticed`: their
    steps), oldest first and, per checkpoint, the primary's copy first, as rank 0 lists them."""
    late = [
        c
        for c in candidates
        if c.manifest is not None
        and c.problem is None
        and c.step is not None
        and after_step < c.step <= through_step
        and c.step not in noticed
    ]
    return [f"{c.store}/{c.name}" for c in sorted(late, key=lambda c: (c.step, c.name, c.store_index))]


@dataclass
class _Listing:
    """The stores listed in a thread: the checkpoints that could have been committed unnoticed
    before the recovery that started it (steps after `after_step`, up to `through_step`)."""

    after_step: int
    through_step: int
    found: list[Candidate] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)


class MissedCommits(ray_compat.ReportCallback):
    """At the first report after workers were lost (`restored_after_a_loss`), lists the run's
    checkpoint stores in a thread (a paused store must not hold up the controller's loop); the
    first report after the listing ended carries the commits it found that no report noticed,
    up to the step the group restored, before this report's own, as if rank 0 had noticed them.
    Goes before every callback that acts on notices. A listing that fails only costs its
    notices; one still running when the run ends is left."""

    def __init__(self, layout: RunLayout, config: StorageConfig) -> None:
        self.layout, self.config = layout, config  # where the run's checkpoints are listed
        # The step the run's first report restored (None before it): what it restored is no
        # notice of this run's.
        self.first_restored: Optional[int] = None
        self.noticed: set[int] = set()  # the steps of the checkpoints reports noticed
        self._listing: Optional[_Listing] = None

    def after_report(self, training_report, metrics) -> None:
        report = rank_zero(metrics)
        listing = self._listing
        if listing is not None and listing.done.is_set():
            self._listing = None
            late = missed_commits(listing.found, listing.after_step, listing.through_step, self.noticed)
            if late:
                print(
                    f"noticed late (rank 0 was lost before its report of them was collected): {', '.join(late)}",
                    flush=True,
                )
                metrics[0]["committed_checkpoints"] = [*late, *report.committed_checkpoints]
        self.noticed |= {
            step
            for step in (step_of(notice.rsplit("/", 1)[-1]) for notice in metrics[0]["committed_checkpoints"])
            if step is not None
        }
        if self.first_restored is None:
            self.first_restored = report.startup.restored_step if report.startup is not None else 0
        elif self._listing is None and (restored_step := restored_after_a_loss(report)) is not None:
            self._listing = self._list(max([self.first_restored, *self.noticed]), restored_step)

    def _list(self, after_step: int, through_step: int) -> _Listing:
        listing = _Listing(after_step, through_step)

        def run() -> None:
            try:
                listing.found = list_candidates(checkpoint_stores(self.layout, self.config))
            except Exception as e:  # the notices are lost, as they were before this looked
                print(f"looking for checkpoints committed unnoticed failed: {e}", flush=True)
            finally:
                listing.done.set()

        threading.Thread(target=run, name="wildtrain-missed-commits", daemon=True).start()
        return listing


def restored_after_a_loss(report: WorkerReport) -> Optional[int]:
    """Where `report` is the first after workers were lost (a restarted group's first, which
    a regrow's restart costs a look, or an in-process generation's first after a `Recovered`
    failure), the step it restored: every commit up to it was the last group's or generation's,
    whose rank 0 may be gone with its notices; the commits after it are this one's, noticed as
    ever. None after a join: its members carry their commits over it."""
    if report.startup is not None:
        return report.startup.restored_step
    return next((e.restored_step for e in report.events if isinstance(e, Recovered) and e.kind == "failure"), None)
