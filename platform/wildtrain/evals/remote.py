"""An evaluation of a committed checkpoint as a Ray task on resources of its own: the
checkpoint exported to Transformers' format in a temporary folder (`export`), evaluated by
lm-eval on each task (`harness`), and the results handed back to the caller, which logs
them to the run's MLflow run at the checkpoint's step (`log_evaluation`). `wildtrain eval`
submits one and waits for it; the controller's `EvalEvery` submits them beside training.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from wildtrain import storage
from wildtrain.config import ConfigError, EvalConfig
from wildtrain.evals.harness import TaskFolder, harness_metrics, name_part, run_tasks, task_manager
from wildtrain.export import RunInfo, export_checkpoint
from wildtrain.resources import choose_device

ARTIFACT_DIR = "evals"
# The task's process logs to the console of whoever submitted it (the training run's):
# Transformers' and Datasets' progress bars would bury its progress lines (lm-eval's:
# `harness.run_tasks`).
_QUIET_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
}


@dataclass(frozen=True)
class EvalPlan:
    """What an evaluation runs: its tasks (known to lm-eval or to the task folder), the
    eval.* settings, and the files of eval.include_path."""

    tasks: tuple[str, ...]
    settings: EvalConfig
    folder: Optional[TaskFolder]


def plan_evaluation(settings: EvalConfig, tasks: Sequence[str], key: str = "eval.tasks") -> EvalPlan:
    """`tasks` checked and eval.include_path read, where the evaluation is submitted from:
    a mistake is one line naming `key` before anything is submitted."""
    if not tasks:
        raise ConfigError(f"{key}: no tasks to evaluate")
    folder = TaskFolder.read(settings.include_path) if settings.include_path else None
    task_manager(tasks, Path(folder.source) if folder else None, key)
    return EvalPlan(tuple(tasks), settings, folder)


@dataclass(frozen=True)
class EvalResources:
    num_cpus: float
    num_gpus: int

    def describe(self) -> str:
        gpus = f"{self.num_gpus} GPU and " if self.num_gpus else ""
        return f"{gpus}{self.num_cpus:g} CPU{'' if self.num_cpus == 1 else 's'}"


def eval_resources(settings: EvalConfig, cluster_gpus: float) -> EvalResources:
    """One GPU where the cluster offers any (`choose_device`'s answer for an unset
    cluster.use_gpu), and eval.num_cpus CPUs."""
    return EvalResources(settings.num_cpus, int(choose_device(None, cluster_gpus).use_gpu))


@dataclass(frozen=True)
class Evaluated:
    step: int  # the checkpoint's
    checkpoint: str  # <store>/<name> it was read from
    metrics: dict[str, float]  # eval/<task>/<metric> (`harness.metric_key`)
    results: dict[str, str]  # lm-eval's results of each task that ran, as JSON
    failed: dict[str, str]  # the reason of each task that did not
    seconds: float


def evaluate(run: RunInfo, step: Optional[int], plan: EvalPlan) -> Evaluated:
    """Run in the Ray task: the run's newest committed checkpoint (or `step`'s), exported
    into checkpoint.staging_dir, evaluated on each task; the folder is removed after."""
    yield_to_training()  # the task's process ends with it (max_calls=1)
    started = time.monotonic()
    staging = Path(run.cfg.checkpoint.staging_dir)
    staging.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"eval-{run.name}-", dir=staging) as folder:
        exported = export_checkpoint(run, str(Path(folder, "model")), step)
        (Path(folder) / "tasks").mkdir()
        results, failed = run_tasks(
            Path(exported.location), plan.tasks, plan.settings, plan.folder, Path(folder) / "tasks"
        )
    metrics = {
        name: value for task in plan.tasks if task in results for name, value in harness_metrics(results[task]).items()
    }
    return Evaluated(
        exported.step,
        exported.checkpoint,
        metrics,
        {task: json.dumps(result, indent=1, default=str) for task, result in results.items()},
        failed,
        time.monotonic() - started,
    )


def yield_to_training() -> None:
    """Every thread of this process runs only on CPU time no other process wants (Linux's
    SCHED_IDLE), where the evaluation shares a node's cores with training (its CPU work on a
    GPU node; all of it on a CPU one). Niceness was not enough: Ray runs training's workers
    at nice 15, and at nice 19 an evaluation still took a share of a contended core from them
    (bench/eval_interference.py; docs/benchmarks.md). Per thread, as Linux schedules threads:
    Ray's own were started before the task ran; those started later inherit it."""
    if not hasattr(os, "SCHED_IDLE"):
        os.nice(19)  # not Linux: the lowest priority it offers
        return
    for thread in os.listdir("/proc/self/task"):
        try:
            os.sched_setscheduler(int(thread), os.SCHED_IDLE, os.sched_param(0))
        except ProcessLookupError:
            pass  # ended meanwhile


def submit(run: RunInfo, step: Optional[int], plan: EvalPlan):
    """`evaluate` as a Ray task on the cluster this process joined, holding `eval_resources`
    until it ends (its process then exits: the model and lm-eval leave with it); its ObjectRef."""
    import ray

    resources = eval_resources(plan.settings, ray.cluster_resources().get("GPU", 0.0))
    task = ray.remote(max_calls=1)(evaluate).options(
        num_cpus=resources.num_cpus,
        num_gpus=resources.num_gpus,
        max_retries=0,
        name=f"wildtrain-eval-{run.name}-step{step if step is not None else 'newest'}",
        # DeepSpeed (the export's checkpoint reading) told there is no GPU, as a CPU worker is;
        # the checkpoint read from the store this process reaches, not the one (if any) of
        # the node the task lands on.
        runtime_env={
            "env_vars": {
                **_QUIET_ENV,
                **({} if resources.num_gpus else {"DS_ACCELERATOR": "cpu"}),
                **storage.handover_env(run.cfg.storage),
            }
        },
    )
    return task.remote(run, step, plan)


def failure_reason(error: BaseException) -> str:
    """One line for an evaluation that raised: the task's own error, not Ray's wrapping."""
    from ray.exceptions import RayTaskError

    cause = error.cause if isinstance(error, RayTaskError) and error.cause is not None else error
    lines = str(cause).strip().splitlines()
    return lines[0] if lines else type(cause).__name__


def artifact_path(step: int, task: str) -> str:
    return f"{ARTIFACT_DIR}/step_{step}/{name_part(task)}.json"


def log_evaluation(tracker, evaluated: Evaluated) -> None:
    """The metrics at the checkpoint's step, and each task's full results as an artifact,
    through the run's `Tracker` (buffered: nothing here waits on MLflow)."""
    if evaluated.metrics:
        tracker.metrics(evaluated.metrics, evaluated.step)
    for task, text in evaluated.results.items():
        tracker.text(text, artifact_path(evaluated.step, task))
