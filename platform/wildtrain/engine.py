"""DeepSpeed from our config: the LR schedule, the model (partitioned from the start under
ZeRO-3) and the engine for a batch plan (`wildtrain.batching`)."""

from __future__ import annotations

import importlib
import math
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch

from wildtrain.batching import BatchPlan
from wildtrain.config import DeepSpeedConfig, ModelConfig, OptimConfig
from wildtrain.model import Transformer


def lr_at(step: int, optim: OptimConfig, total_steps: int) -> float:
    """Linear warm-up to `lr`, then a cosine decay to `min_lr` at `total_steps`.

    A function of the optimizer step alone, so a restart at any world size resumes the
    schedule exactly where it was."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    decay_steps = max(1, total_steps - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps) / decay_steps)
    return optim.min_lr + 0.5 * (optim.lr - optim.min_lr) * (1 + math.cos(math.pi * progress))


# Elements per gradient-reduction and parameter all-gather bucket of ZeRO-1/2 on GPU. With
# DeepSpeed's default of 5e8, a bucket holds over a third of the 1.3b preset's gradients, so
# the first reduction would wait for a third of the backward pass and the last would not
# overlap with it at all; and overlap_comm keeps about 4.5 buckets' worth of buffers per kind
# (DeepSpeed's docs): 18 GB of every GPU for 5e8 fp32 elements. 5e7 (200 MB in fp32) fills
# within one layer's backward of the 1.3b preset (~50M parameters per layer) and keeps the
# buffers near 2 GB, while each call stays bandwidth-bound: ~1 ms of transfer at hundreds of
# GB/s against NCCL's tens of microseconds per call (PyTorch DDP buckets 25 MB, Megatron-LM
# 40M elements). Chosen by that reasoning, not measured: a GPU run of bench/mfu.py would tell.
BUCKET_ELEMENTS = 50_000_000


def zero_optimization(stage: int, on_cuda: bool) -> dict:
    """DeepSpeed's `zero_optimization` section.

    On GPU, ZeRO-1/2 reduce gradients in buckets overlapped with the backward pass
    (`overlap_comm`, on a side stream). At stage 1 in bf16 with fp32 gradient accumulation
    (`deepspeed_config`) DeepSpeed runs its BF16_Optimizer instead of the ZeRO-1 optimizer:
    it reduces once per optimizer step, after the backward pass, and of these settings reads
    only `allgather_bucket_size`. On CPU the DeepSpeed accelerator has no streams, so there
    is nothing to overlap with: it trains as without (the same losses over 2 gloo ranks,
    checked with DeepSpeed 0.19.8) and only the buffers would cost. ZeRO-3 overlaps by
    default and sizes its own buckets."""
    zero: dict = {"stage": stage}
    if on_cuda and stage in (1, 2):
        zero |= {"overlap_comm": True, "reduce_bucket_size": BUCKET_ELEMENTS, "allgather_bucket_size": BUCKET_ELEMENTS}
    return zero


@dataclass(frozen=True)
class EngineSettings:
    """What an engine is built from: the model, optimizer and ZeRO sections, the run's length
    (where the learning-rate schedule ends) and the collectives' timeout."""

    model: ModelConfig
    optim: OptimConfig
    deepspeed: DeepSpeedConfig
    steps: int  # train.steps
    collective_timeout_s: float  # elastic.collective_timeout_s


def deepspeed_config(
    deepspeed: DeepSpeedConfig, optim: OptimConfig, plan: BatchPlan, on_cuda: bool, load_universal: bool = False
) -> dict:
    ds = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum_steps,
        "gradient_clipping": optim.grad_clip,
        "zero_optimization": zero_optimization(deepspeed.zero_stage, on_cuda),
        "steps_per_print": 10**9,  # progress is ours to print, once, from the controller
        "wall_clock_breakdown": False,
    }
    if on_cuda:
        # bf16 weights and activations, but gradients summed over micro-batches and reduced
        # over ranks in fp32: bf16 keeps 8 significant bits, so sums in it round at every
        # add, and a step's update (and the losses after it) would depend on how its batch
        # is split into micro-batches and ranks, i.e. change with the world size. ZeRO-1 sums
        # in its BF16_Optimizer, ZeRO-2 in an fp32 partition from DeepSpeed 0.19.8 on (in bf16
        # before it, whatever this said: hence pyproject's pin).
        ds["bf16"] = {"enabled": True}
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
        ds["communication_data_type"] = "fp32"
    if load_universal:
        # The checkpoint to load was saved at another world size and converted to
        # DeepSpeed's universal (world-size independent) format.
        ds["checkpoint"] = {"load_universal": True}
    return ds


def import_deepspeed():
    """`deepspeed`, set never to build its shared-memory comm op (`deepspeed_shm_comm`).

    On CPU, DeepSpeed's comm backend JIT-builds that C++ op when it starts, slowly and at every
    worker start (torch rebuilds it whenever the build flags differ between processes; bench/startup.py),
    under a file lock in ~/.cache/torch_extensions that a worker killed mid-build leaves
    behind for every later start to wait on forever. Only DeepSpeed's inference all-reduce
    uses the op; training's collectives go through torch.distributed either way. DeepSpeed
    builds the op only where its probe found it compatible, and keeps the probe's answers
    in one dict so that edits to it hold.

    DeepSpeed's autotuner imports MLflow whenever it is installed, for its own tuning runs,
    which wildtrain never starts: a second of every worker's start (docs/benchmarks.md). A worker that has not
    imported MLflow itself imports DeepSpeed with MLflow hidden (a `None` in `sys.modules`
    fails that import, which the autotuner takes as "not installed"), then unhidden.

    DeepSpeed's ZeRO optimizers import its Muon module when the engine is built; its kernels
    are decorated with `torch.compile`, and decorating resolves the inductor backend: a second
    of every worker's start (py-spy, under the engine build; docs/benchmarks.md), for an optimizer wildtrain
    never uses. The module is imported once with `torch.compile` as the identity, so its
    kernels stay uncompiled and every later import finds it loaded.

    Without CUDA, DeepSpeed is told the CPU accelerator, as the CPU workers are
    (`scaling.worker_env`): left to find it, it picks the same and logs a warning that it did,
    the first line of `wildtrain sample` and `export` here."""
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
    hide_mlflow = "mlflow" not in sys.modules
    if hide_mlflow:
        sys.modules["mlflow"] = None
    try:
        import deepspeed
    finally:
        if hide_mlflow:
            del sys.modules["mlflow"]
    from deepspeed.accelerator import get_accelerator

    # Asked as DeepSpeed asks: accelerators without the op (CUDA) skip the probe as it does.
    shm_comm = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if shm_comm is not None:
        deepspeed.ops.__compatible_ops__[shm_comm.NAME] = False
    _import_uncompiled(MUON_MODULE)
    return deepspeed


def import_ahead() -> None:
    """Import what a process's first engine build would: DeepSpeed, and torch._dynamo, which
    torch.optim imports when the first optimizer is made (most of a first build, against
    milliseconds for every build after: docs/benchmarks.md). A worker that joins a running group does it before
    it asks to join, where the members would otherwise wait for it."""
    import_deepspeed()
    import torch._dynamo  # noqa: F401


MUON_MODULE = "deepspeed.runtime.zero.muon.original_muon"


def _import_uncompiled(module: str) -> None:
    """Import `module` with `torch.compile` (as a decorator, bare or with arguments) returning
    the function it decorates; a module that is gone (another DeepSpeed) is left out."""
    if module in sys.modules:
        return
    compile_ = torch.compile
    torch.compile = lambda fn=None, **_: fn if fn is not None else (lambda f: f)
    try:
        importlib.import_module(module)
    except ImportError:
        pass
    finally:
        torch.compile = compile_


def clone_world_group(deepspeed, timeout: timedelta) -> None:
    """Make DeepSpeed's clone of the world group (the group ZeRO reduces gradients over when
    there is no model parallelism) with `timeout`, before DeepSpeed makes it with torch's
    default (30 min on gloo, 10 min on NCCL) instead of the world's: a rank hung in its step
    would otherwise hold its peers that long, past `elastic.collective_timeout_s`. A clone
    that exists is this world's: DeepSpeed drops it when the world is destroyed."""
    groups = deepspeed.utils.groups
    if groups._WORLD_GROUP is None:
        world = torch.distributed.get_world_size()
        groups._WORLD_GROUP = torch.distributed.new_group(ranks=list(range(world)), timeout=timeout)


def destroy_process_groups(deepspeed) -> None:
    """Destroy the world group and every group DeepSpeed made of it, its clone of the world
    (`clone_world_group`) among them, for a world formed anew in the same process."""
    if deepspeed.comm.comm.cdb is None:
        # No engine was built in this process yet, but the clone was: dropped too, or the next
        # world's ranks would create different numbers of groups (a joiner makes the clone)
        # and wait for each other forever.
        torch.distributed.destroy_process_group()
        deepspeed.utils.groups._release_process_group_references()
    else:
        deepspeed.comm.destroy_process_group()


def compiles(model: ModelConfig, deepspeed: DeepSpeedConfig, on_cuda: bool) -> bool:
    """Whether the engine compiles the model: `model.compile` where set; unset, on CUDA
    except under ZeRO-3, whose per-module hooks (gathering each layer's parameters before it
    runs, releasing them after) break the compiled graph at every layer, leaving pieces too
    small to repay their compile time. To be revisited with a GPU measurement."""
    if model.compile is not None:
        return model.compile
    return on_cuda and deepspeed.zero_stage != 3


def build_model(settings: EngineSettings, plan: BatchPlan, device: torch.device) -> Transformer:
    """The model for `build_engine` on `device` (the worker's training device). Under ZeRO-3
    it is built partitioned (DeepSpeed's zero.Init, on the device DeepSpeed trains on): each
    rank holds only its shard, where a plain build would hold the whole fp32 model on every
    rank first (84 GB for the 21b preset), at every restart. The weights are those of the
    plain build with the same seed: rank 0 draws them one parameter at a time, gathered, and
    the others receive its draw."""
    if settings.deepspeed.zero_stage != 3:
        return Transformer(settings.model)
    deepspeed = import_deepspeed()
    import torch.distributed as dist

    zero = deepspeed_config(settings.deepspeed, settings.optim, plan, on_cuda=device.type == "cuda")
    if dist.is_initialized():
        # zero.Init reads the world size from DeepSpeed's comm before it sets that up itself: in
        # a process that built no engine yet it would check the batch plan against a world of 1.
        deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
    number_zero3_from_the_start()
    with deepspeed.zero.Init(config_dict_or_path=zero):
        model = Transformer(settings.model)  # its own init ran on empty shards: drawn again below
    for param, init in model.initializers():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            if dist.get_rank() == 0:
                init(param)
    return model


def number_zero3_from_the_start() -> None:
    """Restart the counters DeepSpeed numbers ZeRO-3's parameters and modules with (`ds_id`),
    which otherwise run on for as long as the process. Its ranks check that they trace the
    same ids at each forward; in a group re-formed in-process a survivor builds its second
    model and a joiner its first, so each model is numbered from zero on every rank."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partition_parameters import Init

    Init.param_id = 0
    DeepSpeedZeRoOffload._register_deepspeed_module.__defaults__[0][0] = 0  # its `count=[0]`


def param_groups(model: Transformer, optim: OptimConfig) -> list[dict]:
    """Matrices with weight decay, vectors (norms) without; a block matrix whose learning rate
    muP scales (`Scaling.lr_mult`: optim.hidden_lr_mult, its fan-in against the base's, depth)
    in a group per distinct multiple of lr, after those two. Without muP the groups are the
    two that earlier checkpoints' optimizer states hold."""

    # A partitioned parameter (zero.Init) is an empty tensor; its true shape is DeepSpeed's.
    def matrix(p) -> bool:
        return len(getattr(p, "ds_shape", p.shape)) >= 2

    mults = {id(p): model.scaling.lr_mult(name, optim.hidden_lr_mult) for name, p in model.hidden_matrices()}
    scaled = {key: mult for key, mult in mults.items() if mult != 1.0}
    groups = [
        {
            "params": [p for p in model.parameters() if matrix(p) and id(p) not in scaled],
            "weight_decay": optim.weight_decay,
        },
        {"params": [p for p in model.parameters() if not matrix(p)], "weight_decay": 0.0},
    ]
    for mult in dict.fromkeys(scaled.values()):
        groups.append(
            {
                "params": [p for p in model.parameters() if scaled.get(id(p)) == mult],
                "weight_decay": optim.weight_decay,
                "lr": optim.lr * mult,
            }
        )
    return groups


def build_engine(
    settings: EngineSettings,
    plan: BatchPlan,
    model: torch.nn.Module,
    device: torch.device,
    load_universal: bool = False,
):
    """Wrap `model` (from `build_model`) in a DeepSpeed engine for `device` (the worker's
    training device) with AdamW and the warm-up + cosine schedule, compiled when `compiles`
    says so.

    The optimizer is torch's AdamW rather than DeepSpeed's by-name optimizers: those need
    compiled ops that the CPU build (DS_BUILD_OPS=0) does not have. On CUDA it is torch's
    fused kernel: one launch for all parameters instead of several per tensor."""
    deepspeed = import_deepspeed()

    on_cuda, optim = device.type == "cuda", settings.optim
    optimizer = torch.optim.AdamW(
        param_groups(model, optim),
        lr=optim.lr,
        betas=(optim.beta1, optim.beta2),
        eps=optim.eps,
        fused=on_cuda,
    )
    # LambdaLR multiplies each group's base lr; dividing by lr keeps lr_at the single source
    # of truth, and the muP groups at their multiples of it.
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, optim, settings.steps) / optim.lr)
    if torch.distributed.is_initialized():
        clone_world_group(deepspeed, timedelta(seconds=settings.collective_timeout_s))
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=schedule,
        config=deepspeed_config(settings.deepspeed, optim, plan, on_cuda=on_cuda, load_universal=load_universal),
    )
    if compiles(settings.model, settings.deepspeed, on_cuda):
        # The engine's compile, not torch.compile(model): it compiles the module in place,
        # so parameter names (and checkpoints) are those of an uncompiled run, and it keeps
        # ZeRO-3's parameter hooks outside the graph. The first steps pay for compiling.
        engine.compile()
    return engine
