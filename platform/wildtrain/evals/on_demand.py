"""The evaluation `wildtrain eval` asks for: one committed checkpoint of a run, checked where
it is asked (a mistake is one line before anything is submitted), evaluated as a Ray task
(`remote.submit`), waited for up to eval.timeout_s, and logged to the run's MLflow run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from wildtrain.config import Config
from wildtrain.evals.remote import Evaluated, failure_reason, log_evaluation, plan_evaluation, submit
from wildtrain.export import committed_step, run_info
from wildtrain.layout import RunLayout
from wildtrain.tracking.controller.mlflow_run import FLUSH_TIMEOUT_S, Tracker
from wildtrain.tracking.mlflow_client import check_reachable


class EvalError(RuntimeError):
    """An evaluation that ran past eval.timeout_s or failed in its task."""


@dataclass(frozen=True)
class Logged:
    evaluated: Evaluated
    mlflow_run_id: str
    unsent: Optional[Path]  # the records MLflow did not take in time (`Tracker.close`); None: all


def evaluate_checkpoint(
    cfg: Config, step: Optional[int], tasks: Optional[Sequence[str]], say: Callable[[str], None]
) -> Logged:
    """Evaluate run.name's checkpoint of `step` (None: the newest committed) on `tasks`
    (None: eval.tasks) on the cluster of cluster.ray_address, and log the results."""
    info = run_info(cfg)
    at = committed_step(info, step)
    plan = plan_evaluation(
        cfg.eval, cfg.eval.tasks if tasks is None else tasks, "eval.tasks" if tasks is None else "--tasks"
    )
    check_reachable(cfg.tracking.uri)
    import ray
    from ray.exceptions import GetTimeoutError

    from wildtrain.services import connect_ray

    connect_ray(cfg.cluster.ray_address)
    say(f"evaluating {cfg.run.name} step {at} on {', '.join(plan.tasks)}")
    ref = submit(info, at, plan)  # the step announced, not whichever is newest when the task runs
    try:
        evaluated = ray.get(ref, timeout=cfg.eval.timeout_s)
    except GetTimeoutError:
        ray.cancel(ref, force=True)
        raise EvalError(
            f"the evaluation of {cfg.run.name} step {at} took longer than eval.timeout_s ({cfg.eval.timeout_s:g} s)"
        ) from None
    except ray.exceptions.RayError as e:
        raise EvalError(f"the evaluation of {cfg.run.name} step {at} failed: {failure_reason(e)}") from e
    tracker = Tracker(cfg.tracking.uri, info.mlflow_run_id, RunLayout.of(cfg.run, cfg.checkpoint).tracking / "eval")
    log_evaluation(tracker, evaluated)
    return Logged(evaluated, info.mlflow_run_id, tracker.close(FLUSH_TIMEOUT_S))
