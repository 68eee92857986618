"""python -m {{ cookiecutter.package_name }}.shards SRC DEST (see write.py)."""

from .write import main

if __name__ == "__main__":
    raise SystemExit(main())
