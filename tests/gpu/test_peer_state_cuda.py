"""In-process recovery's state on the GPU (issue 24): tests/unit/test_peer_state.py's resize
drill with `--device cuda`. Three ranks of a real DeepSpeed ZeRO-1 engine on NCCL (sharing
the machine's one GPU) train in bf16, where DeepSpeed's optimizer is its BF16_Optimizer,
mirroring their partitions to host memory; rank 1 dies, and the two survivors rebuild their
engines on the GPU from their own partitions and rank 1's mirror, and train on as one
uninterrupted rank does. And at ZeRO-3 (issue 58), where each parameter is partitioned on its
own, its bf16 partitions on the GPU rebuilt from the fp32 ones: a rank lost, or one joining."""

from __future__ import annotations

import pytest

from tests.helpers.ranks import NCCL_ON_ONE_GPU
from tests.helpers.zero_resize import DOUBLE, SHRINK, check_drill, run_drill

pytestmark = pytest.mark.gpu


def test_survivors_rebuild_the_zero_state_of_a_dead_peer_on_the_gpu_and_train_on(tmp_path):
    drill, reference = run_drill(tmp_path, "--device", "cuda", env=NCCL_ON_ONE_GPU)
    check_drill(drill, reference, bf16=True)


@pytest.mark.parametrize("resize", [SHRINK, DOUBLE], ids=["3 to 2", "1 to 2"])
def test_a_zero3_group_on_nccl_resized_in_process_rebuilds_each_parameter_s_partitions_and_trains_on(tmp_path, resize):
    drill, reference = run_drill(tmp_path, "--device", "cuda", "--zero", "3", env=NCCL_ON_ONE_GPU, resize=resize)
    check_drill(drill, reference, bf16=True, resize=resize, zero=3)
