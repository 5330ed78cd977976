"""`wildtrain submit --cluster NAME`: the same `python -m wildtrain train` a user runs
locally, sent through the cluster's jobs API with its token, with the cluster's settings
(`Cluster.run_overrides`), its NCCL profile and hotfixes in the runtime env, and an explicit
`run.name`, so resubmitting (or moving) continues the same run; refused while the run is
live (its lease: another driver trains it now)."""

from __future__ import annotations

import asyncio
import shlex
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from wildtrain import lease, storage
from wildtrain.clusters import jobs_api
from wildtrain.clusters.registry import Cluster
from wildtrain.config import Config, default_conf_dir, load_config
from wildtrain.layout import RunLayout


@dataclass(frozen=True)
class Command:
    """What a job runs before the config overrides: `wildtrain train`, whose run is named
    explicitly so that a resubmission (or a move) continues it, or `wildtrain sweep NAME
    ...`, whose trials name their runs themselves."""

    args: tuple[str, ...] = ("train",)
    sweep: Optional[str] = None

    @classmethod
    def of_sweep(cls, name: str, *options: str) -> "Command":
        return cls(("sweep", name, *options), sweep=name)

    def named(self, cfg: Config) -> list[str]:
        """The overrides that name what the job runs."""
        return [] if self.sweep else [f"run.name={cfg.run.name}"]

    def what(self, cfg: Config) -> str:
        return f"sweep {self.sweep!r}" if self.sweep else f"run {cfg.run.name!r}"


TRAIN = Command()


@dataclass(frozen=True)
class JobSpec:
    config: Config  # the run's config as the job will resolve it, checked here first
    submission_id: str
    entrypoint: str
    runtime_env: dict[str, Any]


@dataclass(frozen=True)
class Submitted:
    job_id: str
    dashboard: str
    tracking: str


def job_spec(
    cluster: Cluster, overrides: list[str], working_dir: Optional[Path] = None, command: Command = TRAIN
) -> JobSpec:
    """What is sent: the config is loaded here first, so a bad override fails in a second,
    with the key named, instead of in a job on the cluster."""
    run_overrides = cluster.run_overrides() + list(overrides)
    cfg = load_config(run_overrides)
    submission_id = f"wildtrain-{cfg.run.name}-{uuid.uuid4().hex[:8]}"
    entrypoint = shlex.join(["python", "-m", "wildtrain", *command.args, *run_overrides, *command.named(cfg)])
    hotfix = dict(cluster.entry.hotfix.runtime_env)
    runtime_env = {
        **hotfix,
        "working_dir": str(working_dir or default_conf_dir().parent),
        # The job's leases name it, so that `move` knows the lease of the job it stopped.
        "env_vars": {**hotfix.get("env_vars", {}), **cluster.job_env(), lease.JOB_VARIABLE: submission_id},
    }
    return JobSpec(cfg, submission_id, entrypoint, runtime_env)


def refuse_live(cluster: Cluster, cfg: Config) -> None:
    """Raise `lease.LeaseError` while another driver holds the lease of `cfg`'s run. Where the
    cluster's store does not answer from here, the job's driver checks it there instead."""
    try:
        verdict = lease.check(cfg.run.name, RunLayout.of(cfg.run, cfg.checkpoint).lease, cfg.storage)
    except storage.StorageError:
        return
    if not verdict.free:
        raise lease.LeaseError(f"{cluster.name}: {verdict.why}")


def submit(
    cluster: Cluster,
    overrides: list[str],
    working_dir: Optional[Path] = None,
    follow: Optional[Callable[[str], None]] = None,
    command: Command = TRAIN,
) -> Submitted:
    """Send the run (or the sweep, see `job_spec`); with `follow`, pass it the job's log
    lines until the job ends and fail if the job did not succeed."""
    spec = job_spec(cluster, overrides, working_dir, command)
    if not command.sweep:  # a sweep's trials are refused one by one, by their drivers
        refuse_live(cluster, spec.config)
    client = jobs_api.client(cluster)
    job_id = client.submit_job(
        entrypoint=spec.entrypoint, runtime_env=spec.runtime_env, submission_id=spec.submission_id
    )
    submitted = Submitted(
        job_id,
        cluster.entry.jobs_api,
        f"{spec.config.tracking.uri} experiment {spec.config.tracking.experiment!r}, {command.what(spec.config)}",
    )
    if follow is not None:
        follow_job(cluster, client, job_id, follow)
    return submitted


def follow_job(cluster: Cluster, client, job_id: str, emit: Callable[[str], None]) -> None:
    """Pass the job's log lines to `emit` until it ends; fail unless it succeeded."""

    async def tail() -> str:
        async for lines in client.tail_job_logs(job_id):
            emit(lines)
        return str(client.get_job_status(job_id).value)

    status = asyncio.run(tail())
    if status != "SUCCEEDED":
        raise jobs_api.ClusterError(f"{cluster.name}: job {job_id} ended {status}")
