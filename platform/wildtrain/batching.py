"""The batch plan: micro-batch x gradient accumulation x world size for a fixed global batch.

The global batch (sequences per optimizer step) is fixed by the config and never changes
with the world size, so a run that shrinks and grows still trains the same thing. DeepSpeed
0.19 has no elasticity block any more, so the plan that keeps it constant is computed here,
as pure arithmetic that config validation can use too.
"""

from __future__ import annotations

from dataclasses import dataclass


class BatchPlanError(ValueError):
    pass


@dataclass(frozen=True)
class BatchPlan:
    world_size: int
    micro_batch_size: int
    grad_accum_steps: int

    @property
    def global_batch_size(self) -> int:
        return self.world_size * self.micro_batch_size * self.grad_accum_steps


def batch_plan(global_batch_size: int, max_micro_batch_size: int, world_size: int) -> BatchPlan:
    """The plan with the largest micro-batch <= `max_micro_batch_size` that hits the global
    batch exactly: the largest micro-batch wastes the least time in gradient accumulation,
    and an inexact global batch would make the trained model depend on failures."""
    for micro in range(min(max_micro_batch_size, global_batch_size // world_size), 0, -1):
        per_micro_step = micro * world_size
        if global_batch_size % per_micro_step == 0:
            return BatchPlan(world_size, micro, global_batch_size // per_micro_step)
    raise BatchPlanError(
        f"a global batch of {global_batch_size} sequences cannot be split evenly over "
        f"{world_size} workers with micro-batches of at most {max_micro_batch_size}"
    )


def unservable_world_sizes(
    global_batch_size: int, max_micro_batch_size: int, min_world: int, max_world: int
) -> list[int]:
    bad = []
    for world in range(min_world, max_world + 1):
        try:
            batch_plan(global_batch_size, max_micro_batch_size, world)
        except BatchPlanError:
            bad.append(world)
    return bad
