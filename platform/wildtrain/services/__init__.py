"""The embedded defaults a new user needs no cloud for: a local Ray head with its
dashboard, an MLflow server with a SQLite store and a SeaweedFS S3 object store, all bound
to 127.0.0.1.

`up` starts what is not already running and records the addresses in
`<state_dir>/services.json` (with the object store's keys, so readable by its owner only);
`down` stops what `up` started and nothing else: other Ray clusters on the machine (a test
suite's, another checkout's) keep running. The Ray head gets the object store's AWS_*
variables, so every job and worker on it reaches the store with no setup. Test fixtures use
the same `start_*` functions on free ports.

One module per service: `object_store` (SeaweedFS), `ray_head` (starting and stopping the
head), `mlflow_server`, `state` (`up`, `down` and services.json); `ray_client` is what a
process joining a cluster needs; `process` the ports, waits and stops they share. The
names below are the ones the rest of wildtrain, its tests and bench/ use.
"""

from wildtrain.services.mlflow_server import MLFLOW_SERVER_ENV, start_mlflow
from wildtrain.services.object_store import ObjectStore, start_object_store
from wildtrain.services.process import HOST, ServiceError, free_port, is_healthy, private_dir, stop_process
from wildtrain.services.ray_client import (
    choose_ray_address,
    connect_ray,
    dashboard_text,
    is_loopback,
    prepare_ray_client,
    ray_address,
    token_command,
    uses_token_auth,
)
from wildtrain.services.ray_head import (
    LOOPBACK_ONLY_ENV,
    NODE_HEALTH_CHECKS,
    RAY_METRICS_OFF,
    TRAINER_RESOURCE,
    RayPorts,
    local_gpus,
    ray_cli,
    ray_head_command,
    ray_head_processes,
    start_ray_head,
    stop_ray_head,
    token_auth_env,
)
from wildtrain.services.state import (
    DEFAULT_STATE_DIR,
    Services,
    down,
    read_services,
    recorded_address,
    up,
    use_local_object_store,
)

__all__ = [
    "DEFAULT_STATE_DIR",
    "HOST",
    "LOOPBACK_ONLY_ENV",
    "MLFLOW_SERVER_ENV",
    "NODE_HEALTH_CHECKS",
    "RAY_METRICS_OFF",
    "TRAINER_RESOURCE",
    "ObjectStore",
    "RayPorts",
    "ServiceError",
    "Services",
    "choose_ray_address",
    "connect_ray",
    "dashboard_text",
    "down",
    "free_port",
    "is_healthy",
    "is_loopback",
    "local_gpus",
    "prepare_ray_client",
    "private_dir",
    "ray_address",
    "ray_cli",
    "ray_head_command",
    "ray_head_processes",
    "read_services",
    "recorded_address",
    "start_mlflow",
    "start_object_store",
    "start_ray_head",
    "stop_process",
    "stop_ray_head",
    "token_auth_env",
    "token_command",
    "up",
    "use_local_object_store",
    "uses_token_auth",
]
