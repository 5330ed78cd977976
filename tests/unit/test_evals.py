"""Evaluations with lm-eval: metric names, which checkpoints are evaluated and when, the
eval section's checks, the bundled task on an exported model (lm-eval itself, no Ray), and
`wildtrain eval`'s answers to bad input (one line, a non-zero exit, nothing submitted).
Evaluations of a training run's checkpoints, on a cluster: tests/integration/test_evals.py."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import threading

import pytest
from click.testing import CliRunner, Result

from tests.conftest import REPO
from tests.helpers.models import random_model
from tests.helpers.runs import commit_checkpoint, make_run
from wildtrain import cli
from wildtrain.config import ConfigError, EvalConfig, ModelConfig, load_config
from wildtrain.data.tokenizer import ByteTokenizer
from wildtrain.elastic.controller import EvalQueue, eval_due
from wildtrain.elastic.scaling import spare_cpus
from wildtrain.evals.harness import TaskFolder, harness_metrics, run_tasks
from wildtrain.evals.remote import eval_resources, yield_to_training
from wildtrain.export import write_hf
from wildtrain.layout import RunLayout

TASKS = REPO / "tests/assets/evals"
TASK = "wildtrain_tiny_choice"  # tests/assets/evals/tiny_choice.yaml
MODEL = ModelConfig(dim=32, n_layers=1, n_heads=2, max_seq_len=64)


def test_metric_names_drop_the_default_filter_and_what_mlflow_refuses():
    results = {
        "results": {
            "arc_easy": {"alias": "arc_easy", "acc,none": 0.5, "acc_stderr,none": 0.01, "acc_norm,none": 0.625},
            "gsm8k": {"exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": "N/A", "sample_len": 10},
            "mmlu (stem)": {"acc,none": 0.3, "weird|metric,none": 1},
        }
    }
    assert harness_metrics(results) == {
        "eval/arc_easy/acc": 0.5,
        "eval/arc_easy/acc_stderr": 0.01,
        "eval/arc_easy/acc_norm": 0.625,
        "eval/gsm8k/exact_match/strict-match": 0.25,
        "eval/mmlu _stem_/acc": 0.3,
        "eval/mmlu _stem_/weird_metric": 1.0,
    }


def test_due_checkpoints_are_the_cadences_multiples_and_the_last():
    due = [step for step in range(1, 101) if eval_due(step, every_checkpoints=2, checkpoint_every=20, last_step=90)]
    assert due == [40, 80, 90]
    # A resize's checkpoint between them (step 47) is not due: the due steps never move.
    assert not eval_due(47, 2, 20, 90)


def test_one_evaluation_at_a_time_and_only_the_newest_waits():
    queue, start, skipped = EvalQueue().due(20)
    assert (start, skipped) == (20, None)
    queue, start, skipped = queue.due(40)
    assert (start, skipped) == (None, None)
    queue, start, skipped = queue.due(60)  # 40 never started: 60 replaces it
    assert (start, skipped, queue) == (None, 40, EvalQueue(running=20, waiting=60))
    queue, start = queue.finished()
    assert (start, queue) == (60, EvalQueue(running=60))
    queue, start = queue.finished()
    assert (start, queue) == (None, EvalQueue())


@pytest.mark.parametrize(
    "override, message",
    [
        ("eval.every_checkpoints=0", "eval.every_checkpoints: must be positive, got 0"),
        ("eval.limit=0", "eval.limit: must be positive (below 1: a share of each task) or null, got 0.0"),
        ("eval.tasks=[hellaswag,'']", "eval.tasks.1: '' is not a task name"),
        ("eval.tasks=hellaswag", "eval.tasks: expected a list, e.g. eval.tasks=[a,b]"),
    ],
)
def test_eval_settings_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError) as refused:
        load_config([override])
    assert str(refused.value).startswith(message)


def test_an_evaluation_takes_a_gpu_where_the_cluster_offers_them_and_training_leaves_its_cpus():
    assert eval_resources(EvalConfig(num_cpus=2), cluster_gpus=8).describe() == "1 GPU and 2 CPUs"
    assert eval_resources(EvalConfig(), cluster_gpus=0).describe() == "1 CPU"
    assert spare_cpus(*_data_and_eval("eval.num_cpus=2")) == 1  # no tasks: nothing held for evaluations
    assert spare_cpus(*_data_and_eval("eval.num_cpus=2", "eval.tasks=[x]")) == 3


def _data_and_eval(*overrides: str) -> tuple:
    cfg = load_config(list(overrides))
    return cfg.data, cfg.eval


def _yielded_threads(started_before: threading.Event, queue) -> None:
    # In a process of its own: the policy stays with its threads.
    threading.Thread(target=started_before.wait, daemon=True).start()  # as Ray's threads are
    yield_to_training()
    later = threading.Thread(target=started_before.wait, daemon=True)
    later.start()  # as torch's intra-op threads are
    queue.put({int(t): os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")})
    started_before.set()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policy")
def test_an_evaluation_yields_every_thread_to_training_those_started_before_and_after():
    context = multiprocessing.get_context("fork")  # a copy of this process, which then changes
    queue = context.Queue()
    process = context.Process(target=_yielded_threads, args=(context.Event(), queue))
    process.start()
    policies = queue.get(timeout=60)
    process.join(60)
    assert len(policies) >= 3 and set(policies.values()) == {os.SCHED_IDLE}, policies
    assert os.sched_getscheduler(0) != os.SCHED_IDLE  # the caller's own threads are left alone


def test_the_bundled_task_runs_on_an_exported_model_elsewhere_and_a_broken_task_fails_alone(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    write_hf(model, MODEL, random_model(MODEL).state_dict(), ByteTokenizer(), {})
    source = tmp_path / "tasks"
    shutil.copytree(TASKS, source)
    (source / "broken.yaml").write_text(
        (TASKS / "tiny_choice.yaml")
        .read_text()
        .replace(TASK, "wildtrain_broken")
        .replace("tiny_choice.jsonl", "gone.jsonl")
    )
    folder = TaskFolder.read(str(source))
    shutil.rmtree(source)  # evaluated from what was read: the node evaluating may not see the folder
    (tmp_path / "there").mkdir()
    before = os.getcwd()
    results, failed = run_tasks(model, [TASK, "wildtrain_broken"], EvalConfig(limit=4), folder, tmp_path / "there")
    assert os.getcwd() == before
    assert list(results) == [TASK] and list(failed) == ["wildtrain_broken"]
    assert f"{source}/gone.jsonl" in failed["wildtrain_broken"], failed  # where the user put the task
    assert results[TASK]["n-samples"][TASK]["effective"] == 4
    metrics = harness_metrics(results[TASK])
    assert 0 <= metrics[f"eval/{TASK}/acc"] <= 1
    json.dumps(results[TASK], default=str)  # the artifact's text


def wildtrain(*args: str) -> Result:
    done = CliRunner().invoke(cli.main, list(args))
    assert done.exception is None or isinstance(done.exception, SystemExit), repr(done.exception)
    return done


def one_line(done: Result, code: int) -> str:
    assert done.exit_code == code, done.output
    assert done.stderr.startswith("wildtrain: ") and done.stderr.count("\n") == 1, done.stderr
    return done.stderr.strip()


@pytest.fixture
def run(tmp_path) -> list[str]:
    """A run with a committed checkpoint at step 4 (files never read: every answer here
    comes before an evaluation starts), and the overrides that find it. No MLflow server
    and no Ray cluster: reaching either would fail otherwise."""
    where = [
        f"run.storage={tmp_path / 'runs'}",
        f"checkpoint.staging_dir={tmp_path / 'staging'}",
        "tracking.uri=http://127.0.0.1:9",
        "cluster.ray_address=127.0.0.1:9",
        f"eval.include_path={TASKS}",
    ]
    cfg = make_run(tmp_path / "data", [*where, "run.name=r"], MODEL)
    commit_checkpoint(cfg, tmp_path, 4)
    return where


def test_an_unknown_task_is_named_before_anything_is_submitted(run):
    done = wildtrain("eval", "r", "--tasks", f"{TASK},hellaswg", *run)
    assert one_line(done, 2).startswith(
        "wildtrain: --tasks: unknown task 'hellaswg' (did you mean 'hellaswag'?); not among lm-eval "
    )
    assert str(TASKS) in done.stderr


def test_a_step_without_a_committed_checkpoint_is_named_with_the_committed_ones(run, tmp_path):
    done = wildtrain("eval", "r", "--step", "3", "--tasks", TASK, *run)
    cfg = load_config([*run, "run.name=r"])
    store = RunLayout.of(cfg.run, cfg.checkpoint).checkpoint_uris[0]
    assert one_line(done, 1) == f"wildtrain: run 'r' has no committed checkpoint at step 3 in {store} (committed: 4)"


def test_no_tasks_and_bad_settings_exit_2(run):
    assert one_line(wildtrain("eval", "r", *run), 2) == "wildtrain: eval.tasks: no tasks to evaluate"
    done = wildtrain("eval", "r", "--tasks", TASK, *run, "eval.batch_size=0")
    assert one_line(done, 2) == "wildtrain: eval.batch_size: must be positive, got 0"
    done = wildtrain("eval", "r", "--tasks", TASK, *run, "eval.include_path=/nonexistent/tasks")
    assert one_line(done, 2) == "wildtrain: eval.include_path: no folder /nonexistent/tasks"


def test_an_unreachable_mlflow_is_named_before_anything_is_submitted(run):
    done = wildtrain("eval", "r", "--tasks", TASK, *run)
    assert one_line(done, 1).startswith(
        "wildtrain: tracking.uri: the MLflow server at http://127.0.0.1:9 is unreachable"
    )
