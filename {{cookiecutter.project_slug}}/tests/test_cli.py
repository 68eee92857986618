"""The command line: every documented flag, bad flags, and the launchers that need no torchrun."""

from __future__ import annotations

import json

import pytest
from conftest import ok, python_train

from {{ cookiecutter.package_name }}.config import build_parser, parse_args

SPEC_FLAGS = [
    "--epochs", "--batch-size", "--lr", "--seed", "--dataset-size", "--data", "--num-workers", "--backend",
    "--init-method", "--timeout-s", "--checkpoint-dir", "--save-every", "--save-every-steps", "--keep-last",
    "--resume", "--precision", "--grad-accum", "--clip-grad", "--max-steps", "--log-every", "--output-dir",
    "--nprocs", "--no-progress", "--compile", "--find-unused-parameters", "--local-rank", "--local_rank",
    "--stage-devices",
]


def test_help_documents_every_flag():
    text = build_parser().format_help()
    missing = [flag for flag in SPEC_FLAGS if flag not in text]
    assert not missing


def test_both_local_rank_spellings():
    assert parse_args(["--local-rank=1"]).local_rank == 1
    assert parse_args(["--local_rank", "2"]).local_rank == 2


@pytest.mark.parametrize("argv", [["--epochs", "0"], ["--backend", "mpi"], ["--no-such-flag"],
                                  ["--stage-devices", "cuda:0"], ["--data", "/no/such/file.pt"]])
def test_bad_flags_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2


def test_plain_python_is_a_world_of_one(workdir):
    ok(python_train(["--epochs", "1", "--dataset-size", "256"], workdir))
    summary = json.loads((workdir / "runs/latest/summary.json").read_text())
    assert summary["world_size"] == 1 and summary["launcher"] == "none" and summary["steps"] == 8


def test_spawn_two_processes(workdir):
    ok(python_train(["--nprocs", "2", "--epochs", "1", "--dataset-size", "256"], workdir))
    summary = json.loads((workdir / "runs/latest/summary.json").read_text())
    assert summary["world_size"] == 2 and summary["launcher"] == "spawn" and summary["steps"] == 4
