#!/bin/bash
# Pipeline x data parallel training on several machines under Slurm: one torchrun per node, each starting
# that node's ranks of examples/train_pipeline_dp.py; the nodes meet at the first node (c10d rendezvous).
#
#   fxpipe compile mlp-small --stages 2 --out plan/    # once, on a filesystem every node sees
#   sbatch examples/slurm_pipeline_dp.sh plan/ --steps 100
#
# 2 nodes x 2 ranks = 4 ranks: a 2-stage plan runs as 2 replicas (dp = 4 / 2). Rank = pp x dp + replica,
# and torchrun numbers a node's ranks consecutively, so with as many ranks per node as replicas each node
# holds one stage's whole dp group (its gradient all-reduce stays on the node) and activations cross nodes.
# --checkpoint-dir must be on the shared filesystem too.
#SBATCH --job-name=fxpipe-pp-dp
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --time=00:30:00
set -euo pipefail

PLAN=${1:?usage: sbatch examples/slurm_pipeline_dp.sh PLAN_DIR [train_pipeline_dp.py options]}
shift
RANKS_PER_NODE=${RANKS_PER_NODE:-2}
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
PORT=${PORT:-29400}
HERE=${SLURM_SUBMIT_DIR:-$(pwd)}

export OMP_NUM_THREADS=$(( ${SLURM_CPUS_PER_TASK:-$RANKS_PER_NODE} / RANKS_PER_NODE > 0 ? ${SLURM_CPUS_PER_TASK:-$RANKS_PER_NODE} / RANKS_PER_NODE : 1 ))

# srun starts one task per node; each task's torchrun starts RANKS_PER_NODE ranks and waits (at most
# join_timeout seconds) for the other nodes at $HEAD:$PORT.
srun torchrun \
    --nnodes "$SLURM_NNODES" \
    --nproc-per-node "$RANKS_PER_NODE" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$HEAD:$PORT" \
    --rdzv-id "$SLURM_JOB_ID" \
    --rdzv-conf join_timeout=300 \
    "$HERE/examples/train_pipeline_dp.py" "$PLAN" "$@"

# The same with fxpipe run and a built-in model's plan (fxpipe run starts torchrun itself):
#   srun fxpipe run "$PLAN" --dp 2 --nnodes "$SLURM_NNODES" --nproc "$RANKS_PER_NODE" \
#        --rdzv-endpoint "$HEAD:$PORT" --rdzv-id "$SLURM_JOB_ID" --steps 100
