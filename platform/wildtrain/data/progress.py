"""prepare's progress: one line of bytes and documents read of the total, tokens/s, ETA and
shards written, fed by the driver for finished partitions and by the running partitions'
tasks (`Reporter` → `ReadSoFar`, an actor of the driver's) for the rest."""

from __future__ import annotations

import sys
import time

import numpy as np

from wildtrain.data.parts import PartResult


class Progress:
    """One line of progress: bytes and documents read of the total, tokens/s, ETA, shards
    written; rewritten in place on a terminal, else printed every `every` seconds. Finished
    partitions count exactly (`part_done`); running ones as far as they have reported
    (`running`)."""

    def __init__(self, total_bytes: int, parts: int, every: float, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every = 1.0 if self.tty else every
        self.total_bytes, self.parts, self.parts_done = total_bytes, parts, 0
        # bytes, documents, tokens, shards written, bytes tokenized by this run (the rate's base)
        self.finished = np.zeros(5, np.int64)
        self.running = np.zeros(5, np.int64)
        self.started = self.shown = time.monotonic()

    def advance(self, read: int, documents: int, tokens: int, shards: int) -> None:
        """What the partition being read here has read since the last call."""
        self.running += (read, documents, tokens, shards, read)
        self.show()

    def part_done(self, result: PartResult, part_bytes: int) -> None:
        self.parts_done += 1
        self.running = np.zeros(5, np.int64)
        tokens, tokenized = (result.part.tokens, part_bytes) if result.read else (0, 0)
        self.finished += (part_bytes, result.part.documents, tokens, len(result.written), tokenized)

    def show(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.shown < self.every:
            return
        self.shown = now
        done, documents, tokens, shards, tokenized = (int(n) for n in self.finished + self.running)
        line = progress_line(
            done,
            self.total_bytes,
            documents,
            tokens,
            tokenized,
            shards,
            self.parts_done,
            self.parts,
            now - self.started,
        )
        self.stream.write(f"\r\033[K{line}" if self.tty else f"{line}\n")
        self.stream.flush()

    def finish(self) -> None:
        self.show(force=True)
        if self.tty:
            self.stream.write("\n")


class ReadSoFar:
    """What each running partition's task has read so far (a Ray actor of the driver's)."""

    def __init__(self) -> None:
        self.parts: dict[int, np.ndarray] = {}

    def add(self, index: int, counts: tuple[int, int, int, int]) -> None:
        self.parts[index] = self.parts.get(index, 0) + np.array([*counts, counts[0]], np.int64)

    def of(self, indices: list[int]) -> list[int]:
        return sum((self.parts.get(i, np.zeros(5, np.int64)) for i in indices), np.zeros(5, np.int64)).tolist()


class Reporter:
    """A task's `on_batch`: adds up what it read and tells `ReadSoFar` at most every second."""

    def __init__(self, actor, index: int) -> None:
        self.actor, self.index = actor, index
        self.counts, self.sent = (0, 0, 0, 0), None

    def __call__(self, read: int, documents: int, tokens: int, shards: int) -> None:
        self.counts = tuple(a + b for a, b in zip(self.counts, (read, documents, tokens, shards)))
        now = time.monotonic()
        if self.sent is None or now - self.sent >= 1.0:
            self.actor.add.remote(self.index, self.counts)
            self.counts, self.sent = (0, 0, 0, 0), now


def progress_line(
    done: int,
    total: int,
    documents: int,
    tokens: int,
    tokenized: int,
    shards: int,
    parts_done: int,
    parts: int,
    elapsed: float,
) -> str:
    """The progress line: the ETA extrapolates the bytes this run tokenized per second over
    the bytes left. Pure."""
    rate = tokenized / elapsed if elapsed > 0 else 0
    eta = f"{(total - done) / rate:.0f} s" if rate > 0 else "?"
    share = 100 * done / total if total else 100
    return (
        f"prepare: {_size(done)} of {_size(total)} ({share:.0f}%), {documents:,} documents, "
        f"{tokens / elapsed if elapsed > 0 else 0:,.0f} tokens/s, ETA {eta}, {shards} shards written, "
        f"{parts_done}/{parts} partitions"
    )


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError
