import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from wildtrain.data.sampler import epoch_of, rank_rows, steps_per_epoch


@given(
    num_rows=st.integers(1, 300),
    global_batch=st.sampled_from([1, 2, 4, 6, 8, 12, 16, 24]),
    step=st.integers(0, 200),
    seed=st.integers(0, 3),
)
def test_a_step_trains_on_the_same_rows_at_every_world_size(num_rows, global_batch, step, seed):
    if num_rows < global_batch:
        with pytest.raises(ValueError):
            rank_rows(step, 0, 1, global_batch, num_rows, seed)
        return
    whole = rank_rows(step, 0, 1, global_batch, num_rows, seed)
    assert len(whole) == global_batch and len(set(whole.tolist())) == global_batch
    for world in (w for w in range(1, global_batch + 1) if global_batch % w == 0):
        shares = [rank_rows(step, r, world, global_batch, num_rows, seed) for r in range(world)]
        assert np.array_equal(np.concatenate(shares), whole)


def test_an_epoch_visits_every_row_once_then_reshuffles():
    num_rows, global_batch = 50, 8  # 6 full steps per epoch; 2 rows left out per epoch
    assert steps_per_epoch(num_rows, global_batch) == 6
    epoch0 = np.concatenate([rank_rows(s, 0, 1, global_batch, num_rows, 7) for s in range(6)])
    epoch1 = np.concatenate([rank_rows(s, 0, 1, global_batch, num_rows, 7) for s in range(6, 12)])
    assert len(set(epoch0.tolist())) == 48 and len(set(epoch1.tolist())) == 48
    assert not np.array_equal(epoch0, epoch1)
    assert epoch_of(5, num_rows, global_batch) == 0 and epoch_of(6, num_rows, global_batch) == 1


def test_the_order_depends_on_the_seed():
    assert not np.array_equal(rank_rows(0, 0, 1, 16, 1000, 0), rank_rows(0, 0, 1, 16, 1000, 1))
