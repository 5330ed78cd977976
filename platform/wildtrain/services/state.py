"""`wildtrain up` and `down`, and the state file between them: `<state_dir>/services.json`,
which records the running services' addresses, processes and the object store's keys."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from wildtrain.services.mlflow_server import start_mlflow
from wildtrain.services.object_store import ObjectStore, start_object_store
from wildtrain.services.process import HOST, ServiceError, claim_ports, is_healthy, private_dir, stop_process
from wildtrain.services.ray_head import RayPorts, local_gpus, start_ray_head, stop_ray_head

DEFAULT_STATE_DIR = Path(".wildtrain")


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


def read_services(state_file: Path) -> Services:
    state = json.loads(state_file.read_text())
    store = state.pop("object_store", None)
    return Services(**state, object_store=ObjectStore(**store) if store else None)


def recorded_address(state_dir: Path) -> Optional[str]:
    """The head `wildtrain up` started, if it did."""
    state_file = state_dir / "services.json"
    return json.loads(state_file.read_text())["ray_address"] if state_file.is_file() else None


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


def up(
    state_dir: Path = DEFAULT_STATE_DIR,
    ray_ports: RayPorts = RayPorts(),
    mlflow_port: int = 5000,
    num_cpus: int | None = None,
    object_store_port: int = 8333,
    bucket: str = "wildtrain",
    num_gpus: int | None = None,
) -> Services:
    """Start what is not running (see the package's docstring); `num_gpus`: the GPUs the head
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
