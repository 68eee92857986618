"""A real container runtime for the tests: podman with runc, a base image made on this machine, and
a package index in a folder, so that a baked project's Dockerfile builds without the internet.

What this machine needs (and why each setting):
- podman, runc and debootstrap (`apt-get install podman runc debootstrap`), and root;
- `--runtime runc --cgroup-manager cgroupfs`: crun, podman's default runtime, fails on this
  kernel's cgroup v1, and there is no systemd to manage cgroups;
- explicit `--ulimit`s: podman raises the container's process limit to a value this kernel does
  not let runc set ("error setting rlimit type 6: operation not permitted").

The base image stands in for python:3.11-slim: Debian bookworm with its Python 3.11 (the Python of
the torch wheel installed here), `python` and `pip` on the PATH, and pip allowed to install into
the system Python as in the official image. It is kept in podman's image store, so only the first
run on a machine pays for debootstrap (about a minute).
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

PODMAN = ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs"]
BASE_IMAGE = "localhost/ddp-template-base:bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"


def limits() -> list[str]:
    files = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    procs = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    files = 65536 if files == resource.RLIM_INFINITY else min(files, 65536)
    procs = 16384 if procs == resource.RLIM_INFINITY else min(procs, 16384)
    return ["--ulimit", f"nofile={files}:{files}", "--ulimit", f"nproc={procs}:{procs}"]


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: exit {result.returncode}\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def why_not() -> str | None:
    """Why containers cannot be built and run on this machine, or None."""
    if not sys.platform.startswith("linux"):
        return "needs Linux (podman)"
    missing = [name for name in ("podman", "runc", "debootstrap") if shutil.which(name) is None]
    if missing:
        return (f"needs a container runtime ({', '.join(missing)} missing): "
                "apt-get install podman runc debootstrap")
    if os.geteuid() != 0:
        return "needs root to run podman with runc and to debootstrap a base image"
    info = subprocess.run([*PODMAN, "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        return f"podman does not work here: {info.stderr.strip().splitlines()[-1:]}"
    return None


def base_image(workdir: Path) -> str:
    """The local stand-in for python:3.11-slim (see the module's docstring), made once."""
    if podman("image", "exists", BASE_IMAGE, check=False).returncode == 0:
        return BASE_IMAGE
    rootfs = workdir / "rootfs"
    result = subprocess.run(
        ["debootstrap", "--variant=minbase", "--include=python3,python3-pip,python-is-python3",
         "bookworm", str(rootfs), DEBIAN_MIRROR], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"debootstrap failed\n{result.stdout[-3000:]}{result.stderr}"
    # Like the official python images: pip installs into the system Python.
    for marker in rootfs.glob("usr/lib/python3*/EXTERNALLY-MANAGED"):
        marker.unlink()
    shutil.rmtree(rootfs / "var/lib/apt/lists", ignore_errors=True)
    for deb in (rootfs / "var/cache/apt/archives").glob("*.deb"):
        deb.unlink()
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    imported = subprocess.run([*PODMAN, "import", "--change", 'CMD ["python3"]', "-", BASE_IMAGE],
                              stdin=tar.stdout, capture_output=True, text=True, timeout=300)
    tar.stdout.close()
    assert tar.wait() == 0 and imported.returncode == 0, imported.stderr
    shutil.rmtree(rootfs, ignore_errors=True)
    return BASE_IMAGE


def package_index(folder: Path, requirements: list[str]) -> Path:
    """A PEP 503 index in `folder/simple` holding `requirements`, their dependencies and the torch
    installed here (the CPU build), as wheels for the base image's Python 3.11. pip reads it
    through a file:// URL, so a build needs no network."""
    files = folder / "files"
    torch = f"torch=={metadata.version('torch')}"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
         "--python-version", "3.11", "--dest", str(files), torch, *requirements],
        capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"pip download failed\n{result.stdout}{result.stderr}"
    simple = folder / "simple"
    for wheel in files.glob("*.whl"):
        name = wheel.name.split("-")[0].replace("_", "-").replace(".", "-").lower()
        project = simple / name
        project.mkdir(parents=True, exist_ok=True)
        os.link(wheel, project / wheel.name)
    for project in simple.iterdir():
        links = "".join(f'<a href="{w.name}">{w.name}</a>\n' for w in sorted(project.glob("*.whl")))
        (project / "index.html").write_text(f"<!DOCTYPE html>\n<html><body>\n{links}</body></html>\n")
    return simple


def build(project: Path, tag: str, index: Path, **build_args: str) -> float:
    """`podman build` of the project's Dockerfile with `build_args`, offline: the RUN steps see
    `index` on /index (read-only) and a pip.conf that makes it pip's only index. Returns the
    seconds the build took."""
    conf = index.parent / "pip.conf"
    conf.write_text("[global]\nindex-url = file:///index/simple\n")
    args = [f"--build-arg={name}={value}" for name, value in build_args.items()]
    start = time.monotonic()
    podman("build", "--network", "none", *limits(), "--volume", f"{index.parent}:/index:ro",
           "--volume", f"{conf}:/etc/pip.conf:ro", *args, "--tag", tag, str(project),
           timeout=1200)
    return time.monotonic() - start


def image_size(tag: str) -> int:
    return int(podman("image", "inspect", "--format", "{{.Size}}", tag).stdout)
