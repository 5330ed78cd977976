"""One worker's part of one worker group, or of one in-process generation of it (`Attempt`):
built at its world size from the newest checkpoint or from the state its peers kept, it
steps, validates, saves and reports for the loop in train/loop.py.

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
from typing import Optional, Union

import psutil
import torch

from wildtrain import ray_compat, storage
from wildtrain.batching import batch_plan
from wildtrain.checkpoint.async_save import AsyncSaver
from wildtrain.checkpoint.format import new_attempt_token
from wildtrain.checkpoint.retention import RetentionPolicy
from wildtrain.checkpoint.save_process import SaveProcess
from wildtrain.config import config_hash
from wildtrain.data.manifest import ShardCorrupt
from wildtrain.data.objectives import Objective
from wildtrain.data.stream import RankStream
from wildtrain.elastic.scaling import spare_cpus
from wildtrain.elastic.signals import FinalCheckpointFailed, RunCannotContinue, UnhealthyNodes
from wildtrain.engine import EngineSettings
from wildtrain.events import Event, RegrowPostponed, Resize, StoppedEarly
from wildtrain.layout import RunLayout, checkpoint_stores
from wildtrain.model import flops_per_token
from wildtrain.tracking.worker.mfu import device_peak
from wildtrain.train import checkpointing, collectives, validation
from wildtrain.train.divergence import judge_loss
from wildtrain.train.drills import Drills
from wildtrain.train.generations import Leftovers, Unreported
from wildtrain.train.growth import GrowthCheck
from wildtrain.train.membership import Group
from wildtrain.train.monitor import Monitor
from wildtrain.train.reporting import ReportCadence
from wildtrain.train.samples import SampleRecorder
from wildtrain.train.schedule import At
from wildtrain.train.step import DeviceBatches, StepMetrics, Window, train_step
from wildtrain.train.validation import Validator
from wildtrain.train.watchdog import HangWatchdog
from wildtrain.worker_inputs import LoopInputs
from wildtrain.worker_report import Startup, WorkerReport


class Attempt:
    """One worker's part of one worker group (`group`: Ray Train's, or with elastic.in_process
    one generation of it, train/membership.py): built at its world size from the newest
    checkpoint or from the state its peers kept, it trains until the run ends or the group is
    restarted or re-formed."""

    def __init__(self, inputs: LoopInputs, device: torch.device, group: Group) -> None:
        self.started_at = time.time()
        self.cfg = cfg = inputs.cfg
        self.data, self.group, self.left = inputs.data, group, group.left
        # DeepSpeed's ZeRO calls a deprecated collective once per step; the warning says nothing new.
        warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)
        ray_compat.quiet_report_log()
        ray_compat.quiet_ray_data()
        self.world_size, self.rank = world_size, rank = group.world_size, group.rank
        self.plan = batch_plan(cfg.train.global_batch_size, cfg.train.micro_batch_size, world_size)
        self.layout = RunLayout.of(cfg.run, cfg.checkpoint)
        self.engine_settings = EngineSettings(
            cfg.model, cfg.optim, cfg.deepspeed, cfg.train.steps, cfg.elastic.collective_timeout_s
        )
        self.save_settings = checkpointing.SaveSettings(
            cfg.deepspeed.zero_stage, cfg.train.seed, config_hash(cfg), cfg.checkpoint.timeout_s
        )

        torch.manual_seed(cfg.train.seed)
        # From here to the first step (health check, restore, engine build) under the start-up bound.
        self.watchdog = HangWatchdog(
            cfg.monitor.hang_timeout_s,
            cfg.monitor.startup_timeout_s,
            self.layout.hangs,
            rank,
            cfg.storage,
        )
        try:
            self._build(inputs, device)
        except BaseException:
            self.close()
            raise

    def _build(self, inputs: LoopInputs, device: torch.device) -> None:
        cfg, rank, world_size, left, group = self.cfg, self.rank, self.world_size, self.left, self.group
        # The health check first: a group that is about to re-form without a node should not
        # download and load a checkpoint before it finds out. Survivors re-formed in-process
        # trained together a step ago.
        self.monitor = Monitor(
            cfg.monitor,
            cfg.chaos,
            rank,
            device,
            run_name=cfg.run.name,
            min_workers=cfg.elastic.min_workers,
            zero_stage=cfg.deepspeed.zero_stage,
            check_health=left is None,
        )
        if self.monitor.unhealthy_nodes:
            raise UnhealthyNodes(self.monitor.unhealthy_nodes, self.monitor.take_events())
        self.health_checked_at = time.time()
        stores = checkpoint_stores(self.layout, cfg.storage)
        # The data position is the step: the stream starts where the restored model stopped.
        # It reads doc_ids only for an objective or a mask that needs them.
        objective = Objective.of(cfg.objective, cfg.train, cfg.model, inputs.data.tokenizer)
        held = group.held_by_peers()  # None: from the checkpoint, as every rank agreed
        if held is None:
            self.engine, self.state, self.restored = checkpointing.build_and_restore(
                self.engine_settings, cfg.checkpoint.staging_dir, self.plan, world_size, rank, stores, device
            )
            self.stream = self._open_stream(inputs, objective, self.state.step)
            self.known_good = [self.restored.candidate.key] if self.restored.candidate else []
        else:
            # The step is known before the engine is built: the first step's rows are read meanwhile.
            self.stream = self._open_stream(inputs, objective, held.state.step)
            self.engine, self.state, self.restored = checkpointing.restore_from_peers(
                self.engine_settings, self.plan, device, held
            )
            self.known_good = left.known_good
        self.restored_at, self.restored_step = time.time(), self.state.step
        self.state.world_size = world_size
        self.commits = group.commits(self.state, self.monitor.nodes)
        self.monitor.events += group.formed(self.state.step, self.monitor.nodes)
        background, shm_events = checkpointing.save_mode(
            self.engine_settings, cfg.checkpoint.background, cfg.cluster.use_gpu, rank, world_size, self.monitor.nodes
        )
        self.monitor.events += shm_events
        token = collectives.broadcast_object(new_attempt_token())
        self.saver = self._saver(left.saving if left else None, stores, background, device, token)
        self.samples = SampleRecorder(self.layout, cfg.storage, rank) if cfg.data.record_samples else None
        self.diverged = False
        self.windows: list[Window] = []  # closed at log steps, not yet reported
        # Resolved and not yet reported: the windows an attempt dropped by a re-form left, but
        # for those of steps it trains again.
        self.resolved: list[dict] = [w for w in left.windows if w["step"] <= self.restored_step] if left else []
        self.carried_events: list[Event] = list(left.events) if left else []
        self.carried_commits: list[str] = list(left.committed) if left else []
        self.validator = (
            Validator(
                inputs.data,
                cfg.data.seq_len,
                cfg.eval.micro_batch_size or cfg.train.micro_batch_size,
                cfg.storage,
                rank,
                world_size,
                device,
            )
            if inputs.data.validation
            else None
        )
        self.validated: dict[str, float] = {}  # this step's validation metrics, for its window
        self.reports = ReportCadence(cfg.train.log_every)
        self.startup: Optional[Startup] = None  # the attempt's start-up timings, until a report carries them
        self.tokens_per_step = self.plan.global_batch_size * cfg.data.seq_len
        peak = device_peak(device, cfg.cluster.peak_flops_per_device)
        self.window = StepMetrics(
            self.tokens_per_step,
            flops_per_token(cfg.model, cfg.data.seq_len),
            peak,
            world_size,
            device,
            data_wait=self.stream,
        )
        # Each step's rows become the objective's examples (a pure function of the step and
        # the rows), copied to the device while the step before it trains.
        self.batches = DeviceBatches(
            (self.stream.next_step() for _ in range(cfg.train.steps - self.state.step)),
            device,
            tokens=lambda step: objective.rows(step.step, step.sample_ids, step.tokens, step.doc_ids),
        )
        # Drills (chaos.*), off by default.
        self.drills = Drills(
            cfg.chaos,
            rank,
            self.state.step,
            chaos_failed=self.layout.chaos_failed,
            storage_config=cfg.storage,
            joiner=group.joined,
            slowed=self.monitor.slowed_by_chaos,
            model=self.engine.module,
            short_of_members=group.short_of_members,
            spares_wanted=cfg.elastic.spares,
            spares_waiting=group.spares_waiting,
        )
        # A generation that lost members grows back by the workers the controller starts on
        # their placement slots once Ray placed those again (`elastic.survivors`).
        self.growth = GrowthCheck(
            world_size < cfg.elastic.max_workers,
            rank,
            inputs.worker_resources,
            cfg.elastic.resize_check_interval_s,
            cfg.run.name,
            spare_cpus(cfg.data, cfg.eval),
            joiners=group.joiners_waiting,
            awaiting_joiners=group.short_of_members,
        )
        # This layout's first mirrors, before its first step: a death during it is recovered from them.
        self.commit(flush=True)

    def _saver(
        self, handed: Union[AsyncSaver, SaveProcess, None], stores, background: str, device: torch.device, token: str
    ) -> AsyncSaver:
        """This attempt's saver: at a hand-over to joiners the last generation's, regrouped (its
        save in flight, if any, commits as that generation's); else a new one, in the idle save
        process the last attempt left where there is one."""
        if isinstance(handed, AsyncSaver) and handed.background == background:
            handed.regroup(
                rank=self.rank,
                world_size=self.world_size,
                attempt=token,
                reports_collected=self.group.reports_collected,
            )
            return handed
        if isinstance(handed, AsyncSaver):
            handed = handed.close_keeping_process(timeout_s=0)
        cfg = self.cfg
        return AsyncSaver(
            stores,
            cfg.checkpoint.staging_dir,
            rank=self.rank,
            world_size=self.world_size,
            attempt=token,
            policy=cfg.checkpoint.policy,
            timeout_s=cfg.checkpoint.timeout_s,
            verify_upload=cfg.checkpoint.verify_upload,
            retention=RetentionPolicy(cfg.checkpoint.keep_last, cfg.checkpoint.keep_every),
            known_good=self.known_good,
            commit_when_released=True,
            reports_collected=self.group.reports_collected,
            background=background,
            device=device,
            process=handed,
            # Started after the first step: its imports would take CPU from every rank's start.
            defer_process=True,
        )

    def _open_stream(self, inputs: LoopInputs, objective: Objective, from_step: int) -> RankStream:
        """This rank's rows from `from_step` on, read from now on in the background."""
        stream = RankStream(
            inputs.data.datasets,
            self.cfg.data,
            self.cfg.train,
            self.cfg.storage,
            self.rank,
            self.world_size,
            from_step=from_step,
            doc_ids=not objective.plain,
        )
        stream.start()
        return stream

    def commit(self, flush: bool) -> None:
        """Commit the step before this one, or with `flush` this one (in-process: `PeerCommits`)."""
        self.commits.commit(self.engine, self.state, self.window, flush)

    def re_formed_at_the_end(self) -> bool:
        """Whether this attempt was re-formed in-process after the run's last step committed
        (a member died in that step's report): the report is all that is left of the run."""
        return self.left is not None and self.state.step == self.cfg.train.steps

    def close(self, keep_save_process: bool = False) -> Optional[SaveProcess]:
        """Stop what this attempt started (its watchdog, and where built, its stream and its
        saver: a save in flight is abandoned uncommitted). For a dropped attempt only: a
        finished one leaves its saves to commit. With `keep_save_process`, the saver's
        process, where idle, is not stopped but returned, for the next attempt."""
        self._stop_reading()
        if not hasattr(self, "saver"):
            return None
        if keep_save_process:
            return self.saver.close_keeping_process(timeout_s=0)
        self.saver.close(timeout_s=0)
        return None

    def _stop_reading(self) -> None:
        self.watchdog.stop()
        if hasattr(self, "stream"):
            self.stream.close()

    def abandon(self, error: BaseException, failed_at: float, left: Optional[Leftovers]) -> Leftovers:
        """Drop this attempt, which lost a member to `error` at `failed_at`: what the next one
        needs of it. A save in flight is abandoned (the lost member's part may never come).
        Only a membership that goes on without a lost member drops an attempt (`Membership.lost_member`)."""
        save_process = self.close(keep_save_process=True)
        failure = self.commits.failure(error, failed_at, self.state, self.world_size, list(self.monitor.nodes), left)
        return self.commits.leftovers(failure, self._take_unreported(), self.known_good, saving=save_process)

    def hand_over(self) -> Leftovers:
        """Drop this attempt at a committed step for the next generation, which workers joined (`MembersJoining`):
        what it needs of this one, its saver too (every member of it is in the next: a save in flight commits)."""
        self._stop_reading()
        resize = Resize(
            time.time(),
            self.world_size,
            self.state.step,
            f"workers joined the group of {self.world_size}",
            list(self.monitor.nodes),
        )
        return self.commits.leftovers(resize, self._take_unreported(), self.known_good, saving=self.saver)

    def _take_unreported(self, through: Optional[int] = None) -> Unreported:
        """What the reports have not carried yet (the windows up to step `through`), taken."""
        windows = [w for w in self.windows if through is None or w.metrics["step"] <= through]
        saves = checkpointing.saves_report(self.saver.drain())
        unreported = Unreported(
            self.resolved + self.window.resolve(windows),
            self.carried_events + self.monitor.take_events() + saves.events,
            self.carried_commits + list(saves.committed),
            saves.metrics,
        )
        self.windows, self.resolved, self.carried_events, self.carried_commits = (
            self.windows[len(windows) :],
            [],
            [],
            [],
        )
        return unreported

    def step(self) -> At:
        """One optimizer step; where it leaves the run."""
        try:
            rows, batch = next(self.batches)
        except ShardCorrupt as e:
            raise RunCannotContinue(
                f"{e}; to train on without it, resubmit with data.skip_bad_shards=true "
                "and data.allow_order_change=true (the rows of later steps change)"
            ) from None
        self.drills.before_step(self.state.step + 1)
        started = time.perf_counter()
        train_step(self.engine, self.plan, rows, self.window)
        self.drills.after_step(self.state.step + 1, started)
        state = self.state
        if state.step == self.restored_step:
            # The optimizer's state exists from the first step on: the first save's host
            # buffers can be allocated now, in the background (a collective).
            self.saver.start_process()
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

    def save(self, at: At, regrow: bool) -> bool:
        """Save this step's checkpoint; whether the regrow is still on. A regrow whose checkpoint
        did not commit is called off; a last step whose checkpoint did not commit ends the run."""
        cfg, state = self.cfg, self.state
        # Every optimizer step applied exactly once across restarts, or nothing is saved.
        if self.engine.global_steps != state.step:
            raise RuntimeError(
                f"DeepSpeed counted {self.engine.global_steps} optimizer steps where the run is at {state.step}"
            )
        must_commit = checkpointing.must_commit(at, regrow)
        # A save that must commit waits on storage up to checkpoint.timeout_s, longer than a hang.
        commit_wait = (
            self.watchdog.waiting(f"the commit of step {state.step}", up_to_s=cfg.checkpoint.timeout_s)
            if must_commit
            else contextlib.nullcontext()
        )
        with self.window.timed("checkpoint_stall"), commit_wait:
            # The last save is retried; a regrow's is not: training on at this size is no loss.
            committed = checkpointing.save(
                self.saver, self.engine, self.save_settings, state, self.world_size, must_commit, retry=at.last
            )
        if regrow and not committed:
            # Regrowing now would restart from an older checkpoint and redo steps, and a
            # regrow is no failure, so storage trouble plus free room would loop.
            self.monitor.events.append(
                RegrowPostponed(
                    time.time(),
                    state.step,
                    f"the checkpoint of step {state.step} did not commit; training on at this size",
                )
            )
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
            # A collective and a device sync (unless the window's loss is settled): every rank
            # closes the same windows.
            loss = window.loss.item() if window.settled else collectives.mean_over_ranks(window.loss).item()
        elif watched in window.metrics:
            loss = window.metrics[watched]  # a validation's, already over all ranks
        else:
            return  # no validation at this log step
        verdict = judge_loss(loss, self.state.best_loss, self.cfg.early_stop.loss_factor)
        self.state.best_loss = verdict.best
        if verdict.reason is not None:
            self.diverged = True
            self.monitor.events.append(StoppedEarly(time.time(), self.state.step, verdict.reason))
            self.commits.flush()  # the run ends at this step: its report carries it committed

    def report(self, at: At, logs: bool, saving: bool, must_commit: bool, hold: bool = False) -> None:
        """Close this log step's window (`logs`), then hand the controller the windows, the saves
        that ended and the events since the last report, once that holds no step back (see
        the module docstring); a save commits once its report is collected. With `hold` (a
        join's step) send nothing: it goes over the join on every rank (`Leftovers.of_rank`),
        where a lone member lost before the controller took it would have taken it along."""
        state = self.state
        if logs:
            window = self.window.close(
                step=state.step,
                tokens_seen=state.tokens_seen,
                world_size=self.world_size,
                lr=self.engine.get_lr()[0],
                epoch=(state.step - 1) // self.data.steps_per_epoch,
                **self.group.metrics(),
                **self.validated,
            )
            self.windows.append(window)
            self.validated = {}
            self._judge(window)
        if at.first and self.left is not None:
            self.carried_events += self.group.recovered(self.restored_at, self.restored_step)
        elif at.first:
            # What the controller needs to split this attempt's recovery (and start-up) time into its parts.
            self.startup = Startup(
                restored_step=self.restored_step,
                **dataclasses.asdict(self.restored.timing),
                worker_started_at=psutil.Process().create_time(),
                attempt_started_at=self.started_at,
                health_checked_at=self.health_checked_at,
                restored_at=self.restored_at,
                first_step_at=time.time(),
            )
        # Time blocked here is the report's, never the step's: its own badput in goodput.
        with self.window.timed("report_wait"):
            # The run's end, a regrow and a divergence (which ends the run) cannot go on without
            # their report; every other report waits for a step at which no rank's previous
            # one is still queued.
            looking = self.reports.looks(at, saving)
            if (
                not must_commit
                and not self.diverged
                and (hold or not looking or not collectives.all_ranks(self.group.reports_collected()))
            ):
                return
            # Only committed steps' windows go: in-process, another may be trained again (`PeerCommits`).
            committed = self.commits.committed
            unreported = self._take_unreported(committed)
            windows, events = unreported.windows, unreported.events
            if windows:
                self.monitor.export(windows[-1])
            if self.startup is not None:
                events = self.restored.events + events
            self.group.send(
                WorkerReport(
                    step=state.step,
                    tokens_seen=state.tokens_seen,
                    world_size=self.world_size,
                    windows=tuple(windows),
                    events=tuple(events),
                    checkpoint=unreported.checkpoint_metrics,
                    committed_checkpoints=tuple(unreported.committed),
                    startup=self.startup,
                ).to_dict()
            )
            self.startup = None
            self.reports.sent(state.step, self._steps_per_poll(windows))
        # Every rank's previous report had been collected (or this one waited for its turn);
        # this one's save commits once the controller polls (`reports_collected`).
        self.saver.reported(committed)
