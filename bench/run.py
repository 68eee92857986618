"""Benchmark the generated Trainer against a hand-written DDP loop, the tutorial style and Lightning.

    python bench/run.py              # 5 interleaved repetitions of every variant, both workloads
    python bench/run.py --reps 2 --no-lightning
    python bench/run.py --gpu        # NCCL, 1 process on one GPU, bf16, step times from CUDA events

CPU: gloo, 2 processes through torchrun, OMP_NUM_THREADS=1, no pinning. Results go to bench/results/
as results.json and results.png (results-gpu.* for --gpu), and a table is printed. Lightning is
installed into its own virtual environment (bench/.venv-lightning); it is never a dependency of the
template or its projects.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import venv
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
WARMUP_STEPS = 20
WORKLOADS = {
    # tiny: per-step framework overhead over the ~1 ms gloo floor. 512 steps per run on CPU.
    "tiny": {"hidden-size": 64, "num-layers": 2, "batch-size": 32, "dataset-size": 32768, "epochs": 1},
    # ~6 MB of parameters (1.5 M floats): all-reduce and bucketing. 256 steps per run on CPU.
    "mlp-6MB": {"hidden-size": 1224, "num-layers": 2, "batch-size": 32, "dataset-size": 16384, "epochs": 1},
    # smoke: checks that every variant runs (the template's tests use it); its timings mean nothing.
    "smoke": {"hidden-size": 16, "num-layers": 1, "batch-size": 16, "dataset-size": 1536, "epochs": 1},
}
DEFAULT_WORKLOADS = "tiny,mlp-6MB"
VARIANTS = ["ours", "raw", "raw+DataLoader", "tutorial", "lightning"]
SCRIPTS = {"raw": "raw.py", "raw+DataLoader": "raw_dataloader.py", "tutorial": "tutorial.py",
           "lightning": "lightning_variant.py"}
# Runs a command and prints the largest resident set of any process it started, in KiB.
RSS_WRAPPER = ("import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(rc)")


def bake(folder: Path) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "cookiecutter", "--no-input", "-o", str(folder), str(ROOT)], check=True,
                   stdout=subprocess.DEVNULL)
    return folder / "ddp-project"


def lightning_python() -> str:
    env_dir = HERE / ".venv-lightning"
    python = env_dir / "bin" / "python"
    if not python.exists():
        print("installing pytorch-lightning into bench/.venv-lightning (uses the torch already installed)")
        venv.create(env_dir, system_site_packages=True, with_pip=True)
    check = subprocess.run([str(python), "-c", "import pytorch_lightning"], capture_output=True)
    if check.returncode != 0:
        subprocess.run([str(python), "-m", "pip", "install", "-q", "pytorch-lightning"], check=True)
    return str(python)


def variant_env(project: Path) -> dict[str, str]:
    """One thread per process; the baked project and the variants importable."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{project}{os.pathsep}{HERE / 'variants'}"}


def stats(result: dict, launched_at: float, global_batch: int) -> dict:
    step_ends = result["step_ends"]
    if "cuda_step_ms" in result:  # GPU: time between CUDA events, not host launch times
        durations = result["cuda_step_ms"][WARMUP_STEPS:]
    else:
        durations = [1000 * (b - a) for a, b in zip(step_ends, step_ends[1:], strict=False)][WARMUP_STEPS:]
    median = statistics.median(durations)
    return {
        "median_ms": median,
        "p90_ms": statistics.quantiles(durations, n=10)[-1],
        "samples_per_s": global_batch * 1000 / median,
        "first_step_s": step_ends[0] - launched_at,
        "steps": len(step_ends),
        "import_to_first_step_s": step_ends[0] - result["started_at"],
    }


def run_variant(name: str, workload: dict, project: Path, work: Path, python_for_lightning: str | None,
                gpu: bool) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    flags = [f"--{k}={v}" for k, v in workload.items()]
    nproc = 1 if gpu else 2
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    env = variant_env(project)
    python = python_for_lightning if name == "lightning" else sys.executable
    if name == "ours":
        device_flags = ["--backend=nccl", "--precision=bf16"] if gpu else []
        cmd = [python, *torchrun, str(project / "train.py"), *flags, *device_flags, "--no-progress",
               "--val-fraction=0", "--save-every=0", "--resume=never", f"--output-dir={work}/runs",
               f"--checkpoint-dir={work}/ck", f"--step-times={work}/steps.json"]
    else:
        cmd = [python, *torchrun, str(HERE / "variants" / SCRIPTS[name]), *flags,
               f"--device={'cuda' if gpu else 'cpu'}", f"--result={work}/steps.json"]
    launched_at = time.time()
    proc = subprocess.run([sys.executable, "-c", RSS_WRAPPER, *cmd], cwd=work, env=env, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    out = stats(json.loads((work / "steps.json").read_text()), launched_at, workload["batch-size"] * nproc)
    out["peak_rss_mb"] = int(proc.stderr.strip().splitlines()[-1]) / 1024
    if name == "ours":
        out["checkpoint_save_ms"] = json.loads((work / "runs/summary.json").read_text())["checkpoint_save_ms"]
    return out


def measure_overhead(project: Path, work: Path, pairs: int) -> dict:
    """Ours and raw alternating in one process (variants/overhead.py): resolves tens of microseconds."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = variant_env(project)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           str(HERE / "variants" / "overhead.py"), f"--pairs={pairs}", f"--result={work}/overhead.json"]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"overhead measurement failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads((work / "overhead.json").read_text())


def gpu_error() -> str | None:
    """Why the GPU mode cannot run here, or None."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return "PyTorch is not installed; run `pip install torch` first"
    if not torch.cuda.is_available():
        return "--gpu needs a CUDA GPU and this machine has none; run without --gpu for the CPU benchmark"
    if not dist.is_nccl_available():
        return "--gpu needs a PyTorch build with NCCL; install a CUDA build of torch or run without --gpu"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions of every variant")
    parser.add_argument("--no-lightning", action="store_true", help="skip the Lightning variant")
    parser.add_argument("--workloads", default=DEFAULT_WORKLOADS, help=f"comma-separated, from {', '.join(WORKLOADS)}")
    parser.add_argument("--gpu", action="store_true", help="NCCL, 1 process on one GPU, bf16, CUDA-event timing")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the results and the baked project go")
    parser.add_argument("--pairs", type=int, default=40,
                        help="CPU: paired in-process runs for the per-step overhead of ours over raw (0 = skip)")
    args = parser.parse_args()
    workloads = args.workloads.split(",")
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown or args.reps < 1:
        print(f"error: unknown workload {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}" if unknown else
              "error: --reps must be at least 1", file=sys.stderr)
        return 2
    if args.gpu and (why := gpu_error()):
        print(f"error: {why}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    project = bake(args.out / "baked")
    variants = [v for v in VARIANTS if not (v == "lightning" and args.no_lightning)]
    python_for_lightning = lightning_python() if "lightning" in variants else None
    raw: dict = {w: {v: [] for v in variants} for w in workloads}
    for workload in raw:
        for rep in range(args.reps):
            for variant in variants:  # interleaved: A B C A B C, so drift hits every variant alike
                result = run_variant(variant, WORKLOADS[workload], project, args.out / "work" / variant,
                                     python_for_lightning, args.gpu)
                raw[workload][variant].append(result)
                print(f"{workload} rep {rep + 1}/{args.reps} {variant:15s} {result['median_ms']:.3f} ms/step",
                      flush=True)
    summary = summarize(raw)
    overhead = measure_overhead(project, args.out / "work" / "overhead", args.pairs) if args.pairs and not args.gpu \
        else None
    machine = describe_machine(args.gpu)
    name = "results-gpu" if args.gpu else "results"
    (args.out / f"{name}.json").write_text(json.dumps(
        {"machine": machine, "mode": "gpu" if args.gpu else "cpu", "reps": args.reps,
         "workloads": {w: WORKLOADS[w] for w in workloads}, "summary": summary, "overhead": overhead,
         "runs": raw}, indent=1))
    print(table(summary, machine, args.reps, args.gpu))
    if overhead:
        print(f"\nper-step overhead of ours over raw in one process (world size 1, tiny model, median of "
              f"{overhead['pairs']} paired runs of {overhead['steps_per_run']} steps): median step "
              f"{overhead['overhead_us_median']:+.0f} us (ratio {overhead['ratio_median']:.3f}), 10th-percentile "
              f"step {overhead['overhead_us_p10']:+.0f} us (ratio {overhead['ratio_p10']:.3f})")
    plot(summary, args.out / f"{name}.png")
    return 0


def describe_machine(gpu: bool) -> str:
    text = f"{platform.node()}: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, " \
           f"Python {platform.python_version()}"
    try:
        import torch

        text += f", torch {torch.__version__}"
        if gpu:
            text += f", {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return text


def summarize(raw: dict) -> dict:
    """Median over repetitions of each statistic, and the ratio of median ms/step to raw's."""
    summary = {}
    for workload, per_variant in raw.items():
        summary[workload] = {}
        for variant, runs in per_variant.items():
            keys = runs[0].keys()
            summary[workload][variant] = {k: statistics.median(r[k] for r in runs) for k in keys}
            # How much one run differs from the next on this machine: read small ratios against it.
            summary[workload][variant]["median_ms_range"] = [min(r["median_ms"] for r in runs),
                                                             max(r["median_ms"] for r in runs)]
        floor = summary[workload]["raw"]["median_ms"]
        for values in summary[workload].values():
            values["ratio_to_raw"] = values["median_ms"] / floor
    return summary


def table(summary: dict, machine: str, reps: int, gpu: bool = False) -> str:
    mode = "NCCL, 1 process, bf16, CUDA-event step times" if gpu else "gloo, 2 processes, OMP_NUM_THREADS=1"
    lines = [f"machine: {machine}; {mode}; median of {reps} interleaved runs; first {WARMUP_STEPS} steps dropped",
             "",
             "| workload | variant | median ms/step | runs' range | p90 ms/step | ratio to raw | samples/s "
             "| launch to first step s | peak RSS MB | checkpoint save ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for workload, per_variant in summary.items():
        for variant, v in per_variant.items():
            save = f"{v['checkpoint_save_ms']:.1f}" if "checkpoint_save_ms" in v else ""
            low, high = v["median_ms_range"]
            lines.append(f"| {workload} | {variant} | {v['median_ms']:.3f} | {low:.2f}-{high:.2f} | "
                         f"{v['p90_ms']:.3f} | {v['ratio_to_raw']:.3f} | {v['samples_per_s']:.0f} | "
                         f"{v['first_step_s']:.2f} | {v['peak_rss_mb']:.0f} | {save} |")
    return "\n".join(lines)


def plot(summary: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no matplotlib: skipping the PNG)")
        return
    fig, axes = plt.subplots(1, len(summary), figsize=(6 * len(summary), 4))
    for ax, (workload, per_variant) in zip(list(getattr(axes, "flat", [axes])), summary.items(), strict=True):
        names = list(per_variant)
        values = [per_variant[n]["median_ms"] for n in names]
        bars = ax.bar(names, values, color=["tab:green" if n == "ours" else "tab:gray" for n in names])
        for bar, name in zip(bars, names, strict=True):
            ax.annotate(f"x{per_variant[name]['ratio_to_raw']:.2f}", (bar.get_x() + bar.get_width() / 2,
                        bar.get_height()), ha="center", va="bottom")
        ax.set_title(f"{workload}: median ms/step (ratio to raw)")
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
