"""ZeRO-2 in bf16 sums a step's micro-batches' gradients in fp32, as `deepspeed_config` asks
(`data_types.grad_accum_dtype`), on the CPU as a worker's engine does on CUDA: so a step's
update does not depend on how its batch splits into micro-batches, i.e. on the world size.
DeepSpeed honours it at stage 2 from 0.19.8 on (pyproject's pin); 0.19.0 to 0.19.7 summed in
bf16, which this test tells apart (issue 59)."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from wildtrain import services

MEASURE = """
import json, sys, torch
import torch.distributed as dist
from tests.helpers.grad_accum import accumulation_errors
dist.init_process_group("gloo")
print(json.dumps({stage: accumulation_errors(stage, torch.device("cpu")) for stage in (1, 2)}, default=str))
"""


@pytest.fixture(scope="module")
def measured() -> dict:
    env = os.environ | dict(
        PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'platform'}",
        DS_ACCELERATOR="cpu",
        MASTER_ADDR=services.HOST,
        MASTER_PORT=str(services.free_port()),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        OMP_NUM_THREADS="1",
    )
    done = subprocess.run([sys.executable, "-c", MEASURE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("stage, optimizer", [("1", "BF16_Optimizer"), ("2", "DeepSpeedZeroOptimizer")])
def test_micro_batches_gradients_are_summed_in_fp32_in_bf16_training(measured, stage, optimizer):
    got = measured[stage]
    assert got["optimizer"] == optimizer and got["data_types"] == ["torch.bfloat16", "torch.float32"]
    # Exactly the fp32 sum of the bf16 gradients, and not their bf16 sum.
    assert got["errors"]["fp32"] == 0.0
    assert got["errors"]["bf16"] > 0.0
