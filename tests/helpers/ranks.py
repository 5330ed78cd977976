"""The ranks of a process group as processes of their own, for the tests of in-process
recovery (issue 24): each runs a `tests.helpers` module with `--store-port` and `--rank`,
and they meet at a TCPStore this process holds; or spawned processes of a function
(`spawn_ranks`; `spawned_pair`, two that meet over gloo)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterator

import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import REPO
from tests.helpers.member_rank import SAYS
from wildtrain import services
from wildtrain.elastic.rendezvous import RendezvousServer
from wildtrain.elastic.survivor_env import SURVIVOR_ENV

# The environment of ranks that share a machine's one GPU over NCCL (each sets NCCL_HOSTID to
# a host of its own), as an in-process GPU worker (SURVIVOR_ENV). Several ranks on one
# device is no setting NCCL supports before 2.30's experimental NCCL_MULTI_RANK_GPU_ENABLE
# (its guide: "may lead to hangs"); NCCL_HOSTID, undocumented, makes each rank a host of its
# own that talks over sockets (what NCCL chose on the H200, NCCL 2.28.9: NET/Socket).
# cuMem's file-descriptor exchange is off, where NCCL issues 2350 and 2379 saw it hang under
# gVisor (which that machine runs), and no InfiniBand loopback is tried.
NCCL_ON_ONE_GPU = SURVIVOR_ENV | {
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_IB_DISABLE": "1",
    "NCCL_CUMEM_ENABLE": "0",
    "NCCL_MULTI_RANK_GPU_ENABLE": "1",
}


@dataclass
class Ranks:
    store: dist.TCPStore  # kept until the ranks end: they meet through it
    processes: list[subprocess.Popen]

    def outputs(self, timeout_s: float) -> list[tuple[int, str, str]]:
        """Each rank's (exit code, stdout, stderr), once it ended; one still running
        `timeout_s` after this call is killed, and its stderr says so after what it wrote."""
        deadline = time.monotonic() + timeout_s
        ended = []
        try:
            for process in self.processes:
                try:
                    output, errors = process.communicate(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    process.kill()
                    output, errors = process.communicate()
                    errors += f"\n(killed: still running {timeout_s:g} s after the ranks were awaited)"
                ended.append((process.returncode, output, errors))
            return ended
        finally:
            for process in self.processes:
                process.kill()


def checkout_env() -> dict[str, str]:
    """This environment for a process of the checkout's code run as a script or module: the
    checkout first on its path, the caller's own path after it (where the packages come
    from elsewhere: a GPU machine's carried wheels, bench/gpu_all.sh)."""
    paths = [str(REPO / "platform"), str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.environ | {"PYTHONPATH": os.pathsep.join(paths)}


def start_ranks(module: str, world: int, *args: str, env: dict[str, str] | None = None) -> Ranks:
    """`world` processes of `python -m module --store-port P --rank R *args`."""
    port = services.free_port()
    store = dist.TCPStore(services.HOST, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    env = checkout_env() | {"GLOO_SOCKET_IFNAME": "lo"} | (env or {})
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", module, "--store-port", str(port), "--rank", str(rank), *map(str, args)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    return Ranks(store, processes)


def member_drill(
    rendezvous: RendezvousServer,
    drill: str,
    processes: int = 2,
    *args: str,
    env: dict[str, str] | None = None,
    timeout_s: float = 120.0,
) -> tuple[dict[int, list[str]], dict[int, dict[str, float]]]:
    """What each rank of tests/helpers/member_rank.py printed, its lines (not DeepSpeed's
    bracketed log lines) and its errors; and its timings, apart (`waited 0.5 s` is
    {"waited": 0.5}): how long its failed all-reduce waited, and when it stepped alone."""
    # A rank still running a while before the wait ends prints where it is (member_rank's
    # --stacks-after-s), which a kill would lose.
    ranks = start_ranks(
        "tests.helpers.member_rank",
        processes,
        "--rendezvous-port",
        rendezvous.port,
        "--drill",
        drill,
        "--stacks-after-s",
        timeout_s - 15,
        *args,
        env=env,
    )
    said, times = {}, {}
    # Enough of stderr for a rank's stacks, every thread's, printed as it was given up.
    for rank, (_, output, errors) in enumerate(ranks.outputs(timeout_s)):
        lines = [line for line in output.splitlines() if not line.startswith("[")]
        timed = [line for line in lines if line.startswith(("waited ", "stepped "))]
        times[rank] = {line.split()[0]: float(line.split()[1]) for line in timed}
        said[rank] = [line for line in lines if line not in timed] + [f"(stderr: {errors[-8000:]})"]
    return said, times


def check_said(said: dict[int, list[str]], drill: str) -> None:
    """Each rank began with what `member_rank.SAYS` has it say in `drill`."""
    for rank, lines in SAYS[drill].items():
        assert said[rank][: len(lines)] == lines, (rank, said)


def spawn_ranks(fn: Callable[..., None], world_size: int, *args) -> None:
    """`fn(rank, world_size, port, *args)` in `world_size` spawned processes, a free port for
    them to meet on; raises where one raised. Each exits as soon as `fn` returns: torch's
    teardown of the gloo groups at a normal exit aborts a rank now and then ("terminate called
    without an active exception": test_step once in 16 runs, test_precision in a suite run of
    2026-12-06), after what counts was written."""
    mp.spawn(_exit_after, args=(fn, world_size, services.free_port(), *args), nprocs=world_size, join=True)


def _exit_after(rank: int, fn: Callable[..., None], *args) -> None:
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def spawned_pair(target: Callable[[int, object], None]) -> Iterator[object]:
    """Ranks 0 and 1 as spawned processes in a gloo group of two on a free port, with
    wildtrain's control group open, each running `target(rank, results)`: the queue they put
    into `results`; both killed after."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = services.free_port()
    ranks = [context.Process(target=_pair_member, args=(target, rank, port, results), daemon=True) for rank in (0, 1)]
    for process in ranks:
        process.start()
    try:
        yield results
    finally:
        for process in ranks:
            process.kill()
            process.join()


def _pair_member(target: Callable[[int, object], None], rank: int, port: int, results) -> None:
    from wildtrain.train import collectives

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    collectives.open_control_group(60)
    target(rank, results)
    dist.destroy_process_group()
