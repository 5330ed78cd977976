"""The pure decisions of a sweep: its grid and trial hashes, the early-stop rule, the
ranking and effects, and the muP transfer rule against the published tables."""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch

from wildtrain.config import ConfigError, load_config
from wildtrain.elastic.scaling import resolve_device
from wildtrain.engine import param_groups
from wildtrain.model import Transformer
from wildtrain.sweeps.compare import TrialRecord, differing_data, effects, rank, smooth, table_text
from wildtrain.sweeps.execute import trial_need, trial_slots
from wildtrain.sweeps.grid import GridError, parse_grid, plan_sweep, steps_for_budget
from wildtrain.sweeps.transfer import transfer
from wildtrain.train.divergence import judge_loss


def test_each_trial_args_load_its_config():
    plan = plan_sweep("abl", ["optim.lr=1e-3,3e-3"], ["experiment=tiny"], budget_tokens=10_000)
    for trial in plan.trials:
        assert load_config(list(trial.args)) == trial.cfg


def test_as_many_trials_run_at_once_as_the_cluster_holds_at_their_full_size():
    # As the sweep sizes them: each trial's device resolved against the cluster (no GPU here).
    cfg = load_config(["experiment=tiny", "elastic.max_workers=2", "data.read_cpus=1"])
    cfg = dataclasses.replace(cfg, cluster=resolve_device(cfg.cluster, {"CPU": 10.0})[0])
    assert trial_need(cfg) == {"CPU": 3.0}
    gpu = load_config(["experiment=tiny", "elastic.max_workers=8", "elastic.min_workers=8", "cluster=gpu"])
    assert trial_need(gpu) == {"CPU": 8 * 8 + gpu.data.read_cpus, "GPU": 8.0, "trainer": 8.0}
    assert trial_slots({"CPU": 10.0}, [trial_need(cfg)]) == 3
    # The largest need of each resource counts, whichever trial has it.
    assert trial_slots({"CPU": 200.0, "GPU": 32.0}, [{"CPU": 9.0, "GPU": 8.0}, {"CPU": 90.0, "GPU": 1.0}]) == 2
    assert trial_slots({"CPU": 3.0}, [{"CPU": 1.5}]) == 2
    # A trial larger than the cluster still runs, alone: it waits for capacity as any run does.
    assert trial_slots({"CPU": 2.0}, [{"CPU": 3.0}]) == 1
    assert trial_slots({"CPU": 64.0}, [{"CPU": 8.0, "GPU": 8.0}]) == 1, "no GPU at all: one, which waits"


def test_grid_is_the_cartesian_product_first_key_slowest_with_stable_distinct_hashes():
    plan = plan_sweep("abl", ["optim.lr=1e-3,3e-3", "model.dim=64,128"], ["train.steps=4"])
    assert [t.values for t in plan.trials] == [
        (("optim.lr", "1e-3"), ("model.dim", "64")),
        (("optim.lr", "1e-3"), ("model.dim", "128")),
        (("optim.lr", "3e-3"), ("model.dim", "64")),
        (("optim.lr", "3e-3"), ("model.dim", "128")),
    ]
    assert len({t.hash for t in plan.trials}) == 4
    assert all(t.run_name == f"abl-{t.hash}" == t.cfg.run.name for t in plan.trials)
    assert all(t.cfg.early_stop.enabled and t.cfg.train.steps == 4 for t in plan.trials)
    # The same trial hashes the same in another sweep and in another grid order;
    # anything else it trains with changes the hash.
    again = plan_sweep("other", ["model.dim=128,64", "optim.lr=3e-3,1e-3"], ["train.steps=4"])
    assert {t.hash for t in again.trials} == {t.hash for t in plan.trials}
    longer = plan_sweep("abl", ["optim.lr=1e-3,3e-3", "model.dim=64,128"], ["train.steps=5"])
    assert not {t.hash for t in longer.trials} & {t.hash for t in plan.trials}


def test_credentials_change_no_trial_hash():
    def hashes(uri):
        return [t.hash for t in plan_sweep("s", ["optim.lr=1e-3,3e-3"], [f"tracking.uri={uri}"], steps=4).trials]

    assert hashes("http://alice:s3cret@mlflow.example:5000") == hashes("http://bob:other@mlflow.example:5000")
    assert hashes("http://alice:s3cret@mlflow.example:5000") != hashes("http://alice:s3cret@elsewhere:5000")


def test_budget_tokens_equalizes_data_across_batch_sizes():
    assert steps_for_budget(16 * 128 * 10, 16, 128) == 10
    assert steps_for_budget(16 * 128 * 10 + 1, 16, 128) == 11
    plan = plan_sweep("b", ["train.global_batch_size=8,16"], [], budget_tokens=16 * 128 * 10)
    assert [t.cfg.train.steps for t in plan.trials] == [20, 10]


@pytest.mark.parametrize(
    "specs, overrides, message",
    [
        (["optim.lr"], [], "--grid optim.lr: expected key=value1,value2,..."),
        (["optim.lr=1,1"], [], "--grid optim.lr=1,1: values must be distinct and non-empty"),
        (["run.name=a,b"], [], "--grid run.name=a,b: run.name is set by the sweep for each trial"),
        (["optim.lr=1,2"], ["optim.lr=3"], "optim.lr=3: optim.lr is swept; set it with --grid only"),
        ([], [], "--grid: give at least one key=value1,value2,..."),
    ],
)
def test_bad_grids_name_the_option(specs, overrides, message):
    with pytest.raises(GridError) as e:
        plan_sweep("s", specs, overrides)
    assert str(e.value) == message


def test_a_bad_grid_value_names_its_key_and_trial():
    with pytest.raises(ConfigError, match=r"^optim\.lr: expected float, got 'fast' \(str\) \(trial optim\.lr=fast\)$"):
        plan_sweep("s", ["optim.lr=1e-3,fast"], [])


def test_grid_values_may_be_lists():
    assert parse_grid(["data.datasets=[{uri: a}],[{uri: b}, {uri: c}]"]) == {
        "data.datasets": ["[{uri: a}]", "[{uri: b}, {uri: c}]"]
    }


def test_divergence_is_nan_or_a_multiple_of_the_best_loss():
    verdict = judge_loss(5.0, math.inf, 3.0)
    assert verdict.reason is None and verdict.best == 5.0
    assert judge_loss(4.0, 5.0, 3.0).best == 4.0
    assert judge_loss(14.9, 5.0, 3.0).reason is None
    assert judge_loss(15.1, 5.0, 3.0).reason == "loss 15.1 is above 3 x the best 5"
    assert judge_loss(float("nan"), 5.0, 3.0).reason == "loss is nan"
    assert judge_loss(float("inf"), math.inf, 3.0).reason == "loss is inf"


def record(name, values, loss, status="FINISHED", stopped=None, digests=("d1",)):
    return TrialRecord(
        name,
        f"id-{name}",
        values,
        status,
        stopped,
        tuple(range(len(loss))),
        tuple(loss),
        100.0,
        0.01,
        0.9,
        1.0,
        digests,
    )


def test_ranking_is_by_final_smoothed_loss_with_ties_stated_and_the_rest_unranked():
    trials = [
        record("s-c", (("lr", "1"), ("d", "64")), [3.0, 2.0]),
        record("s-a", (("lr", "1"), ("d", "128")), [3.0, 2.0]),  # the same curve as s-c: a tie
        record("s-b", (("lr", "2"), ("d", "64")), [3.0, 1.0]),
        record("s-d", (("lr", "10"), ("d", "128")), [3.0, 400.0], stopped="loss 400 is above 3 x the best 3"),
    ]
    ranked = rank(trials)
    assert [(r.place, r.trial.name) for r in ranked] == [(1, "s-b"), (2, "s-a"), (2, "s-c"), (None, "s-d")]
    assert ranked[1].note == "tie with s-c" and ranked[2].note == "tie with s-a"
    assert ranked[3].note == "stopped early: loss 400 is above 3 x the best 3"
    assert ranked[0].final_loss == pytest.approx(smooth([3.0, 1.0])[-1])
    assert rank(list(reversed(trials))) == ranked
    by_key = {(e.key, e.value): (e.mean_loss, e.trials) for e in effects(ranked, ["lr", "d"])}
    final_c = smooth([3.0, 2.0])[-1]
    assert by_key[("lr", "1")] == (pytest.approx(final_c), 2)
    assert by_key[("lr", "10")] == (None, 0)
    assert by_key[("d", "64")] == (pytest.approx((final_c + ranked[0].final_loss) / 2), 2)
    text = table_text("s", ranked, ["lr", "d"])
    assert "best: s-b (lr=2 d=64)" in text and "lr=10: - (n=0)" in text


def test_trials_with_validation_losses_rank_by_them_and_show_the_training_loss_beside():
    from dataclasses import replace

    trials = [
        replace(record("s-a", (("obj", "causal"),), [3.0, 1.0]), val_loss=2.5),
        replace(record("s-b", (("obj", "ul2"),), [3.0, 2.0]), val_loss=2.0),
    ]
    ranked = rank(trials)  # training losses of different objectives say nothing: val/loss decides
    assert [(r.place, r.trial.name, r.score) for r in ranked] == [(1, "s-b", 2.0), (2, "s-a", 2.5)]
    text = table_text("s", ranked, ["obj"])
    assert "ranked by final validation loss" in text and "val loss" in text.splitlines()[1]
    # One finished trial without a validation set: all rank by the training loss, and say so.
    mixed = [trials[0], record("s-c", (("obj", "prefix"),), [3.0, 1.5])]
    assert [r.trial.name for r in rank(mixed)] == ["s-a", "s-c"]
    assert "ranked by final smoothed training loss" in table_text("s", rank(mixed), ["obj"])
    with pytest.raises(ValueError, match="ranked by val/loss or loss"):
        rank(trials, "accuracy")


def test_the_law_is_fitted_through_the_best_trial_at_each_size_at_its_final_loss():
    from wildtrain.sweeps.predict import final_loss, fit_points

    trial = dataclasses.replace(record("a", (), [9.0] * 10 + [4.0] * 8 + [3.0, 1.0]), val_loss=2.5)
    assert final_loss(trial, "val/loss") == 2.5
    assert final_loss(trial, "loss") == 2.0, "the mean of the last tenth of its logged losses"
    assert final_loss(record("b", (), [7.0]), "loss") == 7.0
    # a and b: the same size and tokens (their last logged token count), b the better.
    trials = [
        record("a", (), [3.0, 3.0]),
        record("b", (), [5.0, 2.0]),
        record("c", (), [5.0, 5.0]),
        record("d", (), [float("nan")] * 2),
    ]
    assert fit_points(trials, {"a": 10, "b": 10, "c": 20, "d": 30}, "loss") == ([10, 20], [1, 1], [2.0, 5.0])


def test_smoothing_starts_at_the_first_value():
    assert smooth([4.0, 4.0, 4.0]) == pytest.approx([4.0, 4.0, 4.0])


def test_trials_on_other_data_are_flagged():
    trials = [record("a", (), [1.0]), record("b", (), [1.0], digests=("d2",))]
    assert differing_data(trials) == ["b"]
    assert "warning: trained on other data than" in table_text("s", rank(trials), [])


def promoted_model(target: str, base: str = "125m"):
    """The model `promote --to model=<target>` builds from a trial of shape `base`, on the meta
    device (shapes only), with its transfer."""
    trial = load_config([f"model={base}"])
    rule = transfer(trial.model, trial.optim.hidden_lr_mult, load_config([f"model={target}"]).model)
    cfg = load_config([f"model={target}", *(f"{k}={v}" for k, v in rule.overrides().items())])
    with torch.device("meta"):
        return Transformer(cfg.model), cfg.optim, rule


# Tensor Programs V (Yang et al. 2022), Table 3 and its equivalent Table 8 for Adam, with the
# width of each matrix its own fan-in, relative to the base (proxy) model:
#   hidden weights: init var ~ 1/fan_in, Adam LR ~ 1/fan_in;
#   input weights (embedding; fan-in the vocabulary): init and LR unchanged;
#   output weights: init and LR unchanged, logits multiplied by 1/width multiplier;
#   attention logits ~ 1/d_head instead of 1/sqrt(d_head), equal to it at the base's d_head;
# and depth-muP for Adam (Tensor Programs VI): residual branches and hidden LRs x 1/sqrt(m_L).
# Written out from the 125m preset (d 768, ffn_dim 1024, d_head 64, 12 layers) to each larger
# preset: wq..w3 have fan-in d, w2 fan-in ffn_dim.
TP5 = {
    # d 2048, ffn_dim 5472 (8/3 d rounded up to 32), d_head 128, 24 layers: m_L = 2
    "1.3b": dict(
        lr_d=768 / 2048 / math.sqrt(2),
        lr_ffn=1024 / 5472 / math.sqrt(2),
        std_d=math.sqrt(768 / 2048),
        std_ffn=math.sqrt(1024 / 5472),
        output=768 / 2048,
        residual=1 / math.sqrt(2),
        attention=1 / 128 * math.sqrt(64),
    ),
    # d 4096, ffn_dim 11008, d_head 128, 32 layers: m_L = 8/3
    "7b": dict(
        lr_d=768 / 4096 / math.sqrt(32 / 12),
        lr_ffn=1024 / 11008 / math.sqrt(32 / 12),
        std_d=math.sqrt(768 / 4096),
        std_ffn=math.sqrt(1024 / 11008),
        output=768 / 4096,
        residual=1 / math.sqrt(32 / 12),
        attention=1 / 128 * math.sqrt(64),
    ),
    # d 6144, ffn_dim 18432, d_head 128 (grouped-query: wk, wv still have fan-in d), 48 layers: m_L = 4
    "21b": dict(
        lr_d=768 / 6144 / 2,
        lr_ffn=1024 / 18432 / 2,
        std_d=math.sqrt(768 / 6144),
        std_ffn=math.sqrt(1024 / 18432),
        output=768 / 6144,
        residual=1 / 2,
        attention=1 / 128 * 8,
    ),
}


@pytest.mark.parametrize("target", TP5)
def test_promoted_presets_follow_the_tensor_programs_v_table_per_matrix(target):
    table = TP5[target]
    model, optim, rule = promoted_model(target)
    # The learning rate each matrix trains at, as the optimizer is built, a multiple of optim.lr.
    lr_of = {
        id(p): group.get("lr", optim.lr) / optim.lr for group in param_groups(model, optim) for p in group["params"]
    }
    hidden = [
        (name.removesuffix(".weight"), w)
        for layer in model.layers
        for name, w in layer.named_parameters()
        if w.ndim == 2
    ]
    assert {name for name, _ in hidden} == {
        "attention.wq",
        "attention.wk",
        "attention.wv",
        "attention.wo",
        "feed_forward.w1",
        "feed_forward.w3",
        "feed_forward.w2",
    }
    for name, weight in hidden:
        kind = "ffn" if name == "feed_forward.w2" else "d"
        assert lr_of[id(weight)] == pytest.approx(table[f"lr_{kind}"], rel=1e-9), name
    for name, _ in hidden:
        kind = "ffn" if name == "feed_forward.w2" else "d"
        assert model.scaling.init_std(name, 1.0) == pytest.approx(table[f"std_{kind}"], rel=1e-9), name
    for kept in (model.tok_embeddings.weight, model.output.weight, model.norm.weight):
        assert lr_of[id(kept)] == 1.0
    assert model.scaling.output_mult == pytest.approx(table["output"], rel=1e-9)
    assert model.scaling.residual_mult == pytest.approx(table["residual"], rel=1e-9)
    assert model.layers[0].attention.scale == pytest.approx(table["attention"], rel=1e-9)
    # The trial's own multipliers are what the big run keeps, at the base's shape.
    assert (rule.base_dim, rule.base_ffn_dim, rule.base_head_dim, rule.base_n_layers) == (768, 1024, 64, 12)
    assert (rule.hidden_lr_mult, rule.output_mult, rule.residual_mult, rule.hidden_init_std) == (1.0, 1.0, 1.0, 0.02)


def test_transfer_composes_through_an_intermediate_size():
    small, mid, big = (load_config([f"model={m}"]).model for m in ("125m", "1.3b", "7b"))
    step = transfer(small, 1.0, mid)
    mid = dataclasses.replace(
        mid,
        **{key.removeprefix("model."): value for key, value in step.overrides().items() if key.startswith("model.")},
    )
    through = transfer(mid, step.hidden_lr_mult, big)
    direct = transfer(small, 1.0, big)
    assert through == direct
    assert (through.base_dim, through.base_n_layers) == (768, 12)


def test_the_big_runs_choices_replace_the_trials_own():
    from wildtrain.sweeps.promote import overridden

    assert overridden("model.dim", ["model=7b"]) and overridden("model.dim", ["model.dim=4096"])
    assert overridden("model", ["model=7b"]) and overridden("optim.lr", ["optim={lr: 1}"])
    assert not overridden("model.dim", ["model.dims=1", "optim.lr=1"])
    # A group choice replaces only what its file sets: conf/model/7b.yaml sets no mask.
    assert not overridden("model.attention", ["model=7b"]) and not overridden("model", ["model.dim=4096"])
    # conf/cluster/gpu.yaml sets a key of another section too.
    assert overridden("checkpoint.reshard_ahead", ["cluster=gpu"])
    assert not overridden("cluster.ray_address", ["cluster=gpu"])


def test_a_sweep_on_data_that_is_not_there_fails_before_any_trial_or_parent_run(tmp_path):
    from mlflow.tracking import MlflowClient

    from wildtrain.data.dataset import DataError
    from wildtrain.sweeps.execute import run_sweep

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    missing = tmp_path / "no-such-dataset"
    plan = plan_sweep(
        "broken",
        ["optim.lr=1e-3,3e-3"],
        ["experiment=tiny", f"tracking.uri={uri}", f"data.datasets=[{{uri: {missing}}}]"],
        steps=2,
    )
    with pytest.raises(DataError, match=str(missing)):
        run_sweep(plan, say=lambda line: None)
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(plan.trials[0].cfg.tracking.experiment)
    assert experiment is None or not client.search_runs([experiment.experiment_id])


def test_the_early_stop_rules_best_loss_survives_a_restart_through_the_checkpoint():
    from wildtrain.train.state import TrainState

    state = TrainState(step=12, tokens_seen=96, world_size=2)
    state.best_loss = judge_loss(2.5, state.best_loss, 3.0).best
    restored = TrainState.from_json(state.to_json())
    assert restored.best_loss == 2.5
    assert judge_loss(9.0, restored.best_loss, 3.0).reason == "loss 9 is above 3 x the best 2.5"
    # A checkpoint written before the rule kept its best: the restart starts afresh.
    assert TrainState.from_json('{"step": 12, "tokens_seen": 96, "world_size": 2}').best_loss == math.inf


# Hashes of the moved keys' old spelling, pinned anew at each new, removed key or default (one
# changes every hash: it may change what a trial trains): first at 7ba7460, before
# train.checkpoint_every, cluster.reshard_ahead and cluster.capacity_wait_s moved to
# checkpoint.every, checkpoint.reshard_ahead and elastic.capacity_wait_s; then without
# chaos.min_step_s and chaos.short_step_s (tests pace their drills with tests/helpers/pacing.py);
# last with elastic.in_process on by default (issue 58: with it false, the hashes before).
PINNED = {"trial": "282315a818", "config": "d0fe6351c5b5b1d8"}
MOVED_OLD = ["train.checkpoint_every=7", "cluster.reshard_ahead=false", "cluster.capacity_wait_s=33"]
MOVED_NEW = ["checkpoint.every=7", "checkpoint.reshard_ahead=false", "elastic.capacity_wait_s=33"]


@pytest.mark.parametrize("moved", [MOVED_OLD, MOVED_NEW], ids=["old names", "new names"])
def test_a_finished_trial_hashes_as_it_did_before_its_keys_moved(moved):
    from wildtrain.config import config_hash
    from wildtrain.sweeps.grid import trial_hash

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        # eval.every=20: the tiny experiment's value at 7ba7460 (it validates at its last step since).
        cfg = load_config(["experiment=tiny", "cluster=gpu", "eval.every=20", *moved])
    assert (trial_hash(cfg), config_hash(cfg)) == (PINNED["trial"], PINNED["config"])
    assert trial_hash(cfg) != trial_hash(
        load_config(
            [
                "experiment=tiny",
                "cluster=gpu",
                "checkpoint.every=8",
                "checkpoint.reshard_ahead=false",
                "elastic.capacity_wait_s=33",
            ]
        )
    )
