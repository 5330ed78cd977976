#!/usr/bin/env bash
# A helper of bench/gpu_all.sh, no benchmark: the wheels a GPU machine needs, in one folder.
#
# Usage: bash bench/device_carry.sh [--python-version 3.12] [--out .carry]
#
# A GPU machine without a package registry needs them to run tests/gpu and the GPU benches
# (bench/gpu_all.sh installs them there). Prints the wheels' count and size beside the
# working tree's, against the 64 MiB a device call carries.
# That machine has Python 3.12, torch (+ its own requirements), numpy and pyarrow; this is
# everything else the GPU path imports: DeepSpeed (an sdist, built here as a pure-Python
# wheel with DS_BUILD_OPS=0: its ops compile on first use there), its requirements, OmegaConf
# and its YAML parser, and pytest, each at the version of this checkout's environment (one
# version of each: two stop pip's install). Ray and MLflow stay out: nothing on the GPU path
# imports them. Everything a call carries, this folder and the working tree, must fit in
# 64 MiB; the script fails when it does not.
#
# PYTHON (default: the checkout's .venv, else python3) is the environment whose versions are
# pinned and that builds DeepSpeed (torch in it: its setup.py imports torch). The DeepSpeed
# wheel is cached by version under ~/.cache/wildtrain (a build takes a while); pip's own cache
# keeps the downloads.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON_VERSION=3.12
OUT=$REPO/.carry
while [ $# -gt 0 ]; do
    case $1 in
        --python-version) PYTHON_VERSION=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        *) echo "usage: $0 [--python-version X.Y] [--out DIR]" >&2; exit 2 ;;
    esac
done
if [ -z "${PYTHON:-}" ]; then
    PYTHON=python3
    [ -x "$REPO/.venv/bin/python" ] && PYTHON=$REPO/.venv/bin/python
fi
LIMIT=$((64 * 1024 * 1024))
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT

# pip's output only when it fails: where pip is set up with an index that is absent, every
# package look-up warns.
quiet_pip() {
    "$PYTHON" -m pip "$@" >"$LOG" 2>&1 || { cat "$LOG" >&2; echo "device_carry.sh: pip $1 failed" >&2; exit 1; }
}

mib() {
    awk -v bytes="$1" 'BEGIN { printf "%.1f", bytes / 1048576 }'
}

# DeepSpeed's requirements less torch and numpy; OmegaConf's (2.4 needs no antlr4 runtime);
# pytest's, and pytest-timeout for the timeout the project's pytest settings name.
PACKAGES=(
    einops hjson msgpack ninja packaging psutil py-cpuinfo tqdm
    pydantic pydantic-core annotated-types typing-inspection typing-extensions
    omegaconf PyYAML
    pytest pluggy iniconfig pygments pytest-timeout
)

version_of() {
    "$PYTHON" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$1" 2>/dev/null || {
        echo "device_carry.sh: $1 is not installed in $PYTHON's environment, whose versions are carried" >&2
        exit 1
    }
}

rm -rf "$OUT"
mkdir -p "$OUT"

DEEPSPEED=$(version_of deepspeed)
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/wildtrain/deepspeed-$DEEPSPEED
if ! ls "$CACHE"/deepspeed-"$DEEPSPEED"-py3-none-any.whl >/dev/null 2>&1; then
    echo "building the DeepSpeed $DEEPSPEED wheel (no compiled ops) into $CACHE"
    rm -rf "$CACHE.tmp"
    DS_BUILD_OPS=0 quiet_pip wheel --no-deps --no-build-isolation -w "$CACHE.tmp" "deepspeed==$DEEPSPEED"
    rm -rf "$CACHE"
    mv "$CACHE.tmp" "$CACHE"
fi
cp "$CACHE"/deepspeed-"$DEEPSPEED"-py3-none-any.whl "$OUT/"

PINS=()
for package in "${PACKAGES[@]}"; do
    PINS+=("$package==$(version_of "$package")")
done
# Binary wheels only, for the target interpreter on any manylinux x86-64 (the device
# README's recipe): nothing is built there, and pip matches each platform tag exactly.
quiet_pip download --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$OUT" "${PINS[@]}"

count=$(ls "$OUT"/*.whl | wc -l)
if [ "$count" -ne $((${#PACKAGES[@]} + 1)) ]; then
    echo "device_carry.sh: $count wheels in $OUT for $((${#PACKAGES[@]} + 1)) packages" >&2
    exit 1
fi
carry=$(du -sb "$OUT" | cut -f1)
# What travels besides: the tracked and untracked, not ignored, files of the checkout (a
# tracked file deleted in the working tree does not: du skips it).
tree=$(cd "$REPO" && git ls-files -co --exclude-standard -z | { du -bc --files0-from=- 2>/dev/null || true; } \
    | tail -1 | cut -f1)
total=$((carry + tree))
echo "carry: $count wheels for Python $PYTHON_VERSION in $OUT, $(mib "$carry") MiB;" \
    "working tree $(mib "$tree") MiB; together $(mib "$total") of 64 MiB"
if [ "$total" -gt "$LIMIT" ]; then
    echo "device_carry.sh: over the 64 MiB a device call carries" >&2
    exit 1
fi
