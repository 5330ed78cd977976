"""Files by URI: local paths, s3://, gs://, through pyarrow filesystems.

An s3:// URI reaches AWS or any S3-compatible store (SeaweedFS, MinIO, ...): the endpoint comes
from `StorageConfig.endpoint` or $AWS_ENDPOINT_URL, the keys from the environment variables the
config names. Each request is retried with backoff `max_attempts` times; a request that still
fails raises `StorageError` naming the URI and endpoint, never the keys.

Every process of a run must reach the store its driver checked, wherever it runs: a node of
another cluster may have no endpoint, or another one, in its environment. The driver hands
its own settings to the others (`handover_env`) and each compares what it resolves
(`StorageView`) with the driver's.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional
from urllib.parse import urlsplit

import pyarrow.fs as pafs

from wildtrain.config import StorageConfig, redact

ENDPOINT_VARIABLE = "AWS_ENDPOINT_URL"


class StorageError(OSError):
    """A storage request that failed (after its retries); one line naming the URI and endpoint."""


def resolve(uri: str) -> str:
    """A URI as every process of the run can use it: local paths become absolute."""
    if "://" in uri:
        return uri
    return str(Path(uri).expanduser().resolve())


def endpoint(config: Optional[StorageConfig] = None) -> Optional[str]:
    """The S3 endpoint that s3:// URIs go to; None: AWS itself."""
    return (config or StorageConfig()).endpoint or os.environ.get(ENDPOINT_VARIABLE) or None


def _keys(config: StorageConfig) -> tuple[Optional[str], Optional[str]]:
    """The key pair from the variables `config` names, or (None, None) unless both are set:
    then pyarrow's default credential chain answers."""
    access, secret = os.environ.get(config.access_key_env), os.environ.get(config.secret_key_env)
    return (access, secret) if access and secret else (None, None)


@dataclass(frozen=True)
class StorageView:
    """What s3:// URIs resolve to in one process: endpoint (None: AWS), region, and keys as a
    digest of both values (None: the default credential chain), so that a view can travel
    to another process and be compared and named there without the keys."""

    endpoint: Optional[str]
    region: str
    key_variables: tuple[str, str]
    keys_sha256: Optional[str]

    @classmethod
    def here(cls, config: StorageConfig) -> "StorageView":
        access, secret = _keys(config)
        digest = hashlib.sha256(f"{access}\0{secret}".encode()).hexdigest() if access else None
        return cls(endpoint(config), config.region, (config.access_key_env, config.secret_key_env), digest)

    def differences(self, drivers: "StorageView") -> list[str]:
        """How this view differs from the driver's, a phrase each, no key's value in any.
        Keys count only where the driver has its own: its default credential chain is its
        machine's, which no other process can have."""
        found = []
        if self.endpoint != drivers.endpoint:
            found.append(f"endpoint {redact(self.endpoint or 'AWS')}, the driver's {redact(drivers.endpoint or 'AWS')}")
        if self.region != drivers.region:
            found.append(f"region {self.region}, the driver's {drivers.region}")
        if drivers.keys_sha256 is not None and self.keys_sha256 != drivers.keys_sha256:
            names = "/".join(self.key_variables)
            found.append(
                f"{names} not both set, the driver's are"
                if self.keys_sha256 is None
                else f"{names} hold other keys than the driver's"
            )
        return found


def handover_env(config: StorageConfig) -> dict[str, str]:
    """The environment variables that make another process resolve s3:// as this one does
    (`StorageView.here`): the endpoint, empty for AWS (so that one in a node's environment
    does not count), and the key pair where this process has one. It holds the keys: for a
    runtime env, never a config, a log or MLflow."""
    access, secret = _keys(config)
    keys = {config.access_key_env: access, config.secret_key_env: secret} if access else {}
    return {ENDPOINT_VARIABLE: endpoint(config) or "", **keys}


def s3_filesystem(
    endpoint_url: Optional[str], access_key: Optional[str], secret_key: Optional[str], region: str, max_attempts: int
) -> pafs.S3FileSystem:
    """An S3 client with bounded retries; without both keys, pyarrow's default credential chain."""
    options = {}
    if endpoint_url:
        url = urlsplit(endpoint_url if "://" in endpoint_url else f"https://{endpoint_url}")
        options = {"endpoint_override": url.netloc, "scheme": url.scheme}
    keys = {"access_key": access_key, "secret_key": secret_key} if access_key and secret_key else {}
    return pafs.S3FileSystem(
        region=region,
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=max_attempts),
        **keys,
        **options,
    )


def filesystem(uri: str, config: Optional[StorageConfig] = None) -> tuple[pafs.FileSystem, str]:
    uri = resolve(uri)
    if uri.startswith("s3://"):
        config = config or StorageConfig()
        fs = s3_filesystem(endpoint(config), *_keys(config), config.region, config.max_attempts)
        return fs, uri[len("s3://") :].rstrip("/")
    # gs:// and local paths: pyarrow's own defaults (GCS credentials from the environment).
    return pafs.FileSystem.from_uri(uri)


@contextmanager
def errors(uri: str, config: Optional[StorageConfig] = None) -> Iterator[None]:
    """Re-raise a failed request inside the block as one `StorageError` line naming `uri`
    and, for s3://, the endpoint it went to."""
    try:
        yield
    except StorageError:
        raise
    except OSError as e:
        where = f" (endpoint {endpoint(config) or 'AWS'})" if resolve(uri).startswith("s3://") else ""
        raise StorageError(f"{uri}{where}: {' '.join(str(e).split())}") from e


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *parts])


def probe(uri: str, config: Optional[StorageConfig] = None) -> None:
    """Fail now, with the URI and endpoint named, if the store holding `uri` does not answer."""
    fs, path = filesystem(uri, config)
    with errors(uri, config):
        fs.get_file_info(path)


def list_files(uri: str, config: Optional[StorageConfig] = None) -> tuple[pafs.FileSystem, list[str]]:
    """The filesystem of `uri` and the files there, as its paths, sorted: `uri` itself if it
    is a file, everything under it if it is a folder or prefix, nothing if it does not exist."""
    fs, files = list_sizes(uri, config)
    return fs, [path for path, _ in files]


def list_sizes(uri: str, config: Optional[StorageConfig] = None) -> tuple[pafs.FileSystem, list[tuple[str, int]]]:
    """`list_files` with each file's size, from the same listing."""
    fs, path = filesystem(uri, config)
    with errors(uri, config):
        info = fs.get_file_info(path)
        if info.type != pafs.FileType.Directory:
            return fs, [(path, info.size)] if info.type == pafs.FileType.File else []
        found = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    return fs, sorted((f.path, f.size) for f in found if f.type == pafs.FileType.File)


def read_bytes(uri: str, config: Optional[StorageConfig] = None) -> Optional[bytes]:
    """The file's content; None if there is no file at `uri`."""
    fs, path = filesystem(uri, config)
    with errors(uri, config):
        if fs.get_file_info(path).type != pafs.FileType.File:
            return None
        with fs.open_input_stream(path) as f:
            return f.read()


def read_text(uri: str, config: Optional[StorageConfig] = None) -> Optional[str]:
    data = read_bytes(uri, config)
    return None if data is None else data.decode()


def write_bytes(uri: str, data: bytes, config: Optional[StorageConfig] = None) -> None:
    """Write so that readers never see half a file."""
    fs, path = filesystem(uri, config)
    with errors(uri, config):
        write_atomic(fs, path, data)


def write_text(uri: str, text: str, config: Optional[StorageConfig] = None) -> None:
    write_bytes(uri, text.encode(), config)


def write_if_changed(uri: str, data: bytes, config: Optional[StorageConfig] = None) -> bool:
    """Write `data` unless `uri` already holds exactly these bytes; True if it wrote. A file
    of the same size is read back and compared, so a corrupt or truncated one is replaced."""
    fs, path = filesystem(uri, config)
    with errors(uri, config):
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.File and info.size == len(data):
            with fs.open_input_stream(path) as f:
                if f.read() == data:
                    return False
        write_atomic(fs, path, data)
    return True


def has_folders(fs: pafs.FileSystem) -> bool:
    """Whether a file needs its folder made first: not in an object store, where pyarrow's
    `create_dir` writes a marker object for every level of the path, at every call."""
    return not isinstance(fs, (pafs.S3FileSystem, pafs.GcsFileSystem))


def write_atomic(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    """Write `data` to `path` so that readers see all of it or none of it, and a write that
    fails leaves what was there before."""
    if not has_folders(fs):
        # An object appears only once its upload completes, so a plain put is already
        # atomic; a rename would be a second, server-side copy of every byte.
        with fs.open_output_stream(path) as f:
            f.write(data)
        return
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with fs.open_output_stream(tmp) as f:
        f.write(data)
    fs.move(tmp, path)
