"""Where start-up goes, from `wildtrain train experiment=tiny` to its first step: cold against warm.

From submitting the run to its first optimizer step, on a new stack (cold) and again on the
same stack (warm).

First, on its own, DeepSpeed's comm start in a process group of one on CPU as DeepSpeed
does it (JIT-building its shared-memory op, with an empty and then a filled torch extensions
cache) against `wildtrain.engine.import_deepspeed`'s, which builds nothing.

Does what `make demo` does after its install, in a temporary folder and on free ports, so a
stack already running here is left alone: `wildtrain up` (with an empty torch extensions
cache for its workers, as on a fresh machine), `data_pipelines/prepare.py`, then the demo's
run submitted twice as a user submits it (a new `python -m wildtrain train` process each
time, another run name the second time). Prints how long each demo command took, then one
row per phase of each run's start-up, read from what the run records in MLflow (its
`started` event, the `startup/*` metrics of its first report, its first data wait):

    driver up        submit → the driver starts the run (Python's imports, the config)
    group started    → rank 0's worker process exists (data check, MLflow run, joining
                     Ray, capacity check, Ray Train's controller and placement group)
    imports          → the training function runs on rank 0 (the worker's imports)
    health check     → the new group's health check passed
    restore          → the newest checkpoint restored (a new run: listing the store),
                     less the engine build
    engine build     building DeepSpeed's engine (within the restore's span)
    data start       the first batches' wait (Ray Data starting to read)
    first step       → the first optimizer step ended (the rest: the saver, the step)

Then, also on its own, a checkpoint saver's first save from the saver's start, in a process
whose main script imports Ray as a Ray worker's does: its save child spawned as wildtrain
spawns it (`save_process._main_script_hidden`) against the same child running the parent's
main script first, as multiprocessing's spawn does by default.

Then, on the same stack, `--joiners N` joiners (default 3; 0: none), one at a time: a joiner's
start (`train.entry.joiner_main`, less its rendezvous) in a new Ray worker process with a runtime
env of its own, as the controller starts one on a lost member's slot; the median seconds from the
process's start to Ray calling it, to the loop's imports done, to its first read done, and to
`train.loop.ready_to_join`'s end (it would ask to join then). With `--sweep STEPS`, a sweep of four
trials of STEPS steps (`wildtrain sweep` over optim.lr and model.dim, as docs/sweeps.md's example;
one trial at a time on the bench's head): its wall time, and the median seconds from one trial's
MLflow run ending to the next one's created.

With `--reference-rev REV`, the stack and its two runs are done first with that revision's
wildtrain (checked out in a temporary git worktree, on the same machine, in the same bench
run), then with the working tree's: the phases of both side by side, the reference first.
`--runs-only` leaves out the comm start and the saver's first save.

bench/ettr.py reads a run's start-up phases with it (`start_up_phases`).

Usage: .venv/bin/python bench/startup.py [--steps 10] [--reference-rev REV] [--runs-only] [--joiners 3]
       [--sweep STEPS]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlflow.tracking import MlflowClient
from progress import say

from wildtrain import services
from wildtrain.events import Started
from wildtrain.tracking.mlflow_client import quiet_mlflow
from wildtrain.tracking.record import STARTUP_METRICS, mlflow_key, read_events
from wildtrain.tracking.reports.runs import find_run

REPO = Path(__file__).resolve().parents[1]
COMM_START = """
import sys, time
started = time.perf_counter()
if sys.argv[1] == "wildtrain":
    from wildtrain.engine import import_deepspeed
    deepspeed = import_deepspeed()
else:
    import deepspeed
deepspeed.init_distributed(dist_backend="gloo", verbose=False)
print(time.perf_counter() - started)
"""
# Run as a script: its top level is what a Ray worker's main script (`default_worker.py`) imports.
SAVE_CHILD = """
import ray

if __name__ == "__main__":
    import contextlib, sys, tempfile, time
    import torch
    from wildtrain.checkpoint import save_process
    from wildtrain.checkpoint.async_save import AsyncSaver, CheckpointMeta
    from wildtrain.engine import import_deepspeed
    import_deepspeed()
    from deepspeed.runtime.fp16.loss_scaler import LossScaler  # in every ZeRO state a worker saves

    if sys.argv[1] == "main script run":
        save_process._main_script_hidden = contextlib.nullcontext
    folder = tempfile.mkdtemp()
    started = time.perf_counter()
    saver = AsyncSaver([folder + "/store"], folder + "/staging", rank=0, world_size=1, attempt="bench")
    saver.save_state(CheckpointMeta(1, "step_1", 1, 0), {"state.pt": {"w": torch.zeros(8), "scaler": LossScaler(1.0)}})
    assert saver.flush(300) and [o.status for o in saver.drain()] == ["saved"]
    print(time.perf_counter() - started)
    saver.close(60)
"""
# Run as a script on the bench's stack, with its tree's wildtrain: a joiner's start (train.entry.joiner_main
# less its rendezvous) in new Ray worker processes, one at a time; per joiner, seconds from its process's start.
JOINER = """
import sys, time
from wildtrain import services
from wildtrain.config import load_config

cfg = load_config(sys.argv[2:])
services.use_local_object_store()
services.prepare_ray_client(cfg.cluster.ray_address)

import psutil, ray, torch
from wildtrain import storage
from wildtrain.driver import open_data, resolve_device
from wildtrain.elastic import scaling
from wildtrain.worker_inputs import LoopInputs


@ray.remote(num_cpus=1)
class Joiner:
    def ready(self, inputs):
        called = time.time()
        from wildtrain.train.entry import begin_first_read, check_storage

        check_storage(inputs.storage_view, inputs.cfg)
        first_read = begin_first_read(inputs)
        from wildtrain.train.loop import ready_to_join

        imported, read = time.time(), []
        first_read.add_done_callback(lambda _: read.append(time.time()))
        ready_to_join(inputs, torch.device("cpu"), first_read)
        started = psutil.Process().create_time()
        return [at - started for at in (called, imported, read[0], time.time())]


services.connect_ray(cfg.cluster.ray_address)
cfg = resolve_device(cfg)
inputs = LoopInputs(cfg, open_data(cfg), scaling.worker_resources(cfg.cluster), storage.StorageView.here(cfg.storage))
for joiner in range(int(sys.argv[1])):
    # A runtime env of its own, as a joiner's: a new process, never an idle worker of Ray's.
    env = {**storage.handover_env(cfg.storage), "WILDTRAIN_BENCH_JOINER": str(joiner)}
    actor = Joiner.options(runtime_env={"env_vars": env}).remote()
    print(*ray.get(actor.ready.remote(inputs)), flush=True)
    ray.kill(actor)
"""
JOINER_STAGES = ["called", "loop imported", "first read done", "ready to join"]
SWEEP_GRID = ["--grid", "optim.lr=1e-3,3e-3", "--grid", "model.dim=64,128"]
PHASES = [
    "driver up",
    "group started",
    "imports",
    "health check",
    "restore",
    "engine build",
    "data start",
    "first step",
]


def timed(command: list[str], cwd: Path, log: Path, env: dict[str, str]) -> float:
    """Run `command` to its end with its output in `log`; its seconds. A failure stops the bench."""
    started = time.time()
    with log.open("w") as out:
        done = subprocess.run(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}); its output: {log}")
    return time.time() - started


def comm_start_s(how: str, extensions: Path) -> float:
    """Seconds from importing DeepSpeed to its comm backend started, in a new process."""
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "TORCH_EXTENSIONS_DIR": str(extensions),
        "MASTER_ADDR": services.HOST,
        "MASTER_PORT": str(services.free_port()),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }
    done = subprocess.run([sys.executable, "-c", COMM_START, how], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"DeepSpeed's comm start ({how}) failed:\n{done.stderr[-2000:]}")
    return float(done.stdout.split()[-1])


def first_save_s(how: str, script: Path) -> float:
    """Seconds from a saver's start to its first save's end, in a new process running
    `script` (SAVE_CHILD)."""
    done = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"the save child's bench ({how}) failed:\n{done.stderr[-2000:]}")
    return float(done.stdout.split()[-1])


def start_up_phases(uri: str, run_name: str, submitted: float, folder: Path) -> dict[str, float]:
    """Seconds per phase of the run's first attempt (see the module's docstring)."""
    client = MlflowClient(uri)
    run_id = find_run(uri, run_name)
    started = next(e for e in read_events(uri, run_id, str(folder)) if isinstance(e, Started)).at

    def first(key: str):
        return min(client.get_metric_history(run_id, key), key=lambda m: m.step)

    stamps = {key: first(mlflow_key(f"startup/{key}")).value for key in STARTUP_METRICS}
    first_report = first(mlflow_key("startup/first_step_at")).step
    data_wait = next(
        m.value for m in client.get_metric_history(run_id, mlflow_key("time/data_wait_s")) if m.step == first_report
    )
    # A worker process Ray started ahead of the group (an idle one it reuses) exists before the driver does.
    worker_started = max(stamps["worker_started_at"], started)
    return {
        "driver up": started - submitted,
        "group started": worker_started - started,
        "imports": stamps["attempt_started_at"] - worker_started,
        "health check": stamps["health_checked_at"] - stamps["attempt_started_at"],
        "restore": stamps["restored_at"] - stamps["health_checked_at"] - stamps["engine_build_s"],
        "engine build": stamps["engine_build_s"],
        "data start": data_wait,
        "first step": stamps["first_step_at"] - stamps["restored_at"] - data_wait,
        "total": stamps["first_step_at"] - submitted,
    }


def table(columns: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def comm_start_and_first_save(root: Path) -> None:
    """DeepSpeed's comm start and a saver's first save, each on its own (the module's docstring)."""
    comm = {}
    for label, how, cache in (
        ("DeepSpeed, empty extensions cache", "deepspeed", "empty"),
        ("DeepSpeed, filled extensions cache", "deepspeed", "empty"),
        ("wildtrain (import_deepspeed)", "wildtrain", "wildtrain"),
    ):
        say(f"DeepSpeed's comm start: {label}")
        comm[label] = comm_start_s(how, root / f"torch_extensions-{cache}")
    print(
        "\n"
        + table(
            ["DeepSpeed's comm start, CPU", "seconds", "ratio to DeepSpeed's, empty cache"],
            [[label, f"{s:.1f}", f"{s / comm['DeepSpeed, empty extensions cache']:.2f}"] for label, s in comm.items()],
        )
        + "\n",
        flush=True,
    )
    # Alternated, three of each: the first of either pays for cold files.
    saves: dict[str, list[float]] = {"main script run": [], "main script hidden": []}
    script = root / "save_child.py"
    script.write_text(SAVE_CHILD)
    for _ in range(3):
        for how, seconds in saves.items():
            say(f"a saver's first save: the child's {how}")
            seconds.append(first_save_s(how, script))
    reference = min(saves["main script run"])
    print(
        "\n"
        + table(
            ["a saver's first save, from its start", "seconds (fastest of 3)", "all", "ratio"],
            [
                [
                    f"the parent's {how} in the child",
                    f"{min(s):.1f}",
                    ", ".join(f"{x:.1f}" for x in s),
                    f"{min(s) / reference:.2f}",
                ]
                for how, s in saves.items()
            ],
        )
        + "\n",
        flush=True,
    )


def joiner_ready(root: Path, env: dict[str, str], overrides: list[str], joiners: int) -> dict[str, float]:
    """The median seconds from a joiner's process start to each of `JOINER_STAGES`, of `joiners` joiners on
    the stack in `root`."""
    script = root / "joiner.py"
    script.write_text(JOINER)
    log = root / "joiner.log"
    timed([sys.executable, str(script), str(joiners), *overrides], root, log, env)
    rows = [[float(x) for x in line.split()] for line in log.read_text().splitlines() if line[:1].isdigit()]
    return {f"joiner: {stage}": statistics.median(row[i] for row in rows) for i, stage in enumerate(JOINER_STAGES)}


def between_trials(uri: str, sweep: str) -> float:
    """The median seconds from the end of one trial's MLflow run to the creation of the next one's (after
    its driver's start and checks), of the trials of `sweep`, which run one at a time on the bench's stack."""
    client = MlflowClient(uri)
    trials = sorted(
        client.search_runs(
            [e.experiment_id for e in client.search_experiments()],
            f"tags.`wildtrain.sweep` = '{sweep}' and tags.`wildtrain.sweep.role` = 'trial'",
        ),
        key=lambda run: run.info.start_time,
    )
    return statistics.median((b.info.start_time - a.info.end_time) / 1000 for a, b in zip(trials, trials[1:]))


def stack_runs(
    tree: Path, root: Path, steps: int, joiners: int, sweep_steps: int
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """`make demo`'s commands with `tree`'s wildtrain on a new stack in `root`: each command's
    seconds, and the cold and the warm run's start-up phases; then, on the same stack, `joiners`
    joiners' readiness (`joiner_ready`) and a sweep of four trials of `sweep_steps` steps (if any)."""
    ports = {name: services.free_port() for name in ("ray", "dashboard", "mlflow", "object-store")}
    uri = f"http://{services.HOST}:{ports['mlflow']}"
    # A user's environment, plus an empty torch extensions cache for the head, which its
    # workers inherit: the C++ builds of a fresh machine, if any.
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "TORCH_EXTENSIONS_DIR": str(root / "torch_extensions"),
        "PYTHONPATH": os.pathsep.join([str(tree / "platform"), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    wildtrain = [sys.executable, "-m", "wildtrain"]
    demo: dict[str, float] = {}
    runs: dict[str, dict[str, float]] = {}
    try:
        say(f"starting the services with {tree}'s wildtrain (wildtrain up, MLflow on {uri})")
        demo["wildtrain up"] = timed(
            wildtrain + ["up", *(f"--{name}-port={port}" for name, port in ports.items())], root, root / "up.log", env
        )
        say("preparing the tiny corpus (data_pipelines/prepare.py)")
        demo["prepare"] = timed(
            [
                sys.executable,
                # The tree's own script: it imports the tree's wildtrain.
                str(tree / "data_pipelines/prepare.py"),
                "--input",
                str(tree / "tests/assets/tiny_corpus.jsonl"),
                "--output",
                "s3://wildtrain/datasets/tiny",
                "--rows-per-group",
                "128",
            ],
            root,
            root / "prepare.log",
            env,
        )
        for kind in ("cold", "warm"):
            name = f"startup-{kind}-{int(time.time())}"
            say(f"submitting the {kind} run {name} ({steps} steps)")
            submitted = time.time()
            demo[f"train ({kind})"] = timed(
                wildtrain
                + ["train", "experiment=tiny", f"run.name={name}", f"train.steps={steps}", f"tracking.uri={uri}"],
                root,
                root / f"train-{kind}.log",
                env,
            )
            runs[kind] = start_up_phases(uri, name, submitted, root / f"events-{kind}")
        if joiners:
            say(f"starting {joiners} joiners, one at a time")
            demo.update(joiner_ready(root, env, ["experiment=tiny", f"tracking.uri={uri}"], joiners))
        if sweep_steps:
            name = f"startup-sweep-{int(time.time())}"
            say(f"the sweep {name}: four trials of {sweep_steps} steps")
            demo[f"sweep, 4 x {sweep_steps} steps"] = timed(
                wildtrain
                + ["sweep", name, *SWEEP_GRID, f"--steps={sweep_steps}", "experiment=tiny", f"tracking.uri={uri}"],
                root,
                root / "sweep.log",
                env,
            )
            demo["sweep: between trials (median)"] = between_trials(uri, name)
    finally:
        say("stopping the services")
        subprocess.run(wildtrain + ["down"], cwd=root, env=env, capture_output=True)
    return demo, runs


@contextlib.contextmanager
def checked_out(rev: str, folder: Path):
    """`rev` checked out in a git worktree at `folder`, removed at the end."""
    subprocess.run(["git", "worktree", "add", "--detach", str(folder), rev], cwd=REPO, check=True, capture_output=True)
    try:
        yield folder
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(folder)], cwd=REPO, capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="train.steps of each run (the demo's: 60)")
    parser.add_argument("--reference-rev", help="a git revision whose start-up is measured first, beside this tree's")
    parser.add_argument("--runs-only", action="store_true", help="only the runs: no comm start, no saver's save")
    parser.add_argument("--joiners", type=int, default=3, help="joiners started after the runs (0: none)")
    parser.add_argument("--sweep", type=int, default=0, metavar="STEPS", help="a sweep of four trials of STEPS steps")
    args = parser.parse_args()
    quiet_mlflow()
    root = Path(tempfile.mkdtemp(prefix="wildtrain-bench-startup-"))
    say(f"bench/startup.py: working in {root}; each command's output goes to a .log file there")
    if not args.runs_only:
        comm_start_and_first_save(root)
    trees: dict[str, tuple[dict[str, float], dict[str, dict[str, float]]]] = {}
    with contextlib.ExitStack() as stack:
        if args.reference_rev:
            reference = stack.enter_context(checked_out(args.reference_rev, root / "reference"))
            (root / "reference-stack").mkdir()
            trees[args.reference_rev] = stack_runs(
                reference, root / "reference-stack", args.steps, args.joiners, args.sweep
            )
        (root / "stack").mkdir()
        trees["this tree"] = stack_runs(REPO, root / "stack", args.steps, args.joiners, args.sweep)

    columns = [f"{kind} ({label})" for label, (_, runs) in trees.items() for kind in runs]
    # Against the reference measured in the same bench run: a loaded machine's seconds vary from run to run.
    ratio = ["ratio (this tree / reference)"] if args.reference_rev else []

    def ratio_of(seconds: list[float]) -> list[str]:
        return [f"{seconds[-1] / seconds[0]:.2f}"] if ratio else []

    demos = [demo for demo, _ in trees.values()]
    print(
        "\n"
        + table(
            ["demo command", *(f"seconds ({label})" for label in trees), *ratio],
            [
                [name, *(f"{demo[name]:.1f}" for demo in demos), *ratio_of([demo[name] for demo in demos])]
                for name in demos[0]
            ],
        ),
        flush=True,
    )
    print(
        "\n"
        + table(
            ["phase", *columns],
            [
                [phase, *(f"{runs[kind][phase]:.1f}" for _, runs in trees.values() for kind in runs)]
                for phase in PHASES + ["total"]
            ],
        )
    )
    for kind in next(iter(trees.values()))[1] if ratio else ():
        totals = [runs[kind]["total"] for _, runs in trees.values()]
        print(f"\n{kind} run's total, this tree / reference: {ratio_of(totals)[0]}", flush=True)
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"\nseconds; the phases add up to total: submit → the first step's end. Load average at the end "
        f"(1/5/15 min, {os.cpu_count()} cores): {load}",
        flush=True,
    )


if __name__ == "__main__":
    main()
