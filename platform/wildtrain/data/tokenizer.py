"""Tokenizers: byte-level (the default: no download, runs anywhere), a HuggingFace
`tokenizer.json`, or a byte-level BPE trained on the corpus by `prepare`.

Each has `encode(text) -> ids`, an end-of-document id that separates packed documents, a
vocabulary size, reserved ids that text never encodes to (UL2's mode tokens and the
sentinels that stand for corrupted spans, see `data.objectives`), `describe()`: what a
dataset manifest records of it, and `hf_json()`: itself as a `tokenizers` tokenizer.json,
which `hf_files` turns into what Transformers' AutoTokenizer loads (an export's tokenizer).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from typing import Iterable, Optional, Protocol

import numpy as np

from wildtrain import storage
from wildtrain.config import StorageConfig
from wildtrain.data.manifest import DataError

# End-of-document tokens by convention, in order of preference; a trained BPE gets the first.
EOS_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
# UL2's paradigm tokens, one per kind of denoiser (R, X, S), named as in the paper.
MODE_TOKENS = ("[NLU]", "[NLG]", "[S2S]")
# Sentinels named as T5's; an example with more corrupted spans than this reuses them in turn.
SENTINELS = 60


def sentinel_token(i: int) -> str:
    return f"<extra_id_{i}>"


class Tokenizer(Protocol):
    kind: str
    eos_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]: ...

    def describe(self) -> dict: ...

    def decode(self, ids: list[int]) -> str: ...

    def hf_json(self) -> str: ...

    def token_bytes(self) -> np.ndarray: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, one end-of-document id that separates packed documents
    (256), then the mode tokens and the sentinels."""

    kind = "byte"
    eos_id = 256
    modes = {name: 257 + i for i, name in enumerate(MODE_TOKENS)}
    sentinels = list(range(257 + len(MODE_TOKENS), 257 + len(MODE_TOKENS) + SENTINELS))
    vocab_size = sentinels[-1] + 1

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """The ids of all `texts` in one int32 array, and each text's count of them."""
        data = [text.encode("utf-8") for text in texts]
        return (
            np.frombuffer(b"".join(data), np.uint8).astype(np.int32),
            np.fromiter(map(len, data), np.int64, count=len(data)),
        )

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def describe(self) -> dict:
        return {
            "kind": self.kind,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "modes": self.modes,
            "sentinels": self.sentinels,
        }

    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes of text per id (bits per byte divide by them): one per byte id, none
        for the reserved ids."""
        return (np.arange(self.vocab_size) < 256).astype(np.int64)

    def hf_json(self) -> str:
        """A byte-level BPE without merges whose token for byte b has id b (GPT-2's
        printable stand-ins for the bytes), and the reserved ids as special tokens."""
        from tokenizers import AddedToken, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as Backend
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        vocab = {char: byte for byte, char in bytes_to_unicode().items()}
        backend = Backend(models.BPE(vocab=vocab, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        reserved = {
            self.eos_id: EOS_TOKENS[0],
            **{i: name for name, i in self.modes.items()},
            **{i: sentinel_token(n) for n, i in enumerate(self.sentinels)},
        }
        # Added in id order, each gets the next id: 256, 257, ... as here.
        backend.add_special_tokens([AddedToken(reserved[i], special=True, normalized=False) for i in sorted(reserved)])
        return backend.to_str()


class HFTokenizer:
    """A `tokenizers` tokenizer built from the text of its tokenizer.json, which is kept
    verbatim: its sha256 names the exact file a dataset was tokenized with."""

    def __init__(self, json_text: str, kind: str = "hf", name: str = "tokenizer.json"):
        from tokenizers import Tokenizer as Backend

        try:
            self._backend = Backend.from_str(json_text)
        except Exception as e:  # the Rust side raises a bare Exception for any parse error
            raise DataError(f"{name}: not a tokenizer.json ({e})") from None
        eos = [i for i in map(self._backend.token_to_id, EOS_TOKENS) if i is not None]
        if not eos:
            raise DataError(f"{name}: no end-of-document token (none of {', '.join(EOS_TOKENS)})")
        self.json = json_text
        self.kind = kind
        self.eos_id = eos[0]
        # Whichever reserved tokens the file has (a T5 tokenizer has 100 sentinels).
        self.modes = {name: i for name in MODE_TOKENS if (i := self._backend.token_to_id(name)) is not None}
        self.sentinels = []
        while (i := self._backend.token_to_id(sentinel_token(len(self.sentinels)))) is not None:
            self.sentinels.append(i)
        # Text that spells a special token ("<extra_id_0>", "</s>") encodes as text, so no
        # document can forge a sentinel, mode token or end of document.
        self._backend.encode_special_tokens = True
        self.vocab_size = self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # Packing adds the end-of-document id itself; a template's BOS/EOS would double it.
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """The ids of all `texts` in one int32 array, and each text's count of them."""
        ids = [encoding.ids for encoding in self._backend.encode_batch(texts, add_special_tokens=False)]
        lengths = np.fromiter(map(len, ids), np.int64, count=len(ids))
        return np.fromiter(itertools.chain.from_iterable(ids), np.int32, count=int(lengths.sum())), lengths

    def decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids)

    def hf_json(self) -> str:
        return self.json

    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes of text per id (bits per byte divide by them); none for special
        tokens. A byte-level vocabulary spells each byte with one printable stand-in
        character; another spells text ("▁" for a space) or a byte fallback ("<0x0A>")."""
        byte_level = "ByteLevel" in json.dumps(json.loads(self.json).get("pre_tokenizer"))
        special = {added.content for added in self._backend.get_added_tokens_decoder().values() if added.special}
        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        for token, i in self._backend.get_vocab(with_added_tokens=True).items():
            if token in special:
                continue
            if byte_level:
                lengths[i] = len(token)
            elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):
                lengths[i] = 1
            else:
                lengths[i] = len(token.replace("\u2581", " ").encode())
        return lengths

    def describe(self) -> dict:
        return {
            "kind": self.kind,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "modes": self.modes,
            "sentinels": self.sentinels,
            "sha256": hashlib.sha256(self.json.encode()).hexdigest(),
        }


def hf_files(tokenizer: Tokenizer, max_length: int) -> dict[str, str]:
    """tokenizer.json and tokenizer_config.json, from which Transformers' AutoTokenizer
    encodes text to the ids `tokenizer.encode` gives it: text that spells a special token
    encoded as text, and no BOS or EOS added. Training encodes without the file's template
    (packing adds the end-of-document id itself), so the export's file has none: one from
    elsewhere may add a BOS, which the model never saw, and Transformers 5 ignores an
    `add_bos_token: false` beside such a file."""
    from tokenizers import Tokenizer as Backend

    spec = json.loads(tokenizer.hf_json())
    spec["post_processor"] = None
    text = json.dumps(spec, ensure_ascii=False)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": Backend.from_str(text).id_to_token(tokenizer.eos_id),
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    }
    return {"tokenizer.json": text, "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}


def train_bpe(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """A byte-level BPE trained on `texts`: any text encodes, none to an unknown token.
    Training is deterministic: the same texts in the same order give the same tokenizer.json."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    special = [EOS_TOKENS[0], *MODE_TOKENS, *map(sentinel_token, range(SENTINELS))]
    if vocab_size < len(alphabet) + len(special):
        raise DataError(
            f"data.tokenizer: bpe:{vocab_size} is below the {len(alphabet) + len(special)} ids of a "
            "byte-level BPE with its reserved tokens"
        )
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=alphabet, show_progress=False
    )
    backend.train_from_iterator(texts, trainer)
    return HFTokenizer(backend.to_str(), kind="bpe")


def bpe_vocab_size(spec: str) -> Optional[int]:
    """VOCAB of a `bpe:VOCAB` spec; None for any other spec."""
    if not spec.startswith("bpe:"):
        return None
    size = spec[len("bpe:") :]
    if not size.isdigit():
        raise DataError(f"data.tokenizer: {spec!r} must be bpe:VOCAB with VOCAB a number of ids")
    return int(size)


def dataset_tokenizer(root: str, described: dict, config: Optional[StorageConfig] = None) -> Tokenizer:
    """The tokenizer a prepared dataset at `root` was tokenized with, as its manifest
    describes it (`described`): checked against the sha256 the manifest records."""
    if described["kind"] == "byte":
        return ByteTokenizer()
    uri = storage.join(root, "tokenizer.json")
    data = storage.read_bytes(uri, config)
    if data is None or hashlib.sha256(data).hexdigest() != described["sha256"]:
        raise DataError(
            f"{uri}: {'missing' if data is None else 'sha256 differs from'} the tokenizer.json its manifest names"
        )
    return HFTokenizer(data.decode(), kind=described["kind"], name=uri)


def get_tokenizer(spec: str, config: Optional[StorageConfig] = None) -> Tokenizer:
    """`byte`, or the path or URI of a tokenizer.json."""
    if spec == "byte":
        return ByteTokenizer()
    if spec.endswith(".json"):
        text = storage.read_text(spec, config)
        if text is None:
            raise DataError(f"data.tokenizer: {spec} does not exist")
        return HFTokenizer(text, name=spec)
    if bpe_vocab_size(spec) is not None:
        raise DataError(
            f"data.tokenizer: {spec} is trained by data_pipelines/prepare.py; use the "
            "tokenizer.json it saves next to the dataset"
        )
    raise DataError(f"data.tokenizer: unknown tokenizer {spec!r} (byte, bpe:VOCAB or a tokenizer.json)")
