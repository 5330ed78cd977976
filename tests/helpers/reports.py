"""Workers' reports as the controller's callbacks get them (`wildtrain.worker_report`)."""

from wildtrain.worker_report import Startup, WorkerReport


def report(step: int, world_size: int) -> WorkerReport:
    return WorkerReport(step=step, tokens_seen=64 * step, world_size=world_size)


def first_report(
    step: int,
    world_size: int,
    restored_step: int,
    started_at: float,
    first_step_at: float,
    restore_s: float = 1.0,
    reshard_s: float = 2.0,
) -> WorkerReport:
    """An attempt's first report: its training function started at `started_at`, and its
    first step was done at `first_step_at`; the start-up's other times fall between."""
    startup = Startup(
        restored_step=restored_step,
        restore_s=restore_s,
        reshard_s=reshard_s,
        engine_build_s=0.5,
        worker_started_at=started_at - 1.0,
        attempt_started_at=started_at,
        health_checked_at=started_at,
        restored_at=started_at + restore_s + reshard_s,
        first_step_at=first_step_at,
    )
    return WorkerReport(step=step, tokens_seen=64 * step, world_size=world_size, startup=startup)
