"""The per-worker training function that Ray Train runs on every worker of the group.

It reads in the order it runs: plan the batch for this world size, check the group's
health, restore the newest checkpoint (resharding it if it was saved at another size) into
a new engine, then step, and at the steps due for it validate, save, report and regrow,
until the run's last step. A worker group that Ray Train restarts (a node died, capacity came back)
re-enters here at its new size.

A rank that fails ends the attempt on every rank (`collectives.failing_together`): its
peers leave the collective they wait in instead of waiting out its timeout.

A report never holds a step back: Ray Train keeps one report per worker, and a second
waits until the controller polls (`elastic.poll_interval_s`). So the metrics of each log
step are kept as a closed window, and the windows go to the controller together at the
first report step at which every rank's previous report has been collected, looked for
once a poll's worth of steps has passed, or at every log step once a save waits for its
step's report to commit; only the last step's report, a regrow's and a divergence's wait
for their turn. Early stop (on for sweep trials) judges each window's loss at the step that
closes it, not when the window is reported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from dataclasses import dataclass
from typing import Optional

import psutil
import ray.train
import ray.train.torch
import torch

from wildtrain import ray_compat, storage
from wildtrain.batching import batch_plan
from wildtrain.checkpoint.async_save import AsyncSaver
from wildtrain.checkpoint.format import new_attempt_token
from wildtrain.checkpoint.retention import RetentionPolicy
from wildtrain.config import Config
from wildtrain.data.dataset import OpenedData
from wildtrain.data.manifest import ShardCorrupt
from wildtrain.data.objectives import Objective
from wildtrain.data.stream import RankStream
from wildtrain.elastic.scaling import spare_cpus, trains_on_gpu
from wildtrain.elastic.signals import FinalCheckpointFailed, PlannedRegrow, RunCannotContinue, UnhealthyNodes
from wildtrain.events import RegrowPostponed, StoppedEarly
from wildtrain.layout import RunLayout, checkpoint_stores
from wildtrain.model import flops_per_token
from wildtrain.tracking.worker.mfu import peak_flops
from wildtrain.train import checkpointing, collectives, validation
from wildtrain.train.divergence import judge_loss
from wildtrain.train.growth import GrowthCheck
from wildtrain.train.monitor import Monitor
from wildtrain.train.samples import SampleRecorder
from wildtrain.train.reporting import ReportCadence
from wildtrain.train.schedule import At
from wildtrain.train.step import DeviceBatches, StepMetrics, Window, train_step
from wildtrain.train.validation import Validator
from wildtrain.train.watchdog import HangWatchdog
from wildtrain.worker_report import Startup, WorkerReport


@dataclass(frozen=True)
class LoopInputs:
    """What the driver hands every worker: the run's config, its opened datasets, what
    one worker holds on its node (to look for room for another), and where the driver's
    s3:// URIs went."""

    cfg: Config
    data: OpenedData
    worker_resources: dict[str, float]
    storage_view: storage.StorageView


def train_loop(inputs: LoopInputs) -> None:
    cfg = inputs.cfg
    check_storage(inputs.storage_view, cfg)
    collectives.open_control_group(control_timeout_s(cfg))
    # Raised by every rank at the same step: nobody's failure.
    together = (PlannedRegrow, UnhealthyNodes, FinalCheckpointFailed)
    with collectives.failing_together(ray.train.get_context().get_world_rank(), together):
        attempt = Attempt(inputs)
        try:
            while attempt.state.step < cfg.train.steps:
                at = attempt.step()
                # Each component says whether this step is due for it, in the order they run.
                validated = attempt.validate(at)
                logs = attempt.reports.logs(at, validated)
                regrow = attempt.growth.due(at, logs)
                saving = checkpointing.due(at, cfg.checkpoint, regrow)
                if saving:
                    regrow = attempt.save(at, regrow)
                if attempt.reports.due(logs, saving):
                    attempt.report(at, logs, saving, checkpointing.must_commit(at, regrow))
                if attempt.diverged:
                    break  # a diverged trial's checkpoint is worth nothing: no last save
                if regrow:
                    raise PlannedRegrow(f"room for more than {attempt.world_size} workers; "
                                        f"regrowing from the checkpoint of step {attempt.state.step}")
        finally:
            attempt.watchdog.stop()


def check_storage(drivers: storage.StorageView, cfg: Config) -> None:
    """Stop the run, naming what differs, unless this worker's s3:// URIs go where the
    driver's went. The driver's settings reach it in its runtime env; a worker that still
    resolves them otherwise (something on its node overrides them) would read and write
    another store, or none."""
    differs = storage.StorageView.here(cfg.storage).differences(drivers)
    if differs:
        raise RunCannotContinue(f"storage: a worker on {ray.util.get_node_ip_address()} resolves s3:// unlike "
                                f"the driver: {'; '.join(differs)}")


def control_timeout_s(cfg: Config) -> float:
    """The bound of the control group's waits (`collectives`): the longest that one rank may
    legitimately wait for another is a restore's conversion (bounded by the start-up
    watchdog) or a save that must commit (checkpoint.timeout_s)."""
    return max(cfg.monitor.startup_timeout_s or _NO_BOUND_S, cfg.checkpoint.timeout_s)


_NO_BOUND_S = 7 * 24 * 3600.0  # monitor.startup_timeout_s=0 (off): no bound of ours, but torch needs one


class Attempt:
    """One worker's part of one worker group: built at its world size from the newest
    checkpoint, it trains until the run ends or the group is restarted."""

    def __init__(self, inputs: LoopInputs) -> None:
        self.started_at = time.time()
        self.cfg = cfg = inputs.cfg
        self.data = inputs.data
        # DeepSpeed's ZeRO calls a deprecated collective once per step; the warning says nothing new.
        warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)
        ray_compat.quiet_report_log()
        ray_compat.quiet_ray_data()
        context = ray.train.get_context()
        self.world_size, self.rank = world_size, rank = context.get_world_size(), context.get_world_rank()
        self.plan = batch_plan(cfg.train.global_batch_size, cfg.train.micro_batch_size, world_size)

        torch.manual_seed(cfg.train.seed)
        # Ray Train set this worker's CUDA device; NCCL's collectives and the batches go there.
        device = ray.train.torch.get_device() if trains_on_gpu(cfg) else torch.device("cpu")
        # From here to the first step (health check, restore, engine build) under the start-up bound.
        self.watchdog = HangWatchdog(cfg.monitor.hang_timeout_s, cfg.monitor.startup_timeout_s,
                                     RunLayout.of(cfg).hangs, rank, cfg.storage)
        # The health check first: a group that is about to re-form without a node should not
        # download and load a checkpoint before it finds out.
        self.monitor = Monitor(cfg, rank, world_size, device)
        if self.monitor.unhealthy_nodes:
            raise UnhealthyNodes(self.monitor.unhealthy_nodes, self.monitor.take_events())
        self.health_checked_at = time.time()
        stores = checkpoint_stores(cfg)
        self.engine, self.state, self.restored = checkpointing.build_and_restore(cfg, self.plan, world_size, rank,
                                                                                   stores, device)
        self.restored_at = time.time()
        self.restored_step = self.state.step
        self.state.world_size = world_size
        background, shm_events = checkpointing.save_mode(cfg, rank, world_size, self.monitor.nodes)
        self.monitor.events += shm_events
        self.saver = AsyncSaver(
            stores, cfg.checkpoint.staging_dir, rank=rank, world_size=world_size,
            attempt=collectives.broadcast_object(new_attempt_token()),
            policy=cfg.checkpoint.policy, timeout_s=cfg.checkpoint.timeout_s, verify_upload=cfg.checkpoint.verify_upload,
            retention=RetentionPolicy(cfg.checkpoint.keep_last, cfg.checkpoint.keep_every),
            known_good=[self.restored.candidate.key] if self.restored.candidate else [], commit_when_released=True,
            reports_collected=ray_compat.reports_collected, background=background, device=device,
        )
        self.reported_step = self.state.step  # the newest step whose report the controller has for sure
        # The data position is the step: the stream starts where the restored model stopped.
        # It reads doc_ids only for an objective or a mask that needs them.
        objective = Objective.of(cfg, inputs.data.tokenizer)
        stream = RankStream(inputs.data.datasets, cfg, rank, world_size, from_step=self.state.step,
                            doc_ids=not objective.plain)
        self.samples = SampleRecorder(cfg, rank) if cfg.data.record_samples else None
        self.diverged = False
        self.windows: list[Window] = []  # closed at log steps, not yet reported
        self.validator = Validator(cfg, inputs.data, rank, world_size, device) if inputs.data.validation else None
        self.validated: dict[str, float] = {}  # this step's validation metrics, for its window
        self.reports = ReportCadence(cfg.train.log_every)
        self.startup: Optional[Startup] = None  # the attempt's start-up timings, until a report carries them

        self.tokens_per_step = self.plan.global_batch_size * cfg.data.seq_len
        peak = peak_flops(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                          cfg.cluster.peak_flops_per_device)
        self.window = StepMetrics(self.tokens_per_step, flops_per_token(cfg.model, cfg.data.seq_len), peak, world_size,
                                  device, data_wait=stream)
        # Each step's rows become the objective's examples (a pure function of the step and
        # the rows), copied to the device while the step before it trains.
        self.batches = DeviceBatches((stream.next_step() for _ in range(cfg.train.steps - self.state.step)), device,
                                     tokens=lambda step: objective.rows(step.step, step.sample_ids, step.tokens,
                                                                        step.doc_ids))
        # Drills (chaos.*), off by default.
        self.slow_forward_s = cfg.chaos.slow_step_s if self.monitor.slowed_by_chaos else 0.0
        self.fails_at_step = cfg.chaos.fail_at_step if rank == cfg.chaos.fail_rank else 0
        self.growth = GrowthCheck(world_size < cfg.elastic.max_workers, rank, inputs.worker_resources,
                                  cfg.elastic.resize_check_interval_s, cfg.run.name, spare_cpus(cfg))

    def step(self) -> At:
        """One optimizer step; where it leaves the run."""
        try:
            rows, batch = next(self.batches)
        except ShardCorrupt as e:
            raise RunCannotContinue(f"{e}; to train on without it, resubmit with data.skip_bad_shards=true "
                                    "and data.allow_order_change=true (the rows of later steps change)") from None
        if self.state.step + 1 == self.fails_at_step:
            self._fail_once()
        started = time.perf_counter()
        train_step(self.engine, self.plan, rows, self.window, self.slow_forward_s)
        time.sleep(max(0.0, self.cfg.chaos.min_step_s - (time.perf_counter() - started)))
        state = self.state
        if state.step == self.restored_step:
            # The optimizer's state exists from the first step on: the first save's host
            # buffers can be allocated now, in the background (a collective).
            self.saver.reserve_buffers(self.engine)
        state.step += 1
        state.tokens_seen += self.tokens_per_step
        self.watchdog.progress(state.step)
        self.monitor.step_done(state.step, self.window)
        if self.samples is not None:
            self.samples.record(state.step, batch.sample_ids)
        return At.of(state.step, self.restored_step, self.cfg.train.steps)

    def validate(self, at: At) -> bool:
        """Score the validation set if the run has one and `at` is due for it
        (train/validation.py); its time is the window's `eval`, its metrics ride in the
        window closed at this step. Whether it did."""
        if self.validator is None or not validation.due(at, self.cfg.eval):
            return False
        with self.window.timed("eval"):
            self.validated = self.validator.evaluate(self.engine)
        return True

    def _fail_once(self) -> None:
        """The chaos.fail_rank drill: this rank raises mid-step, the first time the run gets here."""
        marker = RunLayout.of(self.cfg).chaos_failed
        if storage.read_text(marker, self.cfg.storage) is None:
            storage.write_text(marker, f"rank {self.rank}, step {self.fails_at_step}", self.cfg.storage)
            raise RuntimeError(f"chaos drill: rank {self.rank} fails in step {self.fails_at_step} (chaos.fail_rank)")

    def save(self, at: At, regrow: bool) -> bool:
        """Save this step's checkpoint; whether the regrow is still on. A regrow whose checkpoint
        did not commit is called off; a last step whose checkpoint did not commit ends the run."""
        cfg, state = self.cfg, self.state
        # Every optimizer step applied exactly once across restarts, or nothing is saved.
        if self.engine.global_steps != state.step:
            raise RuntimeError(f"DeepSpeed counted {self.engine.global_steps} optimizer steps where the run is at {state.step}")
        must_commit = checkpointing.must_commit(at, regrow)
        # A save that must commit waits on storage up to checkpoint.timeout_s, longer than a hang.
        commit_wait = (self.watchdog.waiting(f"the commit of step {state.step}", up_to_s=cfg.checkpoint.timeout_s)
                       if must_commit else contextlib.nullcontext())
        with self.window.timed("checkpoint_stall"), commit_wait:
            # The last save is retried; a regrow's is not: training on at this size is no loss.
            committed = checkpointing.save(self.saver, self.engine, cfg, state, self.world_size,
                                           must_commit=must_commit, retry=at.last)
        if regrow and not committed:
            # Regrowing now would restart from an older checkpoint and redo steps, and a
            # regrow is no failure, so storage trouble plus free room would loop.
            self.monitor.events.append(RegrowPostponed(
                time.time(), state.step, f"the checkpoint of step {state.step} did not commit; training on at this size"))
            return False
        if at.last and not committed:
            restored = self.restored.candidate
            newest = self.saver.last_commit or (storage.join(*restored.key) if restored else None)
            raise FinalCheckpointFailed(state.step, collectives.broadcast_object(newest) or "none")
        return regrow

    def _steps_per_poll(self, windows: list[dict]) -> int:
        """About how many steps pass before the controller polls again and has taken the
        report just sent: until then no rank looks whether it has (a collective a log step
        for nothing). From rank 0's step time, so every rank counts alike."""
        step_s = collectives.broadcast_object(windows[-1]["step_time_s"] if windows else None)
        return max(1, int(self.cfg.elastic.poll_interval_s / step_s)) if step_s else 1

    def _judge(self, window: Window) -> None:
        """The early-stop rule on the watched loss of the window just closed, at its own step
        rather than when it is reported (a report may wait a poll's worth of steps, and a
        short trial would reach its end first): the mean over ranks, so every rank decides
        alike. A diverged run's event goes with the report this step sends."""
        if not self.cfg.early_stop.enabled or self.diverged:
            return
        watched = self.cfg.early_stop.metric
        if watched == "loss":
            # A collective and a device sync: every rank closes the same windows.
            loss = collectives.mean_over_ranks(window.loss).item()
        elif watched in window.metrics:
            loss = window.metrics[watched]  # a validation's, already over all ranks
        else:
            return  # no validation at this log step
        verdict = judge_loss(loss, self.state.best_loss, self.cfg.early_stop.loss_factor)
        self.state.best_loss = verdict.best
        if verdict.reason is not None:
            self.diverged = True
            self.monitor.events.append(StoppedEarly(time.time(), self.state.step, verdict.reason))

    def report(self, at: At, logs: bool, saving: bool, must_commit: bool) -> None:
        """Close this log step's window (`logs`), then hand the controller the windows, the saves
        that ended and the events since the last report, once that holds no step back (see
        the module docstring); a save commits once its report is collected."""
        state = self.state
        if logs:
            self.windows.append(self.window.close(step=state.step, tokens_seen=state.tokens_seen,
                                                  world_size=self.world_size, lr=self.engine.get_lr()[0],
                                                  epoch=(state.step - 1) // self.data.steps_per_epoch,
                                                  **self.validated))
            self.validated = {}
            self._judge(self.windows[-1])
        if at.first:
            # What the controller needs to split this attempt's recovery (and start-up) time into its parts.
            self.startup = Startup(restored_step=self.restored_step, **dataclasses.asdict(self.restored.timing),
                                   worker_started_at=psutil.Process().create_time(), attempt_started_at=self.started_at,
                                   health_checked_at=self.health_checked_at, restored_at=self.restored_at,
                                   first_step_at=time.time())
        # Time blocked here is the report's, never the step's: its own badput in goodput.
        with self.window.timed("report_wait"):
            # The run's end, a regrow and a divergence (which ends the run) cannot go on without
            # their report; every other report waits for a step at which no rank's previous
            # one is still queued.
            looking = self.reports.looks(at, saving)
            if (not must_commit and not self.diverged
                    and (not looking or not collectives.all_ranks(ray_compat.reports_collected()))):
                return
            windows = self.window.resolve(self.windows)
            self.windows = []
            if windows:
                self.monitor.export(windows[-1])
            saves = checkpointing.saves_report(self.saver.drain())
            events = self.monitor.take_events() + saves.events
            if self.startup is not None:
                events = self.restored.events + events
            ray.train.report(WorkerReport(
                step=state.step, tokens_seen=state.tokens_seen, world_size=self.world_size, windows=tuple(windows),
                events=tuple(events), checkpoint=saves.metrics, committed_checkpoints=tuple(saves.committed),
                startup=self.startup,
            ).to_dict())
            self.startup = None
            self.reports.sent(state.step, self._steps_per_poll(windows))
        # Every rank's previous report had been collected (or this one waited for its turn),
        # so reports up to it are at the controller; this one's save commits once the
        # controller polls (`reports_collected`).
        self.saver.release(self.reported_step)
        self.saver.reported(state.step)
        self.reported_step = state.step
