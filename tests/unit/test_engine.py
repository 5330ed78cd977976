import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import REPO
from wildtrain import services
from wildtrain.batching import BatchPlanError, batch_plan, unservable_world_sizes
from wildtrain.config import PACKAGE_CONF_DIR, Config, OptimConfig, load_config
from wildtrain.engine import BUCKET_ELEMENTS, compiles, deepspeed_config, lr_at


@given(global_batch=st.integers(1, 512), max_micro=st.integers(1, 64), world=st.integers(1, 64))
def test_batch_plan_is_exact_and_uses_the_largest_micro_batch(global_batch, max_micro, world):
    try:
        plan = batch_plan(global_batch, max_micro, world)
    except BatchPlanError:
        assert all(global_batch % (m * world) for m in range(1, max_micro + 1))
        return
    assert plan.global_batch_size == global_batch
    assert plan.world_size == world and 1 <= plan.micro_batch_size <= max_micro
    larger = range(plan.micro_batch_size + 1, max_micro + 1)
    assert all(global_batch % (m * world) for m in larger)


def test_batch_plan_examples():
    assert batch_plan(16, 4, 2).grad_accum_steps == 2
    plan = batch_plan(24, 8, 3)
    assert (plan.micro_batch_size, plan.grad_accum_steps) == (8, 1)
    plan = batch_plan(24, 5, 3)  # 5 does not divide 8 sequences per worker: 4 x 2 does
    assert (plan.micro_batch_size, plan.grad_accum_steps) == (4, 2)
    with pytest.raises(BatchPlanError):
        batch_plan(16, 4, 3)


def test_unservable_world_sizes():
    assert unservable_world_sizes(16, 4, 1, 4) == [3]
    assert unservable_world_sizes(12, 4, 1, 4) == []


def test_lr_warms_up_linearly_then_decays_by_cosine_to_min():
    optim = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4)
    assert [lr_at(s, optim, 14) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, optim, 14) == pytest.approx(1.0)
    assert lr_at(9, optim, 14) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(14, optim, 14) == pytest.approx(0.1)
    assert lr_at(100, optim, 14) == pytest.approx(0.1)


def test_deepspeed_config_follows_plan_and_device():
    cfg = Config()
    cfg.deepspeed.zero_stage = 2
    plan = batch_plan(16, 4, 2)
    cpu = deepspeed_config(cfg.deepspeed, cfg.optim, plan, on_cuda=False)
    assert cpu["train_batch_size"] == 16
    assert cpu["train_micro_batch_size_per_gpu"] == 4 and cpu["gradient_accumulation_steps"] == 2
    assert cpu["zero_optimization"] == {"stage": 2}
    assert cpu["gradient_clipping"] == cfg.optim.grad_clip
    assert "bf16" not in cpu  # fp32 on CPU
    assert deepspeed_config(cfg.deepspeed, cfg.optim, plan, on_cuda=True)["bf16"] == {"enabled": True}


PRESETS = sorted(p.stem for p in (PACKAGE_CONF_DIR / "model").glob("*.yaml"))
STAGES = sorted(p.stem for p in (PACKAGE_CONF_DIR / "deepspeed").glob("*.yaml"))


@pytest.fixture(scope="module")
def deepspeed_reads():
    """DeepSpeed's own parse of a config dict: what its engine is built from. Without a
    process group it parses for world size 1."""
    from wildtrain.engine import import_deepspeed

    import_deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig


@pytest.mark.parametrize("on_cuda", [True, False], ids=["cuda", "cpu"])
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("preset", PRESETS)
def test_deepspeed_reads_our_precision_and_overlap_for_every_preset_and_stage(deepspeed_reads, preset, stage, on_cuda):
    cfg = load_config([f"model={preset}", f"deepspeed={stage}"])
    plan = batch_plan(cfg.train.global_batch_size, cfg.train.micro_batch_size, 1)
    read = deepspeed_reads(deepspeed_config(cfg.deepspeed, cfg.optim, plan, on_cuda))
    assert read.zero_optimization_stage == cfg.deepspeed.zero_stage
    assert (read.train_batch_size, read.train_micro_batch_size_per_gpu, read.gradient_accumulation_steps) == (
        plan.global_batch_size,
        plan.micro_batch_size,
        plan.grad_accum_steps,
    )
    zero = read.zero_config
    if on_cuda:
        # bf16 weights; gradients summed over micro-batches and reduced over ranks in fp32.
        assert read.bfloat16_config.enabled
        assert read.grad_accum_dtype == "fp32" and read.communication_data_type == torch.float32
    else:  # fp32 throughout, as DeepSpeed's defaults have it
        assert not read.bfloat16_config.enabled
        assert read.grad_accum_dtype is None and read.communication_data_type is None
    if cfg.deepspeed.zero_stage in (1, 2):
        # Overlapped, sized buckets on GPU only: on CPU there is no stream to overlap on.
        assert zero.overlap_comm is on_cuda
        ours = (zero.reduce_bucket_size, zero.allgather_bucket_size) == (BUCKET_ELEMENTS, BUCKET_ELEMENTS)
        assert ours is on_cuda
    else:  # ZeRO-3 overlaps by DeepSpeed's default, with its own buckets
        assert zero.overlap_comm and zero.reduce_bucket_size != BUCKET_ELEMENTS


@pytest.mark.parametrize(
    "stage, compile, on_cuda, compiled",
    [
        (1, None, True, True),
        (2, None, True, True),
        (3, None, True, False),  # ZeRO-3's per-module hooks break the graph at every layer
        (3, True, True, True),  # asked for: compiled all the same
        (1, None, False, False),  # CPU: compiling costs more than it gains
        (1, True, False, True),
        (1, False, True, False),
    ],
)
def test_compile_is_on_for_cuda_except_under_zero3_unless_set(stage, compile, on_cuda, compiled):
    cfg = Config()
    cfg.deepspeed.zero_stage, cfg.model.compile = stage, compile
    assert compiles(cfg.model, cfg.deepspeed, on_cuda) is compiled


START_COMM = """
from wildtrain.engine import import_deepspeed
deepspeed = import_deepspeed()
deepspeed.init_distributed(dist_backend="gloo", verbose=False)
print("shm op:", deepspeed.comm.comm.cdb.shm_comm_op)
"""


def test_deepspeed_starts_on_cpu_past_a_stale_shm_build_lock(tmp_path):
    # What a worker killed during the op's build leaves behind; waited on forever by
    # every later start that builds the op.
    extensions = tmp_path / "torch_extensions"
    (extensions / "deepspeed_shm_comm").mkdir(parents=True)
    (extensions / "deepspeed_shm_comm" / "lock").touch()
    env = os.environ | dict(
        DS_ACCELERATOR="cpu",
        TORCH_EXTENSIONS_DIR=str(extensions),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(services.free_port()),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
    )
    started = subprocess.run([sys.executable, "-c", START_COMM], env=env, capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr
    assert "shm op: None" in started.stdout


def test_deepspeed_is_imported_without_compiling_its_muon_kernels():
    # In a process of its own: this one may have compiled something already.
    probe = """
import sys, torch
from wildtrain.engine import MUON_MODULE, import_deepspeed
import_deepspeed()
import deepspeed.runtime.zero.muon.muon_optimizer  # as the engine's build imports it
print(MUON_MODULE in sys.modules, torch.compile.__module__, 'torch._inductor.compile_fx' in sys.modules)
"""
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO / "platform"), "DS_ACCELERATOR": "cpu"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # Loaded, torch.compile itself again, and inductor never resolved.
    assert done.stdout.split() == ["True", "torch", "False"], done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="DeepSpeed finds CUDA itself")
def test_without_cuda_deepspeed_is_told_the_cpu_and_logs_no_warning_for_finding_it():
    probe = """
from wildtrain.engine import import_deepspeed
import_deepspeed()
from deepspeed.accelerator import get_accelerator
print(get_accelerator().device_name())
"""
    env = {name: value for name, value in os.environ.items() if name != "DS_ACCELERATOR"}
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        env=env | {"PYTHONPATH": str(REPO / "platform")},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "cpu"
    assert "Setting accelerator to CPU" not in done.stdout + done.stderr


GRADIENT_GROUP_TIMEOUT = """
import datetime, torch
import torch.distributed as dist
from wildtrain.engine import EngineSettings, build_engine, build_model
from wildtrain.batching import batch_plan
from wildtrain.config import Config, ModelConfig

# As Ray Train makes the world: with the run's collective timeout.
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=77))
cfg = Config()
cfg.model = ModelConfig(dim=32, n_layers=1, n_heads=2, vocab_size=64, max_seq_len=16)
cfg.deepspeed.zero_stage = 1
cfg.elastic.collective_timeout_s = 77
plan = batch_plan(2, 1, 1)
settings = EngineSettings(cfg.model, cfg.optim, cfg.deepspeed, cfg.train.steps, cfg.elastic.collective_timeout_s)
engine = build_engine(settings, plan, build_model(settings, plan, torch.device("cpu")), torch.device("cpu"))
group = engine.optimizer.dp_process_group
print("reduces over", group.size(), "ranks with timeout", group._get_backend(torch.device("cpu")).options._timeout)
"""


def test_deepspeed_reduces_gradients_with_the_runs_collective_timeout_not_torchs_default():
    env = os.environ | dict(
        DS_ACCELERATOR="cpu",
        MASTER_ADDR=services.HOST,
        MASTER_PORT=str(services.free_port()),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
    )
    built = subprocess.run(
        [sys.executable, "-c", GRADIENT_GROUP_TIMEOUT], env=env, capture_output=True, text=True, timeout=300
    )
    assert built.returncode == 0, built.stderr[-3000:]
    assert "reduces over 1 ranks with timeout 0:01:17" in built.stdout, built.stdout
