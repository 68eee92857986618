"""Start training: `torchrun --standalone --nproc-per-node=2 train.py` (see README.md)."""

from {{ cookiecutter.package_name }}.main import exit_process, main

if __name__ == "__main__":
    exit_process(main())
