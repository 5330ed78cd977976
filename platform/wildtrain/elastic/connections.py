"""The TCP connections a gloo process group opened, so that a rank can hang them up when the
group breaks, and free the peers that wait on it (issue 24: survivors re-form in-process).

A gloo wait ends at its timeout or when its connection closes. A peer blocked in a
collective with this rank, not with the dead one, is freed by nothing else: gloo's `abort()`
frees no wait in progress (not even this rank's own), and `destroy_process_group` closes the
connections only once nothing refers to the group any more, which DeepSpeed's engine does.
Without the hang-up, a survivor blocked on another survivor waits out the whole collective
timeout.

A Ray worker holds TCP connections of its own (to the GCS, to other workers), so "every socket
but the store's" will not do: `GroupConnections` records the sockets that appeared while the
groups were formed (gloo connects every pair of ranks when a group is made) and shuts
exactly those. A socket another thread of the process opened in that window would be shut
too; Ray's gRPC channels reconnect.
"""

from __future__ import annotations

import os
import socket
from typing import Optional


def socket_inodes() -> dict[int, int]:
    """{inode: fd} of this process's open sockets."""
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (the listing's own fd, among others)
        if target.startswith("socket:["):
            found[int(target[len("socket:[") : -1])] = int(fd)
    return found


class GroupConnections:
    """Record the sockets opened inside `with`: the process groups formed there."""

    def __init__(self) -> None:
        self.inodes: frozenset[int] = frozenset()
        self._before: Optional[set[int]] = None  # while inside `with`

    def __enter__(self) -> "GroupConnections":
        self._before = set(socket_inodes())
        return self

    def __exit__(self, *exc) -> None:
        self.inodes = frozenset(set(socket_inodes()) - self._before)
        self._before = None

    def hang_up(self) -> int:
        """Shut down (both ways) the recorded connections that are still open (inside `with`:
        those opened so far): every peer's wait on this rank fails now. How many were shut."""
        shut = 0
        for inode, fd in socket_inodes().items():
            if inode not in self.inodes and (self._before is None or inode in self._before):
                continue
            try:
                with socket.socket(fileno=os.dup(fd)) as sock:
                    if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                        continue
                    # Not gloo's listener: a listener shut down fails gloo's accept thread,
                    # which ends the process.
                    sock.getpeername()
                    sock.shutdown(socket.SHUT_RDWR)
                    shut += 1
            except OSError:
                pass  # closed meanwhile, or a listener (getpeername: not connected)
        return shut
