"""Progress lines on the driver's console, from the Ray Train controller: each report's newest
step, and the restart path's interruptions and recoveries."""

from __future__ import annotations

import datetime

from wildtrain.controller_events import Consumer, Interruption, Recovery, RecoveryPath, Reported, Stage, StateChanged


def progress_line(metrics: dict, total_steps: int) -> str:
    step = int(metrics["step"])
    eta = datetime.timedelta(seconds=round((total_steps - step) * metrics["step_time_s"]))
    return (
        f"step {step:>{len(str(total_steps))}}/{total_steps} | loss {metrics['loss']:.4f} | "
        f"{metrics['tokens_per_s']:,.0f} tok/s | world {metrics['world_size']} | ETA {eta}"
    )


class ProgressLines(Consumer):
    """Says what `elastic.controller.ControllerEvents` tells before anything else hears of it,
    the recoveries of both paths alike (an in-process re-form's with the report that carries it)."""

    stage = Stage.SAY

    def __init__(self, total_steps: int) -> None:
        self.total_steps = total_steps

    def state_changed(self, change: StateChanged) -> None:
        for entry in change.entries:
            if isinstance(entry, Interruption) and entry.path is RecoveryPath.RESTART:
                event = entry.event
                print(
                    f"{event.KIND} after step {event.last_step} at world size {event.world_size}: {event.cause}",
                    flush=True,
                )

    def reported(self, reported: Reported) -> None:
        windows = reported.report.windows
        if windows:  # the newest: a report carries the log steps of up to a poll interval
            print(progress_line(windows[-1], self.total_steps), flush=True)
        for entry in reported.entries:
            if not isinstance(entry, Recovery):
                continue
            recovery = entry.event
            if entry.path is RecoveryPath.RESTART:
                print(
                    f"recovered at world size {recovery.world_size_after} from step {recovery.restored_step} "
                    f"in {recovery.recovery_s:.1f} s (restart {recovery.restart_s:.1f} s, "
                    f"restore {recovery.restore_s:.1f} s, "
                    f"reshard {recovery.reshard_s:.1f} s); {recovery.steps_lost} steps redone",
                    flush=True,
                )
            else:
                print(
                    f"re-formed in-process at world size {recovery.world_size_after} from step "
                    f"{recovery.restored_step} in {recovery.recovery_s:.1f} s (rendezvous {recovery.restart_s:.1f} s, "
                    f"state from peers {recovery.restore_s:.1f} s); {recovery.steps_lost} steps redone",
                    flush=True,
                )
