"""Spike for issue 24, inside Ray Train: a node dies and the survivors carry on in-process
while Ray Train 2.60's controller keeps the run, instead of restarting the whole group.

bench/recovery_spike.py showed survivors re-forming in-process with workers forked by hand.
This runs the same workers (bench/recovery_spike_worker.py: gloo groups per generation, a
step abandoned when its generation loses a member, state from the peer at the highest step)
as the workers of a TorchTrainer on a fake cluster (a head and three one-worker nodes), and
removes the node of rank --kill-rank mid-run. What keeps Ray Train from restarting the group
is one worker-group callback in the controller (wildtrain's `KeepSurvivors`), using only what Ray 2.60
already has for node preemption:

- after each poll, a worker whose error is its death (its actor or node gone) is masked as a
  worker that ended without error, once the rendezvous owner has published a generation
  without it (the poll waits up to --decide-s for that; past it, the error stands and Ray
  restarts the group: the fallback);
- the report consolidation (`ReportCallbackHandler.set_required_ranks`) is narrowed to the
  survivors, whose reports go past Ray's report barrier (`ray_compat.report_without_barrier`:
  the barrier would hold them for a dead rank 0); with --regrow-after-s the barrier is
  narrowed too (`WorkerGroup.set_required_barrier_ranks`), where rank 0 must survive.

The rendezvous owner (the TCPStore, heartbeats, generations: wildtrain.elastic.membership)
runs in this process, as it would in the controller. The reference is the same training
with nothing killed, by bench/recovery_spike.py's forked workers (no Ray): the batches are
a function of the step, so the losses and final parameters must match.

Prints: death -> first step at size 2 and its parts, steps redone, losses and parameters
against the reference, how the Ray Train run ended and the survivors' last report.

With --regrow-after-s, a node returns that long after the death. The group then runs with
`ray_compat.ReplacingTorchConfig` (a backend with one replica group per worker, as Ray's
torchft path has): the death is not masked but handed to the controller, which, once Ray
has marked the node dead (the callback waits for that: before, the dead rank's placement
slot still points at the dead node), replaces that worker alone on its placement group's
slot (`_replace_bad_workers`) while the survivors train on; when the node is back the slot is
placed there, the new worker starts, asks to join, and takes the state from the survivors.
Prints node back -> first step at size 3, split at the join request.

Once the replacement is in the owner's newest generation the callback widens the report
gates to every rank again, and its reports count (each worker reports once here, at the end;
a platform that reports every few steps must also line the replacement's reports up with the
survivors').

Not covered: the owner's death, rank 0's death with --regrow-after-s (Ray's replacement
path keeps its report barrier, which hands out rank 0's payload), wildtrain's data stream. With --zero the workers are bench/recovery_spike.py's
ZeRO workers (a real DeepSpeed engine, partitions mirrored by wildtrain.elastic.peer_state);
a rank that sees a failure hangs up only its groups' connections (elastic.connections), so
the Ray worker's own stay.

Usage: PYTHONPATH=platform:bench .venv/bin/python bench/recovery_spike_ray.py [--steps 60] [--kill-step 15]
       [--regrow-after-s 5 --steps 500] [--zero 1]
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
from recovery_spike import (drill, free_port, median_step, parse_args, read_logs, rendezvous_owner,  # noqa: E402
                            steps_done, steps_redone, trained_steps)
from recovery_spike_worker import HOST, Worker  # noqa: E402
from wildtrain import ray_compat  # noqa: E402
from wildtrain.elastic.survivors import KeepSurvivors  # noqa: E402
from wildtrain.elastic.rendezvous import announce_node, member_name, node_of  # noqa: E402

WORKERS = 3
SLOT = "spike_slot"
COMPARED_STEPS = 60
_KEPT: list = []  # each worker's spike Worker, so its broken groups are never destroyed


def train_fn(config: dict) -> None:
    """One Ray Train worker: the spike's worker named after its rank; its last report from
    the survivors' group."""
    rank = ray.train.get_context().get_world_rank()
    args = argparse.Namespace(**{**config, "worker": member_name(rank), "out": Path(config["out"])})
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    if args.zero:
        from recovery_spike_zero import ZeroWorker as worker_class
    else:
        worker_class = Worker
    worker = worker_class(args)
    _KEPT.append(worker)
    announce_node(worker.store, worker.name, ray.get_runtime_context().get_node_id())
    worker.train()
    ray_compat.report_without_barrier({"step": worker.step, "world": len(worker.membership.members)})


class SpikeSurvivors(KeepSurvivors, ray_compat.ReportCallback):
    """wildtrain's KeepSurvivors, and the reports the controller consolidates written into
    the store, for the table."""

    def after_report(self, training_report, metrics) -> None:
        self.store().set("consolidated", json.dumps(metrics))


def owner(args, port: int, cluster: Cluster, facts: dict, stop: threading.Event, return_node: threading.Event) -> None:
    """The rendezvous owner (bench/recovery_spike.py's), and the drill: the node of
    --kill-rank removed once --kill-step steps are done, and with --regrow-after-s, one
    returned that long after."""
    store = dist.TCPStore(HOST, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    facts["store"] = store
    owner = rendezvous_owner(args, store, WORKERS, facts)
    while not stop.is_set():
        now = time.time()
        done = steps_done(store)
        owner.turn(now, ending=done >= args.steps)
        if facts["killed"] is None and done >= args.kill_step:
            victim = member_name(args.kill_rank)
            node_id = node_of(store, victim)
            node = next(n for n in cluster.worker_nodes if n.node_id == node_id)
            cluster.remove_node(node, allow_graceful=False)
            facts["killed"], facts["victim"] = time.time(), victim
            say(f"  removed {victim}'s node after step {done}")
        if args.regrow_after_s and facts["killed"] and now - facts["killed"] >= args.regrow_after_s:
            return_node.set()  # Ray adds nodes from the main thread only
        time.sleep(0.01)


def ray_drill(args, out: Path) -> dict:
    port = free_port()
    facts = {"published": {}, "asked": {}, "killed": None, "victim": None, "returned": None, "out": out}
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 2, "_system_config": services.NODE_HEALTH_CHECKS})
    for _ in range(WORKERS):
        cluster.add_node(num_cpus=1, resources={SLOT: 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING")
    stop, return_node = threading.Event(), threading.Event()
    owner_thread = threading.Thread(target=owner, args=(args, port, cluster, facts, stop, return_node), daemon=True)
    owner_thread.start()
    try:
        config = {k: v for k, v in vars(args).items() if k not in ("also", "out")} | {"port": port, "out": str(out)}
        trainer = TorchTrainer(
            train_fn, train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=WORKERS, resources_per_worker={"CPU": 0, SLOT: 1}),
            torch_config=ray_compat.ReplacingTorchConfig(backend="gloo") if args.regrow_after_s
            else TorchConfig(backend="gloo"),
            run_config=RunConfig(name=f"spike-{int(time.time())}", storage_path=str(out / "ray"),
                                 failure_config=FailureConfig(max_failures=-1 if args.regrow_after_s else 0),
                                 callbacks=[SpikeSurvivors(HOST, port, args.decide_s, replace=bool(args.regrow_after_s))]))

        def fit() -> None:
            try:
                trainer.fit()
                facts["ended"] = "FINISHED"
            except Exception as e:  # noqa: BLE001 - the table says how it ended
                facts["ended"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"

        fitting = threading.Thread(target=fit, daemon=True)
        fitting.start()
        while fitting.is_alive():
            if return_node.wait(timeout=0.5) and facts["returned"] is None:
                cluster.add_node(num_cpus=1, resources={SLOT: 1})
                facts["returned"] = time.time()
                say(f"  a node returned {args.regrow_after_s:g} s after the death")
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
    survivors = [member_name(r) for r in range(WORKERS) if member_name(r) != facts["victim"]]
    losses = {}
    for rs in steps.values():
        for r in rs:
            losses.setdefault(r["step"], r["loss"])
    ref_losses = {r["step"]: r["loss"] for r in read_logs(reference["out"])["w0"] if "loss" in r}
    # With --zero, a step whose every mirror was in place when a death broke the all-reduce of
    # its loss is applied (the group re-forms past it) but its loss never logged.
    events = [r for rs in logs.values() for r in rs if "event" in r]
    applied_unlogged = sorted(s for s in set(range(args.steps)) - set(losses)
                              if any(r["event"] == "abandoned" and r["step"] == s for r in events)
                              and any(r["event"] == "formed" and r["step"] > s for r in events))
    missing = sorted(set(range(args.steps)) - set(losses) - set(applied_unlogged))
    if missing:
        raise RuntimeError(f"steps missing from the logs in {facts['out']}: {missing}")
    # Past the first resize the sums are taken in another order, and on this tiny model at this
    # learning rate a rounding difference grows about tenfold every 30 steps: the losses are
    # compared over the steps of a short run (test_elastic's), the weights only after one.
    compared = range(min(args.steps, COMPARED_STEPS))
    loss_diff = max(abs(losses[s] - ref_losses[s]) for s in compared if s in losses)
    params, ref_params = (torch.load(f["out"] / "params.pt") for f in (facts, reference))
    param_diff = (params - ref_params).abs().max().item()
    tol = 1e-3
    drifted = next((s for s in sorted(losses) if abs(losses[s] - ref_losses[s]) > tol), None)
    killed = facts["killed"]
    shrink_gen = min(g for g, (t, members) in facts["published"].items() if t >= killed)
    at_two = [r for n in survivors for r in steps[n] if r["gen"] == shrink_gen]
    first_small = min(r["t"] for r in at_two)
    formed = [r for n in survivors for r in logs[n] if r.get("event") == "formed" and r["gen"] == shrink_gen]
    abandoned = [r for n in survivors for r in logs[n] if r.get("event") == "abandoned" and r["t"] >= killed]
    first_abandon = min((r["t"] for r in abandoned), default=float("nan"))
    t_published = facts["published"][shrink_gen][0]
    t_formed, t_synced = max(r["formed"] for r in formed), max(r["synced"] for r in formed)
    regrow = []
    if facts["returned"] is not None:
        grow_gen = min(g for g, (t, members) in facts["published"].items()
                       if g > shrink_gen and len(members) == WORKERS)
        first_full = min(r["t"] for rs in steps.values() for r in rs if r["gen"] == grow_gen)
        asked = [r["t"] for r in logs[facts["victim"]] if r.get("event") == "asked" and r["t"] > facts["returned"]]
        last_small = max(r["t"] for r in at_two)
        step_full = median_step([r for r in steps[survivors[0]] if r["gen"] == grow_gen])
        regrow = [
            ("node back -> first step at size 3 (s)", f"{first_full - facts['returned']:.2f}"),
            ("  Ray placed and started the replacement worker; it asked to join (s)",
             f"{asked[0] - facts['returned']:.2f}"),
            ("  join request -> first step at size 3 (s)", f"{first_full - asked[0]:.2f}"),
            ("survivors' stop during the join (s)", f"{first_full - last_small - step_full:.2f}"),
        ]
    return [
        ("death (node removed) -> first step at size 2 (s)", f"{first_small - killed:.2f}"),
        ("  a survivor abandoned its step (s)", f"{first_abandon - killed:.2f}"),
        ("  found dead: generation of 2 published (s)", f"{t_published - killed:.2f}"),
        ("  rendezvous (gloo group built) (s)", f"{t_formed - t_published:.2f}"),
        ("  state sync (s)", f"{t_synced - t_formed:.2f}"),
        ("  first step at size 2 (s)", f"{first_small - t_synced:.2f}"),
        *regrow,
        ("steps redone", str(steps_redone(steps))),
        ("steps applied but not logged (mirrored everywhere; the death broke their loss's all-reduce)",
         str(applied_unlogged or "none")),
        (f"max |loss - reference| over steps 0-{compared[-1]}", f"{loss_diff:.2e}"),
        (f"max |param - reference| after step {args.steps - 1}", f"{param_diff:.2e}"),
        ("first step with |loss - reference| > 1e-3", "none" if drifted is None else str(drifted)),
        ("equal to the reference", "yes" if loss_diff <= tol and (param_diff <= tol or args.steps > COMPARED_STEPS)
         else f"NO (tolerance {tol})"),
        ("the Ray Train run ended", facts["ended"]),
        ("the report the controller consolidated (one per rank)", json.dumps(facts["report"])),
    ]


def main() -> None:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--regrow-after-s", type=float, default=0.0,
                     help="return a node this long after the death: Ray replaces the lost worker alone "
                          "(ray_compat.ReplacingTorchConfig) and it joins the survivors; 0: no return")
    mine, rest = own.parse_known_args()
    parser_args = parse_args(rest)
    parser_args.regrow_after_s = mine.regrow_after_s
    parser_args.decide_s = 5.0
    out = parser_args.out or Path(tempfile.mkdtemp(prefix="recovery-spike-ray-"))
    say(f"reference: {WORKERS} forked workers, {parser_args.steps} steps, nothing happens "
        f"(logs in {out / 'reference'})")
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
