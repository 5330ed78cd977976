"""Placement on a stand-in accelerator (tests/helpers/standin_device.py): a device that
computes on the CPU but refuses a host tensor in a device op, as a GPU does. The model's
step under every attention mask, and `DeviceBatches` -> `train_step` fed from host numpy,
run on it here, so a batch left on the host or a mask built there fails `make test`
rather than the first GPU run. Each run must also match the same run on the CPU.

Skipped where CUDA is: registering the stand-in makes it torch's accelerator for the rest
of the process, in CUDA's place, and there tests/gpu runs the real device.

What stays GPU-only, covered by tests/gpu (test_step_cuda.py, test_attention_cuda.py):
- train/step.py `DeviceBatches`: everything under `self.pinned` (`device.type == "cuda"`):
  the copy stream of `__init__`, `__next__`'s `wait_event`/`record_stream`, and
  `_prefetch` past `if not self.pinned` (pinned buffers, the copy on the copy stream, its
  event). A stand-in batch takes the plain `host.to(self.device)` above it.
- train/step.py `StepMetrics`: `timed`'s CUDA-event branch (`self.on_cuda`) and
  `_resolve`; `peak_memory_gb`'s `torch.cuda.max_memory_allocated`. Elsewhere: the host
  clock and resident memory, which run here.
- model/masks.py `build`: `create_block_mask` (`device.type == "cuda"`), and so
  transformer.py `Attention`'s compiled FlexAttention branch; the stand-in runs the dense
  SDPA mask of the same `mask_mod`.
- DeepSpeed's engine (engine.build_engine: ZeRO partitioning, gradient reduction and
  clipping, compile, bf16): it cannot run on a stand-in device, so `train_step` here drives
  `StandInEngine`, which has the engine's protocol around the model and torch's AdamW.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import replace

import numpy as np
import pytest
import torch

from tests.helpers.standin_device import HostTensorInAcceleratorOp, StandInTensor, standin
from wildtrain.batching import BatchPlan, batch_plan
from wildtrain.config import Config, load_config
from wildtrain.data.objectives import Objective
from wildtrain.data.tokenizer import ByteTokenizer
from wildtrain.engine import param_groups
from wildtrain.model import Transformer, flops_per_token
from wildtrain.train.step import DeviceBatches, StepMetrics, model_inputs, train_step

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: tests/gpu runs the real device")

SEQ_LEN = 24
ROWS = 4
# model.attention -> the train.objective that feeds it (document masks train plain causal LM)
ATTENTIONS = {"causal": "causal", "document": "causal", "prefix_lm": "prefix_lm"}


@pytest.fixture
def device():
    with standin() as dev:
        yield dev


@functools.cache  # loading the YAML takes a quarter second; the tests only read it
def config(attention: str, activation_checkpointing: bool = False) -> Config:
    cfg = load_config([f"model.attention={attention}", f"train.objective={ATTENTIONS[attention]}"])
    # Grouped-query attention too: SDPA's enable_gqa path.
    cfg.model = replace(
        cfg.model,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=SEQ_LEN,
        activation_checkpointing=activation_checkpointing,
    )
    return cfg


def host_rows(cfg: Config, step: int) -> np.ndarray:
    """One step's rows as the data path hands them over: int32, (ROWS, SEQ_LEN + 1) tokens
    for plain causal LM, else (ROWS, len(FIELDS), SEQ_LEN), several documents a row."""
    rng = np.random.default_rng(step)
    tokens = rng.integers(0, 256, (ROWS, SEQ_LEN + 1)).astype(np.int32)
    doc_ids = np.sort(rng.integers(0, 3, (ROWS, SEQ_LEN + 1)), axis=1).astype(np.int32)
    objective = Objective.of(cfg.objective, cfg.train, cfg.model, ByteTokenizer().describe())
    return objective.rows(step, np.arange(ROWS) + step * ROWS, tokens, doc_ids)


def fused_adamw(cfg: Config, model: Transformer) -> torch.optim.AdamW:
    """The optimizer `build_engine` gives DeepSpeed on CUDA."""
    return torch.optim.AdamW(
        param_groups(model, cfg.optim),
        lr=cfg.optim.lr,
        betas=(cfg.optim.beta1, cfg.optim.beta2),
        eps=cfg.optim.eps,
        fused=True,
    )


def test_the_stand_in_refuses_host_tensors_in_device_ops_as_a_gpu_does(device):
    weight = torch.randn(3, 4, device=device)
    assert isinstance(weight, StandInTensor) and weight.device == device
    with pytest.raises(
        HostTensorInAcceleratorOp,
        match=r"aten.mm.default got host tensor\(s\) \(cpu torch.float32 "
        r"\[2, 4\]\) together with standin:0",
    ):
        torch.randn(2, 4) @ weight.T
    assert (weight * torch.tensor(2.0)).device == device, "a 0-dim host scalar is allowed, as on CUDA"
    assert weight[0, 1:].device == device  # Python indexing runs on the stand-in's device guard
    back = weight.cpu()
    assert type(back) is torch.Tensor and back.device.type == "cpu" and torch.equal(back, weight.host)
    into = torch.empty(3, 4)
    assert into.copy_(weight) is into and torch.equal(into, back), "copies cross devices"


@pytest.mark.parametrize("activation_checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_the_model_trains_on_the_device_as_on_the_cpu(device, attention, activation_checkpointing):
    cfg = config(attention, activation_checkpointing)
    torch.manual_seed(0)
    on_cpu = Transformer(cfg.model)
    on_device = copy.deepcopy(on_cpu).to(device)
    rows = torch.from_numpy(host_rows(cfg, 0)).long()
    losses = {}
    for model, where in ((on_cpu, torch.device("cpu")), (on_device, device)):
        optimizer = fused_adamw(cfg, model)
        loss = model(**model_inputs(rows.to(where)))
        loss.backward()
        optimizer.step()
        assert loss.device == where
        for name, param in model.named_parameters():
            assert param.device == where and param.grad.device == where, name
            assert all(state.device == where for state in optimizer.state[param].values()), name
        losses[where.type] = loss.detach().cpu()
    # Not bit for bit: the stand-in has no fused attention kernel, so SDPA runs torch's math
    # decomposition there and the CPU's flash kernel here.
    torch.testing.assert_close(losses[device.type], losses["cpu"])
    for (name, p_cpu), p_device in zip(on_cpu.named_parameters(), on_device.parameters()):
        torch.testing.assert_close(p_device.cpu(), p_cpu, msg=lambda detail: f"{name}: {detail}")


class StandInEngine:
    """DeepSpeed's engine protocol as `train_step` uses it, without DeepSpeed: calling it
    runs the model, `backward` scales the loss by the accumulation steps, `step` applies
    the optimizer at the last micro-batch of a step. DeepSpeed's engine itself cannot run
    on the stand-in device: it stays GPU-only (tests/gpu/test_step_cuda.py; on CPU with
    gloo, tests/integration/test_step.py)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, plan: BatchPlan) -> None:
        self.model, self.optimizer, self.plan = model, optimizer, plan
        self.micro_steps = 0

    def __call__(self, **inputs: torch.Tensor) -> torch.Tensor:
        return self.model(**inputs)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.plan.grad_accum_steps).backward()

    def step(self) -> None:
        self.micro_steps += 1
        if self.micro_steps % self.plan.grad_accum_steps == 0:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


def train(cfg: Config, device: torch.device, steps: int) -> tuple[list[float], Transformer]:
    """`steps` steps of DeviceBatches -> train_step on `device`, from host numpy rows."""
    plan = batch_plan(ROWS, ROWS // 2, 1)  # 2 micro-batches a step
    torch.manual_seed(0)
    model = Transformer(cfg.model).to(device)
    engine = StandInEngine(model, fused_adamw(cfg, model), plan)
    window = StepMetrics(ROWS * SEQ_LEN, flops_per_token(cfg.model, SEQ_LEN), None, 1, device)
    host = [host_rows(cfg, step) for step in range(steps)]
    losses = []
    for step, (tokens, item) in enumerate(DeviceBatches(iter(host), device)):
        assert item is host[step]
        assert tokens.device == device and tokens.dtype == torch.int64, "the batch reaches the device, widened"
        train_step(engine, plan, tokens, window)
        assert window.loss_sum.device == device, "the loss is summed on the device"
        losses.append(window.flush()["loss"])
    return losses, model


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_the_step_trains_on_the_device_from_host_numpy_as_on_the_cpu(device, attention):
    cfg = config(attention)
    losses, model = train(cfg, device, steps=3)
    assert all(p.device == device for p in model.parameters())
    cpu_losses, _ = train(cfg, torch.device("cpu"), steps=3)
    assert losses == pytest.approx(cpu_losses, rel=1e-5)


class _RecordingCollectives:
    """torch.distributed's collectives as a group of one that records the device of every
    tensor handed to each group: NCCL cannot run here, so the default group is this stand-in
    for one whose accelerator is the stand-in device; the control group is a real gloo
    group of one."""

    def __init__(self, control) -> None:
        self.control = control
        self.seen: list[tuple[str, str, str]] = []  # (collective, "default" or "control", device type)

    def _note(self, name: str, group, *tensors: torch.Tensor) -> None:
        for t in tensors:
            self.seen.append((name, "control" if group is self.control else "default", t.device.type))

    def all_reduce(self, tensor, op=None, group=None):
        self._note("all_reduce", group, tensor)

    def broadcast(self, tensor, src=0, group=None):
        self._note("broadcast", group, tensor)

    def all_gather(self, rows, row, group=None):
        self._note("all_gather", group, row, *rows)
        rows[0].copy_(row)

    def broadcast_object_list(self, box, src=0, group=None, device=None):
        self._note("broadcast_object_list", group, torch.empty(0, device=device))

    def all_gather_object(self, out, value, group=None):
        self._note("all_gather_object", group, torch.empty(0))
        out[0] = value


@pytest.fixture
def recorded(device, monkeypatch, tmp_path):
    import torch.distributed as dist

    from wildtrain.train import collectives

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        collectives.open_control_group(60)
        recorder = _RecordingCollectives(collectives.control_group())
        for name in ("all_reduce", "broadcast", "all_gather", "broadcast_object_list", "all_gather_object"):
            monkeypatch.setattr(dist, name, getattr(recorder, name))
        # The backend string of a group whose accelerator backend carries the stand-in device.
        monkeypatch.setattr(dist, "get_backend", lambda group=None: f"{device.type}:nccl")
        yield recorder
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()


def test_every_collective_of_the_helper_hands_its_group_tensors_on_that_groups_device(device, recorded):
    from wildtrain.train import collectives

    loss = collectives.mean_over_ranks(torch.tensor(2.5).to(device))
    assert loss.device == device  # the loss stays on the accelerator until a report reads it
    collectives.sum_(torch.ones(8).to(device))
    collectives.all_ranks(True)
    collectives.broadcast_flag(True)
    collectives.broadcast_object({"step": 3})
    collectives.all_gather_object("node-a")
    collectives.all_gather_floats([1.0, 2.0])
    misplaced = [s for s in recorded.seen if s[2] != {"default": device.type, "control": "cpu"}[s[1]]]
    assert not misplaced, f"tensors on a device their group does not carry: {misplaced}"
    assert {s[1] for s in recorded.seen} == {"default", "control"}
    with pytest.raises(ValueError, match="cpu tensor cannot be all-reduced"):
        collectives.sum_(torch.ones(8))  # a host buffer for the accelerator group: refused here, not in c10d
