import dataclasses
import importlib.util
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

from wildtrain.config import PACKAGE_CONF_DIR, Config, ConfigError, DataConfig, DatasetConfig, flatten, load_config
from wildtrain.config.allowed import Allowed, check_declared, setting
from wildtrain.config.reference import entries, field_comments, first_sentence, render

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reference() -> str:
    return render(PACKAGE_CONF_DIR)


def _row(reference: str, key: str) -> str:
    return next(line for line in reference.splitlines() if line.startswith(f"| `{key}` |"))


def test_every_key_of_the_config_and_of_its_lists_items_is_in_the_reference(reference):
    # data.validation is empty by default: one item shows its keys too.
    cfg = Config(data=DataConfig(validation=[DatasetConfig()]))
    keys = {re.sub(r"\.\d+\.", "[].", key) for key in flatten(cfg)}
    assert {"data.datasets[].uri", "data.validation[].weight", "objective.denoisers[].kind"} <= keys
    missing = [key for key in sorted(keys) if f"| `{key}` |" not in reference]
    assert not missing, f"keys missing from the configuration reference: {missing}"


def test_every_key_has_a_meaning_from_the_comment_above_its_field():
    rows = [row for f in dataclasses.fields(Config) for row in entries(type(getattr(Config(), f.name)), f"{f.name}.")]
    assert [row.key for row in rows if not row.meaning] == []


def test_the_reference_shows_each_declared_constraint_and_the_type_and_default(reference):
    assert _row(reference, "model.n_heads") == (
        "| `model.n_heads` | int | `4` | positive | Attention (query) heads: they divide dim into heads of an even "
        "size, as rotary embeddings rotate pairs of a head's dimensions. |"
    )
    assert "| one of causal, prefix_lm, ul2 |" in _row(reference, "train.objective")
    assert "| 0 (the last step only) or positive |" in _row(reference, "eval.every")
    limit = "| float or null | `null` | positive (below 1: a share of each task) or null |"
    assert limit in _row(reference, "eval.limit")
    assert "| list of items (below) | 1 item of the defaults below | non-empty |" in _row(reference, "data.datasets")
    assert "| `run.name` | str | `demo` | any |" in _row(reference, "run.name")


def test_the_reference_lists_the_config_groups_and_their_choices(reference):
    groups = reference[reference.index("## Config groups") :]
    assert "| `model` | `1.3b`, `125m`, `21b`, `7b`, `tiny` | `tiny` |" in groups
    assert "`checkpoint.reshard_ahead`" in _row(groups, "cluster")
    assert "| `experiment` | `tiny` | none |" in groups


def test_the_docs_hook_puts_the_reference_in_place_of_its_marker():
    path = REPO / "docs" / "hooks" / "config_reference.py"
    spec = importlib.util.spec_from_file_location("config_reference_hook", path)
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = (REPO / "docs" / "configuration.md").read_text()
    assert hook.MARKER in page
    rendered = hook.on_page_markdown(page, page=None, config=None, files=None)
    assert hook.MARKER not in rendered and "| `model.n_heads` |" in rendered
    assert hook.on_page_markdown("# Other page\n", page=None, config=None, files=None) == "# Other page\n"


@dataclass
class _Commented:
    # Shared by the two fields right below.
    a: int = 1
    b: int = 2

    c: int = 3
    # Its own. None: a default.
    d: Optional[int] = None
    e: int = setting(5, gt=0)


def test_a_comment_documents_the_fields_below_it_up_to_a_blank_line_or_the_next_comment():
    assert field_comments(_Commented) == {
        "a": "Shared by the two fields right below.",
        "b": "Shared by the two fields right below.",
        "c": "",
        "d": "Its own. None: a default.",
        "e": "Its own. None: a default.",
    }


def test_the_meaning_is_the_first_sentence():
    assert first_sentence("Its own. None: a default.") == "Its own."
    assert first_sentence("A token, e.g. [NLU]; None: none. More.") == "A token, e.g. [NLU]; None: none."
    assert first_sentence("A path (local, s3://). `x` says more.") == "A path (local, s3://)."


@pytest.mark.parametrize(
    "allowed, nullable, words",
    [
        (Allowed(gt=0), False, "positive"),
        (Allowed(gt=0), True, "positive or null"),
        (Allowed(ge=0), False, "at least 0"),
        (Allowed(gt=1), False, "above 1"),
        (Allowed(le=8), False, "at most 8"),
        (Allowed(gt=0, lt=1), False, "between 0 and 1 (exclusive)"),
        (Allowed(ge=0, le=1), False, "between 0 and 1 (inclusive)"),
        (Allowed(ge=0, lt=1), False, "at least 0 and below 1"),
        (Allowed(gt=0, special=(0, "off")), False, "0 (off) or positive"),
        (Allowed(gt=0, note="below 1: a share"), True, "positive (below 1: a share) or null"),
        (Allowed(choices=("a", "b")), False, "one of a, b"),
        (Allowed(nonempty=True), False, "non-empty"),
    ],
)
def test_a_declaration_in_words(allowed, nullable, words):
    assert allowed.describe(nullable) == words


@pytest.mark.parametrize(
    "allowed, admitted, refused",
    [
        (Allowed(gt=0), [1e-9, 5, math.inf], [0, -1, math.nan]),
        (Allowed(gt=0, special=(0, "off")), [0, 0.0, 3], [-1, math.nan]),
        (Allowed(ge=0, lt=1), [0, 0.999], [1, -0.1, math.nan]),
        (Allowed(choices=(0, 1, 2, 3)), [0, 3], [4, -1]),
        (Allowed(nonempty=True), [[1], "x"], [[], ""]),
    ],
)
def test_what_a_declaration_admits(allowed, admitted, refused):
    assert all(allowed.admits(value) for value in admitted)
    assert not any(allowed.admits(value) for value in refused)


@dataclass
class _Item:
    weight: float = setting(1.0, gt=0)


@dataclass
class _Section:
    every: int = setting(0, gt=0, special=(0, "off"))
    window: Optional[int] = setting(None, gt=0)
    items: list[_Item] = dataclasses.field(default_factory=lambda: [_Item()])


def test_the_generic_check_names_the_full_key_the_value_and_what_is_allowed():
    check_declared(_Section(window=None), "sec.")
    with pytest.raises(ConfigError) as e:
        check_declared(_Section(every=-2), "sec.")
    assert str(e.value) == "sec.every: must be 0 (off) or positive, got -2"
    with pytest.raises(ConfigError) as e:
        check_declared(_Section(window=0), "sec.")
    assert str(e.value) == "sec.window: must be positive or null, got 0"
    with pytest.raises(ConfigError) as e:
        check_declared(_Section(items=[_Item(), _Item(weight=-1.0)]), "sec.")
    assert str(e.value) == "sec.items.1.weight: must be positive, got -1.0"


def test_a_value_outside_its_declaration_is_refused_before_any_relation_divides_by_it():
    # model.n_heads=0 was a ZeroDivisionError in `dim % n_heads`.
    with pytest.raises(ConfigError) as e:
        load_config(["experiment=tiny", "model.n_heads=0"])
    assert str(e.value) == "model.n_heads: must be positive, got 0"
    with pytest.raises(ConfigError) as e:
        load_config(["deepspeed.zero_stage=4"])
    assert str(e.value) == "deepspeed.zero_stage: expected one of 0, 1, 2, 3, got 4"
