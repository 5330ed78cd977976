"""The registry of clusters and the files it points at: every launcher YAML as Ray itself
validates it, every KubeRay manifest with the keys our security, elasticity, checkpoints
(/dev/shm) and fabric (InfiniBand, GPUDirect-TCPXO) rely on, and a registry with mistakes
refused naming the key."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from tests.conftest import REPO
from wildtrain.checkpoint.shm import capture_bytes, shm_needed
from wildtrain.clusters import registry
from wildtrain.config import ConfigError, load_config
from wildtrain.model import param_count

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
    starts = [
        c for c in prepared["head_start_ray_commands"] + prepared["worker_start_ray_commands"] if "ray start" in c
    ]
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


def worker_groups(manifest: dict) -> list[dict]:
    spec = manifest["spec"]["rayClusterSpec"] if manifest["kind"] == "RayJob" else manifest["spec"]
    return spec["workerGroupSpecs"]


def container(containers: list[dict], name: str) -> dict:
    (found,) = [c for c in containers if c["name"] == name]
    return found


def mounted(pod: dict, mount: dict) -> dict:
    """The volume behind a container's `mount`."""
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return volume


def quantity(value) -> int:
    """A Kubernetes quantity in bytes: 600Gi, 64Mi, 1000."""
    number, unit = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", str(value)).groups()
    return int(number) * 1024 ** (1 + ["Ki", "Mi", "Gi", "Ti"].index(unit) if unit else 0)


# The largest presets a pod of 8 H100 80GB trains, at the stage each needs: 21b only under
# ZeRO-3 (under ZeRO-1/2 its bf16 weights and gradients alone, 4 bytes a parameter, are 84 GB
# per GPU); 7b under any, ZeRO-1 putting the whole module's weights on rank 0's pod.
LARGEST = [("21b", 3), ("7b", 1)]
# What a pod's memory limit keeps beside /dev/shm, per rank: its trainer, save process, data workers.
PROCESS_MEMORY_PER_RANK = 32 * 2**30


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_kuberay_workers_have_a_memory_dev_shm_that_holds_the_checkpoint_copies(path):
    """The save process reads each rank's host copy of its checkpoint from /dev/shm (64 MiB in
    a container without a volume there): at the smallest size, where a pod holds the largest
    share, twice (checkpoint/shm.py), beside Ray's object store, within the memory limit."""
    for group in worker_groups(yaml.safe_load(path.read_text())):
        pod = group["template"]["spec"]
        worker = container(pod["containers"], "ray-worker")
        (shm,) = [mounted(pod, m) for m in worker["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        assert shm["emptyDir"]["medium"] == "Memory"
        size = quantity(shm["emptyDir"]["sizeLimit"])
        # Fixed: Ray's default takes min(30% of the memory, 200 GB) of /dev/shm once it is large.
        object_store = int(group["rayStartParams"]["object-store-memory"])
        gpus = worker["resources"]["limits"]["nvidia.com/gpu"]
        smallest = group["minReplicas"] * gpus
        for preset, stage in LARGEST:
            n = param_count(load_config([f"model={preset}"]).model)
            needed = shm_needed(capture_bytes(n, 2, stage, smallest, rank) for rank in range(gpus))  # rank 0's pod
            assert needed + object_store <= size, f"{preset} ZeRO-{stage}: {needed + object_store:,} bytes > {size:,}"
        # What fills /dev/shm counts against the pod's memory limit.
        memory = quantity(worker["resources"]["limits"]["memory"])
        assert memory - size >= gpus * PROCESS_MEMORY_PER_RANK, (memory, size)


def test_coreweave_workers_are_on_the_infiniband_fabric():
    manifest = yaml.safe_load((CLUSTERS / "kuberay" / "raycluster-coreweave.yaml").read_text())
    for group in worker_groups(manifest):
        worker = container(group["template"]["spec"]["containers"], "ray-worker")
        # CoreWeave schedules a pod on an InfiniBand node, its HCAs in the pod, for rdma/ib.
        assert worker["resources"]["limits"]["rdma/ib"] == worker["resources"]["requests"]["rdma/ib"] == 1
        # The verbs lock the buffers NCCL registers with the HCAs.
        assert "IPC_LOCK" in worker["securityContext"]["capabilities"]["add"]


GKE = [CLUSTERS / "kuberay" / "raycluster-gke.yaml", CLUSTERS / "kuberay" / "rayjob-gke.yaml"]


@pytest.mark.parametrize("path", GKE, ids=lambda p: p.name)
def test_gke_workers_carry_what_the_tcpxo_profile_expects(path):
    """GPUDirect-TCPXO without hostNetwork, as GKE's guide sets it up: the NICs the `tcpxo`
    NCCL profile names, the tcpxo-daemon sidecar with its devices, and the node's NCCL plugin
    where the profile's paths point."""
    profile = registry.read_nccl_profile(CLUSTERS / "nccl", "tcpxo", "tcpxo")
    for group in worker_groups(yaml.safe_load(path.read_text())):
        template = group["template"]
        pod, annotations = template["spec"], template["metadata"]["annotations"]
        assert pod.get("hostNetwork", False) is False
        nics = json.loads(annotations["networking.gke.io/interfaces"])
        assert [n["interfaceName"] for n in nics] == [
            profile["NCCL_FASTRAK_CTRL_DEV"],
            *profile["NCCL_FASTRAK_IFNAME"].split(","),
        ]
        assert len({n["network"] for n in nics}) == len(nics) == 9
        assert annotations["networking.gke.io/default-interface"] == profile["NCCL_SOCKET_IFNAME"]

        daemon = container(pod["initContainers"], "tcpxo-daemon")
        assert daemon["restartPolicy"] == "Always"  # a sidecar: up before Ray, down with the pod
        assert {"NET_ADMIN", "NET_BIND_SERVICE"} <= set(daemon["securityContext"]["capabilities"]["add"])
        assert "privileged" not in daemon["securityContext"]
        gpus = container(pod["containers"], "ray-worker")["resources"]["limits"]["nvidia.com/gpu"]
        devices = {d["path"] for d in yaml.safe_load(annotations["devices.gke.io/container.tcpxo-daemon"])}
        assert devices == {f"/dev/nvidia{i}" for i in range(gpus)} | {
            "/dev/nvidiactl",
            "/dev/nvidia-uvm",
            "/dev/dmabuf_import_helper",
        }
        host = {m["mountPath"]: mounted(pod, m)["hostPath"]["path"] for m in daemon["volumeMounts"]}
        assert host == {
            "/usr/local/nvidia/lib64": "/home/kubernetes/bin/nvidia/lib64",
            "/hostsysfs": "/sys",
            "/hostprocsysfs": "/proc/sys",
        }

        worker = container(pod["containers"], "ray-worker")
        host = {m["mountPath"]: mounted(pod, m).get("hostPath", {}).get("path") for m in worker["volumeMounts"]}
        # The NCCL core, FasTrak plugin and tuner configs the nccl-tcpxo-installer put on the node.
        assert host[profile["LD_LIBRARY_PATH"]] == "/home/kubernetes/bin/nvidia/lib64"
        assert profile["NCCL_TUNER_CONFIG_PATH"].startswith(profile["LD_LIBRARY_PATH"] + "/")
        env = {e["name"]: e["value"] for e in worker["env"]}
        assert host[env["NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY"]] == "/dev/aperture_devices"


def test_the_rayjob_runs_the_gke_clusters_workers_with_its_nccl_profile():
    """A RayJob does not go through `wildtrain submit`, which sends the NCCL profile with each job."""
    cluster, job = (yaml.safe_load(path.read_text()) for path in GKE)
    assert worker_groups(job) == worker_groups(cluster)
    env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]
    assert env == registry.read_nccl_profile(CLUSTERS / "nccl", "tcpxo", "tcpxo")


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
    cfg = load_config(
        registry.expand(["experiment=tiny", "cluster=aws-p5", "train.steps=3", "run.storage=s3://elsewhere/runs"], path)
    )
    assert cfg.cluster.name == "aws-p5" and cfg.cluster.use_gpu
    assert cfg.cluster.peak_flops_per_device == pytest.approx(989.4e12)
    assert cfg.storage.region == "us-east-2" and cfg.run.storage == "s3://elsewhere/runs"
    # A conf/cluster/ file that is no registry entry stays a config group choice.
    assert registry.expand(["cluster=gpu"], path) == ["cluster=gpu"]


def registry_with(tmp_path: Path, entry: str) -> Path:
    shutil.copytree(CLUSTERS / "nccl", tmp_path / "nccl")
    (tmp_path / "launch.yaml").write_text("cluster_name: x\n")
    path = tmp_path / "clusters.yaml"
    base = {
        "provider": "local",
        "launcher": "launch.yaml",
        "jobs_api": "http://127.0.0.1:1",
        "token_file": "token",
        "storage": {"runs": "s3://b/runs", "data": "s3://b/data"},
    }
    path.write_text(yaml.safe_dump({"clusters": {"a": {**base, **yaml.safe_load(entry)}}}))
    return path


@pytest.mark.parametrize(
    "entry, message",
    [
        ("storage: {runs: s3://b/runs, data: s3://b/data, endpont: x}", "clusters.a.storage.endpont: unknown key"),
        (
            "accelerator: {per_node: eight}",
            "clusters.a.accelerator.per_node: Value 'eight' of type 'str' could not be converted to Integer",
        ),
        ("launcher: missing.yaml", "clusters.a.launcher: no such file"),
        ("nccl: {profile: myrinet}", "clusters.a.nccl.profile: no such profile"),
        ("provider: azure", "clusters.a.provider: 'azure' is not one of local, aws, gcp, kubernetes"),
        ("sync_bwlimit: fast", "clusters.a.sync_bwlimit: 'fast' is not a rate"),
        ("cluster_config: tpu", "clusters.a.cluster_config: no such file conf/cluster/tpu.yaml"),
    ],
)
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
