"""What `promote` and `fit` read back from MLflow: a sweep recorded as `run_sweep` and its
trials' `wildtrain train` record it (the parent run, one run per trial with its metrics),
in a local SQLite store, without Ray."""

from __future__ import annotations

import json
import shutil

import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from tests.conftest import REPO
from wildtrain.config import load_config
from wildtrain.model import param_count
from wildtrain.sweeps.execute import SweepError, open_parent, trial_tags
from wildtrain.sweeps.fit import Law
from wildtrain.sweeps.grid import plan_sweep
from wildtrain.sweeps.predict import predict_promoted
from wildtrain.sweeps.promote import PromoteError, promote
from wildtrain.tracking.mlflow_client import Client

EXPERIMENT = "sweeps"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """(tracking URI, conf/ to plan and promote in): promote writes its experiment there."""
    folder = tmp_path_factory.mktemp("sweeps")
    conf = folder / "conf"
    shutil.copytree(REPO / "conf", conf)
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    MlflowClient(uri).create_experiment(EXPERIMENT, artifact_location=str(folder / "artifacts"))
    return uri, conf


def record_sweep(uri, plan, curve) -> str:
    """The sweep's parent run and a finished run per trial, with the losses `curve(trial)`
    gives: (training losses logged evenly up to train.steps, final val/loss or None)."""
    client = MlflowClient(uri)
    experiment_id = client.get_experiment_by_name(EXPERIMENT).experiment_id
    parent = open_parent(Client(uri), experiment_id, plan)
    for trial in plan.trials:
        losses, val_loss = curve(trial)
        train = trial.cfg.train
        steps = [round(train.steps * (i + 1) / len(losses)) for i in range(len(losses))]
        run = client.create_run(experiment_id, run_name=trial.run_name, tags=trial_tags(parent, plan.name, trial))
        metrics = [Metric("loss", loss, 0, step) for step, loss in zip(steps, losses)]
        metrics += [
            Metric("tokens_seen", step * train.global_batch_size * trial.cfg.data.seq_len, 0, step) for step in steps
        ]
        metrics += [Metric("val/loss", val_loss, 0, steps[-1])] if val_loss is not None else []
        client.log_batch(run.info.run_id, metrics=metrics)
        client.set_terminated(run.info.run_id, "FINISHED")
    client.set_terminated(parent, "FINISHED")
    return parent


def falling(final: float) -> tuple[list[float], float]:
    return [final + 1.0, final + 0.5, final], final


def test_promote_keeps_the_model_settings_the_target_group_does_not_set(store):
    uri, conf = store
    common = [
        "experiment=tiny",
        f"tracking.experiment={EXPERIMENT}",
        "model.attention=prefix_lm",
        "train.objective=prefix_lm",
        "model.n_heads=2",
    ]
    plan = plan_sweep("attention", ["optim.lr=1e-3,3e-3"], common, steps=4, conf_dir=conf)
    record_sweep(uri, plan, lambda t: falling(2.0 if dict(t.values)["optim.lr"] == "3e-3" else 3.0))
    cfg = promote(uri, plan.name, ["model=125m"], name="attention-big", conf_dir=conf).cfg
    # conf/model/125m.yaml sets the shape (and n_heads): those are the big run's; it says
    # nothing of the attention mask, which stays the trial's.
    assert (cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads) == (768, 12, 12)
    assert cfg.model.attention == "prefix_lm" and cfg.train.objective == "prefix_lm"
    assert cfg.optim.lr == 3e-3


def test_a_sweep_with_a_token_budget_promotes_with_each_trials_own_steps(store):
    uri, conf = store
    budget = 16 * 128 * 10
    plan = plan_sweep(
        "budget",
        ["train.global_batch_size=8,16"],
        ["experiment=tiny", f"tracking.experiment={EXPERIMENT}"],
        budget_tokens=budget,
        conf_dir=conf,
    )
    record_sweep(uri, plan, lambda t: falling(2.0 if t.cfg.train.global_batch_size == 8 else 3.0))
    promotion = promote(uri, plan.name, ["model=125m"], name="budget-big", conf_dir=conf)
    best = next(t for t in plan.trials if t.cfg.train.global_batch_size == 8)
    assert promotion.provenance["wildtrain.promoted_from.trial_hash"] == best.hash
    assert (promotion.cfg.train.global_batch_size, promotion.cfg.train.steps) == (8, 20)
    # The same sweep again with another budget is another sweep: refused, not mixed in.
    other = plan_sweep(
        "budget",
        ["train.global_batch_size=8,16"],
        ["experiment=tiny", f"tracking.experiment={EXPERIMENT}"],
        budget_tokens=2 * budget,
        conf_dir=conf,
    )
    client = MlflowClient(uri)
    with pytest.raises(SweepError, match="already exists with other trials"):
        open_parent(Client(uri), client.get_experiment_by_name(EXPERIMENT).experiment_id, other)


def test_credentials_in_a_sweeps_overrides_reach_no_mlflow_record(store):
    uri, conf = store
    secret = "tracking.uri=http://user:s3cret@mlflow.example:5000"
    plan = plan_sweep(
        "credentials",
        ["optim.lr=1e-3,3e-3"],
        ["experiment=tiny", f"tracking.experiment={EXPERIMENT}", secret],
        steps=4,
        conf_dir=conf,
    )
    parent = record_sweep(uri, plan, lambda t: falling(2.0 if dict(t.values)["optim.lr"] == "3e-3" else 3.0))
    params = MlflowClient(uri).get_run(parent).data.params
    assert "s3cret" not in json.dumps(params)
    assert "tracking.uri=http://***@mlflow.example:5000" in json.loads(params["sweep.overrides"])
    # The trial is rebuilt from what was recorded; the credentials it lost must be given again.
    with pytest.raises(PromoteError, match=r"tracking\.uri: .*without its credentials"):
        promote(uri, plan.name, ["model=125m"], name="credentials-big", conf_dir=conf)
    cfg = promote(uri, plan.name, ["model=125m"], [secret], name="credentials-big", conf_dir=conf).cfg
    assert cfg.tracking.uri == "http://user:s3cret@mlflow.example:5000" and cfg.optim.lr == 3e-3


# The loss the sweep's trials reach at the best learning rate (Chinchilla's law, Hoffmann
# et al. 2022); worse learning rates add more the wider the model, as a fixed rate does.
TRUE = Law(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)
PENALTY = {"1e-3": 0.0, "3e-2": 1.0, "1e-1": 2.0}
WIDTHS = {"64": 1, "128": 2, "256": 3}


def size(trial) -> tuple[int, int]:
    cfg = trial.cfg
    return param_count(cfg.model), cfg.train.steps * cfg.train.global_batch_size * cfg.data.seq_len


def final(trial) -> float:
    values = dict(trial.values)
    return TRUE.predict(*size(trial)) + PENALTY[values["optim.lr"]] * WIDTHS[values["model.dim"]]


def test_fit_goes_through_the_best_trial_of_each_size_at_its_final_loss(store):
    uri, conf = store

    def curve(trial):
        # No validation set: each falls steeply to its final training loss, reached in the
        # last tenth of its logged steps, where a moving average of it still lags behind.
        return [final(trial) + 2.0 * (9 - i) for i in range(9)] + [final(trial)], None

    grid = ["model.dim=64,128,256", "train.steps=10,20,40", "optim.lr=1e-3,3e-2,1e-1"]
    plan = plan_sweep("fit", grid, ["experiment=tiny", f"tracking.experiment={EXPERIMENT}"], conf_dir=conf)
    record_sweep(uri, plan, curve)
    prediction = predict_promoted(uri, plan.name, ["model=125m"], ["train.steps=100"], conf_dir=conf)
    for trial in (t for t in plan.trials if dict(t.values)["optim.lr"] == "1e-3"):
        assert prediction.fitted.law.predict(*size(trial)) == pytest.approx(final(trial), rel=0.01), trial.label()
    target = load_config(["experiment=tiny", "model=125m", "train.steps=100"], conf)
    assert (prediction.params, prediction.tokens) == (param_count(target.model), 100 * 16 * 128)
