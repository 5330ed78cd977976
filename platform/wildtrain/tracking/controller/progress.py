"""Progress lines on the driver's console, from the Ray Train controller."""

from __future__ import annotations

import datetime

from ray.train import UserCallback

from wildtrain.worker_report import rank_zero


def progress_line(metrics: dict, total_steps: int) -> str:
    step = int(metrics["step"])
    eta = datetime.timedelta(seconds=round((total_steps - step) * metrics["step_time_s"]))
    return (
        f"step {step:>{len(str(total_steps))}}/{total_steps} | loss {metrics['loss']:.4f} | "
        f"{metrics['tokens_per_s']:,.0f} tok/s | world {metrics['world_size']} | ETA {eta}"
    )


class ProgressCallback(UserCallback):
    def __init__(self, total_steps: int) -> None:
        self.total_steps = total_steps

    def after_report(self, run_context, metrics, checkpoint) -> None:
        windows = rank_zero(metrics).windows
        if windows:  # the newest: a report carries the log steps of up to a poll interval
            print(progress_line(windows[-1], self.total_steps), flush=True)
