"""Shard sets: data larger than one disk, streamed from a folder or a bucket (docs/data.md).

    python -m {{ cookiecutter.package_name }}.shards SRC DEST     write one (write.py)
    train.py --data DEST                     train on it (read.py)

A shard set is a folder or a URL prefix holding `index.json` (written last: a set without it is
not complete) and the shards `NNNNN.bin`. Images: a shard's files back to back, with `NNNNN.idx`
(int64 rows of offset, length, label), so any sample is read alone. Text: one stream of token ids
per shard (`tokenizer.json` beside them); a sample is the seq_len + 1 tokens at seq_len * i, so
where it lies is arithmetic. index.json records each file's size and checksum, the source, and a
checksum of what it says itself (an entry dropped or the classes reordered after prepare)."""

import hashlib
import json
from pathlib import Path

INDEX = "index.json"
TOKENIZER = "tokenizer.json"


def checksum(data: bytes | Path) -> str:
    """A shard file's checksum, as index.json records it (sha256, 16 hex digits)."""
    if isinstance(data, bytes):
        return hashlib.sha256(data).hexdigest()[:16]
    digest = hashlib.sha256()
    with open(data, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()[:16]


def index_checksum(index: dict) -> str:
    """The checksum of what index.json says: every key but this one, in a fixed order."""
    meaning = {key: value for key, value in index.items() if key != "checksum"}
    return checksum(json.dumps(meaning, sort_keys=True).encode())
