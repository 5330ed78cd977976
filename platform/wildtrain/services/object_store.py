"""The local S3 object store: SeaweedFS's `weed mini`, with one bucket and its own keys."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.fs as pafs

from wildtrain import storage
from wildtrain.config import StorageConfig
from wildtrain.services.process import (
    HOST,
    ServiceError,
    free_port,
    free_port_with_offset,
    private_dir,
    stop_process,
    wait_until,
)

# `weed mini` runs a master, volume server, filer, S3 gateway and admin server, each with an
# HTTP and a gRPC port; unset ports default to fixed numbers (gRPC: HTTP + 10000), so a second
# store on the same machine would collide. Only the S3 port is chosen by the caller.
WEED_INTERNAL_PORTS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port.grpc",
)
# The admin server's maintenance worker dials the admin HTTP port + 10000 whatever
# -admin.port.grpc says (seaweedfs 4.48), so the admin gRPC port is left at that default.
WEED_GRPC_OFFSET = 10000
WEED_DISABLED = (
    "-admin.ui=false",
    "-webdav=false",
    "-s3.port.iceberg=0",
    "-s3.port.lance=0",
    "-master.telemetry=false",
)


@dataclass
class ObjectStore:
    """A running SeaweedFS S3 endpoint and what a client needs to reach it."""

    endpoint: str
    bucket: str
    access_key: str
    secret_key: str = field(repr=False)
    pid: int
    data_dir: str

    def env(self) -> dict[str, str]:
        """The standard variables that point `storage` (and any S3 client) at this store."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
        }


def weed_cli() -> str:
    return shutil.which("weed", path=str(Path(sys.executable).parent)) or "weed"


def object_store_keys() -> tuple[str, str]:
    """The keys the store accepts: $AWS_ACCESS_KEY_ID/$AWS_SECRET_ACCESS_KEY, else a fresh random pair."""
    access_key, secret_key = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if access_key and secret_key:
        return access_key, secret_key
    return secrets.token_hex(10).upper(), secrets.token_hex(20)


def start_object_store(root: Path, port: int, bucket: str = "wildtrain", timeout_s: float = 60.0) -> ObjectStore:
    """A SeaweedFS S3 endpoint on 127.0.0.1:`port` storing its data under `root`, with
    `bucket` created; returns once the bucket answers a signed request."""
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
        # SeaweedFS only logs a warning for an invalid name and then never creates the bucket.
        raise ServiceError(f"bucket {bucket!r}: not a valid S3 bucket name (3-63 of a-z, 0-9, '.', '-')")
    root = private_dir(root.resolve())
    data_dir = private_dir(root / "data")
    log = root / "weed.log"
    access_key, secret_key = object_store_keys()
    process = subprocess.Popen(
        [
            weed_cli(),
            "mini",
            f"-dir={data_dir}",
            f"-ip={HOST}",
            f"-ip.bind={HOST}",
            f"-bucket={bucket}",
            f"-s3.port={port}",
            *(f"-{name}={free_port()}" for name in WEED_INTERNAL_PORTS),
            f"-admin.port={free_port_with_offset(WEED_GRPC_OFFSET)}",
            *WEED_DISABLED,
        ],
        # SeaweedFS takes its admin identity from these variables: never from the command line,
        # which every user of the machine can read.
        env={**os.environ, "AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key},
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # outlives the shell that ran `wildtrain up`
    )
    store = ObjectStore(f"http://{HOST}:{port}", bucket, access_key, secret_key, process.pid, str(data_dir))
    client = storage.s3_filesystem(store.endpoint, access_key, secret_key, StorageConfig.region, max_attempts=1)

    def bucket_ready() -> bool:
        try:
            return client.get_file_info(bucket).type == pafs.FileType.Directory
        except OSError:
            return False

    try:
        wait_until(bucket_ready, f"{store.endpoint} did not serve bucket {bucket!r}", process, log, timeout_s)
    except ServiceError:
        stop_process(process.pid)
        raise
    return store
