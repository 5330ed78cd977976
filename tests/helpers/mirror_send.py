"""One rank of tests/unit/test_peer_state.py's checks that a mirror's send waits for its copy
from the device (`peer_state._SendWhenCopied`), on gloo, with a stand-in for the copy's CUDA
event (this machine has no GPU): rank 0's buffer is filled 0.3 s after the send was asked
for, and rank 1 prints what it received.

With --re-formed, rank 0 mirrors through `Mirrors` in generation 1 and its copy lands only
once the group re-formed as generation 2 (a device stuck in a collective with a dead peer
finishes it late); rank 0 then sends rank 1 a marker over generation 2's mirror group, and
rank 1 prints what came first over that group: the marker, never generation 1's mirror.

    python -m tests.helpers.mirror_send --store-port P --rank R [--re-formed]
"""

from __future__ import annotations

import argparse
import os
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from wildtrain.elastic import peer_state
from wildtrain.elastic.membership import Pieces
from wildtrain.elastic.peer_state import Mirrors, _SendWhenCopied

FILLED = 7.0
MARKER = 3.0


class CopyStandIn:
    """A device-to-host copy that lands 0.3 s after it was queued: what `_SendWhenCopied` reads
    of a `torch.cuda.Event`."""

    def __init__(self, into: torch.Tensor) -> None:
        self._done = threading.Event()
        threading.Timer(0.3, self._land, args=(into,)).start()

    def _land(self, into: torch.Tensor) -> None:
        into.fill_(FILLED)
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()


class LateCopy(CopyStandIn):
    """A copy that lands when `land` is called, queued as `torch.cuda.Event` is (`record`)."""

    def __init__(self, into: torch.Tensor) -> None:
        self._done, self._into = threading.Event(), into

    def record(self, stream) -> None:
        pass

    def land(self) -> None:
        self._land(self._into)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--re-formed", action="store_true")
    args = parser.parse_args()
    store = dist.TCPStore("127.0.0.1", args.store_port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=2, timeout=timedelta(seconds=60))
    buffer = torch.zeros(1 << 20)
    if args.re_formed:
        re_formed(args.rank, torch.zeros(1, 16))  # small: a send the receiver never takes still returns
    elif args.rank == 0:
        sending = _SendWhenCopied(CopyStandIn(buffer), lambda: dist.isend(buffer, group_dst=1), lambda: True)
        print(f"posted before the copy landed: {sending.copied.query()}", flush=True)
        sending.wait()
    else:
        dist.irecv(buffer, group_src=0).wait()
        print(f"received: {sorted(set(buffer.tolist()))}", flush=True)
    # Not torch's teardown of the gloo group at exit, which aborts a rank now and then
    # (tests.helpers.ranks.spawn_ranks): the test reads the exit codes.
    os._exit(0)


def re_formed(rank: int, buffer: torch.Tensor) -> None:
    """The --re-formed drill: `buffer` is rank 0's partition, one parameter group's fp32 weights only."""
    first = dist.new_group(backend="gloo")  # generation 1's mirror group
    if rank == 0:
        copy = LateCopy(buffer)
        peer_state.host_copy = lambda engine, into, stream: (buffer, Pieces(((buffer.shape[1],),)))
        Mirrors._copy_stream = lambda self, engine: "a stream of the device"
        torch.cuda.Event = lambda: copy
        peer_state._COPIED_WITHIN_S = 0.1
        mirrors = Mirrors(group=first)
        mirrors.use_layout(1, 2)
        mirrors.exchange(engine=None, step=1)
        sending = mirrors._in_flight[0]
        # A member died: the exchange is dropped, and the group re-forms (`Member.form`).
        mirrors.drop_in_flight()
        mirrors.group = None
    second = dist.new_group(backend="gloo")  # generation 2's
    if rank == 0:
        mirrors.group = second
        mirrors.use_layout(2, 2)
        copy.land()
        sending._thread.join()
        dist.send(torch.full_like(buffer, MARKER), group=second, group_dst=1)
    else:
        came = torch.zeros_like(buffer)
        dist.recv(came, group=second, group_src=0)
        print(f"received: {sorted(set(came.flatten().tolist()))}", flush=True)


if __name__ == "__main__":
    main()
