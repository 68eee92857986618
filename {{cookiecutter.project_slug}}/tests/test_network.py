"""Several machines on a real network: two test hosts in network namespaces (tests/hosts.py), joined
by a bridge, whose host name resolves to loopback as on many real machines. No *_SOCKET_IFNAME is
set anywhere: the project picks the interface that routes to the head node.

Each test runs scripts/train_multinode.sh as the README gives it, one node a host.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    assert_same_model,
    child_env,
    final_model,
    made_once,
    ok,
    path_with,
    skip_unless_example_task,
    summary,
    torchrun,
)

from {{ cookiecutter.package_name }}.runtime.network import route_to, socket_interface_env

pytestmark = [pytest.mark.network,
              pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="network namespaces are Linux's")]

TIMEOUT_S = 10
SMALL = ["--dataset-size", "256", "--hidden-size", "16", "--epochs", "2"]
# 512 steps of 2 ranks, a checkpoint every 32: long enough to cut the network mid-run.
LONG = ["--dataset-size", "8192", "--batch-size", "8", "--hidden-size", "16", "--epochs", "1",
        "--save-every-steps", "32", "--log-every", "16", "--keep-last", "0"]


def start_node(host, rank: int, head, port: int, args: list[str], workdir: Path, bin_dir: Path,
               restarts: int = 0, **extra: str) -> subprocess.Popen:
    env = child_env(PATH=path_with(bin_dir), NPROC="1", RDZV_ID=f"job-{port}",
                    MAX_RESTARTS=str(restarts))
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.pop(name, None)
    env.update(extra)
    script = str(Path(__file__).resolve().parents[1] / "scripts/train_multinode.sh")
    flags = ["--no-progress", "--timeout-s", str(TIMEOUT_S), "--output-dir", str(workdir / "runs"),
             "--checkpoint-dir", str(workdir / "ck"), *args]
    return host.popen(["bash", script, "2", str(rank), f"{head.address}:{port}", *flags],
                      cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                      text=True)


def start_job(hosts, args, workdir, bin_dir, port=29400, restarts=0) -> list[subprocess.Popen]:
    return [start_node(host, rank, hosts[0], port, args, workdir, bin_dir, restarts)
            for rank, host in enumerate(hosts)]


def finish(nodes: list[subprocess.Popen], limit_s: float = 300) -> list[tuple[int, str]]:
    results = []
    for node in nodes:
        out, err = node.communicate(timeout=limit_s)
        results.append((node.returncode, out + err))
    return results


def succeed(nodes: list[subprocess.Popen]) -> list[str]:
    outputs = []
    for code, output in finish(nodes):
        assert code == 0, output[-4000:]
        outputs.append(output)
    return outputs


def errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The final model of the same job on one machine: 2 processes over loopback."""
    skip_unless_example_task()
    ref = {}
    for name, args in (("small", SMALL), ("long", LONG)):  # once for both xdist workers
        folder = made_once(tmp_path_factory, f"network-{name}",
                           lambda folder, args=args: ok(torchrun(args, folder)))
        ref[name] = final_model(folder / "checkpoints")
    return ref


def wait_for_checkpoint(folder: Path, nodes: list[subprocess.Popen], limit_s: float = 120) -> None:
    started = time.monotonic()
    while not list(folder.glob("ckpt_*")):
        assert all(node.poll() is None for node in nodes), finish(nodes)
        assert time.monotonic() - started < limit_s
        time.sleep(0.2)


def test_the_interface_is_the_one_that_routes_to_the_head(hosts):
    probe = ("from {{ cookiecutter.package_name }}.runtime.network import route_to, socket_interface_env\n"
             f"route = route_to('{hosts[0].address}')\n"
             f"print(socket_interface_env('gloo', route, '{hosts[0].address}', dict())[0])\n"
             "print(socket_interface_env('gloo', route, '', dict(GLOO_SOCKET_IFNAME='x'))[0])")
    out = hosts[1].run([sys.executable, "-c", probe], capture_output=True, text=True,
                       env=child_env()).stdout.split("\n")
    assert out[0] == "{'GLOO_SOCKET_IFNAME': 'eth0'}" and out[1] == "{}", out  # the user's wins
    # On one machine (loopback) nothing is set.
    assert socket_interface_env("gloo", route_to("127.0.0.1"), "127.0.0.1", {}) == ({}, "")


# Each job here starts the processes of two hosts, so each init method is one of them: a store
# file on the shared file system this one, tcp:// the job that resumes after the head host dropped
# off, and torchrun's own (env://) the others (the job restarted under --max-restarts checks its
# bits).
def test_the_multinode_script_trains_across_hosts_bit_for_bit(hosts, workdir, bin_dir, reference):
    init = str(workdir / "shared" / "store")  # the hosts share this file system
    outputs = succeed(start_job(hosts, [*SMALL, "--init-method", init], workdir, bin_dir))
    assert f"network eth0 ({hosts[0].address}, routes to" in outputs[0], outputs[0]
    assert summary(workdir / "runs")["world_size"] == 2
    assert_same_model(reference["small"], final_model(workdir / "ck"))


def cut_off(hosts, victim: int, workdir: Path, bin_dir: Path) -> tuple[list, float]:
    """Start a long job, take `victim`'s link down after its first checkpoint; (code, output) of
    each node, and how long after the cut the last process of either host ended."""
    nodes = start_job(hosts, LONG, workdir, bin_dir)
    wait_for_checkpoint(workdir / "ck", nodes)
    hosts[victim].link("down")
    cut = time.monotonic()
    while any(host.pids() for host in hosts):
        if time.monotonic() - cut > TIMEOUT_S + 10 + 5:
            left = {host.address: [described(pid) for pid in host.pids()] for host in hosts}
            outputs = finish_quietly(nodes)
            raise AssertionError(f"processes left {TIMEOUT_S + 15} s after the cut: {left}\n"
                                 + "\n".join(out[-3000:] for out in outputs))
        time.sleep(0.2)
    took = time.monotonic() - cut
    return finish(nodes, 30), took


def finish_quietly(nodes) -> list[str]:
    outputs = []
    for node in nodes:
        node.kill()
        try:
            outputs.append("".join(node.communicate(timeout=30)))
        except subprocess.TimeoutExpired:  # a process of its own still holds the output
            outputs.append("(no output: a process of this node still holds it)")
    return outputs


def described(pid: int) -> str:
    """A process as a failure names it: its pid, command line and what it waits in."""
    try:
        proc = Path(f"/proc/{pid}")
        command = proc.joinpath("cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
        return f"{pid} ({command.strip()}; waiting in {proc.joinpath('wchan').read_text()})"
    except OSError:
        return str(pid)


@pytest.mark.parametrize("victim", [1, 0], ids=["a-worker-host", "the-head-host"])
def test_a_host_that_drops_off_ends_every_process_and_the_job_resumes(hosts, workdir, bin_dir,
                                                                     reference, victim):
    results, took = cut_off(hosts, victim, workdir, bin_dir)
    (code0, out0), (code1, out1) = results
    assert code0 != 0 and code1 != 0
    # Rank 0 holds the job's store: it names the rank that stopped answering, and its host.
    [named] = errors(out0)
    assert f"rank(s) that stopped answering: 1 on vm ({hosts[1].address})" in named, out0
    # Rank 1 lost both its peer and the store, and says so (and which store).
    [lost] = errors(out1)
    assert "rank 1 on " in lost and "lost contact with the other ranks" in lost, out1
    assert f"the job's store at {hosts[0].address}:" in lost and "dropped off the network" in lost
    print(f"host {victim} cut off: every process of both hosts ended {took:.1f} s later")
    if victim == 0:  # the job resumes the same way whichever host dropped off (here by tcp://)
        hosts[victim].link("up")
        init = f"tcp://{hosts[0].address}:29455"
        outputs = succeed(start_job(hosts, [*LONG, "--init-method", init], workdir, bin_dir,
                                    port=29401))
        assert "resumed from" in outputs[0]
        assert_same_model(reference["long"], final_model(workdir / "ck"))


def test_a_host_killed_under_max_restarts_rejoins_and_the_job_finishes(hosts, workdir, bin_dir,
                                                                      reference):
    nodes = start_job(hosts, LONG, workdir, bin_dir, restarts=1)
    wait_for_checkpoint(workdir / "ck", nodes)
    for pid in hosts[1].pids():  # the whole machine goes: agent and training process
        os.kill(pid, 9)
    nodes[1].communicate()
    nodes[1] = start_node(hosts[1], 1, hosts[0], 29400, LONG, workdir, bin_dir, restarts=1)
    outputs = succeed(nodes)
    assert "resumed from" in outputs[0]
    assert_same_model(reference["long"], final_model(workdir / "ck"))


def test_an_interface_that_cannot_reach_the_others_is_named(hosts, workdir, bin_dir):
    """A wrong GLOO_SOCKET_IFNAME wins over the project's choice, and fails with one line that
    names the address the rank offered and the variable."""
    nodes = [start_node(host, rank, hosts[0], 29402, SMALL, workdir, bin_dir,
                        GLOO_SOCKET_IFNAME="lo") for rank, host in enumerate(hosts)]
    (code0, out0), (code1, out1) = finish(nodes, 120)
    assert code0 != 0 and code1 != 0
    # The rank that dials its peer's address says why. Which one dials is gloo's choice (it
    # depends on the ports); the other waits for a connection that never comes, until
    # --timeout-s or until its torchrun ends with the other node's.
    assert len(errors(out0)) <= 1 and len(errors(out1)) <= 1, out0 + out1
    [line] = [line for line in errors(out0) + errors(out1) if "could not connect" in line]
    assert "could not connect to them" in line and "127.0.0.1" in line, line
    assert "(interface lo, from GLOO_SOCKET_IFNAME)" in line
    assert "set GLOO_SOCKET_IFNAME on every node" in line


def test_the_doctor_shows_each_ranks_interface_and_warns_about_a_loopback_host_name(hosts,
                                                                                   workdir):
    """The issue's own command: torchrun with a static head address, one process a host."""
    nodes = [host.popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                         "--node-rank", str(rank), "--nproc-per-node", "1", "--master-addr",
                         hosts[0].address, "--master-port", "29403", "-m",
                         "{{ cookiecutter.package_name }}.doctor", "--timeout-s", str(TIMEOUT_S)],
                        cwd=workdir, env=child_env(), stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True)
             for rank, host in enumerate(hosts)]
    for rank, (code, output) in enumerate(finish(nodes, 120)):
        assert code == 0, output[-3000:]
        assert f"network: eth0 ({hosts[rank].address}, routes to {hosts[0].address})" in output
        assert "resolves to 127." in output and "WARNING: host name" in output
        assert "OK: all_reduce and barrier across 2 process(es)" in output
