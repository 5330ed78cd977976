"""The background half of a saver's saves (`save_work.run_save`) in a process of its own, as in
torch.distributed.checkpoint's process-based async checkpointing: why, and what it costs, is
in `async_save`'s docstring.

One child per saver, spawned (not forked: the trainer has CUDA, NCCL and Ray threads) with the
saver and reused for every save; one that is lost is replaced at once. A saver closed idle
can hand its child to the next (an in-process re-form's, which saves at another rank and
world size): each job carries the saver's settings, so a child serves any saver. A job's
host copies are in shared memory (`HostBuffers(share=True)`), so sending a job sends their
handles, not their bytes, and the child reads the very buffers the capture filled. The stores travel to the
child pickled over the pipe, S3 keys included (pyarrow pickles them): never on a command
line, in the environment of another process, or in a message.

The child runs at the niceness the saver is given (its default: training's own priority), and exits
when the saver stops it, when the pipe to the parent breaks, or when the parent is gone
(an orphan would hold the buffers' shared memory). Unlike a thread, it can be stopped: when
a save overruns its deadline by more than a grace period (a storage call that never
returns), the parent kills it, and the next save starts a new one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import types
from typing import Optional

import torch.multiprocessing

from wildtrain.checkpoint.save_policy import Failure
from wildtrain.checkpoint.save_work import SaveJob, SaveResult, SaveSettings, describe, run_save

# The child's own deadline checks, between chunks, come first and say more; past this the
# call it is in is taken to hang.
KILL_GRACE_S = 5.0
# Until the child names its first deadline: it imports torch and pyarrow first.
STARTUP_S = 120.0


class SaveProcessLost(Exception):
    """The child died, or was killed for overrunning its deadline, in the middle of a save."""

    def __init__(self, message: str, failure: Failure) -> None:
        super().__init__(message)
        self.failure = failure


class SaveProcess:
    """The parent's end: hands one job at a time to the child and relays what it says."""

    def __init__(self, nice: int = 0) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        self._conn, child_end = ctx.Pipe()
        lifeline, self._lifeline = ctx.Pipe(duplex=False)  # the child's end reads EOF once the parent is gone
        self.interrupted = False
        self.process = ctx.Process(
            target=_serve, args=(child_end, lifeline, os.getpid(), nice), name="wildtrain-checkpoint", daemon=True
        )
        with _main_script_hidden():
            self.process.start()
        # Only the child holds its ends now, so the parent reads EOF as soon as the child dies.
        child_end.close()
        lifeline.close()

    def alive(self) -> bool:
        return self.process.is_alive() and not self.interrupted

    def run(self, settings: SaveSettings, job: SaveJob, link, timeout_s: float) -> SaveResult:
        """The job's result; `SaveProcessLost` (with the child gone) if the child died or
        stayed in one call past its deadline and `min(KILL_GRACE_S, timeout_s)`."""
        try:
            return self._relay(settings, job, link, timeout_s)
        except SaveProcessLost:
            raise
        except Exception as e:  # the pipe would be out of step with the child's work
            self.kill()
            raise SaveProcessLost(f"relaying the save process's messages: {describe(e)}", "error") from e

    def _relay(self, settings: SaveSettings, job: SaveJob, link, timeout_s: float) -> SaveResult:
        self._conn.send((settings, job))
        bound = time.monotonic() + STARTUP_S + timeout_s
        doing = "starting the save process"
        while True:
            if not self._conn.poll(max(0.0, bound - time.monotonic())):
                self.kill()
                raise SaveProcessLost(
                    f"{doing} did not return within timeout_s={timeout_s:g} s "
                    f"(and {min(KILL_GRACE_S, timeout_s):g} s more); the save process was stopped",
                    "timeout",
                )
            try:
                kind, value = self._conn.recv()
            except (EOFError, OSError):
                self.kill()
                raise SaveProcessLost(
                    f"the save process exited (code {self.process.exitcode}) while {doing}", "error"
                ) from None
            if kind == "doing":
                doing = value
                link.doing(value)
            elif kind == "deadline":
                bound = value + min(KILL_GRACE_S, timeout_s)
            elif kind == "ask":
                self._conn.send(link.report_collected(value))
            else:
                return value

    def stop(self, timeout_s: Optional[float]) -> None:
        """Let the child finish and exit; kill it if it has not within `timeout_s`."""
        try:
            self._conn.send(None)
        except OSError:
            pass  # gone already
        self.process.join(timeout_s)
        self.kill()

    def interrupt(self) -> None:
        """Kill the child from another thread: `run`, if it is waiting, sees it die."""
        self.interrupted = True  # it may still look alive for a moment
        if self.process.is_alive():
            self.process.kill()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self._conn.close()
        self._lifeline.close()


class _ToParent:
    """`save_work.Link` across the pipe."""

    def __init__(self, conn) -> None:
        self._conn = conn
        self._never = threading.Event()  # the parent stops a child by message or kill, not mid-wait

    def doing(self, what: str) -> None:
        self._conn.send(("doing", what))

    def deadline(self, at: float) -> None:
        # time.monotonic() is CLOCK_MONOTONIC, the same clock in every process of the machine.
        self._conn.send(("deadline", at))

    def report_collected(self, step: int) -> bool:
        self._conn.send(("ask", step))
        return self._conn.recv()

    def wait(self, seconds: float) -> bool:
        return self._never.wait(seconds)


@contextlib.contextmanager
def _main_script_hidden():
    """A spawned child runs its parent's main script first, as `__mp_main__`, where it names
    none by module: in a Ray worker that is Ray's `default_worker.py`, whose imports (Ray's)
    were most of the child's start (bench/startup.py), for nothing the child uses (`_serve`
    and the jobs import what they need). With a bare `__main__` while it starts,
    multiprocessing has no script to hand the child."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _serve(conn, lifeline, parent_pid: int, nice: int) -> None:
    # The first job unpickles DeepSpeed's state, and DeepSpeed's autotuner imports MLflow
    # whenever it is installed, a second of the child's start (docs/benchmarks.md) that the
    # child never uses: a `None` fails that import, as `engine.import_deepspeed` does for the trainer.
    sys.modules["mlflow"] = None
    os.nice(nice)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the process group is the parent's to handle
    torch.set_num_threads(1)  # torch.save and hashing need no intra-op threads; training needs the cores
    threading.Thread(target=_exit_with_parent, args=(lifeline, parent_pid), daemon=True).start()
    link = _ToParent(conn)
    while True:
        try:
            work = conn.recv()
        except EOFError:
            return
        if work is None:
            return
        settings, job = work
        result = run_save(settings, job, link)
        del job, work  # unmaps the host buffers until the next job sends them again
        conn.send(("done", result))


def _exit_with_parent(lifeline, parent_pid: int) -> None:
    # EOF on the lifeline: the parent's end closed, i.e. it died. A forked grandchild of the
    # parent could hold that end open, so a reparented child counts as well.
    while not lifeline.poll(5.0) and os.getppid() == parent_pid:
        pass
    os._exit(0)
