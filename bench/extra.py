"""Two measurements of the generated project beside the per-step race of run.py:

- checkpoint stalls: how long training stands still per save, synchronous vs --async-save, for the
  data_parallel layout (one file written by rank 0) and fsdp (every rank writes its DCP shards),
  on a model whose parameters plus AdamW state pass 1 GB;
- time to recover: under `torchrun --max-restarts=1`, SIGKILL one worker of a 2-process CPU job
  and time from the kill to the first training step after the automatic resume.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

# An MLP 4096 wide with --num-layers 7: a 1.2 GiB checkpoint of weights and AdamW moments (5 gave
# 0.77 GiB). Saves 6 steps apart, so a background write has ended before the next save begins
# (else the stall would include waiting for it).
BIG = ["--hidden-size", "4096", "--num-layers", "7", "--batch-size", "8", "--dataset-size", "256",
       "--epochs", "1", "--max-steps", "36", "--save-every-steps", "6", "--save-every", "0",
       "--val-fraction", "0", "--keep-last", "2", "--log-every", "1", "--no-progress",
       "--resume", "never"]


def torchrun(project: Path, nproc: int = 2, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", *extra, str(project / "train.py")]


def measure_saves(project: Path, work: Path, env: dict[str, str]) -> dict:
    """Median and max stall per save for each layout, sync and async, in one run of the bench."""
    results = {}
    for layout in ("data_parallel", "fsdp"):
        for mode in ("sync", "async"):
            folder = work / f"{layout}-{mode}"
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            cmd = [*torchrun(project), *BIG, "--model-layout", layout,
                   "--checkpoint-dir", str(folder / "ck"), "--output-dir", str(folder / "runs"),
                   *(["--async-save"] if mode == "async" else [])]
            proc = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{layout} {mode} failed:\n{proc.stderr[-3000:]}")
            summary = json.loads((folder / "runs/summary.json").read_text())
            newest = sorted((folder / "ck").glob("ckpt_step*"))[-1]
            size = sum(p.stat().st_size for p in ([newest] if newest.is_file() else
                                                   newest.rglob("*")) if p.is_file())
            results[f"{layout}/{mode}"] = {
                "stall_ms_median": summary["checkpoint_stall_ms"],
                "stall_ms_max": summary["checkpoint_stall_ms_max"],
                "saves": summary["checkpoint_saves"], "checkpoint_mb": size / 2**20,
                "median_step_ms": summary["median_step_ms"],
                "peak_mem_mb": summary["peak_mem_mb"]}
            print(f"saves {layout:13s} {mode:5s} stall {summary['checkpoint_stall_ms']:8.1f} ms "
                  f"(max {summary['checkpoint_stall_ms_max']:.1f}), {size / 2**20:.0f} MB",
                  flush=True)
            shutil.rmtree(folder / "ck", ignore_errors=True)
    for layout in ("data_parallel", "fsdp"):
        results[f"{layout}/ratio"] = (results[f"{layout}/async"]["stall_ms_median"]
                                      / results[f"{layout}/sync"]["stall_ms_median"])
    return results


def _workers(agent: int) -> dict[int, int]:
    found = {}
    for task in Path(f"/proc/{agent}/task").iterdir():
        for pid in (task / "children").read_text().split():
            for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                if item.startswith(b"RANK="):
                    found[int(item[5:])] = int(pid)
    return found


def measure_recovery(project: Path, work: Path, env: dict[str, str], kills: int) -> dict:
    """Seconds from SIGKILL of rank 1 to the first step after torchrun restarted and resumed."""
    times = []
    for attempt in range(kills):
        folder = work / f"recovery{attempt}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        cmd = [*torchrun(project, 2, "--max-restarts=1"), "--no-progress", "--dataset-size",
               "4096", "--batch-size", "16", "--hidden-size", "64", "--epochs", "1", "--max-steps",
               "100", "--save-every-steps", "10", "--log-every", "1", "--step-times", "steps.json"]
        job = subprocess.Popen(cmd, cwd=folder, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
        deadline = time.monotonic() + 120
        while not list(folder.glob("checkpoints/ckpt_step0000002*")):
            if time.monotonic() > deadline or job.poll() is not None:
                raise RuntimeError(f"no checkpoint to recover from: {job.stderr.read()[-2000:]}")
            time.sleep(0.005)
        killed_at = time.time()
        os.kill(_workers(job.pid)[1], signal.SIGKILL)
        _, err = job.communicate(timeout=300)
        if job.returncode != 0:
            raise RuntimeError(f"the job did not recover:\n{err[-3000:]}")
        report = json.loads((folder / "steps.json").read_text())  # the restarted rank 0's
        times.append(report["step_ends"][0] - killed_at)
        print(f"recovery {attempt + 1}/{kills}: {times[-1]:.2f} s from SIGKILL to the next step",
              flush=True)
    return {"kills": kills, "seconds": times, "median_s": statistics.median(times),
            "min_s": min(times), "max_s": max(times)}
