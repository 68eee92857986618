"""Checkpoint files and folders: atomic writes, a lock, pruning only this run's, safe loading."""

from __future__ import annotations

import pickle
import subprocess
import sys
import time

import pytest
import torch
from conftest import PROJECT_ROOT, child_env

from {{ cookiecutter.package_name }}.checkpoint.export import export
from {{ cookiecutter.package_name }}.checkpoint.files import (
    list_checkpoints,
    load_checkpoint,
    unreadable,
    write_file,
)
from {{ cookiecutter.package_name }}.checkpoint.folder import CheckpointDir, Staging
from {{ cookiecutter.package_name }}.checkpoint.resume import pick_checkpoint
from {{ cookiecutter.package_name }}.failures import RunFailure, UsageError


def _state(step: int) -> dict:
    torch.manual_seed(step)
    return {"model": {"w": torch.randn(4, 3)}, "optimizer": {"state": {}, "param_groups": []},
            "step": step, "epoch": 0, "world_size": 1, "config": {"lr": 0.1, "data": None}}


def _dir(path, keep_last=0) -> CheckpointDir:
    folder = CheckpointDir(path, keep_last)
    folder.open()
    return folder


def test_round_trip_with_weights_only(tmp_path):
    folder = _dir(tmp_path, keep_last=3)
    path = folder.save_file(_state(5), step=5)
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    assert loaded["step"] == 5 and loaded["config"] == _state(5)["config"]
    assert torch.equal(loaded["model"]["w"], _state(5)["model"]["w"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", path.name]  # no temp file


def test_keep_last_prunes_only_this_runs_checkpoints(tmp_path):
    old = _dir(tmp_path)
    for step in (4, 8):
        old.save_file(_state(step), step)
    old.close()
    new = _dir(tmp_path, keep_last=1)
    moved = new.set_aside(resumed_from=None)  # a new run: the old one's files move aside
    for step in (1, 2):
        new.save_file(_state(step), step)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt_step00000002.pt"]
    assert sorted(p.name for p in moved.iterdir()) == ["ckpt_step00000004.pt",
                                                       "ckpt_step00000008.pt"]


def test_a_resumed_run_keeps_its_history_and_moves_later_checkpoints(tmp_path):
    folder = _dir(tmp_path)
    for step in (4, 8, 12):
        folder.save_file(_state(step), step)
    moved = folder.set_aside(resumed_from=tmp_path / "ckpt_step00000008.pt")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt_step00000008.pt",
                                                            "ckpt_step00000004.pt"]
    assert [p.name for p in moved.iterdir()] == ["ckpt_step00000012.pt"]


LOCK_HOLDER = """
import sys, time
from {{ cookiecutter.package_name }}.checkpoint.folder import CheckpointDir
folder = CheckpointDir(sys.argv[1], 3)
folder.open()
print("locked", flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="uses a POSIX lock")
def test_a_folder_in_use_is_refused_and_freed_when_its_owner_dies(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(tmp_path)],
                              cwd=PROJECT_ROOT, env=child_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UsageError, match="is in use by a run that is still going .pid"):
            CheckpointDir(tmp_path, 3).open()
    finally:
        holder.kill()
        holder.wait()
    _dir(tmp_path)  # the lock died with its holder: nothing stale


def test_leftover_temp_files_are_cleared_when_the_folder_is_taken(tmp_path):
    (tmp_path / ".ckpt_step00000003.pt.tmp-999").write_bytes(b"half")
    (tmp_path / ".ckpt_step00000004.tmp").mkdir()
    _dir(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]


def test_unreadable_checkpoints_are_skipped_or_refused(tmp_path, capsys):
    folder = _dir(tmp_path)
    folder.save_file(_state(1), 1)
    newest = folder.save_file(_state(2), 2)
    newest.write_bytes(newest.read_bytes()[:100])  # as if killed while copying
    (tmp_path / "ckpt_step00000003.pt").write_bytes(b"")
    (tmp_path / "ckpt_step00000004").mkdir()  # a folder without its metadata
    assert pick_checkpoint("auto", tmp_path).name == "ckpt_step00000001.pt"
    assert capsys.readouterr().err.count("skipping unreadable checkpoint") == 3
    assert pick_checkpoint("never", tmp_path) is None
    assert pick_checkpoint("auto", tmp_path / "missing") is None
    with pytest.raises(UsageError, match="cannot load it .not a checkpoint file"):
        pick_checkpoint(str(newest), tmp_path)
    with pytest.raises(UsageError, match="is a folder of checkpoints, not one; name one of them "
                                         r"\(the newest is .*ckpt_step00000004\)"):
        pick_checkpoint(str(tmp_path), tmp_path)
    with pytest.raises(UsageError, match="a folder without a checkpoint's .metadata"):
        pick_checkpoint(str(tmp_path / "ckpt_step00000004"), tmp_path)


def test_a_sharded_checkpoint_whose_metadata_is_cut_short_is_skipped(tmp_path, capsys):
    """A DCP folder with both its files but a .metadata cut short (as a copy that stopped): not
    resumable, so the resume falls back to the one before; read as opcodes, never unpickled."""
    older, newer = tmp_path / "ckpt_step00000001", tmp_path / "ckpt_step00000002"
    for folder in (older, newer):
        folder.mkdir()
        (folder / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
        (folder / "meta.json").write_text('{"step": 1}')
    (newer / ".metadata").write_bytes((newer / ".metadata").read_bytes()[:10])
    assert "its .metadata is cut short" in unreadable(newer) and unreadable(older) is None
    assert pick_checkpoint("auto", tmp_path) == older
    assert capsys.readouterr().err.count("skipping unreadable checkpoint") == 1


def test_arbitrary_objects_are_never_unpickled(tmp_path):
    path = tmp_path / "ckpt_step00000001.pt"
    torch.save({"model": {}, "payload": object()}, path)
    with pytest.raises(UsageError, match="cannot load it .UnpicklingError"):
        pick_checkpoint(str(path), tmp_path)


def test_a_failed_write_keeps_the_previous_checkpoint_and_says_why(tmp_path):
    folder = _dir(tmp_path)
    good = folder.save_file(_state(1), 1)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(RunFailure, match="cannot write checkpoint .*; free space or choose"):
        write_file(_state(2), tmp_path / "a-file" / "ckpt_step00000002.pt")
    assert list_checkpoints(tmp_path) == [good] and load_checkpoint(good)["step"] == 1


def test_background_save_writes_a_copy_taken_before_training_goes_on(tmp_path):
    folder = _dir(tmp_path)
    live = {"model": {"w": torch.zeros(1000)}, "step": 1}
    copy = Staging().copy(live)
    folder.in_background(lambda: (time.sleep(0.2), folder.save_file(copy, 1)))
    live["model"]["w"].add_(1)  # training changes the weights while the save runs
    folder.wait()
    assert load_checkpoint(tmp_path / "ckpt_step00000001.pt")["model"]["w"].sum() == 0


def test_export_of_a_file_checkpoint(tmp_path):
    folder = _dir(tmp_path)
    path = folder.save_file({**_state(3), "optimizer": {"state": {}}}, 3)
    export(path, tmp_path / "out.pt")
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert set(out) == {"model", "epoch", "step", "world_size", "config", "weights"}
    assert out["weights"] == "raw"  # no EMA in this checkpoint


@pytest.mark.parametrize("output", ["same", "link.pt", "other/ckpt_step00000009.pt",
                                    "ckpt_step00000002/model.pt"])
def test_an_export_onto_its_source_or_a_checkpoint_is_refused(tmp_path, capsys, output):
    from {{ cookiecutter.package_name }}.checkpoint.export import main

    path = _dir(tmp_path).save_file(_state(3), 3)
    before = path.read_bytes()
    (tmp_path / "link.pt").symlink_to(path)
    target = str(path) if output == "same" else str(tmp_path / output)
    assert main(["export", str(path), target]) == 1
    assert capsys.readouterr().err == (f"error: {target}: an export may not replace its source or "
                                       "a checkpoint (ckpt_step...); write it to another file, "
                                       "such as model.pt\n")
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [
        ".lock", path.name, "link.pt"]
