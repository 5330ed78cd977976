"""A pyarrow filesystem that delegates to a real one and injects faults into writes.

    faults = Faults(match=lambda path: path.endswith(".pt"))
    store = Store(faulty_filesystem(LocalFileSystem(), faults), str(tmp_path), "faulty")
    faults.fail_next = 1          # the next matching write raises OSError(EIO)
    faults.corrupt = "truncate"   # matching writes silently store half their bytes
    faults.gate = threading.Event()  # matching writes wait until the test sets it
    faults.hidden = lambda path: ...  # listings leave these out (a listing that lags)
    faults.lost_reads = 1         # the next read of a `read_match` path is a 404, once

Tests wait on events (`faults.write_blocked`), never on sleeps.
"""

from __future__ import annotations

import errno
import os
import threading
from dataclasses import dataclass, field
from typing import Callable, Literal, Optional

import pyarrow as pa
import pyarrow.fs as pafs


@dataclass
class Faults:
    match: Callable[[str], bool] = lambda path: True
    fail_next: int = 0  # the next N matching writes raise `error`
    error: OSError = field(default_factory=lambda: OSError(errno.EIO, "injected I/O error"))
    corrupt: Literal["", "truncate", "flip"] = ""  # reported as written in full either way
    gate: Optional[threading.Event] = None  # matching writes wait until it is set
    write_blocked: threading.Event = field(default_factory=threading.Event)  # set when a write waits at the gate
    writes: int = 0  # matching write calls so far
    # Reads and listings of an eventually consistent store: listings that leave out paths
    # written lately, reads that answer 404 for an object that exists.
    hidden: Callable[[str], bool] = lambda path: False
    read_match: Callable[[str], bool] = lambda path: False
    lost_reads: int = 0  # the next N reads of `read_match` paths raise FileNotFoundError
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def before_write(self, path: str, data: bytes) -> bytes:
        """The bytes to really write for a matching write of `data`; may block or raise."""
        if self.gate is not None and not self.gate.is_set():
            self.write_blocked.set()
            self.gate.wait()
        with self._lock:
            self.writes += 1
            if self.fail_next > 0:
                self.fail_next -= 1
                raise self.error
        if self.corrupt == "truncate":
            return data[: len(data) // 2]
        if self.corrupt == "flip" and data:
            return bytes([data[0] ^ 0xFF]) + data[1:]
        return data


class _FaultyOutput:
    """A writable file object for `pa.PythonFile` that passes matching writes through `faults`."""

    def __init__(self, inner: pa.NativeFile, path: str, faults: Faults) -> None:
        self._inner = inner
        self._path = path
        self._faults = faults
        self._position = 0

    def write(self, data) -> int:
        data = bytes(data)
        self._inner.write(self._faults.before_write(self._path, data))
        self._position += len(data)
        return len(data)

    def tell(self) -> int:
        return self._position

    def flush(self) -> None:
        self._inner.flush()

    def close(self) -> None:
        self._inner.close()

    @property
    def closed(self) -> bool:
        return self._inner.closed

    def writable(self) -> bool:
        return True


class FaultyHandler(pafs.FileSystemHandler):
    def __init__(self, inner: pafs.FileSystem, faults: Faults) -> None:
        self.inner = inner
        self.faults = faults

    def __eq__(self, other) -> bool:
        return isinstance(other, FaultyHandler) and other.inner.equals(self.inner) and other.faults is self.faults

    def __ne__(self, other) -> bool:
        return not self == other

    def get_type_name(self) -> str:
        return f"faulty+{self.inner.type_name}"

    def normalize_path(self, path):
        return self.inner.normalize_path(path)

    def get_file_info(self, paths):
        return self.inner.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return [info for info in self.inner.get_file_info(selector) if not self.faults.hidden(info.path)]

    def create_dir(self, path, recursive):
        self.inner.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self.inner.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self.inner.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        self.inner.delete_dir_contents("/", accept_root_dir=True)

    def delete_file(self, path):
        self.inner.delete_file(path)

    def move(self, src, dest):
        self.inner.move(src, dest)

    def copy_file(self, src, dest):
        self.inner.copy_file(src, dest)

    def open_input_stream(self, path):
        if self.faults.read_match(path):
            with self.faults._lock:
                lost = self.faults.lost_reads > 0
                self.faults.lost_reads -= lost
            if lost:
                raise FileNotFoundError(errno.ENOENT, "injected 404", path)
        return self.inner.open_input_stream(path)

    def open_input_file(self, path):
        return self.inner.open_input_file(path)

    def open_output_stream(self, path, metadata):
        inner = self.inner.open_output_stream(path, metadata=metadata)
        if not self.faults.match(path):
            return inner
        return pa.PythonFile(_FaultyOutput(inner, path, self.faults), mode="w")

    def open_append_stream(self, path, metadata):
        return self.inner.open_append_stream(path, metadata=metadata)


def faulty_filesystem(inner: pafs.FileSystem, faults: Faults) -> pafs.FileSystem:
    return pafs.PyFileSystem(FaultyHandler(inner, faults))


class HangingHandler(FaultyHandler):
    """Delegates to `inner`, except that opening a `.pt` file for writing never returns while
    the file `marker` exists: a storage call that hangs. It pickles (without the faults of
    `FaultyHandler`, which are this process's), so a save process can use it."""

    def __init__(self, inner: pafs.FileSystem, marker: str) -> None:
        super().__init__(inner, Faults())
        self.marker = marker

    def __reduce__(self):
        return HangingHandler, (self.inner, self.marker)

    def open_output_stream(self, path, metadata):
        if path.endswith(".pt") and os.path.exists(self.marker):
            threading.Event().wait()
        return super().open_output_stream(path, metadata)
