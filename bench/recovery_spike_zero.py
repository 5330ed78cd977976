"""The ZeRO worker of bench/recovery_spike.py (`--zero 1|2`, issue 24): the spike's workers
with their state sharded by a real DeepSpeed ZeRO engine (wildtrain's `engine.build_engine`,
AdamW, the LR schedule, gradient clipping), a dead rank's partition recovered from a peer's
host memory, and the engine rebuilt in-process at every new size. No checkpoint is read.

- Mirrors (wildtrain.elastic.peer_state): after each optimizer step a rank copies its
  partition (fp32 master weights and AdamW's two moments) to host memory and sends the copy
  to the next rank of the ring, which keeps it; each keeps the last two steps of its own and
  of its predecessor's. A step is committed (logged, counted) only by the all-reduce after
  that exchange, which no rank passes before every mirror is in place: whoever dies then,
  its partition at the committed step lives on in its successor, and no committed step is
  ever redone.
- Re-form: the survivors (and joiners) of a new generation say which snapshots they hold;
  `membership.plan_repartition` picks the newest step held whole; the holders all-gather
  those partitions (`Mirrors.gather`); each rank builds a new engine at the new world size
  over a fresh module and copies in its new slice, the model's weights, AdamW's step and the
  schedule's position (`peer_state.load_state`). It then commits the new layout's mirrors
  before training on.
- The default process group is destroyed and made again per generation (on a PrefixStore of
  its own): DeepSpeed builds its data-parallel groups and partitions once, in `initialize`,
  from the default group, and releases its cached groups on `deepspeed.comm.destroy_process_group`.

What it leaves out is the spike's list (recovery_spike.py), plus: mirrors sent synchronously
inside the step (a platform would send them while the next forward and backward run), every
rank receiving the whole state at a re-form (it needs only its new slice), and ZeRO-3.
"""

from __future__ import annotations

import gc
import os
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from recovery_spike_worker import Abandoned, Worker, batch

REDUNDANCY_LOST_EXIT = 3  # recovery_spike.py expects it where a partition and its mirror are gone
from wildtrain.batching import BatchPlan
from wildtrain.config import load_config
from wildtrain.elastic.connections import GroupConnections
from wildtrain.elastic.membership import RedundancyLost, micro_batches
from wildtrain.elastic.peer_state import Mirrors, load_state
from wildtrain.elastic.rendezvous import report_error
from wildtrain.engine import build_engine, clone_world_group, import_deepspeed
from wildtrain.model.transformer import Transformer


def config(args):
    return load_config([f"model.max_seq_len={args.seq_len}", f"data.seq_len={args.seq_len}",
                        f"train.steps={args.steps}", f"optim.lr={args.lr}", f"deepspeed.zero_stage={args.zero}"])


class ZeroWorker(Worker):
    def init_state(self) -> None:
        self.cfg = config(self.args)
        self.deepspeed = import_deepspeed()
        self.engine = None
        self.mirrors = Mirrors(keep_steps=2)  # the committed step and the one in flight
        self.connections = GroupConnections()  # the current generation's gloo connections

    def commit(self, loss_sum: float, flag: float) -> torch.Tensor:
        """Mirror this rank's partition to its ring successor, then the all-reduce that commits
        the step (every mirror is in place once any rank is past it)."""
        try:
            self.mirrors.exchange(self.engine, self.step)
            self.mirrors.settle()
        except RuntimeError as e:
            self.mirrors.drop_in_flight()
            self.fail(e)
        totals = torch.tensor([loss_sum, flag], dtype=torch.float64)
        self.finish(dist.all_reduce(totals, async_op=True))
        return totals

    def finish(self, work) -> None:
        try:
            work.wait()
        except RuntimeError as e:
            self.fail(e)

    def fail(self, e: Exception):
        report_error(self.store, self.membership.generation)
        self.connections.hang_up()  # frees the peers that wait on this rank (elastic.connections)
        raise Abandoned(f"collective failed: {str(e).splitlines()[0][:200]}") from e

    # ---- re-forming ----

    def form(self) -> None:
        t0 = time.time()
        m = self.next_generation()
        t_published = time.time()
        rank, world = m.rank(self.name), len(m.members)
        # What a launcher would set, and DeepSpeed's initialize asserts (one worker per node here).
        os.environ.update(LOCAL_RANK="0", RANK=str(rank), WORLD_SIZE=str(world))
        if dist.is_initialized():
            self.engine = None
            if self.deepspeed.comm.comm.cdb is None:
                dist.destroy_process_group()  # Ray Train's group: DeepSpeed has not started on it
            else:
                self.deepspeed.comm.destroy_process_group()
            # The engine and its optimizer refer to each other: only a collection frees the old
            # group, whose destructor closes its connections. Until then a peer blocked in a
            # collective with this rank (not with the dead one) would wait out its timeout.
            gc.collect()
        self.membership = m
        self.connections = GroupConnections()
        self.arrive(m)
        try:
            # A member that died since the generation was published fails this (after the
            # timeout) or a collective below: either is one more generation, not the worker's end.
            timeout = timedelta(seconds=self.args.collective_timeout_s)
            with self.connections:  # every group of this generation, DeepSpeed's included
                dist.init_process_group("gloo", store=dist.PrefixStore(f"g{m.generation}/", self.store), rank=rank,
                                        world_size=world, timeout=timeout)
                # A survivor blocked in a collective that no hang-up frees waits out this
                # timeout, on DeepSpeed's reductions too.
                clone_world_group(self.deepspeed, timeout)
                t_formed = time.time()
                # The first generation: every member builds from the seed.
                plan, full = self.mirrors.gather(fresh=self.step == 0 and self.mirrors.layout is None)
                self.build(world, plan.step if plan else 0, full)
            self.mirrors.use_layout(m.generation, world)
            self.commit(0.0, 0.0)
        except RedundancyLost as e:
            self.record(event="redundancy_lost", why=str(e))
            raise SystemExit(REDUNDANCY_LOST_EXIT) from e
        except (RuntimeError, ValueError) as e:
            if isinstance(e, Abandoned):
                raise
            self.fail(e)
        self.record(event="formed", gen=m.generation, world=world, rank=rank, waited_from=t0,
                    published_seen=t_published, formed=t_formed, synced=time.time(),
                    source=None if plan is None else list(plan.sources), sent_state=plan is not None, step=self.step)

    def build(self, world: int, step: int, full) -> None:
        """A new engine at `world` over a fresh module, holding the state of `full` (from
        `Mirrors.gather`) at `step`; None: the seed's."""
        torch.manual_seed(self.args.seed)
        model = Transformer(self.cfg.model)
        plan = BatchPlan(world, 1, self.args.global_batch // world)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.engine = build_engine(self.cfg, plan, model, torch.device("cpu"))
        self.step = step
        if full is not None:
            load_state(self.engine, full, step, self.args.global_batch)

    # ---- training ----

    def train_one(self) -> bool:
        m, args = self.membership, self.args
        newest = self.newest_or_abandon()
        x, y = batch(args, self.step)
        loss_sum = 0.0
        try:
            for rows in micro_batches(args.global_batch, len(m.members), m.rank(self.name), 1):
                loss = self.engine(x[rows.start:rows.stop], targets=y[rows.start:rows.stop])
                self.engine.backward(loss)
                self.engine.step()
                loss_sum += loss.item() / args.global_batch
        except RuntimeError as e:
            self.fail(e)
        self.step += 1
        committing = time.time()
        try:
            totals = self.commit(loss_sum, float(newest.generation > m.generation))
        except Abandoned:
            self.step -= 1
            raise
        self.record(step=self.step - 1, loss=totals[0].item(), world=len(m.members), gen=m.generation,
                    commit_s=time.time() - committing)
        if m.rank(self.name) == 0:
            self.store.set("progress", str(self.step))
        return totals[1].item() > 0

    def drop_step(self) -> None:
        self.engine = None  # rebuilt at the re-form, from the snapshots

    def flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.engine.module.parameters()])
