"""Tokenizers: a BPE trained on the tiny corpus, and a tokenizer.json loaded by path."""

import hashlib
import json
import pickle

import pytest

from tests.conftest import REPO
from wildtrain.data.manifest import DataError
from wildtrain.data.tokenizer import ByteTokenizer, bpe_vocab_size, get_tokenizer, train_bpe

TEXTS = [json.loads(line)["text"] for line in (REPO / "tests/assets/tiny_corpus.jsonl").read_text().splitlines()[:300]]


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(TEXTS, vocab_size=400)


def test_byte_tokenizer_describes_itself_without_a_file():
    assert ByteTokenizer().describe() == {
        "kind": "byte",
        "vocab_size": 320,
        "eos_id": 256,
        "modes": {"[NLU]": 257, "[NLG]": 258, "[S2S]": 259},
        "sentinels": list(range(260, 320)),
    }


def test_reserved_ids_never_come_from_text():
    bpe = train_bpe(TEXTS, vocab_size=400)
    reserved = {*bpe.modes.values(), *bpe.sentinels}
    assert len(bpe.sentinels) == 60 and set(bpe.modes) == {"[NLU]", "[NLG]", "[S2S]"}
    assert not reserved & {i for text in [*TEXTS, "<extra_id_0> [NLU]"] for i in bpe.encode(text)}
    byte = ByteTokenizer()
    assert not {*byte.modes.values(), *byte.sentinels, byte.eos_id} & set(byte.encode("<extra_id_0> [NLU] \xff"))


def test_bpe_compresses_round_trips_and_has_an_eos(bpe):
    text = TEXTS[0] + " — naïve ünïcode"
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text
    assert len(bpe.encode(TEXTS[1])) < len(TEXTS[1].encode()) / 2
    assert bpe.eos_id == 0 and bpe.eos_id not in ids
    assert bpe.vocab_size == 400 and max(ids) < bpe.vocab_size
    assert bpe.describe()["kind"] == "bpe"


def test_bpe_training_is_deterministic(bpe):
    assert train_bpe(TEXTS, vocab_size=400).json == bpe.json


def test_tokenizer_json_loads_by_path_with_the_files_checksum(bpe, tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(bpe.json)
    loaded = get_tokenizer(str(path))
    assert loaded.encode(TEXTS[2]) == bpe.encode(TEXTS[2])
    assert (loaded.eos_id, loaded.vocab_size) == (bpe.eos_id, bpe.vocab_size)
    assert loaded.describe() == {
        **bpe.describe(),
        "kind": "hf",
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
    }


def test_tokenizer_survives_pickling_as_ray_ships_it_to_tasks(bpe):
    assert pickle.loads(pickle.dumps(bpe)).encode(TEXTS[3]) == bpe.encode(TEXTS[3])


def test_a_tokenizer_json_without_an_eos_token_is_refused(bpe, tmp_path):
    spec = json.loads(bpe.json)
    spec["added_tokens"] = []
    spec["model"]["vocab"].pop("<|endoftext|>")
    path = tmp_path / "no-eos.json"
    path.write_text(json.dumps(spec))
    with pytest.raises(DataError, match=r"no-eos.json: no end-of-document token"):
        get_tokenizer(str(path))


def test_bad_tokenizer_specs_are_named(tmp_path):
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(DataError, match=r"broken.json: not a tokenizer.json"):
        get_tokenizer(str(tmp_path / "broken.json"))
    with pytest.raises(DataError, match=r"^data.tokenizer: .*/absent.json does not exist"):
        get_tokenizer(str(tmp_path / "absent.json"))
    with pytest.raises(DataError, match=r"^data.tokenizer: bpe:512 is trained by data_pipelines/prepare.py"):
        get_tokenizer("bpe:512")
    with pytest.raises(DataError, match=r"^data.tokenizer: 'bpe:lots' must be bpe:VOCAB"):
        bpe_vocab_size("bpe:lots")
    with pytest.raises(DataError, match=r"^data.tokenizer: bpe:100 is below the 320 ids"):
        train_bpe(TEXTS, vocab_size=100)
    assert bpe_vocab_size("bpe:4096") == 4096 and bpe_vocab_size("byte") is None
