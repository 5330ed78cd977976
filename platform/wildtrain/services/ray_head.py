"""The local Ray head: started on 127.0.0.1 only, with token authentication, on ports of its
own, and stopped without touching any other Ray cluster on the machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Optional

import psutil

from wildtrain.services.process import HOST, ServiceError, free_port, wait_healthy

# A dead node is noticed after about period x threshold. With Ray's defaults (3 s x 5)
# a restarted worker group waits longer for a node that is gone.
NODE_HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 2,
}

# Ray's metrics off (not wildtrain's default: it takes them from every user of a cluster).
# With elastic.in_process, while a dead worker's placement bundle waits for a node, Ray's GCS
# retries it without pause and records a metric sample per try, which the head's dashboard
# agent ingests one by one (bench/pg_storm.py); without metrics the agent stays idle.
RAY_METRICS_OFF = {"enable_metrics_collection": False}

# `ray start` turns a loopback --node-ip-address into the machine's address, and with it the
# dashboard agent, runtime-env agent, metrics and client server listen beyond 127.0.0.1 and the
# GCS and raylet on every interface. Ray keeps a loopback node address only where it believes
# multi-node clusters unsupported (Windows, macOS); this variable says so on Linux too. A
# client needs it as well, before it imports Ray, or it resolves 127.0.0.1 to the machine's
# address, where nothing listens.
LOOPBACK_ONLY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}

# The custom resource that conf/cluster/gpu.yaml's workers ask for, one per GPU: the launcher
# files give it to GPU nodes only, keeping workers off CPU-only heads.
TRAINER_RESOURCE = "trainer"


def ray_cli() -> str:
    return shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"


def token_auth_env() -> dict[str, str]:
    """The environment for Ray processes: token authentication, with a token generated in
    ~/.ray/auth_token if there is none (the dashboard and jobs API run arbitrary code for
    whoever reaches them), and this environment's bin/ first on PATH, so a job's `python`
    is the one wildtrain is installed in."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "RAY_AUTH_MODE": "token", "PATH": path}
    # Where Ray looks for a token, in its order. The CLI imports Ray at every call, so it runs
    # only when there is none yet.
    token_file = Path(env.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if not env.get("RAY_AUTH_TOKEN") and not token_file.is_file():
        subprocess.run([ray_cli(), "get-auth-token", "--generate"], env=env, capture_output=True, check=True)
    return env


@dataclass(frozen=True)
class RayPorts:
    """Every TCP port a head started by `start_ray_head` listens on (besides its workers',
    which the OS picks). None: a free port, chosen at start. Ray's own defaults are fixed
    numbers, so a second cluster on the machine would collide on them: the agent's 52365
    makes its jobs API answer "No available agent to submit job"."""

    gcs: Optional[int] = 6379
    dashboard: Optional[int] = 8265
    dashboard_agent: Optional[int] = None
    dashboard_agent_grpc: Optional[int] = None
    runtime_env_agent: Optional[int] = None
    metrics_export: Optional[int] = None
    # `ray start` always starts a Ray Client server and cannot be told not to.
    client_server: Optional[int] = None
    node_manager: Optional[int] = None
    object_manager: Optional[int] = None
    # The autoscaler's and the dashboard's own metrics, set only through the environment.
    autoscaler_metrics: Optional[int] = None
    dashboard_metrics: Optional[int] = None

    def chosen(self) -> "RayPorts":
        return replace(self, **{f.name: free_port() for f in fields(self) if getattr(self, f.name) is None})


def local_gpus() -> int:
    """The GPUs of this machine that training can use: torch's count, not nvidia-smi's.
    Workers train with this Python's torch, so a GPU it cannot use (a CPU-only torch build,
    a driver too old for its CUDA, one hidden by CUDA_VISIBLE_DEVICES, which torch honours
    and nvidia-smi does not) must not be declared: a run on it would fail in every worker
    instead of training on CPU. It costs `up` a torch import (seconds), next to the tens of
    seconds its services take to start."""
    import torch

    return torch.cuda.device_count()


def ray_head_command(ports: RayPorts, num_cpus: int, temp_dir: Path, num_gpus: int = 0) -> list[str]:
    """`ray start` for the local head. Its GPUs are declared, not left to Ray's own detection
    (NVML: any GPU the driver sees), so that Ray offers exactly the ones `local_gpus`
    counted, with as many `trainer` resources for conf/cluster/gpu.yaml's workers."""
    trainer = ["--resources", json.dumps({TRAINER_RESOURCE: num_gpus})] if num_gpus else []
    return [
        ray_cli(),
        "start",
        "--head",
        "--disable-usage-stats",
        "--node-ip-address",
        HOST,
        "--port",
        str(ports.gcs),
        "--include-dashboard",
        "true",
        "--dashboard-host",
        HOST,
        "--dashboard-port",
        str(ports.dashboard),
        "--dashboard-agent-listen-port",
        str(ports.dashboard_agent),
        "--dashboard-agent-grpc-port",
        str(ports.dashboard_agent_grpc),
        "--runtime-env-agent-port",
        str(ports.runtime_env_agent),
        "--metrics-export-port",
        str(ports.metrics_export),
        "--ray-client-server-port",
        str(ports.client_server),
        "--node-manager-port",
        str(ports.node_manager),
        "--object-manager-port",
        str(ports.object_manager),
        # 0: ports the OS picks, instead of the 10002-19999 range every `ray start` shares.
        "--min-worker-port",
        "0",
        "--max-worker-port",
        "0",
        "--num-cpus",
        str(num_cpus),
        "--num-gpus",
        str(num_gpus),
        *trainer,
        "--system-config",
        json.dumps(NODE_HEALTH_CHECKS),
        # Its own temp dir: its sessions, sockets and discovery file apart from any other
        # Ray's, and what `stop_ray_head` finds its processes by.
        "--temp-dir",
        str(temp_dir),
    ]


def start_ray_head(
    ports: RayPorts, num_cpus: int, temp_dir: Path, env: dict[str, str] | None = None, num_gpus: int = 0
) -> str:
    """A Ray head on 127.0.0.1 only, with its dashboard and jobs API, token authentication
    on, its files under `temp_dir` (absolute and short: Ray's socket paths must fit 107
    bytes); `env` is added to the environment of its processes. Returns the GCS address."""
    metric_ports = {
        "AUTOSCALER_METRIC_PORT": str(ports.autoscaler_metrics),
        "DASHBOARD_METRIC_PORT": str(ports.dashboard_metrics),
    }
    # Ray's own helpers that find "the" cluster without an address (Ray Train's placement
    # group cleaner asks the state API) pick the newest of all Ray instances on the machine
    # unless RAY_ADDRESS names theirs: beside a test cluster they removed the wrong group's
    # placement group. Every process of the head inherits its own address.
    own_address = {"RAY_ADDRESS": f"{HOST}:{ports.gcs}"}
    done = subprocess.run(
        ray_head_command(ports, num_cpus, temp_dir, num_gpus),
        capture_output=True,
        text=True,
        env={**token_auth_env(), **LOOPBACK_ONLY_ENV, **metric_ports, **own_address, **(env or {})},
    )
    if done.returncode != 0:
        stop_ray_head(temp_dir, f"{HOST}:{ports.gcs}")
        raise ServiceError(f"`ray start --head` failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    # Ray opens its temp dir to everyone (0777, for a /tmp/ray that users share); this one is
    # the head's alone and holds its logs and spilled objects.
    temp_dir.chmod(0o700)
    wait_healthy(f"http://{HOST}:{ports.dashboard}/api/version", None, Path("ray start"), 60.0)
    return f"{HOST}:{ports.gcs}"


def ray_head_processes(temp_dir: Path, gcs_address: str) -> list[psutil.Process]:
    """The head's processes: those started with its temp dir on their command line (GCS,
    raylet, dashboard, monitors), its Ray Client server (named by the GCS address alone),
    and all their descendants (agents, workers, jobs, the dashboard's modules)."""
    roots = []
    for process in psutil.process_iter(["cmdline"]):
        args = process.info["cmdline"] or []
        if any(_names(arg, temp_dir) for arg in args) or (
            "ray.util.client.server" in args and f"--address={gcs_address}" in args
        ):
            roots.append(process)
    found = {p.pid: p for p in roots}
    for root in roots:
        try:
            found.update({p.pid: p for p in root.children(recursive=True)})
        except psutil.NoSuchProcess:
            pass
    return list(found.values())


def _names(arg: str, folder: Path) -> bool:
    """Whether a command-line argument is `folder` or a path inside it (not a sibling that
    merely starts with the same name)."""
    return any(path == str(folder) or path.startswith(f"{folder}/") for path in (arg, arg.split("=", 1)[-1]))


def stop_ray_head(temp_dir: Path, gcs_address: str, timeout_s: float = 15.0) -> None:
    """Stop one head and nothing else. (`ray stop` stops every Ray of the user on the machine:
    it has no notion of one cluster.) The GCS goes last: terminated together with its clients,
    the GCS and the autoscaler's monitor kept running long after SIGTERM (Ray 2.60), where
    each wave alone exits promptly (docs/benchmarks.md)."""
    processes = ray_head_processes(temp_dir, gcs_address)
    gcs = [p for p in processes if _process_name(p) == "gcs_server"]
    for wave in ([p for p in processes if p not in gcs], gcs):
        _terminate(wave, timeout_s)
    shutil.rmtree(temp_dir, ignore_errors=True)


def _process_name(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.NoSuchProcess:
        return ""


def _terminate(processes: list[psutil.Process], timeout_s: float) -> None:
    """SIGTERM `processes` and wait for their exit; SIGKILL those still there after `timeout_s`."""
    for process in processes:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5.0)
