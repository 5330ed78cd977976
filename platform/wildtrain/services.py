"""The embedded defaults a new user needs no cloud for: a local Ray head with its
dashboard and an MLflow server with a SQLite store, both bound to 127.0.0.1.

`up` starts what is not already running and records the addresses in
`<state_dir>/services.json`; `down` stops what `up` started. Test fixtures use the same
`start_*` functions on free ports.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

HOST = "127.0.0.1"
# A dead node is noticed after about period x threshold. With Ray's defaults (3 s x 5)
# a restarted worker group waits longer for a node that is gone.
NODE_HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 2,
}
DEFAULT_STATE_DIR = Path(".wildtrain")


class ServiceError(RuntimeError):
    pass


@dataclass
class Services:
    ray_address: str
    dashboard_url: str
    mlflow_url: str
    mlflow_pid: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def is_healthy(url: str, timeout_s: float = 2.0) -> bool:
    """True once `url` answers; a 401 counts, since Ray's token auth guards its APIs."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except urllib.error.HTTPError as e:
        return e.code == 401
    except OSError:
        return False


def wait_healthy(url: str, process: subprocess.Popen | None, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not is_healthy(url):
        if process is not None and process.poll() is not None:
            raise ServiceError(f"{' '.join(process.args[:4])} exited with {process.returncode}; see {log}")
        if time.monotonic() > deadline:
            raise ServiceError(f"{url} did not answer within {timeout_s:g} s; see {log}")
        time.sleep(0.2)


def start_mlflow(root: Path, port: int, timeout_s: float = 120.0) -> subprocess.Popen:
    """An MLflow tracking server on 127.0.0.1:`port`, storing runs in `root`."""
    root = root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    log = root / "mlflow.log"
    process = subprocess.Popen(
        [
            sys.executable, "-m", "mlflow", "server",
            "--host", HOST, "--port", str(port), "--workers", "1",
            "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination", str(root / "artifacts"),
        ],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # outlives the shell that ran `wildtrain up`
    )
    wait_healthy(f"http://{HOST}:{port}/health", process, log, timeout_s)
    return process


def stop_process(pid: int, timeout_s: float = 15.0) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left after `timeout_s`."""
    for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def ray_cli() -> str:
    return shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"


def token_auth_env() -> dict[str, str]:
    """The environment for Ray processes: token authentication, with a token generated in
    ~/.ray/auth_token if there is none (the dashboard and jobs API run arbitrary code for
    whoever reaches them), and this environment's bin/ first on PATH, so a job's `python`
    is the one wildtrain is installed in."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "RAY_AUTH_MODE": "token", "PATH": path}
    subprocess.run([ray_cli(), "get-auth-token", "--generate"], env=env, capture_output=True, check=True)
    return env


def start_ray_head(port: int, dashboard_port: int, num_cpus: int, temp_dir: Path | None = None) -> str:
    """A Ray head on 127.0.0.1 with its dashboard and jobs API, token authentication on;
    returns the GCS address."""
    command = [
        ray_cli(), "start", "--head", "--disable-usage-stats",
        "--node-ip-address", HOST, "--port", str(port),
        "--include-dashboard", "true", "--dashboard-host", HOST, "--dashboard-port", str(dashboard_port),
        "--num-cpus", str(num_cpus),
        "--system-config", json.dumps(NODE_HEALTH_CHECKS),
    ]
    if temp_dir is not None:
        command += ["--temp-dir", str(temp_dir)]
    done = subprocess.run(command, capture_output=True, text=True, env=token_auth_env())
    if done.returncode != 0:
        raise ServiceError(f"`ray start --head` failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    wait_healthy(f"http://{HOST}:{dashboard_port}/api/version", None, Path("ray start"), 60.0)
    return f"{HOST}:{port}"


def stop_ray() -> None:
    subprocess.run([ray_cli(), "stop", "--force"], capture_output=True)


def up(state_dir: Path = DEFAULT_STATE_DIR, ray_port: int = 6379, dashboard_port: int = 8265,
       mlflow_port: int = 5000, num_cpus: int | None = None) -> Services:
    state_file = state_dir / "services.json"
    if state_file.is_file():
        running = Services(**json.loads(state_file.read_text()))
        if is_healthy(running.mlflow_url + "/health") and is_healthy(running.dashboard_url + "/api/version"):
            return running
        down(state_dir)
    # Logical CPUs are a scheduling budget: leave room for Ray Data's tasks beside the
    # training workers even on a 2-core machine.
    num_cpus = num_cpus or max(4, os.cpu_count() or 1)
    ray_address = start_ray_head(ray_port, dashboard_port, num_cpus)
    mlflow = start_mlflow(state_dir / "mlflow", mlflow_port)
    services = Services(
        ray_address=ray_address,
        dashboard_url=f"http://{HOST}:{dashboard_port}",
        mlflow_url=f"http://{HOST}:{mlflow_port}",
        mlflow_pid=mlflow.pid,
    )
    state_file.write_text(json.dumps(asdict(services), indent=2))
    return services


def down(state_dir: Path = DEFAULT_STATE_DIR) -> None:
    state_file = state_dir / "services.json"
    if state_file.is_file():
        stop_process(json.loads(state_file.read_text())["mlflow_pid"])
        state_file.unlink()
    stop_ray()
