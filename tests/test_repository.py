"""Rules for the repository itself: test traffic stays on this machine, and nothing stray sits at
the template's top level."""

from __future__ import annotations

import ipaddress
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "{{cookiecutter.project_slug}}" / "tests"))
from hosts import SUBNET  # noqa: E402  (the generated project's test hosts)

# Where tests may send traffic: this machine, and the LAN of the test hosts the tests make in
# network namespaces (nothing outside those namespaces holds these addresses).
ALLOWED = [ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"),
           ipaddress.ip_network(f"{SUBNET}.0/24")]
# A line dials the addresses on it when it holds one of these: a store or rendezvous address, or a
# socket connection. An address that is only parsed (an environment in a unit test) is fine.
DIALS = re.compile(r"tcp://|--init-method|--master[-_]addr|rdzv[-_]endpoint|"
                   r"create_connection\(|\.connect\(")
ADDRESS = re.compile(r"(?<![\w.])(\d{1,3}(?:\.\d{1,3}){3})(?![\w.])|\[([0-9a-fA-F:]+)\]")
SOURCES = ["tests", "bench", "{{cookiecutter.project_slug}}/tests",
           "{{cookiecutter.project_slug}}/scripts"]


def dialed_outside(text: str) -> list[str]:
    """Literal addresses outside ALLOWED on lines that dial them."""
    found = []
    for line in text.splitlines():
        if not DIALS.search(line):
            continue
        for match in ADDRESS.finditer(line):
            try:
                address = ipaddress.ip_address(match.group(1) or match.group(2))
            except ValueError:
                continue
            if not any(address in network for network in ALLOWED):
                found.append(f"{address}: {line.strip()}")
    return found


def test_the_checker_tells_outside_addresses_from_local_ones():
    assert dialed_outside('["--init-method", "tcp://10.255.255.1:29999"]')
    assert dialed_outside("socket.create_connection(('8.8.8.8', 53))")
    assert dialed_outside("torchrun --rdzv-endpoint=[2001:db8::1]:29400 train.py")
    assert not dialed_outside('"tcp://127.0.0.1:29500" and f"tcp://{SUBNET}.99:1"')
    assert not dialed_outside(f'["--master-addr", "{SUBNET}.1"]')
    assert not dialed_outside('{"MASTER_ADDR": "10.0.0.1"}')  # parsed, not dialed


def test_tests_scripts_and_the_benchmark_dial_only_this_machine():
    offenders = []
    for folder in SOURCES:
        for path in (ROOT / folder).rglob("*"):
            if path == Path(__file__).resolve():
                continue  # the checker's own examples above are never dialed
            if path.suffix in (".py", ".sh", ".sbatch", ".yaml", ".toml") and path.is_file():
                offenders += [f"{path.relative_to(ROOT)}: {hit}"
                              for hit in dialed_outside(path.read_text())]
    assert not offenders, "\n".join(offenders)


# The top level of the template, by design (DEVELOPERS.md): nothing else belongs there.
TOP_LEVEL = {"cookiecutter.json", "{{cookiecutter.project_slug}}", "hooks", "tests", "README.md",
             ".ci", ".gitignore", "Makefile", "pyproject.toml", "requirements-dev.txt", "bench",
             "LICENSE"}


def test_nothing_stray_at_the_top_level():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout: cannot tell tracked files from local ones")
    names = {line.split("/", 1)[0] for line in tracked.stdout.splitlines()}
    stray = sorted(names - TOP_LEVEL)
    assert not stray, f"files at the template's top level that are not part of its design: {stray}"
