# Sourced by the sbatch templates in launch/slurm/: the run's name, the preemption notice and the requeue.
#
# The notice: `#SBATCH --signal=B:USR1@180` sends USR1 to this batch shell 180 s before the time limit (Slurm
# may send it up to a minute early). The shell forwards SIGTERM to the training step: every rank saves a final
# checkpoint at its next step and exits. Then the shell requeues the job (`scontrol requeue`; the templates
# ask for `--requeue`), which keeps its job id, so the next start runs the same command line: `--resume
# latest` with the same `--name` continues from that checkpoint. `scancel` sends TERM, not USR1: a cancelled
# job is never requeued, whatever else happened (a notice before or after the TERM included), and a final save
# that its grace period (KillWait) cuts short is never committed, so a later `--resume latest` takes the
# checkpoint before it.

# The run's name, fixed for the life of the job and its requeues: $BIGCLIP_NAME, else <job name>-<job id>.
bigclip_run_name() {
    echo "${BIGCLIP_NAME:-${SLURM_JOB_NAME:-bigclip}-${SLURM_JOB_ID}}"
}

# Run "$@" (the srun command line of the training step) and handle the preemption notice.
bigclip_run_step() {
    local notice=0 cancelled=0 status=0 pid
    trap 'notice=1; echo "bigclip job ${SLURM_JOB_ID}: preemption notice; the training step saves a final checkpoint and stops"; scancel --signal=TERM "${SLURM_JOB_ID}"' USR1
    # scancel: TERM to this shell too. Said at once (Slurm kills the shell KillWait seconds later); never requeue.
    trap 'cancelled=1; echo "bigclip job ${SLURM_JOB_ID}: cancelled (SIGTERM to the batch shell); the job is not requeued"' TERM
    echo "bigclip job ${SLURM_JOB_ID}: start $(( ${SLURM_RESTART_COUNT:-0} + 1 )) of run $(bigclip_run_name) on ${SLURM_JOB_NODELIST}"
    "$@" &
    pid=$!
    # `wait` returns early (status > 128) when the notice arrives; the step is then still running.
    while true; do
        wait "${pid}" && status=0 || status=$?
        kill -0 "${pid}" 2>/dev/null || break
    done
    if [ "${notice}" = 1 ] && [ "${cancelled}" = 0 ]; then
        echo "bigclip job ${SLURM_JOB_ID}: training step stopped (status ${status}); requeueing the job"
        scontrol requeue "${SLURM_JOB_ID}"
        exit 0
    fi
    [ "${cancelled}" = 1 ] && exit 143
    return "${status}"
}
