"""Delete the files these answers do not use, then say what to run next."""

import json
import shutil
from pathlib import Path

ANSWERS = json.loads(r"""{{ cookiecutter | tojson }}""")


def truthy(value) -> bool:
    return value is True or str(value).strip().lower() in {"true", "yes", "y", "1", "on"}


UNUSED = {
    "slurm": ["scripts/slurm", "tests/test_slurm.py"],
    "windows_support": ["scripts/train_windows.ps1"],
    "github_actions": [".github"],
}

LAUNCH = {
    "torchrun": "torchrun --standalone --nproc-per-node=2 train.py --epochs 3",
    "spawn": "python train.py --nprocs 2 --epochs 3",
    "launch": "python -m torch.distributed.launch --nproc-per-node=2 train.py --epochs 3",
}


def main() -> None:
    root = Path.cwd()
    for answer, paths in UNUSED.items():
        if truthy(ANSWERS[answer]):
            continue
        for rel in paths:
            target = root / rel
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    print(f"""
Created {root}

Next:
  cd {root.name}
  pip install -e ".[dev]"
  {LAUNCH[ANSWERS["launcher"]]}
  pytest -q
""")


if __name__ == "__main__":
    main()
