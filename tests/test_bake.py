"""Every answer bakes: exact file set, nothing left unrendered, code that compiles, lints and
parses, and defaults that match the answers."""

from __future__ import annotations

import ast
import re
import shutil
import tomllib

import pytest
from conftest import (
    CHOICES,
    PYTHON,
    answers_id,
    check_ok,
    expected_files,
    pairwise_combinations,
    project_files,
    run,
)

COMBINATIONS = pairwise_combinations()


def test_pairwise_covers_every_choice_of_every_answer():
    for name, values in CHOICES.items():
        assert {c[name] for c in COMBINATIONS} == set(values), name
    assert "task" in CHOICES and len(CHOICES["tracker"]) == 4 and "fsdp" in CHOICES["model_layout"]
    assert len(COMBINATIONS) < 30


@pytest.mark.parametrize("answers", COMBINATIONS, ids=answers_id)
def test_bake_gives_exactly_the_files_of_the_answers(baked_once, answers):
    project = baked_once(**answers)
    assert project.name == "ddp-project"
    assert project_files(project) == expected_files("ddp_project", answers)
    # No empty folders left behind by the post-generation clean-up.
    assert all(any(d.iterdir()) for d in project.rglob("*") if d.is_dir())


@pytest.mark.parametrize("answers", COMBINATIONS, ids=answers_id)
def test_baked_code_renders_compiles_and_lints(baked_once, answers):
    project = baked_once(**answers)
    for rel in project_files(project):
        text = (project / rel).read_text(encoding="utf-8")
        for marker in ("{{", "{%", "cookiecutter"):
            if rel != ".github/workflows/ci.yml" or marker == "{%":  # GitHub's own ${{ }}
                assert marker not in text, f"{rel} contains {marker!r}"
        if rel.endswith(".py"):
            compile(text, rel, "exec")
        if rel.endswith((".sh", ".sbatch")):
            check_ok(run(["bash", "-n", rel], project))
            assert (project / rel).stat().st_mode & 0o111, f"{rel} is not executable"
            if "pipefail" in text:
                assert breakable_pipes(text) == [], rel
    check_ok(run([shutil.which("ruff") or "ruff", "check", "--no-cache", "."], project))


def breakable_pipes(script: str) -> list[str]:
    """The pipelines of a shell script that end in a reader that may stop before its writer
    (head, grep -q, grep -m): the writer then dies of SIGPIPE, which fails the pipeline (141)
    under pipefail (issue 55)."""
    script = re.sub(r"(\\|\|)[ \t]*\n", r"\1 ", script)  # one line per continued command
    found = []
    for line in script.splitlines():
        code = re.sub(r"(^|\s)#.*", "", line)
        for reader in re.split(r"(?<!\|)\|&?(?!\|)", code)[1:]:
            words = reader.split()
            if words[:1] == ["head"] or words[:1] == ["grep"] and any(
                    re.fullmatch(r"-[a-zA-Z]*[qm].*|--(quiet|silent|max-count).*", w)
                    for w in words[1:]):
                found.append(line.strip())
    return found


def test_breakable_pipes_are_found():
    assert breakable_pipes('X=$(scontrol show hostnames "$L" | head -n 1)\n') != []
    assert breakable_pipes("ps ax |\n  grep -qE torchrun && x\nls | grep -m1 a\n") != []
    assert breakable_pipes("a || b | grep x  # | head\nNODES=${N%%$'\\n'*}\n") == []


@pytest.mark.parametrize("answers", COMBINATIONS, ids=answers_id)
def test_the_answers_are_the_projects_defaults(baked_once, answers):
    project = baked_once(**answers)
    readme = (project / "README.md").read_text()
    local = (project / "scripts/train_local.sh").read_text()
    lead = {"torchrun": "torchrun --standalone", "spawn": "python train.py --nprocs",
            "launch": "-m torch.distributed.launch",
            "ray": "python scripts/train_ray.py"}[answers["launcher"]]
    assert lead in readme.split("## Your model")[0] and lead.split()[-1] in local
    config = (project / "ddp_project/config.py").read_text()
    for name in ("backend", "init_method", "model_layout", "tracker"):
        assert f'DEFAULT_{name.upper()} = "{answers[name]}"' in config
    task = (project / "ddp_project/task.py").read_text()
    assert {"classification": "class SmallCNN", "regression": "class MLP",
            "language_model": "class TinyGPT",
            "hf_causal_lm": "def save_pretrained"}[answers["task"]] in task
    dependencies = " ".join(tomllib.loads((project / "pyproject.toml").read_text())["project"]
                            ["dependencies"])
    for tracker, package in (("tensorboard", "tensorboard"), ("wandb", "wandb"),
                             ("mlflow", "mlflow-skinny")):
        assert (package in dependencies) == (answers["tracker"] == tracker), tracker
    assert ("numpy" in dependencies) == (answers["model_layout"] in ("fsdp", "tensor_parallel"))
    for package in ("transformers", "tokenizers", "safetensors", "peft"):  # the HF task's only
        assert (package in dependencies) == (answers["task"] == "hf_causal_lm"), package
    extras = tomllib.loads((project / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    if answers["fault_tolerance"] == "torchft":
        assert extras["ft"] == ["torchft>=0.2.0,<0.3"]
    else:  # `none` bakes no trace of torchft: no extra, no file, no word of it
        assert "ft" not in extras
        mentions = [rel for rel in project_files(project)
                    if "torchft" in (project / rel).read_text(encoding="utf-8").lower()]
        assert not mentions, mentions
    if answers["launcher"] == "ray":
        assert extras["ray"] == ["ray[train]>=2.60,<3"]
    else:  # the other launchers bake no trace of Ray: no extra, no file, no word of it
        assert "ray" not in extras
        # (tests/test_docs.py knows the flags of every tool the docs may name, Ray's too.)
        mentions = [rel for rel in project_files(project) if rel != "tests/test_docs.py" and
                    re.search(r"\bray\b|kuberay", (project / rel).read_text(encoding="utf-8"),
                              re.I)]
        assert not mentions, mentions
    # requirements.txt (what the Dockerfile installs before the project itself) lists the same.
    requirements = [line.strip() for line in (project / "requirements.txt").read_text().splitlines()
                    if line.strip() and not line.startswith("#")]
    assert requirements == tomllib.loads((project / "pyproject.toml").read_text())["project"][
        "dependencies"]


def test_names_are_derived_and_free_text_is_quoted_safely(bake):
    project = bake(project_name="Vision Net 2", description='Says "hi" and \\ it\'s fine',
                   author_name="O'Brien \"Bob\"")
    assert project.name == "vision-net-2"
    assert expected_files("vision_net_2", {}) == project_files(project)
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    assert meta["description"] == 'Says "hi" and \\ it\'s fine'
    assert meta["authors"] == [{"name": "O'Brien \"Bob\""}]
    check_ok(run([PYTHON, "-c", "import vision_net_2.main"], project))


def test_help_runs_in_a_baked_project(bake):
    project = bake()
    result = check_ok(run([PYTHON, "train.py", "--help"], project))
    assert "--stage-devices" in result.stdout and "--local_rank" in result.stdout
    assert "--async-save" in result.stdout and "--config" in result.stdout


def _intra_package_imports(module: str, tree: ast.AST, modules: set[str]) -> set[str]:
    """The package's own modules `module` imports, anywhere in it (lazily or for type checking
    too: a lazy import is still a circle a reader has to keep in mind)."""
    found = set()
    package = module.rsplit(".", 1)[0] if not module.endswith("__init__") else module
    package = package.removesuffix(".__init__")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{alias.name}" for alias in node.names] + [target]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            if name in modules:
                found.add(name)
            elif f"{name}.__init__" in modules:
                found.add(f"{name}.__init__")
    found.discard(module)
    return found


# The bakes whose packages differ: each optional module, and each task.py.
SIZED_BAKES = [{}, {"launcher": "ray"}, {"fault_tolerance": "torchft"},
               {"model_layout": "tensor_parallel", "task": "language_model"},
               {"task": "regression"}, {"task": "language_model"}, {"task": "hf_causal_lm"}]


@pytest.mark.parametrize("answers", SIZED_BAKES, ids=answers_id)
def test_every_bake_stays_within_the_size_rules(bake, answers):
    """Issue 39's rules, in every bake with modules of its own (Ray's, torchft's, tensor_parallel's)
    and with each task.py: no module over 300 lines, no function over 60, no import circle, and the
    modules a user reads (task, loop, main, optim, evaluation, config, settings, data, step) under
    2,200 lines. The package's total has no ceiling (dropped): these rules keep each part
    readable however many parts a bake has."""
    package = bake(**answers) / "ddp_project"
    trees, sizes = {}, {}
    for path in sorted(package.rglob("*.py")):
        name = ".".join(("ddp_project",) + path.relative_to(package).with_suffix("").parts)
        text = path.read_text()
        sizes[name], trees[name] = len(text.splitlines()), ast.parse(text)
    assert {n: s for n, s in sizes.items() if s > 300} == {}
    read = ("task", "loop", "main", "optim", "evaluation", "config", "settings", "data", "step")
    assert sum(sizes[f"ddp_project.{name}"] for name in read) < 2200
    long_functions = [f"{name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
                      for name, tree in trees.items() for node in ast.walk(tree)
                      if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                      and node.end_lineno - node.lineno + 1 > 60]
    assert long_functions == []
    graph = {name: _intra_package_imports(name, tree, set(trees)) for name, tree in trees.items()}

    def circle_from(start: str) -> list[str] | None:
        stack = [(start, [start])]
        seen = set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    return path + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
        return None

    circles = [c for c in map(circle_from, sorted(graph)) if c]
    assert circles == [], circles[0]
