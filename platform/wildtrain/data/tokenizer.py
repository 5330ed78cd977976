"""Tokenizers by name. Byte-level needs no download, so the defaults run anywhere."""

from __future__ import annotations


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus one end-of-document id that separates packed documents."""

    eos_id = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


TOKENIZERS = {"byte": ByteTokenizer}


def get_tokenizer(name: str) -> ByteTokenizer:
    if name not in TOKENIZERS:
        raise ValueError(f"data.tokenizer: unknown tokenizer {name!r} (known: {', '.join(TOKENIZERS)})")
    return TOKENIZERS[name]()
