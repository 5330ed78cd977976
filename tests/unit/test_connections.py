"""A rank hangs up its gloo group's connections, and only those (`elastic.connections`): a
survivor waiting on it is freed at once instead of at the group's timeout, while the
connections the process had before the group (a Ray worker's own) keep working."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from datetime import timedelta

import torch.distributed as dist

from tests.conftest import REPO
from wildtrain import services


def echo_server() -> int:
    """A server that answers each connection's 4 bytes with the same bytes."""
    server = socket.create_server((services.HOST, 0))

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(4):
                conn.sendall(data)

    def accept() -> None:
        while True:
            conn, _ = server.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return server.getsockname()[1]


def run_ranks() -> dict[int, list[str]]:
    """What each rank of tests/helpers/hang_up_rank.py printed, its lines and its errors."""
    store_port = services.free_port()
    store = dist.TCPStore(services.HOST, store_port, is_master=True, wait_for_workers=False,  # noqa: F841
                          timeout=timedelta(seconds=60))
    echo_port = echo_server()
    env = os.environ | {"PYTHONPATH": f"{REPO / 'platform'}:{REPO}", "GLOO_SOCKET_IFNAME": "lo"}
    ranks = [subprocess.Popen([sys.executable, "-m", "tests.helpers.hang_up_rank", "--store-port", str(store_port),
                               "--echo-port", str(echo_port), "--rank", str(rank)],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(3)]
    said = {}
    try:
        for rank, process in enumerate(ranks):
            output, errors = process.communicate(timeout=120)
            said[rank] = output.splitlines() + [f"(stderr: {errors[-2000:]})"]
    finally:
        for process in ranks:
            process.kill()
    return said


def test_a_rank_that_hangs_up_frees_the_survivor_waiting_on_it_and_keeps_its_own_connections():
    said = run_ranks()
    assert said[0][0] != "recorded 0", said[0]  # gloo's connections, made with the group
    assert said[0][1].startswith("failed") and said[0][2] != "shut 0", said[0]  # its receive from the dead rank 1
    assert said[0][3:5] == ["own ping", "rank 2 freed"], said[0]
    assert said[2][1].startswith("failed"), said[2]  # freed by the hang-up: rank 0 still lived, the timeout is 600 s
