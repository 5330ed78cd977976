"""The sections of where and how a run runs: its name and storage, the cluster, elasticity,
checkpoints, monitoring, tracking, object storage and injected faults. Each field's comment
is its meaning in the configuration reference (config/reference.py), `setting(...)` its
valid values (config/allowed.py); a section's `validate()` checks the relations between its
fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from wildtrain.config.allowed import setting
from wildtrain.config.errors import ConfigError

SAVE_POLICIES = ("skip", "queue")
SAVE_BACKGROUNDS = ("process", "thread")
PLACEMENT_STRATEGIES = ("auto", "PACK", "SPREAD", "STRICT_SPREAD", "NODE_BUNDLES")


@dataclass
class RunSectionConfig:
    """The `run:` section: the run's name and where its state lives. (Not `RunConfig`, the
    name of Ray Train's settings of a whole run, which the driver uses beside this.)"""

    # The run's name: its folder in run.storage, its MLflow run, and what a resubmission resumes.
    name: str = "demo"
    # Where checkpoints and run state live: a local path or an object-store URI. Not
    # relative to the current directory: a job's working directory is deleted after it.
    storage: str = "~/wildtrain/runs"
    # MLflow tags the run is created with: `wildtrain promote` records where a promoted run
    # came from (sweep, trial, config hash, data manifests) here.
    tags: dict[str, str] = field(default_factory=dict)
    # How often the driver renews the run's liveness lease (wildtrain.lease).
    lease_renew_s: float = setting(30.0, gt=0)
    # How long each renewal of the lease holds: a dead driver's run is free after at most this,
    # and a live one keeps its lease through renewals missed within it (a storage hiccup).
    lease_expire_s: float = 90.0

    def validate(self) -> None:
        if self.lease_expire_s <= self.lease_renew_s:
            raise ConfigError(
                f"run.lease_expire_s: must be above run.lease_renew_s ({self.lease_renew_s:g}), "
                f"else a live run's lease expires between renewals; got {self.lease_expire_s:g}"
            )


@dataclass
class DeepSpeedConfig:
    """The `deepspeed:` section; presets in conf/deepspeed/."""

    # ZeRO's stage: 0 partitions nothing, 1 the optimizer state, 2 also the gradients, 3 also
    # the parameters.
    zero_stage: int = setting(1, choices=(0, 1, 2, 3))


@dataclass
class ElasticConfig:
    """The `elastic:` section: the sizes a run trains at, and how it recovers when workers die."""

    # The fewest and the most workers the group trains with: it shrinks as nodes die, down to
    # min_workers, and grows back up to max_workers as they return.
    min_workers: int = setting(1, gt=0)
    max_workers: int = setting(2, gt=0)
    # Failures (worker or node deaths) tolerated before the run gives up; -1: no limit.
    max_failures: int = setting(3, ge=0, special=(-1, "no limit"))
    # How long a worker group's start waits for room for its workers (their placement group)
    # before Ray Train retries at the size it then sees. Where the room exists, the placement
    # is quick; a longer wait means the size does not fit, most often because Ray still counts
    # a dead node for a while after its death, and every second of this wait then adds to a
    # node's loss (Ray's default and its cost: docs/decisions/recovery.md). The default leaves
    # a loaded GCS room; a start that fits but is slow afterwards (actors, runtime env) is not
    # bounded by it.
    worker_start_timeout_s: float = setting(30.0, gt=0)
    # How often a healthy, smaller-than-max group looks for room to grow (at its next log
    # step after this). A look is two GCS reads on rank 0, so looking often costs rank 0
    # next to nothing (docs/benchmarks.md); a node that came back idles half this interval
    # on average before the group notices it.
    resize_check_interval_s: float = 2.0
    # How often the controller polls its workers: the delay before a dead worker is
    # noticed, and before a report reaches MLflow. Ray Train queues one report per worker
    # and a second would wait for the poll, so the loop sends the log steps' metrics
    # together at most once a poll and never waits for it (train/attempt.py). Ray's default.
    poll_interval_s: float = 2.0
    # The bound of one collective of the training step (gradients, the loss): a wait that
    # long means a peer is gone, and the attempt fails instead of hanging. Ray's own is
    # 1800 s. Waits that are long by nature (a rank converting a checkpoint while the
    # others wait, a save that must commit) go over a separate group bounded by
    # monitor.startup_timeout_s and checkpoint.timeout_s (train/collectives.py).
    collective_timeout_s: float = setting(300.0, gt=0)
    # How long to wait for the cluster to offer `min_workers` workers before giving up: at
    # submission, and whenever no worker group runs (see elastic.restarts.CapacityClock for what
    # counts). A node's death alone spends the node grace, the time Ray still counts the dead
    # node, and a start attempt of the smallest group that times out on that stale view
    # (elastic.worker_start_timeout_s); the default, about twice their sum, ends a run only
    # when capacity is really gone, not while a smaller group starts.
    capacity_wait_s: float = setting(120.0, gt=0)
    # Recover from a worker's death in seconds, in the survivors' processes, instead of Ray
    # restarting every worker from the last checkpoint (issue 24). The survivors re-form their
    # process group at the smaller size and take the dead rank's ZeRO partition from a peer's
    # host memory; a returning node's worker joins them. Each rank mirrors its partition after
    # every step to its successor on a ring that keeps the mirror off the rank's node where the
    # nodes allow (elastic.peer_state, membership.mirror_ring). The restart from the checkpoint
    # is its automatic fallback: where redundancy is lost (a partition gone with its mirror),
    # the whole cluster goes, or a re-form fails or overruns its bound. false: always restart
    # (docs/decisions/recovery.md says what each costs).
    in_process: bool = True
    # In-process membership (elastic.rendezvous): how often each worker beats its heart in the
    # driver's store, how long a silent one is taken for dead (a hung one: nothing fails), and
    # how long one silent since a failed collective (the error comes within milliseconds of a
    # death but does not say who died). confirm_s spans several heartbeats, so one late beat drops no one.
    heartbeat_s: float = setting(0.1, gt=0)
    dead_after_s: float = setting(10.0, gt=0)
    confirm_s: float = setting(0.5, gt=0)
    # Joiners that come seconds apart join in one re-form: one that asked waits while another
    # is still getting ready (its process started on a returned node, its imports and first
    # read under way), for up to this long after it asked. The members train on meanwhile;
    # each re-form stops all of them, a wait only idles the waiting joiner. A
    # joiner's process start, imports and first read take seconds, so nodes that return close
    # together share one re-form.
    # 0: take each joiner in as it asks.
    join_batch_s: float = setting(10.0, gt=0, special=(0, "each joiner as it asks"))
    # Workers kept started and ready beside a group of elastic.max_workers (elastic.in_process):
    # each on spare capacity (a node the group does not use), its imports done and its data
    # read, waiting. A member's death re-forms the group with a spare in its place, at the
    # same size, where a worker started on a returned node takes many seconds to be ready
    # (docs/benchmarks.md, spares); a returned node's worker becomes the next spare. 0: none.
    spares: int = setting(0, gt=0, special=(0, "none"))

    def validate(self) -> None:
        if self.spares and not self.in_process:
            raise ConfigError(
                f"elastic.spares: {self.spares} spares need elastic.in_process=true (a spare joins "
                "the members in their processes; a restarted group starts every worker anew)"
            )
        if self.max_workers < self.min_workers:
            raise ConfigError(
                f"elastic.max_workers: {self.max_workers} is below elastic.min_workers ({self.min_workers})"
            )


@dataclass
class ClusterConfig:
    """The `cluster:` section: what each worker holds on the cluster; presets in conf/cluster/."""

    # The cluster's name, recorded with the run (`wildtrain report --cluster` reads it).
    name: str = "local"
    # The Ray cluster to join; None: RAY_ADDRESS, else the head `wildtrain up` recorded in
    # .wildtrain/services.json, else the run stops and says to run `wildtrain up`. Never a
    # private Ray started on the spot, whose CPUs the workers could take all of, leaving Ray
    # Data none.
    ray_address: Optional[str] = None
    # Logical CPUs each worker holds: at least one, as a worker that holds nothing would fit
    # any node any number of times.
    cpus_per_worker: int = setting(1, gt=0)
    # true: one GPU per worker, NCCL between them; false: CPU workers over gloo; None: whatever
    # the cluster offers. None is decided once by the driver when it joins (GPUs if it has
    # any) and handed to the workers resolved. Where the cluster has GPUs, training on CPU takes an
    # explicit false; a true where it has none fails after elastic.capacity_wait_s.
    use_gpu: Optional[bool] = None
    # Custom Ray resources each worker also needs, to keep workers on the nodes that
    # offer them (e.g. {"trainer": 1} on GPU nodes, not on a CPU-only head).
    worker_resources: dict[str, float] = field(default_factory=dict)
    # How Ray places the worker group's bundles (Ray Train's ScalingConfig.placement_strategy);
    # auto: the driver decides once the cluster can hold the group. PACK (Ray's default) fills
    # a node before the next; STRICT_SPREAD puts each worker on a node of its own, and a group
    # larger than the nodes cannot start; NODE_BUNDLES (wildtrain's) puts each node's workers
    # in one bundle, STRICT_SPREAD. With elastic.in_process, a PACK group's lost bundles fit
    # the nodes left by their totals, and Ray's GCS retries them without pause while the group
    # runs smaller (bench/pg_storm.py); in the other two they fit no node left, and Ray waits
    # for a node to register. auto (`scaling.choose_placement`) picks NODE_BUNDLES with
    # elastic.in_process, else STRICT_SPREAD where no node can hold two workers (PACK would
    # place them alike), else PACK.
    placement_strategy: str = setting("auto", choices=PLACEMENT_STRATEGIES)
    # Peak FLOP/s of one device for MFU; None: looked up by device name (measured on CPU).
    peak_flops_per_device: Optional[float] = setting(None, gt=0)


@dataclass
class CheckpointConfig:
    """The `checkpoint:` section: when a run saves, where, and what it keeps."""

    # Steps between saves; the last step always saves.
    every: int = setting(20, gt=0)
    # Where committed checkpoints live; None: <run.storage>/<run.name>/checkpoints.
    store: Optional[str] = None
    # A second store (another bucket or provider) every checkpoint is also committed to;
    # restore falls back to it when the primary's copy is gone or corrupt.
    replica: Optional[str] = None
    # Local folder for each rank's files between capture and upload.
    staging_dir: str = "/tmp/wildtrain-staging"
    # A save due while the previous one is still in flight: "skip" it, or "queue" it.
    policy: str = setting("skip", choices=SAVE_POLICIES)
    # A save not committed within this time is recorded as failed; training goes on.
    timeout_s: float = setting(1800.0, gt=0)
    # Read every uploaded file back and compare its sha256 (restore always checks).
    verify_upload: bool = True
    # Keep the newest `keep_last` committed checkpoints, plus every step that is a multiple
    # of `keep_every` (0: none) for good.
    keep_last: int = setting(2, gt=0)
    keep_every: int = setting(0, gt=0, special=(0, "off"))
    # Where a save's upload, hashing and verification run: "process" (a child of the
    # worker, so training keeps the GIL; see checkpoint/async_save.py) or "thread" (no
    # second process: for a worker that cannot spawn one).
    background: str = setting("process", choices=SAVE_BACKGROUNDS)
    # Convert each committed checkpoint to the universal format in the background (on the
    # head, in checkpoint.staging_dir) and commit the copy beside it, so a resize finds it
    # ready: right where the head's CPUs idle beside GPU training, wrong on a CPU-only
    # cluster, where the conversion takes cores from training: conf/cluster/'s files set it.
    reshard_ahead: bool = True


@dataclass
class MonitorConfig:
    """The `monitor:` section: stragglers, the pre-flight health check, and hangs."""

    # Every `straggler_every` steps the ranks' busy times are compared; a rank slower than
    # the median by `straggler_factor` in `straggler_patience` checks in a row is flagged.
    straggler_every: int = setting(10, gt=0)
    straggler_factor: float = setting(1.5, gt=0)
    straggler_patience: int = setting(3, gt=0)
    # A rank whose matmul rate in the pre-flight check of a new worker group is below this
    # share of the group's median fails the check (a `health` event in MLflow).
    health_min_ratio: float = setting(0.5, ge=0, le=1)
    # Leave the nodes that fail the pre-flight check out of the run: the group re-forms
    # without them (a Ray label selector on node ids), unless that would leave fewer than
    # elastic.min_workers workers. Off: a failed check is only recorded.
    exclude_unhealthy: bool = False
    # No optimizer step for this long: dump every thread's stack and end the worker, which the
    # group then recovers from as from any worker's death (0: off). A save that must commit
    # (the last step, a planned regrow) may wait checkpoint.timeout_s on top of it.
    hang_timeout_s: float = setting(600.0, gt=0, special=(0, "off"))
    # No first optimizer step this long after a worker's start: the same as hang_timeout_s
    # (0: off). The health check, the restore with any resharding (growing with the model:
    # docs/benchmarks.md, checkpoints) and compilation (minutes for large models) come before
    # it: the default leaves room for checkpoints far larger than the measured ones; raise it
    # for slower restores.
    startup_timeout_s: float = setting(1800.0, gt=0, special=(0, "off"))


@dataclass
class ChaosConfig:
    """Faults injected on purpose, for drills and tests; off by default."""

    # This rank sleeps `slow_step_s` in every step's forward pass and health-check matmul
    # (-1: none); so does every rank on a node that carries the Ray label `slow_node_label`.
    slow_rank: int = -1
    slow_node_label: Optional[str] = None
    slow_step_s: float = 0.0
    # This rank (-1: none) raises in the middle of step `fail_at_step` while its peers go on
    # into the step's collectives, as a CUDA OOM or a corrupt shard on one rank does; once
    # per run (it leaves a marker in the run's folder), so the restarted group passes it.
    fail_rank: int = -1
    fail_at_step: int = 0
    # A worker that joins an in-process group (elastic.in_process) raises in its first step
    # there, once per run (the same marker), as a joiner on a broken node would.
    fail_joiner: bool = False

    def slows(self, rank: int, node_labels: dict[str, str]) -> bool:
        return rank == self.slow_rank or (self.slow_node_label is not None and self.slow_node_label in node_labels)


@dataclass
class TrackingConfig:
    """The `tracking:` section: the MLflow server runs are recorded in."""

    # The MLflow tracking server's URI.
    uri: str = "http://127.0.0.1:5000"
    # The MLflow experiment the run is recorded under.
    experiment: str = "wildtrain"


@dataclass
class StorageConfig:
    """How to reach object storage (s3:// URIs); gs:// and local paths need nothing here."""

    # An S3-compatible endpoint such as http://127.0.0.1:8333; None: $AWS_ENDPOINT_URL, else AWS.
    endpoint: Optional[str] = None
    # The S3 region.
    region: str = "us-east-1"
    # The names of the variables holding the keys, never the keys: configs are logged to MLflow.
    access_key_env: str = "AWS_ACCESS_KEY_ID"
    secret_key_env: str = "AWS_SECRET_ACCESS_KEY"
    # Attempts per request, with backoff, before an unreachable store is an error.
    max_attempts: int = setting(5, ge=0)
