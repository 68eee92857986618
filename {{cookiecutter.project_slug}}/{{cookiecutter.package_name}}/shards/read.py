"""Reading a shard set: what `--data` trains on when it names one (shards/__init__.py).

`ShardSet` is a map-style Dataset of one part of the set: training, or validation (the last
samples of each shard: --val-fraction of the set's, spread over its shards). A local set is read
in place; one at a URL through a cache folder on this machine (--shard-cache): a shard is
downloaded whole when any rank or data worker of the machine first asks for one of its samples,
and the least recently used go when the cache would pass --shard-cache-gb. Training starts after
the first window's shards, not the whole set.

`epoch_order`: the shards shuffled, then the samples of each window of --shuffle-window shards
shuffled together, a pure function of the seed and the epoch. The sampler deals global batch k as
the same samples at any world size: a run resumed at another number of processes with the same
global batch trains each sample of the epoch once."""

from __future__ import annotations

import bisect
import json
import os
import time
from collections.abc import Callable
from contextlib import suppress
from itertools import accumulate
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from ..checkpoint import storage
from ..failures import RunFailure, UsageError
from . import INDEX, checksum, index_checksum

TRIES = 4  # a failing download is tried this often, pauses growing, all within --timeout-s
TOKENS = {"uint16": torch.uint16, "int32": torch.int32}  # a token set's "dtype" in index.json


def shard_index(data: str | Path | None) -> dict[str, Any] | None:
    """The index of the shard set `--data` names (a folder or URL with index.json), else None."""
    if not data:
        return None
    data = str(data)  # a URL, or a path (images.class_folders gives a Path)
    if data.rstrip("/").rsplit("/", 1)[-1] == INDEX:  # the set's own file, not the set
        folder = data.rstrip("/")[:-len(INDEX)].rstrip("/") or "."
        raise UsageError(f"--data {storage.redact(data)} is a shard set's {INDEX}; give the "
                         f"set's folder: --data {storage.redact(folder)}", everywhere=True)
    root = storage.location(data)
    try:  # an image folder may ship an index.json of its own; a set's names its kind
        text = (root / INDEX).read_text() if (root / INDEX).exists() else ""
        found = '"kind"' in text
        if found and not storage.is_url(data) and any(p.is_dir() for p in root.iterdir()):
            raise UsageError(f"--data {data}: a shard set's {INDEX} with folders beside it (an "
                             "image folder?): move the set or the images to a folder of their "
                             "own", everywhere=True)
        if not found and storage.is_url(data):
            root.fs.ls(root.key.split("/")[0])  # is the bucket there?
    except OSError as exc:  # object storage: credentials, endpoint, bucket
        raise UsageError(f"--data {storage.redact(data)}: {storage.diagnosis(data, exc)}",
                         everywhere=True) from None
    if not found and (storage.is_url(data) or (root / "00000.bin").exists()):
        what = (f"no shard set there (no {INDEX})" if storage.is_url(data) else
                f"00000.bin and no {INDEX} (a shard set whose prepare stopped, or another "
                "tool's .bin files)")
        raise UsageError(f"--data {storage.redact(data)}: {what}; write one with python -m "
                         f"{__package__} SOURCE {storage.redact(data)}", everywhere=True)
    try:
        index = json.loads(text) if found else None
    except ValueError as exc:  # cut short, or edited by hand
        raise UsageError(f"--data {storage.redact(data)}: its {INDEX} is not JSON ({exc}); "
                         "prepare the shard set again", everywhere=True) from None
    if index is not None and not isinstance(index, dict):
        raise UsageError(f"--data {storage.redact(data)}: its {INDEX} is not a shard set's "
                         "(a JSON object); prepare the shard set again", everywhere=True)
    if index and index.get("checksum", index_checksum(index)) != index_checksum(index):
        raise UsageError(f"--data {storage.redact(data)}: {INDEX} was edited after prepare wrote "
                         "it (what it says no longer has its checksum: a shard dropped, the "
                         "classes reordered?); prepare the shard set again", everywhere=True)
    for shard in (index or {}).get("shards", []):  # "53" * 24 is a string, not a size
        if type(shard.get("samples")) is not int:
            raise UsageError(f"--data {storage.redact(data)}: {INDEX} gives shard "
                             f"{shard.get('name')} {shard.get('samples')!r} samples, not a whole "
                             f"number ({INDEX} edited?); prepare the shard set again",
                             everywhere=True)
    return index


def shard_parts(cfg: Any, index: dict[str, Any], train: Callable | None = None,
                val: Callable | None = None, seq_len: int = 0) -> tuple[ShardSet, ShardSet | None]:
    """--data's training and validation parts (None without validation samples), from its index
    (shard_index's), with the transforms of each (images) or the window length (tokens)."""
    check_files(storage.location(cfg.data), cfg.data, index)  # one listing for both parts
    parts = [ShardSet(cfg.data, cfg, part, f, seq_len, index) for part, f in (("train", train),
                                                                               ("val", val))]
    return parts[0], parts[1] if len(parts[1]) else None


def held_out(counts: list[int], fraction: float) -> list[int]:
    """Validation samples of each shard: --val-fraction of the whole set, spread over the shards
    in proportion (the last samples of each). Per shard alone, small shards round to none: 12
    shards of 4 images held out nothing at 0.2. Up to each shard's end, floor(fraction x the
    samples so far) are held out."""
    marks = [int(end * fraction) for end in accumulate(counts)]
    return [b - a for a, b in zip([0, *marks], marks, strict=False)]


class ShardSet(Dataset):
    """The samples of `part` ("train" or "val") of the shard set at `data`. Images come as
    `transform(file_bytes, label)`; tokens as windows of `seq_len` + 1 ids."""

    def __init__(self, data: str, cfg: Any, part: str, transform: Callable | None = None,
                 seq_len: int = 0, index: dict[str, Any] | None = None) -> None:
        self.data, self.transform, self.seq_len = data, transform, seq_len
        self.index = index or shard_index(data)  # given: read and checked by the caller
        self.images = self.index["kind"] == "images"
        self.window, self.root = cfg.shuffle_window, storage.location(data)
        self.cache = (Cache(self.root, cfg.shard_cache, cfg.shard_cache_gb, self.index,
                            cfg.timeout_s) if isinstance(self.root, storage.RemotePath) else None)
        self.ranges = []  # per shard: (first, end) of this part's samples in it
        counts = [shard["samples"] if self.images else max(0, (shard["samples"] - 1) // seq_len)
                  for shard in self.index["shards"]]
        for n, held in zip(counts, held_out(counts, cfg.val_fraction), strict=True):
            self.ranges.append((0, n - held) if part == "train" else (n - held, n))
        self.starts = [0, *accumulate(end - first for first, end in self.ranges)]
        if index is None:
            check_files(self.root, data, self.index)
        self._files: dict[str, Any] = {}  # open shard files
        self._rows: dict[str, list[int]] = {}
        self.files = shard_files(self.index)
        self.summary = {"shuffle_window": self.window,  # checked at resume, as the tokenizer is
                        **({"tokenizer": self.index["tokenizer"]} if not self.images else {})}

    def __len__(self) -> int:
        return self.starts[-1]

    def __getstate__(self) -> dict[str, Any]:  # to a data worker: no open files
        return {**self.__dict__, "_files": {}}

    def __getitem__(self, i: int) -> Any:
        shard = bisect.bisect_right(self.starts, i) - 1
        name = self.index["shards"][shard]["name"]
        j = self.ranges[shard][0] + i - self.starts[shard]
        if not self.images:
            size = (kind := TOKENS[self.index["dtype"]]).itemsize
            ids = self._read(f"{name}.bin", j * self.seq_len * size, (self.seq_len + 1) * size)
            return torch.frombuffer(bytearray(ids), dtype=kind).long()
        if name not in self._rows:  # offsets, lengths and labels: plain ints, read once
            rows = self._read(f"{name}.idx", 0, self.index["shards"][shard]["idx_bytes"])
            self._rows[name] = memoryview(rows).cast("q").tolist()
        offset, length, label = self._rows[name][3 * j:3 * j + 3]
        try:
            return self.transform(self._read(f"{name}.bin", offset, length), label)
        except UsageError as exc:
            raise UsageError(f"--data {self.data}: sample {j} of shard {name}: {exc}") from None

    def _read(self, file: str, offset: int, length: int) -> bytes:
        """`length` bytes at `offset` of a shard file, kept open (unbuffered: no read-ahead of
        what the next, random sample does not need; at most 64 files at once)."""
        if (handle := self._files.get(file)) is None:
            path = self.cache.get(file) if self.cache else self.root / file
            if not self.cache:  # a download is checked by the cache, once per machine
                verify(path, file, self.files[file][1], self.data)
            handle = self._files[file] = open(path, "rb", buffering=0)  # noqa: SIM115 (kept)
            if len(self._files) > 64:
                self._files.pop(next(iter(self._files))).close()
        handle.seek(offset)
        return handle.read(length)

    def epoch_order(self, seed: int, epoch: int) -> torch.Tensor:
        """This part's samples in the order of `epoch` (the module's docstring says which)."""
        g = torch.Generator().manual_seed(seed + epoch)
        shards = torch.randperm(len(self.ranges), generator=g).tolist()
        windows = [torch.cat([torch.arange(self.starts[s], self.starts[s + 1])
                              for s in shards[w:w + self.window]])
                   for w in range(0, len(shards), self.window)]
        return torch.cat([ids[torch.randperm(len(ids), generator=g)] for ids in windows])


def shard_files(index: dict[str, Any]) -> dict[str, tuple[int, str | None]]:
    """Each shard file's size and checksum (None: a set written before checksums)."""
    return {f"{s['name']}.{kind}": (s[f"{key}bytes"], s.get(f"{key}sha256"))
            for s in index["shards"] for kind, key in (("bin", ""), ("idx", "idx_"))
            if f"{key}bytes" in s}


def verify(path: Path, file: str, expected: str | None, data: str, drop: bool = False) -> None:
    """A shard file changed since it was written is one error line (`drop`: deleted first)."""
    if expected and checksum(path) != expected:
        if drop:
            path.unlink()
        raise UsageError(f"--data {storage.redact(data)}: shard file {file} has changed since "
                         f"the set was written (its checksum is not {INDEX}'s); prepare the "
                         "shard set again")


def check_files(root: storage.AnyPath, data: str, index: dict[str, Any]) -> None:
    """Every shard is there at full size (one listing): else one error line now, not an hour in."""
    try:
        found = {p.name: p.stat().st_size for p in root.iterdir()}
    except OSError as exc:
        raise UsageError(f"--data {storage.redact(data)}: {storage.diagnosis(data, exc)}",
                         everywhere=True) from None
    for file, (size, _) in shard_files(index).items():
        if found.get(file) != size:
            what = "missing" if file not in found else f"{found[file]} bytes, not {size}"
            raise UsageError(f"--data {storage.redact(data)}: shard file {file} is {what} "
                             "(a copy cut short?); prepare the shard set again", everywhere=True)
    per = TOKENS[index["dtype"]].itemsize if "dtype" in index else 24  # a token, or an .idx row
    for s in index["shards"]:  # the counts agree with the files' sizes (checked above)
        if s["samples"] * per != (size := s.get("idx_bytes" if per == 24 else "bytes", 0)):
            raise UsageError(f"--data {storage.redact(data)}: {INDEX} gives shard {s['name']} "
                             f"{s['samples']} samples, its files hold {size // per} ({INDEX} "
                             "edited?); prepare the shard set again", everywhere=True)


class Cache:
    """A URL's shards on this machine's disk, at most `gb` GiB: the least recently used go."""

    def __init__(self, root: storage.RemotePath, folder: str, gb: float,
                 index: dict[str, Any], timeout_s: float) -> None:
        self.root, self.limit, self.timeout_s = root, int(gb * 2**30), timeout_s
        self.files = shard_files(index)  # a folder per set: another at this URL is not stale
        self.folder = Path(folder).expanduser() / checksum(f"{root.url}{self.files}".encode())
        biggest = max(s["bytes"] + s.get("idx_bytes", 0) for s in index["shards"])
        if biggest > self.limit:
            raise UsageError(f"--shard-cache-gb {gb:g} is smaller than one shard of "
                             f"{root.url} ({biggest / 2**30:.3g} GiB); raise it", everywhere=True)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"--shard-cache {folder}: cannot write there ({exc.strerror}); give "
                             "a folder of a disk this user can write to", everywhere=True) from None

    def get(self, file: str) -> Path:
        if (path := self.folder / file).exists():
            os.utime(path)  # recently used
            return path
        size, expected = self.files[file]
        self._make_room(size)
        tmp = path.with_name(f".{file}.{os.getpid()}.tmp")
        deadline = time.monotonic() + self.timeout_s  # the peers wait no longer for this rank
        for attempt in range(TRIES):
            failure = storage.within(lambda: self.root.fs.get_file(
                f"{self.root.key}/{file}", str(tmp)), deadline - time.monotonic())
            if failure is None:
                break
            if attempt < TRIES - 1 and time.monotonic() + 2**attempt < deadline:
                time.sleep(2**attempt)
                continue
            tmp.unlink(missing_ok=True)  # a silent try is left running: this process ends now
            why = (f": the storage did not answer within --timeout-s {self.timeout_s:g} s; check "
                   "the endpoint and the network, or raise --timeout-s"
                   if time.monotonic() >= deadline else f" after {attempt + 1} tries "
                   f"({storage.reason(failure)}); run the same command to resume from the "
                   "newest checkpoint once the storage works")
            raise RunFailure(f"--data {self.root.url}: cannot read shard file {file}{why}")
        verify(tmp, file, expected, self.root.url, drop=True)
        os.replace(tmp, path)  # whole or absent, for the other ranks and workers here
        return path

    def _make_room(self, needed: int) -> None:
        files = []
        for path in self.folder.iterdir():
            with suppress(OSError):  # another process of this machine may delete it first
                files.append((path.stat().st_mtime, path.stat().st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total + needed <= self.limit:
                break
            path.unlink(missing_ok=True)  # a reader that has it open keeps reading it
            total -= size
