"""`wildtrain up` beside another Ray cluster on the same machine (the session's test cluster,
as when a user runs `make test` while `make demo`'s services run): its processes listen on
127.0.0.1 only, on ports it chose free, keep their data in owner-only folders, and
`wildtrain down` stops them and nothing else. And a run with no cluster to join says so
instead of starting a private Ray."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import ray
import torch

from tests.helpers.datasets import write_dataset
from wildtrain import services

pytestmark = pytest.mark.integration

LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1"}


def wildtrain(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 300):
    return subprocess.run(
        [sys.executable, "-m", "wildtrain", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout
    )


def with_descendants(pids: list[int]) -> list[psutil.Process]:
    found = {}
    for pid in pids:
        try:
            root = psutil.Process(pid)
            found.update({p.pid: p for p in [root, *root.children(recursive=True)]})
        except psutil.NoSuchProcess:
            pass
    return list(found.values())


def listening(processes: list[psutil.Process]) -> dict[psutil.Process, set[tuple[str, int]]]:
    sockets = {}
    for process in processes:
        try:
            sockets[process] = {
                (c.laddr.ip, c.laddr.port) for c in process.net_connections("inet") if c.status == psutil.CONN_LISTEN
            }
        except psutil.NoSuchProcess:
            pass
    return sockets


def is_ray_worker(process: psutil.Process) -> bool:
    """Workers (idle ones, a job's supervisor) listen on a port the OS picks; agents do not count."""
    try:
        name = process.name()
    except psutil.NoSuchProcess:
        return False
    return name.startswith("ray::") and name not in ("ray::DashboardAgent", "ray::RuntimeEnvAgent")


def test_up_listens_on_loopback_only_and_down_stops_only_what_it_started(ray_cluster, tmp_path):
    state_dir = tmp_path / "state"
    ports = {
        name: services.free_port()
        for name in ("--ray-port", "--dashboard-port", "--mlflow-port", "--object-store-port")
    }
    started = wildtrain("up", "--state-dir", str(state_dir), *(str(x) for pair in ports.items() for x in pair))
    assert started.returncode == 0, started.stdout + started.stderr
    state = json.loads((state_dir / "services.json").read_text())
    try:
        # The dashboard asks for Ray's token: `up` names the command that prints it, never the token.
        token = subprocess.run(
            [services.ray_cli(), "get-auth-token"], capture_output=True, text=True, check=True
        ).stdout
        assert token and token not in started.stdout + started.stderr
        assert "ray get-auth-token" in started.stdout
        # The head offers the GPUs this machine's torch can use, recorded with the rest.
        assert state["num_gpus"] == torch.cuda.device_count()
        assert f"{state['num_gpus']} GPU" in started.stdout
        temp_dir = Path(state["ray_temp_dir"])
        head = services.ray_head_processes(temp_dir, state["ray_address"])
        mlflow = with_descendants([state["mlflow_pid"]])
        store = with_descendants([state["object_store"]["pid"]])
        ours = head + mlflow + store
        sockets = listening(ours)

        addresses = {ip for found in sockets.values() for ip, _ in found}
        assert addresses <= LOOPBACK, {
            p.name(): s for p, s in sockets.items() if s - {(ip, port) for ip, port in s if ip in LOOPBACK}
        }
        ray_ports = {port for p, found in sockets.items() if p in head and not is_ray_worker(p) for _, port in found}
        assert ray_ports == set(state["ray_ports"].values())
        assert {port for p in mlflow for _, port in sockets.get(p, ())} == {ports["--mlflow-port"]}
        assert ports["--object-store-port"] in {port for p in store for _, port in sockets.get(p, ())}

        for folder in (
            state_dir,
            state_dir / "mlflow",
            state_dir / "objectstore",
            state_dir / "objectstore" / "data",
            temp_dir,
        ):
            assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    finally:
        stopped = wildtrain("down", "--state-dir", str(state_dir))
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert not [p for p in ours if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not temp_dir.exists()
    assert not services.ray_head_processes(temp_dir, state["ray_address"])
    # The session's test cluster, started before `up` and running through `down`, still answers.
    assert ray.cluster_resources()["CPU"] >= 1
    assert ray.get(ray.remote(lambda: 1).remote(), timeout=60) == 1


def test_train_with_no_cluster_to_join_fails_fast_and_starts_no_ray(tmp_path, mlflow_url):
    dataset = tmp_path / "data"
    write_dataset(dataset, [np.zeros((32, 129), dtype=np.int32)], rows_per_group=16)
    # This process joined the test cluster; a user's shell has no RAY_ADDRESS.
    env = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}
    started = time.monotonic()
    done = wildtrain(
        "train",
        f"tracking.uri={mlflow_url}",
        f"run.storage={tmp_path / 'runs'}",
        f"data.datasets=[{{uri: {dataset}}}]",
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "run `wildtrain up`" in done.stderr and str(tmp_path / ".wildtrain/services.json") in done.stderr
    assert "Traceback" not in done.stderr
    assert "Started a local Ray instance" not in done.stdout + done.stderr
    assert time.monotonic() - started < 60
