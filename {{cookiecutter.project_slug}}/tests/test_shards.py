"""Shard sets (docs/data.md): `python -m {{ cookiecutter.package_name }}.shards` writes one from an
image folder, to a folder or a bucket (moto's S3 server on loopback), and `--data` trains on it:
every image read back as written, the order a function of the seed and the epoch alone, a SIGKILLed
run resumed bit for bit from a bucket with data workers, a run saved at 2 processes and resumed at 4
training each image of the epoch once, and each careless input one line: a DEST inside SRC, text
that is not UTF-8, another source, a shard changed since it was written, files that are not
images."""

from __future__ import annotations

import importlib.util
import io
import json
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    TRAIN,
    assert_same_model,
    final_model,
    kill_a_worker_once_saved,
    needs_numpy,
    ok,
    one_error,
    run_cmd,
    skip_unless_example_task,
    summary,
    torchrun_cmd,
)

from {{ cookiecutter.package_name }}.config import parse_args
from {{ cookiecutter.package_name }}.data import ShardedBatchSampler
from {{ cookiecutter.package_name }}.failures import RunFailure, UsageError
from {{ cookiecutter.package_name }}.shards import index_checksum, read
from {{ cookiecutter.package_name }}.shards.read import ShardSet
from {{ cookiecutter.package_name }}.shards.write import prepare

PACKAGE = "{{ cookiecutter.package_name }}"
needs_s3 = pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("s3fs", "moto")),
                              reason="needs s3fs and moto's server: pip install -e '.[dev]'")


def needs_images() -> None:
    skip_unless_example_task()
    from {{ cookiecutter.package_name }} import task
    if not hasattr(task, "image_sample"):
        pytest.skip("the image shard sets are the classification task's")


def image_folder(root: Path, per_class: int = 32) -> Path:
    """Three classes of small PNGs, each image its own colour (and a note that is no image)."""
    needs_images()
    from PIL import Image
    g = torch.Generator().manual_seed(0)
    for name in ("cat", "dog", "emu"):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            colour = tuple(torch.randint(256, (3,), generator=g).tolist())
            Image.new("RGB", (12, 12), colour).save(root / name / f"{i:03d}.png")
        (root / name / "notes.txt").write_text("not an image: left out")
    return root


def config(data: str, *flags: str):
    from {{ cookiecutter.package_name }} import task
    return parse_args(["--data", data, *flags], task.Settings)


def as_stored(data: bytes, label: int) -> tuple[bytes, int]:
    return data, label


def test_a_shard_set_holds_every_image_once_and_a_rerun_does_nothing(tmp_path, capsys):
    source = image_folder(tmp_path / "images")
    index = prepare(str(source), str(tmp_path / "set"), shard_mb=0.002, progress=False)
    assert index["kind"] == "images" and index["classes"] == ["cat", "dog", "emu"]
    assert len(index["shards"]) > 2 and sum(s["samples"] for s in index["shards"]) == 96
    written = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "set").iterdir()}
    again = prepare(str(source), str(tmp_path / "set"), shard_mb=0.002, progress=False)
    assert again == index and "is a complete shard set (96 images" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "set").iterdir()} == written

    cfg = config(str(tmp_path / "set"), "--val-fraction", "0.25")
    train, val = (ShardSet(cfg.data, cfg, part, as_stored) for part in ("train", "val"))
    stored = sorted(train[i] for i in range(len(train))) + sorted(val[i] for i in range(len(val)))
    files = {(p.read_bytes(), ["cat", "dog", "emu"].index(p.parent.name))
             for p in source.rglob("*.png")}
    assert len(stored) == 96 and set(stored) == files, "each image once, with its label"
    assert len(val) == int(96 * 0.25)  # the set's fraction, spread over its shards


def test_a_shard_sets_image_that_cannot_be_used_is_a_short_line_naming_shard_and_sample(
        tmp_path):
    """Named by its shard and sample, with what to do for a set (not --skip-bad-images, which a
    set does not take), never the image's bytes (a 32-bit image's line held 3,018 of them)."""
    images = image_folder(tmp_path / "images", 4)  # (skips without Pillow)
    from PIL import Image

    prepare(str(images), str(tmp_path / "set"), 1, progress=False)
    from {{ cookiecutter.package_name }}.images import read_image  # the classification task's

    tiff = io.BytesIO()
    Image.new("F", (32, 32), 2.0).save(tiff, "TIFF")  # 32-bit floats past 0..1
    cfg = config(str(tmp_path / "set"), "--val-fraction", "0")
    for stored, why in ((tiff.getvalue(), "it is a 32-bit image with values outside 0..1; "
                         "convert it to 8 or 16 bits, or prepare"),
                        (b"\x89PNG cut short", "it cannot be decoded as an image (")):
        data = ShardSet(cfg.data, cfg, "train", lambda image, label, s=stored: read_image(s))
        with pytest.raises(UsageError) as raised:
            data[5]
        line = str(raised.value)
        assert line.startswith(f"--data {cfg.data}: sample 5 of shard 00000: {why}"), line
        assert line.endswith("prepare the shard set again (prepare leaves out such images)")
        assert len(line) < 300 and "--skip-bad-images" not in line, line


def test_the_order_depends_on_seed_and_epoch_alone_and_batches_on_the_global_batch(tmp_path):
    prepare(str(image_folder(tmp_path / "images")), str(tmp_path / "set"), 0.002,
            progress=False)
    cfg = config(str(tmp_path / "set"), "--val-fraction", "0", "--shuffle-window", "2")
    data = ShardSet(cfg.data, cfg, "train", as_stored)
    first = data.epoch_order(0, 1)
    assert torch.equal(first, ShardSet(cfg.data, cfg, "train").epoch_order(0, 1))
    assert sorted(first.tolist()) == list(range(96))
    assert not torch.equal(first, data.epoch_order(0, 2))
    # Global batch k (16 samples) is the same samples at 2 x 8 and at 4 x 4.

    def global_batches(world: int) -> list[set[int]]:
        ranks = [[set(b.tolist()) for _, b in ShardedBatchSampler(
            96, r, world, 16 // world, 0, order=data.epoch_order)] for r in range(world)]
        return [set().union(*(batches[k] for batches in ranks)) for k in range(6)]

    assert global_batches(2) == global_batches(4)


def test_careless_inputs_are_one_line(tmp_path, monkeypatch):
    prepare(str(image_folder(tmp_path / "images", 8)), str(tmp_path / "set"), 0.001,
            progress=False)
    index = json.loads((tmp_path / "set" / "index.json").read_text())
    cfg = config(str(tmp_path / "set"))
    with pytest.raises(UsageError, match="is smaller than one shard of s3://b/set"):
        read.Cache(read.storage.RemotePath("s3://b/set", fs=object()), str(tmp_path / "c"),
                   1e-9, index, 300)
    for change in (1, -1):  # a count wrong: more samples than the files hold, or fewer (its
        # checksum made anew: what a faulty writer would leave, which the files still refute)
        shards = [{**index["shards"][0], "samples": index["shards"][0]["samples"] + change}]
        wrong = {**index, "shards": shards}
        wrong["checksum"] = index_checksum(wrong)
        (tmp_path / "set" / "index.json").write_text(json.dumps(wrong))
        with pytest.raises(UsageError, match=r"index.json gives shard 00000 \d+ samples, its "
                                             r"files hold \d+ \(index.json edited\?\); prepare"):
            ShardSet(cfg.data, cfg, "train", as_stored)
    samples = index["shards"][0]["samples"]  # a count written as a string: "gives 53, hold 53"
    wrong = {**index, "shards": [{**index["shards"][0], "samples": str(samples)}]}
    wrong["checksum"] = index_checksum(wrong)
    (tmp_path / "set" / "index.json").write_text(json.dumps(wrong))
    with pytest.raises(UsageError, match=rf"gives shard 00000 '{samples}' samples, not a whole "):
        ShardSet(cfg.data, cfg, "train", as_stored)
    (tmp_path / "set" / "index.json").write_text(json.dumps(index))
    (tmp_path / "set" / "00001.idx").unlink()
    with pytest.raises(UsageError, match="shard file 00001.idx is missing .* prepare the shard "):
        ShardSet(cfg.data, cfg, "train", as_stored)
    shard = tmp_path / "set" / "00000.bin"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(UsageError, match=r"shard file 00000.bin is \d+ bytes, not \d+"):
        ShardSet(cfg.data, cfg, "train", as_stored)
    with pytest.raises(UsageError, match="no such file or folder"):
        prepare(str(tmp_path / "none"), str(tmp_path / "out"), 1, progress=False)
    # An image folder shipping an index.json of its own is an image folder, not a shard set.
    assert read.shard_index(str(tmp_path / "set"))
    with pytest.raises(UsageError, match=rf"--data {tmp_path}/set/index.json is a shard set's "
                       rf"index.json; give the set's folder: --data {tmp_path}/set$"):
        read.shard_index(str(tmp_path / "set" / "index.json"))
    shutil.copytree(tmp_path / "set", tmp_path / "edited")
    written = (tmp_path / "edited" / "index.json").read_text()
    for text, says in ((written[:-40], "is not JSON"), (f"[{written}]", "is not a shard set's")):
        (tmp_path / "edited" / "index.json").write_text(text)
        with pytest.raises(UsageError, match=f"edited: its index.json {says} .*prepare the shard"):
            read.shard_index(str(tmp_path / "edited"))
    (tmp_path / "images" / "index.json").write_text('[{"file": "cat/000.png", "label": 0}]')
    assert not read.shard_index(str(tmp_path / "images"))
    for file in (tmp_path / "set").iterdir():  # a set copied into an image folder: which one?
        shutil.copy(file, tmp_path / "images")
    with pytest.raises(UsageError, match="index.json with folders beside it .* move the set"):
        read.shard_index(str(tmp_path / "images"))

    class Gone:  # storage that stopped answering mid-epoch
        def get_file(self, *args):
            raise ConnectionError("endpoint went away")

    monkeypatch.setattr(read.time, "sleep", lambda s: None)
    cache = read.Cache(read.storage.RemotePath("s3://b/set", fs=Gone()), str(tmp_path / "c"),
                       1, index, 300)
    with pytest.raises(RunFailure, match="cannot read shard file 00000.bin after 4 tries "
                                         r"\(ConnectionError: endpoint went away\); run the same"):
        cache.get("00000.bin")


def test_validation_is_the_fraction_of_the_set_whatever_the_shards_size():
    """12 shards of 4 images at --val-fraction 0.2: 9 held out, spread over the shards (each
    shard's own 0.8 rounded to none before: no validation, and nothing said so)."""
    held = read.held_out([4] * 12, 0.2)
    assert sum(held) == 9 and max(held) == 1
    assert read.held_out([1000, 1000, 999], 0.1) == [100, 100, 99]
    assert read.held_out([4] * 12, 0.0) == [0] * 12


def test_prepare_leaves_out_what_training_would_refuse(tmp_path, capsys):
    """A 32-bit image with values outside 0..65535, which training refuses in one line: prepare
    reads each image as training does, and leaves it out with the files that are no images (it
    stored it before, and the run stopped on it)."""
    from PIL import Image

    source = image_folder(tmp_path / "images", 4)
    Image.new("I", (5, 4), 70000).save(source / "cat" / "wide.tiff")
    index = prepare(str(source), str(tmp_path / "set"), 0.001, progress=False)
    assert sum(shard["samples"] for shard in index["shards"]) == 12  # 3 classes x 4 images
    assert "note: left out 4 files that are not images or cannot be decoded" in \
        capsys.readouterr().err  # each class's notes.txt, and the image


def test_an_index_edited_after_prepare_is_one_line(tmp_path):
    """index.json's checksum covers what it says: a shard entry dropped, or the class names
    reordered (every label then names another class), trained before without a word."""
    prepare(str(image_folder(tmp_path / "images", 8)), str(tmp_path / "set"), 0.001,
            progress=False)
    path = tmp_path / "set" / "index.json"
    index = json.loads(path.read_text())
    assert read.shard_index(str(tmp_path / "set")) == index and len(index["shards"]) > 1
    for edited in ({**index, "shards": index["shards"][1:]},
                   {**index, "classes": index["classes"][::-1]}):
        path.write_text(json.dumps(edited, indent=1))
        with pytest.raises(UsageError, match="index.json was edited after prepare wrote it .*; "
                                             "prepare the shard set again"):
            read.shard_index(str(tmp_path / "set"))


def test_a_prepare_never_writes_into_its_source_nor_onto_another_sources_set(tmp_path, capsys):
    source = image_folder(tmp_path / "images", 4)
    (source / "cat" / "fake.png").write_text("a note named like an image")
    png = (source / "dog" / "000.png").read_bytes()  # its header opens, its pixels are cut off
    (source / "dog" / "cut.png").write_bytes(png[:-20])
    files = sorted(source.rglob("*"))
    for dest in (source, source / "set", f"file://{source}/dog/set"):
        with pytest.raises(UsageError, match=r"^DEST .* is SRC .* or inside it: the shards would "):
            prepare(str(source), str(dest), 1, progress=False)
    assert sorted(source.rglob("*")) == files, "SRC untouched"
    index = prepare(str(source), str(tmp_path / "set"), 1, progress=False)
    assert sum(s["samples"] for s in index["shards"]) == 12 and index["source"] == str(source)
    assert "note: left out 5 files that are not images or cannot be decoded, such as " in \
        capsys.readouterr().err
    other = image_folder(tmp_path / "other", 4)
    with pytest.raises(UsageError, match=f"set is a shard set made from {source}, not {other}; "):
        prepare(str(other), str(tmp_path / "set"), 1, progress=False)
    prepare(str(source), str(tmp_path / "set"), 1, progress=False)
    assert "complete shard set (12 images in 1 shards): nothing to do" in capsys.readouterr().out
    (tmp_path / "set" / "index.json").unlink()
    with pytest.raises(UsageError, match=r"set: 00000.bin and no index.json \(a shard set whose "
                                         r"prepare stopped, or another tool's .bin files\); "
                                         "write one with python -m"):
        read.shard_index(str(tmp_path / "set"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="neither images .* nor .txt files in it"):
        prepare(str(tmp_path / "empty"), str(tmp_path / "out"), 1, progress=False)
    with pytest.raises(UsageError, match=r"^DEST .*other holds other files \(3, such as cat; an "
                                         r"image folder\?\): the shards would land among them; "
                                         "give a new or empty folder"):
        prepare(str(source), str(other), 1, progress=False)
    assert sorted(p.name for p in other.iterdir()) == ["cat", "dog", "emu"], "DEST untouched"


def test_text_that_is_not_utf8_or_empty_is_one_line(tmp_path):
    (tmp_path / "latin.txt").write_bytes("the caf\u00e9 opens\n".encode("latin-1"))
    (tmp_path / "long.txt").write_bytes(b"x" * (2**22 - 1) + "\u00e9".encode() + b"\xff")
    (tmp_path / "utf16.txt").write_text("the caf\u00e9 opens\n", encoding="utf-16")  # with a BOM
    for name, offset, was in (("latin.txt", 7, "latin1"), ("long.txt", 2**22 + 1, "latin1"),
                              ("utf16.txt", 0, "utf-16")):
        with pytest.raises(UsageError, match=rf"{name}: not UTF-8 text \(byte {offset}\); "
                           rf"convert it, e.g. iconv -f {was} -t utf-8 .*{name} > "):
            prepare(str(tmp_path / name), str(tmp_path / "set"), 1, progress=False)
    # UTF-16 without its byte-order mark is valid UTF-8, full of NULs: it was prepared as that.
    for was in ("utf-16le", "utf-16be"):
        (tmp_path / f"{was}.txt").write_text("the cafe opens\n", encoding=was)
        with pytest.raises(UsageError, match=rf"{was}.txt: NUL characters \(byte [01]\): UTF-16 "
                           rf"text without a byte-order mark\? convert it, e.g. iconv -f {was} "):
            prepare(str(tmp_path / f"{was}.txt"), str(tmp_path / "set"), 1, progress=False)
    (tmp_path / "tokens.bin").write_bytes(bytes(range(256)))  # a token file: no advice to convert
    with pytest.raises(UsageError, match=r"tokens.bin: a .bin file is binary \(token ids or "
                       r"shards\), not text; give prepare the UTF-8 text it was made from"):
        prepare(str(tmp_path / "tokens.bin"), str(tmp_path / "set"), 1, progress=False)
    (tmp_path / "empty.txt").write_text(" \n")
    with pytest.raises(UsageError, match="empty.txt: no text in it"):
        prepare(str(tmp_path / "empty.txt"), str(tmp_path / "set"), 1, progress=False)


def test_a_shard_changed_since_it_was_written_is_one_line_once_read(tmp_path, monkeypatch):
    prepare(str(image_folder(tmp_path / "images", 8)), str(tmp_path / "set"), 0.001,
            progress=False)
    shard = tmp_path / "set" / "00001.bin"
    shard.write_bytes(bytes(reversed(shard.read_bytes())))  # the same size: the start-up check
    cfg = config(str(tmp_path / "set"), "--shard-cache", str(shard / "cache"))
    data = ShardSet(cfg.data, cfg, "train", as_stored)
    with pytest.raises(UsageError, match="shard file 00001.bin has changed since the set was "
                                         "written .*; prepare the shard set again"):
        [data[i] for i in range(len(data))]
    index = json.loads((tmp_path / "set" / "index.json").read_text())
    with pytest.raises(UsageError, match=f"^--shard-cache {shard}/cache: cannot write there"):
        read.Cache(read.storage.RemotePath("s3://b/set", fs=object()), cfg.shard_cache, 1, index,
                   300)

    class Bucket:  # whose shard changed: the download is checked, then dropped
        def get_file(self, key: str, local: str) -> None:
            shutil.copy(tmp_path / "set" / Path(key).name, local)

    cache = read.Cache(read.storage.RemotePath("s3://b/set", fs=Bucket()), str(tmp_path / "c"),
                       1, index, 300)
    assert cache.get("00000.bin").read_bytes() == (tmp_path / "set/00000.bin").read_bytes()
    with pytest.raises(UsageError, match="s3://b/set: shard file 00001.bin has changed"):
        cache.get("00001.bin")
    assert [p.name for p in cache.folder.iterdir()] == ["00000.bin"]
    rewritten = {"shards": [{**index["shards"][0], "sha256": "0" * 16}]}  # at the same URL
    assert read.Cache(cache.root, str(tmp_path / "c"), 1, rewritten, 300).folder != cache.folder


@needs_s3
def test_a_silent_or_vanished_endpoint_ends_a_shard_download_within_the_timeout(tmp_path, s3):
    """A GET the endpoint never answers (held by the proxy), then an endpoint that is gone
    (connection refused): one line each, within about --timeout-s, no partial file left."""
    from s3server import Proxy
    prepare(str(image_folder(tmp_path / "images", 8)), str(tmp_path / "set"), 0.001,
            progress=False)
    s3.fs().put(str(tmp_path / "set"), "bkt/silent", recursive=True)
    index = json.loads((tmp_path / "set" / "index.json").read_text())
    proxy = Proxy(("127.0.0.1", s3.port), hold_get="00000.bin")
    cache = read.Cache(read.storage.RemotePath("s3://bkt/silent", s3.fs(proxy.endpoint)),
                       str(tmp_path / "c"), 1, index, 3)
    try:
        assert cache.get("00001.bin").read_bytes() == (tmp_path / "set/00001.bin").read_bytes()
        started = time.monotonic()
        with pytest.raises(RunFailure, match="^--data s3://bkt/silent: cannot read shard file "
                           "00000.bin: the storage did not answer within --timeout-s 3 s; "
                           "check the endpoint and the network, or raise --timeout-s$"):
            cache.get("00000.bin")
        assert proxy.held.is_set() and time.monotonic() - started < 12
    finally:
        proxy.close()
    started = time.monotonic()
    with pytest.raises(RunFailure, match="cannot read shard file 00000.bin") as gone:
        cache.get("00000.bin")
    assert "\n" not in str(gone.value) and time.monotonic() - started < 12, str(gone.value)
    assert [p.name for p in cache.folder.iterdir()] == ["00001.bin"]


@pytest.mark.full
@needs_s3
def test_bucket_mistakes_are_one_line(tmp_path, s3, monkeypatch):
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UsageError, match="s3://nobucket/set: no such bucket 'nobucket'"):
        prepare(str(image_folder(tmp_path / "images", 1)), "s3://nobucket/set", 1, progress=False)
    import s3fs
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    for name in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(name, str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no asking 169.254.169.254
    s3fs.S3FileSystem.clear_instance_cache()
    try:  # botocore's NoCredentialsError, which is no OSError: one line too
        with pytest.raises(UsageError, match="^s3://bkt/set: no credentials found; set AWS_"):
            prepare(str(tmp_path / "images"), "s3://bkt/set", 1, progress=False)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        monkeypatch.undo()
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    for url, says in (("s3://bkt/nothing", "no shard set there (no index.json); write one with"),
                      ("s3://nobucket/set", "no such bucket 'nobucket'")):
        result = run_cmd([sys.executable, TRAIN, "--data", url], tmp_path, **s3.env())
        assert says in one_error(result)


@pytest.fixture(scope="module")
def s3():
    from s3server import S3Server
    server = S3Server()
    yield server
    server.close()


@pytest.fixture(scope="module")
def bucket_set(s3, tmp_path_factory) -> str:
    """The image folder as a shard set in the bucket, written once for this module."""
    folder = tmp_path_factory.mktemp("shards")
    ok(run_cmd([sys.executable, "-m", f"{PACKAGE}.shards", str(image_folder(folder / "images")),
                "s3://bkt/images", "--shard-mb", "0.002", "--no-progress"], folder, **s3.env()))
    return "s3://bkt/images"


@pytest.mark.full
@needs_s3
@pytest.mark.parametrize("where, layout", [("bucket", "data_parallel"),
                                           pytest.param("folder", "fsdp", marks=needs_numpy)])
def test_a_killed_run_resumes_bit_for_bit(tmp_path, s3, bucket_set, where, layout):
    """2 processes, 2 data workers each, shards from the bucket through the cache (or from a
    folder); SIGKILL after the step-4 checkpoint, the same command again: the uninterrupted run's
    weights."""
    data = bucket_set
    if where == "folder":
        data = str(tmp_path / "set")
        prepare(str(image_folder(tmp_path / "images")), data, 0.002, progress=False)

    def command(name: str) -> list[str]:
        return [*torchrun_cmd(2), TRAIN, "--data", data, "--num-workers", "2",
                "--batch-size", "8", "--epochs", "2", "--save-every-steps", "2",
                "--model-layout", layout, "--hidden-size", "16", "--no-progress",
                "--shard-cache", str(tmp_path / "cache"), "--shuffle-window", "3",
                "--checkpoint-dir", str(tmp_path / name),
                "--output-dir", str(tmp_path / f"r{name}")]

    ok(run_cmd(command("a"), tmp_path, **s3.env()))
    kill_a_worker_once_saved(command("b"), tmp_path, tmp_path / "b", step=4, **s3.env())
    ok(run_cmd(command("b"), tmp_path, **s3.env()))
    assert summary(tmp_path / "rb")["resumed_from"]
    assert_same_model(final_model(tmp_path / "a"), final_model(tmp_path / "b"))
    assert bool(list((tmp_path / "cache").glob("*/*.bin"))) == (where == "bucket")


SEEN = """
import os, sys
import {{ cookiecutter.package_name }}.main as entry
from {{ cookiecutter.package_name }}.shards.read import ShardSet

original = ShardSet.__getitem__

def seen(self, i):  # every training sample read, one line each
    with open(os.path.join(os.environ["SEEN"], str(os.getpid())), "a") as f:
        f.write(f"{i}\\n")
    return original(self, i)

ShardSet.__getitem__ = seen
sys.exit(entry.main(sys.argv[1:]))
"""


@pytest.mark.full
def test_a_run_saved_at_2_processes_and_resumed_at_4_trains_each_image_once(tmp_path):
    """The same global batch (2 x 8, then 4 x 4): the resumed run goes on with the next global
    batch, and the epoch ends with each of the 96 images trained exactly once; another
    --shuffle-window mid-epoch is refused."""
    prepare(str(image_folder(tmp_path / "images")), str(tmp_path / "set"), 0.002,
            progress=False)
    (tmp_path / "seen.py").write_text(SEEN)
    (tmp_path / "seen").mkdir()
    flags = ["--data", str(tmp_path / "set"), "--val-fraction", "0", "--epochs", "1",
             "--hidden-size", "8", "--no-progress", "--shuffle-window", "2"]
    env = {"SEEN": str(tmp_path / "seen")}
    ok(run_cmd([*torchrun_cmd(2), "seen.py", *flags, "--batch-size", "8", "--max-steps", "3"],
               tmp_path, **env))
    other_window = run_cmd([sys.executable, TRAIN, *flags[:-1], "3", "--batch-size", "16"],
                           tmp_path)  # the order of the rest of the epoch would change
    assert "part way through an epoch of --shuffle-window 2: give that window again" in one_error(
        other_window)
    resumed = ok(run_cmd([*torchrun_cmd(4), "seen.py", *flags, "--batch-size", "4"], tmp_path,
                         **env))
    assert "continuing epoch 0 after 48 of the 48 samples already seen" in resumed.stderr
    seen = [int(i) for f in (tmp_path / "seen").iterdir() for i in f.read_text().split()]
    assert sorted(seen) == list(range(96))
