"""A run's liveness lease: `<run.storage>/<run.name>/lease.json` says which driver trains the
run now, so that `wildtrain move`, a resubmission or a second `wildtrain train` of the same
run refuses instead of making two clusters write one lineage and one MLflow run.

The driver refuses a run held by another before anything else, takes the lease once its
checks that write nothing have passed (`Keeper.acquire`, before the run record), renews it from a thread every
`run.lease_renew_s` seconds, each renewal valid for `run.lease_expire_s`, and marks it
released when it ends, normally or by an error. A driver that dies (kill -9, its node lost)
stops renewing: its lease expires on its own and the next driver takes the run over.

Race window, honestly: object stores offer no atomic compare-and-swap in general, so taking
the lease is read, check, write, then a re-read after `SETTLE_S` to see whose write won. Two
drivers still both proceed when one's read-to-write takes longer than `SETTLE_S` and the
other writes in between; and times are the holder's wall clock, compared with the reader's,
so clocks that differ by more than `lease_expire_s - lease_renew_s` can make a live lease look
expired. The lease is a guard against a user's mistake, not a lock against a race.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, replace
from typing import Optional

from wildtrain import storage
from wildtrain.config import RunSectionConfig, StorageConfig

# Set by `wildtrain submit` in the job's environment: the job a lease belongs to, which
# `wildtrain move` stops and may then release the lease of.
JOB_VARIABLE = "WILDTRAIN_JOB"
# How long a driver waits after writing the lease before reading back whose write won.
SETTLE_S = 1.0


class LeaseError(RuntimeError):
    """A run that another driver trains now, or a lease file that cannot be read; one line."""


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    cluster: str
    token: str  # tells two holders on one host apart, and a restarted pid from the old one
    job: Optional[str] = None  # the Ray job submission id, where `wildtrain submit` started it

    @classmethod
    def here(cls, cluster: str) -> "Holder":
        return cls(socket.gethostname(), os.getpid(), cluster, uuid.uuid4().hex, os.environ.get(JOB_VARIABLE) or None)

    def describe(self) -> str:
        job = f", job {self.job}" if self.job else ""
        return f"pid {self.pid} on {self.host} (cluster {self.cluster}{job})"


@dataclass(frozen=True)
class Lease:
    holder: Holder
    renewed_at: float
    expires_at: float
    released_at: Optional[float] = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Lease":
        data = json.loads(text)
        return cls(**{**data, "holder": Holder(**data["holder"])})


@dataclass(frozen=True)
class Verdict:
    free: bool  # may the asking driver (or move, or submit) go on
    why: str  # one line: what the lease says, and for a refusal what to do


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(t))


def decide(run: str, lease: Optional[Lease], now: float, token: Optional[str] = None) -> Verdict:
    """Whether `run` is free for the caller (holding `token`, if it holds any) at `now`."""
    if lease is None:
        return Verdict(True, f"run {run!r} has no lease")
    if lease.released_at is not None:
        return Verdict(True, f"run {run!r}: {lease.holder.describe()} released it at {_clock(lease.released_at)}")
    if token is not None and lease.holder.token == token:
        return Verdict(True, f"run {run!r} is held by this driver")
    if lease.expires_at <= now:
        return Verdict(
            True,
            f"run {run!r}: the lease of {lease.holder.describe()} expired at "
            f"{_clock(lease.expires_at)}; that driver stopped renewing it",
        )
    return Verdict(
        False,
        f"run {run!r} is live: {lease.holder.describe()} holds its lease until "
        f"{_clock(lease.expires_at)} (renewed {now - lease.renewed_at:.0f} s ago); stop that "
        "driver first, or if it is dead wait for the lease to expire",
    )


def read(uri: str, config: StorageConfig) -> Optional[Lease]:
    text = storage.read_text(uri, config)
    if text is None:
        return None
    try:
        return Lease.from_json(text)
    except (ValueError, TypeError, KeyError) as e:
        raise LeaseError(f"{uri}: not a lease ({e}); delete it if no driver trains the run") from None


def check(run: str, uri: str, config: StorageConfig) -> Verdict:
    """`decide` on the lease at `uri` now, for a caller that holds none."""
    return decide(run, read(uri, config), time.time())


def release_for(uri: str, config: StorageConfig, holder: Holder) -> bool:
    """Mark released the lease of `holder`, a driver known to have ended (its job stopped);
    False where the lease is no longer its."""
    lease = read(uri, config)
    if lease is None or lease.holder.token != holder.token or lease.released_at is not None:
        return False
    storage.write_text(uri, replace(lease, released_at=time.time()).to_json(), config)
    return True


class Keeper:
    """The lease of one driver: `acquire` before the run starts, `release` when it ends."""

    def __init__(self, run: RunSectionConfig, cluster: str, config: StorageConfig, uri: str):
        self.run, self.uri, self.config = run.name, uri, config
        self.renew_s, self.expire_s = run.lease_renew_s, run.lease_expire_s
        self.holder = Holder.here(cluster)
        self._stop = threading.Event()
        self._written = False
        self._thread: Optional[threading.Thread] = None

    def _write(self) -> None:
        now = time.time()
        storage.write_text(self.uri, Lease(self.holder, now, now + self.expire_s).to_json(), self.config)

    def refuse_if_held(self) -> None:
        """Raise `LeaseError` while another driver holds the run; writes nothing."""
        verdict = check(self.run, self.uri, self.config)
        if not verdict.free:
            raise LeaseError(verdict.why)

    def acquire(self) -> None:
        """Take the lease (checked again: another driver may have taken it since) and keep
        renewing it until `release`."""
        self.refuse_if_held()
        self._written = True  # from here on, an interrupted acquire releases what it wrote
        self._write()
        time.sleep(SETTLE_S)
        won = read(self.uri, self.config)
        if won is None or won.holder.token != self.holder.token:
            raise LeaseError(
                decide(self.run, won, time.time(), self.holder.token).why
                if won
                else f"run {self.run!r}: its lease {self.uri} vanished as it was taken"
            )
        self._thread = threading.Thread(target=self._renew, name="wildtrain-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.renew_s):
            try:
                current = read(self.uri, self.config)
                if current is not None and current.holder.token != self.holder.token:
                    # Taken over after renewals failed for longer than the expiry: writing now
                    # would take it back from a driver that already trains the run.
                    print(
                        f"warning: run {self.run!r}: lost its lease to {current.holder.describe()}; "
                        "two drivers may now write this run",
                        flush=True,
                    )
                    return
                if not self._stop.is_set():  # released meanwhile: a renewal now would undo it
                    self._write()
            except (OSError, LeaseError) as e:  # a storage outage: the next renewal tries again
                print(f"warning: run {self.run!r}: could not renew its lease: {e}", flush=True)

    def release(self) -> None:
        """Stop renewing and mark the lease released, if this driver took it."""
        if not self._written:
            return
        self._stop.set()
        if self._thread is not None:
            # A renewal stuck on a store that does not answer must not hold the driver's end.
            self._thread.join(timeout=self.expire_s)
            if self._thread.is_alive():
                print(
                    f"warning: run {self.run!r}: its lease was not released (its store does not answer); "
                    f"it expires within {self.expire_s:g} s",
                    flush=True,
                )
                return
        try:
            release_for(self.uri, self.config, self.holder)
        except (OSError, LeaseError) as e:  # never hides how the run ended; it expires anyway
            print(
                f"warning: run {self.run!r}: could not release its lease (it expires within {self.expire_s:g} s): {e}",
                flush=True,
            )

    def __enter__(self) -> "Keeper":
        """Refused at once while another driver holds the run; `acquire` comes later, once
        the checks that write nothing have passed."""
        self.refuse_if_held()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
