"""The per-process worker of bench/recovery_spike.py (issue 24): trains wildtrain's tiny model
data-parallel in gloo groups it re-forms, without restarting, whenever the rendezvous owner
(the bench's process) publishes a new generation.

How the workers stay alive (the decisions are wildtrain.elastic.membership, unit-tested):

- The bench's process plays the rendezvous owner (the controller's role): it holds the
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
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from wildtrain.config import ModelConfig
from wildtrain.elastic.membership import Membership, micro_batches, must_abandon, plan_sync
from wildtrain.elastic.rendezvous import Heartbeat, ask_to_join, latest, report_error
from wildtrain.model.transformer import Transformer

HOST = "127.0.0.1"
INITIAL = ("w0", "w1", "w2")
SPARE = "w3"


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
        self.init_state()
        self.step = -1  # optimizer steps taken; -1: no state yet (until the first group forms)
        self.log = open(Path(args.out) / f"{self.name}.jsonl", "a", buffering=1)
        self.graveyard = []  # broken groups, never destroyed (see the module docstring)
        self.membership = Membership(0, ())
        self.pg = None
        self.heartbeat = None  # from the first join request on

    def init_state(self) -> None:
        torch.manual_seed(self.args.seed)
        self.model = Transformer(ModelConfig(max_seq_len=self.args.seq_len))
        self.params = list(self.model.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=self.args.lr, foreach=False)
        # AdamW's state, made now rather than at its first step: a joiner needs tensors to
        # receive into, and zeros at step 0 are what AdamW would have made.
        for p in self.params:
            self.opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                 "exp_avg_sq": torch.zeros_like(p)}

    def drop_step(self) -> None:
        """Forget the abandoned step's gradients: it is retried from the state before it."""
        self.opt.zero_grad(set_to_none=True)

    def flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def record(self, **fields) -> None:
        self.log.write(json.dumps({"t": time.time(), **fields}) + "\n")

    def ask_to_join(self) -> None:
        if self.heartbeat is None:
            self.heartbeat = Heartbeat(HOST, self.args.port, self.name, self.args.heartbeat_s)
        ask_to_join(self.store, self.name)

    def latest(self) -> Membership:
        return latest(self.store)

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
                    ask_to_join(self.store, self.name)
            time.sleep(0.005)

    def arrive(self, m) -> None:
        """Wait until every member of `m` is at its rendezvous, or give it up for a newer
        generation: a member that died after `m` was published would hold the group's
        construction until its timeout, where this wait sees the next generation at once."""
        self.store.set(f"arrived/{m.generation}/{self.name}", "1")
        while not self.store.check([f"arrived/{m.generation}/{name}" for name in m.members]):
            if self.latest().generation > m.generation:
                raise Abandoned(f"generation {m.generation} superseded before every member arrived")
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
        self.membership = m
        self.arrive(m)
        try:
            pg = dist.ProcessGroupGloo(dist.PrefixStore(f"g{m.generation}/", self.store), rank, len(m.members),
                                       timedelta(seconds=self.args.collective_timeout_s))
        except RuntimeError as e:  # a member died after arriving: one more generation
            report_error(self.store, m.generation)
            raise Abandoned(f"rendezvous failed: {str(e).splitlines()[0][:200]}") from e
        t_formed = time.time()
        steps = torch.zeros(len(m.members), dtype=torch.float64)
        steps[rank] = self.step
        self.wait(pg.allreduce([steps]))  # a member that dies now: one more generation
        sync = plan_sync([int(s) for s in steps])
        if sync.needed:
            tensors = self.state()
            flat = torch.cat([t.reshape(-1) for t in tensors])
            opts = dist.BroadcastOptions()
            opts.rootRank = sync.source
            self.wait(pg.broadcast([flat], opts))
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
            report_error(self.store, self.membership.generation)
            raise Abandoned(f"collective failed: {str(e).splitlines()[0][:200]}") from e

    def newest_or_abandon(self) -> Membership:
        """The newest generation, before a step; Abandoned if it drops one of our members."""
        newest = self.latest()
        if newest.generation > self.membership.generation and must_abandon(self.membership, newest):
            raise Abandoned(f"generation {newest.generation} drops a member")
        return newest

    def train_one(self) -> bool:
        """One optimizer step; whether the group must re-form after it."""
        m, args = self.membership, self.args
        newest = self.newest_or_abandon()
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
        self.train()
        # Skips the graveyard's destructors, which would wait out their broken collectives.
        os._exit(0)

    def train(self) -> None:
        if self.name == SPARE:
            # A replacement already started (its process start is Ray's, not measured here),
            # asking once the drill says it is schedulable.
            while not (self.store.check(["progress"]) and int(self.store.get("progress")) >= self.args.join_step):
                time.sleep(0.01)
        elif not self.latest().generation:
            self.step = 0  # every initial worker builds the same model from the seed
        # else: a replacement started while the others train (Ray's, in recovery_spike_ray.py):
        # it holds no state and takes it from them, as the spare does.
        self.ask_to_join()
        self.record(event="asked")
        while self.step < self.args.steps:
            try:
                self.form()  # --zero: a re-form can fail too (a member died during it)
                while self.step < self.args.steps and not self.train_one():
                    pass
            except Abandoned as e:
                self.drop_step()
                self.record(event="abandoned", gen=self.membership.generation, step=self.step, why=str(e))
                self.graveyard.append(self.pg)
        if self.membership.rank(self.name) == 0:
            torch.save(self.flat_params(), Path(self.args.out) / "params.pt")
        self.record(event="done", step=self.step)
        self.log.close()


def worker_main(args, name: str, port: int, out: Path) -> None:
    fd = os.open(out / f"{name}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    if args.zero:
        from recovery_spike_zero import ZeroWorker as worker_class
    else:
        worker_class = Worker
    worker_class(argparse.Namespace(**{**vars(args), "worker": name, "port": port, "out": out})).run()
