"""`wildtrain sync SRC DST`: a resumable, verified copy between stores, by rclone.

A copy is only ever used through its manifests (a prepared dataset's, each checkpoint's) and
a run through its record (`wildtrain_run.json`): these "commit files" go last. In order:

1. rclone copies everything else (`--checksum`: a file already at DST with the same size
   and, where both stores give one, the same hash is skipped, so an interrupted sync
   resumes where it stopped); rclone's `--bwlimit` caps it.
2. Every copied byte is checked: the files a manifest names against its sha256, read from
   DST; the rest (part records, anything else) byte for byte against SRC (`rclone check
   --download`), since stores such as SeaweedFS give rclone no hash for pyarrow's uploads.
   A file that fails is removed from DST, so the next sync copies it again.
3. The commit files listed in step 1's plan, and only those, are copied and checked byte
   for byte: a checkpoint that commits at SRC during the sync has files that steps 1 and 2
   may not have seen, so its manifest waits for the next sync.

SRC and DST are URIs (s3://, gs://, local paths) or `CLUSTER:runs/...`, `CLUSTER:data/...`:
that cluster's store (`storage.runs`, `storage.data` of the registry), reached with its
endpoint and keys; its `sync_bwlimit` is the default cap. rclone gets the keys in
`RCLONE_CONFIG_*` variables, never on its command line, which every user can read.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

from wildtrain import storage
from wildtrain.checkpoint import format as ckpt_format
from wildtrain.checkpoint.store import Store, verify_files
from wildtrain.clusters.registry import BWLIMIT, Registry
from wildtrain.config import ConfigError, StorageConfig
from wildtrain.data import manifest as data_manifest

RUN_RECORD = "wildtrain_run.json"  # layout.RunLayout.record's name
# A dataset's and a checkpoint's manifest have the same name.
assert data_manifest.MANIFEST == ckpt_format.MANIFEST
COMMIT_FILES = (ckpt_format.MANIFEST, RUN_RECORD)
# layout.RunLayout.lease's name: which driver trains the run at SRC. Never copied: nothing
# trains the copy, and a live run's lease, renewed mid-sync, would fail the byte check.
LEASE = "lease.json"
_CLUSTER_PATH = re.compile(r"(?P<cluster>[A-Za-z0-9_.-]+):(?P<store>runs|data)(?:/(?P<path>.*))?")
_SUFFIX = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


class SyncError(RuntimeError):
    """A sync that did not finish verified; one line naming the location and what to do."""


@dataclass(frozen=True)
class Location:
    uri: str  # s3://bucket/path, gs://bucket/path or an absolute local path
    storage: StorageConfig = field(default_factory=StorageConfig)
    bwlimit: Optional[str] = None  # the cap of the cluster it belongs to

    @property
    def is_local(self) -> bool:
        return "://" not in self.uri


def parse_location(text: str, registry: Callable[[], Registry]) -> Location:
    """`CLUSTER:runs/PATH` or `CLUSTER:data/PATH` (the registry is loaded only then), else a URI."""
    match = _CLUSTER_PATH.fullmatch(text)
    if match is None or "://" in text:
        return Location(storage.resolve(text))
    cluster = registry().get(match["cluster"])
    base = getattr(cluster.entry.storage, match["store"])
    return Location(
        storage.join(base, match["path"]) if match["path"] else base, cluster.entry.storage, cluster.entry.sync_bwlimit
    )


def rate_bytes(rate: str) -> float:
    number, suffix = re.fullmatch(r"([\d.]+)([BKMG]?)", rate).groups()
    return float(number) * _SUFFIX[suffix]


def default_bwlimit(src: Location, dst: Location) -> Optional[str]:
    """The lower of the two clusters' caps: both stores carry the copy."""
    caps = [loc.bwlimit for loc in (src, dst) if loc.bwlimit]
    return min(caps, key=rate_bytes) if caps else None


def check_bwlimit(rate: str) -> str:
    if rate != "off" and not BWLIMIT.fullmatch(rate):
        raise ConfigError(f"--bwlimit: {rate!r} is not a rate such as 2M (bytes/s) or off")
    return rate


@dataclass(frozen=True)
class SyncResult:
    copied: tuple[str, ...]  # paths relative to SRC that this sync transferred
    # Step 1 alone, what --bwlimit caps, as rclone accounts it (from its first byte to its
    # last, without its start and listing).
    copied_bytes: int
    copy_seconds: float
    verified: int  # files checked at DST
    commit_files: tuple[str, ...]


def rclone_cli() -> str:
    return shutil.which("rclone", path=str(Path(sys.executable).parent)) or "rclone"


class _Rclone:
    """rclone with SRC and DST as remotes configured from the environment alone."""

    def __init__(self, src: Location, dst: Location):
        # A user's own rclone.conf must not change what a remote means.
        self.env = {**os.environ, "RCLONE_CONFIG": os.devnull}
        self.src = self._remote("WTSRC", src)
        self.dst = self._remote("WTDST", dst)

    def _remote(self, name: str, loc: Location) -> str:
        if loc.is_local:
            return loc.uri
        scheme, _, path = loc.uri.partition("://")
        prefix = f"RCLONE_CONFIG_{name}_"
        if scheme == "s3":
            config = loc.storage
            access, secret = os.environ.get(config.access_key_env), os.environ.get(config.secret_key_env)
            settings = {
                "TYPE": "s3",
                "PROVIDER": "Other",
                "REGION": config.region,
                "NO_CHECK_BUCKET": "true",
                **(
                    {"ACCESS_KEY_ID": access, "SECRET_ACCESS_KEY": secret}
                    if access and secret
                    else {"ENV_AUTH": "true"}
                ),
            }
            if storage.endpoint(config):
                settings["ENDPOINT"] = storage.endpoint(config)
        elif scheme == "gs":
            settings = {"TYPE": "google cloud storage", "ENV_AUTH": "true"}
        else:
            raise ConfigError(f"{loc.uri}: sync reaches s3://, gs:// and local paths only")
        self.env.update({prefix + key: value for key, value in settings.items()})
        return f"{name}:{path}"

    def run(
        self, *args: str, log: Callable[[dict], None] = lambda entry: None, allow_fail: bool = False
    ) -> subprocess.CompletedProcess:
        """rclone ARGS, its JSON log entries passed to `log` as they come."""
        # rclone logs its closing stats only with a stats interval; an hour: no others before.
        process = subprocess.Popen(
            [rclone_cli(), *args, "--use-json-log", "--stats", "1h"],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        errors = []
        for line in process.stderr:
            try:
                entry = json.loads(line)
            except ValueError:
                errors.append(line.strip())
                continue
            if entry.get("level") == "error":
                errors.append(f"{entry.get('object', '')}: {entry.get('msg', '')}")
            log(entry)
        stdout = process.stdout.read()
        if process.wait() != 0 and not allow_fail:
            raise SyncError(
                f"rclone {args[0]} {self.src} -> {self.dst} failed: {'; '.join(errors[-3:]) or process.returncode}"
            )
        return subprocess.CompletedProcess(args, process.returncode, stdout, "\n".join(errors))

    def files(self) -> dict[str, int]:
        """SRC's files and their sizes."""
        listing = self.run("lsjson", "-R", "--files-only", self.src).stdout
        return {item["Path"]: item["Size"] for item in json.loads(listing or "[]")}


def _commit_filter() -> list[str]:
    return [arg for name in COMMIT_FILES for arg in ("--exclude", name)]


@contextmanager
def _listing(paths: list[str]) -> Iterator[str]:
    """A file naming `paths`, one a line, for rclone's --files-from."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as listing:
        listing.write("\n".join(paths) + "\n")
        listing.flush()
        yield listing.name


def sync(
    src: Location, dst: Location, bwlimit: Optional[str] = None, on_copied: Callable[[str], None] = lambda path: None
) -> SyncResult:
    """Copy SRC to DST, verified, commit files last; `bwlimit` (rclone syntax) caps step 1,
    default the clusters' cap. `on_copied` gets each path as it lands at DST."""
    rclone = _Rclone(src, dst)
    cap = check_bwlimit(bwlimit) if bwlimit else default_bwlimit(src, dst)
    sizes = {path: size for path, size in rclone.files().items() if path.rsplit("/", 1)[-1] != LEASE}
    if not sizes:
        raise SyncError(f"{src.uri}: nothing to copy (no such folder, or empty)")
    copied: list[str] = []
    stats: dict = {}

    def note(entry: dict) -> None:
        if entry.get("msg", "").startswith("Copied"):
            copied.append(entry["object"])
            on_copied(entry["object"])
        stats.update(entry.get("stats", {}))

    rclone.run(
        "copy",
        rclone.src,
        rclone.dst,
        "--checksum",
        "-v",
        *(["--bwlimit", cap] if cap else []),
        *_commit_filter(),
        "--exclude",
        LEASE,
        log=note,
    )
    copied_bytes, copy_seconds = stats.get("bytes", 0), stats.get("transferTime", 0.0)
    verified = _verify(rclone, src, dst, sizes)
    commit = sorted(p for p in sizes if p.rsplit("/", 1)[-1] in COMMIT_FILES)
    if commit:
        with _listing(commit) as listing:
            rclone.run("copy", rclone.src, rclone.dst, "--checksum", "-v", "--files-from", listing, log=note)
        _check_bytes(rclone, dst, commit)
    return SyncResult(tuple(copied), copied_bytes, copy_seconds, verified + len(commit), tuple(commit))


def _verify(rclone: _Rclone, src: Location, dst: Location, sizes: dict[str, int]) -> int:
    """Check DST's copy of every file but the commit files; returns how many were checked."""
    covered: set[str] = set()
    problems: list[str] = []
    for path in sizes:
        folder, _, name = path.rpartition("/")
        if name != ckpt_format.MANIFEST:
            continue
        named, bad = _verify_by_manifest(src, dst, folder)
        covered |= {f"{folder}/{p}" if folder else p for p in named}
        problems += [f"{folder}/{p}" if folder else p for p in bad]
    rest = [p for p in sizes if p not in covered and p.rsplit("/", 1)[-1] not in COMMIT_FILES]
    problems += _check_bytes(rclone, dst, rest, raise_on_mismatch=False)
    if problems:
        _remove(dst, problems)
        raise SyncError(
            f"{dst.uri}: {len(problems)} files did not match {src.uri} (first: {problems[0]}); "
            f"they were removed: run the sync again"
        )
    return len(covered) + len(rest)


def _verify_by_manifest(src: Location, dst: Location, folder: str) -> tuple[list[str], list[str]]:
    """The files the manifest in SRC's `folder` names, and those of them whose bytes at DST do
    not hash to its sha256. A manifest of neither kind covers nothing."""
    src_root = storage.join(src.uri, folder) if folder else src.uri
    manifest = storage.join(src_root, ckpt_format.MANIFEST)
    text = storage.read_text(manifest, src.storage)
    if text is None:  # its checkpoint was removed (retention, a user) since the sync listed SRC
        raise SyncError(f"{manifest}: gone from SRC during the sync; run the sync again")
    raw = json.loads(text)
    if "shards" in raw:
        files = [ckpt_format.FileEntry(s["path"], s["bytes"], s["sha256"]) for s in raw["shards"]]
        if "sha256" in raw.get("tokenizer", {}):
            tokenizer = storage.read_bytes(storage.join(src_root, data_manifest.TOKENIZER), src.storage)
            files.append(
                ckpt_format.FileEntry(data_manifest.TOKENIZER, len(tokenizer or b""), raw["tokenizer"]["sha256"])
            )
    elif "files" in raw:
        files = list(ckpt_format.CheckpointManifest.from_json(text, folder).files)
    else:
        return [], []
    parent, _, name = (storage.join(dst.uri, folder) if folder else dst.uri).rstrip("/").rpartition("/")
    store = Store.from_uri(parent, dst.storage)
    problems = verify_files(store, name, files).problems
    bad = [f.path for f in files if any(p.startswith(f"{store.describe(name, f.path)}:") for p in problems)]
    return [f.path for f in files], bad


def _check_bytes(rclone: _Rclone, dst: Location, paths: list[str], raise_on_mismatch: bool = True) -> list[str]:
    """Compare `paths` at DST with SRC byte for byte; the ones that differ."""
    if not paths:
        return []
    bad: list[str] = []

    def note(entry: dict) -> None:
        if entry.get("level") == "error" and entry.get("object"):
            bad.append(entry["object"])

    with _listing(paths) as listing:
        done = rclone.run(
            "check",
            rclone.src,
            rclone.dst,
            "--one-way",
            "--download",
            "--files-from",
            listing,
            log=note,
            allow_fail=True,
        )
    if done.returncode != 0 and not bad:
        raise SyncError(f"rclone check {rclone.src} -> {rclone.dst} failed: {done.stderr}")
    if bad and raise_on_mismatch:
        _remove(dst, bad)
        raise SyncError(
            f"{dst.uri}: {len(bad)} files did not match (first: {bad[0]}); they were removed: run the sync again"
        )
    return bad


def _remove(dst: Location, paths: list[str]) -> None:
    for path in paths:
        fs, at = storage.filesystem(storage.join(dst.uri, path), dst.storage)
        try:
            fs.delete_file(at)
        except FileNotFoundError:
            pass
