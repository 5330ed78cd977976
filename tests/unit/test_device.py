"""Whether a run trains on GPUs: decided once, from `cluster.use_gpu` and what the cluster
offers, and everything downstream (Ray Train's scaling, the workers' environment, the engine,
the checkpoint saver) following that one answer rather than asking torch (no Ray here)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from wildtrain import resources, services
from wildtrain.checkpoint.async_save import AsyncSaver, CheckpointMeta
from wildtrain.config import ConfigError, load_config
from wildtrain.elastic import scaling
from wildtrain.elastic.scaling import resolve_device, shortfall, trains_on_gpu
from wildtrain.elastic.signals import CapacityError
from wildtrain.resources import DeviceChoice, choose_device


@pytest.mark.parametrize(
    "use_gpu, gpus, choice",
    [
        (None, 8.0, DeviceChoice(True)),  # unset: the GPUs the cluster offers
        (None, 0.0, DeviceChoice(False)),  # unset, none offered: CPU, nothing to say
        (True, 1.0, DeviceChoice(True)),
        (True, 0.0, DeviceChoice(True)),  # stands: wait_for_capacity refuses it if none come
        (False, 0.0, DeviceChoice(False)),
    ],
)
def test_the_device_follows_the_cluster_unless_set(use_gpu, gpus, choice):
    assert choose_device(use_gpu, gpus) == choice


def test_cpu_beside_offered_gpus_takes_an_explicit_false_and_is_said_in_one_line():
    choice = choose_device(False, 4.0)
    assert not choice.use_gpu
    assert choice.note.startswith("cluster.use_gpu=false: ") and "4 GPUs" in choice.note
    assert "\n" not in choice.note


def test_the_resolved_config_is_what_scaling_and_the_workers_get():
    cfg = load_config(["experiment=tiny"])
    assert cfg.cluster.use_gpu is None, "conf/cluster/local.yaml leaves it to the cluster"
    with pytest.raises(RuntimeError, match="cluster.use_gpu"):
        scaling.worker_resources(cfg.cluster)  # read unresolved, None would train on CPU without a word

    on_gpus, _ = resolve_device(cfg.cluster, {"CPU": 16.0, "GPU": 2.0})
    assert on_gpus.use_gpu is True and cfg.cluster.use_gpu is None, "a copy, not an edit"
    assert scaling.worker_resources(on_gpus) == {"CPU": 1, "GPU": 1}
    restarting = replace(cfg.elastic, in_process=False)
    assert scaling.worker_env(on_gpus, restarting) == {}, (
        "Ray Train's NCCL error handling: a failed group ends the process"
    )
    in_process = cfg.elastic  # the default
    survivor = scaling.worker_env(on_gpus, in_process)
    assert survivor["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2", "survivors outlive their groups"
    assert survivor["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0", "and torch's dump after their groups' errors"
    with pytest.raises(RuntimeError, match="cluster.placement_strategy"):
        scaling.scaling_config(on_gpus, in_process)  # auto, read unresolved
    eight_gpus = {"CPU": 64.0, "GPU": 8.0}
    bundled = scaling.resolve_placement(on_gpus, in_process, [eight_gpus, eight_gpus])
    assert scaling.scaling_config(bundled, in_process).use_gpu
    assert scaling.node_bundled(bundled), "in-process on nodes of several: a bundle a node"
    assert scaling.scaling_config(bundled, in_process).placement_strategy == "STRICT_SPREAD", (
        "what Ray places the bundles by"
    )
    packed = scaling.resolve_placement(on_gpus, restarting, [eight_gpus, eight_gpus])
    assert scaling.scaling_config(packed, restarting).placement_strategy == "PACK", (
        "Ray's default, where a node holds several"
    )
    assert not scaling.node_bundled(packed)
    spread = replace(on_gpus, placement_strategy="STRICT_SPREAD")
    assert scaling.scaling_config(spread, restarting).placement_strategy == "STRICT_SPREAD"

    on_cpu, choice = resolve_device(cfg.cluster, {"CPU": 16.0})
    assert not trains_on_gpu(on_cpu) and choice.note is None
    assert scaling.worker_resources(on_cpu) == {"CPU": 1}
    assert scaling.worker_env(on_cpu, cfg.elastic) == {"DS_ACCELERATOR": "cpu"}


def test_cluster_gpu_asks_for_what_wildtrain_up_declares():
    cluster, _ = resolve_device(load_config(["experiment=tiny", "cluster=gpu"]).cluster, {})
    per_worker = scaling.worker_resources(cluster)
    assert per_worker["GPU"] == 1 and per_worker[services.TRAINER_RESOURCE] == 1


def test_a_wait_for_gpus_that_never_came_names_cluster_use_gpu():
    cfg = load_config(["experiment=tiny", "cluster.use_gpu=true", "elastic.capacity_wait_s=5"])
    need = {"CPU": 2.0, "GPU": 1.0}
    error = shortfall(cfg.elastic, cfg.data, cfg.eval, need, {"CPU": 8.0})
    assert isinstance(error, ConfigError)
    assert str(error).startswith("cluster.use_gpu: true, but the cluster has offered no GPU for 5 s")
    # Some GPUs, too few for min_workers: a capacity problem, as for CPUs.
    error = shortfall(cfg.elastic, cfg.data, cfg.eval, {"CPU": 2.0, "GPU": 2.0}, {"CPU": 8.0, "GPU": 1.0})
    assert isinstance(error, CapacityError) and str(error).startswith("elastic.min_workers: ")


def test_a_cpu_saver_saves_on_the_host_wherever_torch_sees_cuda(tmp_path, monkeypatch):
    # A run told cluster.use_gpu=false on a GPU machine: the device says CPU, whatever torch says.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    saver = AsyncSaver(
        [str(tmp_path / "store")],
        str(tmp_path / "staging"),
        rank=0,
        world_size=1,
        attempt="c1",
        background="thread",
        device=torch.device("cpu"),
    )
    try:
        saver.save_state(CheckpointMeta(1, "step_1", 1, 0), {"state.pt": {"w": torch.ones(8)}})
        assert saver.flush(30)
        [outcome] = saver.drain()
        assert outcome.status == "saved", outcome.reason
    finally:
        saver.close(30)


BUILD_ON_CPU = """
import os
import sys
import torch
from wildtrain.engine import EngineSettings, build_engine, build_model, import_deepspeed
from wildtrain.batching import batch_plan
from wildtrain.config import Config, ModelConfig

deepspeed = import_deepspeed()
deepspeed.init_distributed(dist_backend="gloo", verbose=False)
torch.cuda.is_available = lambda: True  # a GPU machine, training on CPU as told
for stage in (1, 3):
    cfg = Config()
    cfg.model = ModelConfig(dim=32, n_layers=1, n_heads=2, vocab_size=64, max_seq_len=16)
    cfg.deepspeed.zero_stage = stage
    plan = batch_plan(2, 1, 1)
    device = torch.device("cpu")
    settings = EngineSettings(cfg.model, cfg.optim, cfg.deepspeed, cfg.train.steps, cfg.elastic.collective_timeout_s)
    engine = build_engine(settings, plan, build_model(settings, plan, device), device)
    params = list(engine.module.parameters())
    dtypes = {p.dtype for p in params} | {getattr(p, "ds_tensor", p).dtype for p in params}
    fused = any(g.get("fused") for g in engine.optimizer.optimizer.param_groups)
    print(f"stage {stage}: bf16 {engine.bfloat16_enabled()} dtypes {sorted(map(str, dtypes))} "
          f"fused {fused} compiled {engine.is_compiled}")
# torch's teardown of the gloo group at exit aborts now and then ("terminate called without an
# active exception", a CI of 2026-12-06): what counts is printed.
sys.stdout.flush()
os._exit(0)
"""


def test_the_engine_is_built_for_the_device_it_is_given(tmp_path):
    env = os.environ | dict(
        DS_ACCELERATOR="cpu",
        MASTER_ADDR=services.HOST,
        MASTER_PORT=str(services.free_port()),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
    )
    built = subprocess.run([sys.executable, "-c", BUILD_ON_CPU], env=env, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    for stage in (1, 3):
        assert f"stage {stage}: bf16 False dtypes ['torch.float32'] fused False compiled False" in built.stdout


@pytest.mark.parametrize(
    "nodes, chosen, in_process",
    [
        (
            [{"CPU": 8.0, "GPU": 1.0}, {"CPU": 8.0, "GPU": 1.0}],
            "STRICT_SPREAD",
            False,
        ),  # one GPU a node: the same placement
        ([{"CPU": 8.0, "GPU": 1.0}, {"CPU": 8.0, "GPU": 1.0}], "NODE_BUNDLES", True),  # as STRICT_SPREAD, by our class
        ([{"CPU": 64.0, "GPU": 8.0}, {"CPU": 8.0, "GPU": 1.0}], "PACK", False),  # a node that holds two
        (
            [{"CPU": 64.0, "GPU": 8.0}, {"CPU": 8.0, "GPU": 1.0}],
            "NODE_BUNDLES",
            True,
        ),  # its bundles would storm in PACK
        ([{"CPU": 4.0}, {"CPU": 8.0, "GPU": 1.0}], "STRICT_SPREAD", False),  # a head without GPUs holds none
        ([{"CPU": 4.0}], "PACK", True),  # nothing holds a worker yet: Ray's default
    ],
)
def test_auto_placement_leaves_no_lost_bundle_that_fits_a_node_left(nodes, chosen, in_process):
    assert scaling.choose_placement("auto", {"CPU": 1, "GPU": 1}, nodes, in_process) == chosen
    assert scaling.choose_placement("SPREAD", {"CPU": 1, "GPU": 1}, nodes, in_process) == "SPREAD", (
        "a strategy set stands"
    )


@pytest.mark.parametrize(
    "workers, held, sizes",
    [
        (16, [8, 8], [8, 8]),  # a bundle a node
        (12, [8, 8], [8, 4]),  # the last one partly
        (12, [4, 8], [8, 4]),  # the largest nodes first
        (3, [2, 2, 0], [2, 1]),  # a node that holds no worker holds no bundle
        (2, [1, 1, 1], [1, 1]),  # nodes of one: STRICT_SPREAD's bundles
        (5, [2], [2, 2, 1]),  # more than the nodes hold: placed once such nodes join
    ],
)
def test_node_bundles_put_each_nodes_workers_in_a_bundle_of_their_own(workers, held, sizes):
    assert resources.node_bundles(workers, held) == sizes
