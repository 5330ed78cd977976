"""One rank of tests/unit/test_connections.py: three gloo ranks; rank 1 dies, rank 0's
collective with it fails, and rank 2 waits in a receive from rank 0, which only rank 0's
hang-up (wildtrain.elastic.connections) can end before the group's timeout (600 s).

    python -m tests.helpers.hang_up_rank --store-port P --echo-port E --rank R

Rank 0 holds a connection opened before the group (as a Ray worker holds its own) and
checks that it still answers after the hang-up, then stays alive until rank 2 is freed (at
most 60 s). Prints what happened, a line each.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from wildtrain.elastic.connections import GroupConnections


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--echo-port", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    args = parser.parse_args()
    store = dist.TCPStore("127.0.0.1", args.store_port, is_master=False, timeout=timedelta(seconds=60))
    own = socket.create_connection(("127.0.0.1", args.echo_port))  # not the group's
    with GroupConnections() as connections:
        dist.init_process_group(
            "gloo", store=dist.PrefixStore("g1/", store), rank=args.rank, world_size=3, timeout=timedelta(seconds=600)
        )
    print("recorded", len(connections.inodes), flush=True)
    dist.barrier()
    if args.rank == 1:
        os._exit(0)
    buffer = torch.zeros(4)
    started = time.monotonic()
    try:
        dist.recv(buffer, src=1 if args.rank == 0 else 0)
        print("received", flush=True)
    except RuntimeError:
        print("failed", round(time.monotonic() - started, 1), flush=True)
    if args.rank == 2:
        store.set("rank2/freed", "1")
    else:
        print("shut", connections.hang_up(), flush=True)
        own.sendall(b"ping")
        print("own", own.recv(4).decode(), flush=True)
        # Alive until rank 2 is freed: what frees it is the hang-up, not this process's end.
        try:
            store.wait(["rank2/freed"], timedelta(seconds=60))
            print("rank 2 freed", flush=True)
        except RuntimeError:
            print("rank 2 still waiting", flush=True)
    os._exit(0)  # skips the destructors of a broken group


if __name__ == "__main__":
    main()
