"""Start training: `torchrun --standalone --nproc-per-node=2 train.py` (see README.md). A replica
group starts with train_ft.py instead: here its variables are refused."""

from {{ cookiecutter.package_name }}.fault_tolerance import plain_main
from {{ cookiecutter.package_name }}.runtime.workarounds import exit_process

if __name__ == "__main__":
    exit_process(plain_main())
