import pyarrow.fs as pafs
import pytest

from tests.helpers.faulty_fs import Faults, faulty_filesystem
from wildtrain import storage


def test_an_atomic_write_that_fails_midway_leaves_the_previous_file_whole(tmp_path):
    faults = Faults()
    fs = faulty_filesystem(pafs.LocalFileSystem(), faults)
    path = str(tmp_path / "manifest.json")
    storage.write_atomic(fs, path, b"committed")
    faults.fail_next = 1
    with pytest.raises(OSError, match="injected"):
        storage.write_atomic(fs, path, b"half written")
    assert (tmp_path / "manifest.json").read_bytes() == b"committed"
