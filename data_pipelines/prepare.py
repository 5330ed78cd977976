"""Tokenize, pack and shard a corpus into a training dataset (see wildtrain.data.prepare).

python data_pipelines/prepare.py --input tests/assets/tiny_corpus.jsonl --output s3://wildtrain/tiny
ray job submit --working-dir . -- python data_pipelines/prepare.py --input ... --output ...
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

import click

from wildtrain import services
from wildtrain.cli_common import OneLineUsageCommand
from wildtrain.config import StorageConfig
from wildtrain.data.manifest import DataError
from wildtrain.data.prepare import EXECUTORS, VAL_FRACTION, PrepareConfig, prepare
from wildtrain.storage import StorageError


@click.command(cls=OneLineUsageCommand, prefix="prepare")
@click.option(
    "--input",
    "input_uri",
    required=True,
    help="A .jsonl/.json (plain, .gz or .zst), .txt, .parquet or .arrow file (a `datasets` folder saved "
    "to disk), or a folder or prefix of them (local, s3://, gs://).",
)
@click.option("--output", required=True, help="The dataset root: shards, manifest.json and tokenizer.json go here.")
@click.option("--seq-len", type=int, default=PrepareConfig.seq_len, show_default=True)
@click.option(
    "--tokenizer",
    default=PrepareConfig.tokenizer,
    show_default=True,
    help="byte, bpe:VOCAB (trained on the input) or the path or URI of a tokenizer.json.",
)
@click.option(
    "--text-field",
    default=PrepareConfig.text_field,
    show_default=True,
    help="The text field of jsonl records or text column of Parquet files.",
)
@click.option("--rows-per-shard", type=int, default=PrepareConfig.rows_per_shard, show_default=True)
@click.option("--rows-per-group", type=int, default=PrepareConfig.rows_per_group, show_default=True)
@click.option(
    "--val-fraction",
    type=float,
    default=None,
    show_default=f"{VAL_FRACTION}, more of a small input",
    help="The share of documents held out for validation, chosen by a hash of each document's text "
    "(a rerun holds out the same ones); 0: none.",
)
@click.option(
    "--skip-bad-records",
    is_flag=True,
    help="Skip records that are not UTF-8, not JSON, lack the text field or are longer than --max-record-mb, "
    "and Parquet or Arrow files that cannot be read, counting them per file in the manifest, rather than "
    "stop at the first.",
)
@click.option(
    "--max-record-mb",
    type=click.IntRange(min=1),
    default=PrepareConfig.max_record_bytes >> 20,
    show_default=True,
    help="The longest record (a JSONL line, a .txt file, a Parquet or Arrow text) read as one document; "
    "a longer one is a bad record.",
)
@click.option(
    "--partition-mb",
    type=int,
    default=PrepareConfig.partition_bytes >> 20,
    show_default=True,
    help="A plain JSONL or Parquet file larger than this is prepared in ranges of it, each by its own task.",
)
@click.option(
    "--endpoint", default=None, help="S3-compatible endpoint for s3:// URIs  [default: $AWS_ENDPOINT_URL, else AWS]"
)
@click.option("--region", default=StorageConfig.region, show_default=True)
@click.option(
    "--max-attempts",
    type=int,
    default=StorageConfig.max_attempts,
    show_default=True,
    help="Attempts per object-store request before giving up.",
)
@click.option(
    "--executor",
    type=click.Choice(EXECUTORS),
    default=PrepareConfig.executor,
    show_default=True,
    help="ray: a task per partition on the cluster; local: one partition after another in this process.",
)
def main(
    input_uri: str,
    output: str,
    seq_len: int,
    tokenizer: str,
    text_field: str,
    rows_per_shard: int,
    rows_per_group: int,
    val_fraction: Optional[float],
    skip_bad_records: bool,
    max_record_mb: int,
    partition_mb: int,
    endpoint: str | None,
    region: str,
    max_attempts: int,
    executor: str,
) -> None:
    """Write INPUT's documents to OUTPUT as Parquet shards of packed rows plus manifest.json.
    Rerunning writes only missing or changed shards."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    services.use_local_object_store()
    if executor == "ray":
        _quiet_ray_of_the_run()
    cfg = PrepareConfig(
        input=input_uri,
        output=output,
        seq_len=seq_len,
        tokenizer=tokenizer,
        text_field=text_field,
        rows_per_shard=rows_per_shard,
        rows_per_group=rows_per_group,
        val_fraction=val_fraction,
        skip_bad_records=skip_bad_records,
        max_record_bytes=max_record_mb << 20,
        partition_bytes=partition_mb << 20,
        executor=executor,
        storage=StorageConfig(endpoint=endpoint, region=region, max_attempts=max_attempts),
    )
    try:
        result = prepare(cfg)
    except (DataError, StorageError) as e:
        click.secho(f"prepare: {e}", fg="red", err=True)
        sys.exit(1)
    manifest = result.manifest
    held_out = (
        f", {result.held_out} documents held out for validation (a share of {result.val_share:.3g}) in "
        f"{sum(s.rows for s in manifest.validation)} rows of {len(manifest.validation)} shards"
        if manifest.validation
        else ", no validation rows (--val-fraction 0)"
        if result.val_share == 0
        else f", no validation rows: the {result.held_out} documents held out fill none (--val-fraction holds out more)"
    )
    bad = (
        f", {sum(manifest.bad_records.values())} bad records skipped in {len(manifest.bad_records)} files"
        if manifest.bad_records
        else ""
    )
    click.echo(
        f"{output}: {manifest.rows} rows, {manifest.tokens} tokens in {len(manifest.shards)} shards{held_out} "
        f"({len(result.written)} written, {len(result.unchanged)} unchanged){bad}"
    )


def _quiet_ray_of_the_run() -> None:
    """Let prepare's tasks run on the cluster a run would join (RAY_ADDRESS under `ray job
    submit`, else `wildtrain up`'s head) rather than on a Ray of its own (seconds), and keep
    Ray's INFO lines in its log folder. Before Ray is imported, which reads these settings once."""
    services.prepare_ray_client(None)
    try:
        os.environ.setdefault("RAY_ADDRESS", services.ray_address(None))
    except services.ServiceError:
        pass  # no cluster to join: a Ray of its own for this job
    os.environ.setdefault("RAY_LOGGER_LEVEL", "warning")
    # A partition's bad record stops the job in its one line; the tasks it cancels then are
    # no errors to print as well.
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")


if __name__ == "__main__":
    main()
