#!/usr/bin/env bash
# One node's part of a SLURM job (pretrain_gpt.sbatch runs it once per node with srun):
# torchrun with one worker per GPU, then the exit status SLURM should see.
#
# On SIGTERM or SIGUSR1 (preemption, the time limit) torchrun forwards the signal; every
# worker finishes its step, saves and exits 0, and each that saved leaves a marker file.
# torchrun itself still exits non-zero after a signal, which would mark a cleanly saved
# job step failed; when every local worker left its marker, this node reports success.
#
# The rendezvous is static: node k of the allocation (SLURM_NODEID) holds ranks
# k*GPUS_PER_NODE.., so rank 0, and the job's store torchrun hosts, are on the first node,
# where the batch script runs. (c10d's dynamic rendezvous orders nodes by host name and
# process id: rank 0 could land on any node, and a lost node could take the store along.)
#
# Needs NNODES, GPUS_PER_NODE, HEAD_NODE, RDZV_PORT, SLURM_NODEID (0 if unset; sbatch, srun set
# them); PYTHON, if set, is the interpreter that runs torchrun (torch.distributed.run).
set -uo pipefail

if [ -n "${CHECK_ONLY:-}" ]; then  # the flags only (pretrain_gpt.sbatch's first step)
    out=$(WORLD_SIZE=$((NNODES * GPUS_PER_NODE)) "${PYTHON:-python}" pretrain_gpt.py \
        --dry-run "$@" 2>&1 >/dev/null)
    rc=$?
    [ "$rc" -eq 0 ] || grep '^error:' <<<"$out" | sed "s/^/${SLURMD_NODENAME:-$(hostname)}: /"
    exit "$rc"
fi

markers=$(mktemp -d)
trap 'rm -rf "$markers"' EXIT
# The signal reaches torchrun too (SLURM signals the whole step); bash, with a trap, only
# notes it and waits for torchrun to finish.
trap 'echo "run_node.sh: signal received, waiting for torchrun"' TERM USR1 INT

MEGAULYSSES_SAVED_ON_STOP="$markers" "${PYTHON:-python}" -m torch.distributed.run \
    --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" \
    --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \
    --shutdown-timeout "${SHUTDOWN_TIMEOUT:-240}" \
    --node-rank "${SLURM_NODEID:-0}" --master-addr "$HEAD_NODE" --master-port "$RDZV_PORT" \
    pretrain_gpt.py "$@" &
torchrun_pid=$!
while true; do  # a trapped signal interrupts `wait` (status > 128): wait again
    wait "$torchrun_pid"
    rc=$?
    kill -0 "$torchrun_pid" 2>/dev/null || break
done

saved=$(find "$markers" -type f | wc -l)
if [ "$rc" -ne 0 ] && [ "$saved" -eq "$GPUS_PER_NODE" ]; then
    echo "run_node.sh: torchrun exited $rc after a stop request, but all $saved workers on" \
         "${SLURMD_NODENAME:-$(hostname)} saved and exited cleanly: success"
    exit 0
fi
exit "$rc"
