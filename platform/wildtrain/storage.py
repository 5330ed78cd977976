"""Files by URI: local paths, s3://, gs://, through pyarrow filesystems."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import pyarrow.fs as pafs


def resolve(uri: str) -> str:
    """A URI as every process of the run can use it: local paths become absolute."""
    if "://" in uri:
        return uri
    return str(Path(uri).expanduser().resolve())


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    return pafs.FileSystem.from_uri(resolve(uri))


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *parts])


def read_text(uri: str) -> Optional[str]:
    fs, path = filesystem(uri)
    if fs.get_file_info(path).type != pafs.FileType.File:
        return None
    with fs.open_input_stream(path) as f:
        return f.read().decode()


def write_text(uri: str, text: str) -> None:
    """Write via a temporary name and a rename, so readers never see half a file."""
    fs, path = filesystem(uri)
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    tmp = path + ".tmp"
    with fs.open_output_stream(tmp) as f:
        f.write(text.encode())
    fs.move(tmp, path)
