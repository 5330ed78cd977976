"""(A helper, not a benchmark.) A wildtrain module as it was at another git revision, loaded
beside the current one, so a bench can time both in one process: `--reference-rev` of
bench/commit_hold.py, bench/reform_memory.py and bench/scale/rendezvous.py."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Mapping

REPO = Path(__file__).resolve().parents[1]


def module_at(rev: str, path: str, imports: Mapping[str, str] = {}) -> ModuleType:
    """The module in `path` (relative to the repository) as it was at `rev`, named after its file
    with a `_reference` suffix; `imports` renames the modules its source imports from (to a
    module loaded at `rev` before it, by that name)."""
    source = subprocess.run(
        ["git", "show", f"{rev}:{path}"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    for module, reference in imports.items():
        source = source.replace(f"from {module} import", f"from {reference} import")
    name = f"{Path(path).stem}_reference"
    file = Path(tempfile.mkdtemp()) / f"{name}.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
