#!/bin/bash
# Slurm TaskProlog (slurm.conf: TaskProlog=/etc/slurm/rolloutd-taskprolog.sh).
# Runs as the job's user before each task (the batch script, every srun task); the lines it
# prints as "export NAME=value" land in the task's environment, "print ..." lines in its output.
# The client reads ROLLOUTD_ADDRESS; ROLLOUTD_ROUTER is set for jobs on several nodes when the
# admin enabled it. When the prolog could not start this job's daemon for a reason of the job's
# own (its user's keys, its daemon), this prints that reason and exits 1, which fails the task.
RLD_HOOK=taskprolog
# shellcheck source=rolloutd-slurm-lib.sh
. "$(dirname -- "$(readlink -f -- "$0")")/rolloutd-slurm-lib.sh" 2>/dev/null || exit 0
if ! rld_load_config 2>/dev/null; then
  echo "print rolloutd: no node daemon address for this task: $RLD_ERROR"
  exit 0
fi
failed=$(rld_failure_file)
if [ -f "$failed" ]; then
  echo "print rolloutd: the Prolog could not start this job's node daemon on $(rld_node): $(rld_clean "$(head -c 4000 -- "$failed")" 4000)"
  exit 1
fi
echo "export ROLLOUTD_ADDRESS=ipc://$(rld_run_dir "$(id -u)")/node.sock"
router=$(rld_router_address "${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}")
[ -z "$router" ] || echo "export ROLLOUTD_ROUTER=$router"
exit 0
