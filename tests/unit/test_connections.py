"""A rank hangs up its gloo group's connections, and only those (`elastic.connections`): a
survivor waiting on it is freed at once instead of at the group's timeout, while the
connections the process had before the group (a Ray worker's own) keep working."""

from __future__ import annotations

import socket
import threading

from tests.helpers.ranks import start_ranks
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
    ranks = start_ranks("tests.helpers.hang_up_rank", 3, "--echo-port", echo_server())
    return {
        rank: output.splitlines() + [f"(stderr: {errors[-2000:]})"]
        for rank, (_, output, errors) in enumerate(ranks.outputs(timeout_s=120))
    }


def test_a_rank_that_hangs_up_frees_the_survivor_waiting_on_it_and_keeps_its_own_connections():
    said = run_ranks()
    assert said[0][0] != "recorded 0", said[0]  # gloo's connections, made with the group
    assert said[0][1].startswith("failed") and said[0][2] != "shut 0", said[0]  # its receive from the dead rank 1
    assert said[0][3:5] == ["own ping", "rank 2 freed"], said[0]
    assert said[2][1].startswith("failed"), said[2]  # freed by the hang-up: rank 0 still lived, the timeout is 600 s
