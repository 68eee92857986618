#!/usr/bin/env bash
# Train on this machine: one process per GPU, or NPROC CPU processes (default 2) when there is no GPU.
#   scripts/train_local.sh --epochs 10
#   NPROC=4 scripts/train_local.sh --batch-size 64
set -euo pipefail
CALLER=$PWD
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
# --help, NPROC and MAX_RESTARTS, the flags, the data and the checkpoint, checked once before any
# process starts; it leaves NPROC and the flags with their paths made absolute (scripts/preflight.sh).
source scripts/preflight.sh
{% if cookiecutter.launcher in ("torchrun", "ray") -%}
{%- if cookiecutter.launcher == "ray" %}
# On a Ray cluster: python scripts/train_ray.py --workers N (docs/launching.md); here, torchrun.
{%- endif %}
# torchrun (`python -m torch.distributed.run` is the same program, of this Python).
# --standalone: a private rendezvous on a free port, so several jobs can share the machine.
# --max-restarts: if a worker dies, torchrun restarts the group, which resumes from the newest checkpoint.
# Through runtime/workarounds.py: a mistake found in the processes ends the job at once (no restart
# cures it), and a stop by a signal (Ctrl-C, SIGTERM) with one line, not the agent's traceback.
exec "$PYTHON" -m {{ cookiecutter.package_name }}.runtime.workarounds torchrun --standalone --nproc-per-node="$NPROC" --max-restarts="${MAX_RESTARTS:-3}" train.py "$@"
{%- elif cookiecutter.launcher == "spawn" -%}
# train.py starts the processes itself with mp.spawn and picks a free port.
exec "$PYTHON" train.py --nprocs "$NPROC" "$@"
{%- else -%}
# torch.distributed.launch is deprecated; the same job with torchrun is:
#   torchrun --standalone --nproc-per-node="$NPROC" train.py "$@"
# It passes --local-rank to train.py (add --use-env to pass LOCAL_RANK instead); both are handled.
PORT=${MASTER_PORT:-$("$PYTHON" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")}
exec "$PYTHON" -m torch.distributed.launch --nproc-per-node="$NPROC" --master-port="$PORT" train.py "$@"
{%- endif %}
