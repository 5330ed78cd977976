"""A 2x2 sweep of tiny CPU trials on the session's real Ray, SeaweedFS and MLflow, run once
for the module: parent and child runs, early stop, resumption, the report rebuilt from
MLflow, and promotion to a bigger model."""

from __future__ import annotations

import itertools
import math
import os
import shutil
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import REPO
from tests.helpers.runs import open_mlflow_run
from wildtrain.config import load_config
from wildtrain.model.transformer import scaling
from wildtrain.sweeps.execute import SWEEP_TAG, run_sweep
from wildtrain.sweeps.fit import FitError
from wildtrain.sweeps.grid import plan_sweep
from wildtrain.sweeps.predict import predict_promoted
from wildtrain.sweeps.promote import promote
from wildtrain.sweeps.report import report_sweep
from wildtrain.tracking.record import STOPPED_EARLY_TAG
from wildtrain.tracking.reports.runs import report_cluster

pytestmark = pytest.mark.integration

GRID = ["optim.lr=0.003,10", "model.dim=64,128"]


@pytest.fixture(scope="module")
def sweep(ray_cluster, mlflow_url, tiny_dataset, tmp_path_factory):
    folder = tmp_path_factory.mktemp("sweep")
    name = f"sweep-{os.getpid()}"
    overrides = [
        "experiment=tiny",
        f"data.datasets=[{{uri: {tiny_dataset}}}]",
        f"run.storage={folder / 'runs'}",
        f"tracking.uri={mlflow_url}",
        "tracking.experiment=sweeps",
        # One worker, few steps: the trials differ only in the swept keys, and are short.
        # Half a CPU for the reads: two trials fit the head's 3 CPUs at once.
        "elastic.min_workers=1",
        "elastic.max_workers=1",
        "data.read_cpus=0.5",
        "train.global_batch_size=8",
        "train.micro_batch_size=8",
        "train.log_every=2",
        "checkpoint.every=6",
        "elastic.worker_start_timeout_s=20",
        # Longer than a trial's six steps: a diverged trial's reports wait for the poll, and
        # its early stop must not (it is judged at the log step that shows it).
        "elastic.poll_interval_s=2",
    ]
    plan = plan_sweep(name, GRID, overrides, steps=6)
    outcome = run_sweep(plan, say=print)  # a CI log then shows each trial start
    return plan, outcome, folder


def test_sweep_records_one_parent_and_a_child_per_trial_with_their_swept_values(sweep, mlflow_url):
    plan, outcome, _ = sweep
    client = MlflowClient(mlflow_url)
    runs = client.search_runs(
        [client.get_experiment_by_name("sweeps").experiment_id], f"tags.`{SWEEP_TAG}` = '{plan.name}'"
    )
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert [p.info.run_id for p in parents] == [outcome.parent_run_id]
    assert parents[0].info.status == "FINISHED" and not outcome.failed
    assert sorted(c.info.run_name for c in children) == sorted(t.run_name for t in plan.trials)
    for child in children:
        assert child.info.status == "FINISHED"
        assert child.data.tags["mlflow.parentRunId"] == outcome.parent_run_id
        trial = next(t for t in plan.trials if t.run_name == child.info.run_name)
        lr, dim = dict(trial.values)["optim.lr"], dict(trial.values)["model.dim"]
        assert (child.data.tags["sweep.optim.lr"], child.data.tags["sweep.model.dim"]) == (lr, dim)
        assert float(child.data.params["optim.lr"]) == float(lr) and child.data.params["model.dim"] == dim
        inputs = client.get_run(child.info.run_id).inputs.dataset_inputs
        assert len(inputs) == 1 and inputs[0].dataset.source_type == "wildtrain-manifest"
        history = sorted(client.get_metric_history(child.info.run_id, "loss"), key=lambda m: m.step)
        steps = [m.step for m in history]
        if lr == "10":  # diverged at once: stopped at the first log step that showed it, before the last
            assert (
                "above 3 x the best" in child.data.tags[STOPPED_EARLY_TAG]
                or "nan" in child.data.tags[STOPPED_EARLY_TAG]
            )
            losses = [m.value for m in history]
            diverged = [i for i, loss in enumerate(losses) if i and not loss <= 3 * min(losses[:i])]
            assert diverged[:1] == [len(losses) - 1] and max(steps) < 6, history
        else:
            assert STOPPED_EARLY_TAG not in child.data.tags and max(steps) == 6


def test_trials_run_as_many_at_once_as_the_cluster_holds(sweep, mlflow_url):
    plan, _, _ = sweep
    client = MlflowClient(mlflow_url)
    trials = [
        r
        for r in client.search_runs(
            [client.get_experiment_by_name("sweeps").experiment_id], f"tags.`{SWEEP_TAG}` = '{plan.name}'"
        )
        if "mlflow.parentRunId" in r.data.tags
    ]
    # Each trial's run from its creation to its end; at most two at any time, and two at some.
    edges = sorted([(r.info.start_time, 1) for r in trials] + [(r.info.end_time, -1) for r in trials])
    at_once = max(itertools.accumulate(change for _, change in edges))
    assert at_once == 2, edges


def test_running_the_sweep_again_runs_nothing_new(sweep, mlflow_url):
    plan, outcome, _ = sweep
    client = MlflowClient(mlflow_url)
    experiment = client.get_experiment_by_name("sweeps").experiment_id
    before = {r.info.run_id: r.info.end_time for r in client.search_runs([experiment])}
    again = run_sweep(plan, say=lambda line: None)
    assert (again.parent_run_id, again.ran, again.failed) == (outcome.parent_run_id, (), ())
    assert sorted(again.skipped) == sorted(t.run_name for t in plan.trials)
    assert {r.info.run_id: r.info.end_time for r in client.search_runs([experiment])} == before


def test_report_rebuilds_from_mlflow_and_attaches_to_the_parent(sweep, mlflow_url):
    plan, outcome, _ = sweep
    text = report_sweep(mlflow_url, plan.name)
    print(text)  # the table, in the CI log
    lines = text.splitlines()
    rows = {line.split()[1]: line.split()[0] for line in lines[2:6]}
    by_lr = {t.run_name: dict(t.values)["optim.lr"] for t in plan.trials}
    assert sorted(rank for name, rank in rows.items() if by_lr[name] == "0.003") == ["1", "2"]
    assert {rank for name, rank in rows.items() if by_lr[name] == "10"} == {"-"}
    assert "stopped early: " in text and "optim.lr=10: - (n=0)" in text and "best: " in text
    client = MlflowClient(mlflow_url)
    artifacts = {a.path: a.file_size for a in client.list_artifacts(outcome.parent_run_id, "report")}
    assert artifacts["report/sweep.png"] > 1000
    assert (
        client.download_artifacts(outcome.parent_run_id, "report/sweep.txt")
        and Path(client.download_artifacts(outcome.parent_run_id, "report/sweep.txt")).read_text() == text
    )
    # Trials are runs like any: the cluster's card counts them.
    card = report_cluster(mlflow_url, "local")
    assert all(t.run_name in card for t in plan.trials)


def test_promote_writes_a_frozen_scaled_experiment_whose_run_carries_the_provenance(sweep, mlflow_url, tmp_path):
    plan, outcome, _ = sweep
    conf = tmp_path / "conf"
    shutil.copytree(REPO / "conf", conf)
    promotion = promote(mlflow_url, plan.name, ["model=125m"], ["train.steps=100"], name="yolo", conf_dir=conf)
    best = next(t for t in plan.trials if t.run_name == promotion.provenance["wildtrain.promoted_from.trial"])
    assert dict(best.values)["optim.lr"] == "0.003"
    cfg = load_config(["experiment=yolo"], conf)
    assert cfg == promotion.cfg and cfg.model.dim == 768 and cfg.train.steps == 100 and not cfg.early_stop.enabled
    width, depth = 768 / best.cfg.model.dim, 12 / best.cfg.model.n_layers
    # The trial's multipliers are kept, its shape recorded as the base the model scales from.
    assert cfg.optim.lr == best.cfg.optim.lr and cfg.optim.hidden_lr_mult == best.cfg.optim.hidden_lr_mult
    assert (cfg.model.base_dim, cfg.model.base_head_dim, cfg.model.base_n_layers) == (
        best.cfg.model.dim,
        best.cfg.model.dim // best.cfg.model.n_heads,
        best.cfg.model.n_layers,
    )
    scaled = scaling(cfg.model)
    assert scaled.output_mult == pytest.approx(1 / width)
    assert scaled.lr_mult("attention.wq", cfg.optim.hidden_lr_mult) == pytest.approx(1 / width / math.sqrt(depth))
    text = promotion.path.read_text()
    assert "# Provenance" in text and best.run_name in text
    # The run it starts is created with the provenance as MLflow tags.
    _, run_id = open_mlflow_run(cfg, None)
    tags = MlflowClient(mlflow_url).get_run(run_id).data.tags
    assert tags["wildtrain.promoted_from.sweep"] == plan.name
    assert tags["wildtrain.promoted_from.trial_hash"] == best.hash
    assert tags["wildtrain.promoted_from.data_manifests"]
    assert tags["wildtrain.promoted_from.config_hash"]
    with pytest.raises(Exception, match="frozen"):
        promote(mlflow_url, plan.name, ["model=125m"], name="yolo", conf_dir=conf)


def test_fit_refuses_a_sweep_too_small_for_five_parameters(sweep, mlflow_url):
    plan, _, _ = sweep
    with pytest.raises(FitError, match=r"at least 8 points .* got 2 points, 2 sizes"):
        predict_promoted(mlflow_url, plan.name, ["model=125m"])
