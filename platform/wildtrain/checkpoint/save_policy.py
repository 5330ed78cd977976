"""What becomes of a checkpoint save that is due, and how each save ended: pure decisions and
records, without threads, tensors or storage, so that they are tested on their own.

At most one save is in flight. When the next one is due before it has finished, `policy`
decides: "skip" records the new one as skipped; "queue" captures it and keeps it to run
next (a newer one replaces it, recorded as skipped; the queue costs a second host copy of the
state). With several ranks the decision must be the same on every rank, because the capture
is a collective (see `AsyncSaver.admission`).

Every save ends as one `SaveOutcome` (saved, partial, failed or skipped; why; how long the
training thread waited; how long the rest took; bytes); `metrics` sums up those that ended
since the loop's last report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Sequence

Policy = Literal["skip", "queue"]
Status = Literal["saved", "partial", "failed", "skipped"]
Failure = Literal["", "timeout", "disk_full", "verify", "storage", "error"]


@dataclass(frozen=True)
class DiskFull:
    path: str
    bytes_needed: int
    bytes_free: Optional[int]  # None where the store reports no free space (object stores)

    def __str__(self) -> str:
        free = "unknown" if self.bytes_free is None else f"{self.bytes_free:,}"
        return f"no space left on device for {self.path}: {self.bytes_needed:,} bytes needed, {free} free"


@dataclass(frozen=True)
class SaveOutcome:
    step: int
    name: str
    status: Status  # partial: stored in some stores, not all
    reason: str = ""
    failure: Failure = ""
    stall_s: float = 0.0  # the training thread blocked in the capture
    background_s: float = 0.0  # staging write, upload, verification, commit
    bytes: int = 0  # this rank's files
    stored: tuple[str, ...] = ()  # stores where rank 0 committed (other ranks: uploaded their part)
    notes: tuple[str, ...] = ()  # deletions by retention, problems that did not fail the save
    disk_full: Optional[DiskFull] = None

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.background_s / 1e6 if self.background_s > 0 else 0.0


def metrics(outcomes: Sequence[SaveOutcome]) -> dict[str, float]:
    """The loop's checkpoint metrics for the saves that ended since its last report."""
    reported = {
        f"checkpoint/{status}": float(sum(o.status == status for o in outcomes))
        for status in ("saved", "partial", "failed", "skipped")
    }
    if outcomes:  # every capture stalled training, whatever became of the save afterwards
        reported["checkpoint/stall_s"] = max(o.stall_s for o in outcomes)
    stored = [o for o in outcomes if o.status in ("saved", "partial")]
    if stored:
        last = stored[-1]
        reported |= {
            "checkpoint/save_s": last.background_s,
            "checkpoint/bytes": float(last.bytes),
            "checkpoint/mb_per_s": last.mb_per_s,
            "checkpoint/step": float(last.step),
        }
    return reported


@dataclass(frozen=True)
class InFlight:
    step: int
    running_s: float
    doing: str


@dataclass(frozen=True)
class Admission:
    action: Literal["start", "queue", "skip"]
    reason: str = ""
    disk_full: Optional[DiskFull] = None


def admit(
    policy: Policy,
    in_flight: Optional[InFlight],
    blocked_elsewhere: bool,
    staging: str,
    staging_free: Optional[int],
    bytes_needed: int,
) -> Admission:
    """Whether a save due now starts, waits for the one in flight, or is skipped.
    `bytes_needed` is the previous save's size: the staging disk must hold another."""
    if staging_free is not None and staging_free < bytes_needed:
        full = DiskFull(staging, bytes_needed, staging_free)
        return Admission("skip", f"staging disk full: {full}", full)
    if in_flight is not None and policy == "skip":
        return Admission(
            "skip",
            f"the save of step {in_flight.step} is still in flight after "
            f"{in_flight.running_s:.1f} s ({in_flight.doing})",
        )
    if blocked_elsewhere:
        return Admission("skip", "another rank cannot save now")
    if in_flight is not None:
        return Admission("queue", f"waits for the save of step {in_flight.step}")
    return Admission("start")
