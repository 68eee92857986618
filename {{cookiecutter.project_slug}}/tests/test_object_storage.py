"""Checkpoints in object storage (`--checkpoint-dir s3://...`), against a real S3 API server on
loopback (moto's server mode, tests/s3server.py): lose the machine and resume elsewhere, kills in
the middle of an upload, preemption, retention, failing uploads, and every start-up error."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    TRAIN,
    assert_same_model,
    child_env,
    descendants,
    final_model,
    needs_numpy,
    ok,
    one_error,
    python_train,
    run_cmd,
    torchrun,
    torchrun_cmd,
)

pytestmark = [
    pytest.mark.recovery,
    pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("s3fs", "moto", "boto3")),
                       reason="needs s3fs and moto's server: pip install -e '.[dev]'"),
]

# 8 steps an epoch, 32 in all, a checkpoint every 8 steps.
FLAGS = ["--dataset-size", "256", "--batch-size", "16", "--epochs", "4", "--hidden-size", "64",
         "--save-every-steps", "8", "--log-every", "2"]
LAST_STEP = 32
FILES = ["--model-layout", "data_parallel"]  # checkpoints as .pt files, in every bake
PACKAGE = "{{ cookiecutter.package_name }}"


@pytest.fixture(scope="module")
def s3():
    from s3server import S3Server

    server = S3Server()
    yield server
    server.close()


def checkpoints(fs, prefix: str) -> list[str]:
    """Names under `prefix` of the bucket, sorted."""
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"bkt/{prefix}", detail=False)) \
        if fs.exists(f"bkt/{prefix}") else []


def bucket_model(s3, url: str, cwd: Path) -> dict:
    """The newest checkpoint's model under `url`, exported from the bucket to a local file."""
    from {{ cookiecutter.package_name }}.checkpoint.files import load_checkpoint

    newest = max(n for n in checkpoints(s3.fs(), url[9:]) if n.startswith("ckpt_step"))
    out = cwd / "exported.pt"
    ok(run_cmd([sys.executable, "-m", f"{PACKAGE}.checkpoint", "export", f"{url}/{newest}",
                str(out)], cwd, **s3.env()))
    return load_checkpoint(out)["model"]


def killed_mid_upload(s3, command: list[str], cwd: Path, hold: str):
    """Run `command` under torchrun through a proxy that holds the upload whose path has `hold`,
    and kill the whole job at once while it waits, as a machine is lost: torchrun and every
    process below it (its workers have sessions of their own: left alone, the one held in its
    upload ends 25 s later, outside the reach of a signal to torchrun's process group)."""
    from s3server import Proxy

    proxy = Proxy(("127.0.0.1", s3.port), hold_word=hold)
    job = subprocess.Popen([*torchrun_cmd(2), TRAIN, "--no-progress", *command], cwd=cwd,
                           env=child_env(**s3.env(proxy.endpoint)), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proxy.held.wait(120), job.communicate(timeout=60)
        for pid in [job.pid, *descendants(job.pid)]:  # listed first, then killed
            with contextlib.suppress(ProcessLookupError):  # (a helper may end with its parent)
                os.kill(pid, signal.SIGKILL)
        return subprocess.CompletedProcess(command, -9, *job.communicate(timeout=60))
    finally:
        proxy.close()


def assert_no_secret(s3, outputs: list, folder: Path, prefix: str) -> None:
    """Secrets stay secret: not in any output, file or object the runs left."""
    fs = s3.fs()
    for secret in (s3.secret, s3.key_id):
        for result in outputs:
            assert secret not in result.stdout + result.stderr
        for path in folder.rglob("*"):
            assert not path.is_file() or secret.encode() not in path.read_bytes(), path
        for key in fs.find(f"bkt/{prefix}"):
            assert secret.encode() not in fs.cat_file(key), key


# One job a layout, on the first machine: the proxy holds the upload that would complete step 16's
# checkpoint (the file itself, or the folder's meta.json), and the whole job is killed while it
# waits, as the machine is lost. A second machine resumes from the bucket and finishes with an
# uninterrupted run's bits, keeping the last 2. data_parallel saves in the background here, fsdp in
# the foreground (the failing-upload test below uploads in the other two ways, with no resume).
@pytest.mark.parametrize("layout, extra", [("data_parallel", ["--async-save"]),
                                           pytest.param("fsdp", [], marks=needs_numpy)],
                         ids=["data_parallel-async", "fsdp"])
def test_a_machine_lost_mid_upload_resumes_elsewhere_from_the_previous_checkpoint(
        tmp_path, example_task, s3, layout, extra, monkeypatch):
    from {{ cookiecutter.package_name }}.checkpoint import folder as checkpoint_folder
    from {{ cookiecutter.package_name }}.checkpoint.files import is_complete, list_checkpoints

    flags = [*FLAGS, "--model-layout", layout, *extra]
    reference = tmp_path / "reference"
    reference.mkdir()
    ok(torchrun([*flags, "--keep-last", "0"], reference))
    expected = final_model(reference / "checkpoints")

    url = f"s3://bkt/{layout}{''.join(extra)}/run"
    prefix = url[9:]  # under the bucket
    first, second = tmp_path / "first-machine", tmp_path / "second-machine"
    first.mkdir()
    second.mkdir()
    command = [*flags, "--checkpoint-dir", url, "--keep-last", "2"]
    hold = "ckpt_step00000016" + ("/meta.json" if layout == "fsdp" else ".pt")
    outputs = [killed_mid_upload(s3, command, first, hold)]
    fs = s3.fs()
    if layout == "fsdp":  # shards and DCP's .metadata, but not our meta.json
        assert checkpoints(fs, prefix) == ["ckpt_step00000008", "ckpt_step00000016"]
        assert ".metadata" in checkpoints(fs, f"{prefix}/ckpt_step00000016")
        assert "meta.json" not in checkpoints(fs, f"{prefix}/ckpt_step00000016")
    else:
        assert checkpoints(fs, prefix) == ["ckpt_step00000008.pt"]
    shutil.rmtree(first)  # the machine is gone, and every file it had

    (second / "tmp").mkdir()  # where the checkpoint it resumes from is downloaded, then deleted
    outputs.append(ok(torchrun(command, second, TMPDIR=str(second / "tmp"), **s3.env())))
    assert f"resumed from {url}/ckpt_step00000008" in outputs[1].stdout, outputs[1].stdout
    assert not list((second / "tmp").glob("ckpt-download-*")), "a download left behind"
    if layout == "fsdp":  # the unfinished folder was skipped, then replaced by a complete one
        assert "skipping unreadable checkpoint" in outputs[1].stderr
    kept = [n for n in checkpoints(fs, prefix) if n.startswith("ckpt_step")]
    assert kept == ["ckpt_step00000024" + ("" if layout == "fsdp" else ".pt"),
                    "ckpt_step00000032" + ("" if layout == "fsdp" else ".pt")], kept
    assert_same_model(expected, bucket_model(s3, url, tmp_path))
    assert_no_secret(s3, outputs, second, prefix)

    if layout == "fsdp":  # an unfinished folder is removed once it is old: "old" by STALE_S = 0
        fs.rm(f"bkt/{prefix}/ckpt_step00000024/meta.json")
        monkeypatch.setattr(checkpoint_folder, "STALE_S", 0)
        for key, value in s3.env().items():
            monkeypatch.setenv(key, value)
        checkpoint_folder.CheckpointDir(url, 0).open()
        assert not fs.exists(f"bkt/{prefix}/ckpt_step00000024")
        assert all(is_complete(p) for p in list_checkpoints(url))


def test_sigterm_saves_to_the_bucket_before_the_process_leaves(tmp_path, example_task, s3):
    url = "s3://bkt/preempted"
    flags = [*FLAGS, "--epochs", "400", "--checkpoint-dir", url, "--save-every-steps", "0",
             "--save-every", "0", "--output-dir", "out", *FILES]
    job = subprocess.Popen([*torchrun_cmd(2), TRAIN, "--no-progress", *flags], cwd=tmp_path,
                           env=child_env(**s3.env()), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    metrics = tmp_path / "out" / "metrics.jsonl"
    while not metrics.is_file() or len(metrics.read_text().splitlines()) < 3:
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.05)
    os.kill(job.pid, signal.SIGTERM)  # what a spot machine's shutdown sends
    out, err = job.communicate(timeout=120)
    assert "stopped by SIGTERM at step" in out, err
    stopped_at = int(out.split("stopped by SIGTERM at step ")[1].split(":")[0])
    assert f"checkpoint saved in {url}" in out
    assert checkpoints(s3.fs(), url[9:]) == [f"ckpt_step{stopped_at:08d}.pt"]

    # --resume and scripts/predict.py take a checkpoint's URL too.
    saved = f"{url}/ckpt_step{stopped_at:08d}.pt"
    result = ok(run_cmd([sys.executable, TRAIN, "--no-progress", *flags, "--eval-only",
                         "--resume", saved], tmp_path, **s3.env()))
    assert f"evaluation of {saved} (step {stopped_at})" in result.stdout
    # (predict.py given a URL where nothing is stored: test_a_url_where_nothing_is_stored_...)


@pytest.mark.parametrize("layout, extra", [("data_parallel", []),
                                           ("data_parallel", ["--async-save"]),
                                           pytest.param("fsdp", ["--async-save"],
                                                        marks=needs_numpy)])
def test_an_upload_that_keeps_failing_stops_the_run_naming_the_newest_complete_checkpoint(
        tmp_path, example_task, s3, layout, extra):
    """Storage that refuses the second checkpoint's writes: one line naming the first (with
    --async-save a thread writes: no thread traceback either)."""
    from s3server import Proxy

    url = f"s3://bkt/failing-{layout}{len(extra)}"  # apart: a run resumes from what is there
    proxy = Proxy(("127.0.0.1", s3.port), refuse_word="ckpt_step00000016")
    try:
        started = time.monotonic()
        result = torchrun([*FLAGS, "--checkpoint-dir", url, "--model-layout", layout, *extra],
                          tmp_path, **s3.env(proxy.endpoint))
        took = time.monotonic() - started
    finally:
        proxy.close()
    line = one_error(result)
    assert "Exception in thread" not in result.stderr, result.stderr  # (torchrun's own remains)
    first = "ckpt_step00000008" + (".pt" if layout == "data_parallel" else "")
    newest = line.split("the newest complete checkpoint is ")[1].split()[0].rstrip(".;,")
    assert newest == f"{url}/{first}", line
    if layout == "data_parallel":
        assert "cannot upload checkpoint" in line and "after 3 tries" in line, line
    else:  # the storage's own words, not DCP's wrapper (issue 55), and what to do
        assert "CheckpointException" not in line and "storage works" in line, line
    assert proxy.refused >= (3 if layout == "data_parallel" else 1) and took < 120
    assert [c for c in checkpoints(s3.fs(), url[9:]) if "00000016" not in c] == [first]


def in_process(monkeypatch, call, **env: str) -> str:
    """The UsageError `call()` raises in this process with these variables set (a new s3fs
    filesystem sees them)."""
    import s3fs

    from {{ cookiecutter.package_name }}.failures import UsageError

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        with pytest.raises(UsageError) as error:
            call()
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    return str(error.value)


def test_start_up_errors_are_one_line_before_training(tmp_path, example_task, s3, monkeypatch):
    """Two real runs show a failing write probe is one line before training (a missing bucket
    under torchrun, a silent server under python); the probe's other diagnoses are checked here
    in this process, against the same real servers."""
    from s3server import S3Server, free_port

    from {{ cookiecutter.package_name }}.checkpoint.folder import probe
    from {{ cookiecutter.package_name }}.checkpoint.storage import RemotePath

    def run(url: str, timeout_s: int = 60, launch=python_train, **env: str) -> str:
        """The probe is rank 0's: one process shows it (one case under torchrun, with 2)."""
        started = time.monotonic()
        result = launch([*FLAGS, "--checkpoint-dir", url, "--timeout-s", str(timeout_s)],
                        tmp_path, timeout=120, **env)
        line = one_error(result)
        assert "loss" not in result.stdout, "trained before the error"
        assert time.monotonic() - started < timeout_s + 15  # start-up, then the probe's wait
        return line

    def probed(url: str, **env: str) -> str:
        """The write probe's error, as a run with the default --timeout-s 60 makes it."""
        return in_process(monkeypatch, lambda: probe(RemotePath(url), 30), **env)

    assert "no such bucket 'nobucket'" in run("s3://nobucket/run", launch=torchrun, **s3.env())
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert "cannot reach the endpoint" in probed("s3://bkt/run", **s3.env(closed))
    with socket.socket() as silent:  # a server that takes the connection and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        assert "the storage did not answer within 6 s" in run("s3://bkt/run", timeout_s=12,
                                                               **s3.env(endpoint))
    guarded = S3Server(users={"reader": ["s3:GetObject", "s3:ListBucket"]})
    try:
        reader = {**guarded.env(), "AWS_ACCESS_KEY_ID": guarded.keys["reader"][0],
                  "AWS_SECRET_ACCESS_KEY": guarded.keys["reader"][1]}
        assert "cannot write there (AccessDenied" in probed("s3://bkt/run", **reader)
        wrong = {**reader, "AWS_ACCESS_KEY_ID": "AKIANOSUCHKEY0000000"}
        assert "the credentials were refused (InvalidAccessKeyId" in probed("s3://bkt/run",
                                                                            **wrong)
    finally:
        guarded.close()


def test_a_url_where_nothing_is_stored_is_one_line(tmp_path, example_task, s3, monkeypatch):
    """A --resume URL, or a checkpoint given to predict.py, where nothing is stored: a file and a
    prefix, each once as a real run of one program and once in this process (the function the
    other program calls)."""
    from {{ cookiecutter.package_name }}.checkpoint.export import model_and_meta
    from {{ cookiecutter.package_name }}.checkpoint.resume import pick_checkpoint
    from {{ cookiecutter.package_name }}.checkpoint.storage import location

    file, prefix = "s3://bkt/nothing/ckpt_step00000008.pt", "s3://bkt/nothing"
    line = one_error(python_train([*FLAGS, "--resume", file], tmp_path, **s3.env()))
    assert f"--resume {file}: nothing is stored at that URL; name a checkpoint" in line, line
    result = run_cmd([sys.executable, str(Path(TRAIN).parent / "scripts/predict.py"), prefix,
                      "1"], tmp_path, **s3.env())
    assert f"{prefix}: nothing is stored at that URL" in one_error(result)
    assert f"--resume {prefix}: nothing is stored at that URL; name a checkpoint" in \
        in_process(monkeypatch, lambda: pick_checkpoint(prefix, "checkpoints"), **s3.env())
    assert f"{file}: nothing is stored at that URL" in in_process(  # predict.py's loading
        monkeypatch, lambda: model_and_meta(location(file)), **s3.env())


def test_url_mistakes_are_one_line(tmp_path, example_task, monkeypatch, capsys):
    """Found while parsing the flags: `main` runs here instead of in a new Python (the same code
    path, without the second it takes to import torch), as test_mistakes' bad flags do."""
    from {{ cookiecutter.package_name }}.main import main

    def error(url: str) -> str:
        with pytest.raises(SystemExit) as exit_:
            main(["--checkpoint-dir", url])
        captured = capsys.readouterr()
        result = subprocess.CompletedProcess(["main"], exit_.value.code, captured.out,
                                             captured.err)
        assert result.returncode == 2, result.stderr
        assert "secret" not in result.stderr and "token=x" not in result.stderr
        return one_error(result)

    monkeypatch.chdir(tmp_path)
    cases = {
        "s3://key:secret@bkt/run": "credentials do not go in the URL",
        "s3://bkt/run?token=x": "credentials do not go in the URL",
        "nosuch://bkt/run": "unknown storage scheme nosuch://",
        "s3:///run": "no bucket",
    }
    for url, expected in cases.items():
        assert expected in error(url)
    monkeypatch.setitem(sys.modules, "s3fs", None)  # as if it were not installed
    assert 's3:// needs s3fs: pip install s3fs (the project\'s extra: pip install -e ".[s3]")' \
        in error("s3://bkt/run")


@pytest.mark.network
def test_a_storage_host_that_vanishes_ends_every_wait_within_the_timeout(tmp_path, example_task,
                                                                         hosts):
    """moto's server on test host 1, training on host 0. At start-up the endpoint is an address
    on the LAN that no host holds: the write probe gives up within its share of --timeout-s.
    Mid-run host 1 drops off the network after the first checkpoint: the next upload gives up
    within --timeout-s, naming the checkpoint that is complete, and no process is left."""
    from hosts import UNUSED_ADDRESS
    from s3server import S3Server

    server = S3Server(host=hosts[1])
    try:
        flags = ["--no-progress", *FLAGS, "--checkpoint-dir", "s3://bkt/vanishing",
                 "--timeout-s", "12", "--output-dir", str(tmp_path / "out"), *FILES]
        cmd = [*torchrun_cmd(2), TRAIN, *flags]
        started = time.monotonic()
        result = hosts[0].run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                              env=child_env(**server.env(f"http://{UNUSED_ADDRESS}:5000")))
        assert "the storage did not answer within 6 s" in one_error(result)
        assert time.monotonic() - started < 60

        job = hosts[0].popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=child_env(**server.env()))
        metrics = tmp_path / "out" / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not metrics.is_file() or '"step": 10,' not in metrics.read_text():
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.05)
        hosts[1].link("down")  # the storage's host is gone
        out, err = job.communicate(timeout=120)
        line = one_error(subprocess.CompletedProcess(cmd, job.returncode, out, err))
        assert "cannot upload checkpoint s3://bkt/vanishing/ckpt_step00000016.pt" in line, line
        assert "the newest complete checkpoint is s3://bkt/vanishing/ckpt_step00000008.pt" in line
        assert hosts[0].pids() == [], "a process was left behind"
    finally:
        server.close()
