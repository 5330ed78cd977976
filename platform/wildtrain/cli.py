"""The `wildtrain` command. Thin: parse, call the modules, print their answers; each
command's known errors become one line and an exit code in `cli_common.one_line_errors`.
The commands about clusters of the registry are in `cli_clusters`."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from wildtrain import services
from wildtrain.cli_clusters import clusters, move, submit, submit_to, sync
from wildtrain.cli_common import OVERRIDES, OneLineUsage, fail, one_line_errors, resolve_config
from wildtrain.clusters import registry
from wildtrain.config import redact, to_yaml


@click.group(cls=OneLineUsage)
def main() -> None:
    """Elastic LLM training on Ray + DeepSpeed, tracked in MLflow."""


for command in (clusters, move, submit, sync):
    main.add_command(command)


@main.command()
@OVERRIDES
@one_line_errors()
def train(overrides: tuple[str, ...]) -> None:
    """Train with the config from conf/ plus OVERRIDES (experiment=NAME, group=CHOICE, key=value)."""
    cfg = resolve_config(overrides)
    services.use_local_object_store()
    services.prepare_ray_client(cfg.cluster.ray_address)
    # Ray, DeepSpeed and MLflow load only once the config is known to be good.
    from wildtrain.driver import run
    from wildtrain.tracking.mlflow_client import quiet_mlflow

    quiet_mlflow()
    summary = run(cfg)  # a ConfigError here: a setting the cluster it joined cannot serve (cluster.use_gpu)
    click.echo(
        f"\nrun {cfg.run.name!r} finished: "
        + ", ".join(
            f"{key} {value:.4g}"
            for key, value in summary.final_metrics.items()
            if key in ("step", "loss", "tokens_per_s")
        )
    )
    click.echo(f"  MLflow run:     {redact(summary.mlflow_url)}")
    if summary.dashboard_url:
        dashboard = services.dashboard_text(summary.dashboard_url, services.uses_token_auth())
        click.echo(f"  Ray dashboard:  {redact(dashboard)}")
    click.echo(f"  checkpoint:     {summary.checkpoint}")


@main.command()
@OVERRIDES
@one_line_errors()
def config(overrides: tuple[str, ...]) -> None:
    """Print the resolved config."""
    click.echo(to_yaml(resolve_config(overrides)), nl=False)


@main.command()
@click.argument("run", required=False)
@click.option("--cluster", help="A report card over every run recorded for this cluster (cluster.name).")
@click.option("--tracking-uri", help="The MLflow server [default: tracking.uri of the config].")
@one_line_errors(LookupError)
def report(run: str | None, cluster: str | None, tracking_uri: str | None) -> None:
    """Where a run's compute went (RUN: its name or MLflow run id): goodput, badput by cause,
    and a plot attached to the run; for a sweep's name, its trials ranked and compared, with
    their loss curves attached to the sweep's run; or, with --cluster, the cluster's report card."""
    from wildtrain.tracking.mlflow_client import check_reachable, quiet_mlflow
    from wildtrain.tracking.reports import runs as reports

    quiet_mlflow()
    if (run is None) == (cluster is None):
        fail("report: give either a RUN or --cluster NAME", 2)
    from wildtrain.sweeps import report as sweep_reports

    uri = tracking_uri or resolve_config(()).tracking.uri
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
    click.echo(reports.goodput_text(result))
    click.echo(f"plot: {uri.rstrip('/')} run {run_id}, artifact {reports.PLOT_ARTIFACT_DIR}/run.png")


@main.command()
@click.argument("name")
@click.option(
    "--grid",
    "grid",
    multiple=True,
    required=True,
    help="key=v1,v2 (repeat per key): the trials are the Cartesian product.",
)
@click.option("--steps", type=int, help="train.steps of every trial.")
@click.option("--budget-tokens", type=int, help="Each trial's steps for this many tokens.")
@click.option("--cluster", help="Run the sweep as a job on this cluster of the registry.")
@click.option(
    "--parallel",
    type=click.IntRange(min=1),
    help="Trials at once [default: as many as the cluster holds at their full size].",
)
@click.option("--dry-run", is_flag=True, help="Print the trials with their hashes and exit.")
@OVERRIDES
@one_line_errors()
def sweep(
    name: str,
    grid: tuple[str, ...],
    steps: int | None,
    budget_tokens: int | None,
    cluster: str | None,
    parallel: int | None,
    dry_run: bool,
    overrides: tuple[str, ...],
) -> None:
    """Run the sweep NAME: one trial per point of the grid, each a normal run with OVERRIDES,
    as many at once as the cluster holds (the rest queue); again, it skips finished trials
    and resumes unfinished ones."""
    from wildtrain.sweeps.grid import dry_run_text, plan_sweep

    target = registry.load().get(cluster) if cluster else None
    # Planned with the cluster's settings, as the job will plan it: the same trial hashes.
    plan = plan_sweep(
        name, grid, (*(target.run_overrides() if target else ()), *overrides), steps=steps, budget_tokens=budget_tokens
    )
    click.echo(dry_run_text(plan), nl=False)
    if dry_run:
        return
    if target is not None:
        options = [f"--steps={steps}"] if steps else [f"--budget-tokens={budget_tokens}"] if budget_tokens else []
        options += [f"--parallel={parallel}"] if parallel else []
        from wildtrain.clusters.submit import Command

        submit_to(target, overrides, False, command=Command.of_sweep(name, *(f"--grid={g}" for g in grid), *options))
        return
    services.use_local_object_store()
    services.prepare_ray_client(plan.trials[0].cfg.cluster.ray_address)
    from wildtrain.sweeps.execute import run_sweep
    from wildtrain.sweeps.report import report_sweep
    from wildtrain.tracking.mlflow_client import quiet_mlflow

    quiet_mlflow()
    outcome = run_sweep(plan, say=click.echo, parallel=parallel)
    click.echo(report_sweep(plan.trials[0].cfg.tracking.uri, name), nl=False)
    if outcome.failed:
        fail(f"sweep {name}: {len(outcome.failed)} trials failed: " + "; ".join(outcome.failed), 1)


@main.command()
@click.argument("sweep_name", metavar="SWEEP")
@click.option("--to", "to", multiple=True, required=True, help="What the big run changes, e.g. model=7b (repeatable).")
@click.option(
    "--metric",
    type=click.Choice(["val/loss", "loss"]),
    default=None,
    help="What the best trial is chosen by [default: val/loss where every finished trial has one, else loss].",
)
@click.option("--name", help="The experiment's name [default: SWEEP-yolo].")
@click.option("--submit", is_flag=True, help="Start the promoted run on --cluster.")
@click.option("--cluster", help="With --submit: the cluster of the registry to run it on.")
@click.option("--tracking-uri", help="The MLflow server [default: tracking.uri of the config].")
@OVERRIDES
@one_line_errors(LookupError)
def promote(
    sweep_name: str,
    to: tuple[str, ...],
    metric: str | None,
    name: str | None,
    submit: bool,
    cluster: str | None,
    tracking_uri: str | None,
    overrides: tuple[str, ...],
) -> None:
    """Write the best trial of SWEEP as conf/experiment/<name>.yaml for the big run (--to),
    its learning rates, init, output and attention scaled by muP from the trial's shape, with its provenance."""
    from wildtrain.sweeps.promote import promote as promote_best
    from wildtrain.tracking.mlflow_client import check_reachable, quiet_mlflow

    if submit and cluster is None:
        fail("promote --submit: give the cluster with --cluster NAME", 2)
    target = registry.load().get(cluster) if cluster else None
    quiet_mlflow()
    uri = tracking_uri or resolve_config(()).tracking.uri
    check_reachable(uri)
    promotion = promote_best(uri, sweep_name, to, overrides, name=name, metric=metric)
    click.echo(
        f"wrote {promotion.path} (run.name {promotion.name}, "
        f"from {promotion.provenance['wildtrain.promoted_from.trial']})"
    )
    if target is None:
        click.echo(f"start it with: wildtrain train experiment={promotion.name}")
    else:
        submit_to(target, (f"experiment={promotion.name}",), False)


@main.command()
@click.argument("sweep_name", metavar="SWEEP")
@click.option(
    "--to", "to", multiple=True, required=True, help="The promoted run's changes, e.g. model=7b (repeatable)."
)
@click.option("--tracking-uri", help="The MLflow server [default: tracking.uri of the config].")
@OVERRIDES
@one_line_errors(LookupError)
def fit(sweep_name: str, to: tuple[str, ...], tracking_uri: str | None, overrides: tuple[str, ...]) -> None:
    """Fit loss = E + A/N^alpha + B/D^beta to the best of SWEEP's finished trials at each model
    size and token count, and predict the loss of the run `promote SWEEP --to ... OVERRIDES`
    would write, with 90% bootstrap intervals."""
    from wildtrain.sweeps.predict import predict_promoted
    from wildtrain.tracking.mlflow_client import check_reachable, quiet_mlflow

    quiet_mlflow()
    uri = tracking_uri or resolve_config(()).tracking.uri
    check_reachable(uri)
    prediction = predict_promoted(uri, sweep_name, to, overrides)
    click.echo(prediction.text(), nl=False)


STEP = click.option("--step", type=int, help="The checkpoint of this step [default: the newest committed].")


@main.command("export")
@click.argument("run")
@STEP
@click.option("--out", required=True, help="A local folder (absent or empty) or an object-store URI (s3://, gs://).")
@click.option(
    "--register",
    "register_as",
    metavar="NAME",
    help="Also register the export in MLflow's model registry as a new version of NAME.",
)
@OVERRIDES
@one_line_errors()
def export_command(run: str, step: int | None, out: str, register_as: str | None, overrides: tuple[str, ...]) -> None:
    """Write a committed checkpoint of RUN (its run.name; OVERRIDES say where it is, as for
    `train`) in Hugging Face Transformers' format: config.json, safetensors, tokenizer."""
    _reading_run()
    from wildtrain.export import export, open_run

    exported = export(open_run(run, overrides), out, step=step, register_as=register_as)
    for skipped in exported.skipped:
        click.echo(f"skipped {skipped.store}/{skipped.name}: {skipped.reason}", err=True)
    click.echo(
        f"exported {run} step {exported.step} ({exported.checkpoint}) as {exported.architecture} to {exported.location}"
    )
    if exported.version is not None:
        click.echo(f"registered as {register_as} version {exported.version}")


@main.command("sample")
@click.argument("run")
@STEP
@click.option("--prompt", required=True, help="The text to continue.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option(
    "--temperature",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="0: the most likely token each time; above: drawn from the softmax of logits / temperature.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Of the draws, with a temperature above 0.")
@OVERRIDES
@one_line_errors()
def sample_command(
    run: str, step: int | None, prompt: str, max_tokens: int, temperature: float, seed: int, overrides: tuple[str, ...]
) -> None:
    """Print a continuation of --prompt by a checkpoint of RUN (wildtrain's own model; the
    GPU where there is one)."""
    _reading_run()
    from wildtrain.export import open_run
    from wildtrain.sample import sample

    sampled = sample(
        open_run(run, overrides), prompt, step=step, max_tokens=max_tokens, temperature=temperature, seed=seed
    )
    click.echo(f"{run} step {sampled.step} ({sampled.checkpoint})", err=True)
    click.echo(sampled.text)


@main.command("eval")
@click.argument("run")
@STEP
@click.option(
    "--tasks", help="lm-eval tasks, comma-separated (hellaswag,arc_easy) [default: eval.tasks of the config]."
)
@OVERRIDES
@one_line_errors()
def eval_command(run: str, step: int | None, tasks: str | None, overrides: tuple[str, ...]) -> None:
    """Evaluate a committed checkpoint of RUN with EleutherAI's lm-evaluation-harness, as a
    Ray task on the cluster (a GPU of its own where it offers GPUs, else eval.num_cpus CPUs),
    and log eval/<task>/<metric> to the run's MLflow run at the checkpoint's step, with each
    task's full results as the artifact evals/step_<n>/<task>.json. OVERRIDES: where the run
    is, as for `export`, and eval.* (limit, batch_size, include_path)."""
    cfg = resolve_config((*overrides, f"run.name={run}"))
    services.prepare_ray_client(cfg.cluster.ray_address)
    _reading_run()
    from wildtrain.evals.on_demand import evaluate_checkpoint

    logged = evaluate_checkpoint(
        cfg,
        step,
        None if tasks is None else [task for task in tasks.split(",") if task],
        say=lambda text: click.echo(text, err=True),
    )
    evaluated = logged.evaluated
    for name, value in evaluated.metrics.items():
        click.echo(f"{name} {value:.4g}")
    for task, reason in evaluated.failed.items():
        click.echo(f"wildtrain: {task} failed: {reason}", err=True)
    click.echo(
        f"logged to MLflow run {logged.mlflow_run_id} at step {evaluated.step} ({evaluated.checkpoint}, "
        f"{evaluated.seconds:.1f} s)",
        err=True,
    )
    if evaluated.failed or logged.unsent is not None:
        sys.exit(1)


def _reading_run() -> None:
    """Before a run and its checkpoints are read: s3:// URIs reach `wildtrain up`'s store,
    as for `train`."""
    from wildtrain.tracking.mlflow_client import quiet_mlflow

    quiet_mlflow()
    services.use_local_object_store()


# A port number: anything else is refused before `up` starts any service.
PORT = click.IntRange(1, 65535)


@main.command()
@click.option("--state-dir", type=click.Path(path_type=Path), default=services.DEFAULT_STATE_DIR, show_default=True)
@click.option("--ray-port", type=PORT, default=6379, show_default=True)
@click.option("--dashboard-port", type=PORT, default=8265, show_default=True)
@click.option("--mlflow-port", type=PORT, default=5000, show_default=True)
@click.option("--object-store-port", type=PORT, default=8333, show_default=True)
@click.option("--num-cpus", type=int, default=None, help="Logical CPUs of the head [default: max(4, cores)].")
@click.option(
    "--num-gpus",
    type=click.IntRange(min=0),
    default=None,
    help="GPUs the head offers, one worker each [default: all that torch can use here].",
)
@one_line_errors()
def up(
    state_dir: Path,
    ray_port: int,
    dashboard_port: int,
    mlflow_port: int,
    object_store_port: int,
    num_cpus: int | None,
    num_gpus: int | None,
) -> None:
    """Start the local object store, Ray head and MLflow server (bound to 127.0.0.1) unless
    running. The Ray head's other ports are free ones, recorded in STATE_DIR/services.json
    with the GPUs it offers."""
    running = services.up(
        state_dir,
        services.RayPorts(gcs=ray_port, dashboard=dashboard_port),
        mlflow_port,
        num_cpus,
        object_store_port,
        num_gpus=num_gpus,
    )
    gpus = "" if running.num_gpus is None else f" ({running.num_gpus} GPU{'' if running.num_gpus == 1 else 's'})"
    click.echo(f"Ray:            {running.ray_address}{gpus}")
    click.echo(f"Ray dashboard:  {services.dashboard_text(running.dashboard_url, token_auth=True)}")
    click.echo(f"MLflow:         {running.mlflow_url}")
    store = running.object_store
    click.echo(f"object store:   {store.endpoint} (S3, bucket {store.bucket}; keys in {state_dir / 'services.json'})")


@main.command()
@click.option("--state-dir", type=click.Path(path_type=Path), default=services.DEFAULT_STATE_DIR, show_default=True)
@one_line_errors()
def down(state_dir: Path) -> None:
    """Stop what `wildtrain up` started, and no other Ray cluster on this machine."""
    services.down(state_dir)
