"""`wildtrain report SWEEP`: rebuilt from MLflow alone (the parent run and its trials'
runs) and attached to the parent run: the overlaid smoothed loss curves against tokens
(report/sweep.png) and the ranked table with the effect of each swept key
(report/sweep.txt)."""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Sequence

from wildtrain.sweeps import compare
from wildtrain.sweeps.execute import TRIAL_TAG, find_parent, grid_keys, swept_values, trial_runs
from wildtrain.tracking.mlflow_client import Client
from wildtrain.tracking.record import STOPPED_EARLY_TAG, mlflow_key
from wildtrain.tracking.reports.runs import GOODPUT, summary_figure

ARTIFACT_DIR = "report"
BEST_TAG = "wildtrain.sweep.best"


def is_sweep(uri: str, name: str) -> bool:
    return find_parent(Client(uri), name) is not None


def fetch_sweep(uri: str, sweep: str) -> tuple[object, list[str], list[compare.TrialRecord]]:
    """(parent run, swept keys, one record per trial) as MLflow holds them."""
    client = Client(uri)
    parent = find_parent(client, sweep)
    if parent is None:
        raise LookupError(f"no sweep named {sweep!r} at {uri}")
    runs = trial_runs(client, [parent.info.experiment_id], sweep)
    keys = grid_keys(parent)
    return parent, keys, [_record(client, run, keys) for run in runs]


def _record(client: Client, run, keys: list[str]) -> compare.TrialRecord:
    run_id = run.info.run_id

    def history(key: str) -> list:
        return sorted(client.metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))

    loss = {m.step: m.value for m in history("loss")}  # a step logged twice (a resumed run) counts once
    validated = {m.step: m.value for m in history("val/loss")}
    tokens = {m.step: m.value for m in history("tokens_seen")}
    rates = [m.value for m in history("tokens_per_s")]
    mfu = [m.value for m in history("mfu")]
    memory = [m.value for m in history(mlflow_key("memory/peak_gb"))]
    inputs = client.get_run(run_id).inputs
    digests = tuple(sorted(d.dataset.digest for d in (inputs.dataset_inputs if inputs else [])))
    steps = sorted(loss)
    return compare.TrialRecord(
        name=run.info.run_name,
        run_id=run_id,
        values=tuple((key, dict(swept_values(run))[key]) for key in keys),
        status=run.info.status,
        stopped_early=run.data.tags.get(STOPPED_EARLY_TAG),
        tokens=tuple(tokens.get(step, float("nan")) for step in steps),
        loss=tuple(loss[step] for step in steps),
        tokens_per_s=statistics.fmean(rates) if rates else None,
        mfu=statistics.fmean(mfu) if mfu else None,
        goodput=summary_figure(run.data.tags, GOODPUT),
        peak_memory_gb=max(memory) if memory else None,
        data_digests=digests,
        val_loss=validated[max(validated)] if validated else None,
        hash=run.data.tags[TRIAL_TAG],
    )


def plot_sweep(sweep: str, ranked: Sequence[compare.Ranked], path: Path) -> None:
    """Each trial's smoothed loss against tokens (its raw losses faint behind it), best first
    in the legend; a trial stopped early ends where it stopped, dashed."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 6), layout="constrained")
    ax = figure.subplots()
    colors = [f"C{i % 10}" for i in range(len(ranked))]
    for r, color in zip(ranked, colors):
        trial = r.trial
        label = f"{r.place or '-'}. {' '.join(f'{k}={v}' for k, v in trial.values)}"
        style = "-" if r.place is not None else "--"
        ax.plot(trial.tokens, trial.loss, color=color, alpha=0.25, linewidth=1)
        ax.plot(trial.tokens, compare.smooth(trial.loss), color=color, linestyle=style, label=label)
    finite = [v for r in ranked if r.place is not None for v in r.trial.loss]
    if finite:  # a diverged trial's losses would flatten every other curve
        ax.set_ylim(min(finite) * 0.95, max(finite) * 1.05)
    ax.set_xlabel("tokens")
    ax.set_ylabel(f"loss (EMA {compare.SMOOTHING:g})")
    ax.set_title(f"sweep {sweep}")
    ax.legend(loc="upper right")
    figure.savefig(path, format="png", dpi=100)


def report_sweep(uri: str, sweep: str) -> str:
    """The sweep's table, also attached to its parent run with the plot."""
    parent, keys, trials = fetch_sweep(uri, sweep)
    ranked = compare.rank(trials)
    text = compare.table_text(sweep, ranked, keys)
    client = Client(uri)
    with tempfile.TemporaryDirectory(prefix="wildtrain-sweep-") as folder:
        path = Path(folder) / "sweep.png"
        plot_sweep(sweep, ranked, path)
        client.log_artifact(parent.info.run_id, str(path), ARTIFACT_DIR)
    client.log_text(parent.info.run_id, text, f"{ARTIFACT_DIR}/sweep.txt")
    best = next((r for r in ranked if r.place == 1), None)
    if best is not None:
        client.set_tag(parent.info.run_id, BEST_TAG, best.trial.name)
    return text
