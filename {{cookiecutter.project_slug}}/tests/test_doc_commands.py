"""The docs' commands, run as a reader runs them: each command of each shell block of README.md
and docs/*.md, in the order the page gives them, in a copy of the project. Training commands get
short-run flags; the placeholders are filled in: INPUT (tests/test_task.py's `doc_inputs` writes
what the example task reads), a checkpoint's step (the newest there), and s3://my-bucket (a real
S3 API server on loopback). A block marked `<!-- not run by the tests: why -->` is not run: its
flags are still checked (tests/test_docs.py), and so is that every other block is run here."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
from conftest import PROJECT_ROOT, path_with, project_copy, run_cmd
from test_docs import MARKDOWN, command_words, shell_blocks

try:
    from test_task import doc_inputs
except ImportError:  # a test_task.py of your own: the docs' inputs went with the example's
    doc_inputs = None

pytestmark = [
    pytest.mark.full,
    pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("s3fs", "moto", "boto3")),
                       reason="needs s3fs and moto's server: pip install -e '.[dev]'"),
]

SHORT = ["--no-progress", "--dataset-size", "64", "--batch-size", "16", "--hidden-size", "8"]
CHECKPOINT = re.compile(r"(.*)/(ckpt_step\d{8,}(\.pt)?)")
RUN = {path.relative_to(PROJECT_ROOT).as_posix(): path for path in MARKDOWN
       if any(not block.why_not for block in shell_blocks(path))}


@pytest.fixture(scope="module")
def s3():
    from s3server import S3Server

    server = S3Server()
    server.make_bucket("my-bucket")
    yield server
    server.close()


def newest(word: str, root: Path, s3) -> str:
    """A checkpoint the docs name by an example step: the newest one in that folder or bucket."""
    match = CHECKPOINT.fullmatch(word)
    if match is None:
        return word
    parent = match.group(1)
    if parent.startswith("s3://"):
        names = [p.rsplit("/", 1)[-1] for p in s3.fs().ls(parent[5:], detail=False)]
    else:
        names = [p.name for p in (root / parent).iterdir()]
    saved = sorted(n for n in names if CHECKPOINT.fullmatch(f"x/{n}"))
    assert saved, f"no checkpoint in {parent} for {word}"
    return f"{parent}/{saved[-1]}"


def filled(words: list[str], inputs: list[str], root: Path, s3) -> list[str]:
    """INPUT is the first input, `[INPUT ...]` the others; a checkpoint is the newest."""
    out: list[str] = []
    for word in words:
        if word == "INPUT":
            out.append(inputs[0])
        elif word == "[INPUT":
            out += inputs[1:]
        elif word != "...]":
            out.append(newest(word, root, s3))
    return out


@pytest.mark.parametrize("doc", sorted(RUN))
def test_the_commands_of_a_page_run_as_written(doc, tmp_path, bin_dir, s3, example_task):
    if doc_inputs is None:
        pytest.skip("tests/test_task.py has no doc_inputs(root) giving the docs' INPUT")
    root = project_copy(tmp_path)  # the commands train and save there
    inputs = doc_inputs(root)
    env = {**s3.env(), "PATH": path_with(bin_dir), "PYTHON": sys.executable,
           "PYTHONPATH": str(root)}
    ran = 0
    for block in shell_blocks(RUN[doc]):
        for command in [] if block.why_not else block.commands:
            assignments, words = command_words(command)
            if words[0] == "pytest":  # this suite: the project's CI runs it
                continue
            if words[0] == "pip":  # installs: tests/test_docs.py checks the extras it names
                continue
            words = filled(words, inputs, root, s3)
            training = words[0].endswith("train_local.sh") or "train.py" in words
            result = run_cmd(words + SHORT * training, root, timeout=300, **env, **assignments)
            assert result.returncode == 0, (
                f"{block.where()}: {command}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
            if "scripts/predict.py" in words:  # one line for each input
                assert len(result.stdout.splitlines()) == len(words) - 3, result.stdout
            ran += 1
    assert ran > 0
