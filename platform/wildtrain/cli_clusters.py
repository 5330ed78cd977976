"""The commands about the clusters of the registry (ray_clusters/clusters.yaml): list and
check them, submit a run to one, copy runs and data between them, move a run across."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from wildtrain.cli_common import OVERRIDES, one_line_errors, resolve_config
from wildtrain.clusters import registry
from wildtrain.config import redact

REGISTRY = click.option(
    "--registry",
    "registry_file",
    type=click.Path(path_type=Path),
    default=None,
    help="The clusters file [default: $WILDTRAIN_CLUSTERS, else ray_clusters/clusters.yaml].",
)


@click.group(invoke_without_command=True)
@REGISTRY
@click.pass_context
@one_line_errors()
def clusters(ctx: click.Context, registry_file: Path | None) -> None:
    """The clusters of the registry: provider, jobs API, accelerators, stores."""
    ctx.obj = registry_file
    if ctx.invoked_subcommand is None:
        for name, cluster in registry.load(registry_file).clusters.items():
            entry = cluster.entry
            accelerators = (
                f"{entry.accelerator.per_node}x {entry.accelerator.type}" if entry.accelerator.per_node else "cpu"
            )
            click.echo(f"{name:<16}{entry.provider:<12}{accelerators:<10}{entry.jobs_api:<28}{entry.storage.runs}")


@clusters.command("check")
@click.argument("name")
@click.option("--tracking-uri", help="The MLflow server [default: tracking.uri of the config].")
@click.pass_obj
@one_line_errors()
def clusters_check(path: Path | None, name: str, tracking_uri: str | None) -> None:
    """Whether a run can go to NAME: token, Ray version, stores, and its report card."""
    from wildtrain.clusters.check import check
    from wildtrain.tracking.mlflow_client import quiet_mlflow

    quiet_mlflow()
    cluster = registry.load(path).get(name)
    findings = check(cluster, tracking_uri or resolve_config(()).tracking.uri)
    for finding in findings:
        click.echo(f"{'ok  ' if finding.ok else 'FAIL'} {finding.what}: {redact(finding.detail)}")
    if not all(f.ok for f in findings):
        sys.exit(1)


@click.command()
@click.option("--cluster", "name", required=True, help="A cluster of the registry.")
@click.option("--follow", is_flag=True, help="Stream the job's logs until it ends.")
@REGISTRY
@OVERRIDES
@one_line_errors()
def submit(name: str, follow: bool, registry_file: Path | None, overrides: tuple[str, ...]) -> None:
    """Run `wildtrain train OVERRIDES` on a cluster of the registry, through its jobs API."""
    submit_to(registry.load(registry_file).get(name), overrides, follow)


def submit_to(cluster: registry.Cluster, overrides: tuple[str, ...], follow: bool, command=None) -> None:
    from wildtrain.clusters.submit import TRAIN
    from wildtrain.clusters.submit import submit as send

    submitted = send(
        cluster,
        list(overrides),
        follow=(lambda text: click.echo(text, nl=False)) if follow else None,
        command=command or TRAIN,
    )
    click.echo(f"job:            {submitted.job_id} on {cluster.name}")
    click.echo(f"MLflow run:     {redact(submitted.tracking)}")
    click.echo(f"Ray dashboard:  {redact(submitted.dashboard)} (sign in with the token in {cluster.token_file})")


@click.command()
@click.argument("src")
@click.argument("dst")
@click.option(
    "--bwlimit",
    help="Bytes/s for the copy, rclone syntax (2M), or off [default: the lower of the clusters' sync_bwlimit].",
)
@REGISTRY
@one_line_errors(OSError)
def sync(src: str, dst: str, bwlimit: str | None, registry_file: Path | None) -> None:
    """Copy SRC to DST verified, manifests and run records last; run it again to resume.
    SRC, DST: s3://, gs://, local paths, or CLUSTER:runs/PATH, CLUSTER:data/PATH."""
    from wildtrain.clusters import sync as copier

    source, target = (copier.parse_location(text, lambda: registry.load(registry_file)) for text in (src, dst))
    done = copier.sync(source, target, bwlimit, on_copied=lambda path: click.echo(f"copied {path}"))
    rate = done.copied_bytes / done.copy_seconds / 2**20 if done.copy_seconds else 0.0
    click.echo(
        f"synced {len(done.copied)} files ({done.copied_bytes / 2**20:.1f} MiB at {rate:.1f} MiB/s), "
        f"{done.verified} verified at {target.uri}"
    )


@click.command()
@click.argument("run")
@click.option("--from", "source", required=True, help="The cluster the run is on.")
@click.option("--to", "target", required=True, help="The cluster it continues on.")
@click.option("--bwlimit", help="Bytes/s for the copy [default: the lower of the clusters' sync_bwlimit].")
@click.option(
    "--checkpoint-timeout",
    default=3600.0,
    show_default=True,
    help="Seconds to wait for the running job's next checkpoint.",
)
@REGISTRY
@OVERRIDES
@one_line_errors(OSError)
def move(
    run: str,
    source: str,
    target: str,
    bwlimit: str | None,
    checkpoint_timeout: float,
    registry_file: Path | None,
    overrides: tuple[str, ...],
) -> None:
    """Continue RUN on another cluster: stop it after its next checkpoint, copy its checkpoints
    and record (verified, manifests last), submit it there with the same name and MLflow run."""
    from wildtrain.clusters.move import move as relocate
    from wildtrain.tracking.mlflow_client import quiet_mlflow

    quiet_mlflow()
    clusters = registry.load(registry_file)
    done = relocate(
        run,
        clusters.get(source),
        clusters.get(target),
        list(overrides),
        bwlimit=bwlimit,
        checkpoint_timeout_s=checkpoint_timeout,
        say=click.echo,
    )
    click.echo(f"moved {run} from {source} to {target} at step {done.step}")
    click.echo(f"job:            {done.submitted.job_id} on {target}")
    click.echo(f"MLflow run:     {redact(done.submitted.tracking)}")
