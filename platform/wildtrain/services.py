"""The embedded defaults a new user needs no cloud for: a local Ray head with its
dashboard, an MLflow server with a SQLite store and a SeaweedFS S3 object store, all bound
to 127.0.0.1.

`up` starts what is not already running and records the addresses in
`<state_dir>/services.json` (with the object store's keys, so readable by its owner only);
`down` stops what `up` started and nothing else: other Ray clusters on the machine (a test
suite's, another checkout's) keep running. The Ray head gets the object store's AWS_*
variables, so every job and worker on it reaches the store with no setup. Test fixtures use
the same `start_*` functions on free ports.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Callable, Optional

import psutil
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


# `ray start` turns a loopback --node-ip-address into the machine's address, and with it the
# dashboard agent, runtime-env agent, metrics and client server listen beyond 127.0.0.1 and the
# GCS and raylet on every interface. Ray keeps a loopback node address only where it believes
# multi-node clusters unsupported (Windows, macOS); this variable says so on Linux too. A
# client needs it as well, before it imports Ray, or it resolves 127.0.0.1 to the machine's
# address, where nothing listens.
LOOPBACK_ONLY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class ServiceError(RuntimeError):
    pass


def choose_ray_address(configured: Optional[str], environ_address: Optional[str],
                       recorded: Optional[str], state_file: Path) -> str:
    """The cluster a run joins: `cluster.ray_address`, else $RAY_ADDRESS, else the head
    `wildtrain up` recorded in `state_file`. Never a private Ray started on the spot: its
    CPUs would be whatever this machine has, not what the run was sized for, and a run that
    cannot get them waits forever."""
    for address in (configured, environ_address, recorded):
        if address:
            return address
    raise ServiceError(
        f"cluster.ray_address: not set, RAY_ADDRESS is not set and there is no {state_file.absolute()}; "
        f"run `wildtrain up` to start the local services, or set cluster.ray_address "
        f"(or RAY_ADDRESS) to a running cluster"
    )


def ray_address(configured: Optional[str], state_dir: Path = DEFAULT_STATE_DIR) -> str:
    return choose_ray_address(configured, os.environ.get("RAY_ADDRESS"), _recorded_address(state_dir),
                              state_dir / "services.json")


def _recorded_address(state_dir: Path) -> Optional[str]:
    """The head `wildtrain up` started, if it did."""
    state_file = state_dir / "services.json"
    return json.loads(state_file.read_text())["ray_address"] if state_file.is_file() else None


def is_loopback(address: str) -> bool:
    return address.rsplit(":", 1)[0].strip("[]") in LOOPBACK_HOSTS


def prepare_ray_client(configured: Optional[str], state_dir: Path = DEFAULT_STATE_DIR) -> None:
    """Let this process reach the head the run will join where that is a loopback-only one
    or `wildtrain up`'s (which requires Ray's token authentication); call before Ray is
    imported, which reads both settings once. Where there is no head to join, the driver
    says so, after the checks a user should hear about first (data, MLflow)."""
    try:
        address = ray_address(configured, state_dir)
    except ServiceError:
        return
    if is_loopback(address):
        os.environ.update(LOOPBACK_ONLY_ENV)
    if address == _recorded_address(state_dir):
        os.environ.setdefault("RAY_AUTH_MODE", "token")


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
    # None in a services.json written before `up` gave the head a temp dir of its own.
    ray_temp_dir: Optional[str] = None
    ray_ports: dict = field(default_factory=dict)
    # The GPUs the head declared (`local_gpus`); None in a services.json written before `up`
    # declared them.
    num_gpus: Optional[int] = None


# Ports handed out by `free_port` (or claimed by `claim_ports`) in this process: the kernel
# often gives a port that was just released again at once, before whoever it was chosen for
# has bound it, so two services of one `up` would get the same one.
_handed_out: set[int] = set()


def claim_ports(ports) -> None:
    """Keep `free_port` from handing out `ports`, which are chosen already."""
    _handed_out.update(ports)


def free_port() -> int:
    for _ in range(100):
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise ServiceError(f"no free port on {HOST} that this process has not handed out already")


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


# MLflow's server starts a job runner with eight Huey consumer processes for its GenAI jobs
# (LLM judges, trace roll-ups), which wildtrain never submits: each imports MLflow, together
# about 40 s of CPU at every start and a gigabyte of memory for as long as the server runs.
MLFLOW_SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def start_mlflow(root: Path, port: int, timeout_s: float = 120.0) -> subprocess.Popen:
    """An MLflow tracking server on 127.0.0.1:`port`, storing runs in `root`."""
    root = private_dir(root.resolve())
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
        env={**os.environ, **MLFLOW_SERVER_ENV},
    )
    try:
        wait_healthy(f"http://{HOST}:{port}/health", process, log, timeout_s)
    except ServiceError:
        stop_process(process.pid)  # a server that came up late must not outlive the error
        raise
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
    root = private_dir(root.resolve())
    data_dir = private_dir(root / "data")
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


def token_command() -> str:
    """The command that prints the token of Ray's token authentication (`token_auth_env`), as
    a shell can run it: the `ray` beside this Python, by its path where PATH finds another
    (`make demo` runs .venv/bin/wildtrain from a shell without the venv)."""
    ours = ray_cli()
    return f"{'ray' if shutil.which('ray') == ours else ours} get-auth-token"


def uses_token_auth() -> bool:
    """Whether this process's Ray authenticates with a token (`prepare_ray_client`)."""
    return os.environ.get("RAY_AUTH_MODE") == "token"


def dashboard_text(url: str, token_auth: bool) -> str:
    """The dashboard's address as printed: under token authentication its sign-in asks for
    the token, so with the command that prints it; never the token itself, which would stay
    in terminals' scrollback, job logs and CI output."""
    return f"{url} (sign in with the token `{token_command()}` prints)" if token_auth else url


def token_auth_env() -> dict[str, str]:
    """The environment for Ray processes: token authentication, with a token generated in
    ~/.ray/auth_token if there is none (the dashboard and jobs API run arbitrary code for
    whoever reaches them), and this environment's bin/ first on PATH, so a job's `python`
    is the one wildtrain is installed in."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "RAY_AUTH_MODE": "token", "PATH": path}
    # Where Ray looks for a token, in its order. The CLI costs seconds of a 2-core machine's
    # CPU per call (a Ray import), so it runs only when there is none yet.
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


# The custom resource that conf/cluster/gpu.yaml's workers ask for, one per GPU: the launcher
# files give it to GPU nodes only, keeping workers off CPU-only heads.
TRAINER_RESOURCE = "trainer"


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
        ray_cli(), "start", "--head", "--disable-usage-stats",
        "--node-ip-address", HOST, "--port", str(ports.gcs),
        "--include-dashboard", "true", "--dashboard-host", HOST, "--dashboard-port", str(ports.dashboard),
        "--dashboard-agent-listen-port", str(ports.dashboard_agent),
        "--dashboard-agent-grpc-port", str(ports.dashboard_agent_grpc),
        "--runtime-env-agent-port", str(ports.runtime_env_agent),
        "--metrics-export-port", str(ports.metrics_export),
        "--ray-client-server-port", str(ports.client_server),
        "--node-manager-port", str(ports.node_manager),
        "--object-manager-port", str(ports.object_manager),
        # 0: ports the OS picks, instead of the 10002-19999 range every `ray start` shares.
        "--min-worker-port", "0", "--max-worker-port", "0",
        "--num-cpus", str(num_cpus), "--num-gpus", str(num_gpus), *trainer,
        "--system-config", json.dumps(NODE_HEALTH_CHECKS),
        # Its own temp dir: its sessions, sockets and discovery file apart from any other
        # Ray's, and what `stop_ray_head` finds its processes by.
        "--temp-dir", str(temp_dir),
    ]


def start_ray_head(ports: RayPorts, num_cpus: int, temp_dir: Path, env: dict[str, str] | None = None,
                   num_gpus: int = 0) -> str:
    """A Ray head on 127.0.0.1 only, with its dashboard and jobs API, token authentication
    on, its files under `temp_dir` (absolute and short: Ray's socket paths must fit 107
    bytes); `env` is added to the environment of its processes. Returns the GCS address."""
    metric_ports = {"AUTOSCALER_METRIC_PORT": str(ports.autoscaler_metrics),
                    "DASHBOARD_METRIC_PORT": str(ports.dashboard_metrics)}
    # Ray's own helpers that find "the" cluster without an address (Ray Train's placement
    # group cleaner asks the state API) pick the newest of all Ray instances on the machine
    # unless RAY_ADDRESS names theirs: beside a test cluster they removed the wrong group's
    # placement group. Every process of the head inherits its own address.
    own_address = {"RAY_ADDRESS": f"{HOST}:{ports.gcs}"}
    done = subprocess.run(ray_head_command(ports, num_cpus, temp_dir, num_gpus), capture_output=True, text=True,
                          env={**token_auth_env(), **LOOPBACK_ONLY_ENV, **metric_ports, **own_address, **(env or {})})
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
    the GCS and the autoscaler's monitor outlived SIGTERM by 20 s and more (Ray 2.60), where
    each wave alone exits within seconds."""
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


def private_dir(path: Path) -> Path:
    """`path` created readable by its owner only: it holds the user's data and keys."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)  # mkdir leaves an existing folder's mode as it was
    return path


def up(state_dir: Path = DEFAULT_STATE_DIR, ray_ports: RayPorts = RayPorts(), mlflow_port: int = 5000,
       num_cpus: int | None = None, object_store_port: int = 8333, bucket: str = "wildtrain",
       num_gpus: int | None = None) -> Services:
    """Start what is not running (see the module docstring); `num_gpus`: the GPUs the head
    declares, by default all that `local_gpus` finds."""
    state_file = state_dir / "services.json"
    if state_file.is_file():
        running = read_services(state_file)
        if (
            is_healthy(running.mlflow_url + "/health")
            and is_healthy(running.dashboard_url + "/api/version")
            and running.object_store is not None
            and is_healthy(running.object_store.endpoint + "/healthz")
        ):
            return running
        down(state_dir)
    private_dir(state_dir)
    claim_ports([mlflow_port, object_store_port, *(port for port in asdict(ray_ports).values() if port is not None)])
    # The store first: the Ray head's processes inherit its address and keys.
    store = start_object_store(state_dir / "objectstore", object_store_port, bucket)
    # Logical CPUs are a scheduling budget: leave room for Ray Data's tasks beside the
    # training workers even on a 2-core machine.
    num_cpus = num_cpus or max(4, os.cpu_count() or 1)
    num_gpus = local_gpus() if num_gpus is None else num_gpus
    ports = ray_ports.chosen()
    temp_dir = Path(tempfile.mkdtemp(prefix="wildtrain-ray-"))
    # MLflow's server and Ray's head need nothing of each other: each starts while the other does.
    with ThreadPoolExecutor(1) as pool:
        mlflow_starting = pool.submit(start_mlflow, state_dir / "mlflow", mlflow_port)
        try:
            ray_address = start_ray_head(ports, num_cpus, temp_dir, env=store.env(), num_gpus=num_gpus)
            mlflow = mlflow_starting.result()
        except ServiceError:
            stop_ray_head(temp_dir, f"{HOST}:{ports.gcs}")
            stop_process(store.pid)
            with contextlib.suppress(ServiceError):
                stop_process(mlflow_starting.result().pid)
            raise
    services = Services(
        ray_address=ray_address,
        dashboard_url=f"http://{HOST}:{ports.dashboard}",
        mlflow_url=f"http://{HOST}:{mlflow_port}",
        mlflow_pid=mlflow.pid,
        object_store=store,
        ray_temp_dir=str(temp_dir),
        ray_ports=asdict(ports),
        num_gpus=num_gpus,
    )
    state_file.touch(mode=0o600)
    state_file.write_text(json.dumps(asdict(services), indent=2))
    return services


def read_services(state_file: Path) -> Services:
    state = json.loads(state_file.read_text())
    store = state.pop("object_store", None)
    return Services(**state, object_store=ObjectStore(**store) if store else None)


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
    if not state_file.is_file():
        return
    running = read_services(state_file)
    stop_process(running.mlflow_pid)
    if running.object_store is not None:
        stop_process(running.object_store.pid)
    if running.ray_temp_dir is None:
        raise ServiceError(
            f"{state_file} was written by an older wildtrain and does not say which Ray processes are "
            f"its head ({running.ray_address}); stop it with `ray stop` (which stops every Ray cluster "
            f"of yours on this machine), then remove {state_file}"
        )
    stop_ray_head(Path(running.ray_temp_dir), running.ray_address)
    state_file.unlink()
