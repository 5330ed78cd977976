"""A bounded, ordered buffer between whoever records a run (the Ray Train controller, the
driver) and the tracking server, drained by one background thread, so that a slow or
stopped server never holds up the caller.

Records are JSON-able dicts, sent one at a time and in order by `send`; a record is taken
off the buffer only once it was sent, so a failure retries the same record with backoff
and nothing behind it overtakes it. When more than `capacity` records wait (a long
outage), new ones are appended to a spill file in `folder` instead of memory, and read
back in order once memory has drained. `close` waits a bounded time for the rest and
writes what is still unsent to one file in `folder`; a buffer later opened on the same
folder sends those files first. A record can then be sent twice (its send was in flight
when `close` gave up on it): the tracking store takes a repeated record as a no-op.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from wildtrain import storage
from wildtrain.events import TrackingOutage


@dataclass(frozen=True)
class Backoff:
    """Delay before retry `attempt` (1, 2, ...) of a failed send: doubling, capped."""

    first_s: float = 0.5
    max_s: float = 10.0

    def delay(self, attempt: int) -> float:
        return min(self.max_s, self.first_s * 2 ** (attempt - 1))


@dataclass(frozen=True)
class Outage:
    """The tracking server did not take records from `start` (the first failed send began)
    to `end` (the next one that succeeded, or the buffer closed: `resolved` false)."""

    start: float
    end: float
    error: str  # the last failure
    resolved: bool

    def event(self) -> TrackingOutage:
        return TrackingOutage(self.end, self.start, self.end, self.end - self.start, self.error, self.resolved)


@dataclass
class _SpillFile:
    path: Path
    offset: int = 0  # bytes already sent


class TrackingBuffer:
    """Ordered records from any thread to `send` on a background thread; `put` never
    waits on `send`."""

    def __init__(
        self,
        send: Callable[[dict], None],
        folder: Path,
        *,
        capacity: int = 10_000,
        backoff: Backoff = Backoff(),
        is_transient: Callable[[BaseException], bool] = lambda e: True,
        on_outage: Optional[Callable[[Outage], None]] = None,
        name: str = "tracking",
    ) -> None:
        self._send = send
        self.folder = Path(folder)
        self.capacity = capacity
        self._backoff = backoff
        self._is_transient = is_transient
        self._on_outage = on_outage
        self._memory: collections.deque[dict] = collections.deque()
        # Leftovers of earlier buffers on this folder first. A record goes to memory only
        # while no spill file waits, so memory always holds the oldest records: it drains
        # first, then the spill files in order.
        leftovers = sorted([*self.folder.glob("*-spill.jsonl"), *self.folder.glob("*-unsent.jsonl")])
        self._spilled = [_SpillFile(path) for path in leftovers]
        self._own_spill: Optional[Path] = None
        self._cond = threading.Condition()
        self._deadline: Optional[float] = None  # set by close: monotonic time to give up at
        self._stopped = False  # the drain thread must not send any more
        self._closed = False  # nothing more is taken
        self._outage_start: Optional[float] = None
        self._last_error = ""
        self._thread = threading.Thread(target=self._drain, name=f"{name}-drain", daemon=True)
        self._thread.start()

    def put(self, record: dict) -> None:
        line = json.dumps(record)  # a record that cannot be written fails its caller, here
        with self._cond:
            if self._closed:
                raise RuntimeError("the tracking buffer is closed")
            if self._spilled or len(self._memory) >= self.capacity:
                self._spill(line)
            else:
                self._memory.append(record)
            self._cond.notify()

    def close(self, timeout_s: float) -> Optional[Path]:
        """Send what is left within `timeout_s`; the file holding whatever could not be
        sent (None: everything was)."""
        with self._cond:
            self._deadline = time.monotonic() + timeout_s
            self._cond.notify()
        self._thread.join(timeout_s)
        with self._cond:
            self._stopped = True  # a send still in flight is given up on
            down_since = self._outage_start
        if down_since is not None and self._on_outage is not None:
            # Its records go with the unsent ones.
            self._on_outage(Outage(down_since, time.time(), self._last_error, resolved=False))
        with self._cond:
            self._closed = True
            return self._write_unsent()

    # -- the drain thread ------------------------------------------------------------

    def _drain(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._stopped:
                        return
                    record = self._next()
                    if record is not None:
                        break
                    if self._deadline is not None:
                        return  # closing, and everything was sent
                    self._cond.wait()
            if not self._deliver(record):
                return
            with self._cond:
                if self._stopped:
                    return
                self._advance()

    def _deliver(self, record: dict) -> bool:
        """Send `record`, retrying transient failures with backoff until it is sent (True)
        or the buffer must stop (False). A record the server refuses for good is set aside
        in a file, never dropped."""
        attempt = 0
        while True:
            started = time.time()
            try:
                self._send(record)
            except Exception as e:  # noqa: BLE001 - any failure of the server or the network
                if not self._is_transient(e):
                    self._reject(record, e)
                    return True
                attempt += 1
                with self._cond:
                    if self._outage_start is None:
                        self._outage_start = started
                    self._last_error = f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"
                    # New records wake this wait too: the backoff runs to its end regardless.
                    retry_at = time.monotonic() + self._backoff.delay(attempt)
                    while not self._stopped:
                        left = min(retry_at, self._deadline or retry_at) - time.monotonic()
                        if left <= 0:
                            break
                        self._cond.wait(left)
                    if self._stopped or (self._deadline is not None and time.monotonic() >= self._deadline):
                        return False
                continue
            if attempt:
                self._recovered()
            return True

    def _recovered(self) -> None:
        with self._cond:
            outage = Outage(self._outage_start, time.time(), self._last_error, resolved=True)
            self._outage_start = None
        if self._on_outage is not None:
            self._on_outage(outage)

    def _reject(self, record: dict, error: BaseException) -> None:
        path = self.folder / "rejected.jsonl"  # kept apart: never sent again by itself
        self.folder.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps({"record": record, "error": f"{type(error).__name__}: {error}"}) + "\n")
        print(f"warning: the tracking server refused a record for good ({error}); kept in {path}", flush=True)

    # -- the queue, under self._cond ----------------------------------------------------

    def _next(self) -> Optional[dict]:
        """The oldest record not yet sent, left in place."""
        if self._memory:
            return self._memory[0]
        while self._spilled:
            head = self._spilled[0]
            with head.path.open("rb") as f:
                f.seek(head.offset)
                line = f.readline()
            if line.endswith(b"\n"):
                return json.loads(line)
            self._spilled.pop(0)  # read to its end: every record in it was sent
            head.path.unlink(missing_ok=True)
            if head.path == self._own_spill:
                self._own_spill = None
        return None

    def _advance(self) -> None:
        if self._memory:
            self._memory.popleft()
            return
        head = self._spilled[0]
        with head.path.open("rb") as f:
            f.seek(head.offset)
            head.offset += len(f.readline())

    def _spill(self, line: str) -> None:
        if self._own_spill is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._own_spill = self._file_name("spill")
            self._spilled.append(_SpillFile(self._own_spill))
        with self._own_spill.open("a") as f:
            f.write(line + "\n")

    def _write_unsent(self) -> Optional[Path]:
        """Memory, then the spill files from their offsets, into one file; the spill files
        are removed. None when nothing is left."""
        lines = [json.dumps(record) + "\n" for record in self._memory]
        for spilled in self._spilled:
            with spilled.path.open("rb") as f:
                f.seek(spilled.offset)
                lines += [line.decode() for line in f if line.endswith(b"\n")]
        self._memory.clear()
        if not lines:
            for spilled in self._spilled:
                spilled.path.unlink(missing_ok=True)
            self._spilled = []
            return None
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self._file_name("unsent")
        storage.write_text(str(path), "".join(lines))
        for spilled in self._spilled:
            spilled.path.unlink(missing_ok=True)
        self._spilled = []
        return path

    def _file_name(self, kind: str) -> Path:
        # Names sort by creation time: a later buffer sends older leftovers first.
        return self.folder / f"{time.time():017.6f}-{os.getpid()}-{kind}.jsonl"
