"""Benchmark the generated Trainer against a hand-written DDP loop, the tutorial style and Lightning.

    python bench/run.py              # 5 interleaved repetitions of every variant, both workloads
    python bench/run.py --reps 2 --no-lightning
    python bench/run.py --gpu        # NCCL, 1 process on one GPU, bf16, step times from CUDA events
    python bench/run.py --gpu --workloads gpt2 --reps 3   # GPT-2 small: tokens/s and MFU, ours vs nanoGPT

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

from extra import measure_recovery, measure_saves
from shards import measure_shards, shards_table

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
WARMUP_STEPS = 20
WORKLOADS = {
    # tiny: per-step framework overhead over the ~1 ms gloo floor. 512 steps per run on CPU.
    "tiny": {"task": "regression", "hidden-size": 64, "num-layers": 2, "batch-size": 32,
             "dataset-size": 32768, "epochs": 1},
    # ~6 MB of parameters (1.5 M floats): all-reduce and bucketing; also ours with fsdp.
    "mlp-6MB": {"task": "regression", "hidden-size": 1224, "num-layers": 2, "batch-size": 32,
                "dataset-size": 16384, "epochs": 1},
    # images: the classification task reading and decoding an image folder one image at a time in
    # 2 DataLoader workers per rank, against a DataLoader + DistributedSampler loop on the same data.
    "images": {"task": "classification", "hidden-size": 32, "num-layers": 2, "batch-size": 32,
               "epochs": 1, "num-workers": 2},
    # gpt2: the language-model task as configs/gpt2-small.toml trains it (124 M parameters, context
    # 1024, micro-batch 64, torch.compile, bf16, fused AdamW; an optimizer step every micro-batch
    # here), against a loop written the way nanoGPT's train.py is. GPU only: 48 steps.
    "gpt2": {"task": "language_model", "hidden-size": 768, "num-layers": 12, "num-heads": 12,
             "seq-len": 1024, "vocab-size": 50304, "tie-embeddings": True, "compile": True,
             "batch-size": 64, "dataset-size": 3072, "epochs": 1},
    # gpt2-tiny: the same comparison at a size a CPU runs in seconds (no compile).
    "gpt2-tiny": {"task": "language_model", "hidden-size": 64, "num-layers": 2, "num-heads": 4,
                  "seq-len": 64, "vocab-size": 256, "batch-size": 16, "dataset-size": 2048,
                  "epochs": 1},
    # smoke: checks that every variant runs (the template's tests use it); its timings mean nothing.
    "smoke": {"task": "regression", "hidden-size": 16, "num-layers": 1, "batch-size": 16,
              "dataset-size": 1536, "epochs": 1},
}
VARIANTS_OF = {"tiny": ["ours", "raw", "raw+DataLoader", "tutorial", "lightning"],
               "mlp-6MB": ["ours", "ours-fsdp", "raw", "raw+DataLoader", "tutorial", "lightning"],
               "images": ["ours", "raw+DataLoader"],
               "gpt2": ["ours", "raw"], "gpt2-tiny": ["ours", "raw"],
               "smoke": ["ours", "raw", "raw+DataLoader", "tutorial", "lightning"]}
DEFAULT_WORKLOADS = {"cpu": "tiny,mlp-6MB,images", "gpu": "tiny,gpt2"}
SCRIPTS = {"raw": "raw.py", "raw+DataLoader": "raw_dataloader.py", "tutorial": "tutorial.py",
           "lightning": "lightning_variant.py"}
# Runs a command and prints the largest resident set of any process it started, in KiB.
RSS_WRAPPER = ("import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(rc)")


def bake(folder: Path, task: str) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "cookiecutter", "--no-input", "-o", str(folder), str(ROOT),
                    f"task={task}"], check=True, stdout=subprocess.DEVNULL)
    return folder / "ddp-project"


def write_images(folder: Path, count: int) -> Path:
    """An image folder for the images workload: PPM files the classification task decodes."""
    if folder.is_dir() and len(list(folder.rglob("*.ppm"))) == count:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    import torch

    g = torch.Generator().manual_seed(0)
    for i in range(count):
        label = i % 10
        image = torch.randint(0, 256, (20, 24, 3), generator=g, dtype=torch.uint8)
        image[:, :, label % 3] = image[:, :, label % 3] // 2 + 100
        path = folder / f"class{label}" / f"{i:05d}.ppm"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"P6\n24 20\n255\n" + bytes(image.flatten().tolist()))
    return folder


def venv_python(name: str, modules: str, packages: list[str]) -> str:
    """bench/<name>'s Python: a venv over the torch already installed, with `packages` installed
    unless `modules` import there already (never in the template or in a project)."""
    env_dir = HERE / name
    python = env_dir / "bin" / "python"
    if not python.exists():
        print(f"installing {' '.join(packages)} into bench/{name} (uses the torch already installed)")
        venv.create(env_dir, system_site_packages=True, with_pip=True)
    check = subprocess.run([str(python), "-c", f"import {modules}"], capture_output=True)
    if check.returncode != 0:
        subprocess.run([str(python), "-m", "pip", "install", "-q", *packages], check=True)
    return str(python)


def lightning_python() -> str:
    return venv_python(".venv-lightning", "pytorch_lightning", ["pytorch-lightning"])


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


def workload_flags(workload: dict) -> list[str]:
    """A workload's settings as flags: True a bare flag, False none."""
    return [f"--{k}" if v is True else f"--{k}={v}" for k, v in workload.items() if k != "task" and v is not False]


def run_variant(name: str, workload: dict, project: Path, work: Path, python_for_lightning: str | None,
                gpu: bool) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    flags = workload_flags(workload)
    nproc = 1 if gpu else 2
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    env = variant_env(project)
    python = python_for_lightning if name == "lightning" else sys.executable
    if name.startswith("ours"):
        device_flags = ["--backend=nccl", "--precision=bf16"] if gpu else []
        layout = ["--model-layout=fsdp"] if name == "ours-fsdp" else []
        cmd = [python, *torchrun, str(project / "train.py"), *flags, *device_flags, *layout,
               "--no-progress", "--val-fraction=0", "--save-every=0", "--resume=never",
               f"--output-dir={work}/runs", f"--checkpoint-dir={work}/ck", f"--step-times={work}/steps.json"]
    else:
        script = {"classification": "raw_images.py", "language_model": "raw_lm.py"}.get(
            workload["task"], SCRIPTS[name])
        cmd = [python, *torchrun, str(HERE / "variants" / script), *flags,
               f"--device={'cuda' if gpu else 'cpu'}", f"--result={work}/steps.json"]
    launched_at = time.time()
    proc = subprocess.run([sys.executable, "-c", RSS_WRAPPER, *cmd], cwd=work, env=env, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result = json.loads((work / "steps.json").read_text())
    out = stats(result, launched_at, workload["batch-size"] * nproc)
    out["peak_rss_mb"] = int(proc.stderr.strip().splitlines()[-1]) / 1024
    if result.get("peak_mem_mb"):  # raw_lm.py on a GPU
        out["peak_mem_mb_per_rank"] = result["peak_mem_mb"]
    if name.startswith("ours"):
        summary = json.loads((work / "runs/summary.json").read_text())
        out["checkpoint_stall_ms"] = summary["checkpoint_stall_ms"]
        out["peak_mem_mb_per_rank"] = max(summary["peak_mem_mb"])
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
    parser.add_argument("--workloads", default=None,
                        help=f"comma-separated, from {', '.join(WORKLOADS)} (default: {DEFAULT_WORKLOADS['cpu']}; "
                             f"with --gpu {DEFAULT_WORKLOADS['gpu']})")
    parser.add_argument("--gpu", action="store_true", help="NCCL, 1 process on one GPU, bf16, CUDA-event timing")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the results and the baked project go")
    parser.add_argument("--pairs", type=int, default=40,
                        help="CPU: paired in-process runs for the per-step overhead of ours over raw (0 = skip)")
    parser.add_argument("--saves", action="store_true",
                        help="CPU: checkpoint stall per save, sync vs --async-save, DDP and fsdp, on a 1.2 GB state")
    parser.add_argument("--variants", default=None, help="comma-separated subset of the variants to run")
    parser.add_argument("--images", type=int, default=4096,
                        help="images in the folder of the images workload (10 classes, 24 x 20 pixels, PPM)")
    parser.add_argument("--shards", action="store_true",
                        help="CPU: samples/s of the data reader on the images: image folder vs a shard set in a "
                             "folder and in a bucket on loopback (bench/shards.py)")
    parser.add_argument("--kills", type=int, default=0,
                        help="CPU: SIGKILL a worker this many times and time the recovery under torchrun")
    args = parser.parse_args()
    workloads = (args.workloads or DEFAULT_WORKLOADS["gpu" if args.gpu else "cpu"]).split(",")
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown or args.reps < 1:
        print(f"error: unknown workload {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}" if unknown else
              "error: --reps must be at least 1", file=sys.stderr)
        return 2
    if "gpt2" in workloads and not args.gpu:
        print("error: the gpt2 workload (124 M parameters) needs --gpu; on a CPU use gpt2-tiny", file=sys.stderr)
        return 2
    if args.gpu and (why := gpu_error()):
        print(f"error: {why}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    projects = {task: bake(args.out / f"baked-{task}", task)
                for task in sorted({WORKLOADS[w]["task"] for w in workloads} | {"regression"})}
    if "images" in workloads or args.shards:
        WORKLOADS["images"]["data"] = write_images(args.out / "images", args.images)
    if args.shards and "classification" not in projects:
        projects["classification"] = bake(args.out / "baked-classification", "classification")
    python_for_lightning = None
    raw: dict = {}
    for workload in workloads:
        variants = [v for v in VARIANTS_OF[workload] if not (v == "lightning" and args.no_lightning)
                    and (args.variants is None or v in args.variants.split(","))]
        if "lightning" in variants and python_for_lightning is None:
            python_for_lightning = lightning_python()
        raw[workload] = {v: [] for v in variants}
        project = projects[WORKLOADS[workload]["task"]]
        for rep in range(args.reps):
            for variant in variants:  # interleaved: A B C A B C, so drift hits every variant alike
                result = run_variant(variant, WORKLOADS[workload], project, args.out / "work" / variant,
                                     python_for_lightning, args.gpu)
                raw[workload][variant].append(result)
                print(f"{workload} rep {rep + 1}/{args.reps} {variant:15s} {result['median_ms']:.3f} ms/step",
                      flush=True)
    summary = summarize(raw)
    for workload in workloads:
        if WORKLOADS[workload]["task"] == "language_model":
            add_token_rates(summary[workload], token_costs(projects["language_model"], WORKLOADS[workload]),
                            1 if args.gpu else 2)
    cpu = not args.gpu
    regression = projects["regression"]
    overhead = measure_overhead(regression, args.out / "work" / "overhead", args.pairs) if args.pairs and cpu \
        else None
    saves = measure_saves(regression, args.out / "work" / "saves", variant_env(regression)) if args.saves and cpu \
        else None
    recovery = measure_recovery(regression, args.out / "work" / "recovery", variant_env(regression), args.kills) \
        if args.kills and cpu else None
    shards = measure_shards(projects["classification"], WORKLOADS["images"]["data"], args.out / "work" / "shards",
                            variant_env(projects["classification"]), args.reps) if args.shards and cpu else None
    machine = describe_machine(args.gpu)
    name = "results-gpu" if args.gpu else "results"
    (args.out / f"{name}.json").write_text(json.dumps(
        {"machine": machine, "mode": "gpu" if args.gpu else "cpu", "reps": args.reps,
         "workloads": {w: {k: str(v) for k, v in WORKLOADS[w].items()} for w in workloads}, "summary": summary,
         "overhead": overhead, "saves": saves, "recovery": recovery, "shards": shards, "runs": raw},
        indent=1))
    print(table(summary, machine, args.reps, args.gpu))
    if tokens := tokens_table(summary):
        print("\n" + tokens)
    if overhead:
        print(f"\nper-step overhead of ours over raw in one process (world size 1, tiny model, median of "
              f"{overhead['pairs']} paired runs of {overhead['steps_per_run']} steps): median step "
              f"{overhead['overhead_us_median']:+.0f} us (ratio {overhead['ratio_median']:.3f}), 10th-percentile "
              f"step {overhead['overhead_us_p10']:+.0f} us (ratio {overhead['ratio_p10']:.3f})")
    if saves:
        print("\n" + saves_table(saves))
    if shards:
        print("\n" + shards_table(shards))
    if recovery:
        print(f"\ntime to recover (SIGKILL of rank 1 -> first step after torchrun's restart and resume), "
              f"{recovery['kills']} kills: median {recovery['median_s']:.2f} s, min {recovery['min_s']:.2f} s, "
              f"max {recovery['max_s']:.2f} s")
    plot(summary, args.out / f"{name}.png")
    return 0


def token_costs(project: Path, workload: dict) -> dict:
    """Tokens per sample, training FLOPs per token (the task's own count) and the peak FLOP/s of
    one device (None on CPUs and unknown GPUs), from the baked project."""
    flags = workload_flags(workload)
    code = ("import json, sys, torch\n"
            "from ddp_project import task\n"
            "from ddp_project.config import parse_args\n"
            "from ddp_project.meters import peak_flops\n"
            "cfg = parse_args(sys.argv[1:], task.Settings)\n"
            "with torch.device('meta'):\n"
            "    model = task.build_model(cfg)\n"
            "gpu = torch.cuda.is_available()\n"
            "print(json.dumps({'tokens_per_sample': task.tokens_per_sample(cfg),\n"
            "                  'flops_per_token': task.flops_per_token(model, cfg),\n"
            "                  'peak_flops': peak_flops(torch.device('cuda' if gpu else 'cpu'))}))")
    out = subprocess.run([sys.executable, "-c", code, *flags], env=variant_env(project), capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout)


def token_rate(samples_per_s: float, costs: dict, devices: int) -> tuple[float, float | None]:
    """(tokens/s, MFU or None where the device's peak is unknown)."""
    tokens, peak = samples_per_s * costs["tokens_per_sample"], costs["peak_flops"]
    return tokens, tokens * costs["flops_per_token"] / (peak * devices) if peak else None


def add_token_rates(per_variant: dict, costs: dict, devices: int) -> None:
    """tokens/s and MFU (FLOPs per token x tokens/s / (peak x devices)) of each variant."""
    raw_tokens = None
    for variant, values in per_variant.items():
        values["tokens_per_s"], values["mfu"] = token_rate(values["samples_per_s"], costs, devices)
        raw_tokens = values["tokens_per_s"] if variant == "raw" else raw_tokens
    for values in per_variant.values():
        values["tokens_ratio_to_raw"] = values["tokens_per_s"] / raw_tokens


def tokens_table(summary: dict) -> str:
    lines = ["| workload | variant | tokens/s | ratio to raw | MFU |", "|---|---|---|---|---|"]
    for workload, per_variant in summary.items():
        for variant, v in per_variant.items():
            if "tokens_per_s" in v:
                mfu = f"{100 * v['mfu']:.1f}%" if v["mfu"] is not None else "n/a (no known peak)"
                lines.append(f"| {workload} | {variant} | {v['tokens_per_s']:.0f} | {v['tokens_ratio_to_raw']:.3f} | "
                             f"{mfu} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def saves_table(saves: dict) -> str:
    lines = ["| layout | save | stall per save, median ms | max ms | checkpoint MB | async / sync |",
             "|---|---|---|---|---|---|"]
    for layout in ("data_parallel", "fsdp"):
        for mode in ("sync", "async"):
            v = saves[f"{layout}/{mode}"]
            ratio = f"{saves[f'{layout}/ratio']:.3f}" if mode == "async" else ""
            lines.append(f"| {layout} | {mode} | {v['stall_ms_median']:.1f} | {v['stall_ms_max']:.1f} | "
                         f"{v['checkpoint_mb']:.0f} | {ratio} |")
    return "\n".join(lines)


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
        # The floor: the raw loop, or for per-sample data the hand-written DataLoader loop.
        floor = summary[workload]["raw" if "raw" in per_variant else "raw+DataLoader"]["median_ms"]
        for values in summary[workload].values():
            values["ratio_to_raw"] = values["median_ms"] / floor
    return summary


def table(summary: dict, machine: str, reps: int, gpu: bool = False) -> str:
    mode = "NCCL, 1 process, bf16, CUDA-event step times" if gpu else "gloo, 2 processes, OMP_NUM_THREADS=1"
    lines = [f"machine: {machine}; {mode}; median of {reps} interleaved runs; first {WARMUP_STEPS} steps dropped",
             "",
             "| workload | variant | median ms/step | runs' range | p90 ms/step | ratio to the floor | samples/s "
             "| launch to first step s | peak RSS MB (all processes) | peak RSS MB per rank |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for workload, per_variant in summary.items():
        for variant, v in per_variant.items():
            per_rank = f"{v['peak_mem_mb_per_rank']:.0f}" if "peak_mem_mb_per_rank" in v else ""
            low, high = v["median_ms_range"]
            lines.append(f"| {workload} | {variant} | {v['median_ms']:.3f} | {low:.2f}-{high:.2f} | "
                         f"{v['p90_ms']:.3f} | {v['ratio_to_raw']:.3f} | {v['samples_per_s']:.0f} | "
                         f"{v['first_step_s']:.2f} | {v['peak_rss_mb']:.0f} | {per_rank} |")
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
