"""Shared services for the integration tests: one MLflow server, one Ray cluster
(`ray.cluster_utils.Cluster`, with its dashboard and jobs API) and one SeaweedFS object store
per session, on 127.0.0.1 and free ports, torn down at the end."""

from __future__ import annotations

import os
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import pytest
import ray

from tests.conftest import REPO
from tests.helpers.chaos import HEAD_SLOT, UNINTERRUPTED, UNINTERRUPTED_PACE, BackgroundRun
from tests.helpers.ray_clusters import start_cluster
from wildtrain import services
from wildtrain.config import load_config
from wildtrain.data.prepare import PrepareConfig, prepare

# Logical CPUs of the head: two training workers and one for Ray Data's tasks. Tests that
# need several nodes add them and remove them again: fake nodes share one session folder,
# and a job's working directory unpacked there is deleted by whichever node's runtime-env
# agent lets go of it first, which a real multi-node cluster never does.
HEAD_CPUS = 3
# As `make demo` prepares the tiny corpus.
VAL_FRACTION = 0.05


_mlflow_starting: Optional[Future] = None


def pytest_collection_finish(session) -> None:
    """Start the session's MLflow server as soon as a selected test needs it: it takes ~30 s
    to become healthy here, which the object store's and the Ray clusters' starts overlap."""
    global _mlflow_starting
    if any("mlflow_url" in item.fixturenames for item in session.items):
        root = Path(tempfile.mkdtemp(prefix="wildtrain-test-mlflow-"))
        port = services.free_port()
        pool = ThreadPoolExecutor(1)
        _mlflow_starting = pool.submit(lambda: (services.start_mlflow(root, port), root, port))
        pool.shutdown(wait=False)  # the fixture waits for the start, not collection


def pytest_sessionfinish(session) -> None:
    """Stop it whether or not a test used it (the tests that would have may have skipped)."""
    if _mlflow_starting is not None and _mlflow_starting.exception() is None:
        server, root, _ = _mlflow_starting.result()
        services.stop_process(server.pid)
        shutil.rmtree(root, ignore_errors=True)


# `make test` runs the drills beside the rest of the suite (at nice 19), which ends 12-15
# minutes in, before them. Each drill's time there against alone (a CI here, a run alone):
# those whose time goes to starting many processes at once, two Ray clusters (the move, 1.6x)
# or spares and joiners on fake nodes (1.5x), ran longest; those that wait on the clock
# (outages, sweeps, a second driver: 1.0-1.1x) hardly longer. So those modules go last, where
# the machine is mostly theirs; the others keep pytest's order.
RUN_LAST = ("test_elastic.py", "test_clusters.py")


def pytest_collection_modifyitems(config, items) -> None:
    items.sort(key=lambda item: RUN_LAST.index(item.path.name) + 1 if item.path.name in RUN_LAST else 0)


@pytest.fixture(scope="session")
def mlflow_url() -> str:
    assert _mlflow_starting is not None, "pytest_collection_finish starts MLflow for the tests that use it"
    _, _, port = _mlflow_starting.result()
    return f"http://{services.HOST}:{port}"


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
    prepare(
        PrepareConfig(
            input=str(REPO / "tests/assets/tiny_corpus.jsonl"),
            output=uri,
            rows_per_group=128,
            val_fraction=VAL_FRACTION,
        )
    )
    return uri


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory, mlflow_url, tiny_dataset) -> BackgroundRun:
    """UNINTERRUPTED's training, never moved nor resized: one worker on the head, off the nodes
    tests add and remove. Started by the first test that asks for it and shared: each test
    joins it for the losses its own run must reproduce (a run start less for each after the first)."""
    return BackgroundRun(
        load_config(
            [
                "experiment=tiny",
                f"data.datasets=[{{uri: {tiny_dataset}}}]",
                f"run.name=uninterrupted-{os.getpid()}",
                f"run.storage={tmp_path_factory.mktemp('uninterrupted') / 'runs'}",
                f"tracking.uri={mlflow_url}",
                "tracking.experiment=integration",
                f"cluster.worker_resources.{HEAD_SLOT}=1",
                "elastic.max_workers=1",
                *UNINTERRUPTED,
            ]
        ),
        pace=UNINTERRUPTED_PACE,
    )


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
