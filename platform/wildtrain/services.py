"""The embedded defaults a new user needs no cloud for: a local Ray head with its
dashboard, an MLflow server with a SQLite store and a SeaweedFS S3 object store, all bound
to 127.0.0.1.

`up` starts what is not already running and records the addresses in
`<state_dir>/services.json` (with the object store's keys, so readable by its owner only);
`down` stops what `up` started. The Ray head gets the object store's AWS_* variables, so every
job and worker on it reaches the store with no setup. Test fixtures use the same `start_*`
functions on free ports.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import pyarrow.fs as pafs

from wildtrain import storage
from wildtrain.config import StorageConfig

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
# `weed mini` runs a master, volume server, filer, S3 gateway and admin server, each with an
# HTTP and a gRPC port; unset ports default to fixed numbers (gRPC: HTTP + 10000), so a second
# store on the same machine would collide. Only the S3 port is chosen by the caller.
WEED_INTERNAL_PORTS = (
    "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
    "filer.port", "filer.port.grpc", "s3.port.grpc",
)
# The admin server's maintenance worker dials the admin HTTP port + 10000 whatever
# -admin.port.grpc says (seaweedfs 4.48), so the admin gRPC port is left at that default.
WEED_GRPC_OFFSET = 10000
WEED_DISABLED = ("-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
                 "-master.telemetry=false")


class ServiceError(RuntimeError):
    pass


@dataclass
class ObjectStore:
    """A running SeaweedFS S3 endpoint and what a client needs to reach it."""

    endpoint: str
    bucket: str
    access_key: str
    secret_key: str = field(repr=False)
    pid: int
    data_dir: str

    def env(self) -> dict[str, str]:
        """The standard variables that point `storage` (and any S3 client) at this store."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
        }


@dataclass
class Services:
    ray_address: str
    dashboard_url: str
    mlflow_url: str
    mlflow_pid: int
    # None in a services.json written before `up` started an object store.
    object_store: Optional[ObjectStore] = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def free_port_with_offset(offset: int) -> int:
    """A free port p such that p + `offset` is free too."""
    for _ in range(100):
        port = free_port()
        if port + offset <= 65535:
            with socket.socket() as s:
                try:
                    s.bind((HOST, port + offset))
                except OSError:
                    continue
            return port
    raise ServiceError(f"no free port p with p + {offset} also free on {HOST}")


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
    wait_until(lambda: is_healthy(url), f"{url} did not answer", process, log, timeout_s)


def wait_until(ready: Callable[[], bool], failure: str, process: subprocess.Popen | None, log: Path,
               timeout_s: float) -> None:
    """Poll `ready` until it holds; if `process` exits first or time runs out, raise with the
    end of its log, which says why far better than a timeout does."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if process is not None and process.poll() is not None:
            raise ServiceError(
                f"{' '.join(process.args[:4])} exited with {process.returncode}; see {log}{_tail(log)}"
            )
        if time.monotonic() > deadline:
            raise ServiceError(f"{failure} within {timeout_s:g} s; see {log}{_tail(log)}")
        time.sleep(0.2)


def _tail(log: Path, lines: int = 15) -> str:
    try:
        return "\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:  # not every service has a log file of its own
        return ""


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


def weed_cli() -> str:
    return shutil.which("weed", path=str(Path(sys.executable).parent)) or "weed"


def object_store_keys() -> tuple[str, str]:
    """The keys the store accepts: $AWS_ACCESS_KEY_ID/$AWS_SECRET_ACCESS_KEY, else a fresh random pair."""
    access_key, secret_key = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if access_key and secret_key:
        return access_key, secret_key
    return secrets.token_hex(10).upper(), secrets.token_hex(20)


def start_object_store(root: Path, port: int, bucket: str = "wildtrain", timeout_s: float = 60.0) -> ObjectStore:
    """A SeaweedFS S3 endpoint on 127.0.0.1:`port` storing its data under `root`, with
    `bucket` created; returns once the bucket answers a signed request."""
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
        # SeaweedFS only logs a warning for an invalid name and then never creates the bucket.
        raise ServiceError(f"bucket {bucket!r}: not a valid S3 bucket name (3-63 of a-z, 0-9, '.', '-')")
    root = root.resolve()
    data_dir = root / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    log = root / "weed.log"
    access_key, secret_key = object_store_keys()
    process = subprocess.Popen(
        [
            weed_cli(), "mini", f"-dir={data_dir}", f"-ip={HOST}", f"-ip.bind={HOST}", f"-bucket={bucket}",
            f"-s3.port={port}", *(f"-{name}={free_port()}" for name in WEED_INTERNAL_PORTS),
            f"-admin.port={free_port_with_offset(WEED_GRPC_OFFSET)}", *WEED_DISABLED,
        ],
        # SeaweedFS takes its admin identity from these variables: never from the command line,
        # which every user of the machine can read.
        env={**os.environ, "AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key},
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # outlives the shell that ran `wildtrain up`
    )
    store = ObjectStore(f"http://{HOST}:{port}", bucket, access_key, secret_key, process.pid, str(data_dir))
    client = storage.s3_filesystem(store.endpoint, access_key, secret_key, StorageConfig.region, max_attempts=1)

    def bucket_ready() -> bool:
        try:
            return client.get_file_info(bucket).type == pafs.FileType.Directory
        except OSError:
            return False

    try:
        wait_until(bucket_ready, f"{store.endpoint} did not serve bucket {bucket!r}", process, log, timeout_s)
    except ServiceError:
        stop_process(process.pid)
        raise
    return store


def stop_process(pid: int, timeout_s: float = 15.0) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left after `timeout_s`."""
    for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if _exited(pid):
                return
            time.sleep(0.1)


def _exited(pid: int) -> bool:
    try:
        # A child of this process (a test fixture's server) stays a zombie, which signal 0
        # still finds, until it is reaped here.
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return True
    except ChildProcessError:  # not our child: its own parent reaps it
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


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


def start_ray_head(port: int, dashboard_port: int, num_cpus: int, temp_dir: Path | None = None,
                   env: dict[str, str] | None = None) -> str:
    """A Ray head on 127.0.0.1 with its dashboard and jobs API, token authentication on;
    `env` is added to the environment of its processes. Returns the GCS address."""
    command = [
        ray_cli(), "start", "--head", "--disable-usage-stats",
        "--node-ip-address", HOST, "--port", str(port),
        "--include-dashboard", "true", "--dashboard-host", HOST, "--dashboard-port", str(dashboard_port),
        "--num-cpus", str(num_cpus),
        "--system-config", json.dumps(NODE_HEALTH_CHECKS),
    ]
    if temp_dir is not None:
        command += ["--temp-dir", str(temp_dir)]
    done = subprocess.run(command, capture_output=True, text=True, env={**token_auth_env(), **(env or {})})
    if done.returncode != 0:
        raise ServiceError(f"`ray start --head` failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    wait_healthy(f"http://{HOST}:{dashboard_port}/api/version", None, Path("ray start"), 60.0)
    return f"{HOST}:{port}"


def stop_ray() -> None:
    subprocess.run([ray_cli(), "stop", "--force"], capture_output=True)


def up(state_dir: Path = DEFAULT_STATE_DIR, ray_port: int = 6379, dashboard_port: int = 8265,
       mlflow_port: int = 5000, num_cpus: int | None = None, object_store_port: int = 8333,
       bucket: str = "wildtrain") -> Services:
    state_file = state_dir / "services.json"
    if state_file.is_file():
        state = json.loads(state_file.read_text())
        store = state.pop("object_store", None)
        running = Services(**state, object_store=ObjectStore(**store) if store else None)
        if (
            is_healthy(running.mlflow_url + "/health")
            and is_healthy(running.dashboard_url + "/api/version")
            and running.object_store is not None
            and is_healthy(running.object_store.endpoint + "/healthz")
        ):
            return running
        down(state_dir)
    # The store first: the Ray head's processes inherit its address and keys.
    store = start_object_store(state_dir / "objectstore", object_store_port, bucket)
    # Logical CPUs are a scheduling budget: leave room for Ray Data's tasks beside the
    # training workers even on a 2-core machine.
    num_cpus = num_cpus or max(4, os.cpu_count() or 1)
    ray_address = start_ray_head(ray_port, dashboard_port, num_cpus, env=store.env())
    mlflow = start_mlflow(state_dir / "mlflow", mlflow_port)
    services = Services(
        ray_address=ray_address,
        dashboard_url=f"http://{HOST}:{dashboard_port}",
        mlflow_url=f"http://{HOST}:{mlflow_port}",
        mlflow_pid=mlflow.pid,
        object_store=store,
    )
    state_file.touch(mode=0o600)
    state_file.write_text(json.dumps(asdict(services), indent=2))
    return services


def use_local_object_store(state_dir: Path = DEFAULT_STATE_DIR) -> Optional[str]:
    """Point this process's s3:// URIs at the object store `up` started, unless the
    environment already names an endpoint (as on a cluster node, whose raylet got it from
    `up` or from its operator); the endpoint now in use, if any."""
    state_file = state_dir / "services.json"
    if "AWS_ENDPOINT_URL" not in os.environ and state_file.is_file():
        store = json.loads(state_file.read_text()).get("object_store")
        if store:
            os.environ.update(ObjectStore(**store).env())
    return os.environ.get("AWS_ENDPOINT_URL")


def down(state_dir: Path = DEFAULT_STATE_DIR) -> None:
    state_file = state_dir / "services.json"
    if state_file.is_file():
        state = json.loads(state_file.read_text())
        stop_process(state["mlflow_pid"])
        if state.get("object_store"):
            stop_process(state["object_store"]["pid"])
        state_file.unlink()
    stop_ray()
