"""The sections of what a run trains: the model, its data and objective, the optimizer, the
step's cadence, evaluation and early stopping. Each validates its own keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from wildtrain.config.errors import ConfigError, one_of, positive, zero_or_positive

ATTENTION = ("causal", "document", "prefix_lm")
OBJECTIVES = ("causal", "prefix_lm", "ul2")
DENOISER_KINDS = ("span", "prefix")
EARLY_STOP_METRICS = ("loss", "val/loss")


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

    def validate(self) -> None:
        for key in ("init_std", "output_mult", "residual_mult"):
            positive(f"model.{key}", getattr(self, key))
        if self.dim % self.n_heads:
            raise ConfigError(f"model.n_heads: {self.n_heads} does not divide model.dim ({self.dim})")
        kv_heads = self.n_kv_heads or self.n_heads
        if self.n_heads % kv_heads:
            raise ConfigError(f"model.n_kv_heads: {kv_heads} does not divide model.n_heads ({self.n_heads})")
        one_of("model.attention", self.attention, ATTENTION)
        if self.attention_window is not None and self.attention_window < 1:
            raise ConfigError(f"model.attention_window: must be positive or null, got {self.attention_window}")
        self._validate_base_shape()

    def _validate_base_shape(self) -> None:
        keys = ("base_dim", "base_ffn_dim", "base_head_dim", "base_n_layers")
        base = {f"model.{key}": getattr(self, key) for key in keys}
        unset = [key for key, value in base.items() if value is None]
        if unset and len(unset) < len(base):
            # Also what an experiment promoted before per-matrix muP looks like: its multipliers
            # were already scaled, and scaling them from its base again would be wrong.
            raise ConfigError(
                f"{unset[0]}: the base model's shape needs {', '.join(base)} all set or none "
                f"(set: {', '.join(k for k in base if k not in unset)}); promote the sweep again"
            )
        for key, value in base.items():
            if value is not None and value <= 0:
                raise ConfigError(f"{key}: must be positive, got {value}")


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
    seed: int = 0
    # What the model learns from each packed row (data/objectives.py): causal (next token,
    # loss everywhere), prefix_lm (per document, loss on a random suffix given the rest) or
    # ul2 (per document, one of objective.denoisers; loss on the targets only).
    objective: str = "causal"

    def validate(self) -> None:
        for key in ("steps", "global_batch_size", "micro_batch_size", "log_every"):
            positive(f"train.{key}", getattr(self, key))
        one_of("train.objective", self.objective, OBJECTIVES)


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
    # every_checkpoints x checkpoint.every (the same steps whatever restarts, resizes
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

    def validate(self) -> None:
        zero_or_positive("eval.every", self.every, "the last step only")
        if self.micro_batch_size is not None and self.micro_batch_size <= 0:
            raise ConfigError(f"eval.micro_batch_size: must be positive or null, got {self.micro_batch_size}")
        for key in ("every_checkpoints", "batch_size", "num_cpus", "timeout_s"):
            positive(f"eval.{key}", getattr(self, key))
        if self.limit is not None and self.limit <= 0:
            raise ConfigError(f"eval.limit: must be positive (below 1: a share of each task) or null, got {self.limit}")
        for i, task in enumerate(self.tasks):
            if not task.strip() or "," in task:
                raise ConfigError(f"eval.tasks.{i}: {task!r} is not a task name (give a list: [hellaswag, arc_easy])")


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

    def validate(self) -> None:
        positive("optim.hidden_lr_mult", self.hidden_lr_mult)


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

    def validate(self) -> None:
        positive("early_stop.loss_factor", self.loss_factor)
        one_of("early_stop.metric", self.metric, EARLY_STOP_METRICS)


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

    def validate(self, key: str) -> None:
        one_of(f"{key}.kind", self.kind, DENOISER_KINDS)
        if not 0 < self.corruption < 1:
            raise ConfigError(f"{key}.corruption: must be between 0 and 1, got {self.corruption}")
        if self.kind == "span" and self.mean_span < 1:
            raise ConfigError(f"{key}.mean_span: must be at least 1, got {self.mean_span}")
        positive(f"{key}.weight", self.weight)


@dataclass
class ObjectiveConfig:
    """The settings of train.objective; presets in conf/objective/ (ul2, ul2r)."""

    # prefix_lm: the mean share of a document that is the target.
    prefix_target: float = 0.25
    # ul2: the mixture of denoisers.
    denoisers: list[DenoiserConfig] = field(default_factory=lambda: [DenoiserConfig()])

    def validate(self) -> None:
        if not 0 < self.prefix_target < 1:
            raise ConfigError(f"objective.prefix_target: must be between 0 and 1, got {self.prefix_target}")
        for i, denoiser in enumerate(self.denoisers):
            denoiser.validate(f"objective.denoisers.{i}")
