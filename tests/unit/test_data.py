import json

import numpy as np
import pytest

from wildtrain.config import DataConfig
from wildtrain.data.dataset import DataError, find_documents, pack
from wildtrain.data.tokenizer import ByteTokenizer, get_tokenizer


def test_byte_tokenizer_round_trips_utf8():
    tok = ByteTokenizer()
    text = "naïve café — ok"
    ids = tok.encode(text)
    assert max(ids) < 256 and len(ids) == len(text.encode())
    assert tok.decode(ids + [tok.eos_id]) == text


def test_unknown_tokenizer_names_the_key():
    with pytest.raises(ValueError, match="^data.tokenizer: unknown tokenizer 'gpt9'"):
        get_tokenizer("gpt9")


def test_pack_joins_documents_with_eos_and_drops_the_tail():
    rows = pack([[1, 2, 3], [4, 5], [6, 7, 8, 9]], seq_len=3, eos_id=0)
    # stream: 1 2 3 0 4 5 0 6 7 8 9 0 -> three rows of 4, nothing left over
    assert rows.tolist() == [[1, 2, 3, 0], [4, 5, 0, 6], [7, 8, 9, 0]]
    assert pack([[1, 2]], seq_len=3, eos_id=0).shape == (0, 4)
    assert rows.dtype == np.int64


def test_find_documents_accepts_a_file_or_a_folder(tmp_path):
    doc = tmp_path / "a.jsonl"
    doc.write_text(json.dumps({"text": "hi"}) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "yo"}) + "\n")
    assert find_documents(DataConfig(path=str(doc))) == [doc]
    assert find_documents(DataConfig(path=str(tmp_path))) == [doc, tmp_path / "b.jsonl"]


def test_missing_or_empty_data_path_names_the_key(tmp_path):
    with pytest.raises(DataError, match=r"^data.path: .*nope does not exist"):
        find_documents(DataConfig(path=str(tmp_path / "nope")))
    with pytest.raises(DataError, match=r"^data.path: no .jsonl files"):
        find_documents(DataConfig(path=str(tmp_path)))
