"""Which rows each rank trains on at each step: a pure function of the step.

Epoch e visits the rows in a seeded permutation of all rows; optimizer step s takes the
global positions [s·G, (s+1)·G) of that order (G = global batch; a tail shorter than G is
left out of the epoch), and rank r of W takes the contiguous slice r of that range. The
global batch of a step is therefore the same rows at every world size, and resuming after
any failure or resize is exact by construction: a checkpoint needs nothing but the step.
"""

from __future__ import annotations

import numpy as np


def steps_per_epoch(num_rows: int, global_batch_size: int) -> int:
    return num_rows // global_batch_size


def epoch_of(step: int, num_rows: int, global_batch_size: int) -> int:
    return step // steps_per_epoch(num_rows, global_batch_size)


def epoch_order(num_rows: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_rows)


def rank_rows(step: int, rank: int, world_size: int, global_batch_size: int, num_rows: int, seed: int) -> np.ndarray:
    """Row ids of rank `rank`'s share of optimizer step `step`, in the order it trains on them."""
    per_epoch = steps_per_epoch(num_rows, global_batch_size)
    if per_epoch == 0:
        raise ValueError(f"{num_rows} rows cannot fill one global batch of {global_batch_size}")
    epoch, step_in_epoch = divmod(step, per_epoch)
    per_rank = global_batch_size // world_size
    start = step_in_epoch * global_batch_size + rank * per_rank
    return epoch_order(num_rows, seed, epoch)[start : start + per_rank]
