# rolloutd-slurm-lib.sh: shared by prolog.sh, epilog.sh and taskprolog.sh (sourced, never run).
#
# Slurm runs the Prolog and Epilog as root with no PATH and only SLURM_* variables, so all
# settings come from a file the admin installs (see rolloutd-slurm.conf.example):
#   1. rolloutd-slurm.conf beside the hook as Slurm calls it (e.g. /etc/slurm/rolloutd-slurm.conf),
#   2. else /etc/rolloutd/slurm.conf.
# The file is parsed, never sourced: KEY=value lines, '#' comments, unknown keys are errors.
#
# Root-side rules (README, Slurm): root never opens, follows or reads a path a job's user can
# write (their run folder, their home): such reads run as that user (rld_as_uid) with a size cap
# and a time limit; RUN_BASE and the hook log's folder are checked to be root's alone before
# any use; user text is escaped (rld_clean) before it reaches a log, a drain reason or a job's
# output; a pid is signalled only when rld_is_daemon says it is the job's daemon.
# shellcheck shell=bash

RLD_SAFE_PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH=$RLD_SAFE_PATH
# Byte-wise patterns: rld_clean turns every non-ASCII or control byte of user text into '?'.
export LC_ALL=C

# Defaults (the example file documents each key).
RLD_ROLLOUTD=""
RLD_RUN_BASE=/run/rolloutd-slurm
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
# Set once RUN_BASE and the hook log's folder are checked: nothing is written there before.
RLD_LOG_READY=""
# Upper bound of every root-side command that could wait on something outside root's control.
RLD_CMD_TIMEOUT_S=10

# Where the hook was called from (config lookup) and where this library really lives.
rld_config_file() {
  local beside
  beside="$(dirname -- "$0")/rolloutd-slurm.conf"
  if [ -e "$beside" ]; then printf '%s\n' "$beside"; else printf '%s\n' /etc/rolloutd/slurm.conf; fi
}

# rld_clean TEXT [MAX]: TEXT on one line, control and non-ASCII bytes as '?', at most MAX bytes.
# Whatever a job's user can influence (their daemon's output, file contents) goes through it
# before it reaches a log, a drain reason or a job's output.
rld_clean() {
  local t=${1//$'\n'/ | }
  t=${t//[^[:print:]]/?}
  printf '%s' "${t:0:${2:-500}}"
}

rld_node() { printf '%s\n' "${SLURMD_NODENAME:-$(hostname -s)}"; }

rld_log() {
  local msg
  msg="rolloutd-slurm $RLD_HOOK job ${SLURM_JOB_ID:-?} on $(rld_node): $(rld_clean "$*" 2000)"
  printf '%s\n' "$msg" >&2
  [ -n "$RLD_LOG_READY" ] && [ "$(id -u)" = 0 ] || return 0
  # dd opens with O_NOFOLLOW|O_APPEND and creates the file 0600 (umask): a link planted there
  # is never followed, and only root reads the log.
  printf '%s %s\n' "$(date '+%F %T')" "$msg" \
    | (umask 077; timeout 5 dd of="$RLD_HOOK_LOG" oflag=append,nofollow conv=notrunc status=none) 2>/dev/null || true
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
  [[ $RLD_RUN_BASE == /?* && $RLD_RUN_BASE != */ && $RLD_RUN_BASE != *//* ]] \
    || rld_err "$f: RUN_BASE=$RLD_RUN_BASE must be an absolute path without a trailing or doubled '/'" || return 1
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
  if [ -n "$RLD_NODE_CONFIG" ] && [ "$(id -u)" = 0 ]; then
    # Every job's daemon reads it: a user who could change it would configure everyone's.
    local info dir
    info=$(stat -c '%F|%u|%a' -- "$RLD_NODE_CONFIG") dir=$(stat -c '%F|%u|%a' -- "$(dirname -- "$RLD_NODE_CONFIG")")
    if [[ $info != "regular file|0|"* || $dir != "directory|0|"* ]] || (( 8#${info##*|} & 8#022 || 8#${dir##*|} & 8#022 )); then
      rld_err "$f: NODE_CONFIG=$RLD_NODE_CONFIG and its folder must be root's and writable by root only (file: $info, folder: $dir)"
      return 1
    fi
  fi
  [ -n "$RLD_HOOK_LOG" ] || RLD_HOOK_LOG=$RLD_RUN_BASE/hooks.log
  [[ $RLD_HOOK_LOG == /?* ]] || rld_err "$f: HOOK_LOG=$RLD_HOOK_LOG must be an absolute path" || return 1
}

# The folder of the daemon serving this job: one per job, or one per user shared by their jobs.
rld_run_dir() {
  local uid=${1:-$SLURM_JOB_UID}
  if [ "$RLD_SHARE" = user ]; then printf '%s/u%s\n' "$RLD_RUN_BASE" "$uid"
  else printf '%s/job%s\n' "$RLD_RUN_BASE" "$SLURM_JOB_ID"; fi
}

# Where the prolog leaves the reason a job's daemon could not start (the user's fault): the
# TaskProlog prints it into the job's output and fails the job's tasks.
rld_failure_file() { printf '%s/job%s.failed\n' "$RLD_RUN_BASE" "$SLURM_JOB_ID"; }

# The router's address for a job on several nodes (first node of the job), else nothing.
rld_router_address() {
  local nodelist=$1 first
  [ -n "$RLD_ROUTER_PORT_BASE" ] && [ -n "$nodelist" ] || return 0
  mapfile -t hosts < <(timeout "$RLD_CMD_TIMEOUT_S" scontrol show hostnames "$nodelist" 2>/dev/null)
  (( ${#hosts[@]} > 1 )) || return 0
  first=${hosts[0]}
  printf 'tcp://%s:%s\n' "$first" $((RLD_ROUTER_PORT_BASE + SLURM_JOB_ID % 1000))
}

# rld_job_cpus: the CPUs this job holds on this node, from what slurmd gives the prolog
# (SLURM_JOB_CPUS_PER_NODE "4(x2),2" over SLURM_NODELIST); empty when unknown.
rld_job_cpus() {
  local spec=${SLURM_JOB_CPUS_PER_NODE:-} item r node i
  local -a items hosts counts=()
  [ -n "$spec" ] || return 0
  IFS=, read -r -a items <<<"$spec"
  for item in "${items[@]}"; do
    if [[ $item =~ ^([0-9]+)\(x([0-9]+)\)$ ]]; then
      for ((r = 0; r < BASH_REMATCH[2] && r < 100000; r++)); do counts+=("${BASH_REMATCH[1]}"); done
    elif rld_is_uint "$item"; then counts+=("$item")
    else return 0; fi
  done
  if (( ${#counts[@]} == 1 )); then printf '%s\n' "${counts[0]}"; return 0; fi
  node=$(rld_node)
  mapfile -t hosts < <(timeout "$RLD_CMD_TIMEOUT_S" scontrol show hostnames "${SLURM_NODELIST:-}" 2>/dev/null)
  for i in "${!hosts[@]}"; do
    [ "${hosts[$i]}" = "$node" ] && { printf '%s\n' "${counts[$i]:-}"; return 0; }
  done
}

# rld_secure_path PATH: PATH and every folder above it are real folders (no symlink), owned by
# root and writable by root only: no user can create, swap or redirect anything on the way.
rld_secure_path() {
  local p=$1 info
  while :; do
    info=$(stat -c '%F|%u|%a' -- "${p:-/}" 2>/dev/null) || rld_err "${p:-/} does not exist" || return 1
    [[ $info == directory\|0\|* ]] || rld_err "${p:-/} is not a root-owned folder (${info%%|*}, uid $(cut -d'|' -f2 <<<"$info"))" || return 1
    (( 8#${info##*|} & 8#022 )) && { rld_err "${p:-/} is writable by others than root (mode ${info##*|})"; return 1; }
    [ -n "$p" ] || return 0
    p=${p%/*}
  done
}

# RUN_BASE is created by root and must stay root's, in a place no user can create first (a
# /tmp-like folder would let a user plant it before the first prolog): checked before any use.
rld_prepare_base() {
  rld_secure_path "${RLD_RUN_BASE%/*}" \
    || rld_err "RUN_BASE $RLD_RUN_BASE is unsafe: $RLD_ERROR; every folder above it must be root-owned and writable by root only (e.g. RUN_BASE=/run/rolloutd-slurm)" \
    || return 1
  [ -e "$RLD_RUN_BASE" ] || [ -L "$RLD_RUN_BASE" ] || mkdir -m 0755 -- "$RLD_RUN_BASE" 2>/dev/null
  rld_secure_path "$RLD_RUN_BASE" \
    || rld_err "RUN_BASE $RLD_RUN_BASE is unsafe: $RLD_ERROR; remove it or choose another RUN_BASE" || return 1
  rld_secure_path "${RLD_HOOK_LOG%/*}" \
    || rld_err "HOOK_LOG $RLD_HOOK_LOG is unsafe: $RLD_ERROR" || return 1
  if [ -L "$RLD_HOOK_LOG" ] || { [ -e "$RLD_HOOK_LOG" ] && [ ! -f "$RLD_HOOK_LOG" ]; }; then
    rld_err "HOOK_LOG $RLD_HOOK_LOG is not a regular file"; return 1
  fi
  [ ! -e "$RLD_HOOK_LOG" ] || chmod 0600 -- "$RLD_HOOK_LOG"
  RLD_LOG_READY=1
}

# rld_user_ids USER: "UID GID HOME" of USER (NSS may be remote: bounded).
rld_user_ids() {
  local entry
  entry=$(timeout "$RLD_CMD_TIMEOUT_S" getent passwd "$1") || return 1
  local uid gid home
  IFS=: read -r _ _ uid gid _ home _ <<<"$entry"
  printf '%s %s %s\n' "$uid" "$gid" "$home"
}

# rld_as_uid UID GID SECONDS CMD...: CMD as that user (no supplementary groups, no environment
# but PATH, no standard input, working folder /), killed after SECONDS. Root reads or changes
# nothing in a user's folders itself: a symlink, FIFO or huge file there can only hurt the user.
rld_as_uid() {
  local uid=$1 gid=$2 secs=$3
  shift 3
  (cd / && timeout -k 2 "$secs" setpriv --reuid="$uid" --regid="$gid" --clear-groups \
     env -i PATH="$RLD_SAFE_PATH" LC_ALL=C "$@" </dev/null)
}

# rld_as_user SECONDS USER ARGS...: run `rolloutd ARGS` as the job's user (their groups, a clean
# fixed environment), killed after SECONDS.
rld_as_user() {
  local secs=$1 user=$2 ids home
  shift 2
  ids=$(rld_user_ids "$user") || { echo "unknown user $user" >&2; return 1; }
  home=${ids##* }
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

# rld_is_daemon PID RUN_DIR UID: PID is the daemon of RUN_DIR. The one rule, shared with
# rolloutd.cli.lifecycle.is_daemon (tests/test_slurm_hooks.py checks both agree): the process
# is alive (not a zombie), owned by UID, and one argument of its command line is RUN_DIR or a
# path inside it (`node start --detach` always passes --run-dir). A reused pid, another job's
# daemon (job1 is no prefix of job10/) or a process of another user never qualifies.
rld_is_daemon() {
  local pid=$1 run_dir=$2 uid=$3 arg
  rld_is_uint "$pid" && rld_proc_alive "$pid" || return 1
  [ "$(stat -c %u "/proc/$pid" 2>/dev/null)" = "$uid" ] || return 1
  while IFS= read -r -d '' arg; do
    [[ $arg == "$run_dir" || $arg == "$run_dir"/* ]] && return 0
  done < <(timeout 5 head -c 65536 "/proc/$pid/cmdline" 2>/dev/null)
  return 1
}

# rld_daemon_pid RUN_DIR UID GID: the pid in RUN_DIR/node.pid (read as the user, 32 bytes at
# most, 5 s at most) when it is the daemon of RUN_DIR by rld_is_daemon; empty otherwise.
rld_daemon_pid() {
  local run_dir=$1 uid=$2 gid=$3 pid
  pid=$(rld_as_uid "$uid" "$gid" 5 head -c 32 -- "$run_dir/node.pid" 2>/dev/null | tr -dc 0-9)
  [ -n "$pid" ] && rld_is_daemon "${pid:0:10}" "$run_dir" "$uid" && printf '%s\n' "${pid:0:10}"
  return 0
}

# rld_leftover_pids RUN_DIR UID SID: live processes of UID that belong to the daemon: in its
# session SID, working in RUN_DIR, or naming it by the rule of rld_is_daemon (local sandboxes,
# kernels).
rld_leftover_pids() {
  local run_dir=$1 uid=$2 sid=$3 d pid stat fields cwd
  for d in /proc/[0-9]*; do
    pid=${d#/proc/}
    [ "$pid" != $$ ] && [ "$pid" != "$BASHPID" ] || continue
    [ "$(stat -c %u "$d" 2>/dev/null)" = "$uid" ] || continue
    stat=$(cat "$d/stat" 2>/dev/null) || continue
    read -r -a fields <<<"${stat##*) }"
    [ "${fields[0]}" != Z ] || continue
    if [ -n "$sid" ] && [ "${fields[3]}" = "$sid" ]; then printf '%s\n' "$pid"; continue; fi
    cwd=$(readlink "$d/cwd" 2>/dev/null) || cwd=""
    if [[ $cwd == "$run_dir" || $cwd == "$run_dir/"* ]] || rld_is_daemon "$pid" "$run_dir" "$uid"; then
      printf '%s\n' "$pid"
    fi
  done
}

# rld_check_node_config: the admin's NODE_CONFIG and the hooks' settings as `rolloutd node check`
# sees them, run as nobody: a refusal is the node's fault (it drains), and no job's user can
# influence this answer.
rld_check_node_config() {
  local out args=(node check --backend "$RLD_BACKEND")
  [ -n "$RLD_NODE_CONFIG" ] || return 0
  args+=(--config "$RLD_NODE_CONFIG")
  out=$(rld_as_uid 65534 65534 60 "$RLD_ROLLOUTD" "${args[@]}" 2>&1) \
    || rld_err "NODE_CONFIG $RLD_NODE_CONFIG is refused: $(printf '%s' "$out" | tail -n 3)"
}

# rld_start_daemon USER UID GID HOME RUN_DIR: start the node daemon as USER; it answers before
# this returns. A failure here is the user's (their keys, their daemon): RLD_ERROR says why.
rld_start_daemon() {
  local user=$1 uid=$2 gid=$3 home=$4 run_dir=$5 out rc router workers
  local args=(node start --detach --run-dir "$run_dir" --log-file "$run_dir/node.log"
              --ready-timeout-s "$RLD_READY_TIMEOUT_S" --backend "$RLD_BACKEND")
  # Default: as many workers as the job holds CPUs here, not one per core of a shared node.
  workers=${RLD_WORKERS:-$(rld_job_cpus)}
  [ -z "$workers" ] || args+=(--workers "$workers")
  [ -z "$RLD_WARM" ] || args+=(--warm "$RLD_WARM")
  [ -z "$RLD_NODE_CONFIG" ] || args+=(--config "$RLD_NODE_CONFIG")
  # A user's own inference key: a file only they can read, never the admin's shared config.
  if rld_as_uid "$uid" "$gid" 5 test -f "$home/.rolloutd/inference_api_key"; then
    args+=(--inference-api-key-file "$home/.rolloutd/inference_api_key")
  fi
  router=$(rld_router_address "${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}")
  if [ -n "$router" ]; then
    # A TCP router admits only keyed nodes: the user's keys, made once (see sbatch-multi-node.sh),
    # looked at as the user.
    local keys="$home/.rolloutd/keys"
    rld_as_uid "$uid" "$gid" 5 test -r "$keys/nodes/node.key_secret" -a -r "$keys/router.key" || {
      rld_err "this multi-node job needs your CURVE keys in $keys (run once: rolloutd keygen router --dir $keys && rolloutd keygen node --dir $keys/nodes && rolloutd keygen trainer --dir $keys/clients)"
      return 1
    }
    args+=(--router "$router" --curve-secret-key-file "$keys/nodes/node.key_secret"
           --router-public-key-file "$keys/router.key")
  fi
  # Command substitution waits for EOF: a daemon that kept this pipe would hang the prolog here.
  out=$(rld_as_user $((RLD_READY_TIMEOUT_S + 15)) "$user" "${args[@]}" 2>&1)
  rc=$?
  if [ $rc != 0 ]; then
    rld_err "rolloutd node start failed (exit $rc$([ $rc = 124 ] && echo ', timed out')): $(rld_clean "$(printf '%s' "$out" | tail -n 15)" 1500)"
    return 1
  fi
  rld_log "node daemon for $user up at $(rld_clean "${out##*$'\n'}" 200) (pid $(rld_daemon_pid "$run_dir" "$uid" "$gid"))"
}

# rld_stop_daemon USER UID GID RUN_DIR: graceful stop through `rolloutd node stop`, then forced;
# afterwards no process, socket, sandbox or shared-memory segment of that daemon remains and
# RUN_DIR is gone. Problems are logged, never fatal: a failing epilog would drain the node.
rld_stop_daemon() {
  local user=$1 uid=$2 gid=$3 run_dir=$4 pid out rc victims p
  # RUN_DIR's own entry is root's (RUN_BASE is checked); what is inside is the user's.
  [ -d "$run_dir" ] && [ ! -L "$run_dir" ] || { rld_log "no run folder $run_dir: nothing to stop"; return 0; }
  pid=$(rld_daemon_pid "$run_dir" "$uid" "$gid")
  out=$(rld_as_user $((RLD_STOP_TIMEOUT_S + 20)) "$user" node stop --run-dir "$run_dir" --timeout-s "$RLD_STOP_TIMEOUT_S" 2>&1)
  rc=$?
  [ $rc = 0 ] || rld_log "rolloutd node stop failed (exit $rc): $(rld_clean "$(printf '%s' "$out" | tail -n 5)" 500)"
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
    rld_log "forced stop: the daemon's own log was $run_dir/node.log (removed with the folder)"
  fi
  if [ -n "$pid" ]; then
    rld_as_uid "$uid" "$gid" 30 find /dev/shm -maxdepth 1 -user "$uid" -name "rld$uid-$pid-*" -delete 2>/dev/null
  fi
  # The user's files go as the user; root removes only the emptied folder (or, when the user
  # made that impossible, everything with rm, which never follows links).
  rld_as_uid "$uid" "$gid" 60 find "$run_dir" -mindepth 1 -delete 2>/dev/null
  rmdir -- "$run_dir" 2>/dev/null || timeout 60 rm -rf --one-file-system -- "$run_dir" || rld_log "cannot remove $run_dir"
  rld_log "node daemon ${pid:-(not running)} of $user stopped${out:+: $(rld_clean "${out##*$'\n'}" 200)}"
}
