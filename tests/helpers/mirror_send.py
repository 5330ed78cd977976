"""One rank of tests/unit/test_peer_state.py's check that a mirror's send waits for its copy
from the device (`peer_state._SendWhenCopied`), on gloo, with a stand-in for the copy's CUDA
event (this machine has no GPU): rank 0's buffer is filled 0.3 s after the send was asked
for, and rank 1 prints what it received.

    python -m tests.helpers.mirror_send --store-port P --rank R
"""

from __future__ import annotations

import argparse
import os
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from wildtrain.elastic.peer_state import _SendWhenCopied

FILLED = 7.0


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    args = parser.parse_args()
    store = dist.TCPStore("127.0.0.1", args.store_port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=2, timeout=timedelta(seconds=60))
    buffer = torch.zeros(1 << 20)
    if args.rank == 0:
        sending = _SendWhenCopied(CopyStandIn(buffer), lambda: dist.isend(buffer, group_dst=1))
        print(f"posted before the copy landed: {sending.copied.query()}", flush=True)
        sending.wait()
    else:
        dist.irecv(buffer, group_src=0).wait()
        print(f"received: {sorted(set(buffer.tolist()))}", flush=True)
    # Not torch's teardown of the gloo group at exit, which aborts a rank now and then
    # (tests.helpers.ranks.spawn_ranks): the test reads the exit codes.
    os._exit(0)


if __name__ == "__main__":
    main()
