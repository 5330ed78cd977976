"""Where a run's compute went, from what MLflow recorded: a plot of one run (loss, MFU and
goodput over time, failures and resizes marked), its goodput logged back to it, and a
report card per cluster over the runs recorded for that cluster. A run moved between
clusters (`wildtrain move`) counts on each card for the part it trained there.

The analysis is pure, over a `RunRecord` (the run's metric histories and elastic events);
only `fetch_run`, `fetch_cluster`, `report_run` and `report_cluster` talk to MLflow.
"""

from __future__ import annotations

import bisect
import math
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from wildtrain import events as run_events
from wildtrain.tracking.mlflow_client import Client
from wildtrain.tracking.record import CLUSTER_TAG, CLUSTERS_TAG, mlflow_key, read_events
from wildtrain.tracking.reports import goodput
from wildtrain.tracking.reports.goodput import AttemptStarted, CapacityWait, GroupStopped, RunStarted, RunStopped, Steps

PLOT_ARTIFACT_DIR = "report"
GOODPUT = "goodput"  # a run tag, with goodput/* and badput/<cause>_s: see `report_run`

# Metrics read besides `loss`, by their MLflow keys (`mlflow_key`). Per report of rank 0:
MFU = mlflow_key("mfu")
STEP_TIME = mlflow_key("step_time_s")
DATA_WAIT = mlflow_key("time/data_wait_s")  # mean per step over the report's window
CHECKPOINT_STALL = mlflow_key("time/checkpoint_stall_s")  # mean per step over the report's window
REPORT_WAIT = mlflow_key("time/report_wait_s")  # mean per step over the report's window
EVAL = mlflow_key("time/eval_s")  # mean per step over the report's window
CHECKPOINT_BYTES = mlflow_key("checkpoint/bytes")  # per save
CHECKPOINT_SAVE_S = mlflow_key("checkpoint/save_s")  # per save
# From the controller: the distinct nodes of the worker group when it starts, 0 when it stops.
NODES = mlflow_key("elastic/nodes")
WORLD_SIZE = mlflow_key("world_size")  # per report, like step_time_s: stalls are judged per world size
HISTORY_KEYS = (
    "loss",
    STEP_TIME,
    MFU,
    DATA_WAIT,
    CHECKPOINT_STALL,
    REPORT_WAIT,
    EVAL,
    CHECKPOINT_BYTES,
    CHECKPOINT_SAVE_S,
    NODES,
    WORLD_SIZE,
)


@dataclass(frozen=True)
class Sample:
    at: float  # wall clock of the controller when it logged the value
    step: int
    value: float


History = Mapping[str, Sequence[Sample]]  # metric name → samples, oldest first


@dataclass(frozen=True)
class RunRecord:
    run_id: str
    name: str
    started_at: float
    ended_at: Optional[float]  # None while the run is running
    history: History
    events: tuple[run_events.Event, ...]  # as `record.read_events` returns them
    cluster: str  # where it trains now (or last did): its `wildtrain.cluster` tag


def parts_on(record: RunRecord, cluster: str) -> list[RunRecord]:
    """The parts of the run that trained on `cluster`, each a record of its own: the run
    starts on the first move's source (or where it is now, if it never moved) and each
    `moved` event ends one stay and starts the next. A stay's part holds the reports and
    events logged during it; the copy of a move counts on the cluster left, as time stopped.
    Named "<run> (part i of n)" when the run moved at all."""
    moves = [e for e in record.events if isinstance(e, run_events.Moved)]
    if not moves:
        return [record] if record.cluster == cluster else []
    where = [moves[0].from_cluster] + [m.to_cluster for m in moves]
    starts = [record.started_at] + [m.at for m in moves]
    parts = []
    for i, (stay, start) in enumerate(zip(where, starts)):
        if stay != cluster:
            continue
        # The last stay keeps everything from its start on, the run's final events included.
        until = starts[i + 1] if i + 1 < len(starts) else math.inf
        parts.append(
            RunRecord(
                run_id=record.run_id,
                name=f"{record.name} (part {i + 1} of {len(where)})",
                started_at=start,
                ended_at=record.ended_at if until == math.inf else until,
                history={
                    key: tuple(s for s in samples if start <= s.at < until) for key, samples in record.history.items()
                },
                events=tuple(e for e in record.events if start <= e.at < until),
                cluster=stay,
            )
        )
    return parts


@dataclass(frozen=True)
class RunStats:
    run_id: str
    name: str
    goodput: goodput.Goodput
    mfu: Optional[float]  # mean over the run's reports
    failures: int
    recoveries_s: tuple[float, ...]  # per recovered failure: noticed → first step after it
    node_s: Optional[float]  # seconds × nodes the run's worker groups held
    checkpoint_bytes: float
    checkpoint_save_s: float
    health_passed: int
    health_failed: tuple[str, ...]  # "node: check (detail)"


@dataclass(frozen=True)
class CardRow:
    label: str  # a run's name, or "all runs"
    runs: int
    mfu: Optional[float]
    goodput: float
    failures: int
    failures_per_node_day: Optional[float]
    mttr_s: Optional[float]
    checkpoint_mb_per_s: Optional[float]
    health_passed: int
    health_checks: int


def goodput_events(record: RunRecord) -> list[goodput.GoodputEvent]:
    """The goodput events (see `goodput.account`) of a recorded run: its submissions, waits,
    interruptions and attempts from its events, and its step windows from its reports."""
    events: list[goodput.GoodputEvent] = [RunStarted(record.started_at)]
    if record.ended_at is not None:
        events.append(RunStopped(record.ended_at))
    # A recovery's restart time counts from the interruption (or resubmission) before it.
    restart_from = record.started_at
    for e in record.events:
        if isinstance(e, run_events.Started):
            events.append(RunStarted(e.at))
            restart_from = e.at
        elif isinstance(e, run_events.Stopped):
            events.append(RunStopped(e.at))
        elif isinstance(e, run_events.Waiting):
            events.append(CapacityWait(e.start, e.end))
        elif isinstance(e, run_events.Interrupted):
            events.append(GroupStopped(e.at, e.KIND))
            restart_from = e.at
        elif isinstance(e, run_events.Recovered):
            events.append(AttemptStarted(restart_from + e.restart_s, e.restored_step, e.restore_s, e.reshard_s))
    return events + _step_windows(record.history, events)


def _step_windows(history: History, events: Sequence[goodput.GoodputEvent]) -> list[Steps]:
    """One window per log step with `step_time_s`: from the previous such window of the same
    attempt to this one, stamped when the worker closed it. An attempt's first window covers
    one step (the loop logs every attempt's first step)."""
    boundaries = sorted(e.at for e in events if isinstance(e, (RunStarted, GroupStopped, AttemptStarted)))
    data_wait = {(s.at, s.step): s.value for s in history.get(DATA_WAIT, ())}
    stall = {(s.at, s.step): s.value for s in history.get(CHECKPOINT_STALL, ())}
    report_wait = {(s.at, s.step): s.value for s in history.get(REPORT_WAIT, ())}
    evaluating = {(s.at, s.step): s.value for s in history.get(EVAL, ())}
    world_size = {(s.at, s.step): int(s.value) for s in history.get(WORLD_SIZE, ())}
    windows = []
    previous: Optional[Sample] = None
    for report in history.get(STEP_TIME, ()):
        same_attempt = (
            previous is not None
            and report.step > previous.step
            and bisect.bisect_right(boundaries, previous.at) == bisect.bisect_right(boundaries, report.at)
        )
        steps = report.step - previous.step if same_attempt else 1
        start = previous.at if same_attempt else report.at - report.value
        key = (report.at, report.step)
        windows.append(
            Steps(
                report.step - steps + 1,
                report.step,
                start,
                report.at,
                steps * data_wait.get(key, 0.0),
                steps * stall.get(key, 0.0),
                world_size.get(key, 0),
                steps * report_wait.get(key, 0.0),
                steps * evaluating.get(key, 0.0),
            )
        )
        previous = report
    return windows


def summarize(record: RunRecord, now: float) -> RunStats:
    """A run's figures for the cluster card, as of `now`."""
    events = record.events
    mfu = [s.value for s in record.history.get(MFU, ())]
    health = [e for e in events if isinstance(e, run_events.HealthCheck)]
    return RunStats(
        run_id=record.run_id,
        name=record.name,
        goodput=goodput.account(goodput_events(record), now),
        mfu=statistics.fmean(mfu) if mfu else None,
        failures=sum(isinstance(e, run_events.Failure) for e in events),
        recoveries_s=tuple(e.recovery_s for e in events if isinstance(e, run_events.Recovered) and e.kind == "failure"),
        node_s=_node_seconds(record.history.get(NODES, ()), now),
        checkpoint_bytes=math.fsum(s.value for s in record.history.get(CHECKPOINT_BYTES, ())),
        checkpoint_save_s=math.fsum(s.value for s in record.history.get(CHECKPOINT_SAVE_S, ())),
        health_passed=sum(e.passed for e in health),
        health_failed=tuple(
            f"{e.node}: {e.check}" + (f" ({e.detail})" if e.detail else "") for e in health if not e.passed
        ),
    )


def _node_seconds(nodes: Sequence[Sample], now: float) -> Optional[float]:
    """The node count held from each sample to the next (the last until `now`), summed."""
    if not nodes:
        return None
    ends = [s.at for s in nodes[1:]] + [now]
    return math.fsum(s.value * max(0.0, end - s.at) for s, end in zip(nodes, ends))


def cluster_card(runs: Sequence[RunStats]) -> list[CardRow]:
    """One row per run, then one over all of them."""
    return [_row(run.name, [run]) for run in runs] + [_row("all runs", runs)]


def _row(label: str, runs: Sequence[RunStats]) -> CardRow:
    # MFU weighted by productive time: the utilization of the time spent training.
    weighted = [(run.mfu, run.goodput.productive_s) for run in runs if run.mfu is not None]
    weight = math.fsum(w for _, w in weighted)
    wall = math.fsum(run.goodput.wall_s for run in runs)
    exposed = [run for run in runs if run.node_s is not None]
    node_days = math.fsum(run.node_s for run in exposed) / 86400
    recoveries = [r for run in runs for r in run.recoveries_s]
    save_s = math.fsum(run.checkpoint_save_s for run in runs)
    return CardRow(
        label=label,
        runs=len(runs),
        mfu=math.fsum(m * w for m, w in weighted) / weight if weight > 0 else None,
        goodput=math.fsum(run.goodput.productive_s for run in runs) / wall if wall > 0 else 0.0,
        failures=sum(run.failures for run in runs),
        failures_per_node_day=sum(run.failures for run in exposed) / node_days if node_days > 0 else None,
        mttr_s=statistics.fmean(recoveries) if recoveries else None,
        checkpoint_mb_per_s=math.fsum(run.checkpoint_bytes for run in runs) / save_s / 1e6 if save_s > 0 else None,
        health_passed=sum(run.health_passed for run in runs),
        health_checks=sum(run.health_passed + len(run.health_failed) for run in runs),
    )


def card_text(cluster: str, runs: Sequence[RunStats]) -> str:
    """The card as a table, where all runs' time went, and every failed health check."""

    def show(value: Optional[float], spec: str) -> str:
        return "-" if value is None else format(value, spec)

    header = ("run", "MFU", "goodput", "failures", "fail/node-day", "MTTR s", "ckpt MB/s", "health ok")
    table = [header] + [
        (
            row.label,
            show(row.mfu, ".1%"),
            format(row.goodput, ".1%"),
            str(row.failures),
            show(row.failures_per_node_day, ".2f"),
            show(row.mttr_s, ".1f"),
            show(row.checkpoint_mb_per_s, ".1f"),
            f"{row.health_passed}/{row.health_checks}",
        )
        for row in cluster_card(runs)
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    lines = [f"cluster {cluster}: {len(runs)} runs"]
    lines += [
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
        for line in table
    ]
    wall = math.fsum(run.goodput.wall_s for run in runs)
    if wall > 0:
        badput = {cause: math.fsum(run.goodput.badput_s[cause] for run in runs) for cause in goodput.BADPUT_CAUSES}
        lines.append(
            "badput: "
            + ", ".join(
                f"{cause} {seconds / wall:.1%}"
                for cause, seconds in sorted(badput.items(), key=lambda kv: -kv[1])
                if seconds > 0
            )
        )
    lines += [f"failed health check in {run.name}: {failure}" for run in runs for failure in run.health_failed]
    return "\n".join(lines) + "\n"


def plot_run(history: History, events: Sequence[goodput.GoodputEvent], path: Path, now: float) -> None:
    """A PNG at `path`: loss, MFU and goodput (as known at `now`) over the run's wall
    time, with its failures and resizes marked on each."""
    # The object-oriented API draws with Agg and leaves pyplot's global state alone.
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    origin = min(e.at for e in events if isinstance(e, RunStarted))
    span = now - origin
    scale, unit = (1.0, "s") if span <= 600 else (60.0, "min") if span <= 600 * 60 else (3600.0, "h")

    def x(t: float) -> float:
        return (t - origin) / scale

    figure = Figure(figsize=(10, 8), layout="constrained")
    loss_ax, mfu_ax, goodput_ax = figure.subplots(3, 1, sharex=True)
    for ax, key, label, factor in ((loss_ax, "loss", "loss", 1.0), (mfu_ax, MFU, "MFU %", 100.0)):
        samples = history.get(key, ())
        ax.plot([x(s.at) for s in samples], [s.value * factor for s in samples], marker=".", color="tab:blue")
        ax.set_ylabel(label)
    times = [origin + (now - origin) * i / 400 for i in range(401)]
    goodput_ax.plot(
        [x(t) for t in times], [100.0 * g for g in goodput.goodput_over_time(events, now, times)], color="tab:green"
    )
    goodput_ax.set_ylabel("goodput % (since start)")
    goodput_ax.set_ylim(0, 100)
    goodput_ax.set_xlabel(f"{unit} since the run started")

    marks = {"failure": ("tab:red", "--"), "resize": ("tab:purple", ":")}
    for e in events:
        if isinstance(e, GroupStopped):
            color, style = marks.get(e.kind, ("grey", "-."))
            for ax in (loss_ax, mfu_ax, goodput_ax):
                ax.axvline(x(e.at), color=color, linestyle=style, linewidth=1)
    loss_ax.legend([Line2D([], [], color=c, linestyle=s) for c, s in marks.values()], list(marks), loc="upper right")
    figure.savefig(path, format="png", dpi=100)


def fetch_run(uri: str, run_id: str) -> RunRecord:
    client = Client(uri)
    return _record(client, client.get_run(run_id))


def fetch_cluster(uri: str, cluster: str) -> list[RunRecord]:
    """Every run in every experiment that trained on the cluster (all of it, or a part
    before or after a move), oldest first."""
    client = Client(uri)
    # LIKE's `_` matches any character: the exact test is on the tag's items.
    return [
        _record(client, run)
        for run in client.search_runs(None, f"tags.`{CLUSTERS_TAG}` LIKE '%,{cluster},%'")
        if cluster in run.data.tags[CLUSTERS_TAG].split(",")
    ]


def _record(client: Client, run) -> RunRecord:
    run_id = run.info.run_id
    history = {
        key: tuple(
            Sample(m.timestamp / 1000, int(m.step), float(m.value))
            for m in sorted(client.metric_history(run_id, key), key=lambda m: (m.timestamp, m.step))
        )
        for key in HISTORY_KEYS
    }
    with tempfile.TemporaryDirectory(prefix="wildtrain-report-") as folder:
        events = tuple(read_events(client.uri, run_id, folder))
    ended = run.info.end_time / 1000 if run.info.status != "RUNNING" and run.info.end_time else None
    return RunRecord(
        run_id,
        run.info.run_name,
        run.info.start_time / 1000,
        ended,
        history,
        events,
        run.data.tags.get(CLUSTER_TAG, ""),
    )


def find_run(uri: str, name_or_id: str) -> str:
    """The id of the run with this MLflow run id, or else the newest run with this name."""
    client = Client(uri)
    run = client.run_or_none(name_or_id)
    if run is None:
        run = next(
            client.search_runs(None, f"attributes.run_name = '{name_or_id}'", newest_first=True, page_size=1), None
        )
    if run is None:
        raise LookupError(f"no MLflow run named or with the id {name_or_id!r} at {uri}")
    return run.info.run_id


def goodput_text(result: goodput.Goodput) -> str:
    lines = [
        f"goodput {result.goodput:.1%} of {result.wall_s:.0f} s wall time",
        f"  {'productive':<18}{result.productive_s:9.1f} s",
    ]
    lines += [f"  {cause:<18}{seconds:9.1f} s" for cause, seconds in result.badput_s.items() if seconds > 0]
    return "\n".join(lines)


def report_run(uri: str, run_id: str) -> goodput.Goodput:
    """Plot the run into its artifacts (report/run.png) and set its goodput and badput by
    cause as its summary figures; its goodput. For the end of a run and for
    `wildtrain report RUN` on a running or finished one."""
    record = fetch_run(uri, run_id)
    now = record.ended_at if record.ended_at is not None else time.time()
    events = goodput_events(record)
    result = goodput.account(events, now)
    client = Client(uri)
    with tempfile.TemporaryDirectory(prefix="wildtrain-report-") as folder:
        path = Path(folder) / "run.png"
        plot_run(record.history, events, path, now)
        client.log_artifact(run_id, str(path), PLOT_ARTIFACT_DIR)
    values = {GOODPUT: result.goodput, "goodput/wall_s": result.wall_s, "goodput/productive_s": result.productive_s}
    values |= {f"badput/{cause}_s": seconds for cause, seconds in result.badput_s.items()}
    # Figures of the whole run, not curves: as metrics, each was a one-point chart at the top
    # of the MLflow UI's Model metrics tab, above the loss. As tags they are on the run's
    # Overview, a column of the runs table, and a report later replaces them.
    client.set_tags(run_id, {key: f"{value:.6g}" for key, value in values.items()})
    return result


def summary_figure(tags: Mapping[str, str], key: str) -> Optional[float]:
    """A figure `report_run` set on a run (`GOODPUT`, `badput/<cause>_s`), None before it has."""
    value = tags.get(key)
    return float(value) if value is not None else None


def report_cluster(uri: str, cluster: str) -> str:
    """The cluster's report card as text."""
    now = time.time()
    runs = [
        summarize(part, part.ended_at if part.ended_at is not None else now)
        for record in fetch_cluster(uri, cluster)
        for part in parts_on(record, cluster)
    ]
    return card_text(cluster, runs)
