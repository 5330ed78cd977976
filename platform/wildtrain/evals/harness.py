"""What wildtrain asks of EleutherAI's lm-evaluation-harness (lm-eval): whether tasks
exist, a Transformers model folder evaluated on each of them, and the results as MLflow
metrics.

lm-eval, and Transformers through it, is imported inside the functions that need it only:
never on a training worker's path, nor on the driver's unless eval.tasks is set.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

from wildtrain.config import ConfigError, EvalConfig

METRIC_PREFIX = "eval"
# A task folder travels in the evaluation's arguments, through Ray: task YAMLs and small
# data files, not corpora.
MAX_FOLDER_BYTES = 16 * 2**20
# What MLflow refuses in a metric name's part: all but letters, digits, _ - . and space
# (':' passes on POSIX servers only; '/' separates the parts).
_REFUSED = re.compile(r"[^\w.\- ]")


def name_part(text: str) -> str:
    """`text` as one part of an MLflow metric name or artifact path."""
    part = _REFUSED.sub("_", text)
    return part if part.strip(".") else part.replace(".", "_")  # "." and ".." would be path steps


def metric_key(task: str, key: str) -> Optional[str]:
    """The MLflow metric of lm-eval's result `key` for `task`; None for a key that is no
    metric (alias, sample_len). lm-eval names a metric "<metric>,<filter>": the rule is
    eval/<task>/<metric> for its default filter "none" ("acc,none" -> eval/<task>/acc), and
    eval/<task>/<metric>/<filter> for any other (gsm8k's "exact_match,strict-match"), each part
    with every character MLflow refuses in a name replaced by "_"."""
    metric, comma, filter_name = key.partition(",")
    if not comma:
        return None
    parts = [task, metric] + ([filter_name] if filter_name != "none" else [])
    return "/".join([METRIC_PREFIX, *map(name_part, parts)])


def harness_metrics(results: dict) -> dict[str, float]:
    """The numbers of an lm-eval `simple_evaluate` result (its tasks' and groups'), named by
    `metric_key`; values that are not numbers (a stderr of "N/A") are left out."""
    metrics = {}
    for task, values in results.get("results", {}).items():
        for key, value in values.items():
            name = metric_key(task, key)
            if name is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
                metrics[name] = float(value)
    return metrics


@dataclass(frozen=True)
class TaskFolder:
    """The files of eval.include_path, read where an evaluation is planned and written out
    again where it runs: a node of the cluster, which may not see the folder."""

    source: str  # the folder they were read from, resolved
    files: dict[str, bytes]  # by path relative to it

    @classmethod
    def read(cls, path: str, key: str = "eval.include_path") -> "TaskFolder":
        root = Path(path).expanduser().resolve()
        if not root.is_dir():
            raise ConfigError(f"{key}: no folder {root}")
        files, size = {}, 0
        for file in sorted(root.rglob("*")):
            relative = file.relative_to(root)
            if not file.is_file() or any(p.startswith(".") or p == "__pycache__" for p in relative.parts):
                continue
            size += file.stat().st_size
            if size > MAX_FOLDER_BYTES:
                raise ConfigError(
                    f"{key}: {root} holds more than the {MAX_FOLDER_BYTES // 2**20} MiB an evaluation "
                    "carries to its node; keep large data where every node reads it"
                )
            files[relative.as_posix()] = file.read_bytes()
        return cls(str(root), files)

    def write(self, folder: Path) -> Path:
        for relative, data in self.files.items():
            (folder / relative).parent.mkdir(parents=True, exist_ok=True)
            (folder / relative).write_bytes(data)
        return folder


def task_manager(tasks: Sequence[str], include_path: Optional[Path], key: str):
    """An lm-eval TaskManager that knows every one of `tasks`; an unknown one is refused,
    naming `key`. Only the tasks of `include_path` where they are all there: lm-eval's own
    index of every task it ships costs seconds of CPU to build (docs/benchmarks.md)."""
    from lm_eval import __version__
    from lm_eval.tasks import TaskManager

    include = str(include_path) if include_path is not None else None
    if include is not None:
        own = TaskManager(include_path=include, include_defaults=False)
        if set(tasks) <= set(own.all_tasks):
            return own
    manager = TaskManager(include_path=include)
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown:
        close = difflib.get_close_matches(unknown[0], manager.all_tasks, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        among = f"lm-eval {__version__}'s tasks" + (f" or those in {include}" if include else "")
        raise ConfigError(f"{key}: unknown task {unknown[0]!r}{hint}; not among {among}")
    return manager


@contextlib.contextmanager
def _inside(folder: Path) -> Iterator[None]:
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


@contextlib.contextmanager
def _no_stderr() -> Iterator[None]:
    """Nothing on this process's stderr, its children's included: lm-eval's progress bars
    (which ignore TQDM_DISABLE) and the `git describe` it runs in the task folder ("fatal: not
    a git repository") would interleave with the training run's lines. A task's failure is
    reported by its exception."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def run_tasks(
    model_dir: Path, tasks: Sequence[str], settings: EvalConfig, folder: Optional[TaskFolder], workdir: Path
) -> tuple[dict[str, dict], dict[str, str]]:
    """The Transformers model in `model_dir` evaluated on each task in turn, on the GPU
    where there is one: lm-eval's results by task, and the reasons of the tasks that failed
    (a task whose data cannot be read costs its own metrics only). `folder` is written into
    `workdir`, and the tasks run from there: relative paths in its YAMLs are relative to it."""
    import lm_eval
    import torch
    from lm_eval.models.huggingface import HFLM

    logging.getLogger("lm_eval").setLevel(logging.WARNING)  # its INFO lines per task and request
    include = folder.write(workdir) if folder is not None else None
    with _inside(workdir):
        manager = task_manager(tasks, include, "eval.tasks")
        cuda = torch.cuda.is_available()
        # bf16 on a GPU, as evaluations of large models run; the exported fp32 weights on a CPU.
        model = HFLM(
            pretrained=str(model_dir),
            dtype="bfloat16" if cuda else "float32",
            device="cuda" if cuda else "cpu",
            batch_size=settings.batch_size,
        )
        results, failed = {}, {}
        for task in tasks:
            try:
                with _no_stderr():
                    results[task] = lm_eval.simple_evaluate(
                        model=model, tasks=[task], task_manager=manager, limit=settings.limit, log_samples=False
                    )
            except Exception as e:  # noqa: BLE001 - any task's failure is that task's alone
                reason = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
                # Named where the user put the files, not in the copy evaluated here.
                failed[task] = reason.replace(str(include), folder.source) if include is not None else reason
    return results, failed
