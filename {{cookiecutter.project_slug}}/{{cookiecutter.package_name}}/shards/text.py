"""A shard set's text side: the tokenizer (a given one, a model folder's, or a byte-level BPE
trained here), the text files checked for what is not text, and their token ids written into
shards (write.py's Writer): uint16 where the vocabulary fits, int32 past it."""

from __future__ import annotations

import codecs
import contextlib
import json
from array import array
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..failures import UsageError
from . import TOKENIZER, checksum

EOT = "<|endoftext|>"  # between documents (files)


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
            loaded = Tokenizer.from_file(str(file))
        except Exception as exc:
            raise UsageError(f"--tokenizer {given}: cannot load it ({exc})") from None
        if loaded.token_to_id(eot) is None:  # documents would run into each other
            fix = ("set eos_token in its tokenizer_config.json to one of its tokens"
                   if Path(given).is_dir() else f"add {EOT} to it as a special token, or give "
                   "the model folder it belongs to (whose eos_token is used)")
            raise UsageError(f"--tokenizer {given}: {eot!r}, the token put between documents, is "
                             f"not in its {file.name}; {fix}")
        return loaded, eot
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


def write_tokens(files: list[Path], writer: Any, tokenizer: Any, end: str, tmp: Path,
                 progress: bool) -> dict[str, Any]:
    """`files` tokenized into `writer` (write.py's Writer), each followed by `end`."""
    vocab = tokenizer.get_vocab_size()
    code = "H" if vocab <= 2**16 else "i"  # uint16 or int32 per token
    eot = [tokenizer.token_to_id(end)]
    for path in tqdm(files, "text files", disable=not progress):
        for lines in chunks(path):  # no BOS a line: a model's tokenizer may add one
            encoded = tokenizer.encode_batch(lines, add_special_tokens=False)
            writer.add_tokens(array(code, [i for e in encoded for i in e.ids]).tobytes())
        writer.add_tokens(array(code, eot).tobytes())
    writer.close_shard()
    tokenizer.save(str(tmp / TOKENIZER))
    content = (tmp / TOKENIZER).read_bytes()
    writer.publish(TOKENIZER, content)
    for shard in writer.shards:  # a shard's count is its tokens
        shard["samples"] = shard["bytes"] // array(code).itemsize
    return {"kind": "tokens", "dtype": "uint16" if code == "H" else "int32", "vocab_size": vocab,
            "tokenizer": checksum(content)}
