#!/usr/bin/env bash
# Several machines, one torchrun per machine. Run the same command on every node, changing NODE_RANK:
#   scripts/train_multinode.sh NNODES NODE_RANK HEAD_HOST[:PORT] [train.py flags...]
#   scripts/train_multinode.sh 2 0 10.0.0.1:29400 --epochs 10     # on the head node
#   scripts/train_multinode.sh 2 1 10.0.0.1:29400 --epochs 10     # on the second node
# Pass '-' as HEAD_HOST to use $MASTER_ADDR (and $MASTER_PORT, default 29400).
# TRAIN_SCRIPT: the script torchrun starts (default train.py).
# Checkpoints are written by global rank 0 and read by every rank on resume: --checkpoint-dir must be
# on storage all nodes share.
set -euo pipefail
usage="usage: $0 NNODES NODE_RANK HEAD_HOST[:PORT]|- [train.py flags...]"
NNODES=${1:?$usage}
NODE_RANK=${2:?$usage}
ENDPOINT=${3:?$usage}
shift 3
# torchrun would end these in a traceback, or train node 1 of 1 as if there were two.
if [[ ! "$NNODES" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: NNODES=$NNODES: give the number of nodes, 1 or more ($usage)" >&2
  exit 2
fi
if [[ ! "$NODE_RANK" =~ ^[0-9]+$ ]] || (( NODE_RANK >= NNODES )); then
  echo "error: NODE_RANK=$NODE_RANK: give this node's number, 0 to $((NNODES - 1)) (node 0" \
    "hosts the rendezvous; $usage)" >&2
  exit 2
fi
if [[ "$ENDPOINT" == "-" ]]; then
  ENDPOINT="${MASTER_ADDR:?set MASTER_ADDR or pass HEAD_HOST}:${MASTER_PORT:-29400}"
fi
[[ "$ENDPOINT" == *:* ]] || ENDPOINT="$ENDPOINT:29400"
# A node whose torchrun is restarted must be able to rejoin: with the store torchrun shares with
# its training processes by default, it waits forever on keys of the old round
# (https://github.com/pytorch/pytorch/issues/135712). A store of their own avoids that.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
CALLER=$PWD
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
# As train_local.sh: --help, NPROC and MAX_RESTARTS, the flags, data and checkpoint checked once
# on each node before torchrun starts (a mistake is one line and exit 2 or 1 on every node, not a
# restart), relative paths read from where you ran this; it leaves NPROC, the processes this node
# takes, and the flags (scripts/preflight.sh).
source scripts/preflight.sh
# Many machines resolve their own name to a loopback address. Then torchrun does not see that it
# owns the endpoint (no node would host the rendezvous) and tells the training processes an
# address no other node can reach. So: this node's address on the route to the head, and
# whether the endpoint is this node. (The training processes pick the same interface for gloo
# and NCCL themselves.)
read -r IFACE LOCAL_ADDR IS_HOST < <("$PYTHON" -m {{ cookiecutter.package_name }}.runtime.network "${ENDPOINT%:*}")
NETWORK=(--local-addr="$LOCAL_ADDR")
if [[ "$LOCAL_ADDR" != 127.* && "$LOCAL_ADDR" != "::1" ]]; then
  NETWORK+=(--rdzv-conf="is_host=$IS_HOST")
fi
echo "node $NODE_RANK: $LOCAL_ADDR on ${IFACE}, rendezvous at $ENDPOINT (this node hosts it: $IS_HOST)"
# Through runtime/workarounds.py: a mistake found in the processes ends this node's torchrun at
# once (no restart cures it), and a stop by a signal with one line, not the agent's traceback;
# an endpoint held by a program that is not a torchrun rendezvous, or by a running job, is one
# line before torchrun starts (it would wait minutes there).
exec "$PYTHON" -m {{ cookiecutter.package_name }}.runtime.workarounds torchrun \
  --nnodes="$NNODES" --node-rank="$NODE_RANK" --nproc-per-node="$NPROC" \
  --rdzv-backend=c10d --rdzv-endpoint="$ENDPOINT" --rdzv-id="${RDZV_ID:-ddp-job}" \
  --max-restarts="${MAX_RESTARTS:-3}" "${NETWORK[@]}" \
  "${TRAIN_SCRIPT:-train.py}" "$@"
