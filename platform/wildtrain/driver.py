"""One training run, from a validated config to Ray Train's `fit()`.

Everything that can be checked without workers is checked before Ray starts any: the
data exists and fits the model, the MLflow server answers, the cluster can hold the
smallest allowed worker group on the device chosen for it (its GPUs, where it offers any).
A run is identified by its name: resubmitting a name reopens its MLflow run and continues
from its newest checkpoint, unless another driver trains it now (its lease, `wildtrain.lease`).
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass, replace
from typing import Optional

import ray
from ray.train import LoggingConfig, RunConfig

from wildtrain import lease, ray_compat, services, storage
from wildtrain.checkpoint.restore import newest_committed
from wildtrain.config import Config, config_hash, flatten, redact, to_yaml
from wildtrain.data.dataset import DataError, OpenedData, open_datasets
from wildtrain.data.pins import OrderPins, order_changes, order_pins
from wildtrain.elastic import scaling
from wildtrain.elastic.controller import StorageSettings, controller_callbacks
from wildtrain.elastic.missed_commits import MissedCommits
from wildtrain.elastic.survivors import import_rendezvous_ahead, start_rendezvous, survivor_callbacks
from wildtrain.events import DataOrderChanged, ShardSkipped, Started, Stopped, StragglerCheckOff
from wildtrain.layout import RunLayout, checkpoint_stores, run_record
from wildtrain.tracking.controller.mlflow_run import FLUSH_TIMEOUT_S, MlflowRecorder, Tracker, log_event
from wildtrain.tracking.mlflow_client import Client, check_reachable, run_url
from wildtrain.tracking.reports import runs as report
from wildtrain.tracking.run_setup import open_run
from wildtrain.tracking.worker.stragglers import cannot_observe
from wildtrain.train import hooks
from wildtrain.train.entry import joiner_main, worker_main
from wildtrain.worker_inputs import LoopInputs

NO_VALIDATION_TAG = "wildtrain.no_validation"  # on a run whose data holds no validation rows: the line it said


class RunFailed(RuntimeError):
    pass


@dataclass
class RunSummary:
    run_id: str
    mlflow_url: str
    dashboard_url: Optional[str]
    checkpoint: Optional[str]
    final_metrics: dict


def run(cfg: Config, tags: Optional[dict[str, str]] = None, step_hook: Optional[str] = None) -> RunSummary:
    """Train `cfg` to its last step; `tags` go on the MLflow run when it is created; every
    worker calls `step_hook` (train/hooks.py; by default $WILDTRAIN_STEP_HOOK) after each
    step. Refused (`lease.LeaseError`) before anything starts while another driver holds the
    run's lease."""
    started_at = time.time()
    import_rendezvous_ahead(cfg)
    hook_env = hooks.worker_env(step_hook)
    with lease.Keeper(cfg.run, cfg.cluster.name, cfg.storage, RunLayout.of(cfg.run, cfg.checkpoint).lease) as keeper:
        return _run(cfg, tags, started_at, keeper, hook_env)


def _run(
    cfg: Config, tags: Optional[dict[str, str]], started_at: float, keeper: lease.Keeper, hook_env: dict[str, str]
) -> RunSummary:
    # The storage settings everything below checks the run's data and record with: every
    # process of the run gets them, whatever its node's environment holds.
    storage_env, storage_view = storage.handover_env(cfg.storage), storage.StorageView.here(cfg.storage)
    data = open_data(cfg)
    evaluation = _plan_evaluation(cfg)
    layout = RunLayout.of(cfg.run, cfg.checkpoint)
    record = json.loads(storage.read_text(layout.record, cfg.storage) or "{}")
    pins = order_pins(cfg.data, cfg.train, data)
    order_changed = _check_order(cfg, record, pins)
    check_reachable(cfg.tracking.uri)
    finished = _finished_before(cfg, record.get("mlflow_run_id"))
    if finished is not None:
        return finished
    dashboard_url = services.connect_ray(cfg.cluster.ray_address)
    cfg = resolve_device(cfg)
    scaling.wait_for_capacity(cfg.cluster, cfg.elastic, cfg.data, cfg.eval)
    cfg = resolve_placement(cfg)

    keeper.acquire()  # the first write: nothing is written before the checks above pass
    experiment_id, run_id = open_run(
        cfg.tracking,
        cfg.run,
        cfg.cluster.name,
        record.get("mlflow_run_id"),
        tags,
        params=flatten(cfg),
        config_yaml=to_yaml(cfg),
    )
    storage.write_text(
        layout.record,
        json.dumps(
            {
                "mlflow_run_id": run_id,
                "config_hash": config_hash(cfg),
                "data_order": pins.to_dict(),
                **run_record(cfg.model, data.tokenizer),
            }
        ),
        cfg.storage,
    )
    tracking = Client(cfg.tracking.uri)
    log_event(tracking, run_id, Started(started_at), step=0)
    tracking.log_datasets(
        run_id, [(uri, sha256, bad) for (uri, _, sha256), bad in zip(pins.datasets, data.bad_records)]
    )
    if data.no_validation:
        print(data.no_validation, flush=True)
        tracking.set_tag(run_id, NO_VALIDATION_TAG, data.no_validation)
    if order_changed:
        log_event(tracking, run_id, DataOrderChanged(time.time(), order_changed, "; ".join(order_changed)), step=0)
    for skipped in data.skipped_shards:
        print(f"skipping shard {skipped}", flush=True)
        log_event(tracking, run_id, ShardSkipped(time.time(), skipped), step=0)
    no_straggler_check = cannot_observe(cfg.deepspeed.zero_stage)
    if no_straggler_check:  # said once per submission, where a check that never flags would say nothing
        print(no_straggler_check, flush=True)
        log_event(tracking, run_id, StragglerCheckOff(time.time(), no_straggler_check), step=0)
    mlflow_url = run_url(cfg.tracking.uri, experiment_id, run_id)
    print(f"MLflow run:     {redact(mlflow_url)}", flush=True)
    if dashboard_url:
        print(f"Ray dashboard:  {services.dashboard_text(dashboard_url, services.uses_token_auth())}", flush=True)

    scaling.controller_env(cfg.elastic)
    run_fs, run_path = storage.filesystem(storage.resolve(cfg.run.storage), cfg.storage)
    mlflow = MlflowRecorder(cfg.tracking.uri, run_id, layout.hangs, cfg.storage, layout.tracking)
    rendezvous = start_rendezvous(cfg)
    ray_compat.keep_ray_data_stats_here()  # not on a worker's node, which may die
    worker_env = {**scaling.worker_env(cfg.cluster, cfg.elastic), **storage_env, **hook_env}
    inputs = LoopInputs(
        cfg,
        data,
        scaling.worker_resources(cfg.cluster),
        storage_view,
        rendezvous=(rendezvous.host, rendezvous.port) if rendezvous else None,
    )
    trainer = ray_compat.TrainerWithoutDatasets(
        # Typed inputs rather than Ray's `train_loop_config` dict.
        functools.partial(worker_main, inputs),
        scaling_config=scaling.scaling_config(cfg.cluster, cfg.elastic),
        backend_config=ray_compat.ProcessGroupConfig(
            backend=scaling.backend(cfg.cluster), timeout_s=int(cfg.elastic.collective_timeout_s)
        ),
        run_config=RunConfig(
            name=cfg.run.name,
            # An explicit filesystem: Ray's own would not know the object store's endpoint.
            storage_path=run_path,
            storage_filesystem=run_fs,
            failure_config=scaling.failure_config(),
            # Ray hands the list to the controller as one argument: the elastic callbacks'
            # events go through the same MLflow recorder, not a copy of it.
            # Survivors are kept (or not) before any other callback sees a poll's errors, and
            # commits a lost rank 0 did not report are noticed before any callback acts on notices.
            callbacks=[
                StorageSettings(storage_env),
                *survivor_callbacks(cfg, rendezvous, inputs, worker_env, joiner_main),
                MissedCommits(layout, cfg.storage),
                *controller_callbacks(cfg, mlflow, evaluation),
            ],
            # The Ray Data tasks a worker starts inherit its runtime env, not its process's.
            worker_runtime_env={"env_vars": worker_env},
            # Ray Train's per-report INFO lines would drown the progress lines.
            logging_config=LoggingConfig(log_level="WARNING"),
        ),
        bundle_per_node=scaling.node_bundled(cfg.cluster),
    )
    try:
        trainer.fit()
    except KeyboardInterrupt:
        _finish(cfg, run_id, "KILLED")  # Ctrl-C: the MLflow run says so rather than RUNNING
        raise
    except Exception as e:
        _finish(cfg, run_id, "FAILED")
        raise RunFailed(
            f"run {cfg.run.name!r} failed: {e}\nIts checkpoints are kept in {layout.checkpoint_uris[0]}; "
            f"run the same command again to resume."
        ) from e
    finally:
        if rendezvous is not None:
            rendezvous.stop()
    _finish(cfg, run_id, "FINISHED")
    return RunSummary(
        run_id=run_id,
        mlflow_url=mlflow_url,
        dashboard_url=dashboard_url,
        checkpoint=_newest_checkpoint(cfg),
        # The newest value of each metric: Ray Train's result only knows checkpointed reports.
        final_metrics=tracking.get_run(run_id).data.metrics,
    )


def open_data(cfg: Config) -> OpenedData:
    """The run's datasets, checked against what its model, objective, global batch and early
    stopping ask of them (`open_datasets`)."""
    return open_datasets(
        cfg.data,
        cfg.storage,
        model=cfg.model,
        train=cfg.train,
        objective=cfg.objective,
        needs_validation=cfg.early_stop.watches_validation,
    )


def _plan_evaluation(cfg: Config):
    """The evaluations beside training (eval.tasks), their tasks checked before Ray starts."""
    if not cfg.eval.tasks:
        return None
    from wildtrain.evals.remote import plan_evaluation

    return plan_evaluation(cfg.eval, cfg.eval.tasks)


def _check_order(cfg: Config, record: dict, pins: OrderPins) -> list[str]:
    """What changed in the data order since the run record pinned it; refused (before Ray
    starts) unless data.allow_order_change."""
    changes = order_changes(OrderPins.from_dict(record["data_order"]) if "data_order" in record else None, pins)
    if changes and not cfg.data.allow_order_change:
        raise DataError(
            f"run {cfg.run.name!r} was started with another data order, and resuming it would train on "
            "other rows than the ones its checkpoints assume: "
            + "; ".join(changes)
            + ". Submit it with the original values, give it a new run.name, or set "
            "data.allow_order_change=true to continue in the new order from the restored step"
        )
    return changes


def _finished_before(cfg: Config, run_id: Optional[str]) -> Optional[RunSummary]:
    """The summary of a run that an earlier submission trained to `train.steps` and ended
    FINISHED, else None. Such a resubmission (`make demo` run again) has nothing to train:
    starting the worker group to find that out took most of a run's start-up, and put that
    start and the time since the run ended into the run's goodput (docs/benchmarks.md)."""
    if run_id is None:
        return None
    newest = newest_committed(checkpoint_stores(RunLayout.of(cfg.run, cfg.checkpoint), cfg.storage))
    if newest is None or newest.step is None or newest.step < cfg.train.steps:
        return None
    run = Client(cfg.tracking.uri).run_or_none(run_id)
    if run is None or run.info.status != "FINISHED":  # e.g. a driver that died after the last save
        return None
    print(
        f"run {cfg.run.name!r} was trained to step {newest.step} by an earlier submission "
        f"(train.steps={cfg.train.steps}): nothing to train. Raise train.steps to train on, or give another "
        "run.name.",
        flush=True,
    )
    return RunSummary(
        run_id=run_id,
        mlflow_url=run_url(cfg.tracking.uri, run.info.experiment_id, run_id),
        dashboard_url=None,
        checkpoint=storage.join(newest.store, newest.name),
        final_metrics=run.data.metrics,
    )


def _newest_checkpoint(cfg: Config) -> Optional[str]:
    """The committed checkpoint a resubmission would try first."""
    newest = newest_committed(checkpoint_stores(RunLayout.of(cfg.run, cfg.checkpoint), cfg.storage))
    return storage.join(newest.store, newest.name) if newest else None


def _finish(cfg: Config, run_id: str, status: str) -> None:
    """Close the MLflow run and attach where its compute went (goodput, plot); a report that
    fails is a warning, never the run's failure. A server that is down by now holds the
    end up for a bounded time: what it did not take waits in a local file (printed)."""
    tracking = Tracker(cfg.tracking.uri, run_id, RunLayout.of(cfg.run, cfg.checkpoint).tracking)
    tracking.event(Stopped(time.time(), status), step=0)
    tracking.terminated(status)
    if tracking.close(FLUSH_TIMEOUT_S) is not None:
        print("warning: no run report: MLflow is unreachable", flush=True)
        return
    try:
        result = report.report_run(cfg.tracking.uri, run_id)
        print(report.goodput_text(result), flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"warning: the run report failed: {e}", flush=True)


def resolve_device(cfg: Config) -> Config:
    """`cfg` with `cluster.use_gpu` decided against the cluster this process joined
    (`resources.choose_device`); where that leaves its GPUs idle, says so in one line."""
    cluster, choice = scaling.resolve_device(cfg.cluster, ray.cluster_resources())
    if choice.note:
        print(choice.note, flush=True)
    return replace(cfg, cluster=cluster)


def resolve_placement(cfg: Config) -> Config:
    """`cfg` with `cluster.placement_strategy` decided against the nodes of the cluster this
    process joined (`scaling.choose_placement`); says so where auto spreads the workers."""
    resolved = replace(
        cfg, cluster=scaling.resolve_placement(cfg.cluster, cfg.elastic, list(ray_compat.alive_node_totals().values()))
    )
    said = AUTO_PLACEMENT.get(resolved.cluster.placement_strategy)
    if cfg.cluster.placement_strategy == "auto" and said:
        print(f"cluster.placement_strategy=auto: {said}", flush=True)
    return resolved


# What auto chose and why, where it is not Ray's default.
AUTO_PLACEMENT = {
    "STRICT_SPREAD": "STRICT_SPREAD (no node holds two workers)",
    "NODE_BUNDLES": "NODE_BUNDLES (each node's workers in a bundle of their own, for elastic.in_process)",
}
