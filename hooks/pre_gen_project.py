"""Refuse answers that cannot give a working project, before any file is written.

Each problem prints one line, `ERROR: <variable> <value>: <why>; <what would work>`, and exits 1.
Cookiecutter then removes the project folder it created for the hook to run in; a slug with a path
separator still makes exactly one folder (see folder_name.py), so nothing is left behind.
"""

import json
import keyword
import re
import sys

# The answers arrive as JSON so quotes or backslashes in free text cannot break this file.
ANSWERS = json.loads(r"""{{ cookiecutter | tojson }}""")

# Packages the generated project imports, and its own top-level names: a package with one of these
# names would shadow them.
TAKEN = {"torch", "tqdm", "tensorboard", "wandb", "mlflow", "tomli", "numpy", "pytest", "ruff",
         "setuptools", "pip", "train", "tests", "scripts", "configs", "k8s", "conftest"}
SLUG = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


def truthy(value) -> bool:
    return value is True or str(value).strip().lower() in {"true", "yes", "y", "1", "on"}


def problems(a: dict) -> list[str]:
    found = []
    slug, package = str(a["project_slug"]), str(a["package_name"])
    if "/" in slug or "\\" in slug:
        found.append(f"project_slug {slug!r} contains a path separator; use a plain folder name like 'my-project'")
    elif not SLUG.match(slug):
        found.append(f"project_slug {slug!r} must be lower-case letters, digits, '-' or '_' and start with a "
                     "letter or digit; use something like 'my-project'")
    if not package.isidentifier() or not package.isascii():
        found.append(f"package_name {package!r} is not a valid Python identifier; use letters, digits and '_', "
                     "not starting with a digit, like 'my_project'")
    elif keyword.iskeyword(package) or keyword.issoftkeyword(package):
        found.append(f"package_name {package!r} is a Python keyword; use something like '{package}_project'")
    elif package in sys.stdlib_module_names or package in TAKEN:
        found.append(f"package_name {package!r} would shadow the module of the same name; "
                     f"use something like '{package}_project'")
    if truthy(a["windows_support"]) and a["backend"] == "nccl":
        found.append("backend 'nccl' cannot be used with windows_support: NCCL does not exist on Windows; "
                     "choose backend 'gloo' or 'auto'")
    if a["fault_tolerance"] == "torchft" and a["model_layout"] != "data_parallel":
        found.append(f"fault_tolerance 'torchft' averages whole gradients across replica groups and needs "
                     f"model_layout 'data_parallel', not {a['model_layout']!r}; choose one of the two")
    if a["launcher"] == "ray" and a["fault_tolerance"] == "torchft":
        found.append("launcher 'ray' cannot be used with fault_tolerance 'torchft': Ray Train restarts the "
                     "whole group, torchft keeps the other replica groups going; choose one of the two")
    if a["launcher"] == "ray" and truthy(a["windows_support"]):
        found.append("launcher 'ray' cannot be used with windows_support: Ray Train clusters run on Linux; "
                     "choose another launcher, or windows_support 'no'")
    return found


def main() -> int:
    found = problems(ANSWERS)
    for problem in found:
        print(f"ERROR: {problem}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
