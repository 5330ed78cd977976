"""Exports of real committed checkpoints. Two ranks train a few steps and save through
`AsyncSaver` into the run's store, as the loop does: at ZeRO-0 (whole fp32 weights), at
ZeRO-1 with the engine wildtrain builds on a GPU (bf16, so DeepSpeed's BF16_Optimizer and
its own file layout), and at ZeRO-3 (weights partitioned too). Then `wildtrain export`
writes each as a Transformers model whose logits are those of the trained fp32 weights, and
`wildtrain sample` continues a prompt as the export's `generate` does.

The ranks are processes started with torch.multiprocessing (gloo, CPU), as in
test_resharding; no Ray, no object store (a file:// URI stands for one).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner, Result

from tests.helpers.ranks import spawn_ranks
from tests.helpers.runs import make_run, mlflow_run
from tests.integration.test_resharding import _init_process
from wildtrain.config import ModelConfig

pytestmark = [pytest.mark.integration, pytest.mark.standalone]

# GQA and muP's multipliers, which the export folds into the weights.
MODEL = ModelConfig(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320, max_seq_len=64, output_mult=0.5, residual_mult=0.7
)
CASES = {"zero0": (0, False), "zero1-bf16": (1, True), "zero3": (3, False)}
STEPS = 2
WAIT_S = 120


def _overrides(root: str, case: str) -> list[str]:
    return [
        f"run.name={case}",
        f"run.storage={root}/runs",
        f"checkpoint.staging_dir={root}/staging",
        f"tracking.uri=sqlite:///{root}/mlflow.db",
    ]


def _train_and_save(rank: int, world_size: int, port: int, root: str) -> None:
    _init_process(rank, world_size, port)
    from tests.helpers.models import engine_settings
    from wildtrain import engine as engines
    from wildtrain.batching import batch_plan
    from wildtrain.checkpoint.async_save import AsyncSaver, CheckpointMeta
    from wildtrain.config import load_config
    from wildtrain.layout import RunLayout, checkpoint_stores
    from wildtrain.train.state import TrainState

    token = ["ab12"]
    on_cpu = engines.deepspeed_config
    for case, (stage, bf16) in CASES.items():
        cfg = load_config(
            [
                *_overrides(root, case),
                f"deepspeed.zero_stage={stage}",
                "elastic.in_process=false",  # in-process recovery takes ZeRO-1 and ZeRO-2 only
                "train.global_batch_size=4",
                "train.micro_batch_size=2",
            ]
        )
        cfg.model = MODEL
        # The engine of a GPU run (bf16, fp32 gradient accumulation), on the CPU.
        engines.deepspeed_config = functools.partial(_on_cuda, on_cpu) if bf16 else on_cpu
        plan = batch_plan(4, 2, world_size)
        torch.manual_seed(0)
        engine = engines.build_engine(
            engine_settings(cfg),
            plan,
            engines.build_model(engine_settings(cfg), plan, torch.device("cpu")),
            torch.device("cpu"),
        )
        assert (type(engine.optimizer).__name__ == "BF16_Optimizer") == bf16, type(engine.optimizer)
        saver = AsyncSaver(
            checkpoint_stores(RunLayout.of(cfg.run, cfg.checkpoint), cfg.storage),
            f"{root}/staging/rank{rank}",
            rank=rank,
            world_size=world_size,
            attempt=token[0],
            background="thread",
        )
        data = torch.randint(0, MODEL.vocab_size, (STEPS, 4, 33), generator=torch.Generator().manual_seed(0))
        for step in range(1, STEPS + 1):
            for micro in data[step - 1].view(world_size, plan.grad_accum_steps, 2, 33)[rank]:
                engine.backward(engine(micro[:, :-1], micro[:, 1:]))
                engine.step()
            meta = CheckpointMeta(
                step=step,
                tag=f"step_{step}",
                world_size=world_size,
                zero_stage=stage,
                data_position={"step": step},
                config_hash="test",
            )
            saver.save_engine(engine, meta, TrainState(step=step).to_json())
            assert saver.flush(WAIT_S), f"rank {rank}: the save of {case} step {step} did not finish"
            params = _full_params(engine)  # a collective under ZeRO-3
            if rank == 0:
                assert saver.committed(step), saver.drain()
                torch.save(params, Path(root, f"{case}-{step}.pt"))
        saver.close(WAIT_S)
        dist.barrier()


def _full_params(engine) -> dict:
    """The fp32 weights (the optimizer's master copy where it keeps one: not at ZeRO-0)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {
        name: (safe_get_full_fp32_param(p) if engine.zero_optimization_stage() else p).detach().clone()
        for name, p in engine.module.named_parameters()
    }


def _on_cuda(on_cpu, deepspeed, optim, plan, on_cuda, load_universal=False):
    return on_cpu(deepspeed, optim, plan, True, load_universal)


def wildtrain(*args: str) -> Result:
    from wildtrain import cli

    done = CliRunner().invoke(cli.main, list(args))
    assert done.exception is None or isinstance(done.exception, SystemExit), repr(done.exception)
    assert done.exit_code == 0, done.output
    return done


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("export")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DS_ACCELERATOR", "cpu")
        spawn_ranks(_train_and_save, 2, str(root))
    return root


def _trained_logits(root: Path, case: str, step: int, tokens: torch.Tensor) -> torch.Tensor:
    from wildtrain.model import Transformer

    model = Transformer(MODEL).eval()
    model.load_state_dict(torch.load(root / f"{case}-{step}.pt"))
    with torch.no_grad():
        return model(tokens)


def _exported_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


TOKENS = torch.randint(0, MODEL.vocab_size, (2, 48), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("case", CASES)
def test_export_of_a_2_rank_checkpoint_computes_the_trained_logits(trained, case):
    make_run(trained / "data", _overrides(str(trained), case), MODEL)
    out = trained / f"out-{case}"
    done = wildtrain("export", case, "--out", str(out), *_overrides(str(trained), case)[1:])
    assert f"exported {case} step {STEPS} (" in done.stdout and f"as LlamaForCausalLM to {out}" in done.stdout
    provenance = json.loads((out / "wildtrain_export.json").read_text())
    assert (provenance["step"], provenance["world_size"], provenance["zero_stage"]) == (STEPS, 2, CASES[case][0])
    torch.testing.assert_close(
        _exported_logits(out, TOKENS), _trained_logits(trained, case, STEPS, TOKENS), rtol=1e-4, atol=1e-5
    )


def test_an_earlier_step_to_an_object_store_uri_registered_in_mlflow(trained):
    from mlflow.tracking import MlflowClient

    from wildtrain.config import load_config

    overrides = _overrides(str(trained), "zero1-bf16")
    run_id = mlflow_run(load_config(overrides), trained / "artifacts")
    make_run(trained / "data", overrides, MODEL, mlflow_run_id=run_id)
    uri = f"file://{trained}/bucket/exports/zero1-bf16-step1"
    done = wildtrain("export", "zero1-bf16", "--step", "1", "--out", uri, "--register", "tiny-lm", *overrides[1:])
    assert "exported zero1-bf16 step 1 (" in done.stdout and "registered as tiny-lm version 1" in done.stdout
    step_1 = _trained_logits(trained, "zero1-bf16", 1, TOKENS)
    torch.testing.assert_close(
        _exported_logits(trained / "bucket/exports/zero1-bf16-step1", TOKENS), step_1, rtol=1e-4, atol=1e-5
    )
    assert not torch.allclose(step_1, _trained_logits(trained, "zero1-bf16", 2, TOKENS), rtol=1e-4, atol=1e-5), (
        "the steps' logits are too close for the comparison to tell them apart"
    )
    version = MlflowClient(f"sqlite:///{trained}/mlflow.db").get_model_version("tiny-lm", "1")
    assert (version.source, version.run_id, version.tags["wildtrain.step"]) == (uri, run_id, "1")


def test_a_universal_copy_in_the_store_is_read_instead_of_the_partitions(trained):
    from wildtrain.checkpoint import reshard
    from wildtrain.checkpoint.restore import newest_committed
    from wildtrain.export import export_checkpoint, open_run
    from wildtrain.layout import RunLayout, checkpoint_stores

    run = open_run("zero3", _overrides(str(trained), "zero3")[1:])
    newest = newest_committed(checkpoint_stores(RunLayout.of(run.cfg.run, run.cfg.checkpoint), run.cfg.storage))
    # As the controller does ahead of a resize (in a subprocess there: here in this one, for time).
    reshard.convert_in_store(newest.store, newest.name, newest.manifest, str(trained / "staging"), in_process=True)
    exported = export_checkpoint(run, str(trained / "out-zero3-universal"))
    assert exported.bytes_read < newest.manifest.total_bytes / 2  # its fp32 weights, no optimizer state
    torch.testing.assert_close(
        _exported_logits(trained / "out-zero3-universal", TOKENS),
        _trained_logits(trained, "zero3", STEPS, TOKENS),
        rtol=1e-4,
        atol=1e-5,
    )


def test_greedy_sample_of_a_checkpoint_is_the_exports_generate(trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from wildtrain.data.tokenizer import ByteTokenizer

    overrides = _overrides(str(trained), "zero3")
    make_run(trained / "data", overrides, MODEL)
    out = trained / "out-zero3-sample"
    wildtrain("export", "zero3", "--out", str(out), *overrides[1:])
    done = wildtrain("sample", "zero3", "--prompt", "Once upon a time", "--max-tokens", "24", *overrides[1:])
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer("Once upon a time", return_tensors="pt")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        ids = model.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert done.stdout == ByteTokenizer().decode(ids[0, prompt.shape[1] :].tolist()) + "\n"
    assert f"zero3 step {STEPS} (" in done.stderr
