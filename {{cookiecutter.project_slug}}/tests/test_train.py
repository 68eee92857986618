"""End to end: real 2-process gloo jobs through torchrun, checked by the files they leave."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import (
    PROJECT_ROOT,
    assert_same_model,
    child_env,
    ckpt_name,
    final_model,
    load_state,
    ok,
    one_error,
    path_with,
    project_copy,
    read_metrics,
    run_cmd,
    summary,
    torchrun,
)

from {{ cookiecutter.package_name }}.checkpoint.files import list_checkpoints
from {{ cookiecutter.package_name }}.runtime.workarounds import taken_rendezvous

pytestmark = pytest.mark.full  # the slow tier: pytest --full

SMALL = ["--dataset-size", "512", "--batch-size", "16", "--hidden-size", "16"]  # 16 steps an epoch


def test_two_process_training_learns_and_leaves_its_files(workdir):
    result = ok(torchrun([*SMALL, "--epochs", "3", "--log-every", "4"], workdir))
    assert result.stdout.count("world: 2 process") == 1, "only rank 0 logs"

    metrics = read_metrics(workdir / "runs/latest")
    assert metrics[0]["step"] == 4 and metrics[-1]["step"] == 48
    assert metrics[-1]["loss"] < metrics[0]["loss"], "loss did not go down"
    assert len(metrics[0]["peak_mem_mb"]) == 2 and min(metrics[0]["peak_mem_mb"]) > 0

    done = summary(workdir / "runs/latest")
    assert done["world_size"] == 2 and done["backend"] == "gloo" and done["launcher"] == "torchrun"
    assert done["epochs_completed"] == 3 and done["steps"] == 48 and done["resumed_from"] is None
    assert done["final_loss"] == metrics[-1]["loss"] and done["samples_per_s"] > 0
    assert done["checkpoint_saves"] == 3 and done["checkpoint_stall_ms"] > 0
    assert any(key.startswith("val_") for key in done)
    config = (workdir / "runs/latest/config.json").read_text()
    assert '"batch_size": 16' in config

    checkpoints = list_checkpoints(workdir / "checkpoints")
    assert [p.name for p in checkpoints] == [ckpt_name(s) for s in (48, 32, 16)]
    state = load_state(checkpoints[0])
    assert {"model", "optimizer", "epoch", "step", "world_size", "config"} <= state.keys()
    assert state["world_size"] == 2 and state["step"] == 48 and state["epoch"] == 3
    assert not any(key.startswith("module.") for key in state["model"])
    assert state["config"]["batch_size"] == 16
    assert not list((workdir / "checkpoints").glob(".*tmp*")), "temp files left behind"

    # The command again (with another --lr, which it notes): the run is complete; it says so and
    # changes nothing.
    files = {name: (workdir / "runs/latest" / name).read_bytes()
             for name in ("summary.json", "metrics.jsonl")}
    result = ok(torchrun([*SMALL, "--epochs", "3", "--log-every", "4", "--lr", "0.5"], workdir))
    assert "this run is complete: epoch 3 of 3, step 48; raise --epochs or --max-steps, or " \
           "use --resume never to start over" in result.stdout
    assert "note: settings that differ from the checkpoint's run: lr: 0.003 -> 0.5" in \
        result.stdout, result.stdout
    assert " samples/s" not in result.stdout
    assert all((workdir / "runs/latest" / n).read_bytes() == b for n, b in files.items())


def test_named_runs_keep_their_own_files_and_one_resumed_mid_epoch_matches_the_other(workdir):
    """Two runs with --run-name side by side, each with its own outputs and checkpoints: a, never
    interrupted, and b, stopped at step 21 (5 batches into the second epoch, between log steps)
    and resumed from its own checkpoint, not a's newer one. b also checkpoints activations, which
    changes what is kept for the backward, not what it computes: it ends with a's weights."""
    ok(torchrun([*SMALL, "--epochs", "2", "--run-name", "a"], workdir))
    b = [*SMALL, "--epochs", "2", "--run-name", "b", "--activation-checkpointing"]
    ok(torchrun([*b, "--max-steps", "21"], workdir))
    stopped, last_log = summary(workdir / "runs/b"), read_metrics(workdir / "runs/b")[-1]
    assert stopped["steps"] == last_log["step"] == 21
    assert stopped["final_loss"] == last_log["loss"]
    resumed = ok(torchrun(b, workdir))
    assert f"resumed from checkpoints/b/{ckpt_name(21)}" in resumed.stdout
    assert "max_steps: 21 -> 0" in resumed.stdout

    done = summary(workdir / "runs/b")
    assert done["resumed_from"].endswith(ckpt_name(21)) and done["steps"] == 32
    assert [m["step"] for m in read_metrics(workdir / "runs/b")][-2:] == [30, 32]
    untouched = summary(workdir / "runs/a")
    assert untouched["steps"] == 32 and untouched["resumed_from"] is None
    assert [p.name for p in list_checkpoints(workdir / "checkpoints/a")] == \
        [ckpt_name(s) for s in (32, 16)]
    assert [p.name for p in list_checkpoints(workdir / "checkpoints/b")] == \
        [ckpt_name(s) for s in (32, 21, 16)]
    checkpoints = workdir / "checkpoints"
    assert_same_model(final_model(checkpoints / "a"), final_model(checkpoints / "b"))


def test_unreadable_resume_path_is_one_error_line(workdir):
    bad = workdir / "broken.pt"
    bad.write_bytes(b"not a checkpoint")
    line = one_error(torchrun([*SMALL, "--resume", str(bad)], workdir))
    assert f"--resume {bad}" in line and "not a complete checkpoint" not in line


def test_local_script_trains_with_the_chosen_launcher_then_fine_tunes(workdir, bin_dir):
    """The README's script, run from another folder: its relative paths are read from there. Then
    what the script's check refuses in one line within seconds (before any process starts: not
    one per process and restart), the checkpoints untouched: the same command with a wider model,
    which the checkpoint does not fit; and, fine-tuning as a user does it, task.py now giving SGD
    with momentum under the name of the checkpoint's AdamW. `--resume weights-only` then trains
    from the weights."""
    project = project_copy(workdir)
    command = ["bash", str(project / "scripts/train_local.sh"), *SMALL, "--no-progress",
               "--output-dir", "runs", "--checkpoint-dir=ck"]
    env = {"PATH": path_with(bin_dir), "NPROC": "2", "PYTHON": sys.executable,
           "PYTHONPATH": str(project)}
    ok(run_cmd([*command, "--epochs", "1"], workdir, **env))
    done = summary(workdir / "runs")
    assert done["world_size"] == 2 and done["launcher"] == "{{ cookiecutter.launcher }}"
    before = list_checkpoints(workdir / "ck")
    stamps = [path.stat().st_mtime_ns for path in before]
    assert before
    started = time.monotonic()
    result = run_cmd([*command, "--epochs", "1", "--hidden-size", "96"], workdir, **env)
    assert "does not fit the model" in one_error(result) and result.returncode == 1
    assert time.monotonic() - started < 15 and "Traceback" not in result.stderr, result.stderr

    task = project / "{{ cookiecutter.package_name }}/task.py"
    task.write_text(task.read_text() + "\n\ndef configure_optimizer(model, cfg):\n    return "
                    "torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)\n")
    result = run_cmd([*command, "--epochs", "2"], workdir, **env)
    assert ("holds the optimizers (type, schedule) 'default' (AdamW, --lr-schedule); task.py "
            "gives 'default' (SGD, --lr-schedule); use --resume weights-only") in one_error(result)
    assert result.returncode == 1 and "world: " not in result.stdout, result.stdout
    assert [path.stat().st_mtime_ns for path in list_checkpoints(workdir / "ck")] == stamps
    tuned = ok(run_cmd([*command, "--max-steps", "3", "--resume", "weights-only"], workdir,
                       **env)).stdout
    assert f"--resume weights-only: the weights of {before[0]};" in tuned, tuned
    assert summary(workdir / "runs")["steps"] == 3


def test_a_mistake_the_processes_find_ends_the_local_script_at_once(workdir):
    """--max-restarts (3 in the script) is for a lost worker or peer: a mistake every process
    finds (a metric the evaluation does not report) is one line, with no restart and no report of
    the launcher (but of the deprecated torch.distributed.launch)."""
    result = run_cmd(["bash", str(PROJECT_ROOT / "scripts/train_local.sh"), *SMALL, "--epochs",
                      "1", "--no-progress", "--keep-best", "val_nope:max", "--output-dir", "runs",
                      "--checkpoint-dir", "ck"], workdir, PYTHON=sys.executable)
    assert "--keep-best val_nope: the evaluation reports no such metric" in one_error(result)
    assert result.returncode == 1 and result.stdout.count("world: ") == 1, result.stdout
    assert "{{ cookiecutter.launcher }}" == "launch" or "Traceback" not in result.stderr


def test_a_syntax_error_in_task_py_is_pythons_own_lines_from_the_local_script(tmp_path, bin_dir):
    """The script's check imports task.py: a syntax error there is the file, the line and the
    caret as Python gives them, not a traceback through the import machinery; exit 1. So is an
    ImportError or a NameError at its top level (its frame and the error); train.py gives the
    same lines."""
    project = project_copy(tmp_path)
    task = project / "{{ cookiecutter.package_name }}/task.py"
    original = task.read_text()
    line = original.count("\n") + 2
    task.write_text(original + "\ndef broken(:\n    pass\n")
    result = run_cmd(["bash", str(project / "scripts/train_local.sh")], tmp_path,
                     PATH=path_with(bin_dir), PYTHON=sys.executable, PYTHONPATH=str(project))
    said = result.stderr.splitlines()
    assert result.returncode == 1 and result.stdout == "" and "Traceback" not in result.stderr
    assert said[:2] == [f'  File "{task}", line {line}', "    def broken(:"], result.stderr
    assert said[-2].strip() == "^" and said[-1].startswith("SyntaxError: "), result.stderr
    # The same lines from train.py itself, under spawn too (each process imports it).
    spawned = run_cmd([sys.executable, str(project / "train.py"), "--nprocs", "2"], tmp_path,
                      PYTHONPATH=str(project))
    assert spawned.returncode == 1 and spawned.stderr == result.stderr, spawned.stderr
    # An ImportError or a NameError there: the same form, task.py's frame and the error.
    for mistake, error in (("import no_such_module_here", "ModuleNotFoundError: No module named"),
                           ("undefined_name + 1", "NameError: name 'undefined_name'")):
        task.write_text(original + f"\n{mistake}\n")
        result = run_cmd(["bash", str(project / "scripts/train_local.sh")], tmp_path,
                         PATH=path_with(bin_dir), PYTHON=sys.executable, PYTHONPATH=str(project))
        said = result.stderr.splitlines()
        assert result.returncode == 1 and result.stdout == "", result.stderr
        assert said[:2] == [f'  File "{task}", line {line}, in <module>', f"    {mistake}"]
        assert said[-1].startswith(error) and len(said) <= 4, result.stderr  # (a ^^^ line)


def test_a_bad_flag_to_the_local_script_is_one_line_before_any_process_starts(tmp_path, bin_dir):
    """Checked once by the script: not once per process, nor again at each of torchrun's
    restarts (--max-restarts 3), nor under the launcher's own report of a failed child."""
    script = str(PROJECT_ROOT / "scripts/train_local.sh")
    for flag in (["--epochs", "0"], ["--no-such-flag"]):
        result = run_cmd(["bash", script, *flag], tmp_path, PATH=path_with(bin_dir),
                         PYTHON=sys.executable)
        assert result.returncode == 2 and result.stdout == "", result.stdout
        assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, \
            result.stderr


def test_the_scripts_own_variables_are_one_line_naming_the_variable(tmp_path, bin_dir):
    """NPROC and MAX_RESTARTS, checked by the scripts before anything starts (torchrun would end
    in a traceback, or print its usage naming a flag the user never typed)."""
    for script in ("train_local.sh", "train_multinode.sh"):
        args = ["2", "0", "127.0.0.1:1"] if script == "train_multinode.sh" else []
        for name, value in (("NPROC", "0"), ("NPROC", "abc"), ("MAX_RESTARTS", "-1"),
                            ("MAX_RESTARTS", "abc")):
            result = run_cmd(["bash", str(PROJECT_ROOT / "scripts" / script), *args], tmp_path,
                             PATH=path_with(bin_dir), PYTHON=sys.executable, **{name: value})
            assert result.returncode == 2 and result.stdout == "", (script, name, result.stdout)
            assert result.stderr.startswith(f"error: {name}={value}: give ") and \
                result.stderr.count("\n") == 1, result.stderr


def test_the_multinode_scripts_arguments_are_one_line_naming_the_argument(tmp_path, bin_dir):
    """NNODES and NODE_RANK, checked before anything starts: a node rank not below the node count
    trained as "node 1" of 1; zero nodes, or the arguments swapped, ended in a traceback."""
    cases = ((["1", "1", "127.0.0.1:1"], "NODE_RANK=1: give this node's number, 0 to 0"),
             (["0", "0", "127.0.0.1:1"], "NNODES=0: give the number of nodes, 1 or"),
             (["127.0.0.1:1", "2", "0"], "NNODES=127.0.0.1:1: give the number"),
             (["2", "-1", "127.0.0.1:1"], "NODE_RANK=-1: give this node's number, 0 to 1"))
    for args, words in cases:
        result = run_cmd(["bash", str(PROJECT_ROOT / "scripts/train_multinode.sh"), *args],
                         tmp_path, PATH=path_with(bin_dir), PYTHON=sys.executable)
        assert result.returncode == 2 and result.stdout == "", (args, result.stdout)
        assert result.stderr.startswith(f"error: {words}") and result.stderr.count("\n") == 1, \
            result.stderr


def test_an_endpoint_held_by_another_program_is_one_line_at_once(tmp_path, bin_dir, example_task):
    """A program that accepts connections and never answers, on the head's endpoint: torchrun
    would wait minutes for it, and so did the check for a running job's rendezvous (its store
    client). The probe before torchrun (a store answers a PING at once) says so in one line
    within its 2 s, on the head node and on a node that joins it. Once that program has gone
    (nothing listens), the probe lets torchrun wait for its head as usual, at once."""
    script = str(PROJECT_ROOT / "scripts/train_multinode.sh")
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen(4)  # connections complete in the backlog; nothing is ever sent back
        endpoint = f"127.0.0.1:{other.getsockname()[1]}"
        for nodes, rank in (("1", "0"), ("2", "1")):
            started = time.monotonic()
            result = run_cmd(["bash", script, nodes, rank, endpoint, "--timeout-s", "30"],
                             tmp_path, PATH=path_with(bin_dir), PYTHON=sys.executable,
                             timeout=60)
            assert time.monotonic() - started < 30
            assert result.returncode == 1 and one_error(result).startswith(
                f"error: {endpoint} is held by a program that is not a torchrun rendezvous; ")
            assert "Traceback" not in result.stderr
    started = time.monotonic()
    assert taken_rendezvous(endpoint, "gone", "127.0.0.1") is None
    assert time.monotonic() - started < 5


def test_a_running_jobs_endpoint_refuses_a_second_job_and_a_node_too_many(tmp_path, bin_dir,
                                                                          example_task):
    """A 1-node job trains at an endpoint; a second job there (another folder), and a node rank 1
    of 2 aimed at it, are each one line at once, where each waited silently (a spare for that
    job's next round) until torchrun's own timeouts; so is a job of another rendezvous id there,
    which ran its rendezvous on the running job's store. The running job trains on,
    undisturbed, and saves at its SIGTERM."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{free.getsockname()[1]}"
    script = str(PROJECT_ROOT / "scripts/train_multinode.sh")
    env = {"PATH": path_with(bin_dir), "NPROC": "1", "RDZV_ID": "taken", "PYTHON": sys.executable}
    (tmp_path / "a").mkdir()
    running = subprocess.Popen(["bash", script, "1", "0", endpoint, "--epochs", "100000",
                                "--no-progress", "--checkpoint-dir", "ck"], cwd=tmp_path / "a",
                               env=child_env(**env), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while taken_rendezvous(endpoint, "taken", "127.0.0.1") is None:
            assert running.poll() is None and time.monotonic() < deadline, running.stderr.read()
            time.sleep(1)
        for args in (["1", "0", endpoint], ["2", "1", endpoint]):
            started = time.monotonic()
            result = run_cmd(["bash", script, *args, "--timeout-s", "30"], tmp_path, timeout=60,
                             **env)
            assert time.monotonic() - started < 30
            assert result.returncode == 1 and one_error(result).startswith(
                f"error: the rendezvous at {endpoint} (id taken) is taken: a running job of 1 "
                "node(s) on 127.0.0.1 started there already; give this job another port")
        result = run_cmd(["bash", script, "1", "0", endpoint], tmp_path, timeout=60,
                         **{**env, "RDZV_ID": "mine"})
        assert result.returncode == 1 and one_error(result).startswith(
            f"error: {endpoint} is another job's: a torch store answers there without "
            "rendezvous id mine; give this job another port")
        assert running.poll() is None, "the running job was not disturbed"
    finally:
        running.send_signal(signal.SIGTERM)
        out, err = running.communicate(timeout=60)
    assert running.returncode == 143 and "checkpoint saved" in out + err, err
    assert out.count("world: 1 process") == 1, out  # its workers started once: no new round
