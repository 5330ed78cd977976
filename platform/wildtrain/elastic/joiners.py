"""The joiners of an in-process group (issue 24): workers the controller starts on a lost
member's placement slot, or as spares on spare capacity, that join the group's survivors
in-process (`elastic.survivors.KeepSurvivors` decides when; `train.entry.joiner_main` is
their side)."""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from wildtrain import ray_compat
from wildtrain.elastic import rendezvous
from wildtrain.worker_inputs import LoopInputs

# A joiner's function (`train.entry.joiner_main`), handed down by the driver: elastic sits below train.
JoinerMain = Callable[[LoopInputs, str, str, int], None]


@ray.remote(max_restarts=0, max_concurrency=2)
class Joiner:
    """A worker of the group that Ray Train did not start: it trains as a member of the
    group's in-process generations on a lost member's placement slot (`join_in_process`),
    and the controller takes its reports while it trains (`take_reports`: a second thread)."""

    def run(self, joiner_main: JoinerMain, inputs: LoopInputs, token: str, name: str, group_size: int) -> None:
        joiner_main(inputs, token, name, group_size)

    def take_reports(self) -> list[dict]:
        from wildtrain.elastic.relay import RELAY  # this process's: Ray pickles the class, not its module's objects

        return RELAY.take()


class _Running(NamedTuple):
    actor: object
    run: ray.ObjectRef
    name: str  # its member name


class Ended(NamedTuple):
    name: str  # the joiner's member name
    error: Optional[BaseException]  # None where its run returned (the run's end)


class Joiners:
    """The joiners the controller started: one per lost member's placement slot, and the spares.
    A slot's joiner asks for one worker's resources on that slot, so Ray starts it once it has
    placed that bundle again (a node came back or was added): until then it waits, and costs
    nothing. A spare asks for them anywhere (`start_spare`)."""

    def __init__(self, inputs: LoopInputs, env_vars: dict[str, str], joiner_main: JoinerMain) -> None:
        self.inputs, self.env_vars, self.joiner_main = inputs, env_vars, joiner_main
        self.started = 0
        self.running: dict[int, _Running] = {}  # by the Ray rank of the lost member
        self.spares: dict[str, _Running] = {}  # by member name

    def start(self, worker_group, rank: int, token: str, group_size: int) -> None:
        group, bundle = ray_compat.worker_slot(worker_group, rank)
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle)
        self.running[rank] = self._start(
            f"{rendezvous.member_name(rank)}.{self.started + 1}", token, group_size, strategy
        )

    def start_spare(self, token: str, group_size: int) -> str:
        """Start a spare: a joiner on no slot of the group's, placed by Ray where a worker's
        resources are free. Once ready it waits at the rendezvous for a member's place."""
        name = f"spare.{self.started + 1}"
        self.spares[name] = self._start(name, token, group_size, "DEFAULT")
        return name

    def _start(self, name: str, token: str, group_size: int, strategy) -> _Running:
        resources = dict(self.inputs.worker_resources)
        self.started += 1
        actor = Joiner.options(
            num_cpus=resources.pop("CPU", 0),
            num_gpus=resources.pop("GPU", 0),
            resources=resources,
            scheduling_strategy=strategy,
            runtime_env={"env_vars": self.env_vars},
        ).remote()
        return _Running(actor, actor.run.remote(self.joiner_main, self.inputs, token, name, group_size), name)

    def ended(self) -> dict[int, Ended]:
        """The slots' joiners whose run ended since the last look, by the lost member's rank."""
        return _take_ended(self.running)

    def spares_ended(self) -> list[Ended]:
        """The spares whose run ended since the last look (joined or not)."""
        return list(_take_ended(self.spares).values())

    def _every(self) -> list[_Running]:
        """The slots' joiners and the spares, whose runs have not been seen to end."""
        return [*self.running.values(), *self.spares.values()]

    def runs(self, name: str) -> bool:
        """Whether the member `name` is a joiner (or spare) whose run has not been seen to end."""
        return any(r.name == name for r in self._every())

    def take_reports(self, name: str) -> list[dict]:
        """The reports the joiner `name` made since the last take (`elastic.relay`); none where
        it is not running, or was lost with its node (`ended` says so)."""
        actor = next((r.actor for r in self._every() if r.name == name), None)
        try:
            return ray.get(actor.take_reports.remote(), timeout=10) if actor is not None else []
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            return []

    def outside(self, members: tuple[str, ...]) -> int:
        """How many joiners, slots' and spares, run (or wait to be placed) outside `members`."""
        return sum(1 for running in self._every() if running.name not in members)

    def stop(self) -> None:
        for running in self._every():
            ray.kill(running.actor)
        self.running, self.spares = {}, {}


def _take_ended(running: dict) -> dict:
    """The entries of `running` whose run ended, taken out of it, with how it ended."""
    ended = {}
    for key, (actor, run, name) in list(running.items()):
        done, _ = ray.wait([run], timeout=0)
        if not done:
            continue
        del running[key]
        try:
            ray.get(run)
            ended[key] = Ended(name, None)
        except Exception as e:  # noqa: BLE001 - the controller decides what it means
            ended[key] = Ended(name, e)
        ray.kill(actor)
    return ended
