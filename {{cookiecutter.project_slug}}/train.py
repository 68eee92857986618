"""Start training: `torchrun --standalone --nproc-per-node=2 train.py` (see README.md)."""

import os
import sys
import traceback

try:
    from {{ cookiecutter.package_name }}.main import exit_process, main
except Exception as exc:  # task.py's mistake at its top level (a SyntaxError, ImportError, ...):
    # Python's own lines for it, without the frames of the project's imports; the scripts and
    # scripts/train_ray.py import this file first, for the same lines.
    here = os.path.dirname(os.path.abspath(__file__))
    ours = (os.path.join(here, "{{ cookiecutter.package_name }}", ""),
            os.path.join(here, "train"), "<")  # the package, this file, Python's own
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if f.filename.endswith("task.py") or not f.filename.startswith(ours)]
    sys.exit("".join(traceback.format_list(frames) + traceback.format_exception_only(exc)).rstrip())

if __name__ == "__main__":
    exit_process(main())
