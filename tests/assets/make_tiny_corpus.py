"""Writes tiny_corpus.jsonl: small English-like documents with enough structure for a
byte-level model to learn in a few dozen CPU steps. Deterministic; rerun to regenerate."""

import json
import random
from pathlib import Path

SUBJECTS = ["the cluster", "a node", "the worker", "our model", "the checkpoint", "the team", "a GPU", "the run"]
VERBS = ["trains", "fails", "restarts", "saves", "streams", "recovers", "grows", "waits"]
OBJECTS = ["the data", "every step", "a shard", "the optimizer state", "its tokens", "the loss", "a batch"]
ENDINGS = ["at night.", "without loss.", "on time.", "again.", "in the cloud.", "after a failure."]


def document(rng: random.Random) -> str:
    sentences = []
    for _ in range(rng.randint(3, 8)):
        words = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS), rng.choice(ENDINGS)]
        sentence = " ".join(words)
        sentences.append(sentence[0].upper() + sentence[1:])
    return " ".join(sentences)


if __name__ == "__main__":
    rng = random.Random(0)
    out = Path(__file__).with_name("tiny_corpus.jsonl")
    with out.open("w") as f:
        for i in range(1200):
            f.write(json.dumps({"id": i, "text": document(rng)}) + "\n")
