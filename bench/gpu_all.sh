#!/usr/bin/env bash
# Every GPU check of the project: tests/gpu and the GPU benches, then one table of results.
#
# Usage: bash bench/gpu_all.sh [--device cuda|cpu] [--carry DIR] [--logs DIR]
#
# A runner, no benchmark of its own: each bench it runs compares what its docstring says.
# It runs in parts (PARTS: all of them take two calls of the GPU machine's 10 minutes each,
# the GPU checks on docs/benchmarks.md say which), on a machine with torch,
# numpy and pyarrow but no package registry, no Ray and no network: installs the wheels of
# bench/device_carry.sh, runs tests/gpu (the in-process recovery drills on NCCL in a part of
# their own: a drill that hangs must not take the others' time), bench/gpu_smoke.py,
# bench/mfu.py, bench/reform_compile.py and bench/mirror_cost.py, each bounded by `timeout`,
# and ends with one table: each part's status, seconds and key figures.
#
# --device cpu runs the same parts in a few CPU steps (tests/gpu then only collects and
# skips): the test suite runs it so that this script works the day a GPU is lent.
# --logs keeps each part's full output there (default: a temporary folder).
# PYTHON (default python3) runs everything; SITE (default /tmp/site) receives the wheels.
# The parts' arguments and seconds can be overridden: PYTEST_ARGS, SMOKE_ARGS, MFU_ARGS,
# REFORM_ARGS, MIRROR_ARGS, PYTEST_S, IN_PROCESS_S, SMOKE_S, MFU_S, REFORM_S, MIRROR_S; PARTS
# names the parts to run after the install, in their order (default: pytest in_process smoke
# mfu reform mirror), for a call that has less time than all.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEVICE=cuda
CARRY=$REPO/.carry
LOGS=
while [ $# -gt 0 ]; do
    case $1 in
        --device) DEVICE=$2; shift 2 ;;
        --carry) CARRY=$2; shift 2 ;;
        --logs) LOGS=$2; shift 2 ;;
        *) echo "usage: $0 [--device cuda|cpu] [--carry DIR] [--logs DIR]" >&2; exit 2 ;;
    esac
done
case $DEVICE in cuda|cpu) ;; *) echo "gpu_all.sh: --device cuda or cpu, not $DEVICE" >&2; exit 2 ;; esac
PYTHON=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}
LOGS=${LOGS:-$(mktemp -d)}
mkdir -p "$LOGS"
: >"$LOGS/parts.tsv"

# tests/gpu_smoke_restores... runs gpu_smoke.py on a toy; the smoke part runs it for real.
PYTEST_ARGS=${PYTEST_ARGS:---deselect tests/gpu/test_step_cuda.py::test_gpu_smoke_restores_the_async_checkpoint_exactly}
IN_PROCESS=tests/gpu/test_in_process_nccl.py
PARTS=${PARTS:-pytest in_process smoke mfu reform mirror}
for part in $PARTS; do
    case $part in pytest|in_process|smoke|mfu|reform|mirror) ;; *) echo "gpu_all.sh: no part $part in PARTS" >&2; exit 2 ;; esac
done
if [ "$DEVICE" = cuda ]; then
    # Each part's bound is sized on the first H200 runs, with room to spare (the parts'
    # times: docs/benchmarks.md, GPU checks). The smoke and reform compile the 125m model
    # once; mfu compiles the 1.3b model (the size of the MFU goal) twice, then writes its
    # whole state twice for the checkpoint stall; mirror trains two ranks of a 0.2 B model on
    # the GPU, 16k tokens a rank a step.
    SMOKE_ARGS=${SMOKE_ARGS:---preset 125m --seq-len 1024 --steps 10}
    MFU_ARGS=${MFU_ARGS:---presets 1.3b --steps 10 --warmup 3}
    REFORM_ARGS=${REFORM_ARGS:---preset 125m --seq-len 1024}
    MIRROR_ARGS=${MIRROR_ARGS:---shapes 1024x16 --batch 128 --steps 4 --rounds 2}
    PYTEST_S=${PYTEST_S:-180} IN_PROCESS_S=${IN_PROCESS_S:-240} SMOKE_S=${SMOKE_S:-90} MFU_S=${MFU_S:-180}
    REFORM_S=${REFORM_S:-90} MIRROR_S=${MIRROR_S:-120}
else
    SMOKE_ARGS=${SMOKE_ARGS:---steps 3}
    MFU_ARGS=${MFU_ARGS:---steps 3}
    REFORM_ARGS=${REFORM_ARGS:---backend eager}  # dynamo caches frames alike; no C++ builds on the CI's two cores
    MIRROR_ARGS=${MIRROR_ARGS:---shapes 128x2 --steps 2 --rounds 1}
    PYTEST_S=${PYTEST_S:-120} IN_PROCESS_S=${IN_PROCESS_S:-60} SMOKE_S=${SMOKE_S:-180} MFU_S=${MFU_S:-180}
    REFORM_S=${REFORM_S:-120} MIRROR_S=${MIRROR_S:-120}
fi

# name seconds command...: runs one part under `timeout`, its output shown and kept in
# $LOGS/name.log, and adds its row (name, status, seconds) to $LOGS/parts.tsv.
run_part() {
    local name=$1 seconds=$2
    shift 2
    local started=$SECONDS rc status command="$*"
    echo "=== $name (at most $seconds s): ${command:0:160}"
    timeout --kill-after=10 "$seconds" "$@" 2>&1 | tee "$LOGS/$name.log"
    rc=${PIPESTATUS[0]}
    case $rc in
        0) status=ok ;;
        124|137) status=timeout ;;
        *) status="failed($rc)" ;;
    esac
    printf '%s\t%s\t%s\n' "$name" "$status" $((SECONDS - started)) >>"$LOGS/parts.tsv"
}

cd "$REPO"
run_part install 30 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" \
    "$CARRY"/*.whl
export PYTHONPATH=$SITE:$REPO/platform PYTHONUNBUFFERED=1
# Only the plugins named here: a machine's own pytest plugins were built for its own pytest,
# not the carried one.
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
# One part by name, with its arguments and seconds.
run_named() {
    case $1 in
        # shellcheck disable=SC2086 # the *_ARGS are word lists
        pytest) run_part pytest "$PYTEST_S" "$PYTHON" -m pytest tests/gpu -q -ra -p pytest_timeout \
            -p no:cacheprovider --durations=10 --deselect "$IN_PROCESS" $PYTEST_ARGS ;;
        # -rA: each drill prints how long the survivor's failed all-reduce waited and when it
        # stepped alone, and NCCL's account of it.
        in_process) run_part in_process "$IN_PROCESS_S" "$PYTHON" -m pytest "$IN_PROCESS" -q -rA \
            -p pytest_timeout -p no:cacheprovider ;;
        # shellcheck disable=SC2086
        smoke) run_part smoke "$SMOKE_S" "$PYTHON" bench/gpu_smoke.py --device "$DEVICE" $SMOKE_ARGS ;;
        # shellcheck disable=SC2086
        mfu) run_part mfu "$MFU_S" "$PYTHON" bench/mfu.py --device "$DEVICE" $MFU_ARGS ;;
        # shellcheck disable=SC2086
        reform) run_part reform "$REFORM_S" "$PYTHON" bench/reform_compile.py --device "$DEVICE" $REFORM_ARGS ;;
        # shellcheck disable=SC2086
        mirror) run_part mirror "$MIRROR_S" "$PYTHON" bench/mirror_cost.py --device "$DEVICE" $MIRROR_ARGS ;;
    esac
}

if grep -q "^install	ok" "$LOGS/parts.tsv"; then
    for part in $PARTS; do
        run_named "$part"
    done
fi

"$PYTHON" - "$LOGS" "$CARRY" "$SITE" "$PARTS" <<'EOF'
"""The closing table: one row per part, its key figures read from its log."""
import re
import sys
from pathlib import Path

logs, carry, site = map(Path, sys.argv[1:4])
expected = ["install"] + sys.argv[4].split()


def rows_after(text, first_column):
    """The rows of the table whose header starts with `first_column`, split on spaces."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.split()[:1] == [first_column]:
            rows = []
            for row in lines[i + 2:]:
                if not row.strip():
                    break
                rows.append(row.split())
            return rows
    return []


def figures(name, text):
    if name == "install":
        return f"{len(list(carry.glob('*.whl')))} wheels from {carry} into {site}"
    if name in ("pytest", "in_process"):
        summary = [line.strip("= ") for line in text.splitlines()
                   if re.search(r"\d+ (passed|failed|skipped|error)", line)]
        timed = re.findall(r"^(\w+): rank 0's failed all-reduce \{(.*)\}", text, re.M)
        return "; ".join(summary[-1:] + [f"{drill}: {times}" for drill, times in timed if times])
    if name == "smoke":
        return "; ".join(f"ZeRO-{r[0]}: {r[5]} tokens/s, stall {r[6]} s, restore {r[8]} s, {r[9]}"
                         for r in rows_after(text, "zero"))
    if name == "mfu":
        found = [f"{r[0]} {r[1]}: {r[2]} tokens/s, MFU {r[3]}%" for r in rows_after(text, "preset")]
        stall = re.search(r"full state \(([\d.]+) GB.*?: ([\d.]+) s per save", text)
        if stall:
            found.append(f"stall {stall.group(2)} s for {stall.group(1)} GB")
        return "; ".join(found)
    if name == "reform":
        return "; ".join(f"engine {r[0]}: first step {r[2]} s, {r[3]} frames compiled" for r in rows_after(text, "engine"))
    if name == "mirror":
        cells = [[c.strip() for c in line.strip("| ").split("|")] for line in text.splitlines()
                 if line.startswith("| ") and "x)" in line]
        return "; ".join(f"{c[0]} ({c[2]} a rank): a step {c[3]}, in-process {c[5]}" for c in cells)
    return ""


parts = [line.split("\t") for line in (logs / "parts.tsv").read_text().splitlines()]
print(f"\n{'part':<10} {'status':<11} {'seconds':>7}  figures")
print("-" * 80)
for name, status, seconds in parts:
    log = logs / f"{name}.log"
    print(f"{name:<10} {status:<11} {seconds:>7}  {figures(name, log.read_text() if log.exists() else '')}")
print(f"\nlogs: {logs}")
sys.exit(0 if [name for name, _, _ in parts] == expected and all(status == "ok" for _, status, _ in parts) else 1)
EOF
