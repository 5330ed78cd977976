"""The hang watchdog's bounds: start-up until the first step, the hang timeout between steps,
and a declared wait's own bound. Tiny timeouts, and an exit function that records instead of
ending the test process."""

import threading
import time

import pytest

from wildtrain.config import StorageConfig
from wildtrain.layout import rank_of_hang_dump
from wildtrain.train.watchdog import HANG_EXIT_CODE, HangWatchdog


class Exits:
    def __init__(self) -> None:
        self.codes: list[int] = []
        self.fired = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.fired.set()


@pytest.fixture
def exits():
    return Exits()


def _watchdog(tmp_path, exits, hang_s: float, startup_s: float) -> HangWatchdog:
    return HangWatchdog(hang_s, startup_s, str(tmp_path / "hangs"), 1, StorageConfig(), exit=exits)


def _dump(tmp_path) -> str:
    (path,) = (tmp_path / "hangs").iterdir()
    assert rank_of_hang_dump(path.name) == 1
    return path.read_text()


def test_the_startup_bound_applies_before_the_first_step_and_the_hang_timeout_after(tmp_path, exits):
    watchdog = _watchdog(tmp_path, exits, hang_s=0.2, startup_s=1.0)
    time.sleep(0.5)  # a restore longer than the hang timeout, within the start-up bound
    assert not exits.fired.is_set()
    watchdog.progress(1)
    assert exits.fired.wait(2.0), "no step for longer than the hang timeout after step 1"
    assert exits.codes == [HANG_EXIT_CODE]
    first_line = _dump(tmp_path).splitlines()[0]
    assert "no optimizer step for" in first_line and "after step 1" in first_line
    assert "monitor.hang_timeout_s=0.2" in first_line


def test_a_start_up_longer_than_its_bound_fires_naming_the_startup_key(tmp_path, exits):
    _watchdog(tmp_path, exits, hang_s=60, startup_s=0.2)
    assert exits.fired.wait(2.0)
    assert "since the worker started (monitor.startup_timeout_s=0.2)" in _dump(tmp_path).splitlines()[0]


def test_a_declared_wait_may_outlast_the_hang_timeout_but_not_its_own_bound(tmp_path, exits):
    watchdog = _watchdog(tmp_path, exits, hang_s=0.2, startup_s=60)
    watchdog.progress(40)
    with watchdog.waiting("the commit of step 40", up_to_s=0.6):
        time.sleep(0.6)  # 3x the hang timeout, within the wait's bound (0.6 s + 0.2 s)
        assert not exits.fired.is_set()
    # The wait's end counts as progress: the hang timeout starts over from it.
    time.sleep(0.1)
    assert not exits.fired.is_set()
    with watchdog.waiting("the commit of step 41", up_to_s=0.3):
        assert exits.fired.wait(2.0), "a wait stuck past its bound plus the hang timeout"
    assert "the commit of step 41 still not done after" in _dump(tmp_path).splitlines()[0]


def test_the_watchdog_ends_with_the_thread_that_created_it(tmp_path, exits):
    # The training function may raise before it reaches its `finally: watchdog.stop()`
    # (a failed restore); its watchdog must not later end the worker of a finished attempt.
    created = []
    thread = threading.Thread(target=lambda: created.append(_watchdog(tmp_path, exits, hang_s=0.2, startup_s=0.2)))
    thread.start()
    thread.join()
    time.sleep(0.6)
    assert not exits.fired.is_set()


def test_negative_timeouts_are_config_errors_naming_the_key():
    from wildtrain.config import ConfigError, load_config

    assert load_config([]).monitor.startup_timeout_s > load_config([]).monitor.hang_timeout_s
    with pytest.raises(ConfigError, match=r"^monitor\.startup_timeout_s: must be 0 \(off\) or positive"):
        load_config(["monitor.startup_timeout_s=-1"])
