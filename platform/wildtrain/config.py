"""The typed configuration of a run and how it is assembled.

Each component owns one dataclass below; `Config` groups them. A run's config is
built in this order, later layers winning:

1. the dataclass defaults (the schema),
2. conf/config.yaml,
3. one file per group (conf/<group>/<choice>.yaml), chosen by config.yaml's `defaults`,
   then by the experiment's `defaults`, then by `group=choice` on the command line,
4. the experiment's deltas (conf/experiment/<name>.yaml), selected with `experiment=<name>`,
5. dotlist overrides from the command line (`train.steps=100`).

Every mistake in any layer surfaces as a `ConfigError` whose message starts with the full
key path, so the CLI can print one line and exit 2.
"""

from __future__ import annotations

import difflib
import functools
import re
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Optional

from omegaconf import BooleanNode, FloatNode, IntegerNode, OmegaConf, StringNode
from omegaconf.errors import OmegaConfBaseException, ValidationError

from wildtrain.batching import unservable_world_sizes

# The checkout's conf/ next to the package; a `conf/` in the current directory wins, so a
# job submitted with `--working-dir` uses the configs it was submitted with.
PACKAGE_CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
GROUPS = ("model", "deepspeed", "data", "cluster", "objective")
ATTENTION = ("causal", "document", "prefix_lm")
OBJECTIVES = ("causal", "prefix_lm", "ul2")
DENOISER_KINDS = ("span", "prefix")


class ConfigError(ValueError):
    """A config that cannot run; the message names the key or file at fault."""


@dataclass
class RunSectionConfig:
    """The `run:` section. Not `RunConfig`, the name of Ray Train's settings of a whole run,
    which the driver uses beside this."""

    name: str = "demo"
    # Where checkpoints and run state live: a local path or an object-store URI. Not
    # relative to the current directory: a job's working directory is deleted after it.
    storage: str = "~/wildtrain/runs"
    # MLflow tags the run is created with: `wildtrain promote` records where a promoted run
    # came from (sweep, trial, config hash, data manifests) here.
    tags: dict[str, str] = field(default_factory=dict)
    # The liveness lease (wildtrain.lease): the driver renews it this often, and each renewal
    # holds for lease_expire_s, so a dead driver's run is free after at most that long, and a
    # live one looks dead only once three renewals in a row are missed (a storage hiccup).
    lease_renew_s: float = 30.0
    lease_expire_s: float = 90.0


@dataclass
class ModelConfig:
    name: str = "tiny"
    vocab_size: int = 320
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    # Fewer key/value heads than query heads gives grouped-query attention.
    n_kv_heads: Optional[int] = None
    # None: the SwiGLU default of 8/3 * dim, rounded up to `multiple_of`.
    ffn_dim: Optional[int] = None
    multiple_of: int = 32
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # Standard deviation of the initial embedding and output weights (the base sigma of muP).
    init_std: float = 0.02
    # Of the blocks' matrices; None: init_std. At the base model's shape (base_*, below);
    # muP scales each matrix's by sqrt(base fan-in / its fan-in).
    hidden_init_std: Optional[float] = None
    # Multiply the logits and each residual branch, at the base model's shape; muP multiplies
    # the logits by base_dim / dim, depth-muP the branches by sqrt(base_n_layers / n_layers).
    output_mult: float = 1.0
    residual_mult: float = 1.0
    # The shape of the base (proxy) model that the multipliers above and optim.hidden_lr_mult
    # were tuned at (`wildtrain promote` writes it): muP/depth-muP scale each matrix's init and
    # learning rate, the logits, the residual branches and attention's scale (1 / head_dim,
    # equal to 1 / sqrt(head_dim) at base_head_dim) from it (model/transformer.py, `scaling`).
    # All four or none; none: the model is its own base and nothing is scaled.
    base_dim: Optional[int] = None
    base_ffn_dim: Optional[int] = None
    base_head_dim: Optional[int] = None
    base_n_layers: Optional[int] = None
    # torch.compile the model: None compiles on CUDA, where it is worth ~1.5x in tokens/s,
    # except under ZeRO-3, whose per-module parameter hooks break the graph at every layer
    # (engine.compiles; unmeasured there: set true to compile anyway), and not on CPU, where
    # compiling costs more than a test or demo run gains.
    compile: Optional[bool] = None
    # Recompute each block's activations in backward: for models or sequences whose
    # activations do not fit, at about a third more compute.
    activation_checkpointing: bool = False
    # The attention mask (model/masks.py): causal over the whole packed row; document
    # (causal, never across a document boundary; rotary positions restart per document);
    # prefix_lm (per document: inputs attend to each other, targets causally; needs
    # train.objective prefix_lm or ul2, which say where the inputs end).
    attention: str = "causal"
    # Also limit attention to this many latest positions (a sliding window); None: no limit.
    attention_window: Optional[int] = None


@dataclass
class DatasetConfig:
    # A dataset written by data_pipelines/prepare.py: the folder or prefix holding its
    # manifest.json (local path, s3://, gs://).
    uri: str = "s3://wildtrain/datasets/tiny"
    # Its share of the mixture, relative to the other datasets' weights.
    weight: float = 1.0


@dataclass
class DataConfig:
    # What the run trains on, in the order data/order.py derives from train.seed.
    datasets: list[DatasetConfig] = field(default_factory=lambda: [DatasetConfig()])
    # Must be the seq_len the datasets were prepared with.
    seq_len: int = 128
    # Check every shard's sha256 at start (reads all the data once); sizes, schemas and row
    # counts are always checked.
    verify_checksums: bool = False
    # Train without a shard that is missing or does not match the manifest (recorded in
    # MLflow), instead of stopping. The rows of later steps then differ from a run with it.
    skip_bad_shards: bool = False
    # Logical CPUs each Ray Data read task holds, and the most a rank's reads hold at once.
    # Fractions run more reads at once but make Ray start (and reap) a worker process per
    # extra task: 0.25 was 7x slower than 1 here.
    read_cpus: float = 1.0
    # Read tasks' blocks (about 16 MiB of rows each) Ray Data holds ahead of training, per rank.
    prefetch_blocks: int = 4
    # Write the ids of every step's samples to <run>/samples/ (audits, exactly-once tests).
    record_samples: bool = False
    # Datasets to validate on beside the documents the training datasets hold out (prepare's
    # --val-fraction): every row of theirs is validation (their weights are not used).
    validation: list[DatasetConfig] = field(default_factory=list)
    # A resubmitted run whose data order would change (train.seed, train.global_batch_size,
    # data.seq_len, the datasets, their weights or manifests, the shards left out) is refused;
    # true starts the new order at the restored step instead, recorded as an event.
    allow_order_change: bool = False


@dataclass
class TrainConfig:
    steps: int = 60
    # Sequences per optimizer step, the same at every world size.
    global_batch_size: int = 16
    # The largest micro-batch a worker may run; the batch plan may pick a smaller one.
    micro_batch_size: int = 4
    log_every: int = 5
    checkpoint_every: int = 20
    seed: int = 0
    # What the model learns from each packed row (data/objectives.py): causal (next token,
    # loss everywhere), prefix_lm (per document, loss on a random suffix given the rest) or
    # ul2 (per document, one of objective.denoisers; loss on the targets only).
    objective: str = "causal"


@dataclass
class EvalConfig:
    """The `eval:` section. Validation during training (train/validation.py): every `every`
    steps and at the last, the loss and bits per byte on the whole validation set, per dataset
    and overall. Downstream evaluations of committed checkpoints with EleutherAI's
    lm-evaluation-harness (`wildtrain eval`, and automatically beside training; evals/)."""

    # Steps between validations (0: only at the last step).
    every: int = 0
    # Validation rows per forward pass; None: train.micro_batch_size.
    micro_batch_size: Optional[int] = None

    # lm-eval task or group names (hellaswag, arc_easy, ...) or those of include_path, each
    # evaluated on its own: a task that fails costs only its own metrics. Empty: no
    # evaluation during training; `wildtrain eval` without --tasks runs these.
    tasks: list[str] = field(default_factory=list)
    # While training, evaluate the committed checkpoints of the steps that are multiples of
    # every_checkpoints x train.checkpoint_every (the same steps whatever restarts, resizes
    # or resubmissions happen), and the last step's.
    every_checkpoints: int = 1
    # Examples per task (below 1: a share of them); None: all. lm-eval's --limit.
    limit: Optional[float] = None
    # lm-eval's batch size.
    batch_size: int = 8
    # Logical CPUs an evaluation holds, besides one GPU where the cluster offers GPUs; a
    # training group leaves them free while tasks are set (elastic.scaling.spare_cpus).
    num_cpus: float = 1.0
    # A folder of task YAMLs of your own (lm-eval's --include_path), read where the run or
    # `wildtrain eval` starts and carried to the node that evaluates; relative paths in the
    # YAMLs (dataset_kwargs.data_files) are relative to it.
    include_path: Optional[str] = None
    # How long one evaluation may take, waiting for its resources included, before it is
    # stopped and recorded as failed; the end of a run waits for those in flight.
    timeout_s: float = 3600.0


@dataclass
class OptimConfig:
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 5
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    # The blocks' matrices learn at lr * hidden_lr_mult at the base model's shape (model.base_*);
    # muP with Adam scales each matrix's by base fan-in / its fan-in, depth-muP all by
    # sqrt(base_n_layers / n_layers). Embeddings, norms and the output head learn at lr.
    hidden_lr_mult: float = 1.0


@dataclass
class EarlyStopConfig:
    """Ends a run whose loss diverged (`train.divergence`): on for sweep trials, whose
    resources then go to the next trial; off for a plain run, which trains on."""

    enabled: bool = False
    # Diverged: a logged loss that is NaN or above this multiple of the run's best so far.
    loss_factor: float = 3.0
    # The loss watched: the training loss at every log step, or the validation loss
    # ("val/loss") at every validation (eval.every), which needs a validation set.
    metric: str = "loss"


@dataclass
class DenoiserConfig:
    """One denoiser of a UL2 mixture: `span` corrupts spans of mean length `mean_span`
    covering `corruption` of a document, each replaced by a sentinel in the inputs and
    spelled out after it in the targets (UL2's R and X); `prefix` predicts a suffix of mean
    share `corruption` from the rest (UL2's S, prefix-LM)."""

    name: str = "R"
    kind: str = "span"
    mean_span: float = 3.0
    corruption: float = 0.15
    # Its share of the mixture, relative to the other denoisers' weights.
    weight: float = 1.0
    # The mode token put first in its examples, by name (a reserved token of the dataset's
    # tokenizer, e.g. [NLU], [NLG], [S2S]); None: no mode token.
    mode: Optional[str] = None


@dataclass
class ObjectiveConfig:
    """The settings of train.objective; presets in conf/objective/ (ul2, ul2r)."""

    # prefix_lm: the mean share of a document that is the target.
    prefix_target: float = 0.25
    # ul2: the mixture of denoisers.
    denoisers: list[DenoiserConfig] = field(default_factory=lambda: [DenoiserConfig()])


@dataclass
class DeepSpeedConfig:
    zero_stage: int = 1


@dataclass
class ElasticConfig:
    min_workers: int = 1
    max_workers: int = 2
    # Failures (worker or node deaths) tolerated before the run gives up; -1: no limit.
    max_failures: int = 3
    # How long a worker group's start waits for room for its workers (their placement group)
    # before Ray Train retries at the size it then sees. Where the room exists, the placement
    # takes well under a second; a longer wait means the size does not fit, most often
    # because Ray still counts a dead node (~30 s after the death, measured here). Ray's 60 s
    # default made a node's loss cost 74 s, 10 s made it 37.5 s (measured). 30 s leaves a
    # loaded GCS room; a start that fits but is slow afterwards (actors, runtime env) is not
    # bounded by it.
    worker_start_timeout_s: float = 30.0
    # How often a healthy, smaller-than-max group looks for room to grow (at its next log
    # step after this). A look is two GCS reads on rank 0, 1.3 ms on this loaded 2-core
    # machine (measured), so looking every 2 s costs under 0.1% of one process; at 60 s a
    # node that came back idled 30 s on average before the group noticed it.
    resize_check_interval_s: float = 2.0
    # How often the controller polls its workers: the delay before a dead worker is
    # noticed, and before a report reaches MLflow. Ray Train queues one report per worker
    # and a second would wait for the poll, so the loop sends the log steps' metrics
    # together at most once a poll and never waits for it (train/loop.py). Ray's default.
    poll_interval_s: float = 2.0
    # The bound of one collective of the training step (gradients, the loss): a wait that
    # long means a peer is gone, and the attempt fails instead of hanging. Ray's own is
    # 1800 s. Waits that are long by nature (a rank converting a checkpoint while the
    # others wait, a save that must commit) go over a separate group bounded by
    # monitor.startup_timeout_s and checkpoint.timeout_s (train/collectives.py).
    collective_timeout_s: float = 300.0


@dataclass
class ClusterConfig:
    name: str = "local"
    # None: RAY_ADDRESS, else the head `wildtrain up` recorded in .wildtrain/services.json,
    # else the run stops and says to run `wildtrain up`: never a private Ray started on the
    # spot, whose CPUs the workers could take all of, leaving Ray Data none.
    ray_address: Optional[str] = None
    cpus_per_worker: int = 1
    # One GPU per worker, NCCL between them; false: CPU workers over gloo. None: whatever the
    # cluster offers, decided once by the driver when it joins (GPUs if it has any) and
    # handed to the workers resolved. Where the cluster has GPUs, training on CPU takes an
    # explicit false; a true where it has none fails after capacity_wait_s.
    use_gpu: Optional[bool] = None
    # Custom Ray resources each worker also needs, to keep workers on the nodes that
    # offer them (e.g. {"trainer": 1} on GPU nodes, not on a CPU-only head).
    worker_resources: dict[str, float] = field(default_factory=dict)
    # Convert each committed checkpoint to the universal format in the background (on the
    # head, in checkpoint.staging_dir) and commit the copy beside it, so a resize finds it
    # ready: right where the head's CPUs idle beside GPU training, wrong on a CPU-only
    # cluster, where the conversion takes cores from training.
    reshard_ahead: bool = True
    # How long to wait for the cluster to offer `min_workers` workers before giving up: at
    # submission, and whenever no worker group runs (see elastic.controller.CapacityClock for what
    # counts). A node's death alone spends ~5 s in the node grace, up to ~30 s of Ray still
    # counting the dead node, and a start attempt of the smallest group that times out on
    # that stale view (elastic.worker_start_timeout_s): about 65 s at the defaults, so 120 s
    # ends a run only when capacity is really gone, not while a smaller group starts.
    capacity_wait_s: float = 120.0
    # Peak FLOP/s of one device for MFU; None: looked up by device name (measured on CPU).
    peak_flops_per_device: Optional[float] = None


@dataclass
class CheckpointConfig:
    # Where committed checkpoints live; None: <run.storage>/<run.name>/checkpoints.
    store: Optional[str] = None
    # A second store (another bucket or provider) every checkpoint is also committed to;
    # restore falls back to it when the primary's copy is gone or corrupt.
    replica: Optional[str] = None
    # Local folder for each rank's files between capture and upload.
    staging_dir: str = "/tmp/wildtrain-staging"
    # A save due while the previous one is still in flight: "skip" it, or "queue" it.
    policy: str = "skip"
    # A save not committed within this time is recorded as failed; training goes on.
    timeout_s: float = 1800.0
    # Read every uploaded file back and compare its sha256 (restore always checks).
    verify_upload: bool = True
    # Keep the newest `keep_last` committed checkpoints, plus every step that is a multiple
    # of `keep_every` (0: none) for good.
    keep_last: int = 2
    keep_every: int = 0
    # Where a save's upload, hashing and verification run: "process" (a child of the
    # worker, so training keeps the GIL; see checkpoint/async_save.py) or "thread" (no
    # second process: for a worker that cannot spawn one).
    background: str = "process"


@dataclass
class MonitorConfig:
    # Every `straggler_every` steps the ranks' busy times are compared; a rank slower than
    # the median by `straggler_factor` in `straggler_patience` checks in a row is flagged.
    straggler_every: int = 10
    straggler_factor: float = 1.5
    straggler_patience: int = 3
    # A rank whose matmul rate in the pre-flight check of a new worker group is below this
    # share of the group's median fails the check (a `health` event in MLflow).
    health_min_ratio: float = 0.5
    # Leave the nodes that fail the pre-flight check out of the run: the group re-forms
    # without them (a Ray label selector on node ids), unless that would leave fewer than
    # elastic.min_workers workers. Off: a failed check is only recorded.
    exclude_unhealthy: bool = False
    # No optimizer step for this long: dump every thread's stack and fail the attempt, so the
    # group restarts from the last checkpoint (0: off). A save that must commit (the last
    # step, a planned regrow) may wait checkpoint.timeout_s on top of it.
    hang_timeout_s: float = 600.0
    # The same, from a worker's start to its first optimizer step (0: off): the health check,
    # the restore with any resharding (21 s for a 95M model on 2 CPU cores here, growing
    # with the model) and compilation (minutes for large models) come before it. 30 min leaves
    # room for checkpoints far larger than the measured ones; raise it for slower restores.
    startup_timeout_s: float = 1800.0


@dataclass
class ChaosConfig:
    """Faults injected on purpose, for drills and tests; off by default."""

    # This rank sleeps `slow_step_s` in every step's forward pass and health-check matmul
    # (-1: none); so does every rank on a node that carries the Ray label `slow_node_label`.
    slow_rank: int = -1
    slow_node_label: Optional[str] = None
    slow_step_s: float = 0.0
    # Every step of every rank takes at least this long (0: as long as it takes): a pace for
    # drills that act mid-run, which a faster machine would otherwise run past.
    min_step_s: float = 0.0
    # This rank (-1: none) raises in the middle of step `fail_at_step` while its peers go on
    # into the step's collectives, as a CUDA OOM or a corrupt shard on one rank does; once
    # per run (it leaves a marker in the run's folder), so the restarted group passes it.
    fail_rank: int = -1
    fail_at_step: int = 0

    def slows(self, rank: int, node_labels: dict[str, str]) -> bool:
        return rank == self.slow_rank or (self.slow_node_label is not None and self.slow_node_label in node_labels)


@dataclass
class TrackingConfig:
    uri: str = "http://127.0.0.1:5000"
    experiment: str = "wildtrain"


@dataclass
class StorageConfig:
    """How to reach object storage (s3:// URIs); gs:// and local paths need nothing here."""

    # An S3-compatible endpoint such as http://127.0.0.1:8333; None: $AWS_ENDPOINT_URL, else AWS.
    endpoint: Optional[str] = None
    region: str = "us-east-1"
    # The names of the variables holding the keys, never the keys: configs are logged to MLflow.
    access_key_env: str = "AWS_ACCESS_KEY_ID"
    secret_key_env: str = "AWS_SECRET_ACCESS_KEY"
    # Attempts per request, with backoff, before an unreachable store is an error.
    max_attempts: int = 5


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


def default_conf_dir() -> Path:
    local = Path.cwd() / "conf"
    return local if (local / "config.yaml").is_file() else PACKAGE_CONF_DIR


def load_config(overrides: list[str] = (), conf_dir: Optional[Path] = None) -> Config:
    """Assemble, type-check and validate a run's config (see the module docstring)."""
    conf_dir = conf_dir or default_conf_dir()
    groups, experiment, dotlist = _split_overrides(overrides)
    root = _read_yaml(conf_dir / "config.yaml")
    choices = dict(root.pop("defaults", {}) or {})
    deltas: dict = {}
    if experiment is not None:
        deltas = _read_yaml(conf_dir / "experiment" / f"{experiment}.yaml", kind="experiment")
        choices.update(deltas.pop("defaults", {}) or {})
    choices.update(groups)

    layers = [root]
    for group, choice in choices.items():
        if group not in GROUPS:
            raise ConfigError(f"defaults.{group}: unknown config group (groups: {', '.join(GROUPS)})")
        layers.append({group: _read_yaml(conf_dir / group / f"{choice}.yaml", kind=group)})
    layers.append(deltas)
    for layer in layers:
        _check(layer, Config, "")

    merged = OmegaConf.structured(Config)
    at = None  # the override at hand: some of OmegaConf's errors name no key
    try:
        merged.merge_with(*layers)
        for at, value in dotlist:
            _check_item_numbers(merged, at)
            OmegaConf.update(merged, at, value, merge=True)
        for at, _ in dotlist:
            OmegaConf.select(merged, at)  # resolves an interpolation, named by its key if it fails
        at = None
        OmegaConf.resolve(merged)
        cfg: Config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(_explain(e, at)) from None
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Checks across keys that the types alone cannot express."""
    def positive(key: str, value: float) -> None:
        if value <= 0:
            raise ConfigError(f"{key}: must be positive, got {value}")

    positive("train.steps", cfg.train.steps)
    positive("run.lease_renew_s", cfg.run.lease_renew_s)
    if cfg.run.lease_expire_s <= cfg.run.lease_renew_s:
        raise ConfigError(f"run.lease_expire_s: must be above run.lease_renew_s ({cfg.run.lease_renew_s:g}), "
                          f"else a live run's lease expires between renewals; got {cfg.run.lease_expire_s:g}")
    positive("train.global_batch_size", cfg.train.global_batch_size)
    positive("train.micro_batch_size", cfg.train.micro_batch_size)
    positive("train.log_every", cfg.train.log_every)
    positive("train.checkpoint_every", cfg.train.checkpoint_every)
    positive("early_stop.loss_factor", cfg.early_stop.loss_factor)
    if cfg.early_stop.metric not in ("loss", "val/loss"):
        raise ConfigError(f"early_stop.metric: expected 'loss' or 'val/loss', got {cfg.early_stop.metric!r}")
    positive("model.init_std", cfg.model.init_std)
    positive("model.output_mult", cfg.model.output_mult)
    positive("model.residual_mult", cfg.model.residual_mult)
    positive("optim.hidden_lr_mult", cfg.optim.hidden_lr_mult)
    positive("monitor.straggler_every", cfg.monitor.straggler_every)
    positive("monitor.straggler_factor", cfg.monitor.straggler_factor)
    positive("monitor.straggler_patience", cfg.monitor.straggler_patience)
    positive("checkpoint.keep_last", cfg.checkpoint.keep_last)
    positive("checkpoint.timeout_s", cfg.checkpoint.timeout_s)
    if cfg.checkpoint.keep_every < 0:
        raise ConfigError(f"checkpoint.keep_every: must be 0 (off) or positive, got {cfg.checkpoint.keep_every}")
    for key, value in (("monitor.hang_timeout_s", cfg.monitor.hang_timeout_s),
                       ("monitor.startup_timeout_s", cfg.monitor.startup_timeout_s)):
        if value < 0:
            raise ConfigError(f"{key}: must be 0 (off) or positive, got {value}")
    if cfg.checkpoint.policy not in ("skip", "queue"):
        raise ConfigError(f"checkpoint.policy: expected 'skip' or 'queue', got {cfg.checkpoint.policy!r}")
    if cfg.checkpoint.background not in ("process", "thread"):
        raise ConfigError(f"checkpoint.background: expected 'process' or 'thread', got {cfg.checkpoint.background!r}")
    positive("elastic.min_workers", cfg.elastic.min_workers)
    positive("elastic.worker_start_timeout_s", cfg.elastic.worker_start_timeout_s)
    positive("elastic.collective_timeout_s", cfg.elastic.collective_timeout_s)
    positive("cluster.capacity_wait_s", cfg.cluster.capacity_wait_s)
    # A worker that holds nothing would fit any node any number of times.
    positive("cluster.cpus_per_worker", cfg.cluster.cpus_per_worker)
    if cfg.elastic.max_workers < cfg.elastic.min_workers:
        raise ConfigError(
            f"elastic.max_workers: {cfg.elastic.max_workers} is below elastic.min_workers "
            f"({cfg.elastic.min_workers})"
        )
    if cfg.deepspeed.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"deepspeed.zero_stage: must be 0, 1, 2 or 3, got {cfg.deepspeed.zero_stage}")
    if cfg.data.seq_len > cfg.model.max_seq_len:
        raise ConfigError(
            f"data.seq_len: {cfg.data.seq_len} exceeds model.max_seq_len ({cfg.model.max_seq_len})"
        )
    _validate_objective(cfg)
    _validate_eval(cfg.eval)
    if cfg.model.dim % cfg.model.n_heads:
        raise ConfigError(f"model.n_heads: {cfg.model.n_heads} does not divide model.dim ({cfg.model.dim})")
    kv_heads = cfg.model.n_kv_heads or cfg.model.n_heads
    if cfg.model.n_heads % kv_heads:
        raise ConfigError(f"model.n_kv_heads: {kv_heads} does not divide model.n_heads ({cfg.model.n_heads})")
    _validate_base_shape(cfg.model)
    bad = unservable_world_sizes(
        cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.elastic.min_workers, cfg.elastic.max_workers
    )
    if bad:
        raise ConfigError(
            f"train.global_batch_size: {cfg.train.global_batch_size} sequences cannot be split evenly "
            f"at world size {', '.join(map(str, bad))} with micro-batches of at most "
            f"{cfg.train.micro_batch_size} (elastic.min_workers..max_workers = "
            f"{cfg.elastic.min_workers}..{cfg.elastic.max_workers})"
        )


def _validate_objective(cfg: Config) -> None:
    def one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
        if value not in allowed:
            raise ConfigError(f"{key}: expected one of {', '.join(allowed)}, got {value!r}")

    one_of("model.attention", cfg.model.attention, ATTENTION)
    one_of("train.objective", cfg.train.objective, OBJECTIVES)
    if cfg.model.attention_window is not None and cfg.model.attention_window < 1:
        raise ConfigError(f"model.attention_window: must be positive or null, got {cfg.model.attention_window}")
    if cfg.model.attention == "prefix_lm" and cfg.train.objective == "causal":
        raise ConfigError("model.attention: prefix_lm needs train.objective prefix_lm or ul2 "
                          "(a causal objective has no inputs to attend to bidirectionally)")
    if not 0 < cfg.objective.prefix_target < 1:
        raise ConfigError(f"objective.prefix_target: must be between 0 and 1, got {cfg.objective.prefix_target}")
    if cfg.train.objective == "ul2" and not cfg.objective.denoisers:
        raise ConfigError("objective.denoisers: train.objective=ul2 needs at least one denoiser")
    for i, d in enumerate(cfg.objective.denoisers):
        key = f"objective.denoisers.{i}"
        one_of(f"{key}.kind", d.kind, DENOISER_KINDS)
        if not 0 < d.corruption < 1:
            raise ConfigError(f"{key}.corruption: must be between 0 and 1, got {d.corruption}")
        if d.kind == "span" and d.mean_span < 1:
            raise ConfigError(f"{key}.mean_span: must be at least 1, got {d.mean_span}")
        if d.weight <= 0:
            raise ConfigError(f"{key}.weight: must be positive, got {d.weight}")


def _validate_eval(cfg: EvalConfig) -> None:
    if cfg.every < 0:
        raise ConfigError(f"eval.every: must be 0 (the last step only) or positive, got {cfg.every}")
    if cfg.micro_batch_size is not None and cfg.micro_batch_size <= 0:
        raise ConfigError(f"eval.micro_batch_size: must be positive or null, got {cfg.micro_batch_size}")
    for key in ("every_checkpoints", "batch_size", "num_cpus", "timeout_s"):
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"eval.{key}: must be positive, got {getattr(cfg, key)}")
    if cfg.limit is not None and cfg.limit <= 0:
        raise ConfigError(f"eval.limit: must be positive (below 1: a share of each task) or null, got {cfg.limit}")
    for i, task in enumerate(cfg.tasks):
        if not task.strip() or "," in task:
            raise ConfigError(f"eval.tasks.{i}: {task!r} is not a task name (give a list: [hellaswag, arc_easy])")


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


# user:password@ (or a token@) in any scheme://... URI.
_URI_CREDENTIALS = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/?#@\s]+@")


def redact(text: str) -> str:
    """`text` with the credentials of every URI in it (`http://user:pass@host`) replaced by
    `***`: values such as tracking.uri and cluster.ray_address end up in MLflow params,
    printed URLs and errors, which others read."""
    return _URI_CREDENTIALS.sub(r"\1***@", text)


def _validate_base_shape(model: ModelConfig) -> None:
    keys = ("base_dim", "base_ffn_dim", "base_head_dim", "base_n_layers")
    base = {f"model.{key}": getattr(model, key) for key in keys}
    unset = [key for key, value in base.items() if value is None]
    if unset and len(unset) < len(base):
        # Also what an experiment promoted before per-matrix muP looks like: its multipliers
        # were already scaled, and scaling them from its base again would be wrong.
        raise ConfigError(f"{unset[0]}: the base model's shape needs {', '.join(base)} all set or none "
                          f"(set: {', '.join(k for k in base if k not in unset)}); promote the sweep again")
    for key, value in base.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{key}: must be positive, got {value}")


def config_hash(cfg: Config) -> str:
    """Of what the run trains with: credentials in its URIs are left out (`redact`), as
    they change nothing it trains and the hash is recorded where others read it."""
    return hashlib.sha256(redact(json.dumps(flatten(cfg), sort_keys=True, default=str)).encode()).hexdigest()[:16]


def group_keys(group: str, choice: str, conf_dir: Optional[Path] = None) -> list[str]:
    """The dotted keys conf/<group>/<choice>.yaml sets: `model.dim`, `model.n_layers`, ..."""
    def keys(data: dict, prefix: str) -> list[str]:
        return [k for key, value in data.items()
                for k in (keys(value, f"{prefix}{key}.") if isinstance(value, dict) and value else [f"{prefix}{key}"])]

    return keys(_read_yaml((conf_dir or default_conf_dir()) / group / f"{choice}.yaml", kind=group), f"{group}.")


# A choice of conf/<group>/ or conf/experiment/: a file name there, never a path.
_CHOICE = re.compile(r"\w[\w.-]*")
# What OmegaConf reads as bracket syntax or an escape inside a key.
_NOT_IN_KEYS = re.compile(r"[\[\]\\]")


def _split_overrides(overrides: list[str]) -> tuple[dict[str, str], Optional[str], list[tuple[str, Any]]]:
    """Group choices, the experiment, and the dotlist as (key, value) pairs, each checked
    against the schema before any file is read."""
    groups: dict[str, str] = {}
    experiment = None
    dotlist = []
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or "" in key.split("."):
            raise ConfigError(f"{item}: an override must look like key=value")
        if key == "experiment" or key in GROUPS:
            if not _CHOICE.fullmatch(text):
                raise ConfigError(f"{item}: {text!r} is not the name of a file in conf/{key}/")
            if key == "experiment":
                experiment = text
            else:
                groups[key] = text
            continue
        declared = _type_at(key)
        value = _parse_value(key, text)
        _check(value, declared, key)
        dotlist.append((key, value))
    return groups, experiment, dotlist


def _parse_value(key: str, text: str) -> Any:
    """`text` read as YAML, as OmegaConf reads a dotlist's values."""
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist([f"value={text}"]))["value"]
    except Exception as e:  # PyYAML's errors and OmegaConf's (a key YAML reads as a list)
        raise ConfigError(f"{key}: {text!r} is not a value ({_first_line(e)})") from None


def _first_line(e: Exception) -> str:
    """What is wrong, without PyYAML's multi-line excerpt of where."""
    return getattr(e, "problem", None) or str(e).splitlines()[0]


def _read_yaml(path: Path, kind: str = "config") -> dict:
    if not path.is_file():
        choices = sorted(p.stem for p in path.parent.glob("*.yaml")) if path.parent.is_dir() else []
        hint = f" (available: {', '.join(choices)})" if choices else ""
        raise ConfigError(f"{kind}={path.stem}: no such file {path}{hint}")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as e:
        raise ConfigError(f"{path}: not valid YAML: {_first_line(e)}") from None
    if not isinstance(data or {}, dict):
        raise ConfigError(f"{path}: expected a mapping of keys to values, got a list")
    return data or {}


def _required(declared: Any) -> Any:
    """`X` of `Optional[X]`; any other type as it is."""
    if typing.get_origin(declared) in (typing.Union, types.UnionType):
        return next(arg for arg in typing.get_args(declared) if arg is not type(None))
    return declared


@functools.cache
def _fields(section: type) -> dict[str, Any]:
    return typing.get_type_hints(section)


def _unknown(key: str, at: str, known: dict[str, Any]) -> str:
    parent, _, leaf = at.rpartition(".")
    guess = difflib.get_close_matches(leaf, list(known), n=1)
    hint = f" (did you mean {parent + '.' if parent else ''}{guess[0]}?)" if guess else ""
    return f"{key}: unknown key{'' if at == key else ' ' + at}{hint}"


def _type_at(key: str) -> Any:
    """The declared type of `key` (`data.datasets.0.uri`); a ConfigError names the part of
    it that is no key."""
    declared: Any = Config
    parts = key.split(".")
    for i, part in enumerate(parts):
        parent = ".".join(parts[:i])
        inner = _required(declared)
        if is_dataclass(inner):
            if part not in _fields(inner):
                raise ConfigError(_unknown(key, ".".join(parts[: i + 1]), _fields(inner)))
            declared = _fields(inner)[part]
        elif typing.get_origin(inner) is list:
            if not re.fullmatch(r"[0-9]+", part):
                raise ConfigError(f"{key}: {parent} is a list, and {part!r} is not an item number")
            declared = typing.get_args(inner)[0]
        elif typing.get_origin(inner) is dict:
            if _NOT_IN_KEYS.search(part):
                raise ConfigError(f"{key}: a key may not contain [, ] or \\")
            declared = typing.get_args(inner)[1]
        else:
            raise ConfigError(f"{key}: {parent} ({_type_name(declared)}) has no keys below it")
    return declared


def _type_name(declared: Any) -> str:
    inner = _required(declared)
    if inner is not declared:
        return f"{_type_name(inner)} or null"
    if is_dataclass(inner):
        return f"a mapping of {', '.join(_fields(inner))}"
    if typing.get_origin(inner) is list:
        return f"a list of {_type_name(typing.get_args(inner)[0])}"
    if typing.get_origin(inner) is dict:
        return f"a mapping of names to {_type_name(typing.get_args(inner)[1])}"
    return inner.__name__


# What OmegaConf converts a scalar with (a str "3" to the int 3); the same conversions here.
_SCALARS = {int: IntegerNode, float: FloatNode, bool: BooleanNode, str: StringNode}


def _check(value: Any, declared: Any, path: str) -> None:
    """A ConfigError naming the full key of the first thing in `value` (a YAML layer, an
    override's value) that the `declared` type cannot hold. OmegaConf's own errors name keys
    inside list items without the list (`w: unknown key` for data.datasets.0.w), and it lets
    lists and mappings into a mapping or list of strings (run.tags, eval.tasks)."""
    if isinstance(value, str) and "${" in value:
        return  # an interpolation: OmegaConf checks what it resolves to
    if value == "???":
        raise ConfigError(f"{path}: ??? (OmegaConf's missing value) is not a value")
    inner = _required(declared)
    if value is None:
        if inner is declared:
            raise ConfigError(f"{path}: expected {_type_name(declared)}, got null")
        return
    if is_dataclass(inner) or typing.get_origin(inner) is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected {_type_name(inner)}, got {value!r}")
        for name, item in value.items():
            key = f"{path}.{name}" if path else str(name)
            if item is None and ":" in str(name):  # `{w:1}`: YAML's flow mappings need `: `
                written = str(name).replace(":", ": ", 1)
                raise ConfigError(f"{path or key}: {{{name}}} reads as the key {name!r} without a value: "
                                  f"write {{{written}}}")
            if is_dataclass(inner):
                if name not in _fields(inner):
                    raise ConfigError(_unknown(key, key, _fields(inner)))
                _check(item, _fields(inner)[name], key)
            else:
                if not isinstance(name, str):
                    raise ConfigError(f"{key}: the names in {path} must be text, not {type(name).__name__}")
                _check(item, typing.get_args(inner)[1], key)
    elif typing.get_origin(inner) is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, e.g. {path}=[a,b]")
        for i, item in enumerate(value):
            _check(item, typing.get_args(inner)[0], f"{path}.{i}")
    elif isinstance(value, (dict, list)) or not _holds(inner, value):
        raise ConfigError(f"{path}: expected {_type_name(declared)}, got {value!r} ({type(value).__name__})")


def _holds(scalar: type, value: Any) -> bool:
    try:
        _SCALARS[scalar](value)
    except ValidationError:
        return False
    return True


def _check_item_numbers(merged: Any, key: str) -> None:
    """An item past the end of its list (OmegaConf would call it the wrong type)."""
    parts = key.split(".")
    for i in range(1, len(parts)):
        at = ".".join(parts[:i])
        if typing.get_origin(_required(_type_at(at))) is list:
            items = len(OmegaConf.select(merged, at))
            if int(parts[i]) >= items:
                numbers = f" (0..{items - 1})" if items > 1 else " (0)" if items else ""
                raise ConfigError(f"{key}: {at} has {items} item{'' if items == 1 else 's'}{numbers}; "
                                  f"set the whole list: {at}=[...]")


def _explain(e: OmegaConfBaseException, at: Optional[str]) -> str:
    """`full.key: what is wrong` for what OmegaConf finds beyond `_check`: interpolations
    that do not resolve, or resolve to the wrong type."""
    key = re.sub(r"\[(\w+)\]", r".\1", getattr(e, "full_key", None) or "") or at or "config"
    return f"{key}: {str(e).splitlines()[0]}"
