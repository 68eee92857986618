"""Start one replica group of a fault-tolerant run (torchft): see docs/fault-tolerance.md.

    TORCHFT_LIGHTHOUSE=http://localhost:29510 REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 \
        torchrun --standalone --nproc-per-node=2 train_ft.py
"""

from {{ cookiecutter.package_name }}.fault_tolerance import main
from {{ cookiecutter.package_name }}.runtime.workarounds import exit_process

if __name__ == "__main__":
    exit_process(main())
