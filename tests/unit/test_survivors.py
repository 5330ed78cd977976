"""What the controller's side of in-process recovery decides without Ray (elastic.survivors)."""

from wildtrain.elastic.survivors import goes_on_without


def test_a_group_goes_on_without_any_rank_rank_0_included_while_a_ray_train_worker_is_left():
    assert goes_on_without({0}, set(), [0, 1, 2], replace=False)
    assert goes_on_without({1}, set(), [0, 1], replace=False)
    assert goes_on_without({0, 2}, set(), [0, 1, 2], replace=False)


def test_a_death_that_leaves_only_joiners_restarts_the_group():
    # Rank 1 was lost before (a joiner took its place); rank 0's death leaves no Ray Train
    # worker to report, however many joiners train on.
    assert not goes_on_without({0}, {1}, [0, 1], replace=False)
    assert not goes_on_without({0, 1}, set(), [0, 1], replace=False)


def test_rays_replacement_path_keeps_its_report_barrier_and_so_rank_0():
    assert not goes_on_without({0}, set(), [0, 1, 2], replace=True)
    assert goes_on_without({2}, set(), [0, 1, 2], replace=True)
