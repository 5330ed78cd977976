"""A run sent to a Ray cluster that knows nothing of the object store (not `wildtrain up`'s
head, whose processes inherit its AWS_* variables): the driver knows the endpoint and keys
from its own environment only, as a user's shell does, and hands them to every process of
the run, which trains on that store."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import psutil
import pyarrow.fs as pafs
import pytest
from mlflow.tracking import MlflowClient

from tests.helpers.datasets import write_dataset
from tests.helpers.ray_clusters import start_cluster
from wildtrain import storage
from wildtrain.checkpoint.restore import newest_committed
from wildtrain.config import StorageConfig, load_config
from wildtrain.layout import RunLayout, checkpoint_stores

# Nothing timed, on a Ray of its own: `make test` runs it beside the drills.
pytestmark = [pytest.mark.integration, pytest.mark.untimed]

STORE_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


@pytest.fixture
def bare_cluster(monkeypatch):
    """A cluster of one worker and a CPU for the data reads, whose processes have no store
    variables: another cluster than `wildtrain up`'s, as far as the store goes."""
    for name in STORE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    cluster = start_cluster(monkeypatch.setenv, num_cpus=2)
    yield cluster
    cluster.shutdown()


def test_a_cluster_without_the_store_trains_on_the_one_the_driver_resolved(
    bare_cluster, object_store, mlflow_url, tmp_path, monkeypatch
):
    raylet = psutil.Process(bare_cluster.head_node.all_processes["raylet"][0].process.pid)
    assert not set(STORE_VARIABLES) & set(raylet.environ()), "the cluster must not know the store by itself"

    root = f"s3://{object_store.bucket}/handover-{tmp_path.name}"
    write_dataset(tmp_path / "data", [np.arange(64 * 129, dtype=np.int32).reshape(64, 129) % 250], rows_per_group=16)
    s3 = storage.s3_filesystem(
        object_store.endpoint, object_store.access_key, object_store.secret_key, StorageConfig.region, max_attempts=3
    )
    pafs.copy_files(str(tmp_path / "data"), f"{root}/data"[len("s3://") :], destination_filesystem=s3)

    overrides = [
        "experiment=tiny",
        f"data.datasets=[{{uri: {root}/data}}]",
        f"run.storage={root}/runs",
        f"run.name=handover-{os.getpid()}",
        f"tracking.uri={mlflow_url}",
        "tracking.experiment=integration",
        f"cluster.ray_address={bare_cluster.address}",
        "train.steps=4",
        "train.log_every=2",
        "checkpoint.every=2",
        "elastic.min_workers=1",
        "elastic.max_workers=1",
        # A worker that reaches another store (AWS, unreachable here) fails the run at once.
        "elastic.max_failures=0",
        "elastic.worker_start_timeout_s=300",
        "elastic.poll_interval_s=0.5",
    ]
    # The submitting shell: the store's endpoint and keys, this cluster's address.
    driver_env = {**os.environ, **object_store.env(), "RAY_ADDRESS": bare_cluster.address}
    done = subprocess.run(
        [sys.executable, "-m", "wildtrain", "train", *overrides],
        cwd=tmp_path,
        env=driver_env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert f"run 'handover-{os.getpid()}' finished" in done.stdout

    # The workers wrote their checkpoints to that store.
    for name, value in object_store.env().items():
        monkeypatch.setenv(name, value)
    cfg = load_config(overrides)
    newest = newest_committed(checkpoint_stores(RunLayout.of(cfg.run, cfg.checkpoint), cfg.storage))
    assert newest is not None and newest.manifest.step == 4
    # The keys went to the run's processes, and nowhere a user reads.
    client = MlflowClient(mlflow_url)
    (run,) = client.search_runs(
        [client.get_experiment_by_name("integration").experiment_id], f"attributes.run_name = '{cfg.run.name}'"
    )
    shown = [done.stdout, done.stderr, *run.data.params.values()]
    assert not any(object_store.secret_key in text or object_store.access_key in text for text in shown)
