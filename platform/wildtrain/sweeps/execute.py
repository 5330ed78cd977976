"""Running a sweep: one MLflow parent run, then each trial as a normal run (`driver.run`:
its own elastic worker group, checkpoints, exactly-once data and MLflow run) tagged as
the parent's child. Trials run one after another, so a trial has the whole cluster to
itself and grows and shrinks with it, and the next one queues rather than competing with
it for workers.

Resumable by construction: a trial's run name is its config hash, so running the same
sweep again finds each trial's MLflow run and checkpoints by name. A finished trial (or one
stopped early) is skipped; an unfinished one resumes from its newest checkpoint.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Callable

from wildtrain.sweeps.grid import SweepPlan, Trial

SWEEP_TAG = "wildtrain.sweep"  # the sweep's name, on its parent and its trials
ROLE_TAG = "wildtrain.sweep.role"  # "parent" or "trial"
TRIAL_TAG = "wildtrain.trial"  # a trial's hash
VALUE_TAG = "sweep."  # + swept key: the trial's value, on the trial's run
GRID_PARAM = "sweep.grid"  # on the parent: {key: [values]}, JSON
OVERRIDES_PARAM = "sweep.overrides"  # on the parent: the overrides common to every trial, JSON


class SweepError(RuntimeError):
    pass


@dataclass(frozen=True)
class SweepOutcome:
    parent_run_id: str
    ran: tuple[str, ...]  # trials trained (or resumed) by this call
    skipped: tuple[str, ...]  # trials already finished before it
    failed: tuple[str, ...]  # "name: why"


def run_sweep(plan: SweepPlan, say: Callable[[str], None] = print) -> SweepOutcome:
    from mlflow.tracking import MlflowClient

    from wildtrain import driver
    from wildtrain.tracking.mlflow_run import check_reachable

    tracking = plan.trials[0].cfg.tracking
    check_reachable(tracking.uri)
    client = MlflowClient(tracking.uri)
    experiment = client.get_experiment_by_name(tracking.experiment)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(tracking.experiment)
    parent = _parent(client, experiment_id, plan)
    done = {run.data.tags[TRIAL_TAG] for run in trial_runs(client, [experiment_id], plan.name)
            if run.info.status == "FINISHED"}
    todo = [t for t in plan.trials if t.hash not in done]
    skipped = tuple(t.run_name for t in plan.trials if t.hash in done)
    if not todo:
        say(f"sweep {plan.name}: all {len(plan.trials)} trials finished; nothing to run")
        return SweepOutcome(parent, (), skipped, ())
    client.update_run(parent, status="RUNNING")
    ran, failed = [], []
    try:
        for i, trial in enumerate(todo, start=1):
            say(f"sweep {plan.name}: trial {i}/{len(todo)} {trial.run_name} ({trial.label()})")
            try:
                driver.run(trial.cfg, tags=_trial_tags(parent, plan.name, trial))
                ran.append(trial.run_name)
            except driver.RunFailed as e:  # the next trial may still run; the sweep ends failed
                failed.append(f"{trial.run_name}: {str(e).splitlines()[0]}")
                say(f"sweep {plan.name}: trial {trial.run_name} failed; going on with the next")
    except BaseException as e:
        # A trial that could not start (its data, MLflow, the cluster's capacity) ends the
        # sweep: the parent must not read RUNNING in the MLflow UI for ever after.
        with contextlib.suppress(Exception):  # MLflow itself may be what failed
            client.set_terminated(parent, status="KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
        raise
    client.set_terminated(parent, status="FAILED" if failed else "FINISHED")
    return SweepOutcome(parent, tuple(ran), skipped, tuple(failed))


def trial_runs(client, experiment_ids: list[str], sweep: str) -> list:
    return _search(client, experiment_ids, sweep, "trial")


def find_parent(client, sweep: str):
    """The sweep's parent run, or None."""
    experiment_ids = [e.experiment_id for e in client.search_experiments()]
    runs = _search(client, experiment_ids, sweep, "parent")
    return runs[0] if runs else None


def _search(client, experiment_ids: list[str], sweep: str, role: str) -> list:
    runs, token = [], None
    while True:
        page = client.search_runs(experiment_ids, f"tags.`{SWEEP_TAG}` = '{sweep}' and tags.`{ROLE_TAG}` = '{role}'",
                                  order_by=["attributes.start_time ASC"], page_token=token)
        runs += list(page)
        token = page.token
        if not token:
            return runs


def _parent(client, experiment_id: str, plan: SweepPlan) -> str:
    """The sweep's parent run: created with its grid and common overrides, or found. A
    sweep of that name with another grid or other overrides is refused: its trials would
    not compare with these."""
    from mlflow.entities import Param

    grid = json.dumps({key: list(dict.fromkeys(dict(t.values)[key] for t in plan.trials)) for key in plan.keys})
    overrides = json.dumps(list(plan.overrides))
    existing = _search(client, [experiment_id], plan.name, "parent")
    if existing:
        params = existing[0].data.params
        for name, value, option in ((GRID_PARAM, grid, "--grid"), (OVERRIDES_PARAM, overrides, "overrides")):
            if params.get(name) != value:
                raise SweepError(f"sweep {plan.name!r} already exists with other {option} ({params.get(name)}, "
                                 f"now {value}); give this one another name")
        return existing[0].info.run_id
    run = client.create_run(experiment_id, run_name=plan.name, tags={SWEEP_TAG: plan.name, ROLE_TAG: "parent"})
    client.log_batch(run.info.run_id, params=[Param(GRID_PARAM, grid), Param(OVERRIDES_PARAM, overrides),
                                              Param("sweep.trials", str(len(plan.trials)))])
    return run.info.run_id


def _trial_tags(parent_run_id: str, sweep: str, trial: Trial) -> dict[str, str]:
    return {"mlflow.parentRunId": parent_run_id, SWEEP_TAG: sweep, ROLE_TAG: "trial", TRIAL_TAG: trial.hash,
            **{VALUE_TAG + key: value for key, value in trial.values}}


def swept_values(run) -> tuple[tuple[str, str], ...]:
    """A trial run's (swept key, value), from its tags."""
    return tuple((key[len(VALUE_TAG):], value) for key, value in sorted(run.data.tags.items()) if key.startswith(VALUE_TAG))


def grid_keys(parent_run) -> list[str]:
    return list(json.loads(parent_run.data.params[GRID_PARAM]))


def common_overrides(parent_run) -> list[str]:
    return json.loads(parent_run.data.params[OVERRIDES_PARAM])
