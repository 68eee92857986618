"""kubernetes=true, with a real container runtime: the baked Dockerfile built with podman, its image
run, and the PyTorchJob's Master and Worker pods run as two containers of that image.

The build is the Dockerfile as baked, with build arguments only: the local base image and the
CPU build of torch from a package index in a folder (tests/container.py), with no network. The
pods' command, arguments, environment, user, shared volume and /dev/shm come from
k8s/pytorchjob.yaml, with the variables the Training Operator gives each pod; the containers share
a podman network, and each pod's name resolves to its container, as the operator's services do. The
test's own choices: the tiny workload's flags after the manifest's, OMP_NUM_THREADS=1 (2 cores
here), and a folder of this machine as the ReadWriteMany volume.

Elsewhere (no podman, runc or debootstrap, not root) the tests skip with the reason.
"""

from __future__ import annotations

import ipaddress
import json
import re
import sys
import time
import tomllib
import uuid
from importlib import metadata
from pathlib import Path

import container
import pytest
import torch
from conftest import ROOT
from container import podman
from cookiecutter.main import cookiecutter
from test_kubernetes import (
    TOTAL_STEPS,
    WORKLOAD,
    expand,
    load_manifests,
    newest_checkpoint_step,
    pytorch_container,
    replica_specs,
    shared_mount_path,
)

WHY_NOT = container.why_not()
pytestmark = [pytest.mark.container, pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]


@pytest.fixture(scope="module")
def image(tmp_path_factory, request):
    """(project, image tag): the kubernetes bake, built once for this module."""
    folder = tmp_path_factory.mktemp("image")
    project = Path(cookiecutter(str(ROOT), no_input=True, output_dir=str(folder),
                                extra_context={"kubernetes": True, "task": "regression"}))
    base = container.base_image(folder)
    requirements = [line for line in (project / "requirements.txt").read_text().splitlines()
                    if line.strip() and not line.startswith("#")]
    build_system = tomllib.loads((project / "pyproject.toml").read_text())["build-system"]
    index = container.package_index(folder / "index", [*requirements, "numpy<3", "s3fs",
                                                       *build_system["requires"]])
    tag = f"localhost/{project.name}:test-{uuid.uuid4().hex[:8]}"
    seconds = container.build(project, tag, index, BASE_IMAGE=base, TORCH_VARIANT="cpu",
                              TORCH_VERSION=metadata.version("torch").split("+")[0],
                              TORCH_INDEX_URL="file:///index/simple", EXTRAS="s3fs")
    size = container.image_size(tag)
    with request.config.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
        print(f"\ncontainer image {tag}: {size / 1e9:.2f} GB, built in {seconds:.0f} s "
              f"(CPU torch, on {base})")
    try:
        yield project, tag
    finally:
        podman("rmi", "--force", tag, check=False)


def test_image_runs_as_the_docs_show(image, tmp_path):
    """`docker run --rm --shm-size=2g -v <volume>:/mnt/shared <image>` trains, as user 1000, and
    leaves its checkpoints and metrics on the volume; the package is installed, runtime/ with it."""
    project, tag = image
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    who = podman("run", "--rm", *container.limits(), "--entrypoint", "id", tag, "-u")
    assert who.stdout.strip() == "1000"
    doctor = podman("run", "--rm", *container.limits(), "--workdir", "/", "--entrypoint",
                    "python", tag, "-c", "import ddp_project.checkpoint, ddp_project.main")
    assert doctor.returncode == 0
    result = podman("run", "--rm", *container.limits(), "--shm-size=2g", "--volume",
                    f"{shared}:/mnt/shared", tag, timeout=300)
    assert "done:" in result.stdout, result.stdout + result.stderr
    summary = json.loads((shared / "runs/latest/summary.json").read_text())
    assert summary["world_size"] == 1 and summary["launcher"] == "torchrun", summary
    assert newest_checkpoint_step(shared / "checkpoints") == summary["steps"]
    assert all(p.stat().st_uid == 1000 for p in (shared / "checkpoints").iterdir())


def test_the_container_checkpoints_to_a_bucket_and_resumes_from_it(image, tmp_path):
    """Built with --build-arg EXTRAS=s3fs, the image trains into an S3 bucket (moto's server on
    the host's loopback, reached through the host's network) and a second container, with no
    volume at all, resumes from the bucket."""
    sys.path.insert(0, str(image[0] / "tests"))
    from s3server import S3Server

    project, tag = image
    server = S3Server()
    try:
        env = [f"--env={key}={value}" for key, value in server.env().items()]
        # 16 steps an epoch, 32 in all.
        run = ["run", "--rm", *container.limits(), "--shm-size=2g", "--network=host", *env, tag,
               "--standalone", "--nproc-per-node=1", "train.py", "--checkpoint-dir=s3://bkt/job",
               "--output-dir=/tmp/runs", "--hidden-size=8", "--dataset-size=256",
               "--batch-size=16", "--epochs=2", "--save-every-steps=8", "--keep-last=2"]
        first = podman(*run, "--max-steps=8", timeout=300)
        assert "checkpoints: s3://bkt/job" in first.stdout, first.stdout + first.stderr
        second = podman(*run, timeout=300)
        assert "resumed from s3://bkt/job/ckpt_step00000008.pt" in second.stdout, second.stderr
        assert "done: 32 steps" in second.stdout, second.stdout
        names = sorted(key.rsplit("/", 1)[-1] for key in server.fs().ls("bkt/job"))
        assert names == ["ckpt_step00000024.pt", "ckpt_step00000032.pt"], names
    finally:
        server.close()


# ---------------------------------------------------------------------------------------------
# The PyTorchJob as two containers


class Job:
    """The PyTorchJob's pods as containers of `image` on a podman network of their own, restarted
    like the kubelet does with restartPolicy OnFailure (until runPolicy.backoffLimit).

    Each container gets what the operator gives its pod (Training Operator v1: MASTER_ADDR is the
    Master pod's name, MASTER_PORT the pytorchjob-port, WORLD_SIZE, RANK, PET_*), the container's
    own `env`, `command` and `args` with Kubernetes' $(VAR) expansion, the pod's user and group,
    the shared volume on the manifest's mount path, and /dev/shm of the manifest's size. Each
    container's host name is its pod's name, and every pod's name resolves in every container."""

    def __init__(self, tag: str, job: dict, shared: Path, extra: list[str]):
        self.id = uuid.uuid4().hex[:8]
        self.network = f"ddpjob-{self.id}"
        specs = replica_specs(job)
        nproc = job["spec"]["nprocPerNode"]
        pods = [(rtype, index) for rtype in ("Master", "Worker")
                for index in range(specs[rtype]["replicas"])]
        self.master = f"{job['metadata']['name']}-master-0"
        self.backoff_limit = job["spec"]["runPolicy"]["backoffLimit"]
        self.containers: dict[str, list[str]] = {}  # pod name -> podman create arguments
        for rank, (rtype, index) in enumerate(pods):
            name = f"{job['metadata']['name']}-{rtype.lower()}-{index}"
            pod = specs[rtype]["template"]["spec"]
            spec = pytorch_container(pod)
            [port] = [p["containerPort"] for p in spec["ports"] if p["name"] == "pytorchjob-port"]
            env = {item["name"]: item["value"] for item in spec.get("env", [])}
            env.update({
                "PYTHONUNBUFFERED": "1", "MASTER_ADDR": self.master, "MASTER_PORT": str(port),
                "PET_MASTER_ADDR": self.master, "PET_MASTER_PORT": str(port),
                "WORLD_SIZE": str(len(pods) * int(nproc)), "RANK": str(rank),
                "PET_NODE_RANK": str(rank), "PET_NPROC_PER_NODE": nproc,
                "PET_NNODES": str(len(pods)), "OMP_NUM_THREADS": "1",
            })
            mount, _ = shared_mount_path(pod)
            [shm] = [v["emptyDir"]["sizeLimit"] for v in pod["volumes"]
                     if v["name"] in [m["name"] for m in spec["volumeMounts"]
                                      if m["mountPath"] == "/dev/shm"]]
            security = pod["securityContext"]
            args = [expand(part, env) for part in spec["args"]] + extra
            self.containers[name] = [
                "--name", f"{self.id}-{name}", "--hostname", name, "--network", self.network,
                *container.limits(),
                "--user", f"{security['runAsUser']}:{security['runAsGroup']}",
                "--volume", f"{shared}:{mount}", f"--shm-size={shm.replace('Gi', 'g')}",
                *[f"--env={key}={value}" for key, value in env.items()],
                "--entrypoint", json.dumps(spec["command"]), tag, *args]
        self.exits: dict[str, list[int]] = {name: [] for name in self.containers}
        self.starts: dict[str, int] = dict.fromkeys(self.containers, 0)
        self.text: dict[str, str] = {}  # each container's output, kept when it is removed

    def __enter__(self) -> Job:
        # Name lookups: the pods' names are in /etc/hosts, and any other lookup fails at once
        # (no DNS server in the container's loopback), as a cluster's DNS answers at once. The
        # containers here reach no DNS server, and torch's store looks up the name of a peer's
        # address to log it: sent to the host's resolver (or podman's, which forwards there),
        # such a lookup waited 10 to 20 s when a peer had died. A pod keeps its address when
        # its container restarts: so do these.
        podman("network", "create", "--disable-dns", self.network)
        subnet = ipaddress.ip_network(podman(
            "network", "inspect", "--format", "{{range .Subnets}}{{.Subnet}}{{end}}",
            self.network).stdout.strip())
        ips = {name: subnet[10 + number] for number, name in enumerate(self.containers)}
        names = [f"--add-host={name}:{ip}" for name, ip in ips.items()]
        for name, args in self.containers.items():
            podman("create", "--ip", str(ips[name]), "--dns=127.0.0.1", *names, *args)
            podman("start", f"{self.id}-{name}")
            self.starts[name] += 1
        return self

    def __exit__(self, *exc) -> None:
        self.text = {name: self.logs(name) for name in self.containers}
        for name in self.containers:
            podman("rm", "--force", "--time", "0", f"{self.id}-{name}", check=False)
        podman("network", "rm", "--force", self.network, check=False)

    def states(self) -> dict[str, tuple[str, int]]:
        names = [f"{self.id}-{name}" for name in self.containers]
        args = ["inspect", "--format", "{{.Name}} {{.State.Status}} {{.State.ExitCode}}", *names]
        for _ in range(20):
            result = podman(*args, check=False)
            # A container whose process ends while podman reads it: `read /proc/N/cgroup: no
            # such process`, a race of podman's (containers/podman#16383, fixed after Debian
            # 12's 4.3), gone on the next look.
            if result.returncode == 0 or "no such process" not in result.stderr:
                break
            time.sleep(0.1)
        out = podman(*args).stdout if result.returncode else result.stdout
        found = {}
        for line in out.splitlines():
            full, status, code = line.split()
            found[full.removeprefix(f"{self.id}-")] = (status, int(code))
        return found

    def kill(self, name: str) -> None:
        """The container dies at once (node trouble, OOM): SIGKILL to everything in it."""
        podman("kill", "--signal", "KILL", f"{self.id}-{name}")

    def run(self, condition=lambda: False, timeout: float = 240) -> None:
        """Run until `condition()` holds or, by default, every container has succeeded."""
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"timed out\n{self.output()}"
            states = self.states()
            if all(state == ("exited", 0) for state in states.values()):
                for name in states:
                    self.exits[name].append(0)
                return
            for name, (status, code) in states.items():
                if status == "exited" and code != 0:
                    self.exits[name].append(code)
                    restarts = sum(len(c) - c.count(0) for c in self.exits.values())
                    assert restarts <= self.backoff_limit, f"backoffLimit\n{self.output()}"
                    podman("start", f"{self.id}-{name}")
                    self.starts[name] += 1
            time.sleep(0.25)

    def logs(self, name: str) -> str:
        result = podman("logs", f"{self.id}-{name}", check=False)
        return result.stdout + result.stderr

    def output(self) -> str:
        return "\n".join(f"===== {name}\n{self.logs(name)[-4000:]}" for name in self.containers)


def train(tag: str, job: dict, shared: Path, kill: str | None = None) -> Job:
    """The job to the end on a fresh volume; with `kill`, that pod's container is killed once
    the job has saved a checkpoint, and the job goes on as Kubernetes would run it."""
    shared.mkdir()
    shared.chmod(0o777)  # the pods' user (fsGroup does this in a cluster)
    checkpoints = shared / "checkpoints"
    with Job(tag, job, shared, [*WORKLOAD, "--no-progress"]) as pods:
        if kill is not None:
            pods.run(lambda: newest_checkpoint_step(checkpoints) > 0)
            killed_at = newest_checkpoint_step(checkpoints)
            pods.kill(kill)
            assert killed_at < TOTAL_STEPS, "the job ended before the kill"
        pods.run()
    return pods


def final_weights(shared: Path) -> dict[str, torch.Tensor]:
    path = shared / "checkpoints" / f"ckpt_step{TOTAL_STEPS:08d}.pt"
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


@pytest.fixture(scope="module")
def uninterrupted(image, tmp_path_factory) -> tuple[dict, Path]:
    """(the PyTorchJob, the volume of its run to the end with no kill): the reference."""
    project, tag = image
    job = load_manifests(project)["PyTorchJob"]
    shared = tmp_path_factory.mktemp("uninterrupted") / "shared"
    pods = train(tag, job, shared)
    assert pods.starts == dict.fromkeys(pods.containers, 1), pods.exits
    return job, shared


@pytest.mark.parametrize("victim", ["worker", "master"])
def test_pytorchjob_containers_resume_after_one_is_killed(image, uninterrupted, tmp_path, victim):
    """The Worker's container dies (the Master's torchrun restarts its process and waits for the
    restarted Worker), or the Master's (its rendezvous store goes with it, so the Worker's torchrun
    fails too and both restart): the job resumes and ends with the uninterrupted run's weights."""
    _, tag = image
    job, reference = uninterrupted
    name = f"{job['metadata']['name']}-{victim}-0"
    shared = tmp_path / "shared"
    pods = train(tag, job, shared, kill=name)
    assert pods.exits[name][0] == 137 and pods.starts[name] >= 2, pods.exits
    assert re.search(r"resumed from \S*ckpt_step\d+", pods.text[pods.master]), \
        pods.text[pods.master][-3000:]
    summary = json.loads((shared / "runs/latest/summary.json").read_text())
    assert summary["steps"] == TOTAL_STEPS and summary["world_size"] == 2, summary
    assert summary["resumed_from"], summary

    expected, got = final_weights(reference), final_weights(shared)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[key], got[key]) for key in expected), "weights differ"
