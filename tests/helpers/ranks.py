"""The ranks of a gloo group as processes of their own, for the tests of in-process
recovery (issue 24): each runs a `tests.helpers` module with `--store-port` and `--rank`,
and they meet at a TCPStore this process holds."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from tests.conftest import REPO
from wildtrain import services


@dataclass
class Ranks:
    store: dist.TCPStore  # kept until the ranks end: they meet through it
    processes: list[subprocess.Popen]

    def outputs(self, timeout_s: float) -> list[tuple[int, str, str]]:
        """Each rank's (exit code, stdout, stderr), once it ended; any still running after
        `timeout_s` is killed and the wait raises."""
        ended = []
        try:
            for process in self.processes:
                output, errors = process.communicate(timeout=timeout_s)
                ended.append((process.returncode, output, errors))
            return ended
        finally:
            for process in self.processes:
                process.kill()


def start_ranks(module: str, world: int, *args: str, env: dict[str, str] | None = None) -> Ranks:
    """`world` processes of `python -m module --store-port P --rank R *args`."""
    port = services.free_port()
    store = dist.TCPStore(services.HOST, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    env = os.environ | {"PYTHONPATH": f"{REPO / 'platform'}:{REPO}", "GLOO_SOCKET_IFNAME": "lo"} | (env or {})
    processes = [subprocess.Popen([sys.executable, "-m", module, "--store-port", str(port), "--rank", str(rank),
                                   *map(str, args)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
                 for rank in range(world)]
    return Ranks(store, processes)
