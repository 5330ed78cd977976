"""What `wildtrain submit` sends: the entrypoint a cluster runs and the runtime env it runs in."""

from __future__ import annotations

import shlex

import pytest

from tests.conftest import REPO
from wildtrain.clusters import jobs_api, registry
from wildtrain.clusters.submit import Command, job_spec
from wildtrain.config import ConfigError


@pytest.fixture
def clusters():
    return registry.load(REPO / "ray_clusters" / "clusters.yaml")


def test_entrypoint_trains_with_the_clusters_settings_then_the_users_and_an_explicit_run_name(clusters):
    spec = job_spec(clusters.get("coreweave"), ["experiment=tiny", "train.steps=7"], working_dir=REPO)
    args = shlex.split(spec.entrypoint)
    assert args[:5] == ["python", "-m", "wildtrain", "train", "cluster=gpu"]
    assert "cluster.name=coreweave" in args and "storage.endpoint=https://object.lga1.coreweave.com" in args
    assert args.index("storage.access_key_env=CW_ACCESS_KEY_ID") < args.index("train.steps=7")
    assert args[-1] == "run.name=tiny"  # the experiment's name, made explicit
    assert spec.config.cluster.name == "coreweave" and spec.config.train.steps == 7


def test_a_sweep_is_sent_as_its_own_command_with_the_clusters_settings_and_no_run_name(clusters):
    spec = job_spec(
        clusters.get("coreweave"),
        ["experiment=tiny"],
        working_dir=REPO,
        command=Command.of_sweep("abl", "--grid=optim.lr=1e-3,3e-3", "--steps=5"),
    )
    args = shlex.split(spec.entrypoint)
    assert args[:8] == [
        "python",
        "-m",
        "wildtrain",
        "sweep",
        "abl",
        "--grid=optim.lr=1e-3,3e-3",
        "--steps=5",
        "cluster=gpu",
    ]
    assert "cluster.name=coreweave" in args and args[-1] == "experiment=tiny"  # trials name themselves


def test_runtime_env_carries_working_dir_nccl_profile_and_hotfixes_but_no_secret(clusters, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-to-be-sent")
    cluster = clusters.get("aws-p5")
    env = job_spec(cluster, ["experiment=tiny"], working_dir=REPO).runtime_env
    assert env["working_dir"] == str(REPO)
    assert env["env_vars"]["FI_PROVIDER"] == "efa" and env["env_vars"]["NCCL_DEBUG"] == "WARN"
    assert env["env_vars"]["FI_EFA_USE_HUGE_PAGE"] == "0"  # the cluster's hotfix
    assert "not-to-be-sent" not in repr(env)


def test_a_bad_override_fails_before_anything_is_sent(clusters):
    with pytest.raises(ConfigError, match=r"^train.stepz: unknown key"):
        job_spec(clusters.get("local"), ["train.stepz=3"])


def test_a_missing_token_file_is_named_with_its_key(clusters, tmp_path):
    cluster = clusters.get("aws-p5")
    absent = registry.Cluster(cluster.name, cluster.entry, cluster.launcher, tmp_path / "none", {})
    with pytest.raises(
        jobs_api.ClusterError, match=r"^aws-p5: no token: clusters.aws-p5.token_file .*none does not exist"
    ):
        jobs_api.auth_headers(absent)
