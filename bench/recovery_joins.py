"""In-process re-forms bench/recovery.py does not stage: two returns seconds apart, a death in a join.

In one run on a fake cluster of three one-worker nodes (elastic.in_process, Ray's metrics
off, the tiny model at 24 rows a step so that 1, 2 and 3 workers share it evenly):

    two returns seconds apart   rank 2's node, then rank 1's, removed once the run trains
                                without the one before (3 -> 2 -> 1); then two nodes added
                                `--apart` seconds apart: do their workers join in one
                                re-form or two, and how long does each stop the members?
    a death during a join       rank 2's node removed (3 -> 2), a node added, and rank 1's
                                node removed the moment rank 0 arrives at the rendezvous
                                of the join's generation (a member lost in the re-form
                                that adds the joiner)

Prints one row per interruption the run recorded (its `Failure` or `Resize`, and its
`Recovered`: the sizes, the members' stop, the steps redone), then whether the run trained
every step exactly once at the tokens of an uninterrupted run.

`--join-batch-s 0` is the reference for the two returns: each joiner taken in as it asks,
where by default one that asked waits for another getting ready (`elastic.join_batch_s`).

Usage: PYTHONPATH=platform:bench .venv/bin/python bench/recovery_joins.py [--steps 500] [--apart 3]
       [--join-batch-s S]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import recovery
from mlflow.tracking import MlflowClient
from progress import say
from recovery import LoadSampler, add_worker_node, cell, tiny_services

from tests.helpers.chaos import BackgroundRun  # noqa: E402  (recovery put the checkout's root on sys.path)
from wildtrain import services
from wildtrain.config import load_config
from wildtrain.elastic import rendezvous, rendezvous_keys
from wildtrain.events import Failure, Interrupted, Recovered, Resize
from wildtrain.tracking.record import read_events

ray, Cluster = recovery.ray, recovery.Cluster


class Rendezvous:
    """The run's rendezvous server, caught as the driver (a thread of this process) makes it:
    where the bench reads the generations the moment they are published."""

    def __init__(self) -> None:
        self.servers: list[rendezvous.RendezvousServer] = []
        made = rendezvous.RendezvousServer.__init__

        def catch(server, *args, **kwargs) -> None:
            made(server, *args, **kwargs)
            self.servers.append(server)

        rendezvous.RendezvousServer.__init__ = catch

    def owner(self) -> rendezvous.RendezvousOwner:
        return self.servers[-1].owner

    def current(self) -> tuple[str, ...]:
        owner = self.owner()
        return owner.current.members if owner is not None else ()

    def node_of_rank(self, rank: int) -> str:
        owner = self.owner()
        return rendezvous.node_of(owner.store, owner.current.members[rank])

    def wait_for_arrival(self, name: str, what: str, timeout_s: float = 300) -> None:
        """Until `name` arrived at the newest generation's rendezvous (`in_process.Member._arrive`)."""
        key = rendezvous_keys.arrived(self.owner().current.generation, name)
        deadline = time.monotonic() + timeout_s
        while not self.owner().store.check([key]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {timeout_s:g} s")
            time.sleep(0.005)

    def wait_for(self, predicate, what: str, timeout_s: float = 300) -> tuple[str, ...]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.servers and self.owner() is not None and predicate(self.current()):
                return self.current()
            time.sleep(0.01)
        raise TimeoutError(f"no generation {what} within {timeout_s:g} s (members now: {self.current()})")


def remove(cluster: Cluster, node_id: str) -> float:
    node = next(n for n in cluster.worker_nodes if n.node_id == node_id)
    cluster.remove_node(node, allow_graceful=False)
    return time.time()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--apart", type=float, default=3.0, help="seconds between the two nodes' returns")
    parser.add_argument("--join-batch-s", type=float, default=None, help="elastic.join_batch_s (default: the config's)")
    args = parser.parse_args()
    load = LoadSampler()
    caught = Rendezvous()
    causes: list[tuple[str, float]] = []
    with tiny_services("bench-recovery-joins") as (root, dataset, mlflow_url):
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 2, "_system_config": services.NODE_HEALTH_CHECKS | services.RAY_METRICS_OFF},
        )
        for _ in range(3):
            add_worker_node(cluster)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        try:
            cfg = load_config(
                [
                    "experiment=tiny",
                    f"run.name=recovery-joins-{int(time.time())}",
                    f"run.storage={root / 'runs'}",
                    f"tracking.uri={mlflow_url}",
                    "tracking.experiment=bench-recovery",
                    f"data.datasets=[{{uri: {dataset}}}]",
                    f"train.steps={args.steps}",
                    "train.global_batch_size=24",
                    "train.log_every=1",
                    "checkpoint.every=4",
                    "elastic.max_workers=3",
                    "elastic.in_process=true",
                    f"cluster.worker_resources.{recovery.WORKER_SLOT}=1",
                    *([] if args.join_batch_s is None else [f"elastic.join_batch_s={args.join_batch_s}"]),
                ]
            )
            say(f"training {args.steps} steps at world size 3")
            run = BackgroundRun(cfg)
            caught.wait_for(lambda m: len(m) == 3, "of 3 members", 600)
            run.wait_until(lambda h: any(m.step >= 5 for m in h), "step 5", 600)

            say("two returns seconds apart: removing rank 2's node, then rank 1's")
            causes.append(("rank 2's node removed", remove(cluster, caught.node_of_rank(2))))
            caught.wait_for(lambda m: len(m) == 2, "of 2 members")
            run.wait_until(lambda h: h and h[-1].value == 2, "a step at world size 2", 300)
            causes.append(("rank 1's node removed", remove(cluster, caught.node_of_rank(1))))
            run.wait_until(lambda h: h and h[-1].value == 1, "a step at world size 1", 300)
            say(f"training at world size 1; adding two nodes {args.apart:g} s apart")
            causes.append(("first node added", time.time()))
            add_worker_node(cluster)
            time.sleep(args.apart)  # the scenario's own gap, not a wait for an event
            causes.append(("second node added", time.time()))
            add_worker_node(cluster)
            caught.wait_for(lambda m: len(m) == 3, "of 3 members again")
            run.wait_until(lambda h: h and h[-1].value == 3, "a step at world size 3", 300)

            say(
                "a death during a join: removing rank 2's node, then adding one and removing rank 1's "
                "as the join's generation is published"
            )
            causes.append(("rank 2's node removed", remove(cluster, caught.node_of_rank(2))))
            before = caught.wait_for(lambda m: len(m) == 2, "of 2 members")
            run.wait_until(lambda h: h and h[-1].value == 2, "a step at world size 2", 300)
            rank_1_node = caught.node_of_rank(1)
            causes.append(("node added", time.time()))
            add_worker_node(cluster)
            caught.wait_for(lambda m: len(m) == 3 and set(before) < set(m), "adding the joiner")
            caught.wait_for_arrival(before[0], "rank 0 at the join's re-form")
            causes.append(("rank 1's node removed in the join's re-form", remove(cluster, rank_1_node)))
            summary = run.join(1800)
            say("run finished; reading its events")
            events = read_events(mlflow_url, summary.run_id, tempfile.mkdtemp(dir=root))
            history = MlflowClient(mlflow_url).get_metric_history(summary.run_id, "loss")
        finally:
            ray.shutdown()
            cluster.shutdown()

    print("\n| cause (bench's clock) | at (s) | recorded | sizes | members stopped | steps redone | load |")
    print("|---|---|---|---|---|---|---|")
    started = causes[0][1]
    for what, at in causes:
        print(f"| {what} | {at - started:.1f} | | | | | {load.mean(at, at + 5):.1f} |")
    for interruption, recovered in zip(
        [e for e in events if isinstance(e, Interrupted)], [e for e in events if isinstance(e, Recovered)]
    ):
        kind = "failure" if isinstance(interruption, Failure) else "resize" if isinstance(interruption, Resize) else "?"
        print(
            f"| | {interruption.at - started:.1f} | {kind} after step {interruption.last_step} | "
            f"{recovered.world_size_before}→{recovered.world_size_after} | {cell(recovered.recovery_s)} | "
            f"{recovered.steps_lost} | |"
        )
    steps = sorted(m.step for m in history)
    tokens = summary.final_metrics["tokens_seen"]
    print(
        f"\nsteps logged once each, 1..{args.steps}: {steps == list(range(1, args.steps + 1))}; "
        f"tokens {tokens:.0f} (uninterrupted: {args.steps * 24 * cfg.data.seq_len}); "
        f"final world size {summary.final_metrics['world_size']:.0f}"
    )


if __name__ == "__main__":
    main()
