"""The driver's choice of device against a real Ray cluster: the session's CPU-only test
cluster, and the same with a node declaring a GPU it does not have (Ray takes declared GPUs
at their word, as it takes the count `wildtrain up` declares). Nothing trains on it: there
is no CUDA here, so the tests stop once the driver has decided and waited for capacity."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
import ray

from tests.helpers.datasets import write_dataset
from wildtrain import driver, services
from wildtrain.config import load_config
from wildtrain.elastic import scaling

pytestmark = pytest.mark.integration


def _wait(holds, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not holds():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g} s"
        time.sleep(0.2)


@pytest.fixture
def gpu_node(ray_cluster):
    """A node offering what `wildtrain up` declares on a machine with one GPU."""
    node = ray_cluster.add_node(num_cpus=2, num_gpus=1, resources={services.TRAINER_RESOURCE: 1})
    ray_cluster.wait_for_nodes()
    _wait(lambda: ray.cluster_resources().get("GPU") == 1, "GPU in the cluster's resources")
    yield
    ray_cluster.remove_node(node)
    _wait(lambda: "GPU" not in ray.cluster_resources(), "GPU gone from the cluster's resources")


def config(*extra: str):
    return load_config(["experiment=tiny", "elastic.capacity_wait_s=5", *extra])


def test_unset_trains_on_the_gpus_the_cluster_offers_and_cpu_takes_an_explicit_false(gpu_node, capsys):
    cfg = driver.resolve_device(config())
    assert cfg.cluster.use_gpu is True
    scaling.wait_for_capacity(
        cfg.cluster, cfg.elastic, cfg.data, cfg.eval
    )  # a worker's GPU and CPU, and a CPU for the data: there
    # cluster=gpu: workers only where `trainer` is offered, as `wildtrain up` now offers it.
    cfg = driver.resolve_device(config("cluster=gpu", "cluster.cpus_per_worker=1"))
    scaling.wait_for_capacity(cfg.cluster, cfg.elastic, cfg.data, cfg.eval)
    assert capsys.readouterr().out == "", "nothing to say"

    cfg = driver.resolve_device(config("cluster.use_gpu=false"))
    assert cfg.cluster.use_gpu is False
    assert capsys.readouterr().out == "cluster.use_gpu=false: training on CPU, beside the cluster's 1 GPU\n"


def test_unset_on_a_cluster_without_gpus_trains_on_cpu(ray_cluster):
    cfg = driver.resolve_device(config())
    assert cfg.cluster.use_gpu is False and scaling.worker_env(cfg.cluster, cfg.elastic) == {"DS_ACCELERATOR": "cpu"}


def test_use_gpu_true_without_gpus_exits_2_naming_the_key_after_the_wait(ray_cluster, mlflow_url, tmp_path):
    assert "GPU" not in ray.cluster_resources()
    dataset = tmp_path / "data"
    write_dataset(dataset, [np.zeros((32, 129), dtype=np.int32)], rows_per_group=16)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "wildtrain",
            "train",
            f"tracking.uri={mlflow_url}",
            f"run.storage={tmp_path / 'runs'}",
            f"data.datasets=[{{uri: {dataset}}}]",
            "cluster.use_gpu=true",
            "elastic.capacity_wait_s=2",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "wildtrain: cluster.use_gpu: true, but the cluster has offered no GPU for 2 s; " in done.stderr
    assert "Traceback" not in done.stderr
