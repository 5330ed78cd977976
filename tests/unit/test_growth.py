"""When a worker group below its largest size grows (`train.growth.GrowthCheck`), on one rank
without a process group: joiners are taken in at any log step, a restart only where no lost
member's slot is open, never at the run's last step nor between log steps."""

from __future__ import annotations

from wildtrain.train.growth import Growth, GrowthCheck
from wildtrain.train.schedule import At

STEP, LAST = At(10, first=False, last=False), At(100, first=False, last=True)


def check(monkeypatch, joiners: list[bool], awaiting: bool, below_max: bool = True, room: bool = False) -> GrowthCheck:
    """A check that looks for room at every log step; the cluster's room is `room`."""
    monkeypatch.setattr("wildtrain.train.growth.has_room_for_another_worker", lambda *args: room)
    monkeypatch.setattr("wildtrain.train.growth.excluded_nodes", lambda run: set())
    return GrowthCheck(
        below_max,
        0,
        {"CPU": 1},
        interval_s=0.0,
        run_name="run",
        data_cpus=0.0,
        joiners=lambda: joiners[0],
        awaiting_joiners=awaiting,
    )


def test_joiners_are_taken_in_at_a_log_step_but_not_between_them_nor_at_the_last(monkeypatch):
    waiting = [True]
    growth = check(monkeypatch, waiting, awaiting=True)
    assert growth.due(STEP, logs=False) is Growth.NONE
    assert growth.due(LAST, logs=True) is Growth.NONE
    assert growth.due(STEP, logs=True) is Growth.JOIN
    waiting[0] = False
    assert growth.due(STEP, logs=True) is Growth.NONE


def test_an_open_slot_keeps_a_restart_from_taking_the_room_ray_places_it_on(monkeypatch):
    assert check(monkeypatch, [False], awaiting=True, room=True).due(STEP, logs=True) is Growth.NONE
    assert check(monkeypatch, [False], awaiting=False, room=True).due(STEP, logs=True) is Growth.RESTART
    assert check(monkeypatch, [False], awaiting=False, room=False).due(STEP, logs=True) is Growth.NONE


def test_a_group_at_its_largest_size_looks_for_nothing(monkeypatch):
    assert check(monkeypatch, [True], awaiting=False, below_max=False, room=True).due(STEP, logs=True) is Growth.NONE
