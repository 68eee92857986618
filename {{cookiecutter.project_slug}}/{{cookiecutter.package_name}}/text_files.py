"""The language-model task's `--data FILE`: a text file's bytes, or a `.bin` file of uint16 token
ids (nanoGPT's format), cut into windows read when asked for. A `.bin` file is read whole once
before the first step: what would train garbage without a word (32-bit ids, a text file named
.bin, an odd byte count, an id past the vocabulary) is one error line, and its checksum goes into
every checkpoint, so a file replaced between runs is not resumed as if it were the same."""

from __future__ import annotations

import codecs
import hashlib
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, Subset

from .failures import UsageError

WRITE_UINT16 = "write uint16 ids, as nanoGPT does: np.array(ids, dtype=np.uint16).tofile(path)"


class TextWindows(Dataset):
    """A file cut into windows of seq_len + 1 tokens (inputs and next-token targets): a text's
    bytes, or a .bin file's uint16 token ids (nanoGPT's); each window is read when asked for."""

    def __init__(self, path: str | Path, seq_len: int, vocab: int = 256) -> None:
        self.path, self.seq_len = Path(path), seq_len
        self.width = 2 if self.path.suffix.lower() == ".bin" else 1  # bytes a token
        size = self.path.stat().st_size
        # Bytes never pass 255; a .bin file's ids are all checked now, not where a bad one lies.
        self.summary = {"file": check_token_file(self.path, vocab)} if self.width == 2 else {}
        self.windows = (size // self.width - 1) // seq_len
        if self.windows < 2:
            raise UsageError(f"--data {path}: {size // self.width} tokens; this model needs at "
                             f"least {2 * seq_len + 1} (two windows of --seq-len {seq_len})",
                             everywhere=True)

    def __len__(self) -> int:
        return self.windows

    def __getitem__(self, index: int) -> torch.Tensor:
        with open(self.path, "rb") as f:
            f.seek(index * self.seq_len * self.width)
            window = f.read((self.seq_len + 1) * self.width)
        kind = torch.uint16 if self.width == 2 else torch.uint8
        return torch.frombuffer(bytearray(window), dtype=kind).long()


class Part(Subset):
    """Some of a file's windows (training or validation), with the file's summary."""

    @property
    def summary(self) -> dict[str, Any]:
        return self.dataset.summary


def looks_like_text(block: bytes) -> bool:
    """Whether a file's first bytes are UTF-8 text (printable characters and white space)."""
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(block)  # a cut last character: ok
    except UnicodeDecodeError:
        return False
    return bool(text.strip()) and "".join(text.split()).isprintable()


def check_token_file(path: Path, vocab: int) -> str:
    """The .bin file's size and checksum, once each id in it is known to be below `vocab` and the
    file to hold uint16 ids; else one error line saying what it holds instead."""
    size = path.stat().st_size
    digest, top, high_halves, first = hashlib.sha256(), 0, 0, True
    with open(path, "rb") as f:
        while chunk := f.read(1 << 25):  # 32 MB at a time, an even size: whole ids
            if first and looks_like_text(chunk[:1 << 16]):
                raise UsageError(f"--data {path}: text, not token ids (a .bin file holds uint16 "
                                 f"ids); rename it {path.stem}.txt to train on its bytes",
                                 everywhere=True)
            first = False
            digest.update(chunk)
            ids = torch.frombuffer(bytearray(chunk[:len(chunk) // 2 * 2]), dtype=torch.uint16)
            ids = ids.int()  # uint16 tensors have few operations
            top = max(top, int(ids.max()) if len(ids) else 0)
            high_halves += int(ids[1::2].count_nonzero())
    if size % 2:
        raise UsageError(f"--data {path}: {size} bytes, an odd number: not whole uint16 token ids "
                         f"(2 bytes each); {WRITE_UINT16}", everywhere=True)
    if size >= 8 and not high_halves:  # id, 0, id, 0, ...: each id in 4 (or 8) bytes
        raise UsageError(f"--data {path}: every second uint16 is 0: 32- or 64-bit token ids, "
                         f"not uint16; {WRITE_UINT16}", everywhere=True)
    if top >= vocab:
        raise UsageError(f"--data {path}: token id {top} is beyond --vocab-size {vocab}; GPT-2's "
                         "ids (nanoGPT's .bin files) need 50304", everywhere=True)
    return f"{path.name}: {size} bytes, sha256 {digest.hexdigest()[:16]}"
