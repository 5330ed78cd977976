"""The registry of clusters and the files it points at: every launcher YAML as Ray itself
validates it, every KubeRay manifest with the keys our security and elasticity rely on, and
a registry with mistakes refused naming the key."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from tests.conftest import REPO
from wildtrain.clusters import registry
from wildtrain.config import ConfigError, load_config

CLUSTERS = REPO / "ray_clusters"
LAUNCHERS = sorted(p for p in CLUSTERS.glob("*.yaml") if p.name != "clusters.yaml")
MANIFESTS = sorted((CLUSTERS / "kuberay").glob("*.yaml"))


@pytest.mark.parametrize("path", LAUNCHERS, ids=lambda p: p.name)
def test_launcher_yaml_passes_rays_own_validation_and_is_secure_by_default(path):
    config = yaml.safe_load(path.read_text())
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    (head_start,) = [c for c in prepared["head_start_ray_commands"] if "ray start" in c]
    assert "--dashboard-host=127.0.0.1" in head_start and "0.0.0.0" not in head_start
    starts = [c for c in prepared["head_start_ray_commands"] + prepared["worker_start_ray_commands"] if "ray start" in c]
    assert all("RAY_AUTH_MODE=token ray start" in c for c in starts), starts
    if prepared["provider"]["type"] != "local" or prepared["provider"]["head_ip"] != "127.0.0.1":
        # The token reaches every node by file, never in the YAML.
        assert "~/.ray/auth_token" in prepared["file_mounts"]


def test_there_is_a_launcher_per_provider():
    providers = {yaml.safe_load(p.read_text())["provider"]["type"] for p in LAUNCHERS}
    assert providers == {"aws", "gcp", "local"}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_kuberay_manifest_has_token_auth_a_local_dashboard_and_an_elastic_range(path):
    manifest = yaml.safe_load(path.read_text())
    assert manifest["apiVersion"] == "ray.io/v1"
    spec = manifest["spec"]["rayClusterSpec"] if manifest["kind"] == "RayJob" else manifest["spec"]
    if manifest["kind"] == "RayJob":
        assert manifest["spec"]["entrypoint"].startswith("python -m wildtrain train ")
        # Only a submitter inside the head pod reaches a jobs API bound to 127.0.0.1.
        assert manifest["spec"]["submissionMode"] == "SidecarMode"
    assert spec["authOptions"]["mode"] == "token"
    assert spec["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    assert spec["enableInTreeAutoscaling"] is True
    for group in spec["workerGroupSpecs"]:
        assert 1 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


def test_the_shipped_registry_loads_and_every_nccl_profile_warns_only():
    clusters = registry.load(CLUSTERS / "clusters.yaml").clusters
    assert {"local", "aws-p5", "gcp-a3mega", "coreweave"} <= set(clusters)
    assert clusters["local"].job_env() == {}
    coreweave = clusters["coreweave"].job_env()
    assert coreweave["NCCL_IB_HCA"] == "mlx5" and "NCCL_IB_GID_INDEX" not in coreweave  # "" unsets
    for profile in (CLUSTERS / "nccl").glob("*.yaml"):
        assert registry.read_nccl_profile(profile.parent, profile.stem, "k")["NCCL_DEBUG"] == "WARN"
    gcp = clusters["gcp-a3mega"]
    assert gcp.job_env()["NCCL_FASTRAK_IFNAME"].startswith("eth1,")


def test_cluster_name_on_train_selects_the_entry_and_user_overrides_win():
    path = CLUSTERS / "clusters.yaml"
    cfg = load_config(registry.expand(["experiment=tiny", "cluster=aws-p5", "train.steps=3",
                                       "run.storage=s3://elsewhere/runs"], path))
    assert cfg.cluster.name == "aws-p5" and cfg.cluster.use_gpu
    assert cfg.cluster.peak_flops_per_device == pytest.approx(989.4e12)
    assert cfg.storage.region == "us-east-2" and cfg.run.storage == "s3://elsewhere/runs"
    # A conf/cluster/ file that is no registry entry stays a config group choice.
    assert registry.expand(["cluster=gpu"], path) == ["cluster=gpu"]


def registry_with(tmp_path: Path, entry: str) -> Path:
    shutil.copytree(CLUSTERS / "nccl", tmp_path / "nccl")
    (tmp_path / "launch.yaml").write_text("cluster_name: x\n")
    path = tmp_path / "clusters.yaml"
    base = {"provider": "local", "launcher": "launch.yaml", "jobs_api": "http://127.0.0.1:1", "token_file": "token",
            "storage": {"runs": "s3://b/runs", "data": "s3://b/data"}}
    path.write_text(yaml.safe_dump({"clusters": {"a": {**base, **yaml.safe_load(entry)}}}))
    return path


@pytest.mark.parametrize("entry, message", [
    ("storage: {runs: s3://b/runs, data: s3://b/data, endpont: x}", "clusters.a.storage.endpont: unknown key"),
    ("accelerator: {per_node: eight}", "clusters.a.accelerator.per_node: Value 'eight' of type 'str' could not be converted to Integer"),
    ("launcher: missing.yaml", "clusters.a.launcher: no such file"),
    ("nccl: {profile: myrinet}", "clusters.a.nccl.profile: no such profile"),
    ("provider: azure", "clusters.a.provider: 'azure' is not one of local, aws, gcp, kubernetes"),
    ("sync_bwlimit: fast", "clusters.a.sync_bwlimit: 'fast' is not a rate"),
    ("cluster_config: tpu", "clusters.a.cluster_config: no such file conf/cluster/tpu.yaml"),
])
def test_registry_mistakes_name_the_key(tmp_path, entry, message):
    path = registry_with(tmp_path, entry)
    with pytest.raises(ConfigError) as e:
        registry.load(path)
    assert str(e.value).startswith(f"{path}: ")
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_registry_and_unknown_cluster_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="clusters: no such file .*nope.yaml"):
        registry.load(tmp_path / "nope.yaml")
    path = registry_with(tmp_path, "sync_bwlimit: 10M")
    with pytest.raises(ConfigError, match=r"clusters\.b: no such cluster \(known: a\)"):
        registry.load(path).get("b")
