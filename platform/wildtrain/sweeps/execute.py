"""Running a sweep: one MLflow parent run, then each trial as a normal run (`wildtrain
train` in a process of its own: its own elastic worker group, checkpoints, exactly-once data
and MLflow run, tagged as the parent's child), as many at once as the cluster holds at
their full size. The rest queue: a trial never waits for workers another one holds, and
one that ends (finished, failed or stopped early) makes room for the next.

A process per trial, not a thread: the driver sets Ray Train's settings in its process's
environment (and a swept key may change them), a trial that fails takes only its process
down, and Ctrl-C reaches every trial, each closing its own MLflow run.

Resumable by construction: a trial's run name is its config hash, so running the same
sweep again finds each trial's MLflow run and checkpoints by name. A finished trial (or one
stopped early) is skipped; an unfinished one resumes from its newest checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Mapping, Optional, Sequence

from wildtrain.config import Config, redact
from wildtrain.data.dataset import open_datasets
from wildtrain.sweeps.compare import TrialRecord
from wildtrain.sweeps.grid import SweepPlan, Trial
from wildtrain.tracking.mlflow_client import Client, check_reachable

SWEEP_TAG = "wildtrain.sweep"  # the sweep's name, on its parent and its trials
ROLE_TAG = "wildtrain.sweep.role"  # "parent" or "trial"
TRIAL_TAG = "wildtrain.trial"  # a trial's hash
VALUE_TAG = "sweep."  # + swept key: the trial's value, on the trial's run
GRID_PARAM = "sweep.grid"  # on the parent: {key: [values]}, JSON
OVERRIDES_PARAM = "sweep.overrides"  # on the parent: the overrides common to every trial, JSON
# + a trial's hash, on the parent: all its arguments (its `wildtrain train` overrides, which
# --budget-tokens gives their own train.steps), JSON; what `promote` rebuilds it from.
ARGS_PARAM = "sweep.args."
# A trial told to stop (the sweep was interrupted) has this long to close its run.
STOP_GRACE_S = 60.0


class SweepError(RuntimeError):
    pass


@dataclass(frozen=True)
class SweepOutcome:
    parent_run_id: str
    ran: tuple[str, ...]  # trials trained (or resumed) by this call
    skipped: tuple[str, ...]  # trials already finished before it
    failed: tuple[str, ...]  # "name: why"


def trial_need(cfg: Config) -> dict[str, float]:
    """What a trial holds at its full size: `max_workers` workers and its data reads."""
    from wildtrain.elastic.scaling import data_cpus, worker_resources

    need = {name: amount * cfg.elastic.max_workers for name, amount in worker_resources(cfg.cluster).items()}
    need["CPU"] = need.get("CPU", 0.0) + data_cpus(cfg.data)
    return need


def trial_slots(total: Mapping[str, float], needs: Sequence[Mapping[str, float]]) -> int:
    """How many trials run at once: as many of the largest (per resource) as `total` holds,
    at least one (a trial larger than the cluster then waits for capacity as any run does)."""
    largest: dict[str, float] = {}
    for need in needs:
        for name, amount in need.items():
            largest[name] = max(largest.get(name, 0.0), amount)
    fits = [int(total.get(name, 0.0) // amount) for name, amount in largest.items() if amount > 0]
    return max(1, min(fits, default=1))


def run_sweep(plan: SweepPlan, say: Callable[[str], None] = print, parallel: Optional[int] = None) -> SweepOutcome:
    """Run the trials not finished yet, `parallel` at once (default: `trial_slots` of the
    cluster); each trial's output goes to `say`, prefixed with its name."""
    tracking = plan.trials[0].cfg.tracking
    check_reachable(tracking.uri)
    # What every trial needs, checked once: a sweep on data that is not there fails here, in
    # one line, rather than once per trial.
    for cfg in {json.dumps([d.uri for d in t.cfg.data.datasets]): t.cfg for t in plan.trials}.values():
        open_datasets(
            cfg.data,
            cfg.storage,
            model=cfg.model,
            train=cfg.train,
            objective=cfg.objective,
            needs_validation=cfg.early_stop.watches_validation,
        )
    client = Client(tracking.uri)
    experiment_id = client.experiment_id(tracking.experiment)
    parent = open_parent(client, experiment_id, plan)
    done = {
        run.data.tags[TRIAL_TAG]
        for run in trial_runs(client, [experiment_id], plan.name)
        if run.info.status == "FINISHED"
    }
    todo = [t for t in plan.trials if t.hash not in done]
    skipped = tuple(t.run_name for t in plan.trials if t.hash in done)
    if not todo:
        say(f"sweep {plan.name}: all {len(plan.trials)} trials finished; nothing to run")
        return SweepOutcome(parent, (), skipped, ())
    if parallel is None:
        import ray

        from wildtrain.elastic.scaling import resolve_device
        from wildtrain.services import connect_ray

        connect_ray(todo[0].cfg.cluster.ray_address)
        total = ray.cluster_resources()
        # Each trial as its own driver will size it: on the GPUs, where the cluster offers them.
        parallel = trial_slots(
            total, [trial_need(replace(t.cfg, cluster=resolve_device(t.cfg.cluster, total)[0])) for t in todo]
        )
    say(f"sweep {plan.name}: {len(todo)} trials to run, {parallel} at a time")
    client.set_running(parent)
    try:
        ran, failed = _run_trials(todo, parallel, lambda t: trial_tags(parent, plan.name, t), plan.name, say)
    except BaseException as e:
        # The parent must not read RUNNING in the MLflow UI for ever after.
        with contextlib.suppress(Exception):  # MLflow itself may be what failed
            client.end_run(parent, "KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
        raise
    client.end_run(parent, "FAILED" if failed else "FINISHED")
    return SweepOutcome(parent, tuple(ran), skipped, tuple(failed))


@dataclass
class _Running:
    trial: Trial
    process: subprocess.Popen
    last_line: str = ""


def _run_trials(
    trials: Sequence[Trial],
    parallel: int,
    tags: Callable[[Trial], dict[str, str]],
    sweep: str,
    say: Callable[[str], None],
) -> tuple[list[str], list[str]]:
    """Each trial in a `wildtrain train` process, at most `parallel` at once; (ran, failed)."""
    waiting = list(trials)
    running: list[_Running] = []
    ended: queue.Queue[_Running] = queue.Queue()
    ran, failed = [], []
    try:
        while waiting or running:
            while waiting and len(running) < parallel:
                trial = waiting.pop(0)
                number = len(trials) - len(waiting)
                say(f"sweep {sweep}: trial {number}/{len(trials)} {trial.run_name} ({trial.label()})")
                running.append(_start(trial, tags(trial), say, ended))
            finished = ended.get()
            running.remove(finished)
            if finished.process.returncode == 0:
                ran.append(finished.trial.run_name)
            else:  # the next trial may still run; the sweep ends failed
                failed.append(
                    f"{finished.trial.run_name}: {finished.last_line or f'exit {finished.process.returncode}'}"
                )
                say(f"sweep {sweep}: trial {finished.trial.run_name} failed; going on with the next")
    except KeyboardInterrupt:
        _stop(running, interrupt=False)  # Ctrl-C reached the trials too
        raise
    except BaseException:
        _stop(running, interrupt=True)
        raise
    return ran, failed


def _start(trial: Trial, tags: dict[str, str], say: Callable[[str], None], ended: queue.Queue) -> _Running:
    process = subprocess.Popen(
        [sys.executable, "-m", "wildtrain", "train", *trial.args, f"run.tags={json.dumps(tags)}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    running = _Running(trial, process)

    def relay() -> None:
        for line in process.stdout:
            line = line.rstrip("\n")
            if line.strip():
                running.last_line = line
            say(f"[{trial.run_name}] {line}")
        process.wait()
        ended.put(running)

    threading.Thread(target=relay, name=f"trial-{trial.run_name}", daemon=True).start()
    return running


def _stop(running: Sequence[_Running], interrupt: bool) -> None:
    """Let the trials still running end as Ctrl-C ends them (`interrupt`: send them one), so
    each closes its MLflow run; kill those that have not ended after `STOP_GRACE_S`."""
    for r in running if interrupt else ():
        with contextlib.suppress(ProcessLookupError):
            r.process.send_signal(signal.SIGINT)
    for r in running:
        try:
            r.process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            r.process.kill()
            r.process.wait()


def trial_runs(client: Client, experiment_ids: list[str], sweep: str) -> list:
    return list(_search(client, experiment_ids, sweep, "trial"))


def find_parent(client: Client, sweep: str):
    """The sweep's parent run, or None."""
    return next(_search(client, None, sweep, "parent"), None)


def _search(client: Client, experiment_ids: Optional[list[str]], sweep: str, role: str) -> Iterator:
    return client.search_runs(experiment_ids, f"tags.`{SWEEP_TAG}` = '{sweep}' and tags.`{ROLE_TAG}` = '{role}'")


def open_parent(client: Client, experiment_id: str, plan: SweepPlan) -> str:
    """The sweep's parent run: created with its grid, common overrides and each trial's
    arguments, or found. A sweep of that name with another grid, other overrides or other
    trials (another --budget-tokens) is refused: its trials would not compare with these.
    Credentials in them are redacted as in every run's params: the trials run with them,
    MLflow's readers do not see them."""
    grid = redact(json.dumps({key: list(dict.fromkeys(dict(t.values)[key] for t in plan.trials)) for key in plan.keys}))
    overrides = redact(json.dumps(list(plan.overrides)))
    args = {ARGS_PARAM + t.hash: redact(json.dumps(list(t.args))) for t in plan.trials}
    existing = next(_search(client, [experiment_id], plan.name, "parent"), None)
    if existing is not None:
        params = existing.data.params
        for name, value, option in ((GRID_PARAM, grid, "--grid"), (OVERRIDES_PARAM, overrides, "overrides")):
            if params.get(name) != value:
                raise SweepError(
                    f"sweep {plan.name!r} already exists with other {option} ({params.get(name)}, "
                    f"now {value}); give this one another name"
                )
        recorded = {name: value for name, value in params.items() if name.startswith(ARGS_PARAM)}
        if recorded != args:
            raise SweepError(
                f"sweep {plan.name!r} already exists with other trials (another --budget-tokens, "
                "or recorded before each trial's arguments were); give this one another name"
            )
        return existing.info.run_id
    run_id = client.create_run(experiment_id, plan.name, {SWEEP_TAG: plan.name, ROLE_TAG: "parent"})
    client.log_params(
        run_id, {GRID_PARAM: grid, OVERRIDES_PARAM: overrides, "sweep.trials": str(len(plan.trials)), **args}
    )
    return run_id


def trial_tags(parent_run_id: str, sweep: str, trial: Trial) -> dict[str, str]:
    return {
        "mlflow.parentRunId": parent_run_id,
        SWEEP_TAG: sweep,
        ROLE_TAG: "trial",
        TRIAL_TAG: trial.hash,
        **{VALUE_TAG + key: value for key, value in trial.values},
    }


def swept_values(run) -> tuple[tuple[str, str], ...]:
    """A trial run's (swept key, value), from its tags."""
    return tuple(
        (key[len(VALUE_TAG) :], value) for key, value in sorted(run.data.tags.items()) if key.startswith(VALUE_TAG)
    )


def grid_keys(parent_run) -> list[str]:
    return list(json.loads(parent_run.data.params[GRID_PARAM]))


def common_overrides(parent_run) -> list[str]:
    return json.loads(parent_run.data.params[OVERRIDES_PARAM])


def trial_args(parent_run, trial: TrialRecord) -> list[str]:
    """The arguments that load `trial`'s config, credentials redacted: as the parent
    recorded them or, for a sweep recorded before it did, its common overrides and the
    trial's swept values (which miss a --budget-tokens trial's steps)."""
    recorded = parent_run.data.params.get(ARGS_PARAM + trial.hash)
    if recorded is None:
        return [*common_overrides(parent_run), *(f"{key}={value}" for key, value in trial.values)]
    return json.loads(recorded)
