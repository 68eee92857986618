"""Writing a shard set: `python -m {{ cookiecutter.package_name }}.shards SRC DEST`.

SRC is an image folder (one sub-folder per class) or text (a file, or a folder of text files).
Images are stored as their files' bytes, shuffled once here: each shard holds every class. Text is
tokenized by `--tokenizer PATH` (a Hugging Face tokenizer.json, or a model folder's: its ids and
end-of-text token) or by a byte-level BPE trained on SRC here, offline. Shards are written
locally, then moved or uploaded whole; `index.json` last."""

from __future__ import annotations

import argparse
import codecs
import contextlib
import json
import random
import shutil
import sys
import tempfile
from array import array
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

from tqdm import tqdm

from .. import task
from ..checkpoint import storage
from ..failures import ProjectError, UsageError
from . import INDEX, TOKENIZER, checksum, index_checksum

EOT = "<|endoftext|>"  # between documents (files)
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


def tokenizer_for(files: list[Path], given: str | None, vocab_size: int) -> tuple[Any, str]:
    """The tokenizer and the token between documents: `given`'s (a tokenizer.json, or a model's
    folder with one, whose end-of-text token it uses), or a byte-level BPE trained on `files`."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise UsageError('text shards need Hugging Face tokenizers: pip install -e ".[shards]"'
                         ) from None
    if given:
        file, eot = Path(given), EOT
        if file.is_dir():  # a model's folder, as save_pretrained writes it
            file, eot = file / TOKENIZER, end_of_text(file)
        try:
            return Tokenizer.from_file(str(file)), eot
        except Exception as exc:
            raise UsageError(f"--tokenizer {given}: cannot load it ({exc})") from None
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([str(f) for f in files], trainer)
    return tokenizer, EOT


def end_of_text(folder: Path) -> str:
    """A model folder's end-of-text token (its tokenizer's eos_token), which joins documents."""
    if not (folder / TOKENIZER).exists():
        raise UsageError(f"--tokenizer {folder}: no {TOKENIZER} in it (a fast tokenizer's "
                         "file); write one: AutoTokenizer.from_pretrained(FOLDER)"
                         ".save_pretrained(FOLDER)")
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            eos = json.loads((folder / name).read_text()).get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
            if isinstance(eos, str):
                return eos
    raise UsageError(f"--tokenizer {folder}: its tokenizer names no end-of-text token "
                     "(eos_token) to join documents with; set one in its tokenizer_config.json")


def has_text(path: Path) -> bool:
    """Whether `path` holds more than white space; text that is not UTF-8 is one error line."""
    if path.suffix.lower() == ".bin":  # binary: neither its bytes nor a conversion are text
        raise UsageError(f"{path}: a .bin file is binary (token ids or shards), not text; give "
                         "prepare the UTF-8 text it was made from, or an image folder")
    decoder, offset, seen = codecs.getincrementaldecoder("utf-8")(), 0, False
    with open(path, "rb") as f:
        while True:
            block, pending = f.read(1 << 22), len(decoder.getstate()[0])
            try:
                text = decoder.decode(block, final=not block)
            except UnicodeDecodeError as exc:  # UTF-16's byte-order mark says what it is
                bom = offset == 0 and block[:2] in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)
                raise UsageError(f"{path}: not UTF-8 text (byte {offset - pending + exc.start}); "
                                 f"convert it, e.g. iconv -f {'utf-16' if bom else 'latin1'} -t "
                                 f"utf-8 {path} > {path.stem}-utf8.txt") from None
            if "\0" in text:  # valid UTF-8, but no text has NULs: UTF-16 without its mark
                at = block.index(0)
                was = "utf-16le" if at % 2 else "utf-16be"  # ASCII's zero byte after it, or before
                raise UsageError(f"{path}: NUL characters (byte {offset + at}): UTF-16 text "
                                 f"without a byte-order mark? convert it, e.g. iconv -f {was} "
                                 f"-t utf-8 {path} > {path.stem}-utf8.txt")
            seen |= bool(text.strip())
            if not block:
                return seen
            offset += len(block)


def chunks(path: Path, size: int = 1 << 22) -> Iterator[list[str]]:
    """A text file as lists of lines of about `size` bytes (80 a line): memory stays bounded."""
    with open(path, encoding="utf-8", errors="replace") as f:
        while lines := list(islice(f, -(-size // 80))):
            yield lines


def write_tokens(files: list[Path], writer: Writer, tokenizer: Any, end: str, tmp: Path,
                 progress: bool) -> dict[str, Any]:
    vocab = tokenizer.get_vocab_size()
    code = "H" if vocab <= 2**16 else "i"  # uint16 or int32 per token
    eot = [i for i in [tokenizer.token_to_id(end)] if i is not None]
    for path in tqdm(files, "text files", disable=not progress):
        for lines in chunks(path):  # no BOS a line: a model's tokenizer may add one
            encoded = tokenizer.encode_batch(lines, add_special_tokens=False)
            writer.add_tokens(array(code, [i for e in encoded for i in e.ids]).tobytes())
        writer.add_tokens(array(code, eot).tobytes())
    writer.close_shard()
    tokenizer.save(str(tmp / TOKENIZER))
    content = (tmp / TOKENIZER).read_bytes()
    publish(content, writer.dest / TOKENIZER, tmp)
    for shard in writer.shards:  # a shard's count is its tokens
        shard["samples"] = shard["bytes"] // array(code).itemsize
    return {"kind": "tokens", "dtype": "uint16" if code == "H" else "int32", "vocab_size": vocab,
            "tokenizer": checksum(content)}


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
