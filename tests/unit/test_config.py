import re

import pytest

from wildtrain.config import Config, ConfigError, config_hash, flatten, group_keys, load_config


def test_defaults_load_and_validate():
    cfg = load_config([])
    assert isinstance(cfg, Config)
    assert cfg.model.name == "tiny"
    assert cfg.deepspeed.zero_stage == 1


def test_layers_apply_in_order_experiment_then_groups_then_dotlist():
    cfg = load_config(["experiment=tiny", "model=125m", "deepspeed=zero3", "train.steps=7"])
    assert cfg.run.name == "tiny"  # from the experiment's deltas
    assert cfg.model.name == "125m" and cfg.model.dim == 768  # group chosen on the command line
    assert cfg.deepspeed.zero_stage == 3
    assert cfg.train.steps == 7  # the dotlist wins over the experiment's 60


def test_experiment_can_choose_groups(tmp_path):
    conf = tmp_path / "conf"
    for group in ("model", "deepspeed", "data", "cluster"):
        (conf / group).mkdir(parents=True)
    (conf / "experiment").mkdir()
    (conf / "config.yaml").write_text("defaults:\n  deepspeed: zero1\n")
    (conf / "deepspeed" / "zero1.yaml").write_text("zero_stage: 1\n")
    (conf / "deepspeed" / "zero2.yaml").write_text("zero_stage: 2\n")
    (conf / "experiment" / "big.yaml").write_text("defaults:\n  deepspeed: zero2\ntrain:\n  steps: 3\n")
    cfg = load_config(["experiment=big"], conf_dir=conf)
    assert cfg.deepspeed.zero_stage == 2 and cfg.train.steps == 3
    assert load_config(["experiment=big", "deepspeed=zero1"], conf_dir=conf).deepspeed.zero_stage == 1


def test_unknown_key_names_full_path_and_suggests():
    with pytest.raises(ConfigError) as e:
        load_config(["train.micro_batch=3"])
    assert str(e.value) == "train.micro_batch: unknown key (did you mean train.micro_batch_size?)"


def test_unknown_key_in_a_yaml_file_names_full_path(tmp_path):
    conf = tmp_path / "conf"
    (conf / "experiment").mkdir(parents=True)
    (conf / "config.yaml").write_text("{}\n")
    (conf / "experiment" / "typo.yaml").write_text("optim:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"^optim\.learning_rate: unknown key"):
        load_config(["experiment=typo"], conf_dir=conf)


def test_wrong_type_names_key_and_type():
    with pytest.raises(ConfigError) as e:
        load_config(["train.steps=abc"])
    assert str(e.value) == "train.steps: expected int, got 'abc' (str)"


def test_unknown_group_choice_lists_the_available_ones():
    with pytest.raises(ConfigError, match=r"model=nope: no such file .* \(available: .*tiny"):
        load_config(["model=nope"])


def test_override_without_equals_is_rejected():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(["train.steps"])


def test_unreachable_global_batch_lists_the_world_sizes():
    with pytest.raises(ConfigError) as e:
        load_config(["train.global_batch_size=6", "train.micro_batch_size=2", "elastic.max_workers=4"])
    assert str(e.value).startswith("train.global_batch_size: 6 sequences cannot be split evenly at world size 4")


def test_min_workers_above_max_workers_is_rejected():
    with pytest.raises(ConfigError, match="^elastic.max_workers"):
        load_config(["elastic.min_workers=3", "elastic.max_workers=2"])


def test_a_negative_join_batch_is_rejected_naming_the_key():
    with pytest.raises(ConfigError, match=r"^elastic.join_batch_s: must be 0 \(each joiner as it asks\) or positive"):
        load_config(["elastic.join_batch_s=-1"])


def test_spares_without_in_process_recovery_are_rejected_naming_the_key():
    with pytest.raises(ConfigError, match=r"^elastic.spares: 1 spares need elastic.in_process=true"):
        load_config(["elastic.spares=1", "elastic.in_process=false"])
    assert load_config(["elastic.spares=1"]).elastic.spares == 1  # in-process recovery is the default


def test_seq_len_longer_than_the_model_is_rejected():
    with pytest.raises(ConfigError, match="^data.seq_len"):
        load_config(["data.seq_len=4096"])


@pytest.mark.parametrize(
    "key, bad, choices",
    [
        ("checkpoint.policy", "drop", "skip, queue"),
        ("checkpoint.background", "fork", "process, thread"),
        ("early_stop.metric", "val/acc", "loss, val/loss"),
        ("cluster.placement_strategy", "STRICT_PACK", "auto, PACK, SPREAD, STRICT_SPREAD, NODE_BUNDLES"),
    ],
)
def test_a_value_outside_its_choices_names_the_key_the_value_and_the_choices(key, bad, choices):
    with pytest.raises(ConfigError) as e:
        load_config([f"{key}={bad}"])
    assert str(e.value) == f"{key}: expected one of {choices}, got {bad!r}"


def test_a_partial_base_model_shape_is_rejected_naming_the_missing_key():
    # Also what an experiment promoted before per-matrix muP holds: base_dim and base_n_layers
    # beside multipliers already scaled, which scaling from the base again would compound.
    with pytest.raises(
        ConfigError,
        match=r"^model\.base_ffn_dim: .* all set or none \(set: model\.base_dim, "
        r"model\.base_n_layers\)",
    ):
        load_config(["model.base_dim=64", "model.base_n_layers=1"])
    with pytest.raises(ConfigError, match=r"^model\.base_head_dim: must be positive"):
        load_config(["model.base_dim=64", "model.base_ffn_dim=96", "model.base_head_dim=0", "model.base_n_layers=1"])
    load_config(["model.base_dim=64", "model.base_ffn_dim=96", "model.base_head_dim=16", "model.base_n_layers=1"])


def test_flatten_and_hash_follow_the_values():
    a, b = load_config([]), load_config(["train.steps=61"])
    assert flatten(a)["train.steps"] == 60 and flatten(b)["train.steps"] == 61
    assert config_hash(a) != config_hash(b) and config_hash(a) == config_hash(load_config([]))


MOVED = [
    ("train.checkpoint_every", "checkpoint.every", "7"),
    ("cluster.reshard_ahead", "checkpoint.reshard_ahead", "true"),
    ("cluster.capacity_wait_s", "elastic.capacity_wait_s", "33"),
]


@pytest.mark.parametrize("old, new, value", MOVED)
def test_a_moved_key_s_old_name_still_loads_and_the_warning_names_its_new_home(old, new, value):
    with pytest.warns(FutureWarning, match=rf"^{old} \(on the command line\) is now {new}; the old name is read"):
        cfg = load_config([f"{old}={value}"])
    assert flatten(cfg) == flatten(load_config([f"{new}={value}"]))
    assert flatten(cfg) != flatten(load_config([]))


def test_a_moved_key_s_old_name_in_a_yaml_file_loads_and_the_warning_names_the_file(tmp_path):
    conf = tmp_path / "conf"
    (conf / "experiment").mkdir(parents=True)
    (conf / "config.yaml").write_text("{}\n")
    old = conf / "experiment" / "old.yaml"
    old.write_text("train:\n  steps: 8\n  checkpoint_every: 4\ncluster:\n  capacity_wait_s: 9\n")
    with pytest.warns(FutureWarning) as warned:
        cfg = load_config(["experiment=old"], conf_dir=conf)
    assert [str(w.message).partition(";")[0] for w in warned] == [
        f"train.checkpoint_every (in {old}) is now checkpoint.every",
        f"cluster.capacity_wait_s (in {old}) is now elastic.capacity_wait_s",
    ]
    assert (cfg.train.steps, cfg.checkpoint.every, cfg.elastic.capacity_wait_s) == (8, 4, 9.0)
    old.write_text("train:\n  checkpoint_every: 4\ncheckpoint:\n  every: 5\n")
    both = rf"^train\.checkpoint_every: now checkpoint\.every, which {re.escape(str(old))} also sets"
    with pytest.raises(ConfigError, match=both):
        load_config(["experiment=old"], conf_dir=conf)


def test_a_moved_key_s_old_name_where_it_is_not_read_is_an_unknown_key_naming_its_new_home():
    with pytest.raises(ConfigError) as e:
        load_config(["train={checkpoint_every: 3}"])
    assert str(e.value) == "train.checkpoint_every: unknown key (now checkpoint.every)"


def test_a_cluster_s_file_sets_whether_its_head_converts_checkpoints_ahead():
    # conf/cluster/ files start with `# @package _global_`: their keys are full paths.
    assert not load_config(["cluster=local"]).checkpoint.reshard_ahead
    gpu = load_config(["cluster=gpu"])
    assert gpu.checkpoint.reshard_ahead and gpu.cluster.name == "gpu" and gpu.cluster.use_gpu
    assert "checkpoint.reshard_ahead" in group_keys("cluster", "gpu") and "cluster.name" in group_keys("cluster", "gpu")
    assert group_keys("deepspeed", "zero2") == ["deepspeed.zero_stage"]


def test_in_process_recovery_needs_a_zero_stage_whose_partitions_the_peers_mirror():
    with pytest.raises(ConfigError, match=r"^elastic\.in_process: .*ZeRO-1, 2 and 3.*zero_stage is 0"):
        load_config(["elastic.in_process=true", "deepspeed.zero_stage=0"])
    for stage in (1, 2, 3):
        load_config(["elastic.in_process=true", f"deepspeed.zero_stage={stage}"])


# Values that crashed a run's workers, trained silently wrong, or were taken for another
# value (n_kv_heads=0 for n_heads), accepted before each setting declared what it allows.
NEWLY_REFUSED = [
    (["model.n_heads=0"], "model.n_heads: must be positive, got 0"),
    (["model.dim=96", "model.n_heads=32"], "model.n_heads: 32 heads split model.dim (96) into heads of 3, an odd size"),
    (["model.vocab_size=0"], "model.vocab_size: must be positive, got 0"),
    (["model.n_layers=0"], "model.n_layers: must be positive, got 0"),
    (["model.n_kv_heads=0"], "model.n_kv_heads: must be positive or null, got 0"),
    (["model.ffn_dim=-1"], "model.ffn_dim: must be positive or null, got -1"),
    (["model.multiple_of=0"], "model.multiple_of: must be positive, got 0"),
    (["model.rope_theta=0"], "model.rope_theta: must be positive, got 0.0"),
    (["model.norm_eps=-1e-5"], "model.norm_eps: must be at least 0, got -1e-05"),
    (["model.hidden_init_std=0"], "model.hidden_init_std: must be positive or null, got 0.0"),
    (["model.init_std=nan"], "model.init_std: must be positive, got nan"),
    (["optim.lr=0"], "optim.lr: must be positive, got 0.0"),
    (["optim.lr=-1"], "optim.lr: must be positive, got -1.0"),
    (["optim.min_lr=-1e-4"], "optim.min_lr: must be at least 0, got -0.0001"),
    (["optim.warmup_steps=-1"], "optim.warmup_steps: must be at least 0, got -1"),
    (["optim.weight_decay=-0.1"], "optim.weight_decay: must be at least 0, got -0.1"),
    (["optim.beta1=1"], "optim.beta1: must be at least 0 and below 1, got 1.0"),
    (["optim.beta2=-0.5"], "optim.beta2: must be at least 0 and below 1, got -0.5"),
    (["optim.eps=-1e-8"], "optim.eps: must be positive, got -1e-08"),
    (["optim.eps=0"], "optim.eps: must be positive, got 0.0"),
    (["train.seed=99999999999999999999"], "train.seed: must fit in a 64-bit integer, got 99999999999999999999"),
    (["optim.grad_clip=-1"], "optim.grad_clip: must be 0 (off) or positive, got -1.0"),
    (["data.datasets=[]"], "data.datasets: must be non-empty, got []"),
    (["data.datasets.0.uri=''"], "data.datasets.0.uri: must be non-empty, got ''"),
    (["data.datasets.0.weight=0"], "data.datasets.0.weight: must be positive, got 0.0"),
    (["data.seq_len=0"], "data.seq_len: must be positive, got 0"),
    (["data.read_cpus=-1"], "data.read_cpus: must be at least 0, got -1.0"),
    (["data.prefetch_blocks=-1"], "data.prefetch_blocks: must be at least 0, got -1"),
    (["train.seed=-1"], "train.seed: must be at least 0, got -1"),
    (["elastic.max_failures=-2"], "elastic.max_failures: must be -1 (no limit) or at least 0, got -2"),
    (["cluster.peak_flops_per_device=0"], "cluster.peak_flops_per_device: must be positive or null, got 0.0"),
    (["monitor.health_min_ratio=1.5"], "monitor.health_min_ratio: must be between 0 and 1 (inclusive), got 1.5"),
    (["storage.max_attempts=-1"], "storage.max_attempts: must be at least 0, got -1"),
]


@pytest.mark.parametrize("overrides, message", NEWLY_REFUSED)
def test_a_value_outside_what_its_setting_declares_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(overrides)
    assert str(e.value).startswith(message)


def test_the_limits_of_the_new_declarations_are_themselves_allowed():
    cfg = load_config(
        [
            "optim.min_lr=0",
            "optim.warmup_steps=0",
            "optim.weight_decay=0",
            "optim.beta1=0",
            "optim.grad_clip=0",
            "train.seed=0",
            "elastic.max_failures=-1",
            "monitor.health_min_ratio=1",
            "storage.max_attempts=0",
            "model.dim=96",
            "model.n_heads=3",
        ]
    )
    assert (cfg.optim.grad_clip, cfg.elastic.max_failures, cfg.model.dim // cfg.model.n_heads) == (0.0, -1, 32)
