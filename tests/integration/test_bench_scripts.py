"""The GPU bench scripts run on the CPU in a few steps, so they do not rot between the GPU
runs they are written for. No Ray: each is one process with a torch.distributed group of one.

bench/gpu_smoke.py and bench/mfu.py run as a GPU machine runs them, through bench/gpu_all.sh
with the wheels of bench/device_carry.sh (built for this Python) in a fresh environment whose
only other packages are what that machine has: torch and its requirements, numpy, pyarrow,
and what `python -m venv` puts in a venv (pip; setuptools before Python 3.12). Neither Ray nor
MLflow is there, so an import of either on the GPU path fails here first."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

pytestmark = [pytest.mark.integration, pytest.mark.standalone]

REPO = Path(__file__).resolve().parents[2]
# What the GPU machine's image holds that the carry does not bring.
THERE = ("torch", "numpy", "pyarrow")
VENV_OWN = ("pip",) if sys.version_info >= (3, 12) else ("pip", "setuptools")


def _run(script: str, *args: str) -> str:
    env = os.environ | {"DS_ACCELERATOR": "cpu"}
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), "--device", "cpu", "--steps", "3", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"{script} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _closure(names) -> set[str]:
    """These distributions and everything they require here, by name."""
    seen, todo = set(), list(names)
    while todo:
        dist = importlib.metadata.distribution(todo.pop())
        name = dist.metadata["Name"].lower()
        if name in seen:
            continue
        seen.add(name)
        for line in dist.requires or ():
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return seen


def _link(distributions, folder: Path) -> None:
    """The installed files of `distributions` (top-level packages, modules, metadata),
    linked into `folder`: a site directory holding those and nothing else, in no time."""
    folder.mkdir()
    for name in distributions:
        dist = importlib.metadata.distribution(name)
        for top in {Path(str(f)).parts[0] for f in dist.files or ()} - {"..", "__pycache__"}:
            source = Path(dist.locate_file(top))
            if source.exists() and not (folder / top).exists():
                (folder / top).symlink_to(source)


@pytest.fixture(scope="module")
def gpu_all_cpu(tmp_path_factory) -> dict:
    """bench/gpu_all.sh --device cpu in a fresh venv: what it and device_carry.sh printed, and its logs."""
    work = tmp_path_factory.mktemp("gpu_all")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    carry = subprocess.run(
        ["bash", str(REPO / "bench" / "device_carry.sh"), "--python-version", version, "--out", str(work / "carry")],
        env=os.environ | {"PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert carry.returncode == 0, carry.stdout + carry.stderr

    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    _link(_closure(THERE) | set(VENV_OWN), work / "machine")
    (site / "machine.pth").write_text(f"{work / 'machine'}\n")

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    found = subprocess.run(
        [
            python,
            "-c",
            "import importlib.util as u; "
            "print([m for m in ('ray', 'mlflow', 'deepspeed', 'omegaconf') if u.find_spec(m)])",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    done = subprocess.run(
        [
            "bash",
            str(REPO / "bench" / "gpu_all.sh"),
            "--device",
            "cpu",
            "--carry",
            str(work / "carry"),
            "--logs",
            str(work / "logs"),
        ],
        env=env | {"PYTHON": str(python), "SITE": str(work / "site")},
        capture_output=True,
        text=True,
        timeout=600,
    )
    return {
        "carry": carry.stdout,
        "found_before": found.stdout.strip(),
        "output": done.stdout + done.stderr,
        "returncode": done.returncode,
        "logs": work / "logs",
    }


def test_the_carry_and_gpu_all_run_where_only_torch_is_installed(gpu_all_cpu):
    assert gpu_all_cpu["found_before"] == "[]", "the fresh environment has none of the carried packages, nor Ray"
    size = re.search(r"carry: (\d+) wheels .* together ([\d.]+) of 64 MiB", gpu_all_cpu["carry"])
    assert size and int(size.group(1)) > 10 and float(size.group(2)) < 64, gpu_all_cpu["carry"]
    output = gpu_all_cpu["output"]
    assert gpu_all_cpu["returncode"] == 0, output[-6000:]
    table = {
        line.split()[0]: line.split()
        for line in re.split(r"part +status", output)[-1].splitlines()[2:]
        if line.strip() and not line.startswith("logs:")
    }
    assert list(table) == ["install", "pytest", "in_process", "smoke", "mfu", "reform", "mirror"], output[-3000:]
    assert all(row[1] == "ok" for row in table.values())
    assert "skipped" in " ".join(table["pytest"]), "tests/gpu is collected and skipped without CUDA"
    assert "skipped" in " ".join(table["in_process"]), "so are the in-process drills on NCCL"
    assert "tokens/s" in " ".join(table["smoke"]) and "MFU" in " ".join(table["mfu"])
    assert re.search(
        r"128x2 \([\d.]+ MiB a rank\): a step [\d.]+ s, in-process [\d.]+ s \([\d.]+x\)", " ".join(table["mirror"])
    ), "the mirrors' cost, side by side with the restart path's step"


def _table(output: str, first_column: str) -> tuple[list[str], list[list[str]]]:
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == [first_column])
    rows = []
    for line in lines[start + 2 :]:  # after the header and its rule
        if not line.strip():
            break
        rows.append(line.split())
    return lines[start], rows


def test_gpu_smoke_trains_saves_and_restores_exactly_at_zero_1_and_3(gpu_all_cpu):
    output = (gpu_all_cpu["logs"] / "smoke.log").read_text()
    header, rows = _table(output, "zero")
    for column in ("loss first", "loss last", "tokens/s", "stall s", "save s", "restore s", "restored"):
        assert column in header
    assert [r[0] for r in rows] == ["1", "3"]
    for r in rows:
        assert r[-1] == "exact"
        assert float(r[3]) < float(r[2]), "the loss fell over the steps"
    assert "step 1:" in output, "progress is printed as it goes"


def test_mfu_compares_our_engine_with_plain_pytorch(gpu_all_cpu):
    output = (gpu_all_cpu["logs"] / "mfu.log").read_text()
    header, rows = _table(output, "preset")
    for column in ("impl", "tokens/s", "MFU %", "peak GB", "step ms"):
        assert column in header
    assert [r[:2] for r in rows] == [["tiny", "wildtrain"], ["tiny", "plain"]]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)
    assert "checkpoint stall, tiny full state" in output and "device-to-host copy of the same bytes" in output


def test_a_rebuilt_engine_reuses_the_compiled_code_of_the_first(gpu_all_cpu):
    # What an in-process re-form's first step relies on: its new engine is not compiled anew.
    output = (gpu_all_cpu["logs"] / "reform.log").read_text()
    header, rows = _table(output, "engine")
    assert "frames compiled" in header
    assert [r[0] for r in rows] == ["0", "1", "2"]
    assert int(rows[0][3]) > 0 and [int(r[3]) for r in rows[1:]] == [0, 0], output[-2000:]


def test_attention_times_every_mask_and_trains_every_objective():
    output = _run("attention.py")
    header, rows = _table(output, "mask")
    assert header.split() == ["mask", "mask", "ms", "total", "ms", "x", "causal"]
    assert [r[0] for r in rows] == ["causal_SDPA", "document_Flex", "prefix-LM_Flex", "prefix-LM_dense_SDPA"]
    assert all(float(r[2]) > 0 for r in rows) and float(rows[1][1]) > 0, "the block mask's build is timed"
    header, rows = _table(output, "objective")
    assert [r[:2] for r in rows] == [
        ["causal", "causal"],
        ["causal", "document"],
        ["prefix_lm", "prefix_lm"],
        ["ul2", "document"],
        ["ul2", "prefix_lm"],
    ]
    assert all(float(r[2]) > 0 for r in rows)
