"""Every collective of the training loop goes through train/collectives.py, which puts its
tensors on a device the process group can carry (NCCL: CUDA only; gloo: CPU only)."""

import ast
import re
from pathlib import Path

import pytest
import torch

from wildtrain.train import collectives

TRAIN = Path(collectives.__file__).parent

# The one module that may call torch.distributed's collectives.
HELPER = "collectives.py"
# Modules that still call them directly and are to move to the helper. The test fails
# when one of them no longer does, so the entry goes as soon as the module is migrated.

# Names of torch.distributed functions that communicate: all_reduce, broadcast, all_gather*,
# reduce*, gather, scatter*, barrier, send/recv, the *_object* family and any new one
# named after them.
_COLLECTIVE = re.compile(r"all_|reduce|broadcast|gather|scatter|barrier|_object|send|recv|all_to_all")


def _distributed_aliases(tree: ast.Module) -> tuple[set[str], set[str]]:
    """Names bound to the torch.distributed module, and collectives imported by name."""
    modules, functions = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch.distributed" and alias.asname:
                    modules.add(alias.asname)
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if node.module == "torch" and alias.name == "distributed":
                    modules.add(alias.asname or alias.name)
                elif node.module and node.module.startswith("torch.distributed") and _COLLECTIVE.search(alias.name):
                    functions.add(alias.asname or alias.name)
    return modules, functions


def _is_distributed(expr: ast.expr, modules: set[str]) -> bool:
    if isinstance(expr, ast.Name):
        return expr.id in modules
    # torch.distributed.<fn>
    return (
        isinstance(expr, ast.Attribute)
        and expr.attr == "distributed"
        and isinstance(expr.value, ast.Name)
        and expr.value.id == "torch"
    )


def collective_calls(source: str) -> list[str]:
    """`line: name` of every torch.distributed collective that `source` calls."""
    tree = ast.parse(source)
    modules, functions = _distributed_aliases(tree)
    calls = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and _is_distributed(f.value, modules) and _COLLECTIVE.search(f.attr):
            calls.append(f"{node.lineno}: {f.attr}")
        elif isinstance(f, ast.Name) and f.id in functions:
            calls.append(f"{node.lineno}: {f.id}")
    return sorted(calls, key=lambda c: int(c.split(":")[0]))


def test_the_scan_finds_every_way_of_calling_a_collective():
    source = """
import torch
import torch.distributed as dist
from torch import distributed
from torch.distributed import all_gather_object as gather_them
dist.all_reduce(x)
distributed.broadcast_object_list(box, src=0)
torch.distributed.barrier()
gather_them(out, value)
dist.get_world_size()
dist.is_initialized()
"""
    assert collective_calls(source) == ["6: all_reduce", "7: broadcast_object_list", "8: barrier", "9: gather_them"]


def test_no_module_of_the_training_loop_calls_a_collective_but_the_helper():
    modules = sorted(p.name for p in TRAIN.glob("*.py"))
    assert HELPER in modules and "loop.py" in modules
    bypassing = {
        name: calls
        for name in modules
        if name != HELPER
        for calls in [collective_calls((TRAIN / name).read_text())]
        if calls
    }
    assert bypassing == {}, f"collectives outside train/{HELPER}: {bypassing}"


@pytest.mark.parametrize(
    "backend, device",
    [
        ("gloo", "cpu"),
        ("cpu:gloo,cuda:nccl", "cpu"),  # Ray Train's string: flags and objects need no device copy
        ("cuda:nccl,cpu:gloo", "cpu"),
    ],
)
def test_small_tensors_go_to_the_cpu_when_the_group_has_a_cpu_backend(backend, device):
    assert collectives.small_tensor_device(backend).type == device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_small_tensors_go_to_the_current_cuda_device_under_nccl():
    assert collectives.small_tensor_device("nccl") == torch.device("cuda", torch.cuda.current_device())


def test_an_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="'mpi' is not supported"):
        collectives.small_tensor_device("mpi")


def test_which_devices_a_backend_carries():
    assert collectives.carries("nccl", torch.device("cuda", 0))
    assert not collectives.carries("nccl", torch.device("cpu"))
    assert not collectives.carries("gloo", torch.device("cuda", 0))
    assert collectives.carries("cpu:gloo,cuda:nccl", torch.device("cpu"))
    assert collectives.carries("cpu:gloo,cuda:nccl", torch.device("cuda", 0))


def test_without_a_process_group_each_collective_is_that_of_a_group_of_one():
    assert collectives.all_ranks(True) and not collectives.all_ranks(False)
    assert collectives.any_rank(True) and not collectives.any_rank(False)
    assert collectives.broadcast_flag(True) is True
    assert collectives.broadcast_int(7) == 7
    assert collectives.broadcast_object({"a": 1}) == {"a": 1}
    assert collectives.all_gather_object("x") == ["x"]
    assert collectives.all_gather_floats(1.5) == [1.5]
    assert collectives.all_gather_floats([1.0, 2.0]) == [[1.0, 2.0]]
    assert collectives.mean_over_ranks(torch.tensor(3.0)).item() == 3.0
    assert collectives.world_size() == 1
