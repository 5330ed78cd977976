"""The sections of what a run trains: the model, its data and objective, the optimizer, the
step's cadence, evaluation and early stopping. Each field's comment is its meaning in the
configuration reference (config/reference.py), `setting(...)` its valid values
(config/allowed.py); a section's `validate()` checks the relations between its fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from wildtrain.config.allowed import setting
from wildtrain.config.errors import ConfigError

ATTENTION = ("causal", "document", "prefix_lm")
OBJECTIVES = ("causal", "prefix_lm", "ul2")
DENOISER_KINDS = ("span", "prefix")
EARLY_STOP_METRICS = ("loss", "val/loss")


@dataclass
class ModelConfig:
    """The `model:` section: the shape of the transformer; presets in conf/model/."""

    # The preset's name, recorded with the run.
    name: str = "tiny"
    # Rows of the embedding and of the output head: the tokenizer's vocabulary or more.
    vocab_size: int = setting(320, gt=0)
    # The width of the residual stream.
    dim: int = setting(128, gt=0)
    # Transformer blocks.
    n_layers: int = setting(2, gt=0)
    # Attention (query) heads: they divide dim into heads of an even size, as rotary
    # embeddings rotate pairs of a head's dimensions.
    n_heads: int = setting(4, gt=0)
    # Key/value heads (None: n_heads); fewer, dividing n_heads, gives grouped-query attention.
    n_kv_heads: Optional[int] = setting(None, gt=0)
    # The hidden width of each block's SwiGLU MLP; None: 8/3 * dim, rounded up to `multiple_of`.
    ffn_dim: Optional[int] = setting(None, gt=0)
    # What the default ffn_dim is rounded up to a multiple of.
    multiple_of: int = setting(32, gt=0)
    # The longest sequence the model takes (its rotary tables' length): at least data.seq_len.
    max_seq_len: int = setting(256, gt=0)
    # The base of the rotary embeddings' frequencies.
    rope_theta: float = setting(10000.0, gt=0)
    # Added to the mean square in each RMSNorm, for numerical stability.
    norm_eps: float = setting(1e-5, ge=0)
    # Standard deviation of the initial embedding and output weights (the base sigma of muP).
    init_std: float = setting(0.02, gt=0)
    # Standard deviation of the blocks' initial matrices at the base model's shape (base_*,
    # below); None: init_std. muP scales each matrix's by sqrt(base fan-in / its fan-in).
    hidden_init_std: Optional[float] = setting(None, gt=0)
    # Multiply the logits and each residual branch, at the base model's shape; muP multiplies
    # the logits by base_dim / dim, depth-muP the branches by sqrt(base_n_layers / n_layers).
    output_mult: float = setting(1.0, gt=0)
    residual_mult: float = setting(1.0, gt=0)
    # The shape of the base (proxy) model that the multipliers above and optim.hidden_lr_mult
    # were tuned at, all four or none (None: the model is its own base and nothing is scaled).
    # `wildtrain promote` writes it. muP/depth-muP scale each matrix's init and learning rate,
    # the logits, the residual branches and attention's scale (1 / head_dim, equal to
    # 1 / sqrt(head_dim) at base_head_dim) from it (model/transformer.py, `scaling`).
    base_dim: Optional[int] = setting(None, gt=0)
    base_ffn_dim: Optional[int] = setting(None, gt=0)
    base_head_dim: Optional[int] = setting(None, gt=0)
    base_n_layers: Optional[int] = setting(None, gt=0)
    # torch.compile the model; None: on CUDA except under ZeRO-3, never on CPU. On CUDA it is
    # worth much throughput (docs/benchmarks.md), but ZeRO-3's per-module parameter hooks break the graph at every
    # layer (engine.compiles; unmeasured there: set true to compile anyway); on CPU compiling
    # costs more than a test or demo run gains.
    compile: Optional[bool] = None
    # Recompute each block's activations in backward: for models or sequences whose
    # activations do not fit, at about a third more compute.
    activation_checkpointing: bool = False
    # The attention mask (model/masks.py): causal over the whole packed row; document
    # (causal, never across a document boundary; rotary positions restart per document);
    # prefix_lm (per document: inputs attend to each other, targets causally; needs
    # train.objective prefix_lm or ul2, which say where the inputs end).
    attention: str = setting("causal", choices=ATTENTION)
    # Also limit attention to this many latest positions (a sliding window); None: no limit.
    attention_window: Optional[int] = setting(None, gt=0)

    def validate(self) -> None:
        if self.dim % self.n_heads:
            raise ConfigError(f"model.n_heads: {self.n_heads} does not divide model.dim ({self.dim})")
        if (self.dim // self.n_heads) % 2:
            raise ConfigError(
                f"model.n_heads: {self.n_heads} heads split model.dim ({self.dim}) into heads of "
                f"{self.dim // self.n_heads}, an odd size; rotary embeddings need an even one"
            )
        kv_heads = self.n_kv_heads or self.n_heads
        if self.n_heads % kv_heads:
            raise ConfigError(f"model.n_kv_heads: {kv_heads} does not divide model.n_heads ({self.n_heads})")
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


@dataclass
class DatasetConfig:
    """One dataset of `data.datasets` or `data.validation`."""

    # A dataset written by data_pipelines/prepare.py: the folder or prefix holding its
    # manifest.json (local path, s3://, gs://).
    uri: str = setting("s3://wildtrain/datasets/tiny", nonempty=True)
    # Its share of the mixture, relative to the other datasets' weights.
    weight: float = setting(1.0, gt=0)


@dataclass
class DataConfig:
    """The `data:` section: what the run trains and validates on, and how it is read."""

    # What the run trains on, in the order data/order.py derives from train.seed.
    datasets: list[DatasetConfig] = setting(default_factory=lambda: [DatasetConfig()], nonempty=True)
    # Tokens per training row: must be the seq_len the datasets were prepared with.
    seq_len: int = setting(128, gt=0)
    # Check every shard's sha256 at start (reads all the data once); sizes, schemas and row
    # counts are always checked.
    verify_checksums: bool = False
    # Train without a shard that is missing or does not match the manifest (recorded in
    # MLflow), instead of stopping. The rows of later steps then differ from a run with it.
    skip_bad_shards: bool = False
    # Logical CPUs each Ray Data read task holds, and the most a rank's reads hold at once.
    # Fractions run more reads at once but make Ray start (and reap) a worker process per
    # extra task, which costs more than the reads gain (docs/benchmarks.md, data).
    read_cpus: float = setting(1.0, ge=0)
    # Read tasks' blocks (about 16 MiB of rows each) Ray Data holds ahead of training, per rank.
    prefetch_blocks: int = setting(4, ge=0)
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
    """The `train:` section: how long, in what batches, and on what objective the run trains."""

    # Optimizer steps the run trains for.
    steps: int = setting(60, gt=0)
    # Sequences per optimizer step, the same at every world size: it must split evenly over
    # every world size from elastic.min_workers to max_workers in micro-batches of at most
    # micro_batch_size.
    global_batch_size: int = setting(16, gt=0)
    # The largest micro-batch a worker may run; the batch plan may pick a smaller one.
    micro_batch_size: int = setting(4, gt=0)
    # Steps between logged metrics (loss, throughput, learning rate).
    log_every: int = setting(5, gt=0)
    # Seeds the model's initial weights, the data order and the objectives' draws.
    seed: int = setting(0, ge=0)
    # What the model learns from each packed row (data/objectives.py): causal (next token,
    # loss everywhere), prefix_lm (per document, loss on a random suffix given the rest) or
    # ul2 (per document, one of objective.denoisers; loss on the targets only).
    objective: str = setting("causal", choices=OBJECTIVES)


@dataclass
class EvalConfig:
    """The `eval:` section. Validation during training (train/validation.py): every `every`
    steps and at the last, the loss and bits per byte on the whole validation set, per dataset
    and overall. Downstream evaluations of committed checkpoints with EleutherAI's
    lm-evaluation-harness (`wildtrain eval`, and automatically beside training; evals/)."""

    # Steps between validations (0: only at the last step).
    every: int = setting(0, gt=0, special=(0, "the last step only"))
    # Validation rows per forward pass; None: train.micro_batch_size.
    micro_batch_size: Optional[int] = setting(None, gt=0)

    # lm-eval task or group names (hellaswag, arc_easy, ...) or those of include_path, each
    # evaluated on its own: a task that fails costs only its own metrics. Empty: no
    # evaluation during training; `wildtrain eval` without --tasks runs these.
    tasks: list[str] = field(default_factory=list)
    # While training, evaluate the committed checkpoints of the steps that are multiples of
    # every_checkpoints x checkpoint.every (the same steps whatever restarts, resizes
    # or resubmissions happen), and the last step's.
    every_checkpoints: int = setting(1, gt=0)
    # Examples per task (below 1: a share of them); None: all. lm-eval's --limit.
    limit: Optional[float] = setting(None, gt=0, note="below 1: a share of each task")
    # lm-eval's batch size.
    batch_size: int = setting(8, gt=0)
    # Logical CPUs an evaluation holds, besides one GPU where the cluster offers GPUs; a
    # training group leaves them free while tasks are set (elastic.scaling.spare_cpus).
    num_cpus: float = setting(1.0, gt=0)
    # A folder of task YAMLs of your own (lm-eval's --include_path), read where the run or
    # `wildtrain eval` starts and carried to the node that evaluates; relative paths in the
    # YAMLs (dataset_kwargs.data_files) are relative to it.
    include_path: Optional[str] = None
    # How long one evaluation may take, waiting for its resources included, before it is
    # stopped and recorded as failed; the end of a run waits for those in flight.
    timeout_s: float = setting(3600.0, gt=0)

    def validate(self) -> None:
        for i, task in enumerate(self.tasks):
            if not task.strip() or "," in task:
                raise ConfigError(f"eval.tasks.{i}: {task!r} is not a task name (give a list: [hellaswag, arc_easy])")


@dataclass
class OptimConfig:
    """The `optim:` section: torch's AdamW, with a linear warm-up and a cosine decay."""

    # The peak learning rate, reached at the end of the warm-up.
    lr: float = setting(3e-3, gt=0)
    # The learning rate the cosine decay ends at, at train.steps.
    min_lr: float = setting(3e-4, ge=0)
    # Steps of linear warm-up to lr (0: none).
    warmup_steps: int = setting(5, ge=0)
    # AdamW's decoupled weight decay, of the matrices (embeddings and output head included), not the norms.
    weight_decay: float = setting(0.1, ge=0)
    # AdamW's decay rates of its two moments.
    beta1: float = setting(0.9, ge=0, lt=1)
    beta2: float = setting(0.95, ge=0, lt=1)
    # AdamW's epsilon, added to the denominator of each update: above 0, or an element whose
    # gradient has been 0 so far (an embedding row of a token not yet seen) would become 0 / 0.
    eps: float = setting(1e-8, gt=0)
    # The gradients' global norm is clipped to this.
    grad_clip: float = setting(1.0, gt=0, special=(0, "off"))
    # The blocks' matrices learn at lr * hidden_lr_mult at the base model's shape (model.base_*);
    # muP with Adam scales each matrix's by base fan-in / its fan-in, depth-muP all by
    # sqrt(base_n_layers / n_layers). Embeddings, norms and the output head learn at lr.
    hidden_lr_mult: float = setting(1.0, gt=0)


@dataclass
class EarlyStopConfig:
    """Ends a run whose loss diverged (`train.divergence`): on for sweep trials, whose
    resources then go to the next trial; off for a plain run, which trains on."""

    # Stop the run when its loss diverges.
    enabled: bool = False
    # Diverged: a logged loss that is NaN or above this multiple of the run's best so far.
    loss_factor: float = setting(3.0, gt=0)
    # The loss watched: the training loss at every log step, or the validation loss
    # ("val/loss") at every validation (eval.every), which needs a validation set.
    metric: str = setting("loss", choices=EARLY_STOP_METRICS)

    @property
    def watches_validation(self) -> bool:
        """Whether early stopping judges the validation loss, so the run's data must hold some."""
        return self.enabled and self.metric == "val/loss"


@dataclass
class DenoiserConfig:
    """One denoiser of a UL2 mixture: `span` corrupts spans of mean length `mean_span`
    covering `corruption` of a document, each replaced by a sentinel in the inputs and
    spelled out after it in the targets (UL2's R and X); `prefix` predicts a suffix of mean
    share `corruption` from the rest (UL2's S, prefix-LM)."""

    # A label for the denoiser (UL2 names them R, X and S).
    name: str = "R"
    # span (UL2's R and X) or prefix (UL2's S).
    kind: str = setting("span", choices=DENOISER_KINDS)
    # span: the mean length of a corrupted span, in tokens (at least 1).
    mean_span: float = 3.0
    # span: the share of a document's tokens corrupted; prefix: the mean share that is the target.
    corruption: float = setting(0.15, gt=0, lt=1)
    # Its share of the mixture, relative to the other denoisers' weights.
    weight: float = setting(1.0, gt=0)
    # The mode token put first in its examples, by name (a reserved token of the dataset's
    # tokenizer, e.g. [NLU], [NLG], [S2S]); None: no mode token.
    mode: Optional[str] = None

    def validate(self, key: str) -> None:
        if self.kind == "span" and not self.mean_span >= 1:
            raise ConfigError(f"{key}.mean_span: must be at least 1 for a span denoiser, got {self.mean_span}")


@dataclass
class ObjectiveConfig:
    """The settings of train.objective; presets in conf/objective/ (ul2, ul2r)."""

    # prefix_lm: the mean share of a document that is the target.
    prefix_target: float = setting(0.25, gt=0, lt=1)
    # ul2: the mixture of denoisers.
    denoisers: list[DenoiserConfig] = field(default_factory=lambda: [DenoiserConfig()])

    def validate(self) -> None:
        for i, denoiser in enumerate(self.denoisers):
            denoiser.validate(f"objective.denoisers.{i}")
