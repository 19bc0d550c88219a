#!/bin/bash
# Slurm Epilog (slurm.conf: Epilog=/etc/slurm/rolloutd-epilog.sh).
# Runs as root on every node when a job ends (normally, scancel, time-out, failed prolog): stops
# the job's node daemon, gracefully then by force, and leaves no process, socket, sandbox or
# shared-memory segment behind. Always exits 0, since a failing epilog drains the node; problems
# go to the hook log (HOOK_LOG, default RUN_BASE/hooks.log, root-only).
set -uo pipefail
RLD_HOOK=epilog
# shellcheck source=rolloutd-slurm-lib.sh
. "$(dirname -- "$(readlink -f -- "$0")")/rolloutd-slurm-lib.sh" || { echo "rolloutd-slurm: library missing beside $0" >&2; exit 0; }

# With a broken config the cleanup still runs with what could be read (defaults for the rest):
# the forced path needs no rolloutd program.
rld_load_config || rld_log "config problem (cleaning up anyway): $RLD_ERROR"
[ -n "$RLD_HOOK_LOG" ] || RLD_HOOK_LOG=$RLD_RUN_BASE/hooks.log
# Nothing in RUN_BASE is touched unless it is still root's alone.
rld_prepare_base || { rld_log "not cleaning up: $RLD_ERROR"; exit 0; }
user=${SLURM_JOB_USER:-} uid=${SLURM_JOB_UID:-}
[ -n "$user" ] && [ -n "$uid" ] || { rld_log "no SLURM_JOB_USER/SLURM_JOB_UID: nothing to do"; exit 0; }
rm -f -- "$(rld_failure_file)"
ids=$(rld_user_ids "$user") || { rld_log "unknown user $user: nothing to do"; exit 0; }
read -r _ gid _ <<<"$ids"
run_dir=$(rld_run_dir "$uid")

if [ "$RLD_SHARE" = user ]; then
  refs=$RLD_RUN_BASE/u$uid.jobs
  exec 9>"$RLD_RUN_BASE/u$uid.lock"
  flock -w $((RLD_STOP_TIMEOUT_S + 60)) 9 || rld_log "lock of $run_dir not free; going on without it"
  rm -f -- "$refs/$SLURM_JOB_ID"
  left=$(find "$refs" -mindepth 1 -maxdepth 1 2>/dev/null | wc -l)
  if [ "$left" -gt 0 ]; then
    rld_log "node daemon in $run_dir stays for $left other job(s) of $user"
    exit 0
  fi
  rmdir -- "$refs" 2>/dev/null
fi

rld_stop_daemon "$user" "$uid" "$gid" "$run_dir"
exit 0
