"""What the controller's side of in-process recovery decides (elastic.survivors), without Ray's
actors: Ray Train's own report consolidation and poll statuses, a real rendezvous store."""

from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from ray.exceptions import ActorDiedError, RayActorError
from ray.train.v2._internal.execution.checkpoint.report_handler import ReportCallbackHandler
from ray.train.v2._internal.execution.controller.controller import TrainController
from ray.train.v2._internal.execution.training_report import _TrainingReport
from ray.train.v2._internal.execution.worker_group.poll import WorkerGroupPollStatus, WorkerStatus

from wildtrain import ray_compat, services
from wildtrain.elastic import rendezvous_keys
from wildtrain.elastic.joiners import Ended
from wildtrain.elastic.survivors import KeepSurvivors
from wildtrain.ray_compat import WorkerHealthCheckFailedError
from wildtrain.worker_report import WorkerReport


class StandInJoiners:
    """What `KeepSurvivors` asks of `Joiners`, without Ray's actors: which joiners run, what
    each reported since the last take, how their runs ended."""

    def __init__(self) -> None:
        self.running: set[str] = set()
        self.reports: dict[str, list[dict]] = {}
        self.ended_runs: dict[int, Ended] = {}
        self.started: list[int] = []

    def runs(self, name: str) -> bool:
        return name in self.running

    def take_reports(self, name: str) -> list[dict]:
        return self.reports.pop(name, [])

    def ended(self) -> dict[int, Ended]:
        ended, self.ended_runs = self.ended_runs, {}
        for _, (name, _) in ended.items():
            self.running.discard(name)
        return ended

    def start(self, worker_group, rank: int, token, group_size: int) -> None:
        self.started.append(rank)

    def stop(self) -> None:
        pass


class Group:
    """The parts of Ray Train's worker group the controller's side touches: its report
    consolidation (Ray's own `ReportCallbackHandler`) and its workers."""

    def __init__(self, size: int, report_callbacks: list) -> None:
        self.size = size
        self._callbacks = [ReportCallbackHandler(report_callbacks=report_callbacks)]
        self._callbacks[0].after_worker_group_start(self)

    def __len__(self) -> int:
        return self.size

    def get_workers(self) -> list:
        return [None] * self.size


def report(step: int) -> _TrainingReport:
    return _TrainingReport(
        checkpoint=None, validation=False, metrics=WorkerReport(step=step, tokens_seen=step, world_size=1).to_dict()
    )


def publish(store, generation: int, *members: str) -> None:
    store.set(rendezvous_keys.members(generation), ",".join(members))
    store.set(rendezvous_keys.GENERATION, str(generation))


class Consolidated(ray_compat.ReportCallback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def after_report(self, training_report, metrics) -> None:
        self.steps.append(WorkerReport.from_dict(metrics[0]).step)


def poll(group: Group, keep: KeepSurvivors, statuses: dict[int, WorkerStatus]) -> WorkerGroupPollStatus:
    """One controller poll: Ray's consolidation looks at it first, then wildtrain's callback."""
    status = WorkerGroupPollStatus(statuses)
    group._callbacks[0].after_worker_group_poll_status(status)
    keep.after_worker_group_poll_status(status)
    return status


DIED = WorkerHealthCheckFailedError("A worker health check failed.", failure=ActorDiedError())


@pytest.fixture
def group_of_two():
    """Ray Train's two workers, w0 and w1, in-process; rank 1's node lost, and a joiner on its
    slot (w1.1) in: generation 3 is (w0, w1.1)."""
    store = dist.TCPStore(
        services.HOST, services.free_port(), is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    joiners, consolidated = StandInJoiners(), Consolidated()
    keep = KeepSurvivors(services.HOST, store.port, decide_s=0.0, joiners=joiners)
    keep.store = lambda: store
    group = Group(2, [keep, consolidated])
    keep.after_worker_group_start(group)
    publish(store, 1, "w0", "w1")
    publish(store, 2, "w0")
    poll(group, keep, {0: WorkerStatus(running=True), 1: WorkerStatus(running=False, error=DIED)})
    assert keep.masked == {1} and joiners.started == [1]
    joiners.running.add("w1.1")
    publish(store, 3, "w0", "w1.1")
    poll(group, keep, {0: WorkerStatus(running=True, training_report=report(10)), 1: WorkerStatus(False, DIED)})
    assert consolidated.steps == [10]
    return SimpleNamespace(store=store, joiners=joiners, keep=keep, group=group, consolidated=consolidated)


def test_once_no_ray_train_worker_is_left_the_joiner_that_is_rank_0_reports_for_the_group(group_of_two):
    g = group_of_two
    both_dead = {0: WorkerStatus(running=False, error=DIED), 1: WorkerStatus(running=False, error=DIED)}
    # w0's node lost too: the joiner is the next generation's rank 0. Its reports of steps Ray
    # has consolidated (w0 reported step 10) are not handed over again.
    publish(g.store, 4, "w1.1")
    g.joiners.reports["w1.1"] = [report(10).metrics, report(12).metrics]
    status = poll(g.group, g.keep, dict(both_dead))
    assert g.keep.masked == {0, 1} and not status.errors
    # A joiner waits for rank 0's slot; rank 1's, which Ray's poll still shows failed, is in already.
    assert g.joiners.started == [1, 0]
    assert status.worker_statuses[0].running, "the run goes on: Ray must not see every worker finished"
    assert not TrainController._is_training_succeeded(status)
    assert g.group._callbacks[0]._get_required_ranks() == [0]
    poll(g.group, g.keep, dict(both_dead))
    assert g.consolidated.steps == [10, 12]
    # The run's end: the joiner's last report, then its run returns.
    g.joiners.reports["w1.1"] = [report(20).metrics]
    g.joiners.ended_runs = {1: Ended("w1.1", None)}
    status = poll(g.group, g.keep, dict(both_dead))
    assert status.worker_statuses[0].running and not TrainController._is_training_succeeded(status)
    status = poll(g.group, g.keep, dict(both_dead))
    assert g.consolidated.steps == [10, 12, 20]
    assert TrainController._is_training_succeeded(status)


def test_a_reporting_joiner_lost_with_no_member_left_restarts_the_group(group_of_two):
    g = group_of_two
    both_dead = {0: WorkerStatus(running=False, error=DIED), 1: WorkerStatus(running=False, error=DIED)}
    publish(g.store, 4, "w1.1")
    poll(g.group, g.keep, dict(both_dead))
    g.joiners.ended_runs = {1: Ended("w1.1", RayActorError())}
    status = poll(g.group, g.keep, dict(both_dead))
    assert list(status.errors) == [0] and "no member took its place" in str(status.errors[0])
    assert not TrainController._is_training_succeeded(status)
