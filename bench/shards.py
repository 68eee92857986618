"""The shards measurement (`python bench/run.py --shards`): the data reader alone, no training.

The images workload's images read three ways by the classification task of a baked project, each
through the project's own loader with 2 worker processes, one rank, batches of 32: the image folder
(one file per image), a shard set in a local folder, and the same shard set in a bucket of moto's
S3 server on loopback, read through a cold cache. For each: samples/s after the first batch, and the
seconds from building the data set to the first batch (a cold cache downloads the first shards)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

MEASURE = r'''
import json, os, sys, tempfile, time
import torch
from ddp_project import task
from ddp_project.config import parse_args
from ddp_project.data import ShardedBatchSampler, build_loader
from ddp_project.shards.write import prepare
from s3server import S3Server


def read_all(data: str, cache: str) -> tuple[float, float]:
    cfg = parse_args(["--data", data, "--shard-cache", cache, "--val-fraction", "0"],
                     task.Settings, warn=False)
    started = time.perf_counter()
    train, _ = task.build_datasets(cfg)
    order = getattr(train, "epoch_order", None)
    loader = build_loader(train, ShardedBatchSampler(len(train), 0, 1, 32, 0, order=order), None, 2,
                          torch.device("cpu"))
    count, first = 0, None
    for images, labels in loader:
        if first is None:
            first, after_first = time.perf_counter() - started, time.perf_counter()
        else:
            count += len(labels)
    return count / (time.perf_counter() - after_first), first


if __name__ == "__main__":
    folder, work, reps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    server = S3Server()
    os.environ.update(server.env())
    server.make_bucket("bench")
    for dest in (f"{work}/set", "s3://bench/set"):
        prepare(folder, dest, shard_mb=1, progress=False)
    results = {"image folder": [], "shards, folder": [], "shards, bucket (cold cache)": []}
    for rep in range(reps):  # interleaved, a cold cache each time
        for name, data in zip(results, (folder, f"{work}/set", "s3://bench/set")):
            results[name].append(read_all(data, tempfile.mkdtemp(dir=work)))
            print(f"shards rep {rep + 1}/{reps} {name:28s} {results[name][-1][0]:8.0f} samples/s",
                  file=sys.stderr, flush=True)
    server.close()
    print(json.dumps(results))
'''


def measure_shards(project: Path, images: Path, work: Path, env: dict[str, str], reps: int) -> dict:
    """Median samples/s and seconds to the first batch of each reader, and each one's ratio to the
    image folder's rate."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "measure.py").write_text(MEASURE)
    env = {**env, "PYTHONPATH": f"{env['PYTHONPATH']}:{project / 'tests'}"}
    out = subprocess.run([sys.executable, str(work / "measure.py"), str(images), str(work),
                          str(reps)], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"the shards measurement failed:\n{out.stderr[-3000:]}")
    raw = json.loads(out.stdout.strip().splitlines()[-1])
    base = statistics.median(rate for rate, _ in raw["image folder"])
    return {name: {"samples_per_s": statistics.median(r for r, _ in runs),
                   "first_batch_s": statistics.median(f for _, f in runs),
                   "ratio_to_image_folder": statistics.median(r for r, _ in runs) / base}
            for name, runs in raw.items()}


def shards_table(results: dict) -> str:
    rows = ["| reader (2 workers, batches of 32) | samples/s | vs image folder | first batch (s) |",
            "|---|---|---|---|"]
    rows += [f"| {name} | {v['samples_per_s']:.0f} | {v['ratio_to_image_folder']:.2f}x | "
             f"{v['first_batch_s']:.2f} |" for name, v in results.items()]
    return "\n".join(rows)
