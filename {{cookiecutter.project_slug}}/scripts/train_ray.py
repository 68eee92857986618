"""Train on a Ray cluster with Ray Train (docs/launching.md, "Ray"):

    ray start --head                      # once, on the head node (or use a running cluster)
    python scripts/train_ray.py --workers 2 --epochs 3

`--workers N` (or MIN:MAX) and `--max-restarts R` are this script's; every other flag is
train.py's. The cluster is RAY_ADDRESS's, else the one `ray start` started on this machine."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train  # noqa: E402, F401  (first: a mistake in task.py is Python's own lines, as train.py's)
from {{ cookiecutter.package_name }}.runtime.ray_train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
