"""The registry of clusters (ray_clusters/clusters.yaml): one typed entry per cluster, with
what a run there needs that the run's own config does not say (where its jobs API and token
are, its accelerators, its stores, its NCCL profile and hotfixes).

Loading fails with one `ConfigError` line naming the file and the key's full path: an
unknown key, a wrong type, a launcher file or NCCL profile that does not exist.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from wildtrain.config import PACKAGE_CONF_DIR, ConfigError, StorageConfig

PROVIDERS = ("local", "aws", "gcp", "kubernetes")
# rclone's --bwlimit syntax: bytes per second with an optional binary suffix (B, K, M, G).
BWLIMIT = re.compile(r"\d+(\.\d+)?[BKMG]?")
NCCL_DIR = "nccl"  # beside the registry file: one <profile>.yaml of NAME: value per fabric
REGISTRY_ENV = "WILDTRAIN_CLUSTERS"


@dataclass
class AcceleratorConfig:
    type: str = "cpu"
    per_node: int = 0
    # Peak FLOP/s of one device, for MFU (cluster.peak_flops_per_device); None: by device name.
    peak_flops: Optional[float] = None


@dataclass
class ClusterStorageConfig(StorageConfig):
    """The cluster's stores: StorageConfig's endpoint and key variables, plus where runs and
    prepared datasets live there."""

    runs: str = MISSING
    data: str = MISSING


@dataclass
class NcclConfig:
    # A file of ray_clusters/nccl/ (efa, tcpx, tcpxo, ib); None: no NCCL (CPU clusters).
    profile: Optional[str] = None
    # Values that win over the profile's on this cluster; "" unsets one.
    overrides: dict[str, str] = field(default_factory=dict)


@dataclass
class HotfixConfig:
    """What this cluster needs that others do not: environment variables of every process of
    the job, and runtime_env keys (pip, excludes, ...) merged into the job's runtime env."""

    env: dict[str, str] = field(default_factory=dict)
    runtime_env: dict[str, Any] = field(default_factory=dict)


@dataclass
class ClusterEntry:
    provider: str = MISSING
    # The Ray cluster launcher YAML or KubeRay manifest that brings the cluster up.
    launcher: str = MISSING
    # The jobs API (the dashboard's HTTP address), as reached from here: an SSH tunnel or
    # `kubectl port-forward` to the head's 127.0.0.1.
    jobs_api: str = MISSING
    # The file holding the cluster's Ray auth token; never the token itself.
    token_file: str = MISSING
    # The conf/cluster/ file a run there starts from.
    cluster_config: str = "local"
    accelerator: AcceleratorConfig = field(default_factory=AcceleratorConfig)
    storage: ClusterStorageConfig = field(default_factory=ClusterStorageConfig)
    nccl: NcclConfig = field(default_factory=NcclConfig)
    # Bytes per second a `wildtrain sync` out of or into this cluster's store may use by
    # default (rclone syntax: 50M), so a bulk copy leaves the training reads their share.
    sync_bwlimit: Optional[str] = None
    hotfix: HotfixConfig = field(default_factory=HotfixConfig)


@dataclass
class RegistryFile:
    clusters: dict[str, ClusterEntry] = field(default_factory=dict)


@dataclass(frozen=True)
class Cluster:
    """One entry, with its paths resolved and its NCCL environment read."""

    name: str
    entry: ClusterEntry
    launcher: Path
    token_file: Path
    nccl_env: dict[str, str]

    @property
    def key(self) -> str:
        return f"clusters.{self.name}"

    def job_env(self) -> dict[str, str]:
        """The environment every process of a job there gets: the NCCL profile with its
        overrides (an empty override unsets), then the hotfixes."""
        env = {**self.nccl_env, **self.entry.nccl.overrides}
        return {k: v for k, v in env.items() if v != ""} | dict(self.entry.hotfix.env)

    def run_overrides(self) -> list[str]:
        """The config overrides that make a run belong to this cluster (its name on MLflow's
        report cards and events, its peak FLOP/s for MFU, its stores); the user's own
        overrides come after them and win."""
        accelerator, store = self.entry.accelerator, self.entry.storage
        overrides = [
            f"cluster={self.entry.cluster_config}",
            f"cluster.name={self.name}",
            f"run.storage={store.runs}",
            f"storage.region={store.region}",
            f"storage.access_key_env={store.access_key_env}",
            f"storage.secret_key_env={store.secret_key_env}",
        ]
        if store.endpoint:
            overrides.append(f"storage.endpoint={store.endpoint}")
        if accelerator.peak_flops is not None:
            overrides.append(f"cluster.peak_flops_per_device={accelerator.peak_flops}")
        return overrides


@dataclass(frozen=True)
class Registry:
    path: Path
    clusters: dict[str, Cluster]

    def get(self, name: str) -> Cluster:
        if name not in self.clusters:
            known = ", ".join(sorted(self.clusters)) or "none"
            raise ConfigError(f"{self.path}: clusters.{name}: no such cluster (known: {known})")
        return self.clusters[name]


def default_path() -> Path:
    """$WILDTRAIN_CLUSTERS, else ray_clusters/clusters.yaml of the current directory, else the checkout's."""
    if os.environ.get(REGISTRY_ENV):
        return Path(os.environ[REGISTRY_ENV])
    local = Path.cwd() / "ray_clusters" / "clusters.yaml"
    return local if local.is_file() else PACKAGE_CONF_DIR.parent / "ray_clusters" / "clusters.yaml"


def load(path: Optional[Path] = None) -> Registry:
    path = Path(path or default_path())
    if not path.is_file():
        raise ConfigError(f"clusters: no such file {path} (set {REGISTRY_ENV} or pass --registry)")
    try:
        raw = OmegaConf.load(path)
        typed = OmegaConf.merge(OmegaConf.structured(RegistryFile), raw)
        parsed: RegistryFile = OmegaConf.to_object(typed)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "clusters"
        reason = str(e).splitlines()[0]
        if "Key" in reason and "not in" in reason:
            reason = "unknown key"
        raise ConfigError(f"{path}: {key}: {reason}") from None
    except Exception as e:  # YAML syntax: the parser's own message says where
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    return Registry(path, {name: _resolve(path, name, entry) for name, entry in parsed.clusters.items()})


def _resolve(path: Path, name: str, entry: ClusterEntry) -> Cluster:
    key = f"{path}: clusters.{name}"
    if entry.provider not in PROVIDERS:
        raise ConfigError(f"{key}.provider: {entry.provider!r} is not one of {', '.join(PROVIDERS)}")
    launcher = _relative(path, entry.launcher)
    if not launcher.is_file():
        raise ConfigError(f"{key}.launcher: no such file {launcher}")
    if not (PACKAGE_CONF_DIR / "cluster" / f"{entry.cluster_config}.yaml").is_file():
        raise ConfigError(f"{key}.cluster_config: no such file conf/cluster/{entry.cluster_config}.yaml")
    if entry.sync_bwlimit is not None and not BWLIMIT.fullmatch(entry.sync_bwlimit):
        raise ConfigError(f"{key}.sync_bwlimit: {entry.sync_bwlimit!r} is not a rate such as 50M (bytes/s)")
    return Cluster(
        name,
        entry,
        launcher,
        _relative(path, entry.token_file),
        read_nccl_profile(path.parent / NCCL_DIR, entry.nccl.profile, f"{key}.nccl.profile"),
    )


def read_nccl_profile(folder: Path, profile: Optional[str], key: str) -> dict[str, str]:
    if profile is None:
        return {}
    file = folder / f"{profile}.yaml"
    if not file.is_file():
        available = ", ".join(sorted(p.stem for p in folder.glob("*.yaml"))) or "none"
        raise ConfigError(f"{key}: no such profile {file} (available: {available})")
    values = OmegaConf.to_container(OmegaConf.load(file)) or {}
    return {str(k): str(v) for k, v in values.items()}


def _relative(registry: Path, value: str) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else registry.parent / path


def expand(overrides: list[str], registry_path: Optional[Path] = None) -> list[str]:
    """`cluster=NAME` naming a registry entry becomes that cluster's run overrides; a
    `cluster=` naming only a conf/cluster/ file, and every other override, stay as they are."""
    chosen = [o.partition("=")[2] for o in overrides if o.startswith("cluster=")]
    if not chosen:
        return list(overrides)
    path = Path(registry_path or default_path())
    if not path.is_file():
        return list(overrides)
    registry = load(path)
    if chosen[-1] not in registry.clusters:
        return list(overrides)
    rest = [o for o in overrides if not o.startswith("cluster=")]
    return registry.get(chosen[-1]).run_overrides() + rest
