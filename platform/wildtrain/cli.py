"""The `wildtrain` command. Thin: parse, call the modules, turn known errors into one line."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import click

from wildtrain import services
from wildtrain.clusters import registry
from wildtrain.config import ConfigError, load_config, redact, to_yaml

OVERRIDES = click.argument("overrides", nargs=-1)


def _fail(message: str, code: int) -> None:
    # Errors quote addresses from the config, which may carry a user:password.
    click.secho(f"wildtrain: {redact(message)}", fg="red", err=True)
    sys.exit(code)


def _config(overrides: tuple[str, ...]):
    try:
        # `cluster=NAME` of the registry brings that cluster's settings.
        return load_config(registry.expand(list(overrides)))
    except ConfigError as e:
        _fail(str(e), 2)


@click.group()
def main() -> None:
    """Elastic LLM training on Ray + DeepSpeed, tracked in MLflow."""


@main.command()
@OVERRIDES
def train(overrides: tuple[str, ...]) -> None:
    """Train with the config from conf/ plus OVERRIDES (experiment=NAME, group=CHOICE, key=value)."""
    cfg = _config(overrides)
    services.use_local_object_store()
    services.prepare_ray_client(cfg.cluster.ray_address)
    # Ray, DeepSpeed and MLflow load only once the config is known to be good.
    from wildtrain.data.dataset import DataError
    from wildtrain.driver import RunFailed, run
    from wildtrain.elastic.signals import CapacityError
    from wildtrain.lease import LeaseError
    from wildtrain.storage import StorageError
    from wildtrain.tracking.mlflow_run import TrackingError, quiet_mlflow

    quiet_mlflow()
    try:
        summary = run(cfg)
    except ConfigError as e:  # a setting the cluster it joined cannot serve (cluster.use_gpu)
        _fail(str(e), 2)
    except (DataError, StorageError, TrackingError, CapacityError, RunFailed, services.ServiceError,
            LeaseError) as e:
        _fail(str(e), 1)
    click.echo(f"\nrun {cfg.run.name!r} finished: " + ", ".join(
        f"{key} {value:.4g}" for key, value in summary.final_metrics.items() if key in ("step", "loss", "tokens_per_s")
    ))
    click.echo(f"  MLflow run:     {redact(summary.mlflow_url)}")
    if summary.dashboard_url:
        dashboard = services.dashboard_text(summary.dashboard_url, services.uses_token_auth())
        click.echo(f"  Ray dashboard:  {redact(dashboard)}")
    click.echo(f"  checkpoint:     {summary.checkpoint}")


@main.command()
@OVERRIDES
def config(overrides: tuple[str, ...]) -> None:
    """Print the resolved config."""
    click.echo(to_yaml(_config(overrides)), nl=False)


@main.command()
@click.argument("run", required=False)
@click.option("--cluster", help="A report card over every run recorded for this cluster (cluster.name).")
@click.option("--tracking-uri", help="The MLflow server [default: tracking.uri of the config].")
def report(run: str | None, cluster: str | None, tracking_uri: str | None) -> None:
    """Where a run's compute went (RUN: its name or MLflow run id): goodput, badput by cause,
    and a plot attached to the run; for a sweep's name, its trials ranked and compared, with
    their loss curves attached to the sweep's run; or, with --cluster, the cluster's report card."""
    from wildtrain.tracking import report as reports
    from wildtrain.tracking.mlflow_run import TrackingError, check_reachable, quiet_mlflow

    quiet_mlflow()
    if (run is None) == (cluster is None):
        _fail("report: give either a RUN or --cluster NAME", 2)
    from wildtrain.sweeps import report as sweep_reports

    uri = tracking_uri or _config(()).tracking.uri
    try:
        check_reachable(uri)
        if cluster is not None:
            click.echo(reports.report_cluster(uri, cluster))
            return
        if sweep_reports.is_sweep(uri, run):
            click.echo(sweep_reports.report_sweep(uri, run), nl=False)
            click.echo(f"plot: {uri.rstrip('/')} sweep {run}'s parent run, artifact {sweep_reports.ARTIFACT_DIR}/sweep.png")
            return
        run_id = reports.find_run(uri, run)
        result = reports.report_run(uri, run_id)
    except (TrackingError, LookupError) as e:
        _fail(str(e), 1)
    click.echo(reports.goodput_text(result))
    click.echo(f"plot: {uri.rstrip('/')} run {run_id}, artifact {reports.PLOT_ARTIFACT_DIR}/run.png")


@main.command()
@click.argument("name")
@click.option("--grid", "grid", multiple=True, required=True, help="key=v1,v2 (repeat per key): the trials are the Cartesian product.")
@click.option("--steps", type=int, help="train.steps of every trial.")
@click.option("--budget-tokens", type=int, help="Each trial's steps for this many tokens.")
@click.option("--cluster", help="Run the sweep as a job on this cluster of the registry.")
@click.option("--parallel", type=click.IntRange(min=1),
              help="Trials at once [default: as many as the cluster holds at their full size].")
@click.option("--dry-run", is_flag=True, help="Print the trials with their hashes and exit.")
@OVERRIDES
def sweep(name: str, grid: tuple[str, ...], steps: int | None, budget_tokens: int | None, cluster: str | None,
          parallel: int | None, dry_run: bool, overrides: tuple[str, ...]) -> None:
    """Run the sweep NAME: one trial per point of the grid, each a normal run with OVERRIDES,
    as many at once as the cluster holds (the rest queue); again, it skips finished trials
    and resumes unfinished ones."""
    from wildtrain.sweeps.grid import GridError, dry_run_text, plan_sweep

    target = _cluster(cluster) if cluster else None
    try:
        # Planned with the cluster's settings, as the job will plan it: the same trial hashes.
        plan = plan_sweep(name, grid, (*(target.run_overrides() if target else ()), *overrides),
                          steps=steps, budget_tokens=budget_tokens)
    except (GridError, ConfigError) as e:
        _fail(str(e), 2)
    click.echo(dry_run_text(plan), nl=False)
    if dry_run:
        return
    if target is not None:
        options = [f"--steps={steps}"] if steps else [f"--budget-tokens={budget_tokens}"] if budget_tokens else []
        options += [f"--parallel={parallel}"] if parallel else []
        from wildtrain.clusters.submit import Command

        _submit(target, overrides, False, command=Command.of_sweep(name, *(f"--grid={g}" for g in grid), *options))
        return
    services.use_local_object_store()
    services.prepare_ray_client(plan.trials[0].cfg.cluster.ray_address)
    from wildtrain.data.dataset import DataError
    from wildtrain.elastic.signals import CapacityError
    from wildtrain.storage import StorageError
    from wildtrain.sweeps.execute import SweepError, run_sweep
    from wildtrain.sweeps.report import report_sweep
    from wildtrain.tracking.mlflow_run import TrackingError, quiet_mlflow

    quiet_mlflow()
    try:
        outcome = run_sweep(plan, say=click.echo, parallel=parallel)
        click.echo(report_sweep(plan.trials[0].cfg.tracking.uri, name), nl=False)
    except (DataError, StorageError, TrackingError, CapacityError, SweepError, services.ServiceError) as e:
        _fail(str(e), 1)
    if outcome.failed:
        _fail(f"sweep {name}: {len(outcome.failed)} trials failed: " + "; ".join(outcome.failed), 1)


@main.command()
@click.argument("sweep_name", metavar="SWEEP")
@click.option("--to", "to", multiple=True, required=True, help="What the big run changes, e.g. model=7b (repeatable).")
@click.option("--metric", type=click.Choice(["val/loss", "loss"]), default=None,
              help="What the best trial is chosen by [default: val/loss where every finished trial has one, else loss].")
@click.option("--name", help="The experiment's name [default: SWEEP-yolo].")
@click.option("--submit", is_flag=True, help="Start the promoted run on --cluster.")
@click.option("--cluster", help="With --submit: the cluster of the registry to run it on.")
@click.option("--tracking-uri", help="The MLflow server [default: tracking.uri of the config].")
@OVERRIDES
def promote(sweep_name: str, to: tuple[str, ...], metric: str | None, name: str | None, submit: bool, cluster: str | None,
            tracking_uri: str | None, overrides: tuple[str, ...]) -> None:
    """Write the best trial of SWEEP as conf/experiment/<name>.yaml for the big run (--to),
    its learning rates, init, output and attention scaled by muP from the trial's shape, with its provenance."""
    from wildtrain.sweeps.promote import PromoteError, promote as promote_best
    from wildtrain.tracking.mlflow_run import TrackingError, check_reachable, quiet_mlflow

    if submit and cluster is None:
        _fail("promote --submit: give the cluster with --cluster NAME", 2)
    target = _cluster(cluster) if cluster else None
    quiet_mlflow()
    uri = tracking_uri or _config(()).tracking.uri
    try:
        check_reachable(uri)
        promotion = promote_best(uri, sweep_name, to, overrides, name=name, metric=metric)
    except (PromoteError, TrackingError, LookupError) as e:
        _fail(str(e), 1)
    except ConfigError as e:
        _fail(str(e), 2)
    click.echo(f"wrote {promotion.path} (run.name {promotion.name}, from {promotion.provenance['wildtrain.promoted_from.trial']})")
    if target is None:
        click.echo(f"start it with: wildtrain train experiment={promotion.name}")
    else:
        _submit(target, (f"experiment={promotion.name}",), False)


@main.command()
@click.argument("sweep_name", metavar="SWEEP")
@click.option("--to", "to", multiple=True, required=True, help="The promoted run's changes, e.g. model=7b (repeatable).")
@click.option("--tracking-uri", help="The MLflow server [default: tracking.uri of the config].")
@OVERRIDES
def fit(sweep_name: str, to: tuple[str, ...], tracking_uri: str | None, overrides: tuple[str, ...]) -> None:
    """Fit loss = E + A/N^alpha + B/D^beta to the best of SWEEP's finished trials at each model
    size and token count, and predict the loss of the run `promote SWEEP --to ... OVERRIDES`
    would write, with 90% bootstrap intervals."""
    from wildtrain.sweeps.fit import FitError
    from wildtrain.sweeps.predict import predict_promoted
    from wildtrain.tracking.mlflow_run import TrackingError, check_reachable, quiet_mlflow

    quiet_mlflow()
    uri = tracking_uri or _config(()).tracking.uri
    try:
        check_reachable(uri)
        prediction = predict_promoted(uri, sweep_name, to, overrides)
    except (FitError, TrackingError, LookupError) as e:
        _fail(str(e), 1)
    except ConfigError as e:
        _fail(str(e), 2)
    click.echo(prediction.text(), nl=False)


STEP = click.option("--step", type=int, help="The checkpoint of this step [default: the newest committed].")


@main.command("export")
@click.argument("run")
@STEP
@click.option("--out", required=True, help="A local folder (absent or empty) or an object-store URI (s3://, gs://).")
@click.option("--register", "register_as", metavar="NAME",
              help="Also register the export in MLflow's model registry as a new version of NAME.")
@OVERRIDES
def export_command(run: str, step: int | None, out: str, register_as: str | None, overrides: tuple[str, ...]) -> None:
    """Write a committed checkpoint of RUN (its run.name; OVERRIDES say where it is, as for
    `train`) in Hugging Face Transformers' format: config.json, safetensors, tokenizer."""
    with _reading_run():
        from wildtrain.export import export, open_run

        exported = export(open_run(run, overrides), out, step=step, register_as=register_as)
    for skipped in exported.skipped:
        click.echo(f"skipped {skipped.store}/{skipped.name}: {skipped.reason}", err=True)
    click.echo(f"exported {run} step {exported.step} ({exported.checkpoint}) as {exported.architecture} "
               f"to {exported.location}")
    if exported.version is not None:
        click.echo(f"registered as {register_as} version {exported.version}")


@main.command("sample")
@click.argument("run")
@STEP
@click.option("--prompt", required=True, help="The text to continue.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="0: the most likely token each time; above: drawn from the softmax of logits / temperature.")
@click.option("--seed", type=int, default=0, show_default=True, help="Of the draws, with a temperature above 0.")
@OVERRIDES
def sample_command(run: str, step: int | None, prompt: str, max_tokens: int, temperature: float, seed: int,
                   overrides: tuple[str, ...]) -> None:
    """Print a continuation of --prompt by a checkpoint of RUN (wildtrain's own model; the
    GPU where there is one)."""
    with _reading_run():
        from wildtrain.export import open_run
        from wildtrain.sample import sample

        sampled = sample(open_run(run, overrides), prompt, step=step, max_tokens=max_tokens,
                         temperature=temperature, seed=seed)
    click.echo(f"{run} step {sampled.step} ({sampled.checkpoint})", err=True)
    click.echo(sampled.text)


@main.command("eval")
@click.argument("run")
@STEP
@click.option("--tasks", help="lm-eval tasks, comma-separated (hellaswag,arc_easy) [default: eval.tasks of the config].")
@OVERRIDES
def eval_command(run: str, step: int | None, tasks: str | None, overrides: tuple[str, ...]) -> None:
    """Evaluate a committed checkpoint of RUN with EleutherAI's lm-evaluation-harness, as a
    Ray task on the cluster (a GPU of its own where it offers GPUs, else eval.num_cpus CPUs),
    and log eval/<task>/<metric> to the run's MLflow run at the checkpoint's step, with each
    task's full results as the artifact evals/step_<n>/<task>.json. OVERRIDES: where the run
    is, as for `export`, and eval.* (limit, batch_size, include_path)."""
    cfg = _config((*overrides, f"run.name={run}"))
    services.prepare_ray_client(cfg.cluster.ray_address)
    with _reading_run():
        from wildtrain.evals.remote import failure_reason, log_evaluation, plan_evaluation, submit
        from wildtrain.export import committed_step, run_info
        from wildtrain.layout import RunLayout
        from wildtrain.tracking.mlflow_run import FLUSH_TIMEOUT_S, Tracker, check_reachable

        info = run_info(cfg)
        at = committed_step(info, step)
        names = [task for task in tasks.split(",") if task] if tasks is not None else cfg.eval.tasks
        plan = plan_evaluation(cfg.eval, names, "--tasks" if tasks is not None else "eval.tasks")
        check_reachable(cfg.tracking.uri)
        import ray
        from ray.exceptions import GetTimeoutError

        from wildtrain.driver import connect_ray

        connect_ray(cfg)
        click.echo(f"evaluating {run} step {at} on {', '.join(plan.tasks)}", err=True)
        ref = submit(info, step, plan)
        try:
            evaluated = ray.get(ref, timeout=cfg.eval.timeout_s)
        except GetTimeoutError:
            ray.cancel(ref, force=True)
            _fail(f"the evaluation of {run} step {at} took longer than eval.timeout_s ({cfg.eval.timeout_s:g} s)", 1)
        except ray.exceptions.RayError as e:
            _fail(f"the evaluation of {run} step {at} failed: {failure_reason(e)}", 1)
        tracker = Tracker(cfg.tracking.uri, info.mlflow_run_id, RunLayout.of(cfg).tracking / "eval")
        log_evaluation(tracker, evaluated)
        unsent = tracker.close(FLUSH_TIMEOUT_S)
    for name, value in evaluated.metrics.items():
        click.echo(f"{name} {value:.4g}")
    for task, reason in evaluated.failed.items():
        click.echo(f"wildtrain: {task} failed: {reason}", err=True)
    click.echo(f"logged to MLflow run {info.mlflow_run_id} at step {evaluated.step} ({evaluated.checkpoint}, "
               f"{evaluated.seconds:.1f} s)", err=True)
    if evaluated.failed or unsent is not None:
        sys.exit(1)


@contextlib.contextmanager
def _reading_run():
    """Reading a run and its checkpoints: s3:// URIs reach `wildtrain up`'s store, as for
    `train`; its errors are one line: a config's (exit 2), or the run's, its data's, its
    storage's, MLflow's (exit 1)."""
    from wildtrain.data.manifest import DataError
    from wildtrain.export import ExportError
    from wildtrain.model.hf import NotExpressible
    from wildtrain.sample import SampleError
    from wildtrain.storage import StorageError
    from wildtrain.tracking.mlflow_run import TrackingError, quiet_mlflow

    quiet_mlflow()
    services.use_local_object_store()
    try:
        yield
    except ConfigError as e:
        _fail(str(e), 2)
    except (ExportError, NotExpressible, SampleError, DataError, StorageError, TrackingError) as e:
        _fail(str(e), 1)


@main.command()
@click.option("--state-dir", type=click.Path(path_type=Path), default=services.DEFAULT_STATE_DIR, show_default=True)
@click.option("--ray-port", default=6379, show_default=True)
@click.option("--dashboard-port", default=8265, show_default=True)
@click.option("--mlflow-port", default=5000, show_default=True)
@click.option("--object-store-port", default=8333, show_default=True)
@click.option("--num-cpus", type=int, default=None, help="Logical CPUs of the head [default: max(4, cores)].")
@click.option("--num-gpus", type=click.IntRange(min=0), default=None,
              help="GPUs the head offers, one worker each [default: all that torch can use here].")
def up(state_dir: Path, ray_port: int, dashboard_port: int, mlflow_port: int, object_store_port: int,
       num_cpus: int | None, num_gpus: int | None) -> None:
    """Start the local object store, Ray head and MLflow server (bound to 127.0.0.1) unless
    running. The Ray head's other ports are free ones, recorded in STATE_DIR/services.json
    with the GPUs it offers."""
    try:
        running = services.up(state_dir, services.RayPorts(gcs=ray_port, dashboard=dashboard_port), mlflow_port,
                              num_cpus, object_store_port, num_gpus=num_gpus)
    except services.ServiceError as e:
        _fail(str(e), 1)
    gpus = "" if running.num_gpus is None else f" ({running.num_gpus} GPU{'' if running.num_gpus == 1 else 's'})"
    click.echo(f"Ray:            {running.ray_address}{gpus}")
    click.echo(f"Ray dashboard:  {services.dashboard_text(running.dashboard_url, token_auth=True)}")
    click.echo(f"MLflow:         {running.mlflow_url}")
    store = running.object_store
    click.echo(f"object store:   {store.endpoint} (S3, bucket {store.bucket}; keys in {state_dir / 'services.json'})")


@main.command()
@click.option("--state-dir", type=click.Path(path_type=Path), default=services.DEFAULT_STATE_DIR, show_default=True)
def down(state_dir: Path) -> None:
    """Stop what `wildtrain up` started, and no other Ray cluster on this machine."""
    try:
        services.down(state_dir)
    except services.ServiceError as e:
        _fail(str(e), 1)


REGISTRY = click.option("--registry", type=click.Path(path_type=Path), default=None,
                        help="The clusters file [default: $WILDTRAIN_CLUSTERS, else ray_clusters/clusters.yaml].")


def _registry(path: Path | None) -> registry.Registry:
    try:
        return registry.load(path)
    except ConfigError as e:
        _fail(str(e), 2)


def _cluster(name: str, path: Path | None = None) -> registry.Cluster:
    try:
        return registry.load(path).get(name)
    except ConfigError as e:
        _fail(str(e), 2)


@main.group(invoke_without_command=True)
@REGISTRY
@click.pass_context
def clusters(ctx: click.Context, registry: Path | None) -> None:
    """The clusters of the registry: provider, jobs API, accelerators, stores."""
    ctx.obj = registry
    if ctx.invoked_subcommand is None:
        for name, cluster in _registry(registry).clusters.items():
            entry = cluster.entry
            accelerators = f"{entry.accelerator.per_node}x {entry.accelerator.type}" if entry.accelerator.per_node else "cpu"
            click.echo(f"{name:<16}{entry.provider:<12}{accelerators:<10}{entry.jobs_api:<28}{entry.storage.runs}")


@clusters.command("check")
@click.argument("name")
@click.option("--tracking-uri", help="The MLflow server [default: tracking.uri of the config].")
@click.pass_obj
def clusters_check(path: Path | None, name: str, tracking_uri: str | None) -> None:
    """Whether a run can go to NAME: token, Ray version, stores, and its report card."""
    from wildtrain.clusters.check import check
    from wildtrain.tracking.mlflow_run import quiet_mlflow

    quiet_mlflow()
    try:
        cluster = _registry(path).get(name)
    except ConfigError as e:
        _fail(str(e), 2)
    findings = check(cluster, tracking_uri or _config(()).tracking.uri)
    for finding in findings:
        click.echo(f"{'ok  ' if finding.ok else 'FAIL'} {finding.what}: {redact(finding.detail)}")
    if not all(f.ok for f in findings):
        sys.exit(1)


@main.command()
@click.option("--cluster", "name", required=True, help="A cluster of the registry.")
@click.option("--follow", is_flag=True, help="Stream the job's logs until it ends.")
@REGISTRY
@OVERRIDES
def submit(name: str, follow: bool, registry: Path | None, overrides: tuple[str, ...]) -> None:
    """Run `wildtrain train OVERRIDES` on a cluster of the registry, through its jobs API."""
    _submit(_cluster(name, registry), overrides, follow)


def _submit(cluster: registry.Cluster, overrides: tuple[str, ...], follow: bool, command=None) -> None:
    from wildtrain.clusters.jobs_api import ClusterError
    from wildtrain.clusters.submit import TRAIN, submit as send
    from wildtrain.lease import LeaseError

    try:
        submitted = send(cluster, list(overrides), follow=(lambda text: click.echo(text, nl=False)) if follow else None,
                         command=command or TRAIN)
    except ConfigError as e:
        _fail(str(e), 2)
    except (ClusterError, LeaseError) as e:
        _fail(str(e), 1)
    click.echo(f"job:            {submitted.job_id} on {cluster.name}")
    click.echo(f"MLflow run:     {redact(submitted.tracking)}")
    click.echo(f"Ray dashboard:  {redact(submitted.dashboard)} (sign in with the token in {cluster.token_file})")


@main.command()
@click.argument("src")
@click.argument("dst")
@click.option("--bwlimit", help="Bytes/s for the copy, rclone syntax (2M), or off [default: the lower of "
                                "the clusters' sync_bwlimit].")
@REGISTRY
def sync(src: str, dst: str, bwlimit: str | None, registry: Path | None) -> None:
    """Copy SRC to DST verified, manifests and run records last; run it again to resume.
    SRC, DST: s3://, gs://, local paths, or CLUSTER:runs/PATH, CLUSTER:data/PATH."""
    from wildtrain.clusters import sync as copier

    try:
        source, target = (copier.parse_location(text, lambda: _registry(registry)) for text in (src, dst))
        done = copier.sync(source, target, bwlimit, on_copied=lambda path: click.echo(f"copied {path}"))
    except ConfigError as e:
        _fail(str(e), 2)
    except (copier.SyncError, OSError) as e:
        _fail(str(e), 1)
    rate = done.copied_bytes / done.copy_seconds / 2**20 if done.copy_seconds else 0.0
    click.echo(f"synced {len(done.copied)} files ({done.copied_bytes / 2**20:.1f} MiB at {rate:.1f} MiB/s), "
               f"{done.verified} verified at {target.uri}")


@main.command()
@click.argument("run")
@click.option("--from", "source", required=True, help="The cluster the run is on.")
@click.option("--to", "target", required=True, help="The cluster it continues on.")
@click.option("--bwlimit", help="Bytes/s for the copy [default: the lower of the clusters' sync_bwlimit].")
@click.option("--checkpoint-timeout", default=3600.0, show_default=True,
              help="Seconds to wait for the running job's next checkpoint.")
@REGISTRY
@OVERRIDES
def move(run: str, source: str, target: str, bwlimit: str | None, checkpoint_timeout: float,
         registry: Path | None, overrides: tuple[str, ...]) -> None:
    """Continue RUN on another cluster: stop it after its next checkpoint, copy its checkpoints
    and record (verified, manifests last), submit it there with the same name and MLflow run."""
    from wildtrain.clusters.jobs_api import ClusterError
    from wildtrain.clusters.move import move as relocate
    from wildtrain.clusters.sync import SyncError
    from wildtrain.lease import LeaseError
    from wildtrain.tracking.mlflow_run import quiet_mlflow

    quiet_mlflow()
    try:
        clusters = _registry(registry)
        done = relocate(run, clusters.get(source), clusters.get(target), list(overrides), bwlimit=bwlimit,
                        checkpoint_timeout_s=checkpoint_timeout, say=click.echo)
    except ConfigError as e:
        _fail(str(e), 2)
    except (ClusterError, SyncError, OSError, LeaseError) as e:
        _fail(str(e), 1)
    click.echo(f"moved {run} from {source} to {target} at step {done.step}")
    click.echo(f"job:            {done.submitted.job_id} on {target}")
    click.echo(f"MLflow run:     {redact(done.submitted.tracking)}")
