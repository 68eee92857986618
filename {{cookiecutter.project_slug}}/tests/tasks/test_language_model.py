"""Tests of the example task in task.py: a small transformer predicting the next byte of text.

They check this example learns and that its text-file format works. When you replace task.py with
your own task, replace these with tests of yours; every other test keeps working.
"""

from __future__ import annotations

import sys

from conftest import PROJECT_ROOT, ok, python_train, read_metrics, run_cmd, torchrun

from {{ cookiecutter.package_name }} import task


def test_perplexity_falls_far_below_guessing(workdir):
    ok(torchrun(["--dataset-size", "1024", "--epochs", "3", "--lr", "0.005"], workdir))
    losses = [m["loss"] for m in read_metrics(workdir / "runs/latest")]
    assert losses[-1] < 0.5 * losses[0], "the training loss did not fall"
    final = read_metrics(workdir / "runs/latest", "val_loss")[-1]
    # Guessing among the 256 byte values: 256; the letters' frequencies alone: about 14.
    assert final["val_perplexity"] < 7


def test_text_file_is_read_one_window_at_a_time_by_worker_processes(workdir):
    text = b"the quick brown fox jumps over the lazy dog. " * 400
    (workdir / "corpus.txt").write_bytes(text)
    ok(torchrun(["--data", "corpus.txt", "--num-workers", "2", "--epochs", "2", "--lr", "0.005"],
                workdir))
    final = read_metrics(workdir / "runs/latest", "val_loss")[-1]
    assert final["val_perplexity"] < 4
    windows = task.TextWindows(workdir / "corpus.txt")
    assert len(windows) == (len(text) - 1) // task.SEQ_LEN
    assert bytes(windows[1].tolist()) == text[task.SEQ_LEN:2 * task.SEQ_LEN + 1]


def test_a_file_shorter_than_two_windows_is_one_error_line(workdir):
    (workdir / "tiny.txt").write_bytes(b"too short")
    result = torchrun(["--data", "tiny.txt", "--epochs", "1"], workdir)
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert result.returncode != 0 and len(errors) == 1, result.stderr
    assert "this model needs at least 129" in errors[0]


def test_predict_continues_each_prompt(workdir):
    ok(python_train(["--epochs", "1", "--dataset-size", "64", "--hidden-size", "16"], workdir))
    newest = max((workdir / "checkpoints").glob("ckpt_step*"))  # a file, or a folder (fsdp)
    result = ok(run_cmd([sys.executable, str(PROJECT_ROOT / "scripts/predict.py"), str(newest),
                         "the ", "data"], workdir))
    # Each prompt, continued (a continuation may hold line breaks of its own).
    assert result.stdout.startswith("the ") and "\ndata" in result.stdout
    assert len(result.stdout) > len("the \ndata\n") + 40
