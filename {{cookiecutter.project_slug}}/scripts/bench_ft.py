"""What torchft costs per step: two replica groups of N processes under a lighthouse, against
plain DDP (train.py) on the same 2 x N processes, with the same flags and the same global batch.

    python scripts/bench_ft.py --nproc 2 --steps 400 -- --dataset-size 4096 --hidden-size 64

Prints each run's median step time (from summary.json) and torchft's extra cost per step. Needs
torchft (pip install -e ".[ft]"). On a machine with fewer cores than processes, both runs share
the cores alike; compare the figures only with each other.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def torchrun(nproc: int, script: str, flags: list[str], out: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", str(ROOT / script), "--no-progress",
            "--output-dir", str(out), "--checkpoint-dir", str(out / "checkpoints"), *flags]


def median_ms(out: Path) -> float:
    return json.loads((out / "summary.json").read_text())["median_step_ms"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--nproc", type=int, default=2, help="processes per replica group")
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps of each run")
    parser.add_argument("flags", nargs="*", help="train.py flags, after --")
    args = parser.parse_args(argv)
    lighthouse_bin = shutil.which("torchft_lighthouse", path=os.path.dirname(sys.executable))
    if lighthouse_bin is None:
        parser.error('needs torchft: pip install -e ".[ft]"')
    flags = [*args.flags, "--max-steps", str(args.steps), "--epochs", "1000000",
             "--save-every", "0", "--val-fraction", "0"]
    # A replica group's variables, if the shell exports them, would make train.py refuse to run.
    env = {k: v for k, v in os.environ.items()
           if k not in ("REPLICA_GROUP_ID", "TORCHFT_LIGHTHOUSE")}
    env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="bench-ft-") as tmp:
        work = Path(tmp)
        subprocess.run(torchrun(2 * args.nproc, "train.py", flags, work / "ddp"), env=env,
                       check=True, stdout=subprocess.DEVNULL)
        port = free_port()
        lighthouse = subprocess.Popen([lighthouse_bin, "--bind", f"[::]:{port}",
                                       "--min_replicas", "2"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            groups = [subprocess.Popen(torchrun(args.nproc, "train_ft.py", flags, work / f"g{i}"),
                                       env={**env, "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}",
                                            "REPLICA_GROUP_ID": str(i), "NUM_REPLICA_GROUPS": "2",
                                            "TORCHFT_MIN_REPLICAS": "2"},
                                       stdout=subprocess.DEVNULL) for i in range(2)]
            if any(group.wait() != 0 for group in groups):
                print("a replica group failed; run it by hand to see why", file=sys.stderr)
                return 1
        finally:
            lighthouse.kill()
            lighthouse.wait()
        plain, ft = median_ms(work / "ddp"), max(median_ms(work / f"g{i}") for i in range(2))
    rows = [(f"plain DDP, {2 * args.nproc} processes", plain),
            (f"torchft, 2 groups x {args.nproc} processes", ft)]
    for name, ms in rows:
        print(f"{name:<36} median step {ms:8.2f} ms")
    print(f"torchft's cost: {ft - plain:+.2f} ms per step ({100 * (ft / plain - 1):+.0f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
