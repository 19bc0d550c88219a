# rolloutd-slurm-lib.sh: shared by prolog.sh, epilog.sh and taskprolog.sh (sourced, never run).
#
# Slurm runs the Prolog and Epilog as root with no PATH and only SLURM_* variables, so all
# settings come from a file the admin installs (see rolloutd-slurm.conf.example):
#   1. rolloutd-slurm.conf beside the hook as Slurm calls it (e.g. /etc/slurm/rolloutd-slurm.conf),
#   2. else /etc/rolloutd/slurm.conf.
# The file is parsed, never sourced: KEY=value lines, '#' comments, unknown keys are errors.
# shellcheck shell=bash

RLD_SAFE_PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH=$RLD_SAFE_PATH

# Defaults (the example file documents each key).
RLD_ROLLOUTD=""
RLD_RUN_BASE=/tmp/rolloutd-slurm
RLD_SHARE=job
RLD_BACKEND=auto
RLD_WORKERS=""
RLD_WARM=""
RLD_NODE_CONFIG=""
RLD_CACHE_DIR=""
RLD_READY_TIMEOUT_S=60
RLD_STOP_TIMEOUT_S=20
RLD_HOOK_LOG=""
RLD_ROUTER_PORT_BASE=""
RLD_KEYS=(ROLLOUTD RUN_BASE SHARE BACKEND WORKERS WARM NODE_CONFIG CACHE_DIR READY_TIMEOUT_S STOP_TIMEOUT_S
          HOOK_LOG ROUTER_PORT_BASE)
# Longest run folder name below RUN_BASE ("/u4294967295" or "/job4294967295") plus "/node.sock":
# the socket path must fit the daemon's 100-byte limit for Unix sockets.
RLD_RUN_NAME_MAX=24
RLD_SOCKET_PATH_MAX=100

RLD_HOOK=${RLD_HOOK:-hook}
RLD_ERROR=""

# Where the hook was called from (config lookup) and where this library really lives.
rld_config_file() {
  local beside
  beside="$(dirname -- "$0")/rolloutd-slurm.conf"
  if [ -e "$beside" ]; then printf '%s\n' "$beside"; else printf '%s\n' /etc/rolloutd/slurm.conf; fi
}

rld_log() {
  local msg="rolloutd-slurm $RLD_HOOK job ${SLURM_JOB_ID:-?} on ${SLURMD_NODENAME:-$(hostname -s)}: $*"
  printf '%s\n' "$msg" >&2
  if [ -n "$RLD_HOOK_LOG" ] && [ "$(id -u)" = 0 ]; then
    printf '%s %s\n' "$(date '+%F %T')" "$msg" >>"$RLD_HOOK_LOG" 2>/dev/null || true
  fi
}

# rld_err MESSAGE: record the reason and fail the calling function.
rld_err() { RLD_ERROR=$*; return 1; }

rld_is_uint() { [[ $1 =~ ^[0-9]+$ ]]; }

rld_load_config() {
  local file line key value n=0 owner mode
  file=$(rld_config_file)
  RLD_CONFIG_FILE=$file
  [ -f "$file" ] && [ -r "$file" ] || rld_err "cannot read the config file $file (install one from rolloutd-slurm.conf.example)" || return 1
  if [ "$(id -u)" = 0 ]; then
    # The prolog runs the configured program: only root may be able to change which one.
    owner=$(stat -L -c %u "$file") mode=$(stat -L -c %a "$file")
    if [ "$owner" != 0 ] || (( 8#$mode & 8#022 )); then
      rld_err "$file must be owned by root and writable by root only (it is uid $owner, mode $mode)"; return 1
    fi
  fi
  while IFS= read -r line || [ -n "$line" ]; do
    n=$((n + 1))
    line=${line#"${line%%[![:space:]]*}"}
    line=${line%"${line##*[![:space:]]}"}
    [ -z "$line" ] || [ "${line:0:1}" = "#" ] && continue
    if ! [[ $line =~ ^([A-Z_][A-Z0-9_]*)=(.*)$ ]]; then
      rld_err "$file line $n: expected KEY=value, got: $line"; return 1
    fi
    key=${BASH_REMATCH[1]} value=${BASH_REMATCH[2]}
    if [[ $value =~ ^\"(.*)\"$ ]] || [[ $value =~ ^\'(.*)\'$ ]]; then value=${BASH_REMATCH[1]}; fi
    if [[ " ${RLD_KEYS[*]} " != *" $key "* ]]; then
      rld_err "$file line $n: unknown key $key (known: ${RLD_KEYS[*]})"; return 1
    fi
    printf -v "RLD_$key" '%s' "$value"
  done <"$file"
  rld_check_config
}

rld_check_config() {
  local f=$RLD_CONFIG_FILE
  [ -n "$RLD_ROLLOUTD" ] || rld_err "$f: ROLLOUTD is not set (the path of the rolloutd program)" || return 1
  [[ $RLD_ROLLOUTD == /* ]] && [ -x "$RLD_ROLLOUTD" ] \
    || rld_err "$f: ROLLOUTD=$RLD_ROLLOUTD is not an executable absolute path" || return 1
  [[ $RLD_RUN_BASE == /* ]] || rld_err "$f: RUN_BASE=$RLD_RUN_BASE must be an absolute path" || return 1
  (( ${#RLD_RUN_BASE} + RLD_RUN_NAME_MAX <= RLD_SOCKET_PATH_MAX )) \
    || rld_err "$f: RUN_BASE=$RLD_RUN_BASE is too long for a Unix socket path (at most $((RLD_SOCKET_PATH_MAX - RLD_RUN_NAME_MAX)) bytes)" || return 1
  case $RLD_SHARE in job | user) ;; *) rld_err "$f: SHARE=$RLD_SHARE must be 'job' or 'user'"; return 1 ;; esac
  case $RLD_BACKEND in auto | apptainer | local) ;;
    *) rld_err "$f: BACKEND=$RLD_BACKEND must be auto, apptainer or local"; return 1 ;; esac
  local k
  for k in WORKERS WARM ROUTER_PORT_BASE; do
    local v="RLD_$k"
    [ -z "${!v}" ] || rld_is_uint "${!v}" || rld_err "$f: $k=${!v} must be a whole number" || return 1
  done
  for k in READY_TIMEOUT_S STOP_TIMEOUT_S; do
    local v="RLD_$k"
    rld_is_uint "${!v}" && (( ${!v} > 0 )) || rld_err "$f: $k=${!v} must be a positive whole number of seconds" || return 1
  done
  [ -z "$RLD_NODE_CONFIG" ] || [ -r "$RLD_NODE_CONFIG" ] \
    || rld_err "$f: NODE_CONFIG=$RLD_NODE_CONFIG is not a readable file" || return 1
  [ -n "$RLD_HOOK_LOG" ] || RLD_HOOK_LOG=$RLD_RUN_BASE/hooks.log
}

# The folder of the daemon serving this job: one per job, or one per user shared by their jobs.
rld_run_dir() {
  local uid=${1:-$SLURM_JOB_UID}
  if [ "$RLD_SHARE" = user ]; then printf '%s/u%s\n' "$RLD_RUN_BASE" "$uid"
  else printf '%s/job%s\n' "$RLD_RUN_BASE" "$SLURM_JOB_ID"; fi
}

# The router's address for a job on several nodes (first node of the job), else nothing.
rld_router_address() {
  local nodelist=$1 first
  [ -n "$RLD_ROUTER_PORT_BASE" ] && [ -n "$nodelist" ] || return 0
  mapfile -t hosts < <(scontrol show hostnames "$nodelist" 2>/dev/null)
  (( ${#hosts[@]} > 1 )) || return 0
  first=${hosts[0]}
  printf 'tcp://%s:%s\n' "$first" $((RLD_ROUTER_PORT_BASE + SLURM_JOB_ID % 1000))
}

# RUN_BASE is created by root and must stay root's: job users get their folder inside it only
# through the prolog, so nobody can plant a folder or symlink where a daemon will run.
rld_prepare_base() {
  local owner mode
  [ -L "$RLD_RUN_BASE" ] && { rld_err "RUN_BASE $RLD_RUN_BASE is a symlink; refusing to use it"; return 1; }
  mkdir -p -m 0755 -- "$RLD_RUN_BASE" || rld_err "cannot create RUN_BASE $RLD_RUN_BASE" || return 1
  owner=$(stat -c %u "$RLD_RUN_BASE") mode=$(stat -c %a "$RLD_RUN_BASE")
  if [ "$owner" != 0 ] || (( 8#$mode & 8#022 )); then
    rld_err "RUN_BASE $RLD_RUN_BASE must be owned by root and writable by root only (uid $owner, mode $mode); remove it or choose another RUN_BASE"
    return 1
  fi
}

# rld_as_user SECONDS USER ARGS...: run `rolloutd ARGS` as the job's user with a clean, fixed
# environment and no inherited standard input, killed after SECONDS.
rld_as_user() {
  local secs=$1 user=$2 home
  shift 2
  home=$(getent passwd "$user" | cut -d: -f6)
  local env=(PATH="$RLD_SAFE_PATH" HOME="${home:-/}" USER="$user" LOGNAME="$user" LANG=C.UTF-8)
  [ -z "$RLD_CACHE_DIR" ] || env+=(ROLLOUTD_CACHE_DIR="$RLD_CACHE_DIR")
  [ -z "${SLURM_JOB_ID:-}" ] || env+=(SLURM_JOB_ID="$SLURM_JOB_ID")
  (cd / && timeout -k 5 "$secs" runuser -u "$user" -- env -i "${env[@]}" "$RLD_ROLLOUTD" "$@" </dev/null)
}

# rld_proc_alive PID: the process exists and is not a zombie (PID 1 may reap orphans late).
rld_proc_alive() {
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  stat=${stat##*) }
  [ "${stat%% *}" != Z ]
}

# rld_daemon_pid RUN_DIR UID: the node daemon's PID from its pidfile, checked against PID reuse
# (alive, owned by UID, a rolloutd command line naming RUN_DIR); empty if none.
rld_daemon_pid() {
  local run_dir=$1 uid=$2 pid cmd
  pid=$(head -c 32 "$run_dir/node.pid" 2>/dev/null | tr -dc 0-9) || true
  [ -n "$pid" ] && rld_proc_alive "$pid" || return 0
  [ "$(stat -c %u "/proc/$pid" 2>/dev/null)" = "$uid" ] || return 0
  cmd=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 0
  [[ $cmd == *rolloutd* && $cmd == *"$run_dir/"* ]] && printf '%s\n' "$pid"
  return 0
}

# rld_leftover_pids RUN_DIR UID SID: live processes of UID that belong to the daemon: in its
# session SID, or running in or naming RUN_DIR (local sandboxes, kernels).
rld_leftover_pids() {
  local run_dir=$1 uid=$2 sid=$3 d pid stat fields cmd cwd
  for d in /proc/[0-9]*; do
    pid=${d#/proc/}
    [ "$pid" != $$ ] && [ "$pid" != "$BASHPID" ] || continue
    [ "$(stat -c %u "$d" 2>/dev/null)" = "$uid" ] || continue
    stat=$(cat "$d/stat" 2>/dev/null) || continue
    read -r -a fields <<<"${stat##*) }"
    [ "${fields[0]}" != Z ] || continue
    if [ -n "$sid" ] && [ "${fields[3]}" = "$sid" ]; then printf '%s\n' "$pid"; continue; fi
    cmd=$(tr '\0' ' ' <"$d/cmdline" 2>/dev/null) || continue
    cwd=$(readlink "$d/cwd" 2>/dev/null) || cwd=""
    if [[ $cmd == *"$run_dir/"* || $cwd == "$run_dir" || $cwd == "$run_dir/"* ]]; then printf '%s\n' "$pid"; fi
  done
}

# rld_start_daemon USER UID RUN_DIR: start the node daemon as USER; it answers before this returns.
rld_start_daemon() {
  local user=$1 uid=$2 run_dir=$3 gid out rc router
  gid=$(id -g "$user") || rld_err "unknown user $user" || return 1
  install -d -o "$uid" -g "$gid" -m 0700 -- "$run_dir" || rld_err "cannot create $run_dir" || return 1
  local args=(node start --detach --run-dir "$run_dir" --log-file "$run_dir/node.log"
              --ready-timeout-s "$RLD_READY_TIMEOUT_S" --backend "$RLD_BACKEND")
  [ -z "$RLD_WORKERS" ] || args+=(--workers "$RLD_WORKERS")
  [ -z "$RLD_WARM" ] || args+=(--warm "$RLD_WARM")
  [ -z "$RLD_NODE_CONFIG" ] || args+=(--config "$RLD_NODE_CONFIG")
  router=$(rld_router_address "${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}")
  if [ -n "$router" ]; then
    # A TCP router admits only keyed nodes: the user's keys, made once (see sbatch-multi-node.sh).
    local keys
    keys="$(getent passwd "$user" | cut -d: -f6)/.rolloutd/keys"
    [ -r "$keys/nodes/node.key_secret" ] && [ -r "$keys/router.key" ] || {
      rld_err "multi-node job of $user: no CURVE keys in $keys (run once: rolloutd keygen router --dir $keys && rolloutd keygen node --dir $keys/nodes && rolloutd keygen trainer --dir $keys/clients)"
      return 1
    }
    args+=(--router "$router" --curve-secret-key-file "$keys/nodes/node.key_secret"
           --router-public-key-file "$keys/router.key")
  fi
  # Command substitution waits for EOF: a daemon that kept this pipe would hang the prolog here.
  out=$(rld_as_user $((RLD_READY_TIMEOUT_S + 15)) "$user" "${args[@]}" 2>&1)
  rc=$?
  if [ $rc != 0 ]; then
    rld_err "rolloutd node start failed (exit $rc$([ $rc = 124 ] && echo ', timed out')): $(printf '%s' "$out" | tail -n 15)"
    return 1
  fi
  rld_log "node daemon for $user up at ${out##*$'\n'} (pid $(rld_daemon_pid "$run_dir" "$uid"))"
}

# rld_stop_daemon USER UID RUN_DIR: graceful stop through `rolloutd node stop`, then forced;
# afterwards no process, socket, sandbox or shared-memory segment of that daemon remains and
# RUN_DIR is gone. Problems are logged, never fatal: a failing epilog would drain the node.
rld_stop_daemon() {
  local user=$1 uid=$2 run_dir=$3 pid out rc victims p
  [ -d "$run_dir" ] || { rld_log "no run folder $run_dir: nothing to stop"; return 0; }
  pid=$(rld_daemon_pid "$run_dir" "$uid")
  out=$(rld_as_user $((RLD_STOP_TIMEOUT_S + 20)) "$user" node stop --run-dir "$run_dir" --timeout-s "$RLD_STOP_TIMEOUT_S" 2>&1)
  rc=$?
  [ $rc = 0 ] || rld_log "rolloutd node stop failed (exit $rc): $(printf '%s' "$out" | tail -n 5)"
  mapfile -t victims < <(rld_leftover_pids "$run_dir" "$uid" "$pid")
  if [ -n "$pid" ] && rld_proc_alive "$pid"; then victims+=("$pid"); fi
  if ((${#victims[@]})); then
    rld_log "forcing leftover processes of the node daemon: ${victims[*]}"
    kill -TERM "${victims[@]}" 2>/dev/null
    for _ in $(seq 20); do
      local alive=0
      for p in "${victims[@]}"; do rld_proc_alive "$p" && alive=1; done
      [ $alive = 0 ] && break
      sleep 0.1
    done
    kill -KILL "${victims[@]}" 2>/dev/null
  fi
  if [ $rc != 0 ] || ((${#victims[@]})); then
    # A second stop finds no daemon and reaps what it left on disk (sandbox instances, sockets).
    rld_as_user 30 "$user" node stop --run-dir "$run_dir" --timeout-s 1 >/dev/null 2>&1 \
      || rld_log "cleanup after the forced stop failed"
  fi
  if [ -n "$pid" ]; then
    find /dev/shm -maxdepth 1 -user "$uid" -name "rld$uid-$pid-*" -delete 2>/dev/null
  fi
  if [ $rc != 0 ] || ((${#victims[@]})); then
    rld_log "daemon log tail: $(tail -n 20 "$run_dir/node.log" 2>/dev/null)"
  fi
  rm -rf -- "$run_dir" || rld_log "cannot remove $run_dir"
  rld_log "node daemon ${pid:-(not running)} of $user stopped${out:+: ${out##*$'\n'}}"
}
