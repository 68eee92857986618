#!/usr/bin/env bash
# Fault-tolerant training with torchft (docs/fault-tolerance.md): one lighthouse, and replica groups
# that are each an ordinary torchrun job on this machine. Start the lighthouse once, then each group:
#   scripts/train_ft.sh lighthouse &                        # listens on LIGHTHOUSE_PORT (29510)
#   REPLICA_GROUP_ID=0 scripts/train_ft.sh group --epochs 10
#   REPLICA_GROUP_ID=1 scripts/train_ft.sh group --epochs 10
# A group on several machines: scripts/train_multinode.sh with TRAIN_SCRIPT=train_ft.py and the
# same variables. Settings (environment): TORCHFT_LIGHTHOUSE (default http://localhost:29510),
# NUM_REPLICA_GROUPS (default 2), TORCHFT_MIN_REPLICAS (default 1: a group alone goes on),
# NPROC (processes per group: one per GPU, or 2), HEARTBEAT_TIMEOUT_MS (the lighthouse's,
# default 5000), LIGHTHOUSE_LOG (default runs/lighthouse.log).
# Each group keeps its own runs/groupN and checkpoints/groupN unless you pass other folders.
set -euo pipefail
usage="usage: $0 lighthouse | group [train_ft.py flags...]"
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
case "${1:-}" in
  lighthouse)
    shift
    # It logs a few lines per step: to a file, not to the terminal the groups may share.
    LOG=${LIGHTHOUSE_LOG:-runs/lighthouse.log}
    mkdir -p "$(dirname "$LOG")"
    echo "torchft lighthouse on port ${LIGHTHOUSE_PORT:-29510}; its log: $LOG"
    exec >> "$LOG" 2>&1
    exec torchft_lighthouse --bind "[::]:${LIGHTHOUSE_PORT:-29510}" \
      --min_replicas "${TORCHFT_MIN_REPLICAS:-1}" \
      --heartbeat_timeout_ms "${HEARTBEAT_TIMEOUT_MS:-5000}" \
      --join_timeout_ms "${JOIN_TIMEOUT_MS:-10000}" "$@"
    ;;
  group)
    shift
    : "${REPLICA_GROUP_ID:?set REPLICA_GROUP_ID: 0 for the first group, 1 for the second, ...}"
    export REPLICA_GROUP_ID NUM_REPLICA_GROUPS=${NUM_REPLICA_GROUPS:-2}
    export TORCHFT_LIGHTHOUSE=${TORCHFT_LIGHTHOUSE:-http://localhost:29510}
    NPROC=${NPROC:-$("$PYTHON" -c "import torch; print(torch.cuda.device_count() or 2)")}
    # --standalone: each group its own rendezvous on a free port. No --max-restarts: a group that
    # fails leaves the others training; start it again and it heals from them.
    exec torchrun --standalone --nproc-per-node="$NPROC" train_ft.py \
      --output-dir "runs/group$REPLICA_GROUP_ID" \
      --checkpoint-dir "checkpoints/group$REPLICA_GROUP_ID" "$@"
    ;;
  *)
    echo "$usage" >&2
    exit 2
    ;;
esac
