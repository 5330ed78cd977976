"""Spike for issue 24: survivors of a dead peer carry on in-process; a returning peer joins
without restarting them. No Ray: gloo process groups built by hand; with --zero, the state
sharded by a real DeepSpeed ZeRO engine and a dead rank's partition taken from a peer's
host memory (bench/recovery_spike_zero.py).

Two drills of the same training, one after the other: a reference (three workers, nothing
happens) and the drill (three workers; after --kill-step one is SIGKILLed; after --join-step
a spare asks to join). Each trains wildtrain's tiny model data-parallel on a fixed global batch
(--global-batch rows, a function of the step only), so a smaller world gives each rank more
rows to accumulate and the losses stay those of the reference. `--also` adds drills: a
survivor killed as the join's generation is published (a death during a regrow), and two
ring neighbours killed together (with --zero, more than the mirrors cover).

How the workers stay alive (their decisions are wildtrain.elastic.membership, unit-tested;
the worker itself is bench/recovery_spike_worker.py): this script's process plays the
rendezvous owner (the controller's role) and publishes each new generation; the workers
re-form a gloo group per generation, abandon a step whose generation lost a member, and
take the state from peers at each re-form: without --zero, all of it by broadcast from the
lowest rank at the highest step; with --zero, each old partition from its owner or from the
ring successor that mirrors it, re-cut for the new world (`membership.plan_repartition`).
No checkpoint is read.

Prints one table per drill: death -> first step at the smaller size (detection, rendezvous,
state sync, the step), join request -> first step at the full size, the survivors' stop
during the join, steps redone, and the losses and final parameters against the reference.

What it does not cover yet:
- The rendezvous owner's own death (here, the bench process; in Ray, the controller).
- ZeRO-3 (parameters sharded too); mirrors sent inside the step, not beside the next one;
  each rank receiving the whole old state at a re-form where it needs only its new slice.
- Data: batches are a function of the step; wildtrain's stream (Ray Data) would need its
  position per step, not per worker, to hand a dead rank's rows to the survivors.
- Worker start: workers are forked from this process, torch already imported, and the joiner
  is a spare forked at the start that asks at --join-step. "Join request -> first step"
  leaves out a replacement's process start and imports (13 s for torch and 10 s for
  torch._dynamo, which the first optimizer imports, on this loaded machine).
- Ray Train, MLflow, checkpoints (the restart-based fallback when redundancy is lost), GPUs
  and NCCL (whose abort, unlike gloo's, does end work in flight, but whose communicator init
  costs seconds at scale).

How it maps to DeepSpeed ZeRO (--zero): ZeRO-1/2 shard the optimizer state over the
data-parallel ranks, so a dead rank takes the only copy of its partition with it. Each rank
mirrors its partition (fp32 master weights and two moments, 12 bytes a parameter over N
ranks: 1.3 GB a step per rank for 7B on 64 ranks) to its ring successor's host memory; a
step is committed only once every mirror of it is in place (torchft's should_commit, in
effect), so a death costs at most the step in flight, never a committed one. DeepSpeed
builds its groups and partitions once, at initialize(): a resize destroys the default group
(DeepSpeed releases its cached groups with it), makes a new one, and builds a new engine
over a fresh module at the new size, then copies the re-cut state in. A loss beyond the
redundancy (a rank and its mirror's holder, the whole cluster) is RedundancyLost: the
workers stop with that reason, for today's restart from the checkpoint.

How it would map to Ray Train V2 (2.60): its controller restarts the whole worker group when
any worker dies (FailurePolicy -> a new group, new processes). Keeping survivors needs the
controller to treat a worker death as a resize that the group handles itself: the training
function owns membership (this script's rendezvous, with the controller, or a store actor, as
owner), Ray keeps placement and lifecycle (start a replacement worker when a node returns and
hand it the store's address). That means replacing the controller's failure handling and the
worker group's start for new members, Ray internals that ray_compat must confine, with a test
that fails when Ray changes them; Ray merged replica-group fault tolerance with torchft after
2.60 (PRs 61156, 61475), the design to follow once the pin moves.

torchft (0.2.0, read from its wheel: manager.py, process_group.py): a Lighthouse forms a
quorum of replica groups every step, recovering replicas fetch the full state from a peer at
max_step, should_commit makes the optimizer step all-or-nothing, and process groups are
reconfigured (gloo dropped, NCCL aborted, or run in a killable subprocess, ProcessGroupBaby).
Its unit of fault tolerance is a replica group that holds a complete copy of the state
(DDP, or HSDP: sharded within a group, replicated across), and its Manager drives the
gradient all-reduce through its own reconfigurable process group. DeepSpeed ZeRO shards over
all data-parallel ranks through groups it owns, so under ZeRO torchft would only fit as
replica groups of whole ZeRO engines (doubling memory per copy, or halving the model that
fits); wildtrain should borrow its protocol (per-step quorum, max-step source, should_commit)
rather than adopt the library under ZeRO.

Usage: nice -n 19 env PYTHONPATH=platform .venv/bin/python bench/recovery_spike.py [--steps 60]
       [--zero 1] [--also death-during-join two-at-once] [--kill-rank 0] [--kill-step 15] [--join-step 35] [--confirm-s 0.5] [--dead-after-s 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from progress import say
from recovery_spike_worker import HOST, INITIAL, SPARE, worker_main
from recovery_spike_zero import REDUNDANCY_LOST_EXIT
from wildtrain.elastic.rendezvous import RendezvousOwner


EXTRA_DRILLS = {
    "death-during-join": "as the first drill, and a survivor is killed as the join's generation is published",
    "two-at-once": "two ring neighbours killed together: with --zero, a partition and its mirror are gone",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kill-step", type=int, default=15, help="SIGKILL a worker once this many steps are done")
    p.add_argument("--kill-rank", type=int, default=1, help="the rank killed (0 makes another worker rank 0)")
    p.add_argument("--join-step", type=int, default=35, help="the spare asks to join once this many steps are done")
    p.add_argument("--global-batch", type=int, default=6)
    p.add_argument("--micro-batch", type=int, default=2, help="rows per micro-batch (--zero: 1)")
    p.add_argument("--zero", type=int, choices=(0, 1, 2), default=0,
                   help="shard the state with DeepSpeed ZeRO at this stage, mirrored to a peer "
                        "(recovery_spike_zero.py); 0: every worker holds the whole state")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heartbeat-s", type=float, default=0.1)
    p.add_argument("--dead-after-s", type=float, default=2.0, help="silent this long: dead")
    p.add_argument("--confirm-s", type=float, default=0.5,
                   help="after a failed collective, silent this long since: dead")
    p.add_argument("--collective-timeout-s", type=float, default=10.0)
    p.add_argument("--also", nargs="*", default=[], choices=EXTRA_DRILLS,
                   help="more drills after the first: " + "; ".join(f"{k}: {v}" for k, v in EXTRA_DRILLS.items()))
    p.add_argument("--out", type=Path, default=None, help="folder for the workers' logs (default: a temp dir)")
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def import_lazy_parts(zero: int) -> None:
    """What torch imports on first use, imported here once rather than in every worker:
    an optimizer's first construction imports torch._dynamo (10 s on this loaded machine);
    with --zero, DeepSpeed."""
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    if zero:
        from wildtrain.engine import import_deepspeed

        import_deepspeed()


def launch(args, name: str, port: int, out: Path) -> multiprocessing.Process:
    # Forked from this process, which has torch imported: a fresh interpreter's import takes
    # 13 s on this loaded 2-core machine, and a worker's start is not what is measured here.
    # Forked before this process starts the store's threads, which a fork would not copy.
    proc = multiprocessing.get_context("fork").Process(target=worker_main, args=(args, name, port, out), name=name)
    proc.start()
    return proc


def rendezvous_owner(args, store, initial: int, facts: dict) -> RendezvousOwner:
    """The rendezvous owner (the controller's role) of a drill, its request and publication
    times kept in `facts` ("asked", "published")."""
    owner = RendezvousOwner(store, initial, args.dead_after_s, args.confirm_s)
    facts["asked"], facts["published"] = owner.asked, owner.published
    return owner


def steps_done(store) -> int:
    """The steps rank 0 has done."""
    return int(store.get("progress")) if store.check(["progress"]) else 0


def drill(args, out: Path, chaos: bool, extra: str = "") -> dict:
    """Run one drill (`extra`: one of EXTRA_DRILLS, or the first) as the rendezvous owner;
    what it did, by time.time()."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = {name: launch(args, name, port, out) for name in INITIAL + ((SPARE,) if chaos else ())}
    store = dist.TCPStore(HOST, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    facts = {"published": {}, "asked": {}, "killed": None, "victim": None, "victims": set(), "killed_in_join": None,
             "out": out}
    owner = rendezvous_owner(args, store, len(INITIAL), facts)
    deadline = time.time() + 600
    try:
        while True:
            now = time.time()
            # A worker that failed on its own is a bug of this script, not a drill's death.
            running = [n for n, p in procs.items() if p.is_alive()]
            failed = [n for n, p in procs.items() if p.exitcode not in (None, 0) and n not in facts["victims"]
                      and not (extra == "two-at-once" and p.exitcode == REDUNDANCY_LOST_EXIT)]
            if failed:
                raise RuntimeError(f"worker {failed[0]} exited {procs[failed[0]].exitcode}; "
                                   f"see {out / (failed[0] + '.log')}")
            if not running or running == [SPARE] and facts["killed"]:
                return facts  # the spare waits for progress that stopped
            if now > deadline:
                raise TimeoutError(f"the drill in {out} did not end within 600 s; still running: {running}")
            done = steps_done(store)
            # At the end the workers stop beating as they exit: not deaths.
            nxt = owner.turn(now, ending=done >= args.steps)
            current = owner.current
            if nxt is not None:
                if extra == "death-during-join" and facts["killed"] and not facts["killed_in_join"] \
                        and len(nxt.members) == len(INITIAL):
                    victim = nxt.members[0]
                    procs[victim].kill()
                    facts["victims"].add(victim)
                    facts["killed_in_join"] = time.time()
                    say(f"  killed {victim} as generation {nxt.generation} (the join) was published")
            if chaos and facts["killed"] is None and done >= args.kill_step:
                facts["victim"] = current.members[args.kill_rank]
                facts["victims"] = {facts["victim"]}
                if extra == "two-at-once":
                    facts["victims"].add(current.members[(args.kill_rank + 1) % len(current.members)])
                for victim in facts["victims"]:
                    procs[victim].kill()
                facts["killed"] = time.time()
                say(f"  killed {', '.join(sorted(facts['victims']))} after step {done}")
            time.sleep(0.01)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
            p.join()


def read_logs(out: Path) -> dict[str, list[dict]]:
    return {f.stem: [json.loads(line) for line in f.read_text().splitlines()] for f in sorted(out.glob("w*.jsonl"))}


def median_step(records: list[dict]) -> float:
    """The median time between one worker's consecutive steps."""
    return statistics.median(b["t"] - a["t"] for a, b in zip(records, records[1:]))


def trained_steps(logs: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """Each worker's records of the steps it trained (and logged)."""
    return {n: [r for r in rs if "step" in r and "loss" in r] for n, rs in logs.items()}


def steps_redone(steps: dict[str, list[dict]]) -> int:
    """Steps a worker logged more than once: trained again after a recovery."""
    return sum(len(rs) - len({r["step"] for r in rs}) for rs in steps.values())


def analyse(args, facts: dict, reference: dict) -> list[tuple[str, str]]:
    """The table's rows, from the drill's and the reference's `facts` and their workers' logs."""
    logs = read_logs(facts["out"])
    steps = trained_steps(logs)
    survivors = [n for n in INITIAL if n != facts["victim"]]
    redone = steps_redone(steps)
    losses = {}
    for rs in steps.values():
        for r in rs:
            losses.setdefault(r["step"], r["loss"])
    ref_logs = read_logs(reference["out"])
    ref_losses = {r["step"]: r["loss"] for r in ref_logs["w0"] if "loss" in r}
    if sorted(losses) != list(range(args.steps)) or sorted(ref_losses) != list(range(args.steps)):
        raise RuntimeError(f"steps missing from the logs in {facts['out']} or {reference['out']}")
    loss_diff = max(abs(losses[s] - ref_losses[s]) for s in losses)
    params = torch.load(facts["out"] / "params.pt")
    ref_params = torch.load(reference["out"] / "params.pt")
    param_diff = (params - ref_params).abs().max().item()

    # The shrink: the first generation of two after the kill.
    killed = facts["killed"]
    shrink_gen = min(g for g, (t, members) in facts["published"].items() if t >= killed and len(members) == 2)
    grow_gen = min(g for g, (t, members) in facts["published"].items() if g > shrink_gen and len(members) == 3)
    def at(gen: int) -> list[dict]:
        return [r for n in survivors for r in steps[n] if r["gen"] == gen]

    first_small = min(r["t"] for r in at(shrink_gen))
    formed = [r for n in survivors for r in logs[n] if r.get("event") == "formed" and r["gen"] == shrink_gen]
    t_published = facts["published"][shrink_gen][0]
    t_formed, t_synced = max(r["formed"] for r in formed), max(r["synced"] for r in formed)
    abandoned = [r for n in survivors for r in logs[n] if r.get("event") == "abandoned" and r["t"] >= killed]
    first_abandon = min((r["t"] for r in abandoned), default=float("nan"))

    asked = facts["asked"][SPARE]
    first_full = min(r["t"] for r in at(grow_gen))
    last_small = max(r["t"] for r in at(shrink_gen))
    step_small, step_full = (median_step([r for r in steps[survivors[0]] if r["gen"] == g])
                             for g in (shrink_gen, grow_gen))
    joiner_formed = next(r for r in logs[SPARE] if r.get("event") == "formed")
    gap = first_full - last_small
    tol = 1e-3
    commits = [r["commit_s"] for r in steps[survivors[0]] if "commit_s" in r]
    mirrors = [("mirror to the ring successor + commit, median per step (s)",
                f"{statistics.median(commits):.3f} (in the step's time)")] if commits else []
    return mirrors + [
        ("death -> first step at size 2 (s)", f"{first_small - killed:.2f}"),
        ("  a survivor abandoned its step (s)", f"{first_abandon - killed:.2f}"),
        ("  found dead: generation of 2 published (s)", f"{t_published - killed:.2f}"),
        ("  rendezvous (gloo group built) (s)", f"{t_formed - t_published:.2f}"),
        ("  state sync (--zero: partitions gathered, engine rebuilt, mirrors committed) (s)",
         f"{t_synced - t_formed:.2f}"),
        ("  first step at size 2 (s)", f"{first_small - t_synced:.2f}"),
        ("join request -> first step at size 3 (s)", f"{first_full - asked:.2f}"),
        ("  state sync to the joiner (s)", f"{joiner_formed['synced'] - joiner_formed['formed']:.2f}"),
        ("survivors' stop during the join (s)", f"{gap - step_full:.2f} (gap {gap:.2f} - one step {step_full:.2f})"),
        ("median step at size 2 / 3 (s)", f"{step_small:.3f} / {step_full:.3f}"),
        ("step in flight at the death, retried at size 2", ", ".join(sorted({str(r["step"]) for r in abandoned}))),
        ("steps redone", str(redone)),
        ("generations (reference: 1)", str(max(facts["published"]))),
        ("max |loss - reference|", f"{loss_diff:.2e}"),
        ("max |param - reference|", f"{param_diff:.2e}"),
        ("final loss drill / reference", f"{losses[args.steps - 1]:.4f} / {ref_losses[args.steps - 1]:.4f}"),
        ("equal to the reference", "yes" if loss_diff <= tol and param_diff <= tol else f"NO (tolerance {tol})"),
    ]


def analyse_extra(args, facts: dict, reference: dict, extra: str) -> list[tuple[str, str]]:
    """The rows of an EXTRA_DRILLS drill."""
    logs = read_logs(facts["out"])
    if extra == "two-at-once":
        lost = [r for rs in logs.values() for r in rs if r.get("event") == "redundancy_lost"]
        steps_after = {r["step"] for rs in logs.values() for r in rs if "loss" in r and r["t"] > facts["killed"]}
        if not lost:
            return [("two neighbours killed -> survivors", f"trained on: {len(steps_after)} steps after the deaths")]
        return [("two neighbours killed -> survivors stop, state lost (s)",
                 f"{min(r['t'] for r in lost) - facts['killed']:.2f}, {len(steps_after)} steps trained after"),
                ("  their reason", lost[0]["why"][:150])]
    per_worker = trained_steps(logs)
    steps = [r for rs in per_worker.values() for r in rs]
    losses = {r["step"]: r["loss"] for r in steps}
    ref_losses = {r["step"]: r["loss"] for r in read_logs(reference["out"])["w0"] if "loss" in r}
    after = [r["t"] for r in steps if r["t"] > facts["killed_in_join"]]
    params = torch.load(facts["out"] / "params.pt")
    param_diff = (params - torch.load(reference["out"] / "params.pt")).abs().max().item()
    loss_diff = max(abs(losses[k] - ref_losses[k]) for k in ref_losses) if sorted(losses) == sorted(ref_losses) \
        else float("nan")
    return [("death during the join's re-form -> next step (s)", f"{min(after) - facts['killed_in_join']:.2f}"),
            ("steps redone", str(steps_redone(per_worker))),
            ("generations", str(max(facts["published"]))),
            ("max |loss - reference| / |param - reference|", f"{loss_diff:.2e} / {param_diff:.2e}")]


def print_table(title: str, rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    print(f"\n{title:<{width}}  value\n{'-' * width}  {'-' * 30}")
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def main() -> None:
    args = parse_args()
    if not 0 < args.kill_step < args.join_step < args.steps:
        raise SystemExit(f"need 0 < --kill-step ({args.kill_step}) < --join-step ({args.join_step}) "
                         f"< --steps ({args.steps})")
    if args.zero and args.global_batch % 6:
        raise SystemExit(f"--zero trains micro-batches of one row: --global-batch ({args.global_batch}) must be "
                         "a multiple of 6, for worlds of 2 and 3")
    root = args.out or Path(tempfile.mkdtemp(prefix="recovery-spike-"))
    import_lazy_parts(args.zero)
    say(f"reference: 3 workers, {args.steps} steps, nothing happens (logs in {root / 'reference'})")
    reference = drill(args, root / "reference", chaos=False)
    say(f"drill: 3 workers, kill rank {args.kill_rank} after step {args.kill_step}, the spare asks after step "
        f"{args.join_step} (logs in {root / 'drill'})")
    facts = drill(args, root / "drill", chaos=True)
    tables = [("measure", analyse(args, facts, reference))]
    for extra in args.also:
        say(f"drill {extra}: {EXTRA_DRILLS[extra]} (logs in {root / extra})")
        tables.append((extra, analyse_extra(args, drill(args, root / extra, chaos=True, extra=extra), reference, extra)))
    for title, rows in tables:
        print_table(title, rows)


if __name__ == "__main__":
    main()
