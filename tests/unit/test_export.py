"""How `wildtrain export` and `sample` find a run, its config and its checkpoints, their
answers to bad input (one line, a non-zero exit, nothing written), and the model registry.
Exports of real checkpoints: tests/integration/test_export.py."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from mlflow.tracking import MlflowClient

from tests.helpers.runs import commit_checkpoint, mlflow_run
from tests.helpers.runs import make_run as make_run_in
from wildtrain import cli
from wildtrain.config import Config, ModelConfig, load_config
from wildtrain.data.tokenizer import ByteTokenizer
from wildtrain.export import Exported, open_run, register
from wildtrain.layout import RunLayout

MODEL = ModelConfig(dim=32, n_layers=1, n_heads=2, max_seq_len=64)


def wildtrain(*args: str) -> Result:
    done = CliRunner().invoke(cli.main, list(args))
    assert done.exception is None or isinstance(done.exception, SystemExit), repr(done.exception)
    return done


def one_line(done: Result, code: int = 1) -> str:
    assert done.exit_code == code, done.output
    assert done.stderr.startswith("wildtrain: ") and done.stderr.count("\n") == 1, done.stderr
    return done.stderr.strip()


@pytest.fixture
def where(tmp_path) -> list[str]:
    """The overrides that put runs, staging and tracking under this test's folder."""
    return [
        f"run.storage={tmp_path / 'runs'}",
        f"checkpoint.staging_dir={tmp_path / 'staging'}",
        f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
    ]


def make_run(tmp_path: Path, where: list[str], name: str = "r", model: ModelConfig = MODEL, **record) -> Config:
    return make_run_in(tmp_path / "data", [*where, f"run.name={name}"], model, **record)


def test_an_unknown_run_is_named_with_where_it_was_looked_for(tmp_path, where):
    done = wildtrain("export", "nosuch", "--out", str(tmp_path / "out"), *where)
    assert one_line(done).startswith(f"wildtrain: no run 'nosuch' at {tmp_path / 'runs' / 'nosuch'} (no ")
    assert not (tmp_path / "out").exists()
    assert one_line(wildtrain("sample", "nosuch", "--prompt", "hi", *where)).startswith("wildtrain: no run 'nosuch'")


def test_a_step_without_a_committed_checkpoint_lists_the_committed_ones(tmp_path, where):
    cfg = make_run(tmp_path, where)
    commit_checkpoint(cfg, tmp_path, 4)
    commit_checkpoint(cfg, tmp_path, 8, committed=False)  # a save that never committed
    store = RunLayout.of(cfg.run, cfg.checkpoint).checkpoint_uris[0]
    for step in (8, 3):
        done = wildtrain("export", "r", "--step", str(step), "--out", str(tmp_path / "out"), *where)
        assert one_line(done) == (
            f"wildtrain: run 'r' has no committed checkpoint at step {step} in {store} (committed: 4)"
        )
    done = wildtrain("sample", "r", "--step", "8", "--prompt", "hi", "--max-tokens", "8", *where)
    assert "has no committed checkpoint at step 8" in one_line(done)
    assert not (tmp_path / "out").exists()


def test_a_run_without_checkpoints_says_so(tmp_path, where):
    make_run(tmp_path, where)
    done = wildtrain("export", "r", "--out", str(tmp_path / "out"), *where)
    assert one_line(done).startswith("wildtrain: run 'r' has no committed checkpoint in ")


def test_a_prefix_lm_is_refused_before_anything_is_read(tmp_path, where):
    make_run(tmp_path, where, model=replace(MODEL, attention="prefix_lm"))
    # No checkpoint exists: the refusal comes before the checkpoints are looked at.
    done = wildtrain("export", "r", "--out", str(tmp_path / "out"), *where)
    assert one_line(done).startswith("wildtrain: model.attention=prefix_lm: Transformers has no decoder")
    assert not (tmp_path / "out").exists()


def test_a_folder_with_files_in_it_is_not_written_into(tmp_path, where):
    make_run(tmp_path, where)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    done = wildtrain("export", "r", "--out", str(tmp_path / "out"), *where)
    assert one_line(done) == f"wildtrain: {tmp_path / 'out'}: exists and is not an empty folder"


def test_a_prompt_longer_than_the_model_is_refused_before_the_download(tmp_path, where):
    make_run(tmp_path, where)
    done = wildtrain("sample", "r", "--prompt", "x" * 60, "--max-tokens", "5", *where)
    assert one_line(done) == "wildtrain: --max-tokens: 60 prompt tokens + 5 exceed model.max_seq_len (64)"


def test_a_config_mistake_exits_2(tmp_path, where):
    done = wildtrain("export", "r", "--out", str(tmp_path / "out"), "run.storag=x")
    assert one_line(done, code=2).startswith("wildtrain: run.storag: unknown key")


def test_a_dataset_tokenized_again_otherwise_is_refused(tmp_path, where):
    bpe = {**ByteTokenizer().describe(), "kind": "bpe", "sha256": "0" * 64}
    make_run(tmp_path, where, tokenizer=bpe)
    done = wildtrain("export", "r", "--out", str(tmp_path / "out"), *where)
    assert one_line(done) == (
        f"wildtrain: {tmp_path / 'data' / 'manifest.json'}: its tokenizer is not the one run 'r' "
        f"trained with: kind 'bpe' -> 'byte'; sha256 '{'0' * 64}' -> None"
    )


def test_the_model_comes_from_the_record_not_from_the_command_line(tmp_path, where):
    trained = replace(MODEL, output_mult=0.125, rope_theta=500.0)
    make_run(tmp_path, where, model=trained)
    run = open_run("r", [*where, "model.output_mult=1.0"])
    assert run.model == trained
    assert run.dataset == str(tmp_path / "data") and run.cfg.run.storage == str(tmp_path / "runs")


def test_an_older_record_takes_the_model_its_mlflow_run_was_created_with(tmp_path, where):
    cfg = load_config([*where, "run.name=r", "model.dim=48", "model.n_kv_heads=2", "model.output_mult=0.5"])
    run_id = mlflow_run(cfg, tmp_path / "artifacts")
    make_run(tmp_path, where, record_model=False, mlflow_run_id=run_id)
    assert open_run("r", where).model == cfg.model


def test_a_registered_export_is_a_new_version_linked_to_the_run_and_step(tmp_path, where):
    cfg = load_config([*where, "run.name=r"])
    run_id = mlflow_run(cfg, tmp_path / "artifacts")
    make_run(tmp_path, where, mlflow_run_id=run_id)
    run = open_run("r", where)
    exported = Exported(
        location="s3://bucket/exports/r-60",
        architecture="LlamaForCausalLM",
        step=60,
        checkpoint="s3://bucket/runs/r/checkpoints/step_000000060-ab",
        skipped=(),
        bytes_read=0,
    )
    assert register(run, exported, "tiny-lm") == "1"
    assert register(run, replace(exported, step=80), "tiny-lm") == "2"
    client = MlflowClient(cfg.tracking.uri)
    first = client.get_model_version("tiny-lm", "1")
    assert (first.source, first.run_id) == ("s3://bucket/exports/r-60", run_id)
    assert first.tags["wildtrain.step"] == "60" and first.tags["wildtrain.run"] == "r"
    assert first.tags["wildtrain.checkpoint"] == exported.checkpoint
    assert client.get_model_version("tiny-lm", "2").tags["wildtrain.step"] == "80"


def test_training_never_imports_transformers():
    """Only an export or an evaluation imports Transformers or lm-eval: not the driver, a
    worker's loop, the controller's callbacks, or the CLI."""
    code = (
        "import sys, wildtrain.cli, wildtrain.driver, wildtrain.train.loop, wildtrain.export, wildtrain.sample, "
        "wildtrain.elastic.controller, wildtrain.evals.remote; "
        "print(sorted({'transformers', 'huggingface_hub', 'safetensors', 'lm_eval', 'datasets'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
