"""`wildtrain move RUN --from A --to B`: the same run (its lineage of checkpoints, its MLflow
run) continues on another cluster.

0. A run that is live (its lease, `wildtrain.lease`) other than as that job is refused before
   anything stops or moves: a `wildtrain train` on A's head, a RayJob, a sweep's trial; so is a
   run live on B.
1. The run's job on A, if one still runs, is stopped once its next checkpoint has committed
   (a job stop loses the steps since the newest commit, so right after one it loses least),
   and its lease released: its driver may have been killed before it could.
2. `<A's runs>/<RUN>/` (committed checkpoints, the run record with its MLflow run id) is
   synced to B's runs store: manifests and record last, every byte verified (`sync`).
3. The MLflow run gets a `moved` event; the run is submitted on B with the same name, so the
   driver there finds the record (same MLflow run) and the workers the newest checkpoint.

The data is not moved: B reads its own store's copy (`wildtrain sync A:data/X B:data/X`,
and `data.datasets` among the overrides); the record's data order pins refuse a copy that
differs.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from wildtrain import lease, storage
from wildtrain.checkpoint.restore import newest_committed
from wildtrain.checkpoint.store import Store
from wildtrain.clusters import jobs_api
from wildtrain.clusters.registry import Cluster
from wildtrain.clusters.submit import Submitted, submit
from wildtrain.clusters.sync import Location, SyncResult, sync
from wildtrain.config import ConfigError, load_config
from wildtrain.events import Moved
from wildtrain.layout import RunLayout, checkpoint_stores

ACTIVE = ("PENDING", "RUNNING")


@dataclass(frozen=True)
class MoveResult:
    stopped_job: Optional[str]
    step: Optional[int]  # the newest committed checkpoint that moved
    synced: SyncResult
    submitted: Submitted


def running_job(cluster: Cluster, run: str) -> Optional[str]:
    """The submission id of the run's job on `cluster` that has not ended, if any."""
    own = re.compile(rf"wildtrain-{re.escape(run)}-[0-9a-f]{{8}}")
    for job in jobs_api.client(cluster).list_jobs():
        if job.submission_id and own.fullmatch(job.submission_id) and str(job.status.value) in ACTIVE:
            return job.submission_id
    return None


def newest_step(stores: list[Store]) -> Optional[int]:
    candidate = newest_committed(stores)
    return candidate.step if candidate else None


def stop_after_next_commit(
    cluster: Cluster,
    job_id: str,
    run: str,
    stores: list[Store],
    timeout_s: float,
    poll_s: float,
    say: Callable[[str], None],
) -> Optional[int]:
    """Wait for a checkpoint of `run` newer than the newest in `stores` now, then stop the job
    and wait for its end."""
    before = newest_step(stores)
    say(f"waiting for the next checkpoint of {run} on {cluster.name} (newest now: step {before})")
    client = jobs_api.client(cluster)
    deadline = time.monotonic() + timeout_s
    while (newest := newest_step(stores)) == before:
        if str(client.get_job_status(job_id).value) not in ACTIVE:
            break  # it ended by itself: nothing newer will come
        if time.monotonic() > deadline:
            raise jobs_api.ClusterError(
                f"{cluster.name}: no checkpoint of {run} committed within "
                f"{timeout_s:g} s after step {before}; the job {job_id} still runs"
            )
        time.sleep(poll_s)
    client.stop_job(job_id)
    while str(client.get_job_status(job_id).value) in ACTIVE:
        time.sleep(poll_s)
    say(f"stopped {job_id} on {cluster.name} after step {newest}")
    return newest


def move(
    run: str,
    src: Cluster,
    dst: Cluster,
    overrides: list[str],
    *,
    working_dir: Optional[Path] = None,
    bwlimit: Optional[str] = None,
    checkpoint_timeout_s: float = 3600.0,
    poll_s: float = 5.0,
    say: Callable[[str], None] = lambda line: None,
) -> MoveResult:
    named = [*overrides, f"run.name={run}"]
    # Both configs load before anything stops: a bad override fails here, naming its key.
    src_cfg, dst_cfg = (load_config(c.run_overrides() + named) for c in (src, dst))
    src_layout, dst_layout = (
        RunLayout.of(src_cfg.run, src_cfg.checkpoint),
        RunLayout.of(dst_cfg.run, dst_cfg.checkpoint),
    )
    if src_cfg.checkpoint.store or src_cfg.checkpoint.replica:
        raise ConfigError(
            "checkpoint.store/checkpoint.replica: move copies <run.storage>/<run.name>/ only; "
            "sync a checkpoint store outside it with `wildtrain sync` first"
        )
    record = storage.read_text(src_layout.record, src_cfg.storage)
    if record is None:
        raise jobs_api.ClusterError(f"{src.name}: no run {run!r} at {src_layout.root} (no {src_layout.record})")
    held = lease.read(src_layout.lease, src_cfg.storage)
    verdict = lease.decide(run, held, time.time())
    # A live lease may only be that of the job step 1 stops; one no job holds refuses at once.
    job = running_job(src, run) if verdict.free or held.holder.job else None
    if not verdict.free and (job is None or held.holder.job != job):
        raise lease.LeaseError(f"{src.name}: {verdict.why}")
    on_dst = lease.check(run, dst_layout.lease, dst_cfg.storage)
    if not on_dst.free:
        raise lease.LeaseError(f"{dst.name}: {on_dst.why}")
    src_stores = checkpoint_stores(src_layout, src_cfg.storage)
    step = (
        stop_after_next_commit(src, job, run, src_stores, checkpoint_timeout_s, poll_s, say)
        if job
        else newest_step(src_stores)
    )
    if job and (stopped := lease.read(src_layout.lease, src_cfg.storage)) and stopped.holder.job == job:
        # Its driver ended with the job, killed perhaps before it could release the lease.
        lease.release_for(src_layout.lease, src_cfg.storage, stopped.holder)
    say(f"copying {src_layout.root} to {dst_layout.root}")
    synced = sync(
        Location(src_layout.root, src.entry.storage, src.entry.sync_bwlimit),
        Location(dst_layout.root, dst.entry.storage, dst.entry.sync_bwlimit),
        bwlimit,
        on_copied=lambda path: say(f"copied {path}"),
    )
    _record_move(
        src_cfg.tracking.uri,
        json.loads(record)["mlflow_run_id"],
        Moved(time.time(), src.name, dst.name, step, synced.copied_bytes),
        step or 0,
    )
    submitted = submit(dst, named, working_dir)
    return MoveResult(job, step, synced, submitted)


def _record_move(tracking_uri: str, run_id: str, event: Moved, step: int) -> None:
    from wildtrain.tracking.controller.mlflow_run import log_event
    from wildtrain.tracking.mlflow_client import Client

    log_event(Client(tracking_uri), run_id, event, step)
