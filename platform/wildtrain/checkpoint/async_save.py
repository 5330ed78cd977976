"""Asynchronous, verified checkpoints: training waits only while the state is copied to host memory.

A save has two halves. The capture, on the training thread (`AsyncSaver.save_engine`,
`save_state`): DeepSpeed's `save_checkpoint` runs as usual (a collective that builds every
state dict and names every file) with the engine's checkpoint writer swapped for one that
copies each tensor into a host buffer (`host_copy` owns them); DeepSpeed's small files and
the client state go straight to the rank's staging folder. The background half, in the
saver's child process (`save_process`; `save_work` is the work: staging write, upload to
each store, verification, and on rank 0 the commit once every rank's part is in): a writer
thread hands each save to the child and relays what it asks (whether a step's report was
collected) and tells (what it is doing, its deadline).

Why a process: in a thread, the background half takes the GIL (pickling, the Python loops of
hashing and copying) in turns with training, which on busy cores slows training's steps far
more than a process does (bench/save_interference.py; figures on docs/benchmarks.md). The child
keeps training's priority unless `nice` says otherwise: a niced save took many times longer
there, and later saves were skipped meanwhile.
The host buffers are in shared memory (on CUDA also page-locked, as torch's DCP staging does)
and reused; one child per saver, spawned with it or handed over from the last one (its
imports take seconds); scripts that make a saver need the spawn's `__main__` guard.

Not DeepSpeed's own save to a local folder, uploaded after: serializing is most of a save,
and it stalls training many times longer than the capture (bench/checkpoint_stall.py; figures
on docs/benchmarks.md, checkpoints and GPUs). The price is host memory: one copy of this
rank's part, two while one is queued. Storage problems never raise into training: every save
ends as one `SaveOutcome` (`save_policy` also decides a save due while one is in flight); the
next save is the retry. A storage call that never returns is bounded by killing the child
(`save_process.KILL_GRACE_S` past its deadline); a thread's is not: later saves skip or queue."""

from __future__ import annotations

import dataclasses
import math
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Mapping, Optional, Sequence

import torch

from wildtrain import checkpoint
from wildtrain.checkpoint.format import checkpoint_name
from wildtrain.checkpoint.host_copy import CapturingWriter, HostBuffers, buffer_key, copying, reserve, to_host
from wildtrain.checkpoint.retention import RetentionPolicy
from wildtrain.checkpoint.save_policy import Admission, InFlight, Policy, SaveOutcome, admit
from wildtrain.checkpoint.save_process import SaveProcess, SaveProcessLost
from wildtrain.checkpoint.save_work import (
    CheckpointMeta,
    SaveJob,
    SaveResult,
    SaveSettings,
    describe,
    run_save,
)
from wildtrain.checkpoint.save_work import (
    disk_free as _disk_free,
)
from wildtrain.checkpoint.store import Store, StoreLike, as_store

__all__ = ["AsyncSaver", "Background", "CheckpointMeta"]

# Where a save's background half runs: a child process (see `save_process`), or a thread of
# the saver's process (no second process, but it contends for the GIL with training).
Background = Literal["process", "thread"]


@dataclass
class _Job:
    meta: CheckpointMeta
    name: str
    folder: Path
    settings: SaveSettings  # the saver's when the job was made: a regroup changes later jobs'
    host: HostBuffers
    pending: list[tuple[str, Any]] = field(default_factory=list)  # (path in folder, host copy)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    stall_s: float = 0.0
    started: Optional[float] = None  # monotonic, when the writer thread took it
    doing: str = "queued"

    def pending_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers.values())


class _Link:
    """`save_work.Link` for the saver's own process: the thread mode, and the relay of a child's questions."""

    def __init__(self, saver: "AsyncSaver", job: _Job) -> None:
        self._saver, self._job = saver, job

    def doing(self, what: str) -> None:
        self._job.doing = what

    def deadline(self, at: float) -> None:  # a thread cannot be stopped: its checks between chunks are all
        pass

    def report_collected(self, step: int) -> bool:
        return self._saver._report_collected(step)

    def wait(self, seconds: float) -> bool:
        return self._saver._closing.wait(seconds)


class AsyncSaver:
    """One per worker: saves this rank's part of each checkpoint in the background (see the
    module docstring). `attempt` must be the same on every rank of the worker group and
    differ between groups (`format.new_attempt_token`, broadcast from rank 0). `device` is
    the one the engine trains on: on CUDA the host buffers are page-locked and the copies
    run on a stream of their own."""

    def __init__(
        self,
        stores: Sequence[StoreLike],
        staging_dir: str,
        *,
        rank: int,
        world_size: int,
        attempt: str,
        policy: Policy = "skip",
        timeout_s: float = 1800.0,
        verify_upload: bool = True,
        retention: Optional[RetentionPolicy] = None,
        known_good: Iterable[tuple[str, str]] = (),
        disk_free: Callable[[str], Optional[int]] = _disk_free,
        commit_when_released: bool = False,
        reports_collected: Callable[[], bool] = lambda: False,
        background: Background = "process",
        nice: int = 0,
        device: torch.device = torch.device("cpu"),
        process: Optional[SaveProcess] = None,
        defer_process: bool = False,
    ) -> None:
        if policy not in ("skip", "queue"):
            raise ValueError(f"checkpoint save policy {policy!r}: expected 'skip' or 'queue'")
        if background not in ("process", "thread"):
            raise ValueError(f"checkpoint save background {background!r}: expected 'process' or 'thread'")
        if not stores:
            raise ValueError("AsyncSaver needs at least one store")
        self.stores: list[Store] = [as_store(s) for s in stores]
        self.staging = Path(staging_dir)
        self.rank, self.attempt, self.policy, self.timeout_s = rank, attempt, policy, timeout_s
        # (store URI, checkpoint name) pairs known to be good, which retention never deletes
        # all of: restored from, or uploaded and verified by this saver.
        self._good: set[tuple[str, str]] = set(known_good)
        self._disk_free = disk_free
        self.background, self.nice = background, nice  # nice: the child's niceness
        self._settings = SaveSettings(
            tuple(self.stores), rank, world_size, timeout_s, verify_upload, retention, disk_free
        )
        # Spawned now, not with the first save (its imports take seconds, and a save still in
        # flight when the next falls due makes that one skipped), or handed over (`close_keeping_process`,
        # or by the caller). With `defer_process` at `start_process`: an attempt's, after its first step.
        if process is not None and (background != "process" or not process.alive()):
            process.stop(0)
            process = None
        self._process: Optional[SaveProcess] = process
        self._cond = threading.Condition()
        if not defer_process:
            self.start_process()
        # A child reads the host copies where the capture put them: in shared memory.
        on_cuda = device.type == "cuda"
        self._buffers = HostBuffers(pin=on_cuda, share=background == "process")
        # The device-to-host copies run on a stream of their own, so waiting for them waits
        # for nothing else (a step's kernels queued behind the save, another stream's work).
        self._copy_stream = torch.cuda.Stream(device) if on_cuda else None
        self._last_bytes = 0
        self._running: Optional[_Job] = None
        self._queued: Optional[_Job] = None
        self._outcomes: list[SaveOutcome] = []
        self._closing = threading.Event()
        # With `commit_when_released`, rank 0 commits a save only once its step's report is
        # collected: `release` covers the step, or `reported` does and `reports_collected()`
        # (the controller has taken every report handed to Ray) holds. Otherwise at once.
        self._released = -1 if commit_when_released else math.inf
        self._reported = -1
        self._tries = (-1, 0)  # (step, captures of it so far)
        # Rank 0: the newest checkpoint it committed (store URI/name), named where a run must stop.
        self.last_commit: Optional[str] = None
        self._reports_collected = reports_collected
        self._thread = threading.Thread(target=self._work, name=f"wildtrain-checkpoint-rank{rank}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ training thread

    @property
    def busy(self) -> bool:
        with self._cond:
            return self._running is not None or self._queued is not None

    def admission(self, *, blocked_elsewhere: bool = False, policy: Optional[Policy] = None) -> Admission:
        """What a save due now would do on this rank; with several ranks, all-reduce
        `action == "skip"` and pass the result to `save_*` as `blocked_elsewhere`."""
        with self._cond:
            job = self._running or self._queued
            in_flight = (
                None
                if job is None
                else InFlight(
                    job.meta.step, time.monotonic() - job.started if job.started is not None else 0.0, job.doing
                )
            )
        self.staging.mkdir(parents=True, exist_ok=True)
        return admit(
            policy or self.policy,
            in_flight,
            blocked_elsewhere,
            str(self.staging),
            self._disk_free(str(self.staging)),
            self._last_bytes,
        )

    def save_engine(
        self,
        engine,
        meta: CheckpointMeta,
        client_state: str,
        *,
        blocked_elsewhere: bool = False,
        policy: Optional[Policy] = None,
    ) -> Admission:
        """Capture this rank's part of a DeepSpeed checkpoint (a collective: every rank calls
        it, with the same `blocked_elsewhere`) and hand it to the writer thread. The local
        folder has the layout of `wildtrain.checkpoint.save`."""

        def capture(job: _Job) -> None:
            original = engine.checkpoint_engine
            engine.checkpoint_engine = CapturingWriter(original, lambda path, state: self._capture(job, path, state))
            try:
                checkpoint.save(engine, str(job.folder), meta.tag, client_state, self.rank)
            finally:
                engine.checkpoint_engine = original

        return self._save(meta, blocked_elsewhere, policy, capture)

    def start_process(self) -> None:
        """Spawn the save process where the saves run in one and this saver has none yet."""
        with self._cond:
            if self.background == "process" and self._process is None:
                self._process = SaveProcess(self.nice)

    def reserve_buffers(self, engine) -> None:
        """Allocate the host buffers of this rank's part of `engine`'s checkpoints in the background, before the
        first save needs them (a collective, as a save is); scratch of the attempt's own, as runs share a node."""
        reserve(self._buffers, engine, self.staging / f"reserve.{self.attempt}.rank{self.rank}", self.rank)

    def save_state(
        self,
        meta: CheckpointMeta,
        files: Mapping[str, Any],
        *,
        blocked_elsewhere: bool = False,
        policy: Optional[Policy] = None,
    ) -> Admission:
        """Capture `files` (path in the checkpoint folder → a nested container of tensors for
        `torch.save`, or `bytes` written as they are) and hand them to the writer thread."""

        def capture(job: _Job) -> None:
            for path, obj in files.items():
                self._capture(job, str(job.folder / path), obj)

        return self._save(meta, blocked_elsewhere, policy, capture)

    def release(self, step: int) -> None:
        """Let saves of steps up to `step` commit, their reports collected: a checkpoint committed before its
        step's metrics reached the controller could be restored after a crash with them lost for good."""
        with self._cond:
            self._released = max(self._released, step)
            self._cond.notify_all()

    def reported(self, step: int) -> None:
        """The report of `step` was handed to Ray, which takes one only once the controller
        collected the one before: saves up to the step of that one may commit, and saves up to
        `step` as soon as `reports_collected()` says the controller has this one too."""
        with self._cond:
            self._released = max(self._released, self._reported)
            self._reported = max(self._reported, step)
            self._cond.notify_all()

    def committed(self, step: int) -> bool:
        """Whether a save of `step` ended committed in at least one store, among the outcomes
        not drained yet (rank 0 commits; on other ranks: whether this rank's part got in)."""
        with self._cond:
            return any(o.step == step and o.status in ("saved", "partial") for o in self._outcomes)

    def drain(self) -> list[SaveOutcome]:
        """The outcomes recorded since the last call, oldest first."""
        with self._cond:
            outcomes, self._outcomes = self._outcomes, []
        return outcomes

    def flush(self, timeout_s: Optional[float] = None) -> bool:
        """Wait until no save is in flight or queued; False if `timeout_s` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._running is None and self._queued is None, timeout_s)

    def close(self, timeout_s: Optional[float] = None) -> bool:
        """Finish the saves in flight and queued, then stop the writer thread and the save
        process. A save still running after `timeout_s` is killed with its process (its
        outcome: failed); in a thread it is left to end on its own."""
        finished = self._close(timeout_s)
        if self._process is not None:
            self._process.stop(timeout_s)
        return finished

    def close_keeping_process(self, timeout_s: Optional[float] = None) -> Optional[SaveProcess]:
        """`close`, handing the save process over to a next saver where it is idle and alive
        (None where a save had to be killed with it, or the saves ran in a thread)."""
        self._close(timeout_s)
        process, self._process = self._process, None
        if process is not None and not process.alive():
            process.stop(0)  # its pipes
            return None
        return process

    def regroup(self, *, rank: int, world_size: int, attempt: str, reports_collected: Callable[[], bool]) -> None:
        """Save as `rank` of `world_size` in `attempt` from the next save on: the worker group
        re-formed in-process with workers that joined (elastic.in_process). A save in flight
        or queued ends as its own group's: every rank of that group is still in."""
        with self._cond:
            self.rank, self.attempt, self._reports_collected = rank, attempt, reports_collected
            self._settings = dataclasses.replace(self._settings, rank=rank, world_size=world_size)
            self._buffers = self._buffers.emptied()  # the new layout's tensors fit none of the old
            self._tries = (-1, 0)

    def _close(self, timeout_s: Optional[float]) -> bool:
        finished = self.flush(timeout_s)
        self._closing.set()
        with self._cond:
            self._cond.notify_all()
        if self.background == "thread":
            self._thread.join(timeout_s if finished else 0)
            return finished
        if not finished and self._process is not None:
            self._process.interrupt()
        self._thread.join()  # at once: the process is idle, or dead and its save recorded
        return finished

    def _save(
        self, meta: CheckpointMeta, blocked_elsewhere: bool, policy: Optional[Policy], capture: Callable[[_Job], None]
    ) -> Admission:
        started = time.perf_counter()
        admission = self.admission(blocked_elsewhere=blocked_elsewhere, policy=policy)
        if admission.action == "skip":
            self._record(
                SaveOutcome(
                    meta.step,
                    checkpoint_name(meta.step, self.attempt),
                    "skipped",
                    admission.reason,
                    "disk_full" if admission.disk_full else "",
                    disk_full=admission.disk_full,
                )
            )
            return admission
        job = self._new_job(meta)
        try:
            with copying(self._copy_stream):
                capture(job)
        except BaseException:
            self._discard(job)
            raise
        job.stall_s = time.perf_counter() - started
        self._enqueue(job)
        return admission

    def _new_job(self, meta: CheckpointMeta) -> _Job:
        # A step saved again (a must-commit save retried) gets a folder of its own, so that
        # the earlier try's part records, failed ones included, are not read as this one's.
        # Every rank counts the same tries: the capture is a collective.
        tries = self._tries[1] + 1 if self._tries[0] == meta.step else 1
        self._tries = (meta.step, tries)
        name = checkpoint_name(meta.step, self.attempt if tries == 1 else f"{self.attempt}t{tries}")
        folder = self.staging / f"{name}.rank{self.rank}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        return _Job(meta, name, folder, self._settings, self._buffers)

    def _capture(self, job: _Job, path: str, state: Any) -> None:
        key = buffer_key(job.folder, job.meta.tag, path)
        host = state if isinstance(state, bytes) else to_host(state, key, job.host, job.buffers, self._copy_stream)
        job.pending.append((Path(path).relative_to(job.folder).as_posix(), host))

    def _enqueue(self, job: _Job) -> None:
        with self._cond:
            superseded, self._queued = self._queued, job
            self._cond.notify_all()
        if superseded is not None:
            self._record(
                SaveOutcome(
                    superseded.meta.step,
                    superseded.name,
                    "skipped",
                    f"superseded by the save of step {job.meta.step} while queued",
                    stall_s=superseded.stall_s,
                )
            )
            self._discard(superseded)

    def _discard(self, job: _Job) -> None:
        job.host.give_back(job.buffers)
        shutil.rmtree(job.folder, ignore_errors=True)

    def _record(self, outcome: SaveOutcome) -> None:
        with self._cond:
            self._outcomes.append(outcome)

    def _report_collected(self, step: int) -> bool:
        with self._cond:
            if self._released >= step:
                return True
            if self._reported >= step and self._reports_collected():
                self._released = max(self._released, self._reported)
                return True
            return False

    # ------------------------------------------------------------ writer thread

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queued is not None or self._closing.is_set())
                if self._closing.is_set():
                    break
                job, self._queued = self._queued, None
                job.started = time.monotonic()
                self._running = job
            try:
                result = self._run(job)
                outcome = result.outcome
            except Exception as e:  # a bug here must neither stop training nor leave the saver busy for good
                outcome = SaveOutcome(job.meta.step, job.name, "failed", describe(e), "error", job.stall_s)
            else:
                self._good = set(result.good)
                if result.last_bytes is not None:
                    self._last_bytes = result.last_bytes
                self.last_commit = result.last_commit or self.last_commit
            finally:
                self._discard(job)
            with self._cond:
                self._outcomes.append(outcome)
                self._running = None
                self._cond.notify_all()
        with self._cond:
            dropped, self._queued = self._queued, None
        if dropped is not None:
            self._record(
                SaveOutcome(
                    dropped.meta.step,
                    dropped.name,
                    "skipped",
                    "the saver closed before it started",
                    stall_s=dropped.stall_s,
                )
            )
            self._discard(dropped)

    def _run(self, job: _Job) -> SaveResult:
        work = SaveJob(
            job.meta, job.name, job.folder, tuple(job.pending), job.pending_bytes(), job.stall_s, frozenset(self._good)
        )
        if self.background == "thread":
            return run_save(job.settings, work, _Link(self, job))
        started = time.perf_counter()
        self.start_process()  # where deferred
        try:
            return self._process.run(job.settings, work, _Link(self, job), self.timeout_s)
        except SaveProcessLost as e:
            with self._cond:  # ready before the next save; a closing saver has none
                self._process = None if self._closing.is_set() else SaveProcess(self.nice)
            outcome = SaveOutcome(
                job.meta.step,
                job.name,
                "failed",
                f"step {job.meta.step}: {e}",
                e.failure,
                job.stall_s,
                time.perf_counter() - started,
            )
            return SaveResult(outcome, None, work.good, None)
