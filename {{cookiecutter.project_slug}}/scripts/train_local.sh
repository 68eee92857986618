#!/usr/bin/env bash
# Train on this machine: one process per GPU, or NPROC CPU processes (default 2) when there is no GPU.
#   scripts/train_local.sh --epochs 10
#   NPROC=4 scripts/train_local.sh --batch-size 64
set -euo pipefail
CALLER=$PWD
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
for arg in "$@"; do
  if [[ "$arg" == "-h" || "$arg" == "--help" ]]; then exec "$PYTHON" train.py --help; fi
done
# This script's own variables, by name (torchrun would name --nproc-per-node or --max-restarts,
# flags you never typed).
if [[ -n "${NPROC:-}" && ! "$NPROC" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: NPROC=$NPROC: give the processes per machine, 1 or more (unset: one per GPU, or 2)" >&2
  exit 2
fi
if [[ ! "${MAX_RESTARTS:-3}" =~ ^[0-9]+$ ]]; then
  echo "error: MAX_RESTARTS=$MAX_RESTARTS: give how often torchrun may restart the job, 0 or more" >&2
  exit 2
fi
# Checked once, before any process starts (doctor.py's preflight): the flags (a mistake: one error
# line, exit 2), the data and the checkpoint to resume (exit 1), not once per process and restart.
# Relative paths (files, folders, --init-method's store file) are read from where you ran this
# script. Then the processes this machine takes, as the doctor says: one per GPU (per two GPUs
# with --model-layout model_parallel_2), or 2 CPU processes.
# A mistake at task.py's top level (the import runs it: a syntax error, an ImportError, a
# NameError): Python's own lines for it (file, line, error), without our frames; exit 1.
LAUNCH=$("$PYTHON" -c "import os, sys, traceback
try:
    from {{ cookiecutter.package_name }}.doctor import preflight
except Exception as exc:
    ours = sys.modules['{{ cookiecutter.package_name }}'].__path__[0] + os.sep
    tb = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.endswith('task.py')
          or not f.filename.startswith(('<', ours))]
    sys.exit(''.join(traceback.format_list(tb) + traceback.format_exception_only(exc)).rstrip())
print(preflight(sys.argv[2:], caller=sys.argv[1]))" "$CALLER" "$@")
eval "set -- $LAUNCH"  # the process count, then the flags with their paths made absolute
NPROC=${NPROC:-$1}
shift
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
