"""(A helper, not a benchmark.) A wildtrain module as it was at another git revision, loaded
beside the current one, so a bench can time both in one process: `--reference-rev` of
bench/commit_hold.py and bench/scale/rendezvous.py."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def module_at(rev: str, path: str) -> ModuleType:
    """The module in `path` (relative to the repository) as it was at `rev`, named after its file
    with a `_reference` suffix."""
    source = subprocess.run(
        ["git", "show", f"{rev}:{path}"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    name = f"{Path(path).stem}_reference"
    file = Path(tempfile.mkdtemp()) / f"{name}.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
