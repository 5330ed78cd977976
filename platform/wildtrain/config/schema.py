"""The whole config: one section per component, and the keys that moved between sections."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    DataConfig,
    EarlyStopConfig,
    EvalConfig,
    ModelConfig,
    ObjectiveConfig,
    OptimConfig,
    TrainConfig,
)

GROUPS = ("model", "deepspeed", "data", "cluster", "objective")

# Keys that moved to the section of the component that reads them: the old name is still
# read, with a warning, until the next release. Hashes of configs (trial names, checkpoint
# manifests) key values by the old names (`hashed_form`), so a finished trial keeps its hash:
# an entry stays here for that after its old name is no longer read.
RENAMED = {
    "train.checkpoint_every": "checkpoint.every",
    "cluster.reshard_ahead": "checkpoint.reshard_ahead",
    "cluster.capacity_wait_s": "elastic.capacity_wait_s",
}


@dataclass
class Config:
    run: RunSectionConfig = field(default_factory=RunSectionConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    chaos: ChaosConfig = field(default_factory=ChaosConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
