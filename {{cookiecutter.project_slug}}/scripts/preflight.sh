# shellcheck shell=bash
# Sourced by train_local.sh and train_multinode.sh, in the project's folder, with CALLER (where
# you ran the script), PYTHON and the script's flags as "$@". Checked once, before any process
# starts: --help, this script's own variables, then (doctor.py's preflight) the flags (a mistake:
# one error line, exit 2), the data and the checkpoint to resume (exit 1), not once per process
# and restart. Relative paths (files, folders, --init-method's store file) are read from CALLER.
# It leaves NPROC, the processes this machine takes (as the doctor says: one per GPU, per two GPUs
# with --model-layout model_parallel_2, or 2 CPU processes; NPROC set overrides it), and "$@", the
# flags with their paths made absolute.
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
# A mistake at task.py's top level (the import runs it: a syntax error, an ImportError, a
# NameError): Python's own lines for it (file, line, error), without our frames, as train.py
# gives them on import; exit 1.
LAUNCH=$("$PYTHON" -c "import sys, train
from {{ cookiecutter.package_name }}.doctor import preflight
print(preflight(sys.argv[2:], caller=sys.argv[1]))" "$CALLER" "$@")
eval "set -- $LAUNCH"  # the process count, then the flags with their paths made absolute
NPROC=${NPROC:-$1}
shift
