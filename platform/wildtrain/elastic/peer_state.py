"""A ZeRO engine's sharded state kept alive by its peers across a resize (issues 24 and 58).

ZeRO shards the fp32 master weights and AdamW's two moments over the data-parallel ranks
(ZeRO-1/2 each parameter group flattened, ZeRO-3 each parameter on its own, as
`membership.Pieces` describes), so a rank that dies takes the only copy of its partition with it. `Mirrors` keeps a
host copy of this rank's partition after every optimizer step and sends one to the next rank
of a ring that puts it on another node wherever the nodes allow (`membership.mirror_ring`),
which keeps it (12 bytes a parameter over the world size, each way). The copies go into
buffers that the snapshots dropped as old leave: one copy a value, and no fresh memory a step
(bench/mirror_cost.py). On a GPU the copy from the device queues on a stream of its own into
pinned memory, beside the next step's forward and backward; the next optimizer step, which
changes what it reads, waits for it on the device, and the send waits for it on the host
(`exchange`).

A step's exchange goes on beside the next step, over a gloo group of its own (no collective
of the step waits behind its bytes), and the next exchange waits for it first
(`generations.PeerCommits` says when a step is committed). The last `keep_steps` snapshots
of each partition are kept, and those of the layout a resize left until the new layout's
first exchange is settled everywhere.

After a resize the ranks of the new group say which snapshots they hold,
`membership.plan_repartition` picks the newest step held whole (`Mirrors.agree`), and once
each rank has built its engine at the new size, `load_state` assembles its new partition from
the slices of the old partitions that overlap it, each sent point to point by one holder of
that partition, its own or a mirror (`membership.plan_transfers`, piece by piece: a group at
ZeRO-1/2, a parameter at ZeRO-3). No checkpoint is read;
where a partition and its mirror are both gone (`RedundancyLost`) only a checkpoint restores
the run. A re-form moves each value once and holds at most a partition more per rank: its
memory scales with the partition, not the model (bench/reform_memory.py, docs/recovery.md).
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from wildtrain.elastic.membership import (
    Layout,
    Pieces,
    Repartition,
    Transfer,
    mirror_ring,
    plan_repartition,
    plan_transfers,
)

# How long a failed rank waits, at most, for a mirror in flight to turn out received, and
# for its own last copy from the device (a partition of GBs at a pinned copy's ~25 GB/s).
_CAME_WITHIN_S = 0.1
_COPIED_WITHIN_S = 2.0

Partition = list[torch.Tensor]  # per parameter (sub-)group, [3, n]: fp32 weights, exp_avg, exp_avg_sq
MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class PartitionedGroup:
    """One parameter group of a ZeRO-1/2 optimizer, as this rank holds it."""

    fp32: torch.Tensor  # this rank's partition of the fp32 master weights: AdamW's parameter
    flat: torch.Tensor  # every rank's low-precision weights of the group, flat, padded at the end
    params: list[torch.Tensor]  # the group's low-precision parameters (views into `flat`)

    @property
    def numel(self) -> int:
        """The group's values, padding excluded."""
        return sum(p.numel() for p in self.params)


def partitioned_groups(engine) -> list[PartitionedGroup]:
    """The parameter groups of a ZeRO-1/2 `engine`'s optimizer. At stage 1 in bf16 with fp32
    gradient accumulation (the precision on GPUs, `engine.deepspeed_config`) DeepSpeed's
    optimizer is its BF16_Optimizer, not the ZeRO one, and names them otherwise."""
    zero = engine.optimizer
    if hasattr(zero, "single_partition_of_fp32_groups"):
        fp32s, flats, params = zero.single_partition_of_fp32_groups, zero.bit16_groups_flat, zero.bit16_groups
    else:
        fp32s, flats, params = zero.fp32_groups_flat_partition, zero.bf16_groups_flat, zero.bf16_groups
    return [PartitionedGroup(fp32, flat, group) for fp32, flat, group in zip(fp32s, flats, params, strict=True)]


def is_zero3(engine) -> bool:
    """Whether `engine`'s optimizer is DeepSpeed's ZeRO-3 one, which keeps each parameter's
    partition apart (`ds_tensor`) and its fp32 masters flat per sub-group."""
    return hasattr(engine.optimizer, "fp32_partitioned_groups_flat")


@dataclass(frozen=True)
class Sharded:
    """A ZeRO engine's optimizer state as this rank holds it, whatever the stage."""

    fp32: list[torch.Tensor]  # per parameter (sub-)group: this rank's partition of the fp32 master weights
    pieces: Pieces  # how those partitions are laid out
    numels: tuple[int, ...]  # per piece, in `pieces.cut`'s order: its values, padding excluded


def sharded(engine) -> Sharded:
    """The fp32 partitions of `engine`'s ZeRO optimizer, and how DeepSpeed laid them out: at
    ZeRO-3 each sub-group's partition is its parameters' `ds_tensor`s end to end
    (stage3.py, `_create_fp16_partitions_with_defragmentation`), at ZeRO-1/2 a group's is one
    share of the group flattened."""
    zero = engine.optimizer
    if is_zero3(engine):
        return Sharded(
            list(zero.fp32_partitioned_groups_flat),
            Pieces(tuple(tuple(p.partition_numel() for p in group) for group in zero.fp16_groups)),
            tuple(p.ds_numel for group in zero.fp16_groups for p in group),
        )
    groups = partitioned_groups(engine)
    return Sharded(
        [group.fp32 for group in groups],
        Pieces(tuple((group.fp32.numel(),) for group in groups)),
        tuple(group.numel for group in groups),
    )


def host_copy(
    engine, into: Optional[torch.Tensor] = None, stream: Optional["torch.cuda.Stream"] = None
) -> tuple[torch.Tensor, Pieces]:
    """A host copy of this rank's partition of a ZeRO `engine`'s parameter groups, laid end
    to end in one [3, n] buffer (fp32 weights, exp_avg, exp_avg_sq), and how it is laid out
    (each group's n is `pieces.partitions`). Written
    into `into` where it has that shape (a buffer reused step after step: one copy a value and
    no fresh memory to fault in), else into a new buffer: pinned with a `stream`, pageable
    without one.
    With `stream` (the partition on a GPU) the copies queue there, after the work queued on
    the training stream so far, and the caller waits for them (`Mirrors.exchange`); without
    one they are done when this returns.
    Before AdamW's first step its moments do not exist yet: zeros, what AdamW would make."""
    state = engine.optimizer.optimizer.state
    held = sharded(engine)
    sizes = list(held.pieces.partitions)
    first = held.fp32[0]
    shape = (1 + len(MOMENTS), sum(sizes))
    if into is None or into.shape != shape or into.dtype != first.dtype:
        into = host_buffer(shape, first.dtype, pinned=stream is not None)
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(first.device))
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for fp32, part in zip(held.fp32, into.split(sizes, dim=1)):
            moments = state.get(fp32) or {}
            for row, value in enumerate([fp32.detach(), *(moments.get(name) for name in MOMENTS)]):
                if value is None:
                    part[row].zero_()
                    continue
                part[row].copy_(value, non_blocking=stream is not None)
                if stream is not None:
                    value.record_stream(stream)  # its memory stays AdamW's until the copy is done
    return into, held.pieces


def host_buffer(shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """An uninitialised host buffer; `pinned` where the device's copies go into it, and
    pageable where the host cannot pin that much more (the copy is synchronous then, as it
    would be into any pageable buffer, and nothing else changes)."""
    if pinned:
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        except RuntimeError as error:  # cudaHostAlloc: out of page-locked memory
            warnings.warn(
                f"wildtrain: a mirror's host buffer could not be pinned ({error}); pageable instead", stacklevel=2
            )
    return torch.empty(shape, dtype=dtype)


class _SendWhenCopied:
    """A send of a host buffer that a device-to-host copy is still filling: posted from a
    thread once the copy's event is done, so that the training thread queues the next step
    meanwhile, unless the generation it was copied in is no longer `current` (a copy stuck
    behind a dead peer's collective lands after the re-form): it is dropped, not sent into
    the next generation's group. Waited for as the send's `Work` is."""

    def __init__(self, copied: "torch.cuda.Event", send: Callable[[], Any], current: Callable[[], bool]) -> None:
        self.copied = copied
        self._work = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(
            target=self._run, args=(send, current), name="wildtrain-mirror-send", daemon=True
        )
        self._thread.start()

    def _run(self, send: Callable[[], Any], current: Callable[[], bool]) -> None:
        try:
            self.copied.synchronize()
            if not current():
                raise RuntimeError("a mirror copied in a generation re-formed since was dropped unsent")
            self._work = send()
        except BaseException as error:  # a group hung up after a failure: raised by `wait`
            self._error = error

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        self._thread.join(None if timeout is None else timeout.total_seconds())
        if self._thread.is_alive():
            raise RuntimeError("a mirror's copy from the device is still going on")
        if self._error is not None:
            raise self._error
        return self._work.wait() if timeout is None else self._work.wait(timeout)


def partition(engine) -> Partition:
    """This rank's partition of each parameter group of a ZeRO `engine`, on the host."""
    copy, pieces = host_copy(engine)
    return list(copy.split(list(pieces.partitions), dim=1))


class Mirrors:
    """This rank's snapshots: its own partition and its ring predecessor's, by layout (the
    generation and world size that cut them), old rank and step. The host copies travel over
    `group` (a gloo group of the whole world, such as the control group, where the default
    group is NCCL's) or the default group."""

    def __init__(self, keep_steps: int = 2, group: Optional[dist.ProcessGroup] = None) -> None:
        self.keep_steps = keep_steps
        self.group = group
        self.layout: Optional[Layout] = None
        self._ring: tuple[int, ...] = ()
        self.snapshots: dict[tuple[int, int, int], dict[int, Partition]] = {}
        # The buffer each snapshot's groups are views of, by (layout, old rank, step); those of
        # snapshots dropped as old are reused for the next steps' copies: this rank's own
        # (pinned on a GPU) for its own, the predecessor's for the next received.
        self._buffers: dict[tuple[int, int, int, int], torch.Tensor] = {}
        self._free: dict[bool, list[torch.Tensor]] = {True: [], False: []}  # own: buffers
        self._in_flight: list = []
        self._received: Optional[tuple[int, torch.Tensor, Pieces]] = None  # (step, buffer, its layout)
        self._pieces: dict[Layout, Pieces] = {}  # how each layout's partitions are laid out
        self._exchanged_in_layout = False
        # On a GPU: the stream the copies from the device go on, the optimizer whose steps wait
        # for them, and the last copy, maybe not done yet (its snapshot's key and step, and its event).
        self._stream: Optional["torch.cuda.Stream"] = None
        self._hooked: Optional[weakref.ref] = None
        self._copying: Optional[tuple[tuple[int, int, int], int, "torch.cuda.Event"]] = None

    def use_layout(self, generation: int, world: int, nodes: Optional[Sequence[str]] = None) -> None:
        """The group was re-formed: snapshots from now on are of this layout, whose ranks run on
        `nodes` (by rank; None: each on a node of its own)."""
        nodes = [str(rank) for rank in range(world)] if nodes is None else list(nodes)
        if len(nodes) != world:
            raise ValueError(f"a layout of {world} ranks on {len(nodes)} nodes ({nodes}): one node per rank")
        self.layout = (generation, world)
        self._free = {True: [], False: []}  # cut for the last layout
        self._ring = mirror_ring(nodes)
        self._exchanged_in_layout = False

    def exchange(self, engine, step: int) -> None:
        """Keep this rank's partition after optimizer step `step` and start sending it to the
        ring successor while receiving the predecessor's (`settle` waits for both). On a GPU
        the copy from the device is queued, not done: the send goes once it is (a thread
        waits for it), and the next optimizer step waits for it on the device."""
        if self.layout is None:
            raise RuntimeError("Mirrors.use_layout was not called: no layout to file the snapshots under")
        self.settle()
        generation, world = self.layout
        if self._exchanged_in_layout:
            # Every rank settled this layout's first exchange before the reduction this rank
            # has since passed: the older layouts are not needed any more.
            self.snapshots = {key: kept for key, kept in self.snapshots.items() if key[:2] == self.layout}
            self._buffers = {key: buffer for key, buffer in self._buffers.items() if key[:2] == self.layout}
            self._pieces = {self.layout: self._pieces[self.layout]} if self.layout in self._pieces else {}
        self._exchanged_in_layout = True
        rank = dist.get_rank(self.group)
        stream = self._copy_stream(engine)
        sent, pieces = host_copy(engine, self._free[True].pop() if self._free[True] else None, stream)
        self._keep(rank, step, sent, pieces, own=True)
        copied = None
        if stream is not None:
            copied = torch.cuda.Event()
            copied.record(stream)
            self._copying = ((*self.layout, rank), step, copied)
        if world == 1:
            return
        # Every rank of a layout holds partitions of the same sizes: so do its free buffers.
        free = self._free[False]
        fits = free and free[-1].shape == sent.shape and free[-1].dtype == sent.dtype
        received = free.pop() if fits else torch.empty(sent.shape, dtype=sent.dtype)

        # Where it goes is this generation's, taken now: a send posted later must not read the next one's.
        group, successor, layout = self.group, self._neighbour(rank, 1), self.layout

        def send():
            return dist.isend(sent, group=group, group_dst=successor)

        def current() -> bool:
            return self.group is group and self.layout == layout

        self._in_flight = [
            send() if copied is None else _SendWhenCopied(copied, send, current),
            dist.irecv(received, group=self.group, group_src=self._neighbour(rank, -1)),
        ]
        self._received = (step, received, pieces)

    def _copy_stream(self, engine) -> Optional["torch.cuda.Stream"]:
        """The stream for copies of `engine`'s partition from its GPU (None on the CPU), with
        `engine`'s optimizer made to wait for the last of them before it steps."""
        device = sharded(engine).fp32[0].device
        if device.type != "cuda":
            return None
        adamw = engine.optimizer.optimizer
        if self._hooked is None or self._hooked() is not adamw:  # a new engine: each re-form builds one
            adamw.register_step_pre_hook(self._before_optimizer_step)
            self._hooked = weakref.ref(adamw)
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        """AdamW is about to change the values the last copy from the device reads: the
        device waits for that copy first (the host does not)."""
        if self._copying is not None:
            torch.cuda.current_stream(self._stream.device).wait_event(self._copying[2])

    def _copy_done(self, within_s: Optional[float] = None) -> None:
        """Wait for the last copy from the device; with `within_s`, that long at most, after
        which its snapshot is dropped: the copy may still be filling it (a device stuck in a
        collective with a dead peer), and an older step is held whole."""
        if self._copying is None:
            return
        (key, step, copied), self._copying = self._copying, None
        deadline = None if within_s is None else time.monotonic() + within_s
        while deadline is not None and not copied.query():
            if time.monotonic() > deadline:
                self.snapshots.get(key, {}).pop(step, None)
                self._buffers.pop((*key, step), None)  # not free: the device may write it still
                return
            time.sleep(0.001)
        copied.synchronize()

    def settle(self) -> None:
        """Wait until this rank's last exchange is done (raises what the collective raised)."""
        for work in self._in_flight:
            work.wait()  # what raises here stays in flight, for `drop_in_flight`
        self._in_flight = []
        self._copy_done()
        if self._received is not None:
            self._keep_received()

    def _keep_received(self) -> None:
        step, received, pieces = self._received
        self._received = None
        self._keep(self._neighbour(dist.get_rank(self.group), -1), step, received, pieces, own=False)

    def _neighbour(self, rank: int, offset: int) -> int:
        """The rank `offset` places after `rank` on the layout's ring (-1: its predecessor)."""
        return self._ring[(self._ring.index(rank) + offset) % len(self._ring)]

    def drop_in_flight(self) -> None:
        """Forget the exchange in flight when a collective failed, keeping what it received in
        full: a predecessor's mirror that came before the failure (the exchange goes on beside
        the next step) is as good as one settled, and may be the only copy of its partition."""
        in_flight, self._in_flight = self._in_flight, []
        self._copy_done(within_s=_COPIED_WITHIN_S)
        try:
            if self._received is not None and in_flight:
                # gloo counts a receive done only once waited for: one whose bytes came returns at once.
                in_flight[-1].wait(timedelta(seconds=_CAME_WITHIN_S))
                self._keep_received()
        except (RuntimeError, dist.DistError):
            pass  # it never came
        finally:
            self._received = None

    def forget_after(self, step: int) -> None:
        """Drop the snapshots of steps after `step` (the last whose commit returned here): a step
        whose commit some rank did not finish is not continued from (its window may be closed
        nowhere), and a window of a step after the one continued from is dropped with it."""
        for key, kept in self.snapshots.items():
            for later in [s for s in kept if s > step]:
                del kept[later]
                self._buffers.pop((*key, later), None)

    def held(self) -> dict[tuple[int, int, int], set[int]]:
        """(layout generation, layout world, old rank) -> the steps held of that partition."""
        return {key: set(kept) for key, kept in self.snapshots.items()}

    def agree(self, fresh: bool) -> Optional["Reform"]:
        """Collectively, in a newly formed group: which state the group continues from, and who
        holds each of its partitions (`membership.plan_repartition`); None when every rank is
        `fresh` (the run's first group: each builds from the seed). Raises `RedundancyLost` on
        every rank alike. Only what the ranks hold is exchanged here, not the state: each rank
        receives its new partition's values once its engine is built (`load_state`)."""
        world = dist.get_world_size(self.group)
        offers: list = [None] * world
        dist.all_gather_object(offers, None if fresh else (self.held(), self._cuts()), group=self.group)
        if all(offer is None for offer in offers):
            return None
        repartition = plan_repartition([offer and offer[0] for offer in offers])
        pieces, dtype = next(
            offer[1][repartition.layout] for offer in offers if offer and repartition.layout in offer[1]
        )
        return Reform(repartition, pieces, dtype)

    def slice_of(self, reform: "Reform", transfer: Transfer) -> torch.Tensor:
        """The [3, length] values `transfer` sends, in this rank's snapshot of the old partition:
        a view, each row contiguous."""
        groups = self.snapshots[(*reform.repartition.layout, transfer.old_rank)][reform.repartition.step]
        group, offset = reform.pieces.places()[transfer.piece]
        start = offset + transfer.src_offset
        return groups[group][:, start : start + transfer.length]

    def _cuts(self) -> dict[Layout, tuple[Pieces, torch.dtype]]:
        """Per layout held: how its partitions are laid out (alike on every rank of a layout)
        and their dtype, so that a rank holding none of it can receive them."""
        cuts = {}
        for key, kept in self.snapshots.items():
            if kept:
                cuts[key[:2]] = (self._pieces[key[:2]], next(iter(kept.values()))[0].dtype)
        return cuts

    def _keep(self, old_rank: int, step: int, buffer: torch.Tensor, pieces: Pieces, own: bool) -> None:
        key = (*self.layout, old_rank)
        self._pieces[self.layout] = pieces
        kept = self.snapshots.setdefault(key, {})
        kept[step] = list(buffer.split(list(pieces.partitions), dim=1))
        self._buffers[(*key, step)] = buffer
        for old in sorted(kept)[: -self.keep_steps]:
            del kept[old]
            # Settled long ago (an exchange settles the last one first): nothing reads or sends it.
            dropped = self._buffers.pop((*key, old), None)
            if dropped is not None:
                self._free[own].append(dropped)


@dataclass(frozen=True)
class Reform:
    """What a re-formed group continues from, as every rank of it agreed (`Mirrors.agree`)."""

    repartition: Repartition
    pieces: Pieces  # how the partitions of the layout restored from are laid out
    dtype: torch.dtype

    @property
    def step(self) -> int:
        return self.repartition.step


def load_partitions(engine, mirrors: Mirrors, reform: Reform) -> None:
    """Collectively, over `mirrors.group`: put this rank's partition of the state `reform`
    continues from into a ZeRO `engine` just built at the new world size, its fp32 weights
    and AdamW's moments at step `reform.step`, and the engine's low-precision weights made
    from them (`publish_weights`).

    Each rank receives only the slices of old partitions that overlap its new one, piece by
    piece (`membership.Pieces`), each from one rank that holds it (`membership.plan_transfers`,
    of which each rank plans only what it sends and receives), and sends from its snapshots
    only what others' new partitions take of them: point to point, no rank holding more than
    its partition at once. The values go straight into the engine's
    tensors on the CPU, and through one host buffer of a parameter group's partition on a GPU
    (gloo moves host memory)."""
    held = sharded(engine)
    group, world = mirrors.group, dist.get_world_size(mirrors.group)
    rank = dist.get_rank(group)
    if reform.dtype != held.fp32[0].dtype:
        raise ValueError(f"partitions of {reform.dtype} for an engine whose partitions are of {held.fp32[0].dtype}")
    old = reform.pieces.cut(reform.repartition.layout[1])
    if len(old.sizes) != len(held.numels):
        raise ValueError(
            f"partitions of {len(old.sizes)} pieces for an engine of {len(held.numels)}: "
            "the state is of another model or ZeRO stage"
        )
    new = held.pieces.cut(world)
    plan = plan_transfers(held.numels, old, new, reform.repartition.holders, rank)
    tags = plan.tags()
    places = held.pieces.places()
    rows = 1 + len(MOMENTS)
    # Every send at once: they are views of the snapshots, and the receives below wait for them.
    sends = [
        dist.isend(values, group=group, group_dst=transfer.dst, tag=rows * tag + row)
        for transfer, tag in zip(plan.transfers, tags)
        if transfer.src == rank != transfer.dst
        for row, values in enumerate(mirrors.slice_of(reform, transfer))
    ]
    adamw = engine.optimizer.optimizer
    # AdamW keeps its step count on the parameter's device when fused or capturable.
    on_device = adamw.defaults.get("fused") or adamw.defaults.get("capturable")
    with torch.no_grad():
        for index, fp32 in enumerate(held.fp32):
            state = [fp32, *(torch.zeros_like(fp32) for _ in MOMENTS)]
            landing = state if fp32.device.type == "cpu" else torch.zeros(rows, fp32.numel(), dtype=fp32.dtype)
            if landing is state:
                fp32.zero_()  # the padding, which no one sends
            receives = []
            for transfer, tag in zip(plan.transfers, tags):
                in_group, offset = places[transfer.piece]
                if in_group != index or transfer.dst != rank:
                    continue
                at = slice(offset + transfer.dst_offset, offset + transfer.dst_offset + transfer.length)
                if transfer.src == rank:
                    for row, values in enumerate(mirrors.slice_of(reform, transfer)):
                        landing[row][at].copy_(values)
                    continue
                receives += [
                    dist.irecv(landing[row][at], group=group, group_src=transfer.src, tag=rows * tag + row)
                    for row in range(rows)
                ]
            for work in receives:
                work.wait()
            if landing is not state:
                for value, landed in zip(state, landing):
                    value.copy_(landed)
            count = torch.tensor(float(reform.step), device=fp32.device if on_device else "cpu")
            adamw.state[fp32] = {"step": count, **dict(zip(MOMENTS, state[1:]))}
        publish_weights(engine, world, rank)
    for work in sends:
        work.wait()


def publish_weights(engine, world: int, rank: int) -> None:
    """Collectively: `engine`'s low-precision weights made from its fp32 partitions, as
    DeepSpeed makes them after each optimizer step. At ZeRO-1/2 every rank holds every weight:
    each rank's partition is gathered to all (`gather_in_place`). At ZeRO-3 a rank holds its
    partition of each parameter (`ds_tensor`), cast from its fp32 one as the step casts it, and
    the parameters DeepSpeed keeps gathered between steps (its persistent ones) are gathered
    anew, as a checkpoint's load does: none is left gathered with the values it had before."""
    zero = engine.optimizer
    if is_zero3(engine):
        zero.checkpoint_event_prologue()
        for sub_group in range(len(zero.fp32_partitioned_groups_flat)):
            zero._reassign_or_swap_out_partitioned_parameters(sub_group)
        zero.checkpoint_event_epilogue()
        return
    for index, kept in enumerate(partitioned_groups(engine)):
        size = kept.fp32.numel()
        if kept.flat.numel() != world * size:
            raise ValueError(f"parameter group {index}: a flat buffer of {kept.flat.numel()} for {world} x {size}")
        kept.flat.narrow(0, rank * size, size).copy_(kept.fp32)
        gather_in_place(kept.flat, size, world)


def gather_in_place(flat: torch.Tensor, size: int, world: int) -> None:
    """Every rank's `size` values of `flat` (a rank's at rank x `size`) to every rank of the
    default group, into `flat` itself. NCCL's all-gather writes its output in place; gloo's
    goes through a buffer of the whole output (the model's weights once more), so on gloo each
    rank broadcasts its share in place."""
    if world == 1:
        return
    if dist.get_backend() == "nccl":
        dist.all_gather_into_tensor(flat, flat.narrow(0, dist.get_rank() * size, size))
        return
    for src in range(world):
        dist.broadcast(flat.narrow(0, src * size, size), src=src)


def load_state(engine, mirrors: Mirrors, reform: Reform, samples_per_step: int) -> None:
    """Collectively: the state `reform` continues from in a ZeRO `engine` just built at the
    new world size (`load_partitions`), with AdamW's step count and the schedule's position of
    its optimizer step."""
    load_partitions(engine, mirrors, reform)
    step = reform.step
    schedule = engine.lr_scheduler
    schedule.last_epoch = step - 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "step() before optimizer.step()": no step is taken here
        schedule.step()  # the learning rate of `step`
    engine.global_steps = step
    engine.global_samples = step * samples_per_step
