"""Convert a ZeRO checkpoint to DeepSpeed's universal format, so it loads at another world size.

DeepSpeed refuses to load a ZeRO (stage 1-3) checkpoint saved at a different data-parallel
world size: the optimizer state is partitioned per rank. Its `ds_to_universal` tool rewrites
the partitions as one file per parameter, which an engine built with DeepSpeed's
`"checkpoint": {"load_universal": true}` loads at any world size (`load` below). Stage 0
checkpoints need no conversion, and `ds_to_universal` cannot convert them.

Atomicity: the conversion runs in a hidden staging folder next to the checkpoint and is
renamed into place only after a marker file was written into it last, so `folder/<tag>_universal`
either does not exist or is complete, and a crash mid-conversion leaves at most a staging
folder that never counts as converted. `folder/<tag>` is only read.

ZeRO-3: DeepSpeed 0.19.8's universal loader gives every optimizer param group the
hyperparameters of the first one (so parameters exempt from weight decay get it after a
resize), and one shared Adam step counter, which then advances once per group and step;
`load` puts back each group's own hyperparameters and counter.

`ds_to_universal` also writes a `latest_universal` file next to its output, which DeepSpeed
reads only when `load_checkpoint` is given no tag. Because the staging folder is its output's
parent, that file (which would name the staging folder) is discarded with it, and the loader
is always given the tag.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

MARKER = "wildtrain_universal_complete"  # written last, inside the converted folder
_OUTPUT_TAIL = 4000  # characters of the tool's output kept in an error


def universal_tag(tag: str) -> str:
    """The tag of the converted copy of `tag`, DeepSpeed's own naming convention."""
    return f"{tag}_universal"


def is_converted(folder: str, tag: str) -> bool:
    return (Path(folder) / universal_tag(tag) / MARKER).is_file()


def convert(folder: str, tag: str, *, in_process: bool = False) -> str:
    """Convert the checkpoint `folder/tag` to `folder/<universal tag>` unless already done;
    return the universal tag.

    `in_process` runs DeepSpeed's converter in this process rather than in a new Python:
    right in a worker restoring inside a restart, which imports torch and DeepSpeed anyway
    and does nothing else meanwhile (a small model's conversion in a new interpreter is
    mostly that interpreter's imports: docs/benchmarks.md, checkpoints). Wrong in a
    long-lived process that does other work (the controller): the conversion would hold the
    GIL against it for minutes on a large model, and its output could not be kept apart
    from the process's own."""
    utag = universal_tag(tag)
    target = Path(folder) / utag
    if is_converted(folder, tag):
        return utag
    source = Path(folder) / tag
    if not source.is_dir():
        raise FileNotFoundError(f"no checkpoint {tag!r} in {folder}")

    staging = Path(tempfile.mkdtemp(prefix=f".{utag}.partial-", dir=folder))
    try:
        output = staging / utag
        if in_process and pattern_safe(str(output.resolve())):
            _convert_here(source.resolve(), output.resolve())
        else:
            _convert_in_subprocess(source.resolve(), staging, utag)
        (output / MARKER).write_text(f"converted from {tag}\n")
        if target.exists() and not is_converted(folder, tag):
            shutil.rmtree(target)  # incomplete, not written by this module
        try:
            os.rename(output, target)
        except OSError:
            if not is_converted(folder, tag):  # else a concurrent conversion got there first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return utag


def pattern_safe(path: str) -> bool:
    """Whether `ds_to_universal` can be given `path` as it is: it builds glob and regex
    patterns from its output path unescaped, so a folder named e.g. `a+b` fails with
    "Cannot parse dp_rank". (A `.` matches itself too.)"""
    return re.fullmatch(r"[\w/.\-]+", path) is not None


# Serial: the conversion is I/O and memory bound, and worker pools multiply memory.
_SERIAL = {"num_extract_workers": 1, "num_merge_workers": 1}


def _convert_here(source: Path, output: Path) -> None:
    from wildtrain.engine import import_deepspeed

    import_deepspeed()  # as every worker imports it: quickly, and building nothing
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(
        input_folder=str(source),
        output_folder=str(output),
        inject_missing_state=True,
        keep_temp_folder=False,
        strict=True,
        **_SERIAL,
    )
    printed = io.StringIO()  # its progress bars and lines, kept for an error
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            ds_to_universal.main(args)
    except Exception as e:
        raise RuntimeError(
            f"converting checkpoint {source} to the universal format failed: {e}\n{printed.getvalue()[-_OUTPUT_TAIL:]}"
        ) from e


def _convert_in_subprocess(source: Path, cwd: Path, output: str) -> None:
    command = [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(source),
        # Relative to `cwd`, so that only its own name must be `pattern_safe`.
        "--output_folder",
        output,
        "--inject_missing_state",
        *(f"--{key}={value}" for key, value in _SERIAL.items()),
    ]
    done = subprocess.run(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"converting checkpoint {source} to the universal format failed "
            f"(exit {done.returncode}):\n{done.stdout[-_OUTPUT_TAIL:]}"
        )


def load(engine, folder: str, tag: str) -> None:
    """Load the universal copy of `tag` into `engine`, which must have been built with
    DeepSpeed's `"checkpoint": {"load_universal": true}`; any world size."""
    if not engine.load_universal_checkpoint():
        raise ValueError("the engine was built without DeepSpeed's checkpoint.load_universal")
    utag = universal_tag(tag)
    load_path, _ = engine.load_checkpoint(folder, tag=utag, load_optimizer_states=True, load_lr_scheduler_states=True)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed found no checkpoint {utag!r} in {folder}")
    saved = torch.load(Path(folder, utag, "zero", "optimizer_state.pt"), mmap=True, weights_only=False)
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(engine.optimizer.param_groups):
        raise RuntimeError(
            f"{folder}/{utag} has {len(saved_groups)} optimizer param groups, the engine "
            f"{len(engine.optimizer.param_groups)}"
        )
    for group, saved_group in zip(engine.optimizer.param_groups, saved_groups):
        group.update((k, v) for k, v in saved_group.items() if k != "params")
    for state in engine.optimizer.optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
