# make demo: bake a project with the default answers into .demo/ and train it as its README's
# quickstart does (one process per GPU, or 2 CPU processes).
# make test: the template's whole test suite (what CI runs); it ends with the slowest tests and the
# seconds per test file.
# make bench: the benchmark (not part of the tests).
# make gpu-check: on a GPU machine, the default project's quickstart, tests and GPU benchmark in
# about 8 minutes (bench/gpu_check.py; results in bench/results/gpu-check/).
# make torch-range TORCH="2.6.0 2.14.1": on each torch release, installed as a user does, the
# default project keeps that torch with every extra, its quickstart trains and its `pytest -q`
# passes; on the floor, 2.9.1 and the newest also the --full tests of its private-torch seams
# (bench/torch_range.py; wheels cached in ~/.cache/torch-range; 4-20 minutes per release).
# Without TORCH: every minor release from the floor, 2.6.0, to 2.14.1.
# make combos: a pairwise set of the answers that change a run (some 20-25 bakes: every value of
# launcher, backend, init_method, task, model_layout, tracker, fault_tolerance and the yes/no
# answers beside every other), each baked, installed into a fresh venv as its README says (TORCH
# first), trained for one short epoch and its `pytest -q` run (bench/combos.py; results in
# bench/results/combos/; the defaults took 7 minutes on 2 cores, all of them 3-4 hours;
# `python bench/combos.py --list` names them). Not in CI.
# make bench-hf: one small Llama fine-tuned by a task=hf_causal_lm bake and by transformers.Trainer
# (same folder, windows, batch, lr and steps; 2 CPU processes, or one GPU with GPU=1), alternating;
# prints `per-step ours/Trainer: R` (bench/hf.py; Trainer's accelerate goes into bench/.venv-hf).
# make gpu-levers: on one GPU, what each of the language-model task's levers is worth at GPT-2 small
# in about 7 minutes (bench/levers.py; results in bench/results/levers/).
PYTHON ?= python3
# Installed only when `import torch` fails. Override for your platform, e.g. TORCH="torch==2.14.1".
TORCH ?= torch==2.13.0

.PHONY: setup demo test lint bench bench-hf gpu-check gpu-levers torch-range combos

setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "$(TORCH)"
	$(PYTHON) -m pip install -q -r requirements-dev.txt

demo: setup
	rm -rf .demo
	$(PYTHON) -m cookiecutter --no-input --output-dir .demo .
	cd .demo/ddp-project && PYTHON=$(PYTHON) scripts/train_local.sh --epochs 3 --no-progress
	@echo "metrics: $(CURDIR)/.demo/ddp-project/runs/latest/metrics.jsonl"

lint:
	$(PYTHON) -m ruff check hooks tests bench

# Two passes: first the parts that mostly wait on one core (the Ray bake's cluster, a container
# image built, one-node SLURM and pods restarting, bakes read, the benchmark's smoke run), two
# files at a time, longest first (xdist would order them by their number of tests); then the rest
# one at a time (each keeps both cores busy, and torchft's timing checks need them). Both always
# run; `make test` fails if either did.
WAITING_TESTS = tests/test_ray_bake.py tests/test_container.py tests/test_slurm_cluster.py \
	tests/test_kubernetes.py tests/test_bench.py tests/test_docs_pointers.py tests/test_bake.py \
	tests/test_cruft.py tests/test_hooks.py tests/test_workflow.py tests/test_repository.py

test: setup lint
	status=0; \
	$(PYTHON) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=10 \
		$(WAITING_TESTS) || status=1; \
	$(PYTHON) -m pytest -q --durations=25 $(WAITING_TESTS:%=--ignore=%) || status=1; \
	exit $$status

# The generated Trainer against a raw DDP loop, DataLoader, the tutorial style and Lightning (see README).
bench: setup
	$(PYTHON) bench/run.py

bench-hf: setup
	$(PYTHON) bench/hf.py $(if $(GPU),--gpu)

# Needs torch with CUDA, pytest and cookiecutter (or WHEELS=DIR, a folder of its wheels): no network.
gpu-check:
	$(PYTHON) bench/gpu_check.py $(if $(WHEELS),--wheels $(WHEELS))

gpu-levers:
	$(PYTHON) bench/levers.py $(if $(WHEELS),--wheels $(WHEELS))

# TORCH given on the command line: its releases ("torch==" may prefix them); else the matrix's.
torch-range:
	$(PYTHON) bench/torch_range.py $(if $(filter command line,$(origin TORCH)),$(TORCH))

# Every venv gets $(TORCH) first, as a user pins it; run it alone (it keeps both cores busy).
combos: setup
	$(PYTHON) bench/combos.py --torch "$(TORCH)"
