#!/bin/bash
# Static shards of one batchgen job as a Slurm job array: task i runs `--shard i/N` (N = the array's size).
#
#   sbatch jobs/cluster/slurm_array.sh jobs/sft_synthesis.yaml
#
# output.path must be on a filesystem every node mounts (or an object store: s3://, gs://). Each task
# writes its units' parts; the task that commits the last unit writes _SUCCESS. A task that fails (or a
# node that dies) loses only its units in flight: resubmit that index (sbatch --array=I ...) and it
# resumes. If every task finished but _SUCCESS is missing, `batchgen finalize OUT` writes it.
#SBATCH --job-name=batchgen
#SBATCH --array=0-7%8
#SBATCH --gres=gpu:1
#SBATCH --cpus-per-task=8
#SBATCH --time=12:00:00
#SBATCH --output=logs/batchgen-%A_%a.log
#SBATCH --requeue
set -euo pipefail

JOB_FILE=${1:?usage: sbatch slurm_array.sh JOB.yaml [--set section.key=value ...]}
shift

# --shard auto reads SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN and SLURM_ARRAY_TASK_COUNT.
srun batchgen run "$JOB_FILE" --shard auto --no-progress "$@"
