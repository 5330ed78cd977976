"""When a worker reports (see train/attempt.py's docstring for why a report may wait): which
steps close a metrics window, and which of them look whether the previous report reached
the controller. The same on every rank, so the ranks look at the same steps."""

from __future__ import annotations

from dataclasses import dataclass

from wildtrain.train.schedule import At, every


@dataclass
class ReportCadence:
    log_every: int  # train.log_every
    next_look: int = 0  # the first step at which the previous report may have been collected
    # A save waits for a report of its step before it may commit: from its step on, every
    # report step looks whether one can go.
    save_unreported: bool = False

    def logs(self, at: At, validated: bool) -> bool:
        """Whether `at` closes a metrics window: every `log_every` steps, the attempt's first
        step (the recovery's timing), the run's last, and a validation's (its metrics ride in
        the window)."""
        return at.last or at.first or validated or every(at.step, self.log_every)

    def due(self, logs: bool, saving: bool) -> bool:
        """Every step that logs or saves reports: a save commits once its report is collected."""
        return logs or saving

    def looks(self, at: At, saving: bool) -> bool:
        """Whether this report step asks every rank if its previous report was collected (a
        collective): once a poll's worth of steps has passed, or while a save waits for its
        step's report."""
        self.save_unreported |= saving
        return at.step >= self.next_look or self.save_unreported

    def sent(self, step: int, steps_per_poll: int) -> None:
        """A report went at `step`; the controller takes it about `steps_per_poll` steps on."""
        self.save_unreported = False
        self.next_look = step + steps_per_poll
