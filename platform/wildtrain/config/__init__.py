"""The typed configuration of a run and how it is assembled.

Each component owns one section, a dataclass that validates its own keys (config/training.py:
what is trained; config/system.py: where and how it runs); `Config` (config/schema.py) groups
them. A run's config is built in this order, later layers winning:

1. the dataclass defaults (the schema),
2. conf/config.yaml,
3. one file per group (conf/<group>/<choice>.yaml), chosen by config.yaml's `defaults`,
   then by the experiment's `defaults`, then by `group=choice` on the command line,
4. the experiment's deltas (conf/experiment/<name>.yaml), selected with `experiment=<name>`,
5. dotlist overrides from the command line (`train.steps=100`).

Every mistake in any layer surfaces as a `ConfigError` whose message starts with the full
key path (config/overrides.py), so the CLI can print one line and exit 2; checks across
sections are in config/checks.py.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from wildtrain.config.checks import validate
from wildtrain.config.errors import ConfigError
from wildtrain.config.overrides import (
    check,
    check_item_numbers,
    explain,
    group_layer,
    layer_keys,
    move_renamed,
    read_yaml,
    split_overrides,
)
from wildtrain.config.schema import GROUPS, RENAMED, Config
from wildtrain.config.system import (
    ChaosConfig,
    CheckpointConfig,
    ClusterConfig,
    DeepSpeedConfig,
    ElasticConfig,
    MonitorConfig,
    RunSectionConfig,
    StorageConfig,
    TrackingConfig,
)
from wildtrain.config.training import (
    ATTENTION,
    DENOISER_KINDS,
    OBJECTIVES,
    DataConfig,
    DatasetConfig,
    DenoiserConfig,
    EarlyStopConfig,
    EvalConfig,
    ModelConfig,
    ObjectiveConfig,
    OptimConfig,
    TrainConfig,
)

__all__ = [
    "ATTENTION",
    "DENOISER_KINDS",
    "GROUPS",
    "OBJECTIVES",
    "PACKAGE_CONF_DIR",
    "RENAMED",
    "ChaosConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DatasetConfig",
    "DeepSpeedConfig",
    "DenoiserConfig",
    "EarlyStopConfig",
    "ElasticConfig",
    "EvalConfig",
    "ModelConfig",
    "MonitorConfig",
    "ObjectiveConfig",
    "OptimConfig",
    "RunSectionConfig",
    "StorageConfig",
    "TrackingConfig",
    "TrainConfig",
    "config_hash",
    "default_conf_dir",
    "flatten",
    "group_keys",
    "hashed_form",
    "load_config",
    "redact",
    "to_yaml",
    "validate",
]

# The checkout's conf/ next to the package; a `conf/` in the current directory wins, so a
# job submitted with `--working-dir` uses the configs it was submitted with.
PACKAGE_CONF_DIR = Path(__file__).resolve().parents[3] / "conf"


def default_conf_dir() -> Path:
    local = Path.cwd() / "conf"
    return local if (local / "config.yaml").is_file() else PACKAGE_CONF_DIR


def load_config(overrides: list[str] = (), conf_dir: Optional[Path] = None) -> Config:
    """Assemble, type-check and validate a run's config (see the module docstring)."""
    conf_dir = conf_dir or default_conf_dir()
    groups, experiment, dotlist = split_overrides(overrides)
    root = read_yaml(conf_dir / "config.yaml")
    choices = dict(root.pop("defaults", {}) or {})
    deltas: dict = {}
    experiment_file = conf_dir / "experiment" / f"{experiment}.yaml"
    if experiment is not None:
        deltas = read_yaml(experiment_file, kind="experiment")
        choices.update(deltas.pop("defaults", {}) or {})
    choices.update(groups)

    layers = [(root, conf_dir / "config.yaml")]
    for group, choice in choices.items():
        if group not in GROUPS:
            raise ConfigError(f"defaults.{group}: unknown config group (groups: {', '.join(GROUPS)})")
        layers.append((group_layer(conf_dir, group, choice), conf_dir / group / f"{choice}.yaml"))
    layers.append((deltas, experiment_file))
    for layer, path in layers:
        move_renamed(layer, str(path))
        check(layer, Config, "")

    merged = OmegaConf.structured(Config)
    at = None  # the override at hand: some of OmegaConf's errors name no key
    try:
        merged.merge_with(*(layer for layer, _ in layers))
        for at, value in dotlist:
            check_item_numbers(merged, at)
            OmegaConf.update(merged, at, value, merge=True)
        for at, _ in dotlist:
            OmegaConf.select(merged, at)  # resolves an interpolation, named by its key if it fails
        at = None
        OmegaConf.resolve(merged)
        cfg: Config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(explain(e, at)) from None
    validate(cfg)
    return cfg


def group_keys(group: str, choice: str, conf_dir: Optional[Path] = None) -> list[str]:
    """The dotted keys conf/<group>/<choice>.yaml sets: `model.dim`, `model.n_layers`, ..."""
    return layer_keys(group_layer(conf_dir or default_conf_dir(), group, choice))


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def flatten(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """`{"train.steps": 60, ...}`: the resolved config as flat key/value pairs."""
    flat: dict[str, Any] = {}
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        key = f"{prefix}{f.name}"
        if is_dataclass(value):
            flat.update(flatten(value, key + "."))
        elif isinstance(value, list) and value and all(is_dataclass(v) for v in value):
            for i, item in enumerate(value):
                flat.update(flatten(item, f"{key}.{i}."))
        else:
            flat[key] = value
    return flat


def hashed_form(cfg: Config) -> dict[str, Any]:
    """`flatten(cfg)` with each moved key under the name it had when hashes of configs were
    first recorded (`RENAMED`), so a finished trial or a checkpoint hashes the same whether
    its config spells the key the old way or the new."""
    hashed_as = {new: old for old, new in RENAMED.items()}
    return {hashed_as.get(key, key): value for key, value in flatten(cfg).items()}


# user:password@ (or a token@) in any scheme://... URI.
_URI_CREDENTIALS = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/?#@\s]+@")


def redact(text: str) -> str:
    """`text` with the credentials of every URI in it (`http://user:pass@host`) replaced by
    `***`: values such as tracking.uri and cluster.ray_address end up in MLflow params,
    printed URLs and errors, which others read."""
    return _URI_CREDENTIALS.sub(r"\1***@", text)


def config_hash(cfg: Config) -> str:
    """Of what the run trains with: credentials in its URIs are left out (`redact`), as
    they change nothing it trains and the hash is recorded where others read it."""
    return hashlib.sha256(redact(json.dumps(hashed_form(cfg), sort_keys=True, default=str)).encode()).hexdigest()[:16]
