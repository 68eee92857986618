"""Docs and comments point at something: every file, section and flag that README.md, docs/*.md
and the package's comments and docstrings name exists in this project as it was made."""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import io
import re
import shlex
import tokenize
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch.distributed.launch
import torch.distributed.run
from conftest import PROJECT_ROOT, import_file, skip_unless_example_task

PACKAGE = next(p.parent for p in PROJECT_ROOT.glob("*/loop.py"))
MARKDOWN = [PROJECT_ROOT / "README.md", *sorted((PROJECT_ROOT / "docs").glob("*.md"))]

# External tools' own flags that the docs name (each is a real flag of that tool). They count only
# where a command, or the paragraph around the flag, names the tool. torchrun, the legacy launcher
# and pytest are not listed: their parsers are asked.
EXTERNAL_FLAGS = {
    "sbatch": {"--nodes", "--ntasks-per-node", "--gpus-per-node", "--gpus-per-task",
               "--cpus-per-task", "--open-mode", "--time", "--signal"},
    "srun": {"--nodes", "--ntasks-per-node", "--gpus-per-node", "--cpus-per-task"},
    "docker": {"--platform", "--build-arg", "--rm", "--shm-size"},
    "kubectl": {"--server-side", "--prefix"},
    "helm": {"--namespace", "--create-namespace", "--version", "--set"},
    "aws": {"--bucket", "--lifecycle-configuration"},
    "tensorboard": {"--logdir"},
    "mlflow": {"--backend-store-uri"},
    "lighthouse": {"--min_replicas"},  # the fault-tolerance lighthouse server
    "hf": {"--local-dir"},  # huggingface_hub's command line (hf download)
    "ray": {"--head", "--address", "--num-cpus", "--num-gpus", "--port", "--force",
            "--node-ip-address"},
}
# Commands that take no long flags in the docs, or pass theirs on: named so that a command line
# starting with them is recognised (a flag after them must then belong to what follows).
NO_FLAGS = {"python", "python3", "env", "ip", "pip", "podman", "powershell", "cruft", "git"}
# Words of a paragraph that bring a command's flags into it (besides train.py's, always there).
NAMED = {
    "torchrun": r"\btorchrun\b|torch\.distributed\.run",
    "launch": r"torch\.distributed\.launch|legacy launcher",
    "doctor": r"\bdoctor\b",
    "export": r"\bexport\b",
    "shards": r"\bshards\b|shard set",
    "predict.py": r"predict\.py",
    "plot_metrics.py": r"plot_metrics\.py",
    "bench_ft.py": r"bench_ft\.py",
    "train_ray.py": r"train_ray\.py",
    "pytest": r"\bpytest\b",
    "sbatch": r"\bSLURM\b|\bsbatch\b|#SBATCH",
    "srun": r"\bsrun\b",
    "docker": r"\bdocker\b|\bpodman\b|Dockerfile",
    "kubectl": r"\bkubectl\b",
    "helm": r"\bhelm\b",
    "aws": r"\baws\b",
    "tensorboard": r"\btensorboard\b",
    "mlflow": r"\bmlflow\b",
    "lighthouse": r"\blighthouse",
    "hf": r"\bhf download\b",
}
# A module's own comments speak of its own command line.
OWN_COMMAND = {"doctor.py": "doctor", "export.py": "export", "workarounds.py": "torchrun",
               "write.py": "shards", "ray_train.py": "train_ray.py"}
# Files a project holds (what a path must start with, or end with, to count as a pointer).
TOP_DIRS = {"docs", "scripts", "tests", "k8s", "configs", ".github", PACKAGE.name}
EXTENSIONS = (".py", ".md", ".sh", ".sbatch", ".ps1", ".yaml", ".yml", ".toml", ".txt")
TOP_FILES = {"Dockerfile", ".dockerignore"}
FOLDERS = [PROJECT_ROOT, *sorted({p.parent for p in PACKAGE.rglob("*.py")}), *(
    PROJECT_ROOT / name for name in ("scripts", "scripts/slurm", "tests", "docs", "configs",
                                     "k8s"))]
# Words that look like pointers but stand for whatever the reader chooses.
PLACEHOLDERS = {
    "file.txt",  # README (language_model): `--data file.txt`, the user's own text
    "--flag", "--name", "--no-name",  # config.py and the tasks: "each field is a --flag"
}


@dataclass
class Piece:
    """A stretch of text: `kind` is prose (a paragraph, list item, table row or comment), code (a
    line of a fenced block, backslashes joined) or python (a fenced block of Python)."""

    source: Path
    line: int
    text: str
    kind: str

    def where(self) -> str:
        return f"{self.source.relative_to(PROJECT_ROOT)}:{self.line}"


def markdown_pieces(path: Path) -> Iterator[Piece]:
    block: list[str] = []
    start = 0
    fence: str | None = None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        stripped = line.strip()
        if fence is not None:
            if stripped.startswith("```"):
                yield from fenced(path, start, block, fence)
                fence, block = None, []
            else:
                block.append(line)
            continue
        new_block = (not stripped or stripped.startswith(("```", "|", "#"))
                     or re.match(r"(-|\d+\.)\s", stripped))
        if new_block and block:
            yield Piece(path, start, "\n".join(block), "prose")
            block = []
        if stripped.startswith("```"):
            fence, start = stripped[3:].strip() or "text", number + 1
        elif stripped:
            start = start if block else number
            block.append(line)
    if block:
        yield Piece(path, start, "\n".join(block), "prose")


def fenced(path: Path, start: int, lines: list[str], language: str) -> Iterator[Piece]:
    if language == "python":
        yield Piece(path, start, "\n".join(lines), "python")
        return
    text = "\n".join(lines).replace("\\\n", " ")
    for offset, line in enumerate(text.splitlines()):
        yield Piece(path, start + offset, line, "code")


def python_pieces(path: Path) -> Iterator[Piece]:
    """Each run of comment lines and each paragraph of a docstring."""
    source = path.read_text(encoding="utf-8")
    comments: list[tuple[int, str]] = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments.append((token.start[0], token.string.lstrip("#").strip()))
    run: list[tuple[int, str]] = []
    for number, text in comments:
        if run and number != run[-1][0] + 1:
            yield Piece(path, run[0][0], "\n".join(t for _, t in run), "prose")
            run = []
        run.append((number, text))
    if run:
        yield Piece(path, run[0][0], "\n".join(t for _, t in run), "prose")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body[0] if node.body else None
            if (isinstance(body, ast.Expr) and isinstance(body.value, ast.Constant)
                    and isinstance(body.value.value, str)):
                line = body.lineno
                for paragraph in body.value.value.split("\n\n"):
                    yield Piece(path, line, paragraph, "prose")
                    line += paragraph.count("\n") + 2


def all_pieces() -> list[Piece]:
    pieces = [p for path in MARKDOWN for p in markdown_pieces(path)]
    return pieces + [p for path in sorted(PACKAGE.rglob("*.py")) for p in python_pieces(path)]


# --- what exists: commands' flags, headings ---------------------------------------------------

def options(parser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}  # argparse's own list


def help_flags(main: Callable[[list[str]], object], *argv: str) -> set[str]:
    """The long flags a command's --help names, asked in this process."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        with contextlib.suppress(SystemExit):
            main([*argv, "--help"])
    return set(re.findall(r"--[A-Za-z][\w-]*", out.getvalue()))


def script_main(name: str) -> Callable[[list[str]], object]:
    return import_file(PROJECT_ROOT / "scripts" / name, f"docs_{name}").main


@pytest.fixture(scope="module")
def flags(pytestconfig) -> dict[str, Callable[[str], bool]]:
    """For each command the docs may name: whether a flag is one of its own."""
    config = importlib.import_module(f"{PACKAGE.name}.config")
    settings = importlib.import_module(f"{PACKAGE.name}.settings")
    task = importlib.import_module(f"{PACKAGE.name}.task")
    doctor = importlib.import_module(f"{PACKAGE.name}.doctor")
    export = importlib.import_module(f"{PACKAGE.name}.checkpoint.export")
    train = options(settings.build_parser(config.Config, getattr(task, "Settings", None)))
    doctor_parser = settings.build_parser(config.Config, getattr(task, "Settings", None))
    doctor.add_plan_flags(doctor_parser)
    known: dict[str, set[str]] = {
        "train.py": train,
        "doctor": options(doctor_parser),
        "export": help_flags(export.main, "export"),
        "shards": help_flags(importlib.import_module(f"{PACKAGE.name}.shards.write").main),
        "torchrun": options(torch.distributed.run.get_args_parser()),
        "launch": help_flags(torch.distributed.launch.parse_args),  # adds --use-env
        **EXTERNAL_FLAGS,
        **{name: set() for name in NO_FLAGS},
    }
    if (PROJECT_ROOT / "train_ft.py").exists():
        known["train_ft.py"] = train  # the same parser: train_ft.py only trains differently
    for script in ("predict.py", "plot_metrics.py", "bench_ft.py", "train_ray.py"):
        if (PROJECT_ROOT / "scripts" / script).exists():
            known[script] = help_flags(script_main(script))

    def pytest_has(flag: str) -> bool:
        try:
            pytestconfig.getoption(flag)
        except ValueError:
            return False
        return True

    checks: dict[str, Callable[[str], bool]] = {name: s.__contains__ for name, s in known.items()}
    checks["pytest"] = pytest_has
    return checks


def headings(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return [m.replace("`", "").strip() for m in re.findall(r"^#+\s+(.*)$", text, flags=re.M)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


# --- what the docs name ---------------------------------------------------------------------

FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
SECTION = re.compile(r"(README(?:\.md)?|[\w./-]+\.md)\)?,?\s+\(?[\"“]([^\"”\n]+)[\"”]")
WORD = re.compile(r"&&|\|\||[;&|]|[^\s`'\"()\[\],;|&=]+")


def named_flags(text: str) -> Iterator[str]:
    for match in FLAG.finditer(text):
        after = text[match.end():match.end() + 1]
        if not match.group().endswith("-") and after not in {"*", "<"}:  # --no-..., --rdzv-*
            yield match.group()


def program(word: str, previous: str) -> str | None:
    """The command a word of a command line starts, if it starts one."""
    word = word.strip("\"'").replace("\\", "/")
    name = word.rsplit("/", 1)[-1]
    if previous == "-m":  # python -m MODULE, torchrun -m MODULE
        module = name.removeprefix(f"{PACKAGE.name}.")
        return {"torch.distributed.run": "torchrun", "torch.distributed.launch": "launch",
                "doctor": "doctor", "checkpoint": "export"}.get(module, module)
    if name.endswith((".sh", ".sbatch")):
        return "train.py"  # the scripts pass their flags on to train.py (train_ft.py)
    if word == "#SBATCH":
        return "sbatch"
    known = name in EXTERNAL_FLAGS or name in NO_FLAGS or name in {"torchrun", "pytest"}
    return name if known or name.endswith(".py") else None


def command_flags(text: str) -> Iterator[tuple[str | None, str]]:
    """(command, flag) for each flag of a command line; None before any known command."""
    command: str | None = None
    previous = ""
    for word in WORD.findall(text):
        started = program(word, previous)
        if started is not None and not word.startswith("-"):
            command = started
        elif word in {"&&", "||", "&", "|", ";"}:
            command = None
        for flag in named_flags(word):
            yield command, flag
        previous = word


def is_command(span: str) -> bool:
    words = [w for w in WORD.findall(span) if not re.match(r"[A-Z_][A-Z0-9_]*=", w)]
    return bool(words) and program(words[0], "") is not None


def path_pointers(text: str) -> Iterator[str]:
    """Words that name a file of the project (not /abs, ~/x, URLs, globs or <placeholders>)."""
    for word in re.findall(r"[^\s`'\"()\[\],;|=]+", text):
        word = word.rstrip(".:").replace("\\", "/")  # scripts\train_windows.ps1
        # /abs, ~/home, $VAR, URLs and host:port, user@host, globs, <placeholders>, NNNN, ...
        if (not word or word in PLACEHOLDERS or word[0] in "/~$%"
                or re.search(r"[:@*<>]|NNNN|\.\.\.", word)):
            continue
        word = word.removeprefix("./")
        top = word.split("/", 1)[0]
        if word in TOP_FILES or ("/" in word and top in TOP_DIRS) or (
                "/" not in word and word.endswith(EXTENSIONS)):
            yield word


def file_exists(pointer: str, source: Path) -> bool:
    if "/" not in pointer and not pointer.startswith("."):  # a bare name: any folder of ours
        return any((folder / pointer).exists() for folder in FOLDERS)
    return any((base / pointer).exists() for base in (PROJECT_ROOT, source.parent, PACKAGE))


def module_exists(parts: list[str]) -> bool:
    """pkg.a.b.attr: each folder a package of ours, down to a module (what follows is its own)."""
    folder = PACKAGE
    for part in parts:
        if (folder / f"{part}.py").exists():
            return True
        if not (folder / part / "__init__.py").exists():
            return False
        folder = folder / part
    return True


# --- the tests --------------------------------------------------------------------------------

PIECES = all_pieces()


def settings_flags(code: str) -> set[str]:
    """The flags a `class Settings` in a document's Python example declares."""
    found = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ClassDef) and node.name == "Settings":
            for field in node.body:
                if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name):
                    name = field.target.id.replace("_", "-")
                    found.add(f"--{name}")
                    if ast.unparse(field.annotation) == "bool":  # --name and --no-name
                        found.add(f"--no-{name}")
    return found


# A document's own example Settings define flags that document may name.
DOC_SETTINGS = {path: {flag for p in PIECES if p.source == path and p.kind == "python"
                       for flag in settings_flags(p.text)} for path in MARKDOWN}


def command_problems(piece: Piece, line: str,
                     flags: dict[str, Callable[[str], bool]]) -> Iterator[str]:
    for command, flag in command_flags(line):
        if command is None or not flags.get(command, lambda _: False)(flag):
            yield f"{piece.where()}: {flag} ({command or 'no known command'})"


def test_the_docs_are_read():
    """The reader finds what it should, so that an empty list below means something."""
    kinds = {p.kind for p in PIECES}
    assert {"prose", "code"} <= kinds
    assert any("--epochs" in p.text for p in PIECES if p.source.name == "README.md")
    assert any(p.source.parent == PACKAGE for p in PIECES)


def test_every_named_file_exists():
    dead = []
    for piece in PIECES:
        text = piece.text
        if piece.kind == "prose":
            for target in LINK.findall(text):
                path = target.split("#", 1)[0]
                if path and "://" not in path and not (piece.source.parent / path).exists():
                    dead.append(f"{piece.where()}: link to {path}")
            text = LINK.sub(lambda m: m.group()[:m.group().index("](") + 1], text)
        for pointer in path_pointers(text):
            if not file_exists(pointer, piece.source):
                dead.append(f"{piece.where()}: {pointer}")
        for module in re.findall(rf"\b{PACKAGE.name}((?:\.\w+)+)", text):
            if not module_exists(module.split(".")[1:]):
                dead.append(f"{piece.where()}: module {PACKAGE.name}{module}")
    assert not dead, "\n".join(dead)


def test_every_named_section_exists():
    dead = []
    for piece in PIECES:
        if piece.kind != "prose":
            continue
        for target in LINK.findall(piece.text):
            path, _, anchor = target.partition("#")
            file = piece.source if not path else piece.source.parent / path
            if anchor and "://" not in path and file.suffix == ".md" and file.exists():
                if anchor not in {slug(h) for h in headings(file)}:
                    dead.append(f"{piece.where()}: {target}")
        for name, title in SECTION.findall(piece.text.replace("\n", " ")):
            name = "README.md" if name.startswith("README") else name
            files = [base / name for base in (PROJECT_ROOT, piece.source.parent)]
            file = next((f for f in files if f.is_file()), None)
            found = file is not None and any(
                h == title or (h.startswith(title) and h[len(title)] in ":(")
                for h in headings(file))
            if not found:
                dead.append(f"{piece.where()}: {name}, \"{title}\"")
    assert not dead, "\n".join(dead)


def test_every_named_flag_exists(flags):
    # The docs show the example task's own flags (--hidden-size, ...): a task of your own
    # replaces them, and then this check skips (the files and sections are still checked).
    skip_unless_example_task()
    dead = []
    for piece in PIECES:
        if piece.kind == "code":
            dead += command_problems(piece, piece.text, flags)
            continue
        # A command in backticks is checked as a command line; the other flags as prose.
        text = piece.text
        for span in filter(is_command, re.findall(r"`([^`]+)`", text)):
            text = text.replace(f"`{span}`", " ")
            dead += command_problems(piece, span, flags)
        named = [c for c, words in NAMED.items() if re.search(words, piece.text)]
        own = OWN_COMMAND.get(piece.source.name, "train.py")  # doctor.py speaks of the doctor
        commands = list(dict.fromkeys(["train.py", own, *named]))
        for flag in named_flags(text):
            if flag in PLACEHOLDERS or flag in DOC_SETTINGS.get(piece.source, set()):
                continue
            if not any(flags[c](flag) for c in commands if c in flags):
                dead.append(f"{piece.where()}: {flag} (not a flag of {', '.join(commands)})")
    assert not dead, "\n".join(dead)


def test_the_module_table_names_every_module():
    """docs/configuration.md's table of files names every module of this project's package."""
    text = (PROJECT_ROOT / "docs/configuration.md").read_text(encoding="utf-8")
    table = text.split("\n## Files", 1)[1]
    named = {m.removeprefix(f"{PACKAGE.name}/") for m in re.findall(r"`([\w/]+\.py)`", table)}
    modules = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
               if p.name != "__init__.py"}
    assert sorted(modules - named) == []


def test_the_optional_task_functions_are_listed_alike():
    """The README's table of task.py's functions and task.py's own docstring list the same
    optional functions (the docstring is the example's: a task of your own may say less)."""
    skip_unless_example_task()
    readme = (PROJECT_ROOT / "README.md").read_text(encoding="utf-8")
    rows = [row for row in readme.splitlines() if row.startswith("| `") and "(optional)" in row]
    in_readme = {name for row in rows for name in re.findall(r"`(\w+)\(", row.split("|")[1])}
    docstring = ast.get_docstring(ast.parse((PACKAGE / "task.py").read_text(encoding="utf-8")))
    optional = docstring.split("Optional:", 1)[1]
    in_task = set(re.findall(r"^\s+(\w+)\(", optional, re.MULTILINE)) | set(
        re.findall(r", (\w+)\(", optional))
    assert in_readme == in_task and len(in_readme) >= 8, (in_readme, in_task)


def flags_table() -> str:
    """The table of docs/configuration.md's "Every flag": train.py's flags section by section, each
    with its default and its help as `--help` gives them (task.py's own settings are the task's:
    `python train.py --help` lists them)."""
    from {{ cookiecutter.package_name }}.config import Config
    from {{ cookiecutter.package_name }}.settings import build_parser

    rows = ["| flag | default | what it does |", "|---|---|---|"]
    for group in build_parser(Config, None)._action_groups:
        actions = [a for a in group._group_actions if a.dest != "help"]
        if actions:
            rows.append(f"| **{group.title}** | | |")
        for action in actions:
            flags = ", ".join(f"`{option}`" for option in action.option_strings)
            # As --help: a help that states its default itself (--no-progress's) has no other.
            stated = action.default in (None, []) or "(default:" in action.help
            default = "" if stated else f"`{action.default}`"
            what = action.help.replace("|", "\\|")
            if action.choices:
                what += f" (one of {', '.join(map(str, action.choices))})"
            rows.append(f"| {flags} | {default} | {what} |")
    return "\n".join(rows)


def test_the_flags_reference_is_the_declarations():
    """docs/configuration.md's table of every flag is generated from the settings' declarations:
    a flag added, renamed or re-documented fails this test, which prints the table anew."""
    doc = (PROJECT_ROOT / "docs/configuration.md").read_text(encoding="utf-8")
    table = doc.split("<!-- flags table -->\n", 1)[1].split("\n<!-- end of flags table -->", 1)[0]
    expected = flags_table()
    assert table == expected, f"docs/configuration.md's flags table should be:\n{expected}"


# --- shell blocks: tests/test_doc_commands.py runs them, or they say why not ----------------------

NOT_RUN = re.compile(r"<!--\s*not run by the tests:\s*(.+?)\s*-->")
# What test_doc_commands.py runs (pip and pytest lines it checks: they install, or are this suite).
RUNS_HERE = {"python", "torchrun", "ls", "train_local.sh", "pip", "pytest"}


@dataclass
class Block:
    """A fenced shell block: its commands (continuations joined), and why it is not run, from the
    `<!-- not run by the tests: why -->` line just above it."""

    source: Path
    line: int
    commands: list[str]
    why_not: str | None

    def where(self) -> str:
        return f"{self.source.relative_to(PROJECT_ROOT)}:{self.line}"


def shell_blocks(path: Path) -> list[Block]:
    blocks: list[Block] = []
    above, body, language, start, mark = "", None, "", 0, None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        stripped = line.strip()
        if body is not None and stripped.startswith("```"):
            if language in {"bash", "sh", "shell"}:
                text = "\n".join(body).replace("\\\n", " ")
                blocks.append(Block(path, start, [c.strip() for c in text.splitlines()
                                                  if c.strip()], mark and mark.group(1)))
            body = None
        elif body is not None:
            body.append(line)
        elif stripped.startswith("```"):
            language, body, start = stripped[3:].strip(), [], number + 1
            mark = NOT_RUN.fullmatch(above)
        if stripped:
            above = stripped
    return blocks


def command_words(command: str) -> tuple[dict[str, str], list[str]]:
    """A command line's leading VAR=value assignments, and its words (its comment left out)."""
    words = shlex.split(command, comments=True)
    env = {}
    while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    return env, words


def extras() -> set[str]:
    section = (PROJECT_ROOT / "pyproject.toml").read_text(encoding="utf-8").split(
        "[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([\w-]+) = \[", section, re.MULTILINE))


def test_every_shell_block_runs_in_the_suite_or_says_why_not():
    """tests/test_doc_commands.py runs each command of a block not marked: one it could not run
    (a cluster's tool, a job in the background, a pipe) needs its block marked with the reason.
    A `pip install -e ".[extra]"` names extras that pyproject.toml has."""
    problems, declared = [], extras()
    for path in MARKDOWN:
        for block in (b for b in shell_blocks(path) if not b.why_not):
            for command in block.commands:
                _, words = command_words(command)
                name = words[0].rsplit("/", 1)[-1] if words else ""
                if name not in RUNS_HERE or {"&", "&&", "|", "||", ";"} & set(words):
                    problems.append(f"{block.where()}: {command}")
                for extra in re.findall(r"\.\[([\w,-]+)\]", command) if name == "pip" else []:
                    problems += [f"{block.where()}: no extra {e!r}" for e in extra.split(",")
                                 if e not in declared]
    assert not problems, ("tests/test_doc_commands.py cannot run these: mark each block with "
                          "`<!-- not run by the tests: why -->`\n" + "\n".join(problems))
