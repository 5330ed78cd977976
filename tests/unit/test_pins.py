from wildtrain.data.pins import OrderPins, order_changes

PINS = OrderPins(
    seed=0,
    global_batch_size=16,
    seq_len=128,
    datasets=(("s3://b/tiny", 1.0, "a" * 64), ("s3://b/code", 0.5, "b" * 64)),
    skipped_shards=(),
)


def test_nothing_pinned_yet_is_no_change():
    assert order_changes(None, PINS) == []
    assert order_changes(PINS, PINS) == []


def test_each_change_names_its_key():
    changed = OrderPins(1, 32, 256, PINS.datasets, ("s3://b/tiny/shard-3.parquet: missing",))
    lines = order_changes(PINS, changed)
    assert [line.split(":")[0] for line in lines] == [
        "train.seed",
        "train.global_batch_size",
        "data.seq_len",
        "data.skip_bad_shards",
    ]


def test_a_reweighted_mixture_and_a_rewritten_manifest_are_changes():
    reweighted = OrderPins(0, 16, 128, (PINS.datasets[0], ("s3://b/code", 2.0, "b" * 64)), ())
    assert order_changes(PINS, reweighted)[0].startswith(
        "data.datasets: [s3://b/tiny (weight 1), s3://b/code (weight 0.5)]"
    )
    rewritten = OrderPins(0, 16, 128, (PINS.datasets[0], ("s3://b/code", 0.5, "c" * 64)), ())
    assert order_changes(PINS, rewritten) == [
        "data.datasets.1.uri: s3://b/code/manifest.json differs from the one the run started with "
        "(sha256 bbbbbbbbbbbb… -> cccccccccccc…)"
    ]
    elsewhere = OrderPins(0, 16, 128, (PINS.datasets[0], ("s3://c/code", 0.5, "c" * 64)), ())
    assert order_changes(PINS, elsewhere) == [
        "data.datasets.1.uri: s3://c/code/manifest.json differs from the one the run started with at s3://b/code "
        "(sha256 bbbbbbbbbbbb… -> cccccccccccc…)"
    ]


def test_the_same_manifest_on_another_store_is_the_same_order():
    copied = OrderPins(
        0,
        16,
        128,
        tuple((uri.replace("s3://b", "s3://other-cluster"), weight, sha) for uri, weight, sha in PINS.datasets),
        (),
    )
    assert order_changes(PINS, copied) == []


def test_pins_survive_the_run_record_json_round_trip():
    import json

    assert OrderPins.from_dict(json.loads(json.dumps(PINS.to_dict()))) == PINS
