"""Spike for issue 24: survivors of a dead peer carry on in-process; a returning peer joins
without restarting them. No Ray, no DeepSpeed: gloo process groups built by hand.

Two drills of the same training, one after the other: a reference (three workers, nothing
happens) and the drill (three workers; after --kill-step one is SIGKILLed; after --join-step
a spare asks to join). Each trains wildtrain's tiny model data-parallel on a fixed global batch
(--global-batch rows, a function of the step only), so a smaller world gives each rank more
rows to accumulate and the losses stay those of the reference.

How the workers stay alive (the decisions are wildtrain.elastic.membership, unit-tested):

- This script's process plays the rendezvous owner (the controller's role): it holds the
  TCPStore, reads every worker's heartbeat (a key rewritten every --heartbeat-s by a thread)
  and join requests, and publishes each new generation: `members/<g>` then `gen` = g. A
  member is dead when silent for --dead-after-s (covers a hang, where nothing fails), or,
  once a worker reported a failed collective, silent since then for --confirm-s: the error
  comes within milliseconds of a death (the peer's sockets close) but does not say who died.
- A generation is a gloo group built on PrefixStore("g<g>/"), so no key of a broken group is
  ever read again. Workers never destroy or abort a broken group: gloo's abort() does not free
  a wait already in progress, and destroying a group with work in flight joins its threads,
  that is, waits for that work. They drop it (kept referenced until exit) and its threads end
  at the collective timeout (--collective-timeout-s).
- Each step all-reduces one buffer: the gradients, the loss, and a flag "I saw a newer
  generation". While it is in flight the worker polls the store; a newer generation that lacks
  one of its members (a death) makes it abandon the step: gradients dropped, no optimizer step,
  so the step is retried at the new size from the state before it. A newer generation that
  only adds joiners lets the step finish; the flag, summed, makes every rank re-form at the
  same step boundary.
- At each re-form the ranks all-reduce their step counts and take the state (parameters,
  AdamW moments, step) by broadcast from the lowest rank at the highest step: survivors can be
  one step apart (one finished the all-reduce the others saw fail), and a joiner has none.
  No checkpoint is read.

Prints one table: death -> first step at the smaller size (detection, rendezvous, state
sync, the step), join request -> first step at the full size, the survivors' stop during the
join, steps redone, and the losses and final parameters against the reference.

What it does not cover yet:
- A death during a re-form (rendezvous or state broadcast): the new group's constructor waits
  for the dead member until the collective timeout, and then needs another generation; the
  rendezvous owner's own death (here, the bench process; in Ray, the controller).
- Sharded state: every worker holds the whole model and optimizer (plain data parallelism).
- Data: batches are a function of the step; wildtrain's stream (Ray Data) would need its
  position per step, not per worker, to hand a dead rank's rows to the survivors.
- Worker start: workers are forked from this process, torch already imported, and the joiner
  is a spare forked at the start that asks at --join-step. "Join request -> first step"
  leaves out a replacement's process start and imports (13 s for torch and 10 s for
  torch._dynamo, which the first optimizer imports, on this loaded machine).
- Ray Train, MLflow, checkpoints (the restart-based fallback when redundancy is lost), GPUs
  and NCCL (whose abort, unlike gloo's, does end work in flight, but whose communicator init
  costs seconds at scale).

How it would map to DeepSpeed ZeRO: ZeRO-1/2/3 shard the optimizer state (and at stage 3 the
parameters) over the data-parallel ranks, so a dead rank takes the only copy of its partition
with it: the plan_sync broadcast has no source. Each rank would mirror its partition (fp32
master weights and two moments, 12 bytes a parameter over N ranks: 1.3 GB a step per rank
for 7B on 64 ranks) to a neighbour's host memory on another node (Gemini's placement),
copied after each optimizer step while the next forward and backward run. The mirrors must
hold one step that every rank agrees on: step k counts as committed when every mirror of it
is acknowledged (torchft's should_commit, in effect), and a death before that takes the
survivors back to k-1 from their own host copy, one step redone instead of all since the
checkpoint; mirroring every few steps trades bandwidth for that many. After a death the
survivors re-partition at the new size from host memory (what our reshard does from a
universal checkpoint). DeepSpeed builds its data-parallel groups and partitions once, at
initialize(): a resize means a new engine over the same module (or an engine that accepts a
new group), the part to measure next. A loss beyond the redundancy (a rank and its mirror's
host, the whole cluster) falls back to today's restart from the checkpoint.

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
       [--kill-rank 0] [--kill-step 15] [--join-step 35] [--confirm-s 0.5] [--dead-after-s 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from progress import say
from wildtrain.config import ModelConfig
from wildtrain.elastic.membership import (Membership, micro_batches, must_abandon, next_membership, plan_sync,
                                          stale)
from wildtrain.model.transformer import Transformer

HOST = "127.0.0.1"
INITIAL = ("w0", "w1", "w2")
SPARE = "w3"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kill-step", type=int, default=15, help="SIGKILL a worker once this many steps are done")
    p.add_argument("--kill-rank", type=int, default=1, help="the rank killed (0 makes another worker rank 0)")
    p.add_argument("--join-step", type=int, default=35, help="the spare asks to join once this many steps are done")
    p.add_argument("--global-batch", type=int, default=6)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heartbeat-s", type=float, default=0.1)
    p.add_argument("--dead-after-s", type=float, default=2.0, help="silent this long: dead")
    p.add_argument("--confirm-s", type=float, default=0.5,
                   help="after a failed collective, silent this long since: dead")
    p.add_argument("--collective-timeout-s", type=float, default=10.0)
    p.add_argument("--out", type=Path, default=None, help="folder for the workers' logs (default: a temp dir)")
    return p.parse_args(argv)


# ---------------------------------------------------------------- worker


def batch(args, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: rows counting from a random start by a random stride
    (mod 256), learnable, and the same whoever computes it."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    start = torch.randint(0, 256, (args.global_batch, 1), generator=g)
    stride = torch.randint(1, 8, (args.global_batch, 1), generator=g)
    rows = (start + stride * torch.arange(args.seq_len + 1)) % 256
    return rows[:, :-1], rows[:, 1:]


class Abandoned(Exception):
    pass


class Worker:
    def __init__(self, args):
        self.args, self.name = args, args.worker
        timeout = timedelta(seconds=60)
        self.store = dist.TCPStore(HOST, args.port, is_master=False, timeout=timeout)
        torch.manual_seed(args.seed)
        self.model = Transformer(ModelConfig(max_seq_len=args.seq_len))
        self.params = list(self.model.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=args.lr, foreach=False)
        # AdamW's state, made now rather than at its first step: a joiner needs tensors to
        # receive into, and zeros at step 0 are what AdamW would have made.
        for p in self.params:
            self.opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                 "exp_avg_sq": torch.zeros_like(p)}
        self.step = -1  # optimizer steps taken; -1: no state yet (until the first group forms)
        self.log = open(Path(args.out) / f"{self.name}.jsonl", "a", buffering=1)
        self.graveyard = []  # broken groups, never destroyed (see the module docstring)
        self.membership = Membership(0, ())
        self.pg = None

    def record(self, **fields) -> None:
        self.log.write(json.dumps({"t": time.time(), **fields}) + "\n")

    def beat(self) -> None:
        # A client of its own: the main thread's may be in a long get.
        store = dist.TCPStore(HOST, self.args.port, is_master=False, timeout=timedelta(seconds=60))
        while True:
            store.set(f"hb/{self.name}", repr(time.time()))
            time.sleep(self.args.heartbeat_s)

    def ask_to_join(self) -> None:
        threading.Thread(target=self.beat, daemon=True).start()
        time.sleep(self.args.heartbeat_s)  # the first beat is in before the owner reads it
        n = self.store.add("joins", 1)
        self.store.set(f"join/{n}", f"{self.name} {time.time()!r}")

    def latest(self) -> Membership:
        g = int(self.store.get("gen")) if self.store.check(["gen"]) else 0
        return Membership(g, tuple(self.store.get(f"members/{g}").decode().split(","))) if g else Membership(0, ())

    def next_generation(self) -> Membership:
        """Wait for a generation newer than ours that includes us."""
        while True:
            newest = self.latest()
            if newest.generation > self.membership.generation:
                if self.name in newest.members:
                    return newest
                if self.membership.generation:
                    # Found dead while alive (a stalled heartbeat): ask again, as a joiner.
                    self.record(event="excluded", gen=newest.generation)
                    self.step, self.membership = -1, newest
                    n = self.store.add("joins", 1)
                    self.store.set(f"join/{n}", f"{self.name} {time.time()!r}")
            time.sleep(0.005)

    def state(self) -> list[torch.Tensor]:
        out = [p.data for p in self.params]
        for p in self.params:
            s = self.opt.state[p]
            out += [s["exp_avg"], s["exp_avg_sq"], s["step"].view(1)]
        return out

    def form(self) -> None:
        t0 = time.time()
        m = self.next_generation()
        t_published = time.time()
        rank = m.rank(self.name)
        pg = dist.ProcessGroupGloo(dist.PrefixStore(f"g{m.generation}/", self.store), rank, len(m.members),
                                   timedelta(seconds=self.args.collective_timeout_s))
        t_formed = time.time()
        steps = torch.zeros(len(m.members), dtype=torch.float64)
        steps[rank] = self.step
        pg.allreduce([steps]).wait()
        sync = plan_sync([int(s) for s in steps])
        if sync.needed:
            tensors = self.state()
            flat = torch.cat([t.reshape(-1) for t in tensors])
            opts = dist.BroadcastOptions()
            opts.rootRank = sync.source
            pg.broadcast([flat], opts).wait()
            for t, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
                t.copy_(piece.view_as(t))
        self.step = sync.step
        self.pg, self.membership = pg, m
        self.record(event="formed", gen=m.generation, world=len(m.members), rank=rank, waited_from=t0,
                    published_seen=t_published, formed=t_formed, synced=time.time(), source=sync.source,
                    sent_state=sync.needed, step=self.step)

    def wait(self, work) -> None:
        """Until `work` finishes, or a newer generation drops one of our members."""
        polled = time.monotonic()
        while not work.is_completed():
            time.sleep(0.001)
            if time.monotonic() - polled > 0.02:
                polled = time.monotonic()
                newest = self.latest()
                if newest.generation > self.membership.generation and must_abandon(self.membership, newest):
                    raise Abandoned(f"generation {newest.generation} drops a member")
        try:
            work.wait()
        except RuntimeError as e:
            self.store.set(f"error/{self.membership.generation}", repr(time.time()))
            raise Abandoned(f"collective failed: {str(e).splitlines()[0][:200]}") from e

    def train_one(self) -> bool:
        """One optimizer step; whether the group must re-form after it."""
        m, args = self.membership, self.args
        newest = self.latest()
        if newest.generation > m.generation and must_abandon(m, newest):
            raise Abandoned(f"generation {newest.generation} drops a member")
        x, y = batch(args, self.step)
        loss_sum = 0.0
        for rows in micro_batches(args.global_batch, len(m.members), m.rank(self.name), args.micro_batch):
            loss = self.model(x[rows.start:rows.stop], targets=y[rows.start:rows.stop])
            # Weighted by rows over the global batch: the summed gradient is the global mean's.
            share = len(rows) / args.global_batch
            (loss * share).backward()
            loss_sum += loss.item() * share
        flag = float(newest.generation > m.generation)
        buf = torch.cat([p.grad.reshape(-1) for p in self.params] + [torch.tensor([loss_sum, flag])])
        self.wait(self.pg.allreduce([buf]))
        for p, g in zip(self.params, buf[:-2].split([p.numel() for p in self.params])):
            p.grad = g.view_as(p)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.record(step=self.step, loss=buf[-2].item(), world=len(m.members), gen=m.generation)
        self.step += 1
        if m.rank(self.name) == 0:
            self.store.set("progress", str(self.step))
        return buf[-1].item() > 0

    def run(self) -> None:
        if self.name == SPARE:
            # A replacement already started (its process start is Ray's, not measured here),
            # asking once the drill says it is schedulable.
            while not (self.store.check(["progress"]) and int(self.store.get("progress")) >= self.args.join_step):
                time.sleep(0.01)
        else:
            self.step = 0  # every initial worker builds the same model from the seed
        self.ask_to_join()
        self.record(event="asked")
        while self.step < self.args.steps:
            self.form()
            try:
                while self.step < self.args.steps and not self.train_one():
                    pass
            except Abandoned as e:
                self.opt.zero_grad(set_to_none=True)
                self.record(event="abandoned", gen=self.membership.generation, step=self.step, why=str(e))
                self.graveyard.append(self.pg)
        if self.membership.rank(self.name) == 0:
            torch.save(torch.cat([p.detach().reshape(-1) for p in self.params]), Path(self.args.out) / "params.pt")
        self.record(event="done", step=self.step)
        self.log.close()
        # Skips the graveyard's destructors, which would wait out their broken collectives.
        os._exit(0)


# ---------------------------------------------------------------- rendezvous owner and drill


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def worker_main(args, name: str, port: int, out: Path) -> None:
    fd = os.open(out / f"{name}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    Worker(argparse.Namespace(**{**vars(args), "worker": name, "port": port, "out": out})).run()


def import_lazy_parts() -> None:
    """What torch imports on first use, imported here once rather than in every worker:
    an optimizer's first construction imports torch._dynamo (10 s on this loaded machine)."""
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])


def launch(args, name: str, port: int, out: Path) -> multiprocessing.Process:
    # Forked from this process, which has torch imported: a fresh interpreter's import takes
    # 13 s on this loaded 2-core machine, and a worker's start is not what is measured here.
    # Forked before this process starts the store's threads, which a fork would not copy.
    proc = multiprocessing.get_context("fork").Process(target=worker_main, args=(args, name, port, out), name=name)
    proc.start()
    return proc


def drill(args, out: Path, chaos: bool) -> dict:
    """Run one drill as the rendezvous owner; what it did, by time.time()."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = {name: launch(args, name, port, out) for name in INITIAL + ((SPARE,) if chaos else ())}
    store = dist.TCPStore(HOST, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    current, pending, seen_joins, errors = Membership(0, ()), [], 0, {}
    facts = {"published": {}, "asked": {}, "killed": None, "victim": None, "out": out}
    deadline = time.time() + 600
    try:
        while True:
            now = time.time()
            # A worker that failed on its own is a bug of this script, not a drill's death.
            running = [n for n, p in procs.items() if p.is_alive()]
            failed = [n for n, p in procs.items() if p.exitcode not in (None, 0) and n != facts["victim"]]
            if failed:
                raise RuntimeError(f"worker {failed[0]} exited {procs[failed[0]].exitcode}; "
                                   f"see {out / (failed[0] + '.log')}")
            if not running:
                return facts
            if now > deadline:
                raise TimeoutError(f"the drill in {out} did not end within 600 s; still running: {running}")
            joins = store.add("joins", 0)
            for n in range(seen_joins + 1, joins + 1):
                name, t = store.get(f"join/{n}").decode().split()
                pending.append(name)
                facts["asked"][name] = float(t)
            seen_joins = joins
            progress = int(store.get("progress")) if store.check(["progress"]) else 0
            if progress >= args.steps:
                nxt = None  # the workers stop beating as they exit: not deaths
            elif current.generation == 0:
                nxt = Membership(1, tuple(sorted(pending))) if len(set(pending)) == len(INITIAL) else None
            else:
                # A member whose heartbeat thread has not written yet counts from its request.
                beats = {m: float(store.get(f"hb/{m}")) if store.check([f"hb/{m}"]) else facts["asked"][m]
                         for m in current.members}
                error_key = f"error/{current.generation}"
                if current.generation not in errors and store.check([error_key]):
                    errors[current.generation] = float(store.get(error_key))
                error_at = errors.get(current.generation)
                dead = stale(beats, now, args.dead_after_s, error_at, args.confirm_s)
                nxt = next_membership(current, dead, pending, None if error_at is None else now - error_at,
                                      args.confirm_s)
            if nxt is not None:
                store.set(f"members/{nxt.generation}", ",".join(nxt.members))
                store.set("gen", str(nxt.generation))
                facts["published"][nxt.generation] = (time.time(), nxt.members)
                pending = [p for p in pending if p not in nxt.members]
                current = nxt
            if chaos and facts["killed"] is None and progress >= args.kill_step:
                facts["victim"] = current.members[args.kill_rank]
                procs[facts["victim"]].kill()
                facts["killed"] = time.time()
                say(f"  killed {facts['victim']} (rank {args.kill_rank}) after step {progress}")
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


def analyse(args, facts: dict, reference: dict) -> list[tuple[str, str]]:
    """The table's rows, from the drill's and the reference's `facts` and their workers' logs."""
    logs = read_logs(facts["out"])
    steps = {n: [r for r in rs if "step" in r and "loss" in r] for n, rs in logs.items()}
    survivors = [n for n in INITIAL if n != facts["victim"]]
    redone = sum(len(rs) - len({r["step"] for r in rs}) for n, rs in steps.items())
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
    return [
        ("death -> first step at size 2 (s)", f"{first_small - killed:.2f}"),
        ("  a survivor abandoned its step (s)", f"{first_abandon - killed:.2f}"),
        ("  found dead: generation of 2 published (s)", f"{t_published - killed:.2f}"),
        ("  rendezvous (gloo group built) (s)", f"{t_formed - t_published:.2f}"),
        ("  step count + state sync (s)", f"{t_synced - t_formed:.2f}"),
        ("  first step at size 2 (s)", f"{first_small - t_synced:.2f}"),
        ("join request -> first step at size 3 (s)", f"{first_full - asked:.2f}"),
        ("  state broadcast to the joiner (s)", f"{joiner_formed['synced'] - joiner_formed['formed']:.2f}"),
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


def main() -> None:
    args = parse_args()
    if not 0 < args.kill_step < args.join_step < args.steps:
        raise SystemExit(f"need 0 < --kill-step ({args.kill_step}) < --join-step ({args.join_step}) "
                         f"< --steps ({args.steps})")
    root = args.out or Path(tempfile.mkdtemp(prefix="recovery-spike-"))
    import_lazy_parts()
    say(f"reference: 3 workers, {args.steps} steps, nothing happens (logs in {root / 'reference'})")
    reference = drill(args, root / "reference", chaos=False)
    say(f"drill: 3 workers, kill rank {args.kill_rank} after step {args.kill_step}, the spare asks after step "
        f"{args.join_step} (logs in {root / 'drill'})")
    facts = drill(args, root / "drill", chaos=True)
    rows = analyse(args, facts, reference)
    width = max(len(k) for k, _ in rows)
    print(f"\n{'measure':<{width}}  value\n{'-' * width}  {'-' * 30}")
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
