"""The worker's side of checkpoints: restore the newest good one into a new engine at this
world size, and save one (in the background, or waiting for its commit where the run
cannot go on without it), with what the controller logs about each save.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from wildtrain import checkpoint
from wildtrain.batching import BatchPlan
from wildtrain.checkpoint import reshard, save_policy, shm, universal
from wildtrain.checkpoint.async_save import AsyncSaver, CheckpointMeta
from wildtrain.checkpoint.format import needs_universal
from wildtrain.checkpoint.restore import Candidate, restore
from wildtrain.checkpoint.save_policy import SaveOutcome
from wildtrain.checkpoint.store import CommitError, Store
from wildtrain.config import CheckpointConfig
from wildtrain.elastic.peer_state import Mirrors, Reform, load_state
from wildtrain.engine import EngineSettings, build_engine, build_model
from wildtrain.events import (
    CheckpointFailed,
    CheckpointFallback,
    CheckpointPartial,
    CheckpointSkipped,
    Event,
    ShmTooSmall,
)
from wildtrain.model import param_count
from wildtrain.train import collectives
from wildtrain.train.schedule import At, every
from wildtrain.train.state import TrainState


@dataclass(frozen=True)
class RestoreTiming:
    """Where a restore's time went: the controller splits the recovery time with it
    (`worker_report.Startup`)."""

    restore_s: float
    reshard_s: float
    engine_build_s: float


@dataclass
class Restored:
    candidate: Optional[Candidate]  # None: nothing to restore, the run starts from scratch
    timing: RestoreTiming
    events: list[CheckpointFallback]  # committed checkpoints passed over, and why


def build_and_restore(
    settings: EngineSettings,
    staging_dir: str,
    plan: BatchPlan,
    world_size: int,
    rank: int,
    stores: list[Store],
    device: torch.device,
):
    """The engine of `settings` with the newest good committed checkpoint loaded, the state
    saved with it, and what the restore did. A checkpoint saved at another world size is
    loaded from its universal copy in the store, which rank 0 makes (staged in `staging_dir`,
    checkpoint.staging_dir) unless the controller made it ahead. `device`: the worker's
    training device."""
    started = time.perf_counter()
    reshard_s = engine_build_s = 0.0

    def new_engine(load_universal: bool = False):
        nonlocal engine_build_s
        engine, engine_build_s = timed_engine(settings, plan, device, load_universal)
        return engine

    def universal_copy(store: Store, candidate: Candidate):
        nonlocal reshard_s
        converting = time.perf_counter()
        copy = None
        if rank == 0:
            try:
                copy = reshard.convert_in_store(store, candidate.name, candidate.manifest, staging_dir, in_process=True)
            except Exception as e:  # the candidate is passed over like one that fails verification
                copy = f"converting it to the universal format failed: {e}"
        copy = collectives.broadcast_object(copy)
        reshard_s += time.perf_counter() - converting
        if isinstance(copy, str):
            raise CommitError(copy)
        return copy

    local = tempfile.mkdtemp(prefix=f"wildtrain-restore-rank{rank}-")
    try:
        restored = restore(
            stores,
            local,
            rank=rank,
            world_size=world_size,
            agree=collectives.all_ranks,
            listing=lambda list_them: collectives.broadcast_object(list_them() if rank == 0 else None),
            universal_copy=universal_copy,
        )
        if restored is None:
            engine = new_engine()
            return (
                engine,
                TrainState(world_size=world_size),
                Restored(None, RestoreTiming(0.0, 0.0, engine_build_s), []),
            )
        events = [CheckpointFallback(time.time(), s.store, s.name, s.step, s.reason) for s in restored.skipped]
        state = TrainState.from_json(checkpoint.read_client_state(restored.folder))
        universal_load = needs_universal(restored.manifest, world_size)
        engine = new_engine(load_universal=universal_load)
        (universal.load if universal_load else checkpoint.load)(engine, restored.folder, restored.manifest.tag)
    finally:
        shutil.rmtree(local, ignore_errors=True)
    timing = RestoreTiming(
        restore_s=time.perf_counter() - started - reshard_s, reshard_s=reshard_s, engine_build_s=engine_build_s
    )
    return engine, state, Restored(restored.candidate, timing, events)


@dataclass(frozen=True)
class HeldByPeers:
    """The state the members of a re-formed group kept (elastic.in_process): the train state
    of the newest step whose every ZeRO partition some member holds, and who holds each
    (`Mirrors.agree`); the partitions themselves move once the engine is built
    (`restore_from_peers`)."""

    state: TrainState
    mirrors: Mirrors
    reform: Reform
    gather_s: float


def gather_from_peers(mirrors: Mirrors, states: dict[int, TrainState], world_size: int) -> HeldByPeers:
    """Collectively, what the group continues from (`Mirrors.agree`; `RedundancyLost` where no
    step is whole); `states`: this rank's committed steps (a joiner has none)."""
    started = time.perf_counter()
    reform = mirrors.agree(fresh=False)
    state = next(held[reform.step] for held in collectives.all_gather_object(states) if reform.step in held)
    return HeldByPeers(replace(state, world_size=world_size), mirrors, reform, time.perf_counter() - started)


def restore_from_peers(settings: EngineSettings, plan: BatchPlan, device: torch.device, held: HeldByPeers):
    """What `build_and_restore` returns, from the state the members of a re-formed group
    kept (`gather_from_peers`) rather than from a checkpoint: each rank's new partition
    assembled from the slices of the old ones that overlap it (`peer_state.load_state`)."""
    started = time.perf_counter()
    engine, engine_build_s = timed_engine(settings, plan, device)
    load_state(engine, held.mirrors, held.reform, plan.global_batch_size)
    timing = RestoreTiming(
        restore_s=held.gather_s + time.perf_counter() - started - engine_build_s,
        reshard_s=0.0,
        engine_build_s=engine_build_s,
    )
    return engine, held.state, Restored(None, timing, [])


def timed_engine(settings: EngineSettings, plan: BatchPlan, device: torch.device, load_universal: bool = False):
    """A new engine for `plan` (its model built on `device`), and the seconds its build took:
    a restore's timing counts them apart."""
    building = time.perf_counter()
    engine = build_engine(settings, plan, build_model(settings, plan, device), device, load_universal=load_universal)
    return engine, time.perf_counter() - building


def save_mode(
    settings: EngineSettings,
    background: str,
    on_gpu: bool,
    rank: int,
    world_size: int,
    nodes: list[str],
    shm_free: Callable[[], Optional[int]] = shm.shm_free,
) -> tuple[str, list[ShmTooSmall]]:
    """Where this rank's saves run, for the engine of `settings` on GPUs or not (`on_gpu`):
    `background` (checkpoint.background), unless that is "process" and the
    host copies of the checkpoint parts of every rank on this node (`nodes`: each rank's node)
    would not fit in its /dev/shm (checkpoint/shm.py); then "thread", said on this worker's
    stdout and as an event per such node for the controller (a collective): on every rank
    alike, since where rank 0's node takes its report before the controller collected it,
    the next rank's stands in."""
    param_bytes = 2 if on_gpu else 4  # bf16 on CUDA, fp32 elsewhere (engine.deepspeed_config)
    on_node = [r for r, node in enumerate(nodes) if node == nodes[rank]]
    needed = shm.shm_needed(
        shm.capture_bytes(param_count(settings.model), param_bytes, settings.deepspeed.zero_stage, world_size, r)
        for r in on_node
    )
    mode = shm.choose_mode(background, shm_free(), needed)
    if mode.reason:
        print(f"rank {rank} on node {nodes[rank]}: {mode.reason}", flush=True)
    modes = collectives.all_gather_object(mode)
    events = {}  # a node's ranks see the same room and need: one event per node
    for node, m in zip(nodes, modes):
        if m.reason and node not in events:
            events[node] = ShmTooSmall(
                time.time(),
                node,
                [r for r, n in enumerate(nodes) if n == node],
                m.free,
                m.needed,
                f"node {node}: {m.reason}",
            )
    return mode.mode, list(events.values())


# A final save that did not commit is tried again after this, then 4x longer each time
# (at most a minute): a store's blip passes within seconds, an outage within minutes.
FIRST_COMMIT_RETRY_S = 5.0


def due(at: At, checkpoint: CheckpointConfig, regrow: bool = False) -> bool:
    """A save every `checkpoint.every` steps, at the run's last step, and before a regrow."""
    return at.last or regrow or every(at.step, checkpoint.every)


def must_commit(at: At, regrow: bool) -> bool:
    """The run cannot go on without this save: the last step's, or a regrow's, which the
    larger group restarts from."""
    return at.last or regrow


@dataclass(frozen=True)
class SaveSettings:
    """What every checkpoint of the run is saved with from its config."""

    zero_stage: int  # deepspeed.zero_stage
    seed: int  # train.seed, recorded with the data position
    config_hash: str  # the run's config's (`config.config_hash`)
    timeout_s: float  # checkpoint.timeout_s: how long a save that must commit may take


def save(
    saver: AsyncSaver,
    engine,
    settings: SaveSettings,
    state: TrainState,
    world_size: int,
    must_commit: bool,
    retry: bool = False,
) -> bool:
    """Capture this rank's part of the checkpoint and let it commit in the background. With
    `must_commit` (the last step, a planned regrow) wait for the commit, and with `retry`
    try a save that failed again, with backoff, for up to checkpoint.timeout_s in all;
    whether it committed (the same answer on every rank). Without, False: the commit is yet
    to come."""
    meta = CheckpointMeta(
        step=state.step,
        tag=f"step_{state.step}",
        world_size=world_size,
        zero_stage=settings.zero_stage,
        data_position={"step": state.step, "seed": settings.seed},
        config_hash=settings.config_hash,
    )
    if not must_commit:
        # Skipping is collective: one rank still busy with the previous save skips it for all.
        skip = collectives.any_rank(saver.admission().action == "skip")
        saver.save_engine(engine, meta, state.to_json(), blocked_elsewhere=skip)
        return False
    deadline = time.monotonic() + settings.timeout_s
    backoff_s = FIRST_COMMIT_RETRY_S
    while True:
        # Queued behind a save in flight; skipped only when a staging disk is full.
        skip = collectives.any_rank(saver.admission(policy="queue").action == "skip")
        saver.save_engine(engine, meta, state.to_json(), blocked_elsewhere=skip, policy="queue")
        if not skip:
            saver.release(state.step)  # the last report, or the regrow's, follows right after
            saver.flush(max(0.0, deadline - time.monotonic()))
        committed = collectives.broadcast_object(saver.committed(state.step))  # rank 0 commits; its word counts
        if committed or not retry or time.monotonic() + backoff_s > deadline:
            return committed
        print(f"the checkpoint of step {state.step} did not commit; trying again in {backoff_s:g} s", flush=True)
        time.sleep(backoff_s)
        backoff_s = min(4 * backoff_s, 60.0)


_NOT_SAVED = {"failed": CheckpointFailed, "skipped": CheckpointSkipped, "partial": CheckpointPartial}


@dataclass(frozen=True)
class SavesReport:
    """The saves that ended since the last report, for the report (`WorkerReport`): the
    controller logs them (rank 0's), and converts each committed checkpoint ahead of a resize."""

    metrics: dict[str, float]  # checkpoint/<metric>
    committed: list[str]  # "<store URI>/<checkpoint name>" of each copy committed
    events: list[Event]  # the saves that did not commit everywhere


def saves_report(outcomes: list[SaveOutcome]) -> SavesReport:
    events: list[Event] = [
        _NOT_SAVED[o.status](time.time(), o.step, o.name, o.reason, o.failure, str(o.disk_full) if o.disk_full else "")
        for o in outcomes
        if o.status != "saved"
    ]
    committed = [f"{store}/{o.name}" for o in outcomes if o.status in ("saved", "partial") for store in o.stored]
    return SavesReport(save_policy.metrics(outcomes), committed, events)
