"""Room in shared memory for the save process's host copies, and the save mode that follows.

With `checkpoint.background="process"` each rank's host copies of its checkpoint live in
shared memory (`HostBuffers(share=True)`: torch's `share_memory_()` makes them files in
/dev/shm), so that the save process reads them where the capture put them. A container's
/dev/shm is 64 MiB unless a larger one is mounted there (Docker's and containerd's default,
and so every KubeRay pod's without a memory emptyDir): the first capture then fails with
torch's "unable to allocate shared memory(shm)", the worker group restarts, restores, and
fails again at the next save, for good. So the room is checked before the saver is built;
where it is short, the saves run in a thread of the worker (private host buffers, pinned on
CUDA), which costs training only under CPU contention (see `async_save`), and the run says
so, with the fix.

What is needed: every rank on a node fills the same /dev/shm, and each may hold two copies
of its part, a save in flight and one queued behind it (`checkpoint.policy=queue`, and the
saves of the last step and of a regrow, which queue whatever the policy), plus `MARGIN` for
what the estimate leaves out (DeepSpeed's small tensors, NCCL's own segments). Ray's object
store takes from the same /dev/shm as it fills, after this check: a pod's /dev/shm is sized
for both (ray_clusters/kuberay/).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Iterable, Optional

SHM_DIR = "/dev/shm"  # where glibc's shm_open, and so torch's share_memory_(), puts its files
COPIES = 2
MARGIN = 0.10
# DeepSpeed's optimizer state per parameter: fp32 master weights and AdamW's two fp32 moments.
OPTIMIZER_BYTES_PER_PARAM = 12
FIX = (
    "mount a memory-backed volume at /dev/shm sized for it (Kubernetes: an emptyDir with medium: Memory, "
    "as ray_clusters/kuberay/ does; Docker: --shm-size)"
)


def capture_bytes(n_params: int, param_bytes: int, zero_stage: int, world_size: int, rank: int) -> int:
    """What `rank` copies to host memory per save (DeepSpeed's files), from the model's size:
    the module's weights, on rank 0 alone (under ZeRO-3 the module holds empty placeholders:
    the weights are the optimizer's fp32 partitions), and its share of the optimizer state
    (partitioned over the ranks by ZeRO 1-3; at stage 0 counted whole on rank 0, an upper
    bound). Exact but for a few bytes of step counters at stages 1-3 (test_save_mode.py)."""
    weights = n_params * param_bytes if rank == 0 and zero_stage != 3 else 0
    whole = zero_stage == 0 and rank == 0
    optimizer = OPTIMIZER_BYTES_PER_PARAM * (n_params if whole else math.ceil(n_params / world_size))
    return weights + optimizer


def shm_needed(node_capture_bytes: Iterable[int]) -> int:
    """The /dev/shm a node needs for the process mode: its ranks' captures (`capture_bytes`
    of each rank on it), `COPIES` times, plus `MARGIN`."""
    return math.ceil(COPIES * sum(node_capture_bytes) * (1 + MARGIN))


def shm_free(path: str = SHM_DIR) -> Optional[int]:
    """Bytes free for unprivileged writers on the filesystem at `path`; None where there is
    none (not Linux)."""
    try:
        stats = os.statvfs(path)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


@dataclass(frozen=True)
class SaveMode:
    mode: str  # "process" or "thread"
    reason: str  # why not the mode asked for; "" when it is
    free: Optional[int]  # bytes free in /dev/shm, None: not known
    needed: int  # bytes the process mode needs there


def choose_mode(requested: str, free: Optional[int], needed: int, where: str = SHM_DIR) -> SaveMode:
    """The save mode for `checkpoint.background=requested` with `free` bytes in `where` and
    `needed` for the process mode: `requested`, unless it is "process" and there is less
    room than needed (a free space not known counts as room: /dev/shm is no limit there)."""
    if requested != "process" or free is None or free >= needed:
        return SaveMode(requested, "", free, needed)
    reason = (
        f"checkpoint.background=process needs {_size(needed)} free in {where} for the host copies of this "
        f"node's checkpoint parts ({COPIES} copies, +{MARGIN:.0%}) and {_size(free)} are free: saving in a "
        f"thread instead (training slows more under CPU contention); to save in a process, {FIX}"
    )
    return SaveMode("thread", reason, free, needed)


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB ({n:,} bytes)" if n >= 2**30 else f"{n / 2**20:.1f} MiB ({n:,} bytes)"
