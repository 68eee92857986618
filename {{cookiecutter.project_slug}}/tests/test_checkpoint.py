"""Atomic writes, pruning, falling back past broken files, and loading with weights_only."""

from __future__ import annotations

import pytest
import torch

from {{ cookiecutter.package_name }}.checkpoint import (
    find_resumable,
    list_checkpoints,
    load_checkpoint,
    load_for_resume,
    save_checkpoint,
)
from {{ cookiecutter.package_name }}.distributed import SetupError
from {{ cookiecutter.package_name }}.model import MLP


def _state(step: int) -> dict:
    torch.manual_seed(step)
    model = MLP()
    return {"model": model.state_dict(), "step": step, "epoch": 0, "config": {"lr": 0.1, "data": None}}


def test_round_trip_with_weights_only(tmp_path):
    state = _state(5)
    path = save_checkpoint(state, tmp_path, step=5, keep_last=3)
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    assert loaded["step"] == 5 and loaded["config"] == state["config"]
    for key, value in state["model"].items():
        assert torch.equal(loaded["model"][key], value)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temp file left


def test_keep_last_prunes_oldest(tmp_path):
    for step in (1, 2, 3, 4, 5):
        save_checkpoint(_state(step), tmp_path, step=step, keep_last=2)
    assert [load_checkpoint(p)["step"] for p in list_checkpoints(tmp_path)] == [5, 4]


def test_newest_broken_checkpoint_is_skipped(tmp_path, capsys):
    save_checkpoint(_state(1), tmp_path, step=1, keep_last=0)
    newest = save_checkpoint(_state(2), tmp_path, step=2, keep_last=0)
    newest.write_bytes(newest.read_bytes()[:100])  # as if killed while copying
    (tmp_path / "ckpt_step00000003.pt").write_bytes(b"")
    path, state = find_resumable(tmp_path)
    assert state["step"] == 1
    assert "skipping unreadable checkpoint" in capsys.readouterr().err


def test_resume_choices(tmp_path):
    assert load_for_resume("never", tmp_path) is None
    assert load_for_resume("auto", tmp_path / "missing") is None
    save_checkpoint(_state(7), tmp_path, step=7, keep_last=0)
    assert load_for_resume("auto", tmp_path)[1]["step"] == 7
    with pytest.raises(SetupError, match="no such file"):
        load_for_resume(str(tmp_path / "nope.pt"), tmp_path)
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(SetupError, match="cannot load"):
        load_for_resume(str(bad), tmp_path)


def test_arbitrary_objects_are_not_unpickled(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "payload": object()}, path)
    with pytest.raises(SetupError, match="cannot load"):
        load_for_resume(str(path), tmp_path)
