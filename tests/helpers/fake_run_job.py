"""A stand-in for a training job on a cluster, for `wildtrain move`: once told to (an object
`go` appears beside the run folder) it commits its next checkpoint, a copy of step 4 as
step 8, then trains on (sleeps) until it is stopped.

    python tests/helpers/fake_run_job.py s3://bucket/runs/RUN
"""

import json
import sys
import time

from wildtrain import storage

root = sys.argv[1].rstrip("/")
while storage.read_bytes(f"{root}-go") is None:
    time.sleep(0.2)
old, new = f"{root}/checkpoints/step_000000004-ab", f"{root}/checkpoints/step_000000008-ab"
manifest = json.loads(storage.read_text(f"{old}/manifest.json"))
for entry in manifest["files"]:
    storage.write_bytes(f"{new}/{entry['path']}", storage.read_bytes(f"{old}/{entry['path']}"))
storage.write_text(f"{new}/manifest.json", json.dumps({**manifest, "step": 8}))
time.sleep(3600)
