"""Evaluations of a real run's checkpoints with lm-eval, on the session's Ray cluster,
logged to its MLflow server: the automatic ones beside training (eval.tasks), one of whose
tasks fails, which costs only an event; then `wildtrain eval` of an earlier checkpoint of the
same run. One short run serves both."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from mlflow.tracking import MlflowClient

from tests.conftest import REPO
from wildtrain import cli, driver
from wildtrain.events import EvalFailed
from wildtrain.tracking.record import read_events

# Nothing timed: `make test` runs it beside the drills, whose longest it was (93 s in a CI).
pytestmark = [pytest.mark.integration, pytest.mark.untimed]

TASK = "wildtrain_tiny_choice"  # tests/assets/evals/tiny_choice.yaml


def test_a_run_evaluates_its_checkpoints_beside_training_and_wildtrain_eval_an_earlier_one(
    tmp_path, tiny_config, tiny_overrides, mlflow_url
):
    tasks = tmp_path / "tasks"
    shutil.copytree(REPO / "tests/assets/evals", tasks)
    # A task whose data is gone, as a dataset that cannot be downloaded is: known to lm-eval
    # (the run starts), failing when evaluated.
    (tasks / "broken.yaml").write_text(
        (tasks / "tiny_choice.yaml")
        .read_text()
        .replace(TASK, "wildtrain_broken")
        .replace("tiny_choice.jsonl", "gone.jsonl")
    )
    evals = [f"eval.include_path={tasks}", "eval.every_checkpoints=2", "eval.limit=6"]
    # One worker: the head's third CPU is the evaluations' (scaling.spare_cpus).
    cfg = tiny_config("elastic.max_workers=1", f"eval.tasks=[{TASK},wildtrain_broken]", *evals)
    summary = driver.run(cfg)

    client = MlflowClient(mlflow_url)
    run_id = summary.run_id
    assert client.get_run(run_id).info.status == "FINISHED"
    # Checkpoints at steps 4 and 8 (checkpoint.every 4); due: 8, a multiple of 2 x 4 and the last.
    [auto] = client.get_metric_history(run_id, f"eval/{TASK}/acc")
    assert auto.step == 8 and 0 <= auto.value <= 1
    [artifact] = client.list_artifacts(run_id, "evals/step_8")
    assert artifact.path == f"evals/step_8/{TASK}.json"
    results = json.loads(Path(client.download_artifacts(run_id, artifact.path, str(tmp_path))).read_text())
    assert results["results"][TASK]["acc,none"] == auto.value and results["n-samples"][TASK]["effective"] == 6
    [failed] = [e for e in read_events(mlflow_url, run_id, str(tmp_path / "events")) if isinstance(e, EvalFailed)]
    assert (failed.step, failed.tasks) == (8, ["wildtrain_broken"]) and "gone.jsonl" in failed.reason

    done = CliRunner().invoke(cli.main, ["eval", cfg.run.name, "--step", "4", "--tasks", TASK, *tiny_overrides, *evals])
    assert done.exit_code == 0, done.output
    assert f"\neval/{TASK}/acc " in f"\n{done.stdout}"  # after what the task's process printed
    history = sorted(client.get_metric_history(run_id, f"eval/{TASK}/acc"), key=lambda m: m.step)
    assert [m.step for m in history] == [4, 8]
    assert f"{TASK}.json" in [a.path.rsplit("/", 1)[-1] for a in client.list_artifacts(run_id, "evals/step_4")]
