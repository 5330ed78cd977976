"""Every leaf setting fuzzed (issue 59): boundary and wrong-type values (0, -1, huge, NaN, inf,
empty, wrong type, wrong nesting) as command-line overrides are either taken or refused with a
ConfigError of one line that starts with a key path, never another exception; through
`wildtrain config`, exit 0 or exit 2 with one line. The values the checks take at the edges of
what each setting declares train a step of the tiny model on the CPU to finite weights."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import warnings

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.conftest import REPO
from wildtrain import services
from wildtrain.cli import main
from wildtrain.config import Config, ConfigError, flatten, load_config
from wildtrain.config.allowed import allowed_of, field_types

# Every leaf key, list items' included (data.datasets.0.uri, objective.denoisers.0.kind).
KEYS = sorted(flatten(Config()))
SECTIONS = [f.name for f in dataclasses.fields(Config)]
# What a refusal starts with: the key at fault (`data.datasets.0.uri: ...`).
KEY_PATH = re.compile(rf"({'|'.join(SECTIONS)})(\.\w+)*: ")

HUGE = [str(2**63), str(2**64), "9" * 40, "1e308", "1e309", "-1e309"]
BOUNDARY = ["0", "-1", "1", "0.5", "-0.0", "1e-300", "nan", "inf", "-inf", ".nan", ".inf", *HUGE]
WRONG_TYPE = ["''", "' '", "abc", "true", "null", "'1'", "???", "${nope}", "${model.dim}", "'a\\nb'", "'\\ud83d'"]
WRONG_NESTING = ["[]", "{}", "[1, 2]", "[[1]]", "{a: 1}", "{a: {b: 1}}", "[{uri: x}]", "{uri: x, weight: 0}"]
VALUES = st.one_of(
    st.sampled_from(BOUNDARY + WRONG_TYPE + WRONG_NESTING),
    st.integers().map(str),
    st.floats().map(repr),
    st.text(max_size=12),
)
FUZZ = settings(
    derandomize=True, deadline=None, max_examples=100, suppress_health_check=[HealthCheck.too_slow], database=None
)


def loads_or_refuses_in_one_line(overrides: list[str]) -> None:
    """`load_config` takes `overrides` or raises a one-line ConfigError naming a key; any other
    exception fails the test with its traceback."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the old names of moved keys
        try:
            load_config(["experiment=tiny", *overrides])
        except ConfigError as e:
            message = str(e)
            assert "\n" not in message, message
            assert KEY_PATH.match(message), message


@FUZZ
@given(key=st.sampled_from(KEYS), value=VALUES)
@example(key="elastic.max_workers", value=str(10**12))  # tried every world size up to it
@example(key="elastic.max_workers", value="100000")  # listed them all in one line
@example(key="train.seed", value=str(2**64))
@example(key="model.n_heads", value="0")
@example(key="data.datasets", value="[]")
def test_every_leaf_setting_takes_a_value_or_refuses_it_in_one_line(key, value):
    loads_or_refuses_in_one_line([f"{key}={value}"])


@settings(FUZZ, max_examples=40)
@given(key=st.sampled_from(KEYS), below=st.sampled_from(["x", "0", "a.b"]), value=st.sampled_from(["1", "{a: 1}"]))
def test_a_key_below_a_leaf_is_refused_in_one_line(key, below, value):
    loads_or_refuses_in_one_line([f"{key}.{below}={value}"])


@settings(FUZZ, max_examples=30)
@given(key=st.sampled_from(KEYS), value=st.sampled_from(BOUNDARY + WRONG_TYPE + WRONG_NESTING))
def test_wildtrain_config_exits_0_or_2_with_one_line(key, value):
    result = CliRunner().invoke(main, ["config", "experiment=tiny", f"{key}={value}"])
    assert result.exit_code in (0, 2), result.output
    assert "Traceback" not in result.output
    if result.exit_code == 2:
        assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("wildtrain: "), result.stderr


def test_a_huge_group_is_refused_before_its_world_sizes_are_tried():
    with pytest.raises(ConfigError, match=r"^elastic.max_workers: 1000000000000 workers need at least one sequence"):
        load_config(["experiment=tiny", f"elastic.max_workers={10**12}"])
    with pytest.raises(ConfigError) as e:
        load_config(["experiment=tiny", "train.global_batch_size=1000", "elastic.max_workers=1000"])
    assert "at world size 3, 6, 7, 9, 11, 12, 13, 14 and 976 more with" in str(e.value)


def edges(section: type, prefix: str) -> list[str]:
    """Overrides at the numeric edges each setting of `section` declares: its lower bound (or
    just above it), its upper (or just below), its special value."""
    overrides = []
    for f in dataclasses.fields(section):
        allowed, declared = allowed_of(f), field_types(section)[f.name]
        if allowed is None or allowed.choices or allowed.nonempty:
            continue
        whole = int in (declared, *getattr(declared, "__args__", ()))
        step = 1 if whole else 1e-6
        values = [
            allowed.special and allowed.special[0],
            allowed.ge,
            allowed.gt is not None and allowed.gt + step,
            allowed.le,
            allowed.lt is not None and allowed.lt - step,
        ]
        overrides += [f"{prefix}{f.name}={int(v) if whole else v}" for v in values if v is not None and v is not False]
    return overrides


def step_configs() -> list[list[str]]:
    """Per section a step trains with, the most of its edge values one config takes together
    (each added if the checks take it with those before)."""
    configs = []
    for name in ("model", "optim", "train", "data"):
        taken: list[str] = []
        for override in edges(field_types(Config)[name], f"{name}."):
            try:
                load_config(["experiment=tiny", "data.seq_len=16", *taken, override])
            except ConfigError:
                continue
            taken.append(override)
        configs.append(taken)
    return configs


ONE_STEP = """
import json, sys, warnings
import torch
import torch.distributed as dist
from wildtrain.batching import batch_plan
from wildtrain.config import load_config
from wildtrain.engine import EngineSettings, build_engine, build_model
from wildtrain.model import flops_per_token
from wildtrain.tracking.worker.mfu import Peak
from wildtrain.train.step import StepMetrics, model_inputs, train_step

warnings.simplefilter("ignore")
dist.init_process_group("gloo")
for overrides in json.loads(sys.argv[1]):
    cfg = load_config(["experiment=tiny", "data.seq_len=16", *overrides])
    plan = batch_plan(cfg.train.global_batch_size, cfg.train.micro_batch_size, 1)
    torch.manual_seed(cfg.train.seed)
    cpu = torch.device("cpu")
    settings = EngineSettings(cfg.model, cfg.optim, cfg.deepspeed, cfg.train.steps, cfg.elastic.collective_timeout_s)
    engine = build_engine(settings, plan, build_model(settings, plan, cpu), cpu)
    seq = cfg.data.seq_len
    tokens = torch.randint(0, cfg.model.vocab_size, (plan.global_batch_size, seq + 1))
    window = StepMetrics(plan.global_batch_size * seq, flops_per_token(cfg.model, seq), Peak(1e12, "config"), 1, cpu)
    train_step(engine, plan, tokens, window)
    finite = all(bool(torch.isfinite(p).all()) for p in engine.module.parameters())
    loss = engine(**model_inputs(tokens[: plan.micro_batch_size]))
    print(json.dumps({"overrides": overrides, "finite": finite and bool(torch.isfinite(loss))}), flush=True)
"""


def test_the_edges_the_checks_take_train_a_step_on_the_cpu_to_finite_weights():
    configs = step_configs()
    assert all(configs) and "optim.eps=1e-06" in configs[1]
    env = os.environ | dict(
        PYTHONPATH=str(REPO / "platform"),
        DS_ACCELERATOR="cpu",
        MASTER_ADDR=services.HOST,
        MASTER_PORT=str(services.free_port()),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        OMP_NUM_THREADS="1",
    )
    done = subprocess.run(
        [sys.executable, "-c", ONE_STEP, json.dumps(configs)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["overrides"] for r in results] == configs
    assert all(r["finite"] for r in results), results
