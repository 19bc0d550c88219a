#!/bin/bash
# Slurm Prolog (slurm.conf: Prolog=/etc/slurm/rolloutd-prolog.sh, with PrologFlags=Alloc).
# Runs as root on every node of a job before it starts: brings up the node daemon for the job's
# user and returns once it answers.
#
# Two kinds of failure (README, Slurm):
# - the node's fault (the hooks' config, RUN_BASE, the admin's NODE_CONFIG, an unknown user, a
#   run folder root cannot create): exit 1, so Slurm drains the node, with the cause as the reason
#   (`sinfo -R`), and requeues the job held;
# - the job user's fault (no CURVE keys for a multi-node job, their daemon failing to start):
#   exit 0, the node stays in service, and the TaskProlog prints the reason into the job's output
#   and fails its tasks.
set -uo pipefail
RLD_HOOK=prolog
# shellcheck source=rolloutd-slurm-lib.sh
. "$(dirname -- "$(readlink -f -- "$0")")/rolloutd-slurm-lib.sh" || { echo "rolloutd-slurm: library missing beside $0" >&2; exit 1; }

node_fault() {
  local reason="rolloutd prolog: $(rld_clean "$RLD_ERROR" 180)"
  rld_log "FAILED (node fault, draining): $RLD_ERROR"
  # Slurm would drain with "Prolog error"; set the reason first so the admin sees the cause.
  timeout "$RLD_CMD_TIMEOUT_S" scontrol update NodeName="$(rld_node)" State=DRAIN \
    Reason="$reason" >/dev/null 2>&1 || rld_log "could not set the drain reason"
  exit 1
}

user_fault() {
  local failed
  failed=$(rld_failure_file)
  rld_log "FAILED (the job's fault, node stays in service): $RLD_ERROR"
  # Root-written, in root's RUN_BASE, readable by the job's user only; O_NOFOLLOW as for the log.
  rld_clean "$RLD_ERROR" 2000 | (umask 077; timeout 5 dd of="$failed" oflag=nofollow status=none) \
    && chown -- "$uid" "$failed" || rld_log "could not record the failure for the TaskProlog"
  exit 0
}

rld_load_config || node_fault
rld_prepare_base || node_fault
user=${SLURM_JOB_USER:?} uid=${SLURM_JOB_UID:?}
ids=$(rld_user_ids "$user") || { RLD_ERROR="unknown user $user (getent passwd)"; node_fault; }
read -r _ gid home <<<"$ids"
rld_check_node_config || node_fault
run_dir=$(rld_run_dir "$uid")

if [ "$RLD_SHARE" = user ]; then
  # One daemon per user and node, shared by that user's jobs: job ids in a root-owned folder
  # count the references; the lock orders prologs and epilogs of concurrent jobs.
  refs=$RLD_RUN_BASE/u$uid.jobs
  exec 9>"$RLD_RUN_BASE/u$uid.lock"
  flock -w $((RLD_READY_TIMEOUT_S + 30)) 9 || { RLD_ERROR="timed out waiting for the lock of $run_dir (another of your jobs is starting its daemon)"; user_fault; }
  mkdir -p -m 0755 -- "$refs"
  touch -- "$refs/$SLURM_JOB_ID"
  if [ -n "$(rld_daemon_pid "$run_dir" "$uid" "$gid")" ] \
     && rld_as_user 30 "$user" node status --run-dir "$run_dir" >/dev/null 2>&1; then
    rld_log "sharing the running node daemon in $run_dir"
    exit 0
  fi
  # A dead daemon's leftovers go before a new one starts in the same folder.
  rld_stop_daemon "$user" "$uid" "$gid" "$run_dir"
else
  # Job ids restart when a cluster's state is wiped: whatever an old job left here goes first.
  [ ! -e "$run_dir" ] || rld_stop_daemon "$user" "$uid" "$gid" "$run_dir"
fi
install -d -o "$uid" -g "$gid" -m 0700 -- "$run_dir" || { RLD_ERROR="cannot create $run_dir"; node_fault; }
if ! rld_start_daemon "$user" "$uid" "$gid" "$home" "$run_dir"; then
  error=$RLD_ERROR
  [ "$RLD_SHARE" != user ] || rm -f -- "$refs/$SLURM_JOB_ID"
  rld_stop_daemon "$user" "$uid" "$gid" "$run_dir"
  RLD_ERROR=$error
  user_fault
fi
exit 0
