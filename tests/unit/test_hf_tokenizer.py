"""An export's tokenizer files: Transformers' AutoTokenizer loads them and encodes text to the
ids wildtrain trained on, for each kind of tokenizer a dataset can be prepared with."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers, processors

from wildtrain.data.tokenizer import (
    EOS_TOKENS,
    MODE_TOKENS,
    ByteTokenizer,
    HFTokenizer,
    hf_files,
    sentinel_token,
    train_bpe,
)

TEXTS = [
    "hello world",
    " leading space, ünïcödé, 日本語 and 🎉",
    "tabs\tand\nnewlines  twice",
    # Text that spells special tokens is text, as in training: no document can forge them.
    "<|endoftext|> [NLU] <extra_id_0> </s>",
    "",
]


def auto_tokenizer(folder, tokenizer):
    from transformers import AutoTokenizer

    folder.mkdir()
    for name, text in hf_files(tokenizer, max_length=128).items():
        (folder / name).write_text(text)
    return AutoTokenizer.from_pretrained(folder)


def test_byte_tokenizer_encodes_and_decodes_as_wildtrains(tmp_path):
    ours = ByteTokenizer()
    theirs = auto_tokenizer(tmp_path / "tok", ours)
    for text in TEXTS:
        assert theirs(text)["input_ids"] == ours.encode(text), text
        assert theirs.decode(ours.encode(text)) == text
    assert theirs.eos_token_id == ours.eos_id == 256
    assert len(theirs) == ours.vocab_size
    assert theirs.convert_tokens_to_ids([*MODE_TOKENS, sentinel_token(0), sentinel_token(59)]) == [
        *ours.modes.values(),
        ours.sentinels[0],
        ours.sentinels[59],
    ]
    assert theirs.model_max_length == 128


def test_trained_bpe_encodes_as_wildtrains(tmp_path):
    corpus = ["the cat sat on the mat", "the dog ate the cat's dinner", "ünïcödé cats"] * 20
    ours = train_bpe(corpus, vocab_size=400)
    theirs = auto_tokenizer(tmp_path / "tok", ours)
    for text in TEXTS + corpus[:3]:
        assert theirs(text)["input_ids"] == ours.encode(text), text
    assert theirs.eos_token_id == ours.eos_id


@pytest.fixture
def tokenizer_with_bos_template() -> HFTokenizer:
    """A tokenizer.json from elsewhere whose post-processor adds a BOS, as Llama's does."""
    backend = Backend(models.BPE(vocab={chr(c): i for i, c in enumerate(range(97, 123))}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<s>", EOS_TOKENS[1]])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 26)])
    assert backend.encode("ab").ids == [26, 0, 1]
    return HFTokenizer(backend.to_str())


def test_a_template_bos_is_not_added_because_training_never_saw_one(tmp_path, tokenizer_with_bos_template):
    ours = tokenizer_with_bos_template
    theirs = auto_tokenizer(tmp_path / "tok", ours)
    assert theirs("ab cd")["input_ids"] == ours.encode("ab cd") == [0, 1, 2, 3]
    assert theirs.eos_token == "</s>" and theirs.eos_token_id == ours.eos_id == 27
