"""Shared services for the integration tests: one MLflow server, one Ray cluster
(`ray.cluster_utils.Cluster`, with its dashboard and jobs API) and one SeaweedFS object store
per session, on 127.0.0.1 and free ports, torn down at the end."""

from __future__ import annotations

import os

import pytest
import ray

from wildtrain import services
from tests.conftest import REPO
from tests.helpers.chaos import HEAD_SLOT
from tests.helpers.ray_clusters import start_cluster
from wildtrain.config import load_config
from wildtrain.data.prepare import PrepareConfig, prepare

# Logical CPUs of the head: two training workers and one for Ray Data's tasks. Tests that
# need several nodes add them and remove them again: fake nodes share one session folder,
# and a job's working directory unpacked there is deleted by whichever node's runtime-env
# agent lets go of it first, which a real multi-node cluster never does.
HEAD_CPUS = 3
# As `make demo` prepares the tiny corpus.
VAL_FRACTION = 0.05


@pytest.fixture(scope="session")
def mlflow_url(tmp_path_factory) -> str:
    port = services.free_port()
    server = services.start_mlflow(tmp_path_factory.mktemp("mlflow"), port)
    yield f"http://{services.HOST}:{port}"
    services.stop_process(server.pid)


@pytest.fixture(scope="session")
def object_store(tmp_path_factory) -> services.ObjectStore:
    """An S3 endpoint with the bucket `wildtrain-test`; `object_store.env()` points a client at it."""
    store = services.start_object_store(tmp_path_factory.mktemp("objectstore"), services.free_port(), "wildtrain-test")
    yield store
    services.stop_process(store.pid)


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory, object_store):
    # Raylets and so every worker and Ray Data task inherit the store's AWS_* variables,
    # as on a head started by `wildtrain up`; so does this process (the driver).
    os.environ.update(object_store.env())
    cluster = start_cluster(os.environ.__setitem__, HEAD_CPUS, {HEAD_SLOT: HEAD_CPUS})
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="session")
def tiny_dataset(ray_cluster, object_store) -> str:
    """The bundled tiny corpus, prepared once into the object store, as `make demo` does:
    with documents held out for validation."""
    uri = f"s3://{object_store.bucket}/datasets/tiny"
    prepare(PrepareConfig(input=str(REPO / "tests/assets/tiny_corpus.jsonl"), output=uri, rows_per_group=128,
                          val_fraction=VAL_FRACTION))
    return uri


@pytest.fixture
def tiny_overrides(tmp_path, mlflow_url, tiny_dataset) -> list[str]:
    """A few-step tiny run that reads the prepared tiny corpus and writes only under this
    test's tmp_path."""
    return [
        "experiment=tiny",
        f"data.datasets=[{{uri: {tiny_dataset}}}]",
        f"run.name=test-{os.getpid()}-{tmp_path.name}",
        f"run.storage={tmp_path / 'runs'}",
        f"tracking.uri={mlflow_url}",
        "tracking.experiment=integration",
        "train.steps=8",
        "train.log_every=2",
        "checkpoint.every=4",
        "elastic.worker_start_timeout_s=20",
        # How soon the controller notices a failed worker and logs a report: tests wait on both.
        "elastic.poll_interval_s=0.5",
    ]


@pytest.fixture
def tiny_config(tiny_overrides):
    return lambda *extra: load_config([*tiny_overrides, *extra])
