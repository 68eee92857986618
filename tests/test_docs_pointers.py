"""Every pointer of a baked project's docs and comments (files, sections, flags) exists in that
bake: its own tests/test_docs.py passes for every answer set of the pairwise set. And the words of
an answer (its tools, scripts and files) appear only in the bakes that chose it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from conftest import PYTHON, answers_id, pairwise_combinations, run

# What only a bake with the answer may say, in its docs, scripts and package: an answer's own
# tools and files. (Every bake detects SLURM and Kubeflow's pods at run time, and handles their
# signals: those words stay.)
ANSWER_WORDS = {
    ("slurm", False): ["sbatch", "scripts/slurm"],
    ("kubernetes", False): ["kubectl", "k8s/", "Dockerfile", "docker build"],
    ("windows_support", False): ["powershell", "train_windows", ".ps1"],
    ("fault_tolerance", "none"): ["torchft", "lighthouse", "train_ft", "REPLICA_GROUP_ID"],
}
for launcher in ("torchrun", "spawn", "launch"):
    ANSWER_WORDS[("launcher", launcher)] = ["train_ray", "Ray Train", "ray start", "KubeRay"]


def test_docs_point_at_what_the_bake_has(baked_once):
    """Two bakes' suites at a time: each is mostly the start of a Python that imports torch."""
    projects = {answers_id(answers): baked_once(**answers) for answers in pairwise_combinations()}

    def docs_test(project):
        # No plugins of the template's Python (hypothesis, benchmark...): a third of each start.
        return run([PYTHON, "-m", "pytest", "-q", "tests/test_docs.py", "-p", "no:cacheprovider"],
                   project, timeout=300, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")

    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(projects, pool.map(docs_test, projects.values()), strict=True))
    failed = {name: r.stdout[-3000:] + r.stderr[-1000:] for name, r in results.items()
              if r.returncode != 0}
    assert not failed, "\n\n".join(f"{name}:\n{out}" for name, out in failed.items())


def test_an_answers_words_appear_only_where_it_was_chosen(baked_once):
    found = []
    for answers in pairwise_combinations():
        project = baked_once(**answers)
        files = [project / "README.md", *(project / "docs").glob("*.md"),
                 *(p for p in (project / "scripts").rglob("*") if p.is_file()),
                 *Path(project).glob("*/**/*.py")]
        texts = {f.relative_to(project).as_posix(): f.read_text() for f in files
                 if not f.relative_to(project).as_posix().startswith("tests/")}
        for (name, value), words in ANSWER_WORDS.items():
            if answers[name] != value:
                continue
            found += [f"{answers_id(answers)}: {path} says {word!r}" for path, text in texts.items()
                      for word in words if word in text]
    assert not found, "\n".join(found)
