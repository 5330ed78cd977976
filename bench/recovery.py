"""Recovery time on a local fake cluster: kill a node at a known step, then bring it back.

Runs the tiny model on two one-worker nodes once per scenario and ZeRO stage
(`--zero-stages`, deepspeed.zero_stage), side by side: by default wildtrain's default config
("default": the survivor re-forms in its own process from its peer's mirror, and the returned
node's worker joins it; issue 58's goal, a death to the first step at the smaller size within
5 s with no committed step redone, a return taken in with the others stopped at most 1 s)
and, for reference, the restart path ("restart (elastic.in_process=false)": a resize restarts
every worker from the last checkpoint). With --only, Ray's own timeouts and tuned variants
of the restart path too, and in-process variants: "in-process + spare" (elastic.spares=1 on
a third node: the spare takes the dead member's place, and the returned node's worker waits
ready as the next spare), "in-process, nodes of two" (four workers on two nodes of two: a
death takes two), "in-process, rank 0's node" (the node removed holds rank 0, Ray's and the
generation's, where the others remove the last rank's) and "in-process, every ray worker
lost" (rank 1's node, then, once its joiner is in, rank 0's: only a joiner is left).
`--override KEY=VALUE` sets a config value in every scenario, under the scenario's own.
A scenario takes a few minutes at each stage on a 2-core machine.
Each scenario gets its own fake cluster (node health checks are set when the head starts,
as `wildtrain up` sets them). Prints one row per interruption:

    detection   node killed (or added) → the controller learns of it (in-process: a
                survivor's collective fails; at a regrow, the survivors hand their state
                over: Ray placed the lost slot on the node, the worker started there asked
                to join, and the survivors reached a log step)
    restart     → the new worker group's training function starts (in-process: the
                survivors' new process group formed)
    restore     → checkpoint loaded (excluding resharding)
    reshard     → conversion to the universal format (world size changed)
    stopped     → first optimizer step at the new size: the time no worker trained (at an
                in-process regrow, how long the members stopped to take the joiner in)
    first step  node killed (or added) → first optimizer step at the new size
    node up     at a regrow, add_node → the GCS lists the node alive: its raylet's start,
                before which nothing can be placed on it
    from schedulable  at a regrow, first step less node up (issue 24: join within 5 s of
                being schedulable)
    steps lost  steps done before the interruption that the restored checkpoint lacked
    load        the machine's mean 1-minute load average over that recovery (on a shared
                2-core machine, other people's work moves every column)
    GCS cores   the head's GCS's CPU from the node's removal to its return (a lost placement
                bundle that fits a node left is retried without pause: bench/pg_storm.py)

Then, per scenario and stage, each shrink's death → first step and steps redone, and each
regrow's stop, against issue 58's bounds. An interruption nothing here caused is a row of its
own ("unplanned"); a scenario that fails is one row saying why, and the others still run.

Its fake cluster and services are also what bench/ettr.py, bench/recovery_joins.py and
bench/tiny_runs.py build on.

Usage: .venv/bin/python bench/recovery.py [--steps 60] [--zero-stages 1 2 3]
       [--only default "restart (elastic.in_process=false)" "wildtrain tuned" ...] [--override KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

import psutil
from progress import say

from wildtrain import services

REPO = Path(__file__).resolve().parents[1]
# The fault injection is a test helper (tests/helpers/chaos.py), imported from the checkout's
# root: `python bench/recovery.py` puts bench/ on sys.path, not the root.
sys.path.insert(0, str(REPO))

# Ray reads its authentication mode once, on import: the fake clusters use tokens, as
# `wildtrain up` does.
os.environ.update(services.token_auth_env())

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from tests.helpers.chaos import BackgroundRun  # noqa: E402
from tests.helpers.pacing import Pace  # noqa: E402
from wildtrain.config import load_config  # noqa: E402
from wildtrain.data.prepare import PrepareConfig, prepare  # noqa: E402
from wildtrain.events import Failure, Formed, Interrupted, Recovered  # noqa: E402
from wildtrain.tracking.mlflow_client import quiet_mlflow  # noqa: E402
from wildtrain.tracking.record import read_events  # noqa: E402

WORKER_SLOT = "wildtrain_worker"
# Issue 58's bounds: a node's death to the first step at the smaller size (no committed step
# redone), and the members' stop when a returning node's worker is taken in.
SHRINK_FIRST_STEP_S = 5.0
REGROW_STOPPED_S = 1.0
NODES_OF_TWO = ("elastic.in_process=true", "elastic.max_workers=4", "train.global_batch_size=24")
RESTART = "restart (elastic.in_process=false)"
SCENARIOS = {
    # What a user gets: the config's defaults on a head `wildtrain up` started.
    "default": dict(overrides=[], system_config=services.NODE_HEALTH_CHECKS),
    # The restart path, the default's fallback, as a mode of its own: every resize restarts the group.
    RESTART: dict(overrides=["elastic.in_process=false"], system_config=services.NODE_HEALTH_CHECKS),
    # The restart path at Ray 2.60's defaults: 60 s worker-group start timeout, 2 s controller
    # poll, 60 s resize checks, node health checks every 3 s with 5 misses allowed.
    "ray defaults": dict(
        overrides=[
            "elastic.in_process=false",
            "elastic.worker_start_timeout_s=60",
            "elastic.poll_interval_s=2",
            "elastic.resize_check_interval_s=60",
        ],
        system_config={},
    ),
    # The restart path with shorter waits than its defaults.
    "wildtrain tuned": dict(
        overrides=[
            "elastic.in_process=false",
            "elastic.worker_start_timeout_s=10",
            "elastic.poll_interval_s=2",
            "elastic.resize_check_interval_s=5",
        ],
        system_config=services.NODE_HEALTH_CHECKS,
    ),
    # In-process, rank 0's node lost: the survivor, Ray's rank 1, is the next generation's rank 0.
    "in-process, rank 0's node": dict(
        overrides=["elastic.in_process=true"], system_config=services.NODE_HEALTH_CHECKS, victims=(0,)
    ),
    # In-process, rank 1's node lost and its worker joined again, then rank 0's: no Ray Train
    # worker is left, and the joiner that is rank 0 reports through the controller (elastic.relay).
    "in-process, every ray worker lost": dict(
        overrides=["elastic.in_process=true"], system_config=services.NODE_HEALTH_CHECKS, victims=(1, 0)
    ),
    # In-process, and a spare kept ready on a third node (elastic.spares): the group keeps its
    # size through the death, and the returned node's worker waits as the next spare. Paced so
    # that the return's worker gets ready before the run's end.
    "in-process + spare": dict(
        overrides=["elastic.in_process=true", "elastic.spares=1"],
        pace=Pace(min_step_s=0.2),
        system_config=services.NODE_HEALTH_CHECKS | services.RAY_METRICS_OFF,
        spares=1,
    ),
    # Ray's default placement, PACK, where wildtrain's auto places a bundle a node (here one
    # worker a node, as STRICT_SPREAD would): the lost bundle fits the survivor's node by its
    # totals, and the GCS retries it without pause until a node comes back (bench/pg_storm.py).
    "in-process, pack": dict(
        overrides=["elastic.in_process=true", "cluster.placement_strategy=PACK"],
        system_config=services.NODE_HEALTH_CHECKS,
    ),
    # Nodes of two workers (as nodes of several GPUs), four workers: a node's death takes two.
    # auto places a bundle a node (NODE_BUNDLES); PACK, a bundle a worker, leaves the GCS
    # retrying the two lost bundles while the group runs smaller (bench/pg_storm.py --several).
    # 24 rows a step: 1 to 4 workers share them evenly.
    "in-process, nodes of two": dict(
        overrides=[*NODES_OF_TWO], system_config=services.NODE_HEALTH_CHECKS, workers_per_node=2
    ),
    "in-process, nodes of two, pack": dict(
        overrides=[*NODES_OF_TWO, "cluster.placement_strategy=PACK"],
        system_config=services.NODE_HEALTH_CHECKS,
        workers_per_node=2,
    ),
    # The same without Ray's metrics (services.RAY_METRICS_OFF says why).
    "in-process, ray metrics off": dict(
        overrides=["elastic.in_process=true"], system_config=services.NODE_HEALTH_CHECKS | services.RAY_METRICS_OFF
    ),
    # The restart path tuned, its checkpoints converted to the universal format in the
    # background as they commit, so a resize loads one ready (on this CPU-only machine the
    # conversion slows training).
    "tuned + reshard ahead": dict(
        overrides=[
            "elastic.in_process=false",
            "elastic.worker_start_timeout_s=10",
            "elastic.poll_interval_s=2",
            "elastic.resize_check_interval_s=5",
            "checkpoint.reshard_ahead=true",
        ],
        system_config=services.NODE_HEALTH_CHECKS,
    ),
}


def prepare_tiny(uri: str) -> str:
    """The bundled tiny corpus in the object store, as `make demo` prepares it (5% of its
    documents held out for validation)."""
    # "local": a private Ray, never another one running on this machine.
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        prepare(
            PrepareConfig(
                input=str(REPO / "tests/assets/tiny_corpus.jsonl"), output=uri, rows_per_group=128, val_fraction=0.05
            )
        )
    finally:
        ray.shutdown()
    return uri


@contextlib.contextmanager
def tiny_services(name: str, nice: int = 0) -> Iterator[tuple[Path, str, str]]:
    """An object store and an MLflow server in a new folder, each process of theirs at `nice`,
    the tiny corpus prepared in the store: the folder, the dataset's URI and MLflow's URL;
    the services stopped after."""
    quiet_mlflow()
    root = Path(tempfile.mkdtemp(prefix=f"wildtrain-{name}-"))
    say(f"starting an object store and an MLflow server in {root}")
    store = services.start_object_store(root / "objectstore", services.free_port(), "bench")
    os.environ.update(store.env())  # before any cluster starts: its workers inherit it
    port = services.free_port()
    mlflow = services.start_mlflow(root / "mlflow", port)
    for server in (psutil.Process(store.pid), psutil.Process(mlflow.pid)) if nice else ():
        for process in [server, *server.children(recursive=True)]:
            process.nice(nice)
    try:
        say("preparing the tiny corpus")
        yield root, prepare_tiny(f"s3://{store.bucket}/datasets/tiny"), f"http://{services.HOST}:{port}"
    finally:
        services.stop_process(mlflow.pid)
        services.stop_process(store.pid)


@contextlib.contextmanager
def fake_cluster(system_config: dict, worker_nodes: int = 2, workers_per_node: int = 1) -> Iterator[Cluster]:
    """A head (the driver, Ray Data) and `worker_nodes` nodes of `workers_per_node` workers
    (`add_worker_node`), which this process joins; all stopped after. `system_config`: the
    head's (node health checks)."""
    # Ray's helpers that look for "the" cluster without an address (Ray Train's placement group
    # cleaner) take the newest Ray instance on the machine unless RAY_ADDRESS names theirs:
    # beside another cluster they removed this run's placement group (tests/helpers/ray_clusters.py).
    gcs_port = services.free_port()
    os.environ["RAY_ADDRESS"] = f"{services.HOST}:{gcs_port}"
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "gcs_server_port": gcs_port, "_system_config": system_config},
    )
    for _ in range(worker_nodes):
        add_worker_node(cluster, workers_per_node)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def add_worker_node(cluster: Cluster, workers: int = 1) -> None:
    """A node with room for `workers` training workers (`cluster.worker_resources` names the slot)."""
    cluster.add_node(num_cpus=workers, resources={WORKER_SLOT: workers})


def gcs_cpu_s(cluster: Cluster) -> float:
    """The CPU seconds the head's GCS has used so far."""
    return sum(psutil.Process(cluster.head_node.all_processes["gcs_server"][0].process.pid).cpu_times()[:2])


def run_scenario(
    name: str,
    overrides: list[str],
    system_config: dict,
    mlflow_url: str,
    steps: int,
    root: Path,
    load: "LoadSampler",
    spares: int = 0,
    workers_per_node: int = 1,
    victims: Optional[tuple[int, ...]] = None,
    pace: Optional[Pace] = None,
) -> list[dict]:
    """The node of each rank of `victims` (of the newest in-process generation; the last rank's
    by default) removed in turn, each added back once the group trains smaller, and the next
    removed once it trains at full size again; the steps paced by `pace` (tests/helpers/pacing.py)."""
    if spares:
        return run_spare_scenario(name, overrides, system_config, mlflow_url, steps, root, load, pace)
    full, smaller = 2 * workers_per_node, workers_per_node
    say(f"{name}: starting a fake cluster of a head and two nodes of {workers_per_node} worker(s)")
    causes, gcs_cores = [], {}  # when each node was removed or added; the GCS's cores after each removal
    node_up = {}  # by when a node was added: how long until the GCS listed it alive (schedulable)
    with fake_cluster(system_config, workers_per_node=workers_per_node) as cluster:
        cfg = run_config(name, overrides, mlflow_url, steps, root)
        say(f"{name}: training {steps} steps at world size {full}")
        run = BackgroundRun(cfg, pace)
        run.wait_until(lambda h: any(m.step >= 6 for m in h), "step 6", 600)
        for n, rank in enumerate(victims or (full - 1,)):
            if n:
                run.wait_until(lambda h: h and h[-1].value == full, f"a step at world size {full} again", 600)
            say(f"{name}: removing rank {rank}'s node, waiting for a step at world size {smaller}")
            victim = rank_node(cluster, run, mlflow_url, root, rank)
            killed_at, gcs_at_kill = time.time(), gcs_cpu_s(cluster)
            cluster.remove_node(victim)
            run.wait_until(lambda h: h and h[-1].value == smaller, f"a step at world size {smaller}", 600)
            added_at = time.time()
            gcs_cores[killed_at] = (gcs_cpu_s(cluster) - gcs_at_kill) / (added_at - killed_at)
            say(
                f"{name}: training at world size {smaller} after {added_at - killed_at:.1f} s (the GCS used "
                f"{gcs_cores[killed_at]:.2f} cores meanwhile); adding the node back"
            )
            add_worker_node(cluster, workers_per_node)  # returns once the GCS lists the node alive
            node_up[added_at] = time.time() - added_at
            causes += [killed_at, added_at]
        summary = run.join(1200)
        say(f"{name}: run finished; reading its events")
        events = read_events(mlflow_url, summary.run_id, tempfile.mkdtemp(dir=root))

    groups = sum(e.generation == 1 for e in events if isinstance(e, Formed))
    if groups > 1:
        say(f"{name}: Ray started {groups} worker groups: {groups - 1} restart(s)")
    pairs = recovered_interruptions(events)
    caused = caused_by(causes, pairs)
    rows = []
    for (interruption, recovery), cause_at in zip(pairs, caused):
        kind = "shrink" if isinstance(interruption, Failure) else "regrow"
        row = {
            "scenario": name,
            "event": f"{kind if cause_at is not None else f'unplanned {kind}'} "
            f"{recovery.world_size_before}→{recovery.world_size_after}",
            "restart": recovery.restart_s,
            "restore": recovery.restore_s,
            "reshard": recovery.reshard_s,
            "stopped": recovery.recovery_s,
            "steps lost": recovery.steps_lost,
        }
        if cause_at is not None:
            first_step = recovery.recovery_s + interruption.at - cause_at
            row |= {
                "detection": interruption.at - cause_at,
                "first step": first_step,
                "node up": node_up.get(cause_at, "-"),
                "from schedulable": first_step - node_up[cause_at] if cause_at in node_up else "-",
                "load": f"{load.mean(cause_at, cause_at + first_step):.1f}",
                "GCS cores": f"{gcs_cores[cause_at]:.2f}" if cause_at in gcs_cores else "-",
            }
        rows.append(row)
    for cause_at in sorted(set(causes) - set(caused)):
        what = "regrow" if cause_at in node_up else "shrink"
        rows.append({"scenario": name, "event": f"{what}: none before the run's last step"})
    for row in rows:
        say(f"{name}: {row['event']}: first step after {cell(row.get('first step', '-'))}")
    return rows


def recovered_interruptions(events: list) -> list[tuple[Interrupted, Recovered]]:
    """Each interruption with the recovery that followed it (one left unrecovered when the run
    ended, or interrupted again before its first step, has none and is left out)."""
    pairs, pending = [], None
    for e in events:
        if isinstance(e, Interrupted):
            pending = e
        elif isinstance(e, Recovered) and pending is not None:
            pairs.append((pending, e))
            pending = None
    return pairs


def caused_by(causes: list[float], pairs: list[tuple[Interrupted, Recovered]]) -> list[Optional[float]]:
    """Per pair, the node's removal or return (of `causes`, ascending) that it followed: the
    first interruption known after each cause; None for one nothing here caused (a failure
    of the run's own, e.g. a worker's start timed out on a loaded machine)."""
    caused: list[Optional[float]] = [None] * len(pairs)
    for cause_at in causes:
        after = [i for i, (interruption, _) in enumerate(pairs) if interruption.at >= cause_at and caused[i] is None]
        if after:
            caused[after[0]] = cause_at
    return caused


def run_spare_scenario(
    name: str,
    overrides: list[str],
    system_config: dict,
    mlflow_url: str,
    steps: int,
    root: Path,
    load: "LoadSampler",
    pace: Optional[Pace],
) -> list[dict]:
    """A group of two beside a third node's spare (elastic.spares=1): rank 1's node removed once
    the spare is ready, and added back once the spare took its place. Rows: the death (the
    group re-formed at the same size) and the return (its worker ready as the next spare; no
    member stopped for it)."""
    say(f"{name}: starting a fake cluster of a head and three one-worker nodes")
    with fake_cluster(system_config, worker_nodes=3) as cluster:
        cfg = run_config(name, overrides, mlflow_url, steps, root)
        say(f"{name}: training {steps} steps at world size 2, waiting for the spare to be ready")
        run = BackgroundRun(cfg, pace)
        run.wait_until(lambda h: h and h[-1].value == 1, "a spare ready", 600, key="system/spares")
        victim = rank_node(cluster, run, mlflow_url, root, 1)
        killed_at = time.time()
        cluster.remove_node(victim)
        formed = wait_for_events(run, mlflow_url, root, lambda events: len(formed_of(events)) >= 2, "the re-form")
        added_at = time.time()
        say(
            f"{name}: re-formed at world size {len(formed_of(formed)[-1].nodes)} after {added_at - killed_at:.1f} s; "
            "adding the node back, waiting for its worker to be ready as the next spare"
        )
        add_worker_node(cluster)
        ready = run.wait_until(
            lambda h: any(m.value == 1 and m.timestamp / 1000 > added_at for m in h),
            "the returned node's worker ready as a spare",
            600,
            key="system/spares",
        )
        ready_at = next(m.timestamp / 1000 for m in ready if m.value == 1 and m.timestamp / 1000 > added_at)
        summary = run.join(1200)
        events = read_events(mlflow_url, summary.run_id, tempfile.mkdtemp(dir=root))
    interruptions = [e for e in events if isinstance(e, Interrupted)]
    recoveries = [e for e in events if isinstance(e, Recovered)]
    interruption, recovery = interruptions[0], recoveries[0]
    first_step = recovery.recovery_s + interruption.at - killed_at
    rows = [
        {
            "scenario": name,
            "event": f"spare takes the place {recovery.world_size_before}→{recovery.world_size_after}",
            "detection": interruption.at - killed_at,
            "restart": recovery.restart_s,
            "restore": recovery.restore_s,
            "reshard": recovery.reshard_s,
            "stopped": recovery.recovery_s,
            "first step": first_step,
            "steps lost": recovery.steps_lost,
            "load": f"{load.mean(killed_at, killed_at + first_step):.1f}",
        },
        {
            "scenario": name,
            "event": f"return: ready as the next spare {ready_at - added_at:.1f} s after add_node",
            "detection": "-",
            "restart": "-",
            "restore": "-",
            "reshard": "-",
            "stopped": 0.0 if len(interruptions) == 1 else f"{len(interruptions) - 1} more re-forms",
            "first step": "-",
            "steps lost": "-",
            "load": f"{load.mean(added_at, ready_at):.1f}",
        },
    ]
    for row in rows:
        say(f"{name}: {row['event']}: stopped {cell(row['stopped'])}")
    return rows


def run_config(name: str, overrides: list[str], mlflow_url: str, steps: int, root: Path):
    return load_config(
        [
            "experiment=tiny",
            f"run.name=recovery-{re.sub('[^a-z0-9]+', '-', name.lower().replace('+', 'and'))}-{int(time.time())}",
            f"run.storage={root / 'runs'}",
            f"tracking.uri={mlflow_url}",
            "tracking.experiment=bench-recovery",
            f"train.steps={steps}",
            "train.log_every=1",
            "checkpoint.every=4",
            f"cluster.worker_resources.{WORKER_SLOT}=1",
            *overrides,
        ]
    )


def formed_of(events: list) -> list[Formed]:
    return [e for e in events if isinstance(e, Formed)]


def wait_for_events(run: BackgroundRun, mlflow_url: str, root: Path, condition, what: str, timeout_s: float = 300):
    """The run's events once `condition(events)` holds (they come with rank 0's reports)."""
    deadline = time.monotonic() + timeout_s
    while not condition(events := read_events(mlflow_url, run.mlflow_run_id(), tempfile.mkdtemp(dir=root))):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:g} s")
        time.sleep(0.5)
    return events


def rank_node(cluster: Cluster, run: BackgroundRun, mlflow_url: str, root: Path, rank: int):
    """The worker node of `rank`: from the newest in-process generation's `Formed` event where
    the run has one (waited for), else any (a group Ray restarts has no rank worth keeping)."""
    if not run.cfg.elastic.in_process:
        return next(iter(cluster.worker_nodes))
    formed = formed_of(wait_for_events(run, mlflow_url, root, formed_of, "in-process generation", 60))
    return next(node for node in cluster.worker_nodes if node.node_id == formed[-1].nodes[rank])


class LoadSampler:
    """The machine's 1-minute load average every 2 s, in the background."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            self.samples.append((time.time(), os.getloadavg()[0]))
            time.sleep(2.0)

    def mean(self, start: float, end: float) -> float:
        during = [load for at, load in self.samples if start <= at <= end] or [os.getloadavg()[0]]
        return sum(during) / len(during)


def cell(value) -> str:
    return f"{value:.1f} s" if isinstance(value, float) else str(value)


def against_bounds(rows: list[dict]) -> list[str]:
    """Per shrink, its death → first step and steps redone; per regrow, how long the members
    stopped: each against issue 58's bound."""
    lines = []
    for row in rows:
        kind = row["event"].split(" ")[0]
        if kind == "shrink" and isinstance(row.get("first step"), float):
            within = row["first step"] <= SHRINK_FIRST_STEP_S and row["steps lost"] == 0
            lines.append(
                f"{row['scenario']}: {row['event']}: the first step {row['first step']:.1f} s after the death, "
                f"{row['steps lost']} steps redone ({'within' if within else 'beyond'} "
                f"{SHRINK_FIRST_STEP_S:g} s and none redone)"
            )
        elif kind == "regrow" and isinstance(row.get("stopped"), float):
            within = row["stopped"] <= REGROW_STOPPED_S
            lines.append(
                f"{row['scenario']}: {row['event']}: the members stopped {row['stopped']:.1f} s (the first step "
                f"{cell(row.get('first step', '-'))} after the node's return; {'within' if within else 'beyond'} "
                f"{REGROW_STOPPED_S:g} s stopped)"
            )
    return lines


def run_options(parser: argparse.ArgumentParser) -> None:
    """The options of a bench that runs each of its runs at each ZeRO stage, under the
    user's config overrides (`run_overrides`)."""
    parser.add_argument(
        "--zero-stages",
        nargs="+",
        type=int,
        choices=[1, 2, 3],
        default=[1],
        help="deepspeed.zero_stage: every run at each",
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every run, under the run's own (its scenario's or reference's; repeatable)",
    )


def run_overrides(args: argparse.Namespace, own: list[str], stage: int) -> list[str]:
    """A run's config overrides, as `run_options` asks for them: the user's, then the run's
    `own` (which win), at ZeRO `stage`."""
    return [*args.override, *own, f"deepspeed.zero_stage={stage}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument(
        "--only",
        nargs="+",
        choices=sorted(SCENARIOS),
        default=["default", RESTART],
        help="the scenarios to run (default: wildtrain's default config, and the restart path beside it)",
    )
    run_options(parser)
    args = parser.parse_args()
    load = LoadSampler()
    rows = []
    with tiny_services("bench-recovery") as (root, dataset, mlflow_url):
        for stage in args.zero_stages:
            for name in args.only:
                scenario = SCENARIOS[name]
                overrides = [f"data.datasets=[{{uri: {dataset}}}]", *run_overrides(args, scenario["overrides"], stage)]
                label = f"{name}, ZeRO-{stage}"
                try:
                    rows += run_scenario(
                        label,
                        overrides,
                        scenario["system_config"],
                        mlflow_url,
                        args.steps,
                        root,
                        load,
                        scenario.get("spares", 0),
                        scenario.get("workers_per_node", 1),
                        scenario.get("victims"),
                        scenario.get("pace"),
                    )
                except Exception as e:  # the other scenarios' rows are still worth their minutes
                    say(f"{label}: failed: {e}")
                    rows.append(
                        {
                            "scenario": label,
                            "event": f"failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
                        }
                    )

    columns = [
        "scenario",
        "event",
        "detection",
        "restart",
        "restore",
        "reshard",
        "stopped",
        "first step",
        "node up",
        "from schedulable",
        "steps lost",
        "load",
        "GCS cores",
    ]
    print("\n| " + " | ".join(columns) + " |")
    print("|" + "|".join("---" for _ in columns) + "|")
    for row in rows:
        print("| " + " | ".join(cell(row.get(c, "-")) for c in columns) + " |")
    print(
        "\ndetection: node removed/added → controller knows; restart: → new group's training function starts "
        "(measured from detection); stopped: no worker trained (at a join, the members' stop); first step: node "
        "removed/added → first step at the new size; node up: add_node → the GCS lists the node alive (its raylet "
        "started); from schedulable: that → the first step; GCS cores: the head's GCS's CPU from the node's removal "
        "to its return.\n"
    )
    for line in against_bounds(rows):
        print(line)


if __name__ == "__main__":
    main()
