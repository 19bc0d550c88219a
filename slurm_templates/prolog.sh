#!/bin/bash
# Slurm Prolog (slurm.conf: Prolog=/etc/slurm/rolloutd-prolog.sh, with PrologFlags=Alloc).
# Runs as root on every node of a job before it starts: brings up the node daemon for the job's
# user and returns once it answers. Exit 0 = ready. On failure the node is drained with a reason
# saying what is wrong (`sinfo -R`), the message goes to slurmd's log, and the job is requeued.
set -uo pipefail
RLD_HOOK=prolog
# shellcheck source=rolloutd-slurm-lib.sh
. "$(dirname -- "$(readlink -f -- "$0")")/rolloutd-slurm-lib.sh" || { echo "rolloutd-slurm: library missing beside $0" >&2; exit 1; }

fail() {
  local reason="rolloutd prolog: ${RLD_ERROR//$'\n'/ | }"
  rld_log "FAILED: $RLD_ERROR"
  # Slurm would drain with "Prolog error"; set the reason first so the admin sees the cause.
  timeout 10 scontrol update NodeName="${SLURMD_NODENAME:-$(hostname -s)}" State=DRAIN \
    Reason="${reason:0:200}" >/dev/null 2>&1 || rld_log "could not set the drain reason"
  exit 1
}

rld_load_config || fail
rld_prepare_base || fail
user=${SLURM_JOB_USER:?} uid=${SLURM_JOB_UID:?}
run_dir=$(rld_run_dir "$uid")

if [ "$RLD_SHARE" = user ]; then
  # One daemon per user and node, shared by that user's jobs: job ids in a root-owned folder
  # count the references; the lock orders prologs and epilogs of concurrent jobs.
  refs=$RLD_RUN_BASE/u$uid.jobs
  exec 9>"$RLD_RUN_BASE/u$uid.lock"
  flock -w $((RLD_READY_TIMEOUT_S + 30)) 9 || { RLD_ERROR="timed out waiting for the lock of $run_dir"; fail; }
  mkdir -p -m 0755 -- "$refs"
  touch -- "$refs/$SLURM_JOB_ID"
  if [ -n "$(rld_daemon_pid "$run_dir" "$uid")" ] \
     && rld_as_user 30 "$user" node status --run-dir "$run_dir" >/dev/null 2>&1; then
    rld_log "sharing the running node daemon in $run_dir"
    exit 0
  fi
  # A dead daemon's leftovers go before a new one starts in the same folder.
  rld_stop_daemon "$user" "$uid" "$run_dir"
  if ! rld_start_daemon "$user" "$uid" "$run_dir"; then
    rm -f -- "$refs/$SLURM_JOB_ID"
    rld_stop_daemon "$user" "$uid" "$run_dir"
    fail
  fi
  exit 0
fi

# Job ids restart when a cluster's state is wiped: whatever an old job left here goes first.
[ ! -e "$run_dir" ] || rld_stop_daemon "$user" "$uid" "$run_dir"
if ! rld_start_daemon "$user" "$uid" "$run_dir"; then
  rld_stop_daemon "$user" "$uid" "$run_dir"
  fail
fi
exit 0
