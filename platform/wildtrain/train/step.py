"""One training step, factored out of the loop so it runs in any torch.distributed process
group (gloo on CPU, NCCL on GPU), with or without Ray.

On a GPU the step must not wait on the host: the next batch's copy is issued while this
one trains (`DeviceBatches`), the loss is summed on the device, and phases are timed with
CUDA events that are read only when a window's metrics are resolved for a report
(`StepMetrics.resolve`). A
`torch.cuda.synchronize()` or `.item()` per micro-batch would drain the queue the device
works from and stall ZeRO-3's parameter prefetch.
"""

from __future__ import annotations

import contextlib
import resource
import time
from dataclasses import dataclass
from typing import Callable, Generic, Iterator, Optional, Protocol, Sequence, TypeVar

import numpy as np
import torch

from wildtrain.batching import BatchPlan
from wildtrain.data.objectives import FIELDS
from wildtrain.tracking.worker.mfu import Peak, mfu
from wildtrain.train import collectives

B = TypeVar("B")


class DeviceBatches(Generic[B]):
    """The batches of `host` (numpy int32: rows × seq_len+1 tokens, or an objective's rows ×
    fields × seq_len, see `train_step`), as int64 tensors on `device`, one step ahead: taking batch k issues the copy
    of batch k+1, so the copy and
    the host's reading of the next batch overlap step k.

    On CUDA each batch goes through a reused pinned host buffer (a pageable copy cannot be
    asynchronous) on a copy stream of its own; on any other device it is a plain copy
    (none on the CPU). Either way it is widened to int64 on the device: half the bytes
    over PCIe. `host` yields anything `tokens` turns into the token array (the
    loop's `Step`, with its sample ids); `next()` returns (device tokens, that item).
    Exceptions of `host` (a corrupt shard) surface from the `next()` that prefetches."""

    def __init__(
        self, host: Iterator[B], device: torch.device, tokens: Callable[[B], np.ndarray] = lambda batch: batch
    ) -> None:
        self.host = host
        self.device = device
        self.tokens = tokens
        self.pinned = device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(device) if self.pinned else None
        # Two pinned buffers: one whose copy may be in flight, one being filled.
        self._buffers: list[Optional[torch.Tensor]] = [None, None]
        self._copied: list[Optional[torch.cuda.Event]] = [None, None]
        self._slot = 0
        self._ahead: Optional[tuple[torch.Tensor, Optional[torch.cuda.Event], B]] = None
        self._started = False

    def __iter__(self) -> "DeviceBatches[B]":
        return self

    def __next__(self) -> tuple[torch.Tensor, B]:
        if not self._started:
            self._started = True
            self._prefetch()
        if self._ahead is None:
            raise StopIteration
        tokens, copied, item = self._ahead
        self._prefetch()  # before this step's kernels are queued, so the copy runs beside them
        if copied is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(copied)
            tokens.record_stream(current)  # allocated on the copy stream, used on this one
        return tokens.long(), item

    def _prefetch(self) -> None:
        item = next(self.host, _END)
        if item is _END:
            self._ahead = None
            return
        host = torch.from_numpy(np.ascontiguousarray(self.tokens(item)))
        if not self.pinned:
            self._ahead = (host.to(self.device), None, item)
            return
        slot = self._slot
        self._slot = 1 - slot
        buffer = self._buffers[slot]
        if buffer is None or buffer.shape != host.shape or buffer.dtype != host.dtype:
            buffer = self._buffers[slot] = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
        elif self._copied[slot] is not None:
            self._copied[slot].synchronize()  # its previous copy is done long ago; never overwrite one in flight
        buffer.copy_(host)
        with torch.cuda.stream(self._copy_stream):
            tokens = buffer.to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        self._copied[slot] = copied
        self._ahead = (tokens, copied, item)


_END = object()


class DataWait(Protocol):
    wait_s: float  # seconds spent waiting for data since it was last reset (data.stream.RankStream)


def peak_memory_gb(device: torch.device) -> float:
    """This process's peak: device memory allocated on CUDA, resident host memory elsewhere."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB


@dataclass
class Window:
    """A closed metrics window of one rank: the steps since the previous one, with what is
    known on the host. Its loss (this rank's, on the device) is averaged over the ranks and,
    on CUDA, its device timings are read only when it is resolved (`StepMetrics.resolve`),
    so closing one costs neither a collective nor a device sync. A window closed after
    `StepMetrics.settle` holds the loss over the ranks already (`settled`)."""

    metrics: dict  # per step, besides `loss` and the device-timed phases: see `StepMetrics.resolve`
    loss: torch.Tensor
    phase_s: dict[str, float]
    pending: list[tuple[str, "torch.cuda.Event", "torch.cuda.Event"]]
    steps: int
    settled: bool = False


class StepMetrics:
    """Loss, throughput, MFU and where the time went, per window of steps: means per step
    of `time/<phase>_s` (data wait, forward, backward, optimizer, checkpoint stall, report
    wait, validation); the loss is averaged over all ranks.

    Forward, backward and optimizer are timed on the device (CUDA events on the current
    stream, read when a window is resolved or `busy_s` is read) and on the host clock
    elsewhere; a checkpoint stall, a report wait and a validation are the host's waits and
    always on the host clock."""

    DEVICE_PHASES = ("forward", "backward", "optimizer")
    PHASES = DEVICE_PHASES + ("checkpoint_stall", "report_wait", "eval")

    def __init__(
        self,
        tokens_per_step: int,
        flops_per_token: float,
        peak: Optional[Peak],
        world_size: int,
        device: torch.device,
        data_wait: Optional[DataWait] = None,
    ) -> None:
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak = peak
        self.world_size = world_size
        self.device = device
        self.on_cuda = device.type == "cuda"
        self.data_wait = data_wait
        # Forward time since the attempt started: a rank's own work, for straggler checks.
        # Backward and optimizer steps end in gradient reductions, where fast ranks wait.
        self._busy_s = 0.0
        self._busy_pending: list[tuple["torch.cuda.Event", "torch.cuda.Event"]] = []
        self._reset()

    def _reset(self) -> None:
        self.loss_sum: Optional[torch.Tensor] = None
        self.settled_loss: Optional[float] = None  # the open window's loss over ranks, as of `settle`
        self.micro_steps = 0
        self.optimizer_steps = 0
        self.phase_s = dict.fromkeys(self.PHASES, 0.0)
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        if self.data_wait is not None:
            self.data_wait.wait_s = 0.0
        self.started = time.perf_counter()

    @contextlib.contextmanager
    def timed(self, phase: str):
        if phase not in self.PHASES:
            raise ValueError(f"unknown phase {phase!r}; phases are {', '.join(self.PHASES)}")
        if self.on_cuda and phase in self.DEVICE_PHASES:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._pending.append((phase, start, end))
                if phase == "forward":
                    self._busy_pending.append((start, end))
            return
        started = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - started
            self.phase_s[phase] += seconds
            if phase == "forward":
                self._busy_s += seconds

    @property
    def busy_s(self) -> float:
        """Forward seconds since the attempt started. On CUDA reading it waits for the device:
        read it when a straggler check needs it, not every step."""
        if self._busy_pending:
            self._busy_pending[-1][1].synchronize()
            self._busy_s += sum(start.elapsed_time(end) / 1000 for start, end in self._busy_pending)
            self._busy_pending.clear()
        return self._busy_s

    def add_loss(self, loss: torch.Tensor) -> None:
        loss = loss.detach().float()  # stays on its device: no sync per micro-batch
        self.loss_sum = loss if self.loss_sum is None else self.loss_sum + loss
        self.micro_steps += 1

    def end_step(self) -> None:
        self.optimizer_steps += 1

    def settle(self) -> None:
        """Average the open window's loss over the ranks now (a collective on the control
        group: every rank calls it at the same step). In-process (elastic.in_process) each
        step commits with it: a window closed after the commit resolves without a
        collective, so a member's death cannot drop the losses of steps that survive it."""
        mine = (self.loss_sum / max(1, self.micro_steps)).item() if self.loss_sum is not None else float("nan")
        losses = collectives.all_gather_floats(mine)
        self.settled_loss = sum(losses) / len(losses)

    def close(self, **extra) -> Window:
        """End the window here (no collective, no device sync) and start the next; `extra`
        values (step, lr, ...) ride in its metrics."""
        elapsed = time.perf_counter() - self.started
        steps = max(1, self.optimizer_steps)
        tokens_per_s = steps * self.tokens_per_step / elapsed
        if self.settled_loss is not None:
            loss = torch.tensor(self.settled_loss)
        else:
            loss = self.loss_sum / max(1, self.micro_steps) if self.loss_sum is not None else torch.tensor(float("nan"))
        metrics = extra | {
            "at": time.time(),
            "step_time_s": elapsed / steps,
            "tokens_per_s": tokens_per_s,
            "time/data_wait_s": (self.data_wait.wait_s if self.data_wait is not None else 0.0) / steps,
            "memory/peak_gb": peak_memory_gb(self.device),
        }
        if self.peak is not None:
            metrics["mfu"] = mfu(self.flops_per_token, tokens_per_s, self.peak, self.world_size)
        window = Window(
            metrics, loss.detach(), self.phase_s, self._pending, steps, settled=self.settled_loss is not None
        )
        self._reset()
        return window

    def resolve(self, windows: Sequence[Window]) -> list[dict]:
        """The metrics of closed `windows`, oldest first: one collective for the losses of
        those not settled (every rank resolves the same windows at the same step) and one
        wait for the device."""
        if not windows:
            return []
        unsettled = [w.loss for w in windows if not w.settled]
        means = iter(
            collectives.mean_over_ranks(torch.stack([loss.to(unsettled[-1].device) for loss in unsettled]))
            .cpu()
            .tolist()
            if unsettled
            else []
        )
        pending = [p for w in windows for p in w.pending]
        if pending:
            pending[-1][2].synchronize()
        resolved = []
        for window in windows:
            loss = window.loss.item() if window.settled else next(means)
            phase_s = dict(window.phase_s)
            for phase, start, end in window.pending:
                phase_s[phase] += start.elapsed_time(end) / 1000
            resolved.append(
                window.metrics
                | {"loss": loss}
                | {f"time/{phase}_s": seconds / window.steps for phase, seconds in phase_s.items()}
            )
        return resolved

    def flush(self, **extra) -> dict:
        """Close the window and resolve it (a collective: every rank calls it at the same step)."""
        return self.resolve([self.close(**extra)])[0]


def model_inputs(micro_batch: torch.Tensor) -> dict[str, torch.Tensor]:
    """The model's keyword arguments from rows of seq_len+1 tokens (the plain causal LM), or
    from rows of an objective's `FIELDS` (data/objectives.py)."""
    if micro_batch.dim() == 2:
        return {"tokens": micro_batch[:, :-1], "targets": micro_batch[:, 1:]}
    return dict(zip(FIELDS, micro_batch.unbind(1)))


def train_step(engine, plan: BatchPlan, tokens: torch.Tensor, metrics: StepMetrics) -> None:
    """One optimizer step of the DeepSpeed `engine` on this rank's `tokens` (on the engine's
    device, see `model_inputs`): forward, backward and `engine.step()` per micro-batch of the
    plan; DeepSpeed applies the optimizer at the last."""
    rows = plan.micro_batch_size * plan.grad_accum_steps
    if tokens.shape[0] != rows:
        raise ValueError(
            f"a step of this plan trains {rows} rows per rank "
            f"({plan.grad_accum_steps} micro-batches of {plan.micro_batch_size}), got {tokens.shape[0]}"
        )
    for micro_batch in tokens.split(plan.micro_batch_size):
        with metrics.timed("forward"):
            loss = engine(**model_inputs(micro_batch))
        with metrics.timed("backward"):
            engine.backward(loss)
        with metrics.timed("optimizer"):
            engine.step()
        metrics.add_loss(loss)
    metrics.end_step()
