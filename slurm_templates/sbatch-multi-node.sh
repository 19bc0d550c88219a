#!/bin/bash
# Several nodes: node daemons everywhere, the router and the trainer on the first node, inference
# servers on the other (GPU) nodes.
#
#   node 0            router (tcp, CURVE)  +  trainer  ──────────▶ ROLLOUTD_ROUTER
#   nodes 0..N-1      rolloutd node daemon (Prolog) ── joins the router, runs sandboxes
#   nodes 1..N-1      inference server on each node's GPUs
#
# The router and federation are tested on one machine (separate processes and network namespaces,
# TCP with CURVE); this template itself has not run on a multi-node cluster here.
#
# Once per user, before the first multi-node job (keys on a filesystem every node sees; the Prolog
# reads them from ~/.rolloutd/keys of the job's user):
#   rolloutd keygen router --dir ~/.rolloutd/keys
#   rolloutd keygen node --dir ~/.rolloutd/keys/nodes       # node daemons join with this key
#   rolloutd keygen trainer --dir ~/.rolloutd/keys/clients  # only for trainers outside the head node
#
# What the cluster provides: the admin's Prolog starts a node daemon on every node of the job and,
# with ROUTER_PORT_BASE set in the hooks' config, makes it join tcp://<first node>:<port>; the
# TaskProlog exports that address as ROLLOUTD_ROUTER (and the local daemon as ROLLOUTD_ADDRESS).
# The daemons retry joining until the router below is up.
#
#   sbatch --nodes=4 slurm_templates/sbatch-multi-node.sh     # after editing the settings below
#
#SBATCH --job-name=rolloutd-multinode
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

# ---- settings (environment variables override them) ----------------------------------------
MODEL=${MODEL:-/path/to/model}
INFERENCE_PORT=${INFERENCE_PORT:-8000}
INFERENCE_CMD=${INFERENCE_CMD:-vllm serve $MODEL --port $INFERENCE_PORT --host 0.0.0.0 --tensor-parallel-size 8}
INFERENCE_READY_TIMEOUT_S=${INFERENCE_READY_TIMEOUT_S:-900}
TRAINER_CMD=${TRAINER_CMD:?set TRAINER_CMD to the command that runs your trainer}
ROLLOUTD=${ROLLOUTD:-rolloutd}                  # the rolloutd program on the compute nodes
ROLLOUTD_PYTHON=${ROLLOUTD_PYTHON:-python3}      # a Python with rolloutd installed
KEYS_DIR=$HOME/.rolloutd/keys                   # made once, see above
INFERENCE_API_KEY=${INFERENCE_API_KEY:-}         # the servers' bearer token, when they ask for one
# ---------------------------------------------------------------------------------------------

: "${ROLLOUTD_ROUTER:?no router address: ask the admin to set ROUTER_PORT_BASE in the rolloutd Slurm config}"
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
(( ${#nodes[@]} >= 2 )) || { echo "this template needs at least 2 nodes" >&2; exit 1; }
head=${nodes[0]}
router_port=${ROLLOUTD_ROUTER##*:}
gpu_nodes=$(IFS=,; echo "${nodes[*]:1}")

[ -r "$KEYS_DIR/router.key_secret" ] && [ -d "$KEYS_DIR/nodes" ] || {
  echo "no CURVE keys in $KEYS_DIR: see the top of this file" >&2; exit 1; }

# The router's private folder on this (the first) node: made fresh and 0700 by mktemp, so no
# other user can have created it first.
ROUTER_RUN_DIR=$(mktemp -d "${TMPDIR:-/tmp}/rolloutd-router-$SLURM_JOB_ID.XXXXXX")
trap 'rm -rf -- "$ROUTER_RUN_DIR"' EXIT

# 1. The router on the first node, as a job step: it ends with the job. Nodes join over TCP with
# their keys; the trainer, on the same host, uses the router's private ipc socket.
srun --nodes=1 --ntasks=1 --nodelist="$head" --overlap \
  "$ROLLOUTD" router start --run-dir "$ROUTER_RUN_DIR" --node-bind "tcp://0.0.0.0:$router_port" \
  --curve-secret-key-file "$KEYS_DIR/router.key_secret" --node-keys-dir "$KEYS_DIR/nodes" \
  >"router-$SLURM_JOB_ID.log" 2>&1 &

# 2. One inference server per GPU node, as one job step.
srun --nodes=$((${#nodes[@]} - 1)) --ntasks-per-node=1 --nodelist="$gpu_nodes" --overlap \
  bash -c "exec $INFERENCE_CMD" >"inference-$SLURM_JOB_ID.log" 2>&1 &
servers=()
for n in "${nodes[@]:1}"; do servers+=("http://$n:$INFERENCE_PORT"); done
export ROLLOUTD_INFERENCE_SERVERS=$(IFS=,; echo "${servers[*]}")

"$ROLLOUTD_PYTHON" - "$INFERENCE_READY_TIMEOUT_S" "${servers[@]}" <<'EOF'
import sys, time, urllib.request
deadline = time.monotonic() + float(sys.argv[1])
for url in sys.argv[2:]:
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=5).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                sys.exit(f"inference server {url} did not answer within {sys.argv[1]} s")
            time.sleep(5)
print("inference servers up:", " ".join(sys.argv[2:]))
EOF

# The node daemons started before this script: the router hands each server to all of them.
INFERENCE_API_KEY=$INFERENCE_API_KEY ROLLOUTD_ADDRESS="ipc://$ROUTER_RUN_DIR/router.sock" \
  "$ROLLOUTD_PYTHON" - "$INFERENCE_READY_TIMEOUT_S" "${servers[@]}" <<'EOF'
import os, sys, time
from rolloutd.client.sync_client import RolloutClient
deadline = time.monotonic() + float(sys.argv[1])
while not os.path.exists(os.environ["ROLLOUTD_ADDRESS"][len("ipc://"):]):
    if time.monotonic() > deadline:
        sys.exit(f"the router did not come up; see router-{os.environ['SLURM_JOB_ID']}.log")
    time.sleep(1)
with RolloutClient() as c:
    for url in sys.argv[2:]:
        c.add_inference_server(url, os.environ.get("INFERENCE_API_KEY") or None)
print("node daemons send model turns to:", " ".join(sys.argv[2:]))
EOF

# 3. The trainer on the first node talks to the router, which spreads rollouts over every node's
# daemon.
srun --nodes=1 --ntasks=1 --nodelist="$head" --overlap \
  env ROLLOUTD_ADDRESS="ipc://$ROUTER_RUN_DIR/router.sock" bash -c "exec $TRAINER_CMD"
