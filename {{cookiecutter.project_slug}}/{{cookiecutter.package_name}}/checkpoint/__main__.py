"""python -m {{ cookiecutter.package_name }}.checkpoint export SRC OUT.pt (see export.py)."""

from .export import main

if __name__ == "__main__":
    raise SystemExit(main())
