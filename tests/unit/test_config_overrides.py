"""Overrides as a user types them, fuzzed over every key of the Config schema: sections,
fields, items of lists (data.datasets, objective.denoisers), entries of mappings
(cluster.worker_resources, run.tags). A good one loads; a bad one (unknown key, wrong type,
malformed syntax) is a ConfigError of one line that starts with the key at fault, and
`wildtrain config` turns it into exit 2 with that line."""

from __future__ import annotations

import json
import typing
from dataclasses import is_dataclass

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from wildtrain.cli import main
from wildtrain.config import GROUPS, Config, ConfigError, flatten, load_config, redact

FUZZ = settings(max_examples=60, deadline=None)


def _required(typ):
    args = [a for a in typing.get_args(typ) if a is not type(None)]
    return (args[0], True) if typing.get_origin(typ) is typing.Union else (typ, False)


def _keys(typ=Config, prefix: str = "") -> list[tuple[str, object]]:
    """(key, declared type) of everything settable: each section, field, list item 0 with
    its fields, and a new entry `w` of each mapping."""
    found = []
    for name, declared in typing.get_type_hints(typ).items():
        key = prefix + name
        found.append((key, declared))
        inner, _ = _required(declared)
        if is_dataclass(inner):
            found += _keys(inner, key + ".")
        elif typing.get_origin(inner) is list:
            item = typing.get_args(inner)[0]
            found.append((f"{key}.0", item))
            if is_dataclass(item):
                found += _keys(item, f"{key}.0.")
        elif typing.get_origin(inner) is dict:
            found.append((f"{key}.w", typing.get_args(inner)[1]))
    return found


KEYS = _keys()
DEFAULTS = OmegaConf.structured(load_config([]))


def _render(value) -> str:
    """A value as override text (JSON is YAML's flow style)."""
    return json.dumps(OmegaConf.to_container(value) if OmegaConf.is_config(value) else value)


# Text no YAML reads as a number, a bool or null.
WORD = st.text("qxzjkv", min_size=2, max_size=6)


def _wrong_values(declared) -> st.SearchStrategy[str]:
    """Override values the declared type cannot hold."""
    inner, optional = _required(declared)
    missing = [] if optional else [""]  # `key=` is null
    if is_dataclass(inner):
        names = list(typing.get_type_hints(inner))
        return st.one_of(
            st.sampled_from(["3", "[1]", *missing]),
            WORD,
            WORD.filter(lambda w: w not in names).map(lambda w: f"{{{w}: 1}}"),
            st.sampled_from(names).map(lambda n: f"{{{n}: {{a: [1]}}}}"),
        )
    if typing.get_origin(inner) is list:
        item, _ = _required(typing.get_args(inner)[0])
        bad_items = ["[1]", "[{nope: 1}]"] if is_dataclass(item) else ["[[a]]", "[{a: 1}]"]
        return st.one_of(st.sampled_from(["{a: 1}", "3", *bad_items, *missing]), WORD)
    if typing.get_origin(inner) is dict:
        bad_entries = ["{w:1}", "{w: [1]}", "{w: {a: 1}}", "{1: a}"]
        return st.one_of(st.sampled_from(["[1]", "3", *bad_entries, *missing]), WORD)
    if inner is str:
        return st.sampled_from(["[1]", "{a: 1}", "[a, b]", *missing])
    scalar = {
        int: ["1.5", "1e3", "true", "[1]", "{a: 1}"],
        float: ["true", "[1]", "{a: 1}"],
        bool: ["1.5", "[1]", "{a: 1}"],
    }[inner]
    return st.one_of(st.sampled_from([*scalar, *missing]), WORD)


def _wrong_typed(key_and_type) -> st.SearchStrategy[str]:
    key, declared = key_and_type
    return _wrong_values(declared).map(lambda value: f"{key}={value}")


def _unknown_key(key_and_type) -> st.SearchStrategy[str]:
    key, declared = key_and_type
    inner, _ = _required(declared)
    if is_dataclass(inner):
        names = typing.get_type_hints(inner)
        return WORD.filter(lambda w: w not in names).map(lambda w: f"{key}.{w}=1")
    if typing.get_origin(inner) is list:  # not an item number, or past the end
        return st.sampled_from([f"{key}.x=1", f"{key}.99=1", f"{key}.0.1.2=1"])
    if typing.get_origin(inner) is dict:
        return st.just(f"{key}.w.x=1")
    return st.just(f"{key}.x=1")  # below a scalar


MALFORMED = st.sampled_from(
    [
        "train.steps",
        "=1",
        "=",
        ".train=1",
        "train.=1",
        "train..steps=1",
        "train.steps=[",
        "train.steps={",
        "run.name=]",
        "run.name='open",
        "run.name=a: b: c",
        "run.name=!!python/object:os.system",
        "train.steps=${",
        "train.steps=${nope}",
        "run.name=${nope.x}",
        "train.steps=???",
        "run.name=???",
        "data.datasets.0.uri=${oops:1}",
        "data.validation=${run.tags}",
        "run.tags=${data.datasets}",
        "cluster.worker_resources.a[0]=1",
        "run.tags.a]=b",
        "model=",
        "model=nope",
        "model=../config",
        "model=a/b",
        "experiment=",
        "experiment=../config.yaml",
        "deepspeed=zero1 ",
        "train .steps=1",
    ]
)

BAD = st.one_of(
    st.sampled_from(KEYS).flatmap(_wrong_typed),
    st.sampled_from(KEYS).flatmap(_unknown_key),
    WORD.map(lambda w: f"{w}=1"),  # an unknown section
    MALFORMED,
)


def _names_the_key(message: str, item: str) -> bool:
    key = item.partition("=")[0]
    return message.startswith((f"{key}: ", f"{key}.", f"{item}: "))


@FUZZ
@given(BAD)
def test_a_bad_override_is_one_line_naming_its_key(item):
    with pytest.raises(ConfigError) as e:
        load_config([item])
    message = str(e.value)
    assert "\n" not in message
    assert _names_the_key(message, item), message


@settings(max_examples=25, deadline=None)
@given(BAD)
def test_wildtrain_config_exits_2_with_that_line(item):
    with pytest.raises(ConfigError) as e:
        load_config([item])
    done = CliRunner().invoke(main, ["config", item])
    assert done.exit_code == 2, done.output
    assert done.stdout == ""
    assert done.stderr == f"wildtrain: {redact(str(e.value))}\n"


# Every key set to its default value: `model=...` chooses a file of conf/model/, so a
# group's section is set key by key.
GIVEN_DEFAULTS = [
    f"{key}={_render(OmegaConf.select(DEFAULTS, key))}"
    for key, _ in KEYS
    if key not in GROUPS and OmegaConf.select(DEFAULTS, key, default=KeyError) is not KeyError
]
DEFAULT_FLAT = flatten(load_config([]))


def test_every_key_set_to_its_default_at_once_loads_unchanged():
    assert len(GIVEN_DEFAULTS) > 100
    assert flatten(load_config(GIVEN_DEFAULTS)) == DEFAULT_FLAT


def test_an_item_of_a_list_set_on_its_own_loads():
    # At once, `data.datasets=[...]` before `data.datasets.0=...` hides what one item alone does.
    items = [item for item in GIVEN_DEFAULTS if ".0" in item.partition("=")[0]]
    assert len(items) >= 8
    for item in items:
        assert flatten(load_config([item])) == DEFAULT_FLAT, item


STR_KEYS = [key for key, declared in KEYS if _required(declared)[0] is str and not key.startswith("eval.tasks")]


@settings(max_examples=10, deadline=None)
@given(
    st.sampled_from(STR_KEYS),
    st.text(st.characters(codec="utf-8", exclude_characters="$\\", exclude_categories=["Cc", "Cs"]), max_size=12),
)
def test_any_text_for_a_text_key_loads_as_given_or_is_refused_naming_it(key, text):
    try:
        cfg = load_config([f"{key}={json.dumps(text)}"])
    except ConfigError as e:
        assert _names_the_key(str(e), key) and "\n" not in str(e), str(e)
    else:
        assert OmegaConf.select(OmegaConf.structured(cfg), key) == text


@pytest.mark.parametrize(
    "item, key, value",
    [
        ("cluster.worker_resources={w: 1}", "cluster.worker_resources", {"w": 1.0}),
        ("cluster.worker_resources.trainer=2", "cluster.worker_resources", {"trainer": 2.0}),
        ("data.datasets.0.weight=2", "data.datasets.0.weight", 2.0),
        ("data.datasets=[{uri: s3://a}, {uri: s3://b, weight: 2}]", "data.datasets.1.weight", 2.0),
        ("objective.denoisers.1={corruption: 0.5}", "objective.denoisers.1.corruption", 0.5),
        ("run.tags={wildtrain.trial: abc}", "run.tags", {"wildtrain.trial": "abc"}),
        ("model.n_kv_heads=", "model.n_kv_heads", None),
    ],
)
def test_items_and_entries_can_be_set(item, key, value):
    assert OmegaConf.select(OmegaConf.structured(load_config([item])), key) == value


@pytest.mark.parametrize(
    "item, message",
    [
        (
            "cluster.worker_resources={w:1}",
            "cluster.worker_resources: {w:1} reads as the key 'w:1' without a value: write {w: 1}",
        ),
        (
            "data.datasets=[{uri: a, wieght: 1}]",
            "data.datasets.0.wieght: unknown key (did you mean data.datasets.0.weight?)",
        ),
        (
            "data.datasets.3.uri=a",
            "data.datasets.3.uri: data.datasets has 1 item (0); set the whole list: data.datasets=[...]",
        ),
        ("train.steps.x=1", "train.steps.x: train.steps (int) has no keys below it"),
        ("foo.bar=1", "foo.bar: unknown key foo"),
        ("eval.tasks=[[hellaswag]]", "eval.tasks.0: expected str, got ['hellaswag'] (list)"),
        ("run.tags={a: [1]}", "run.tags.a: expected str, got [1] (list)"),
    ],
)
def test_errors_name_the_full_key(item, message):
    with pytest.raises(ConfigError) as e:
        load_config([item])
    assert str(e.value) == message


def test_a_yaml_file_s_error_inside_a_list_names_its_full_key(tmp_path):
    conf = tmp_path / "conf"
    (conf / "data").mkdir(parents=True)
    (conf / "config.yaml").write_text("defaults:\n  data: typo\n")
    (conf / "data" / "typo.yaml").write_text("datasets:\n  - uri: s3://a\n  - uri: s3://b\n    wieght: 2\n")
    with pytest.raises(ConfigError) as e:
        load_config([], conf_dir=conf)
    assert str(e.value) == "data.datasets.1.wieght: unknown key (did you mean data.datasets.1.weight?)"
