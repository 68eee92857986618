"""Shape the new project to the answers: keep the chosen example task, delete the files the
answers do not use, then say what to run next."""

import json
import shutil
from pathlib import Path

ANSWERS = json.loads(r"""{{ cookiecutter | tojson }}""")


def truthy(value) -> bool:
    return value is True or str(value).strip().lower() in {"true", "yes", "y", "1", "on"}


# Files that only some answers use: deleted when the answer is no.
UNUSED = {
    "slurm": ["scripts/slurm", "tests/test_slurm.py"],
    "windows_support": ["scripts/train_windows.ps1"],
    "kubernetes": ["Dockerfile", ".dockerignore", "k8s"],
    "github_actions": [".github"],
}
# Files of fault_tolerance=torchft: deleted with `none`, which then bakes no trace of torchft.
TORCHFT = ["train_ft.py", "train.torchft.py", "{package}/fault_tolerance.py",
           "{package}/replica_groups.py", "scripts/train_ft.sh",
           "scripts/bench_ft.py", "scripts/slurm/ft.sbatch", "tests/test_fault_tolerance.py",
           "docs/fault-tolerance.md"]
# Files of launcher=ray: deleted with the other launchers, which then bake no trace of Ray.
RAY = ["scripts/train_ray.py", "{package}/runtime/ray_train.py", "{package}/runtime/ray_stop.py",
       "tests/test_ray.py"]
# Files of model_layout=tensor_parallel: deleted with the other layouts (the flag is then refused).
TENSOR_PARALLEL = ["{package}/tensor_parallel.py", "tests/test_tensor_parallel.py"]

def remove(target: Path) -> None:
    if target.is_dir():
        shutil.rmtree(target)
    elif target.exists():
        target.unlink()


def main() -> None:
    root = Path.cwd()
    package = root / ANSWERS["package_name"]
    task = ANSWERS["task"]
    # The chosen example becomes the project's task.py (and its tests test_task.py).
    (package / "tasks" / f"{task}.py").replace(package / "task.py")
    (root / "tests" / "tasks" / f"test_{task}.py").replace(root / "tests" / "test_task.py")
    (root / "configs" / f"{task}.toml").replace(root / "configs" / "example.toml")
    remove(package / "tasks")
    if task not in ("language_model", "hf_causal_lm"):  # their loss's chunked cross-entropy
        remove(package / "cross_entropy.py")
    if task != "classification":  # its image files' reading
        remove(package / "images.py")
    if task != "hf_causal_lm":  # transformers' side of it
        remove(package / "hf.py")
    if task != "language_model":  # its --data files: text, or nanoGPT's token ids
        remove(package / "text_files.py")
    remove(root / "tests" / "tasks")
    presets = {"example.toml"} | ({"gpt2-small.toml"} if task == "language_model" else set())
    for path in (root / "configs").glob("*.toml"):
        if path.name not in presets:
            path.unlink()
    for answer, paths in UNUSED.items():
        if not truthy(ANSWERS[answer]):
            for rel in paths:
                remove(root / rel)
    if ANSWERS["fault_tolerance"] == "torchft":
        # Its train.py refuses a replica group's variables (train_ft.py starts the groups).
        (root / "train.torchft.py").replace(root / "train.py")
    else:
        for rel in TORCHFT:
            remove(root / rel.format(package=ANSWERS["package_name"]))
    if ANSWERS["launcher"] != "ray":
        for rel in RAY:
            remove(root / rel.format(package=ANSWERS["package_name"]))
    if ANSWERS["model_layout"] != "tensor_parallel":
        for rel in TENSOR_PARALLEL:
            remove(root / rel.format(package=ANSWERS["package_name"]))
    flags = "--epochs 3"
    if task == "hf_causal_lm":  # your model's folder and your text
        flags = "--model path/to/model --data path/to/text.txt --epochs 3"
    train = (f"scripts/train_local.sh {flags}     # {ANSWERS['launcher']}: one process per GPU,"
             " or 2 on CPU")
    extras = "dev"
    if ANSWERS["launcher"] == "ray":
        train = ("ray start --head --node-ip-address 127.0.0.1 --num-cpus 2  # or set RAY_ADDRESS\n"
                 f"  python scripts/train_ray.py --workers 2 {flags}")
        extras = "dev,ray"
    print(f"""
Created {root}

Next:
  cd {root.name}
  pip install -e ".[{extras}]"
  {train}
  pytest -q
""")


if __name__ == "__main__":
    main()
