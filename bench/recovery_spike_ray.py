"""Spike for issue 24, inside Ray Train: a node dies and the survivors carry on in-process
while Ray Train 2.60's controller keeps the run, instead of restarting the whole group.

bench/recovery_spike.py showed survivors re-forming in-process with workers forked by hand.
This runs the same workers (bench/recovery_spike_worker.py: gloo groups per generation, a
step abandoned when its generation loses a member, state from the peer at the highest step)
as the workers of a TorchTrainer on a fake cluster (a head and three one-worker nodes), and
removes the node of rank --kill-rank mid-run. What keeps Ray Train from restarting the group
is one worker-group callback in the controller (`KeepSurvivors`), using only what Ray 2.60
already has for node preemption:

- after each poll, a worker whose error is its death (its actor or node gone) is masked as a
  worker that ended without error, once the rendezvous owner has published a generation
  without it (the poll waits up to --decide-s for that; past it, the error stands and Ray
  restarts the group: the fallback);
- the report consolidation (`ReportCallbackHandler.set_required_ranks`) and the report
  barrier (`WorkerGroup.set_required_barrier_ranks`) are narrowed to the survivors, so their
  `ray.train.report` calls go through (rank 0 must survive: Ray's barrier keeps rank 0's
  payload only).

The rendezvous owner (the TCPStore, heartbeats, generations: wildtrain.elastic.membership)
runs in this process, as it would in the controller. The reference is the same training
with nothing killed, by bench/recovery_spike.py's forked workers (no Ray): the batches are
a function of the step, so the losses and final parameters must match.

Prints: death -> first step at size 2 and its parts, steps redone, losses and parameters
against the reference, how the Ray Train run ended and the survivors' last report.

Not covered: a node's return (adding a worker to a running group needs Ray internals the
2.60 pin has only for replica groups: `WorkerGroup.replace_replica_group`), the owner's
death, rank 0's death, ZeRO (see bench/recovery_spike.py --zero), wildtrain's data stream.

Usage: PYTHONPATH=platform .venv/bin/python bench/recovery_spike_ray.py [--steps 60] [--kill-step 15]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

from wildtrain import services

# Ray reads its authentication mode once, on import.
os.environ.update(services.token_auth_env())

import ray  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.train import FailureConfig, RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchConfig, TorchTrainer  # noqa: E402

from progress import say  # noqa: E402
from recovery_spike import drill, free_port, parse_args, read_logs, trained_steps, steps_redone  # noqa: E402
from recovery_spike_worker import HOST, Worker  # noqa: E402
from wildtrain import ray_compat  # noqa: E402
from wildtrain.elastic.membership import Membership, next_membership, stale  # noqa: E402

WORKERS = 3
SLOT = "spike_slot"
_KEPT: list = []  # each worker's spike Worker, so its broken groups are never destroyed


def latest(store) -> Membership:
    g = int(store.get("gen")) if store.check(["gen"]) else 0
    return Membership(g, tuple(store.get(f"members/{g}").decode().split(","))) if g else Membership(0, ())


def train_fn(config: dict) -> None:
    """One Ray Train worker: the spike's worker named after its rank; its last report from
    the survivors' group."""
    rank = ray.train.get_context().get_world_rank()
    args = argparse.Namespace(**{**config, "worker": f"w{rank}", "out": Path(config["out"])})
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    worker = Worker(args)
    _KEPT.append(worker)
    worker.store.set(f"node/w{rank}", ray.get_runtime_context().get_node_id())
    worker.train()
    ray.train.report({"step": worker.step, "world": len(worker.membership.members)})


class KeepSurvivors(ray_compat.WorkerGroupCallback, ray_compat.ReportCallback):
    """Masks the death of a worker the rendezvous owner has dropped from the group, and
    narrows Ray's report gates to the survivors (see the module docstring). Writes the
    reports the controller consolidates into the store, for the table."""

    def __init__(self, port: int, decide_s: float) -> None:
        self.port, self.decide_s = port, decide_s
        self.worker_group = None
        self.masked: set[int] = set()

    def after_worker_group_start(self, worker_group) -> None:
        self.worker_group = worker_group

    def after_report(self, training_report, metrics) -> None:
        store = dist.TCPStore(HOST, self.port, is_master=False, timeout=timedelta(seconds=10))
        store.set("consolidated", json.dumps(metrics))

    def after_worker_group_poll_status(self, worker_group_status) -> None:
        lost = {r for r, e in worker_group_status.errors.items() if ray_compat.worker_lost(e)}
        if not lost - self.masked:
            ray_compat.mask_worker_deaths(worker_group_status, self.masked)
            return
        store = dist.TCPStore(HOST, self.port, is_master=False, timeout=timedelta(seconds=10))
        deadline = time.monotonic() + self.decide_s
        while True:
            members = latest(store).members
            dropped = {r for r in lost if members and f"w{r}" not in members}
            if dropped == lost or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        if dropped - self.masked:
            self.masked |= dropped
            survivors = [r for r in range(len(worker_group_status.worker_statuses)) if r not in self.masked]
            ray_compat.narrow_report_gates(self.worker_group, survivors)
            print(f"KeepSurvivors: ranks {sorted(self.masked)} dropped by the owner; reports gated on {survivors}",
                  flush=True)
        ray_compat.mask_worker_deaths(worker_group_status, self.masked)


def owner(args, port: int, cluster: Cluster, facts: dict, stop: threading.Event) -> None:
    """The rendezvous owner (bench/recovery_spike.py's drill, without joins past the first
    generation), and the drill's kill: the node of --kill-rank once --kill-step steps are done."""
    store = dist.TCPStore(HOST, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    facts["store"] = store
    current, pending, seen_joins, errors = Membership(0, ()), [], 0, {}
    while not stop.is_set():
        now = time.time()
        joins = store.add("joins", 0)
        for n in range(seen_joins + 1, joins + 1):
            name, t = store.get(f"join/{n}").decode().split()
            pending.append(name)
            facts["asked"][name] = float(t)
        seen_joins = joins
        progress = int(store.get("progress")) if store.check(["progress"]) else 0
        if progress >= args.steps:
            nxt = None
        elif current.generation == 0:
            nxt = Membership(1, tuple(sorted(pending))) if len(set(pending)) == WORKERS else None
        else:
            beats = {m: float(store.get(f"hb/{m}")) if store.check([f"hb/{m}"]) else facts["asked"][m]
                     for m in current.members}
            if current.generation not in errors and store.check([f"error/{current.generation}"]):
                errors[current.generation] = float(store.get(f"error/{current.generation}"))
            error_at = errors.get(current.generation)
            dead = stale(beats, now, args.dead_after_s, error_at, args.confirm_s)
            nxt = next_membership(current, dead, [], None if error_at is None else now - error_at, args.confirm_s)
        if nxt is not None:
            store.set(f"members/{nxt.generation}", ",".join(nxt.members))
            store.set("gen", str(nxt.generation))
            facts["published"][nxt.generation] = (time.time(), nxt.members)
            current = nxt
        if facts["killed"] is None and progress >= args.kill_step:
            victim = f"w{args.kill_rank}"
            node_id = store.get(f"node/{victim}").decode()
            node = next(n for n in cluster.worker_nodes if n.node_id == node_id)
            cluster.remove_node(node, allow_graceful=False)
            facts["killed"], facts["victim"] = time.time(), victim
            say(f"  removed {victim}'s node after step {progress}")
        time.sleep(0.01)


def ray_drill(args, out: Path) -> dict:
    port = free_port()
    facts = {"published": {}, "asked": {}, "killed": None, "victim": None, "out": out}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    for _ in range(WORKERS):
        cluster.add_node(num_cpus=1, resources={SLOT: 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING")
    stop = threading.Event()
    owner_thread = threading.Thread(target=owner, args=(args, port, cluster, facts, stop), daemon=True)
    owner_thread.start()
    try:
        config = {k: v for k, v in vars(args).items() if k not in ("also", "out")} | {"port": port, "out": str(out)}
        trainer = TorchTrainer(
            train_fn, train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=WORKERS, resources_per_worker={"CPU": 0, SLOT: 1}),
            torch_config=TorchConfig(backend="gloo"),
            run_config=RunConfig(name=f"spike-{int(time.time())}", storage_path=str(out / "ray"),
                                 failure_config=FailureConfig(max_failures=0),
                                 callbacks=[KeepSurvivors(port, args.decide_s)]))
        try:
            trainer.fit()
            facts["ended"] = "FINISHED"
        except Exception as e:  # noqa: BLE001 - the table says how it ended
            facts["ended"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    finally:
        stop.set()
        store = facts["store"]
        facts["report"] = json.loads(store.get("consolidated")) if store.check(["consolidated"]) else None
        ray.shutdown()
        cluster.shutdown()
    return facts


def analyse(args, facts: dict, reference: dict) -> list[tuple[str, str]]:
    logs = read_logs(facts["out"])
    steps = trained_steps(logs)
    survivors = [f"w{r}" for r in range(WORKERS) if f"w{r}" != facts["victim"]]
    losses = {}
    for rs in steps.values():
        for r in rs:
            losses.setdefault(r["step"], r["loss"])
    ref_losses = {r["step"]: r["loss"] for r in read_logs(reference["out"])["w0"] if "loss" in r}
    if sorted(losses) != list(range(args.steps)):
        raise RuntimeError(f"steps missing from the logs in {facts['out']}: {sorted(set(range(args.steps)) - set(losses))}")
    loss_diff = max(abs(losses[s] - ref_losses[s]) for s in losses)
    param_diff = (torch.load(facts["out"] / "params.pt") - torch.load(reference["out"] / "params.pt")).abs().max().item()
    killed = facts["killed"]
    shrink_gen = min(g for g, (t, members) in facts["published"].items() if t >= killed)
    at_two = [r for n in survivors for r in steps[n] if r["gen"] == shrink_gen]
    first_small = min(r["t"] for r in at_two)
    formed = [r for n in survivors for r in logs[n] if r.get("event") == "formed" and r["gen"] == shrink_gen]
    abandoned = [r for n in survivors for r in logs[n] if r.get("event") == "abandoned" and r["t"] >= killed]
    t_published = facts["published"][shrink_gen][0]
    t_formed, t_synced = max(r["formed"] for r in formed), max(r["synced"] for r in formed)
    tol = 1e-3
    return [
        ("death (node removed) -> first step at size 2 (s)", f"{first_small - killed:.2f}"),
        ("  a survivor abandoned its step (s)", f"{min((r['t'] for r in abandoned), default=float('nan')) - killed:.2f}"),
        ("  found dead: generation of 2 published (s)", f"{t_published - killed:.2f}"),
        ("  rendezvous (gloo group built) (s)", f"{t_formed - t_published:.2f}"),
        ("  state sync (s)", f"{t_synced - t_formed:.2f}"),
        ("  first step at size 2 (s)", f"{first_small - t_synced:.2f}"),
        ("steps redone", str(steps_redone(steps))),
        ("max |loss - reference| / |param - reference|", f"{loss_diff:.2e} / {param_diff:.2e}"),
        ("equal to the reference", "yes" if loss_diff <= tol and param_diff <= tol else f"NO (tolerance {tol})"),
        ("the Ray Train run ended", facts["ended"]),
        ("the report the controller consolidated (one per rank)", json.dumps(facts["report"])),
    ]


def main() -> None:
    parser_args = parse_args()
    parser_args.decide_s = 5.0
    out = parser_args.out or Path(tempfile.mkdtemp(prefix="recovery-spike-ray-"))
    say(f"reference: {WORKERS} forked workers, {parser_args.steps} steps, nothing happens (logs in {out / 'reference'})")
    reference = drill(parser_args, out / "reference", chaos=False)
    say(f"drill: {WORKERS} Ray Train workers on a fake cluster; rank {parser_args.kill_rank}'s node removed after "
        f"step {parser_args.kill_step} (logs in {out / 'drill'})")
    (out / "drill").mkdir(parents=True)
    facts = ray_drill(parser_args, out / "drill")
    rows = analyse(parser_args, facts, reference)
    width = max(len(r[0]) for r in rows)
    print(f"\n{'measure'.ljust(width)}  value\n{'-' * width}  {'-' * 30}")
    for name, value in rows:
        print(f"{name.ljust(width)}  {value}")


if __name__ == "__main__":
    main()
