"""bench/gpu_smoke.py, bench/mfu.py and bench/attention.py run on the CPU in a few steps, so they do not rot
between the GPU runs they are written for. No Ray: each is one process with a
torch.distributed group of one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str) -> str:
    env = os.environ | {"DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, str(REPO / "bench" / script), "--device", "cpu", "--steps", "3", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{script} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _table(output: str, first_column: str) -> tuple[list[str], list[list[str]]]:
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == [first_column])
    rows = []
    for line in lines[start + 2:]:  # after the header and its rule
        if not line.strip():
            break
        rows.append(line.split())
    return lines[start], rows


def test_gpu_smoke_trains_saves_and_restores_exactly_at_zero_1_and_3():
    output = _run("gpu_smoke.py")
    header, rows = _table(output, "zero")
    for column in ("loss first", "loss last", "tokens/s", "stall s", "save s", "restore s", "restored"):
        assert column in header
    assert [r[0] for r in rows] == ["1", "3"]
    for r in rows:
        assert r[-1] == "exact"
        assert float(r[3]) < float(r[2]), "the loss fell over the steps"
    assert "step 1:" in output, "progress is printed as it goes"


def test_mfu_compares_our_engine_with_plain_pytorch():
    output = _run("mfu.py")
    header, rows = _table(output, "preset")
    for column in ("impl", "tokens/s", "MFU %", "peak GB", "step ms"):
        assert column in header
    assert [r[:2] for r in rows] == [["tiny", "wildtrain"], ["tiny", "plain"]]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)
    assert "checkpoint stall, tiny full state" in output and "device-to-host copy of the same bytes" in output


def test_attention_times_every_mask_and_trains_every_objective():
    output = _run("attention.py")
    header, rows = _table(output, "mask")
    assert header.split() == ["mask", "mask", "ms", "total", "ms", "x", "causal"]
    assert [r[0] for r in rows] == ["causal_SDPA", "document_Flex", "prefix-LM_Flex", "prefix-LM_dense_SDPA"]
    assert all(float(r[2]) > 0 for r in rows) and float(rows[1][1]) > 0, "the block mask's build is timed"
    header, rows = _table(output, "objective")
    assert [r[:2] for r in rows] == [["causal", "causal"], ["causal", "document"], ["prefix_lm", "prefix_lm"],
                                     ["ul2", "document"], ["ul2", "prefix_lm"]]
    assert all(float(r[2]) > 0 for r in rows)
