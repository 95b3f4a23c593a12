#!/bin/bash
# One node's `recycle agent`, started by recycle.sbatch through srun (one task per node). Reads the
# environment recycle.sbatch exports; the node's workers come from SLURM_NODEID:
#   worker w = SLURM_NODEID * WORKERS_PER_NODE + i (i = 0 .. WORKERS_PER_NODE - 1) is [w / P, w % P]
# (pipeline-major), and the agent gives its i-th worker LOCAL_RANK i (with --device auto: GPU i).
set -euo pipefail

: "${SLURM_NODEID:?run through srun}" "${JOB_ENV:?}" "${NUM_STAGES:?}" "${WORKERS_PER_NODE:?}"
: "${SERVICE_URL:?}" "${STORE:?}" "${ITERATIONS:?}" "${OUT_DIR:?}" "${CHECKPOINT_DIR:?}"

# shellcheck source=/dev/null
. "$JOB_ENV"  # RECYCLE_JOB_ID, RECYCLE_WORKER_TOKEN (written by the registration step)

workers=""
for ((i = 0; i < WORKERS_PER_NODE; i++)); do
  w=$((SLURM_NODEID * WORKERS_PER_NODE + i))
  workers+="${workers:+;}$((w / NUM_STAGES)),$((w % NUM_STAGES))"
done

model=()
if [[ -n ${ENTRY:-} ]]; then model+=(--entry "$ENTRY"); fi
if [[ -n ${MODEL:-} ]]; then model+=(--model "$MODEL"); fi

echo "recycle-node.sh: node $SLURM_NODEID ($(hostname)) runs workers $workers" >&2
exec recycle agent --service "$SERVICE_URL" --job-id "$RECYCLE_JOB_ID" --token "$RECYCLE_WORKER_TOKEN" \
  --workers "$workers" --store "$STORE" --iterations "$ITERATIONS" \
  --out "$OUT_DIR/node$SLURM_NODEID" --checkpoint-dir "$CHECKPOINT_DIR" \
  --checkpoint-every "${CHECKPOINT_EVERY:-50}" --backend auto --device auto "${model[@]}"
