"""What a finished step is due for: a report, a checkpoint, a regrow. Pure, so the
loop's cadence is tested without workers."""

from __future__ import annotations

from dataclasses import dataclass, replace

from wildtrain.config import CheckpointConfig, EvalConfig, TrainConfig


@dataclass(frozen=True)
class Due:
    log: bool  # the metrics window is flushed into this step's report
    checkpoint: bool
    last: bool  # the run's last step: its checkpoint must commit
    first_of_attempt: bool  # the controller times the recovery from this step's report
    regrow: bool = False  # room for more workers: checkpoint, then restart larger
    validate: bool = False  # score the validation set; its metrics ride in this step's window

    @property
    def report(self) -> bool:
        """Every step that logs or saves reports: a save commits once its report is collected."""
        return self.log or self.checkpoint

    @property
    def must_commit(self) -> bool:
        return self.last or self.regrow

    def with_regrow(self) -> "Due":
        return replace(self, regrow=True, checkpoint=True)

    def without_regrow(self) -> "Due":
        return replace(self, regrow=False)


def due_at(step: int, restored_step: int, train: TrainConfig, checkpoint: CheckpointConfig,
           evaluation: EvalConfig = EvalConfig(), validates: bool = False) -> Due:
    """What `step` is due for; `validates`: the run has a validation set."""
    last = step == train.steps
    first = step == restored_step + 1
    validate = validates and (last or (evaluation.every > 0 and step % evaluation.every == 0))
    return Due(log=last or first or validate or step % train.log_every == 0,
               checkpoint=last or step % checkpoint.every == 0, last=last, first_of_attempt=first,
               validate=validate)
