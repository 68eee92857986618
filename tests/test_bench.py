"""The benchmark runs every variant for real (short workloads; their timings mean nothing)."""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import PYTHON, ROOT

BENCH = [PYTHON, str(ROOT / "bench" / "run.py")]


def test_bench_smoke_runs_every_variant_and_writes_its_report(tmp_path):
    result = subprocess.run([*BENCH, "--reps", "1", "--no-lightning", "--workloads", "smoke,images,gpt2-tiny",
                             "--images", "1536", "--pairs", "1", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["mode"] == "cpu" and report["reps"] == 1
    summary = report["summary"]["smoke"]
    assert list(summary) == ["ours", "raw", "raw+DataLoader", "tutorial"]
    for variant, values in summary.items():
        # 1536 samples / (2 ranks x 16) = 48 steps each, and every statistic was measured.
        assert values["steps"] == 48, variant
        assert 0 < values["median_ms"] <= values["p90_ms"] and values["samples_per_s"] > 0
        assert 0 < values["import_to_first_step_s"] < values["first_step_s"] < 120 and values["peak_rss_mb"] > 50
    assert summary["raw"]["ratio_to_raw"] == 1.0 and summary["ours"]["checkpoint_stall_ms"] > 0
    # images: ours and the DataLoader loop read the same folder of 1536 images, 2 x 32 a step.
    images = report["summary"]["images"]
    assert list(images) == ["ours", "raw+DataLoader"] and images["raw+DataLoader"]["ratio_to_raw"] == 1.0
    assert all(values["steps"] == 24 and values["median_ms"] > 0 for values in images.values())
    # gpt2-tiny: the language-model task against the nanoGPT-style loop, in tokens/s; no MFU on a CPU.
    lm = report["summary"]["gpt2-tiny"]
    assert list(lm) == ["ours", "raw"] and lm["raw"]["tokens_ratio_to_raw"] == 1.0
    for values in lm.values():
        assert values["steps"] == 2048 // 32 and values["mfu"] is None
        assert values["tokens_per_s"] == values["samples_per_s"] * 64 > 0
    assert "| gpt2-tiny | ours |" in result.stdout and "n/a (no known peak)" in result.stdout
    overhead = report["overhead"]  # ours' real Trainer and the raw loop, alternating in one process
    assert overhead["pairs"] == 1 and len(overhead["ours_ms"]) == len(overhead["raw_ms"]) == 1
    for median, p10 in overhead["ours_ms"] + overhead["raw_ms"]:  # each run's median and 10th-percentile step
        assert 0 < p10 <= median
    assert "per-step overhead of ours" in result.stdout
    rows = [line for line in result.stdout.splitlines() if line.startswith("| smoke |")]
    assert [row.split("|")[2].strip() for row in rows] == list(summary)


def test_bench_refuses_bad_arguments_in_one_line(tmp_path):
    bad = subprocess.run([*BENCH, "--workloads", "huge", "--out", str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: unknown workload huge; choose from tiny, mlp-6MB, images, gpt2, gpt2-tiny, smoke"]
    big = subprocess.run([*BENCH, "--workloads", "gpt2", "--out", str(tmp_path)], capture_output=True, text=True)
    assert big.returncode == 2 and big.stderr.strip().splitlines() == [
        "error: the gpt2 workload (124 M parameters) needs --gpu; on a CPU use gpt2-tiny"]
    assert not any(tmp_path.iterdir()), "nothing is baked before the arguments are checked"


def test_bench_gpu_mode_says_why_it_cannot_run_without_a_gpu(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: `python bench/run.py --gpu` runs for real")
    result = subprocess.run([*BENCH, "--gpu", "--out", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: --gpu needs a CUDA GPU and this machine has none; run without --gpu for the CPU benchmark"]
    levers = subprocess.run([PYTHON, str(ROOT / "bench" / "levers.py"), "--out", str(tmp_path / "levers")],
                            capture_output=True, text=True)
    assert levers.returncode == 2 and levers.stderr.strip().splitlines() == [
        "error: levers.py measures on one CUDA GPU and this machine has none; --cpu runs its rows at gpt2-tiny "
        "on 2 CPU processes"]
