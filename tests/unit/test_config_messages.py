"""The troubleshooting page lists every message a setting's check can print (issue 59): its
list (config/reference.py's `render_messages`, put in by the docs' hook) shows each kind of
declaration's refusal, and each relation's actual message matches a line of it."""

import importlib.util
import re

import pytest

from tests.conftest import REPO
from wildtrain.config import ConfigError, load_config
from wildtrain.config.reference import declared_refusals, render_messages

LISTED = render_messages()


def _pattern(line: str) -> re.Pattern:
    """A listed line as a pattern: each `<...>` stands for whatever the message shows there."""
    return re.compile(".*".join(re.escape(part) for part in re.split(r"<[^<>]*>", line)))


TEMPLATES = [_pattern(m) for m in re.findall(r"^(?:- |\| `[^`]*` \| )`(.*)`", LISTED, re.MULTILINE)]


def test_every_kind_of_declaration_is_listed_with_its_refusal():
    refusals = dict(declared_refusals())
    assert refusals["model.n_heads"] == "model.n_heads: must be positive, got <value>"  # a range
    assert refusals["train.objective"].startswith("train.objective: expected one of causal, prefix_lm, ul2, got ")
    assert refusals["data.datasets"] == "data.datasets: must be non-empty, got <value>"
    assert refusals["optim.grad_clip"] == "optim.grad_clip: must be 0 (off) or positive, got <value>"  # special
    assert refusals["model.n_kv_heads"].endswith("must be positive or null, got <value>")
    assert refusals["data.datasets.<n>.uri"] == "data.datasets.<n>.uri: must be non-empty, got <value>"
    assert all(f"| `{key}` | `{line}` |" in LISTED for key, line in refusals.items())


# One override per relation of the sections' validate() and of config/checks.py, and per
# check of a value's type and of an override's form.
REFUSED = [
    ["model.n_heads=3"],
    ["model.dim=96", "model.n_heads=32"],
    ["model.n_kv_heads=3"],
    ["model.base_dim=64"],
    ["eval.tasks=['a,b']"],
    ["objective.denoisers.0.mean_span=0.5"],
    ["run.lease_expire_s=1"],
    ["elastic.spares=1", "elastic.in_process=false"],
    ["elastic.min_workers=3"],
    ["data.seq_len=1000"],
    ["model.attention=prefix_lm"],
    ["train.objective=ul2", "objective.denoisers=[]"],
    ["elastic.in_process=true", "deepspeed.zero_stage=0"],
    ["train.global_batch_size=15"],
    ["elastic.max_workers=100"],
    ["train.seed=99999999999999999999"],
    ["train.steps=abc"],
    ["train.micro_batch=3"],
    ["model.dim.x=1"],
    ["eval.tasks.3=x"],
    ["data.datasets.x.uri=y"],
    ["no_equals"],
    ["train.steps=${nope}"],
    ["model.n_heads=0"],
    ["model.attention=sideways"],
]


@pytest.mark.parametrize("overrides", REFUSED, ids=" ".join)
def test_each_relations_message_is_a_listed_line(overrides):
    with pytest.raises(ConfigError) as e:
        load_config(overrides)
    assert any(template.fullmatch(str(e.value)) for template in TEMPLATES), str(e.value)


def test_the_docs_hook_puts_the_list_in_place_of_its_marker_on_the_troubleshooting_page():
    path = REPO / "docs" / "hooks" / "config_reference.py"
    spec = importlib.util.spec_from_file_location("config_reference_hook", path)
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = (REPO / "docs" / "troubleshooting.md").read_text()
    assert hook.MESSAGES_MARKER in page
    rendered = hook.on_page_markdown(page, page=None, config=None, files=None)
    assert hook.MESSAGES_MARKER not in rendered and LISTED in rendered
