"""Fault tolerance with torchft, for real: a lighthouse and replica groups of 2 processes each,
every one a torchrun job of train_ft.py. Needs torchft (`pip install -e ".[ft]"`); the ones that
start groups are in the slow tier (`pytest --full`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    PROJECT_ROOT,
    child_env,
    descendants,
    load_state,
    one_error,
    read_metrics,
    run_cmd,
    torchrun_cmd,
)

from {{ cookiecutter.package_name }}.checkpoint.files import list_checkpoints
from {{ cookiecutter.package_name }}.failures import UsageError
from {{ cookiecutter.package_name }}.replica_groups import Replicas
from {{ cookiecutter.package_name }}.runtime.environments import World, find_free_port

TRAIN = str(PROJECT_ROOT / "train.py")
TRAIN_FT = str(PROJECT_ROOT / "train_ft.py")
HEARTBEAT_S = 3.0  # the lighthouse's heartbeat timeout in these tests
# A small model and many short steps: groups must still be training when the killed one is back.
FLAGS = ["--no-progress", "--dataset-size", "512", "--hidden-size", "16", "--batch-size", "16",
         "--val-fraction", "0", "--epochs", "100000", "--log-every", "20", "--timeout-s", "10",
         "--save-every", "0", "--save-every-steps", "50", "--step-times", "steps.json"]

needs_torchft = pytest.mark.skipif(
    shutil.which("torchft_lighthouse", path=os.path.dirname(sys.executable)) is None,
    reason='needs torchft: pip install -e ".[ft]"')


def test_replica_settings_come_from_the_environment():
    env = {"TORCHFT_LIGHTHOUSE": "http://lh:29510", "REPLICA_GROUP_ID": "1",
           "NUM_REPLICA_GROUPS": "3"}
    replicas = Replicas.from_env(env)
    assert (replicas.group, replicas.groups, replicas.min_replicas) == (1, 3, 1)
    # Group 1 of 3, rank 1 of 2: share 3 of 6 (the groups split the data, then their ranks).
    assert replicas.share(World(1, 1, 2, 2, "torchrun")) == (3, 6)
    for bad, words in [({"TORCHFT_LIGHTHOUSE": ""}, "TORCHFT_LIGHTHOUSE is not set"),
                       ({"REPLICA_GROUP_ID": "3"}, "REPLICA_GROUP_ID 3 is not below"),
                       ({"REPLICA_GROUP_ID": "x"}, "REPLICA_GROUP_ID=x is not a whole number"),
                       ({"REPLICA_GROUP_ID": "0", "NUM_REPLICA_GROUPS": "0"},
                        "NUM_REPLICA_GROUPS=0: there must be at least one replica group")]:
        with pytest.raises(UsageError, match=words):
            Replicas.from_env({**env, **bad})
    # HOST:PORT gets its http:// (torchft would wait out every timeout without it).
    for given, used in [("lh:29510", "http://lh:29510"), ("http://lh:29510/", "http://lh:29510"),
                        ("[::1]:29510", "http://[::1]:29510")]:
        assert Replicas.from_env({**env, "TORCHFT_LIGHTHOUSE": given}).lighthouse == used
    for bad in ["lh", "http://lh", "https://lh:29510", "lh:port", "http://:29510", "lh:1/x", "a b"]:
        with pytest.raises(UsageError, match=f"TORCHFT_LIGHTHOUSE={re.escape(bad)} is not a "
                                             "lighthouse address: write http://HOST:PORT"):
            Replicas.from_env({**env, "TORCHFT_LIGHTHOUSE": bad})


# The refusals below come before any process group: one process shows them.
def test_without_torchft_the_error_gives_the_install_command(tmp_path):
    shadow = tmp_path / "shadow" / "torchft"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named torchft')\n")
    result = run_cmd([sys.executable, TRAIN_FT, "--no-progress"], tmp_path, timeout=120,
                     PYTHONPATH=f"{shadow.parent}{os.pathsep}{PROJECT_ROOT}",
                     TORCHFT_LIGHTHOUSE="http://127.0.0.1:9", REPLICA_GROUP_ID="0",
                     NUM_REPLICA_GROUPS="2")
    assert 'torchft is not installed: pip install -e ".[ft]"' in one_error(result)


def test_torch_26_is_one_line_naming_torchfts_floor(monkeypatch):
    """torchft 0.2 requires torch 2.7: on 2.6 (here pretended), one line before any work."""
    from torch.torch_version import TorchVersion

    from {{ cookiecutter.package_name }}.replica_groups import start_manager

    monkeypatch.setattr(torch, "__version__", TorchVersion("2.6.0+cu124"))
    with pytest.raises(UsageError, match=r"torchft needs torch 2.7 or later .* not torch 2.6.0"):
        start_manager(None, None, "gloo", torch.device("cpu"), 5)


def test_train_py_refuses_a_replica_groups_variables(tmp_path):
    """train.py would train an ordinary job without torchft: refused before anything starts."""
    result = run_cmd([sys.executable, TRAIN, "--no-progress"], tmp_path, timeout=120,
                     REPLICA_GROUP_ID="0")
    assert one_error(result) == ("error: REPLICA_GROUP_ID set, but train.py trains without "
                                 "torchft: start a replica group with train_ft.py "
                                 "(scripts/train_ft.sh group), or unset it for a plain run")
    result = run_cmd([*torchrun_cmd(2), TRAIN, "--no-progress"], tmp_path, timeout=120,
                     TORCHFT_LIGHTHOUSE="http://127.0.0.1:9", REPLICA_GROUP_ID="1")
    assert "REPLICA_GROUP_ID and TORCHFT_LIGHTHOUSE set" in one_error(result)
    assert "world:" not in result.stdout  # refused before the process group


def test_a_malformed_lighthouse_address_is_one_line_at_once(tmp_path):
    started = time.monotonic()
    result = run_cmd([sys.executable, TRAIN_FT, "--no-progress"], tmp_path, timeout=120,
                     TORCHFT_LIGHTHOUSE="localhost", REPLICA_GROUP_ID="0", NUM_REPLICA_GROUPS="2")
    assert one_error(result) == ("error: TORCHFT_LIGHTHOUSE=localhost is not a lighthouse "
                                 "address: write http://HOST:PORT, e.g. http://localhost:29510")
    assert time.monotonic() - started < 60  # start-up only, not the default --timeout-s 300


def test_powersgd_is_refused_in_replica_groups(tmp_path):
    result = run_cmd([sys.executable, TRAIN_FT, "--no-progress", "--comm-hook", "powersgd"],
                     tmp_path, timeout=120, TORCHFT_LIGHTHOUSE="http://127.0.0.1:9",
                     REPLICA_GROUP_ID="0", NUM_REPLICA_GROUPS="2")
    assert "train_ft.py does not take --comm-hook powersgd" in one_error(result)


class Lighthouse:
    """torchft's lighthouse on a free port, here or on a test host."""

    def __init__(self, workdir: Path, min_replicas: int = 1, host: Any = None,
                 start: bool = True) -> None:
        self.port, self.min_replicas, self.host = find_free_port(), min_replicas, host
        self.address = f"http://{host.address if host else '127.0.0.1'}:{self.port}"
        self.log = workdir / "lighthouse.log"
        self.process: subprocess.Popen | None = None
        if start:
            self.start()

    def start(self) -> None:
        binary = shutil.which("torchft_lighthouse", path=os.path.dirname(sys.executable))
        self.process = (self.host.popen if self.host else subprocess.Popen)(
            [binary, "--bind", f"[::]:{self.port}", "--min_replicas", str(self.min_replicas),
             "--heartbeat_timeout_ms", str(int(HEARTBEAT_S * 1000)), "--join_timeout_ms",
             "3000"], stdout=self.log.open("w"), stderr=subprocess.STDOUT)

    def stop(self) -> None:
        if self.process:
            self.process.kill()
            self.process.wait()


class Group:
    """One replica group: torchrun with 2 processes of train_ft.py, in a session of its own so
    that a test can kill all of it at once; its output goes to a file the test can watch."""

    def __init__(self, workdir: Path, index: int, lighthouse: Lighthouse, *extra: str,
                 min_replicas: int = 1, host: Any = None, flags: list[str] = FLAGS) -> None:
        self.index, self.workdir, self.host = index, workdir, host
        self.output_dir = workdir / f"runs/group{index}"
        self.checkpoints = workdir / f"checkpoints/group{index}"
        self.log = workdir / f"group{index}.log"
        self.runs = 0
        self.args = [*torchrun_cmd(2), TRAIN_FT, *flags, "--output-dir", str(self.output_dir),
                     "--checkpoint-dir", str(self.checkpoints), *extra]
        self.env = child_env(TORCHFT_LIGHTHOUSE=lighthouse.address, REPLICA_GROUP_ID=str(index),
                             NUM_REPLICA_GROUPS="2", TORCHFT_MIN_REPLICAS=str(min_replicas))
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # the project finds it
            self.env.pop(name, None)
        self.start()

    def start(self) -> None:
        self.runs += 1
        out = self.log.with_suffix(f".{self.runs}.log").open("w")
        self.process = (self.host.popen if self.host else subprocess.Popen)(
            self.args, cwd=self.workdir, env=self.env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)

    def output(self) -> str:
        return self.log.with_suffix(f".{self.runs}.log").read_text()

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.output())
            if found:
                return found
            assert self.process.poll() is None, f"group {self.index} ended:\n{self.output()}"
            time.sleep(0.05)
        raise AssertionError(f"group {self.index}: no {pattern!r} in\n{self.output()}")

    def kill(self) -> None:
        """SIGKILL to every process of the group at once, as when its host is lost. (torchrun
        starts each worker in a session of its own: killing the agent's alone would let the
        workers see their launcher gone, save and leave in good order.)"""
        for pid in [*descendants(self.process.pid), self.process.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()

    def finish(self, timeout: float = 300) -> str:
        code = self.process.wait(timeout)
        assert code == 0, f"group {self.index} exited with {code}:\n{self.output()}"
        return self.output()

    def final_weights(self) -> dict[str, torch.Tensor]:
        return load_state(list_checkpoints(self.checkpoints)[0])["model"]

    def step_gaps(self) -> list[float]:
        ends = json.loads((self.workdir / "steps.json").read_text())["step_ends"]
        return [b - a for a, b in zip(ends, ends[1:], strict=False)]


@pytest.fixture
def groups(tmp_path):
    """Start a lighthouse and groups; whatever is left is stopped at the end."""
    started: list = []

    def start(*extra: str, min_replicas: int = 1) -> tuple[Lighthouse, Group, Group]:
        lighthouse = Lighthouse(tmp_path, min_replicas)
        workdirs = [tmp_path / f"g{i}" for i in range(2)]
        for workdir in workdirs:
            workdir.mkdir(exist_ok=True)
        pair = [Group(workdirs[i], i, lighthouse, *extra, min_replicas=min_replicas)
                for i in range(2)]
        started.extend([lighthouse, *pair])
        return lighthouse, pair[0], pair[1]

    yield start
    for thing in started:
        if isinstance(thing, Group) and thing.process.poll() is None:
            thing.kill()
        elif isinstance(thing, Lighthouse):
            thing.stop()


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.full
@needs_torchft
def test_a_lost_group_leaves_the_other_training_and_heals_when_started_again(groups,
                                                                             example_task):
    lighthouse, first, second = groups("--max-steps", "2500")
    first.wait_for(r"step [1-9]\d\d+ loss")  # both groups are past step 100
    second.kill()
    at_kill = max(int(step) for step in re.findall(r"step (\d+) loss", first.output()))
    first.wait_for(r"step \d+: 1 replica group\(s\) taking part")
    second.start()
    healed = int(second.wait_for(r"healed from a live replica group: .* step (\d+)").group(1))
    first.wait_for(r"step \d+: 2 replica group\(s\) taking part", timeout=60)
    out_first, out_second = first.finish(), second.finish()

    # The survivor paused once, for about the heartbeat timeout, and never restarted.
    gaps = first.step_gaps()
    assert max(gaps) <= HEARTBEAT_S + 2.0, f"longest pause {max(gaps):.1f} s"
    assert "resumed from" not in out_first
    # Its loss kept falling, alone and after the other group came back.
    losses = [r["loss"] for r in read_metrics(first.output_dir) if r["step"] >= at_kill]
    assert losses[-1] < losses[0], losses
    # The healed group took the live state: the same final weights, bit for bit.
    assert "done: 2500 steps" in out_first and "done: 2500 steps" in out_second
    assert same(first.final_weights(), second.final_weights())
    print(f"\ngroup 1 killed at step {at_kill}, healed at step {healed}; longest pause of "
          f"group 0: {max(gaps):.2f} s (heartbeat timeout {HEARTBEAT_S:.0f} s)")


@pytest.mark.full
@needs_torchft
def test_every_group_killed_resumes_from_its_checkpoint_exactly(groups, tmp_path, example_task):
    # Two groups in every step (min 2), so a run's result does not depend on timing.
    _, first, second = groups("--max-steps", "300", min_replicas=2)
    first.finish(), second.finish()
    reference = first.final_weights()
    assert same(reference, second.final_weights())

    for folder in (tmp_path / "g0", tmp_path / "g1"):
        shutil.rmtree(folder)
    _, first, second = groups("--max-steps", "300", min_replicas=2)
    first.wait_for(r"step (1[4-9]\d|2\d\d) loss")  # past the checkpoint of step 100
    first.kill(), second.kill()
    first.start(), second.start()
    resumed = [group.wait_for(r"resumed from \S+ \(.* step (\d+)\)").group(1)
               for group in (first, second)]
    first.finish(), second.finish()
    assert all(int(step) >= 100 for step in resumed), resumed
    assert same(first.final_weights(), reference)
    assert same(second.final_weights(), reference)


@pytest.mark.full
@needs_torchft
def test_groups_that_meet_with_other_weights_at_one_step_end_with_one_model(groups, tmp_path,
                                                                           example_task):
    """A split job: each group under a lighthouse of its own trains alone to step 20 (other data,
    so other weights). Under one lighthouse they meet at the same step, where torchft heals no
    one (it heals a group that is behind); the groups compare their state every
    --check-replicas-every steps, take the first group's, and end with one model."""
    apart = []
    try:
        for i in range(2):
            (tmp_path / f"g{i}").mkdir()
            apart.append(Lighthouse(tmp_path / f"g{i}"))
            apart.append(Group(tmp_path / f"g{i}", i, apart[-1], "--max-steps", "20"))
        for group in apart[1::2]:
            group.finish()
    finally:
        for thing in apart:
            if isinstance(thing, Lighthouse):
                thing.stop()
            elif thing.process.poll() is None:
                thing.kill()
    assert not same(apart[1].final_weights(), apart[3].final_weights())
    _, first, second = groups("--max-steps", "40", "--check-replicas-every", "10",
                              min_replicas=2)
    out = first.finish() + second.finish()
    assert out.count("resumed from") == 2
    assert "the replica groups had different weights (they trained apart)" in out
    assert same(first.final_weights(), second.final_weights())


@pytest.mark.full
@needs_torchft
def test_an_unreachable_lighthouse_is_one_error_line_within_the_timeout(tmp_path):
    started = time.monotonic()
    address = f"http://127.0.0.1:{find_free_port()}"
    result = run_cmd([*torchrun_cmd(2), TRAIN_FT, "--no-progress", "--timeout-s", "5"], tmp_path,
                     timeout=120, TORCHFT_LIGHTHOUSE=address, REPLICA_GROUP_ID="0",
                     NUM_REPLICA_GROUPS="2")
    assert one_error(result) == (f"error: cannot reach the torchft lighthouse at {address} (no "
                                 "connection in --timeout-s 5 s); start it (scripts/train_ft.sh "
                                 "lighthouse) or fix TORCHFT_LIGHTHOUSE")
    assert f"torchft: waiting for the lighthouse at {address} (Connection refused)" in \
        result.stdout
    assert time.monotonic() - started < 5 + 15


@pytest.mark.full
@needs_torchft
def test_a_group_says_at_once_that_it_waits_for_a_lighthouse_that_starts_late(tmp_path,
                                                                               example_task):
    lighthouse = Lighthouse(tmp_path, start=False)
    at = FLAGS.index("--timeout-s")  # the default --timeout-s (300 s) instead of the tests' 10
    group = Group(tmp_path, 0, lighthouse, "--max-steps", "20", flags=FLAGS[:at] + FLAGS[at + 2:])
    try:
        group.wait_for(r"torchft: replica group 0 of 2")
        started = time.monotonic()
        group.wait_for(rf"torchft: waiting for the lighthouse at {lighthouse.address} \(Connection "
                       r"refused\), up to --timeout-s 300 s; start it")
        waited = time.monotonic() - started
        assert waited < 5, f"the waiting line came {waited:.1f} s after the start-up line"
        time.sleep(3)  # still waiting, well past a try's few seconds
        assert group.process.poll() is None, group.output()
        lighthouse.start()
        out = group.finish(120)
    finally:
        if group.process.poll() is None:
            group.kill()
        lighthouse.stop()
    assert out.count("waiting for the lighthouse") == 1 and "done: 20 steps" in out, out


@pytest.mark.full
@needs_torchft
def test_a_lighthouse_address_without_http_gets_it(tmp_path, example_task):
    lighthouse = Lighthouse(tmp_path)
    address = lighthouse.address
    lighthouse.address = address.removeprefix("http://")  # as a user may write it: HOST:PORT
    group = Group(tmp_path, 0, lighthouse, "--max-steps", "20")
    try:
        out = group.finish(120)
    finally:
        if group.process.poll() is None:
            group.kill()
        lighthouse.stop()
    assert f"replica group 0 of 2, lighthouse {address}" in out and "done: 20 steps" in out, out
    assert "waiting for the lighthouse" not in out, out


@pytest.mark.full
@needs_torchft
def test_a_lighthouse_that_dies_ends_every_group_with_one_line(groups, example_task):
    lighthouse, first, second = groups("--max-steps", "100000", "--timeout-s", "5")
    first.wait_for(r"step \d+ loss"), second.wait_for(r"step \d+ loss")
    lighthouse.stop()
    stopped = time.monotonic()
    for group in (first, second):
        assert group.process.wait(60) == 1
        errors = [line for line in group.output().splitlines() if "error:" in line]
        assert len(errors) == 1 and "lost the torchft lighthouse" in errors[0], group.output()
    assert time.monotonic() - stopped < 5 + 15


@pytest.mark.full
@needs_torchft
def test_the_script_starts_a_lighthouse_and_two_groups_as_the_docs_show(tmp_path, example_task):
    script = str(PROJECT_ROOT / "scripts" / "train_ft.sh")
    port = find_free_port()
    env = child_env(PATH=f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}",
                    PYTHON=sys.executable, LIGHTHOUSE_PORT=str(port), HEARTBEAT_TIMEOUT_MS="3000",
                    TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}",
                    LIGHTHOUSE_LOG=str(tmp_path / "lighthouse.log"))
    lighthouse = subprocess.Popen([script, "lighthouse"], env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        # The folders given last win over the script's runs/groupN and checkpoints/groupN.
        jobs = [subprocess.Popen([script, "group", *FLAGS[:-2], "--max-steps", "100",
                                  "--output-dir", str(tmp_path / f"runs{i}"),
                                  "--checkpoint-dir", str(tmp_path / f"checkpoints{i}")],
                                 env={**env, "REPLICA_GROUP_ID": str(i)}, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True) for i in range(2)]
        outputs = [job.communicate(timeout=240)[0] for job in jobs]
    finally:
        os.killpg(lighthouse.pid, signal.SIGKILL)
        lighthouse.wait()
    for i, (job, out) in enumerate(zip(jobs, outputs, strict=True)):
        assert job.returncode == 0, out
        assert f"replica group {i} of 2" in out and "done: 100 steps" in out
        assert list_checkpoints(tmp_path / f"checkpoints{i}")
    assert "Quorum" in (tmp_path / "lighthouse.log").read_text()


@pytest.mark.full
@needs_torchft
def test_a_group_started_by_mp_spawn_with_a_file_rendezvous_trains(tmp_path, example_task):
    lighthouse = Lighthouse(tmp_path)
    try:
        result = run_cmd([sys.executable, TRAIN_FT, "--nprocs", "2", "--init-method", "file",
                          *FLAGS, "--max-steps", "40", "--output-dir", str(tmp_path / "runs")],
                         tmp_path, timeout=180, TORCHFT_LIGHTHOUSE=lighthouse.address,
                         REPLICA_GROUP_ID="0", NUM_REPLICA_GROUPS="1")
    finally:
        lighthouse.stop()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "launcher spawn" in result.stdout and "done: 40 steps" in result.stdout


@pytest.mark.full
@needs_torchft
def test_groups_on_two_hosts_find_each_other_and_one_heals_across_the_network(hosts, tmp_path,
                                                                              example_task):
    """Two machines whose host name resolves to loopback (tests/hosts.py), no *_SOCKET_IFNAME:
    each group advertises its address on the route to the lighthouse, so the other reaches it
    for the allreduce and for healing."""
    lighthouse = Lighthouse(tmp_path, host=hosts[0])
    workdirs = [tmp_path / f"g{i}" for i in range(2)]
    for workdir in workdirs:
        workdir.mkdir()
    first, second = (Group(workdirs[i], i, lighthouse, "--max-steps", "3000", host=hosts[i])
                     for i in range(2))
    try:
        second.wait_for(r"step \d+: 2 replica group\(s\) taking part")
        first.wait_for(r"step [1-9]\d\d+ loss")
        second.kill()
        first.wait_for(r"step \d+: 1 replica group\(s\) taking part")
        second.start()
        second.wait_for(r"healed from a live replica group")
        first.finish(), second.finish()
        assert same(first.final_weights(), second.final_weights())
    finally:
        for thing in (first, second, lighthouse):
            if isinstance(thing, Group) and thing.process.poll() is None:
                thing.kill()
        lighthouse.stop()
