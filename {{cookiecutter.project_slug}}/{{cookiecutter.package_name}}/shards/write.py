"""Writing a shard set: `python -m {{ cookiecutter.package_name }}.shards SRC DEST`.

SRC is an image folder (one sub-folder per class) or text (a file, or a folder of text files).
Images are stored as their files' bytes, shuffled once here: each shard holds every class. Text is
tokenized by `--tokenizer PATH` (a Hugging Face tokenizer.json, or a model folder's: its ids and
end-of-text token) or by a byte-level BPE trained on SRC here, offline. Shards are written
locally, then moved or uploaded whole; `index.json` last."""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
from array import array
from pathlib import Path
from typing import Any

from tqdm import tqdm

from .. import task
from ..checkpoint import storage
from ..failures import ProjectError, UsageError
from . import INDEX, TOKENIZER, checksum, index_checksum
from .text import has_text, tokenizer_for, write_tokens

IMAGES = {".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".gif", ".webp", ".tif", ".tiff"}  # SRC is


class Writer:
    """Shards of about `limit` bytes, each published to `dest` when full."""

    def __init__(self, dest: storage.AnyPath, tmp: Path, limit: int) -> None:
        self.dest, self.tmp, self.limit = dest, tmp, limit
        self.shards: list[dict[str, Any]] = []
        self.data, self.rows, self.count = bytearray(), [], 0  # rows: flat (offset, length, label)

    def add(self, data: bytes, label: int) -> None:
        """One image: its file's bytes and its row of the index."""
        self.rows += (len(self.data), len(data), label)
        self.data += data
        self.count += 1
        if len(self.data) >= self.limit:
            self.close_shard()

    def add_tokens(self, data: bytes) -> None:
        """Token ids: the stream is cut into shards of exactly `limit` bytes."""
        while data:
            room = self.limit - len(self.data)
            self.data += data[:room]
            data = data[room:]
            if len(self.data) >= self.limit:
                self.close_shard()

    def publish(self, name: str, content: bytes) -> None:
        """A file of the set beside the shards (tokenizer.json)."""
        publish(content, self.dest / name, self.tmp)

    def close_shard(self) -> None:
        if not self.data:
            return
        name, data = f"{len(self.shards):05d}", bytes(self.data)
        publish(data, self.dest / f"{name}.bin", self.tmp)
        shard = {"name": name, "bytes": len(data), "sha256": checksum(data), "samples": self.count}
        if self.rows:
            rows = array("q", self.rows).tobytes()
            publish(rows, self.dest / f"{name}.idx", self.tmp)
            shard |= {"idx_bytes": len(rows), "idx_sha256": checksum(rows)}
        self.shards.append(shard)
        self.data, self.rows, self.count = bytearray(), [], 0


def publish(content: bytes, target: storage.AnyPath, tmp: Path) -> None:
    """`content` at `target`, whole or not at all: a local rename, or one upload."""
    local = tmp / target.name
    local.write_bytes(content)
    if isinstance(target, storage.RemotePath):
        target.fs.put_file(str(local), target.key)
        local.unlink()
    else:
        target.parent.mkdir(parents=True, exist_ok=True)  # DEST: made by the first file
        shutil.move(local, target)


def write_images(source: Path, writer: Writer, progress: bool) -> dict[str, Any]:
    from PIL import Image  # the image tasks' dependency
    classes = sorted(p.name for p in source.iterdir() if p.is_dir())
    files = [(path, label) for label, name in enumerate(classes)
             for path in sorted((source / name).iterdir())]
    wrong = UsageError(f"{source}: expected one sub-folder of images per class (at least two)")
    if len(classes) < 2:
        raise wrong
    random.Random(0).shuffle(files)  # every shard holds every class
    others = []
    for path, label in tqdm(files, "images", disable=not progress, unit=" files"):
        try:  # decoded whole, as training reads it: what it would refuse is left out now
            if hasattr(task, "image_sample"):  # (a 32-bit image out of range, say)
                task.image_sample(path.read_bytes(), label, augment=False)
            else:
                Image.open(path).load()
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError, UsageError):
            others.append(path)
            continue
        writer.add(path.read_bytes(), label)
    if len(others) == len(files):
        raise wrong
    if others:
        print(f"note: left out {len(others)} files that are not images or cannot be decoded, "
              f"such as {others[0]}", file=sys.stderr)
    writer.close_shard()
    return {"kind": "images", "classes": classes}


def prepare(source: str, dest: str, shard_mb: float, tokenizer: str | None = None,
            vocab_size: int = 8192, progress: bool = True) -> dict[str, Any]:
    """Write SRC as a shard set at DEST; a complete set there is left as it is."""
    target, src, made_from = storage.given(dest), Path(source), str(Path(source).resolve())
    if not isinstance(target, storage.RemotePath) and made_from in (
            str(target.resolve()), *map(str, target.resolve().parents)):
        raise UsageError(f"DEST {dest} is SRC {source} or inside it: the shards would land among "
                         "SRC's files; give a DEST outside SRC")
    try:
        index = json.loads((target / INDEX).read_text()) if (target / INDEX).exists() else None
        if index is None and isinstance(target, storage.RemotePath):
            target.fs.ls(target.key.split("/")[0])  # is the bucket there?
    except Exception as exc:  # OSError, or botocore's own (no credentials: not an OSError)
        raise UsageError(f"{storage.redact(dest)}: {storage.diagnosis(dest, exc)}") from None
    if index is None and not isinstance(target, storage.RemotePath) and target.is_dir() and (
            others := [p.name for p in sorted(target.iterdir()) if not is_set_file(p.name)]):
        raise UsageError(f"DEST {dest} holds other files ({len(others)}, such as {others[0]}; an "
                         "image folder?): the shards would land among them; give a new or empty "
                         "folder")
    if index is not None:
        if index.get("source", made_from) != made_from:
            raise UsageError(f"{storage.shown(dest)} is a shard set made from "
                             f"{index['source']}, not {made_from}; give another DEST (or "
                             "delete that set to replace it)")
        print(f"{storage.shown(dest)} is a complete shard set ({sum_samples(index)} "
              f"{index['kind']} in {len(index['shards'])} shards): nothing to do")
        return index
    if not src.exists():
        raise UsageError(f"{source}: no such file or folder")
    with tempfile.TemporaryDirectory(prefix="shards-") as tmp:
        writer = Writer(target, Path(tmp), max(4, int(shard_mb * 2**20) // 4 * 4))
        if src.is_dir() and any(f.suffix.lower() in IMAGES for d in src.iterdir() if d.is_dir()
                                for f in d.iterdir()):
            index = write_images(src, writer, progress)
        else:
            files = sorted(src.rglob("*.txt")) if src.is_dir() else [src]
            if not files:
                raise UsageError(f"{src}: neither images (one sub-folder per class) nor .txt "
                                 "files in it; give an image folder, a text file or a folder")
            if not (texts := [f for f in files if has_text(f)]):
                raise UsageError(f"{src}: no text in it (empty); give text, UTF-8")
            if len(texts) < len(files):
                print(f"note: left out {len(files) - len(texts)} empty text files", file=sys.stderr)
            index = write_tokens(texts, writer, *tokenizer_for(texts, tokenizer, vocab_size),
                                 Path(tmp), progress)
        index = {"format": 1, "source": made_from, **index, "shards": writer.shards}
        index["checksum"] = index_checksum(index)  # read.shard_index checks it
        publish(json.dumps(index, indent=1).encode(), target / INDEX, Path(tmp))
    print(f"wrote {sum_samples(index)} {index['kind']} in {len(index['shards'])} shards to "
          f"{storage.shown(dest)}")
    return index


def is_set_file(name: str) -> bool:
    """Whether a file of this name is a shard set's (a stopped prepare leaves some: redone)."""
    stem, _, suffix = name.partition(".")
    return name in (INDEX, TOKENIZER) or (stem.isdigit() and suffix in ("bin", "idx"))


def sum_samples(index: dict[str, Any]) -> int:
    return sum(shard["samples"] for shard in index["shards"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__package__}", allow_abbrev=False,
                                     description="Write a shard set for --data (docs/data.md).")
    parser.add_argument("source", help="an image folder (one sub-folder per class), a text "
                                       "file or a folder of text files (*.txt)")
    parser.add_argument("dest", help="a folder or a URL (s3://bucket/prefix)")
    parser.add_argument("--shard-mb", type=float, default=64, help="about this much per shard")
    parser.add_argument("--tokenizer", metavar="PATH", help="text: this tokenizer file, or a "
                        "model folder's tokenizer, instead of one trained on SOURCE")
    parser.add_argument("--vocab-size", type=int, default=8192,
                        help="text: the vocabulary of the tokenizer trained on SOURCE")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if not args.shard_mb > 0 or args.vocab_size < 257:
        parser.error("--shard-mb must be above 0 and --vocab-size at least 257")
    try:
        prepare(args.source, args.dest, args.shard_mb, args.tokenizer, args.vocab_size,
                not args.no_progress)
    except ProjectError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
