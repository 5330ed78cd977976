"""The per-worker training function that Ray Train runs on every worker of the group.

It reads in the order it runs: check the storage, open the control group, build the
attempt (train/attempt.py: plan the batch for this world size, check the group's health,
restore the newest checkpoint into a new engine), then step it, and at the steps due for it
validate, save, report and regrow, until the run's last step. A worker group that Ray Train
restarts (a node died, capacity came back) re-enters here at its new size.

A rank that fails ends the attempt on every rank (`collectives.failing_together`): its
peers leave the collective they wait in instead of waiting out its timeout. Whether the
worker group ends with it is its membership's to say (train/membership.py): on the restart
path it does, and Ray restarts the group from the checkpoint.

With elastic.in_process a member's death does not end the worker group: the survivors drop
their attempt, form the next generation of their membership at the smaller size
(`train.in_process`) and build the next attempt from the state their peers mirrored,
in the same processes (`train_generations`). Each step's ZeRO partitions are mirrored on the
ring successors while the next step trains, and a step commits once every mirror of it is in
place (with the next step's commit, or at once where it saves): no committed step is redone,
and a step a death cut short is done again whole. A worker the controller
starts on a lost member's placement slot joins the members (`join_in_process`): they hand
their state over at their next log step to the generation that includes it.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from typing import Callable, Optional

import psutil
import ray.train
import ray.train.torch
import torch

from wildtrain.checkpoint.save_process import SaveProcess
from wildtrain.config import Config
from wildtrain.elastic.scaling import backend, trains_on_gpu
from wildtrain.elastic.signals import MembersJoining, PlannedRegrow
from wildtrain.engine import import_ahead
from wildtrain.tracking.worker.mfu import device_peak
from wildtrain.train import checkpointing, collectives
from wildtrain.train.attempt import Attempt
from wildtrain.train.generations import Leftovers
from wildtrain.train.growth import Growth
from wildtrain.train.in_process import Member
from wildtrain.train.membership import InProcessMembership, Membership, RestartMembership
from wildtrain.train.schedule import At
from wildtrain.worker_inputs import LoopInputs


def train_loop(inputs: LoopInputs) -> None:
    cfg = inputs.cfg
    collectives.open_control_group(control_timeout_s(cfg))
    # Ray Train set this worker's CUDA device: NCCL's collectives and the batches go there.
    device = ray.train.torch.get_device() if trains_on_gpu(cfg.cluster) else torch.device("cpu")
    context = ray.train.get_context()
    membership: Membership = RestartMembership()
    if inputs.rendezvous is not None:
        member = Member.of_ray_worker(
            inputs.rendezvous,
            context.get_world_rank(),
            context.get_world_size(),
            ray.get_runtime_context().get_node_id(),
            cfg.elastic,
            backend(cfg.cluster),
            control_timeout_s(cfg),
        )
        membership = InProcessMembership(member)
    with collectives.failing_together(context.get_world_rank(), store=membership.peer_store) as watch:
        train_generations(inputs, device, membership, None, watch.failed_peer)


def train(attempt: Attempt) -> None:
    """Step `attempt` to the run's last step."""
    cfg = attempt.cfg
    try:
        if attempt.re_formed_at_the_end():
            # The last step committed, and a member died before its report went: it goes now.
            attempt.report(At(cfg.train.steps, first=True, last=True), logs=False, saving=False, must_commit=True)
        while attempt.state.step < cfg.train.steps:
            at = attempt.step()
            # Each component says whether this step is due for it, in the order they run.
            validated = attempt.validate(at)
            logs = attempt.reports.logs(at, validated)
            growth = attempt.growth.due(at, logs)
            regrow = growth is Growth.RESTART
            saving = checkpointing.due(at, cfg.checkpoint, regrow)
            if saving:
                regrow = attempt.save(at, regrow)
            # A step saved (whose report lets its save commit) or joined at commits now; every
            # other step with the next one.
            attempt.commit(flush=saving or growth is Growth.JOIN)
            if attempt.reports.due(logs, saving):
                attempt.report(at, logs, saving, checkpointing.must_commit(at, regrow), hold=growth is Growth.JOIN)
            if attempt.diverged:
                break  # a diverged trial's checkpoint is worth nothing: no last save
            if regrow:
                raise PlannedRegrow(
                    f"room for more than {attempt.world_size} workers; "
                    f"regrowing from the checkpoint of step {attempt.state.step}"
                )
            if growth is Growth.JOIN:
                raise MembersJoining(
                    f"workers ask to join the group of {attempt.world_size} after step {attempt.state.step}"
                )
    finally:
        attempt.watchdog.stop()


def join_in_process(
    inputs: LoopInputs, token: str, name: str, group_size: int, first_read: Future, called_at: float
) -> None:
    """A worker the controller started on a lost member's placement slot (`elastic.survivors`):
    it joins the group registered under `token` as `name` and trains in its generations from
    the state the members hold. No Ray Train worker: its generation's rank 0 reports.
    `first_read`: its first read through Ray Data, started when Ray called it, at `called_at`
    (`train.entry.joiner_main`)."""
    cfg = inputs.cfg
    # Ray shows the actor its slot's one GPU as device 0, where Ray Train sets a worker's device itself.
    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed reads it
    device = torch.device("cpu")
    if trains_on_gpu(cfg.cluster):
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    member = Member.joining(
        inputs.rendezvous,
        token,
        name,
        group_size,
        ray.get_runtime_context().get_node_id(),
        cfg.elastic,
        backend(cfg.cluster),
        control_timeout_s(cfg),
    )
    try:
        left = ready_to_join(inputs, device, first_read)
        started_at, asked_at = psutil.Process().create_time(), time.time()
        print(
            f"{name} asks to join, {asked_at - started_at:.1f} s after its process started: "
            f"{called_at - started_at:.1f} s until Ray called it (its worker process), "
            f"{asked_at - called_at:.1f} s getting ready (the imports of torch, Ray Train, the engine's, "
            f"and the first read beside them)",
            flush=True,
        )
        member.ask()
        train_generations(inputs, device, InProcessMembership(member), left, lambda: None)
    finally:
        member.heartbeat.stop()  # ended or failed: either way no member any more


def ready_to_join(inputs: LoopInputs, device: torch.device, first_read: Future) -> Leftovers:
    """What a process's first attempt does for the first time, and slowly (seconds each,
    against milliseconds after: docs/benchmarks.md), done by a joiner before it asks to join, where the members
    would otherwise wait for it: the first engine build's imports, its save process's start,
    Ray Data's first read (`first_read`, under way), and the device's peak FLOP/s (measured on
    a CPU). The save process imports in a process of its own, and the first read mostly waits
    for Ray's read tasks: both run beside the imports."""
    cfg = inputs.cfg
    save_process = SaveProcess() if cfg.checkpoint.background == "process" else None
    import_ahead()
    first_read.result()
    device_peak(device, cfg.cluster.peak_flops_per_device)
    return Leftovers.joiner(save_process)


def train_generations(
    inputs: LoopInputs,
    device: torch.device,
    membership: Membership,
    left: Optional[Leftovers],
    peer_failure: Callable[[], Optional[str]],
) -> None:
    """Train in the groups of this worker's `membership`: where a member is lost, drop the
    attempt, form the next group and go on from the state the members hold; where workers
    join, hand the state over to the group that includes them. Every other error stands and
    ends the worker group (on the restart path, every error does)."""
    while True:
        attempt = None
        try:
            attempt = Attempt(inputs, device, membership.form(left))
            train(attempt)
            membership.leave()
            return
        except MembersJoining:
            left = attempt.hand_over()
        except Exception as e:
            failed_at = time.time()
            if not membership.lost_member(e, peer_failure):
                raise
            if attempt is not None:
                left = attempt.abandon(e, failed_at, left)
            elif left is not None:
                left = left.without_saves_in_flight()


def control_timeout_s(cfg: Config) -> float:
    """The bound of the control group's waits (`collectives`): the longest that one rank may
    legitimately wait for another is a restore's conversion (bounded by the start-up
    watchdog) or a save that must commit (checkpoint.timeout_s)."""
    return max(cfg.monitor.startup_timeout_s or _NO_BOUND_S, cfg.checkpoint.timeout_s)


_NO_BOUND_S = 7 * 24 * 3600.0  # monitor.startup_timeout_s=0 (off): no bound of ours, but torch needs one
