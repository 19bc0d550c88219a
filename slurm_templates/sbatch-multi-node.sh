#!/bin/bash
# Several nodes: node daemons everywhere, the router and the trainer on the first node, inference
# servers on the other (GPU) nodes.
#
#   node 0            router (tcp, CURVE)  +  trainer  ──────────▶ ROLLOUTD_ROUTER
#   nodes 0..N-1      rolloutd node daemon (Prolog) ── joins the router, runs sandboxes
#   nodes 1..N-1      inference server on each node's GPUs
#
# >>> PLANNED: the router and federation (`rolloutd router start`, `rolloutd keygen`,
# >>> `rolloutd node start --router`) are being built; the commands below follow their planned
# >>> interface and are not tested yet. The single-node template is tested against real Slurm.
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
# CURVE keys of the router and the trainer, on a filesystem every node sees (made once per user).
KEYS_DIR=${KEYS_DIR:-$HOME/.rolloutd/keys}
# ---------------------------------------------------------------------------------------------

: "${ROLLOUTD_ROUTER:?no router address: ask the admin to set ROUTER_PORT_BASE in the rolloutd Slurm config}"
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
(( ${#nodes[@]} >= 2 )) || { echo "this template needs at least 2 nodes" >&2; exit 1; }
head=${nodes[0]}
router_port=${ROLLOUTD_ROUTER##*:}
gpu_nodes=$(IFS=,; echo "${nodes[*]:1}")

# 1. Keys, once per user (PLANNED: `rolloutd keygen`).
[ -e "$KEYS_DIR/router.key" ] || "$ROLLOUTD" keygen --out "$KEYS_DIR"

# 2. The router on the first node, as a job step: it ends with the job (PLANNED: `rolloutd router`).
srun --nodes=1 --ntasks=1 --nodelist="$head" --overlap \
  "$ROLLOUTD" router start --bind "tcp://0.0.0.0:$router_port" --keys "$KEYS_DIR" \
  >"router-$SLURM_JOB_ID.log" 2>&1 &

# 3. One inference server per GPU node, as one job step.
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

# 4. The trainer on the first node talks to the router, which spreads rollouts over every node's
# daemon. ROLLOUTD_ADDRESS (this node's daemon) stays available for single-node use.
export ROLLOUTD_CURVE_KEYS=$KEYS_DIR
srun --nodes=1 --ntasks=1 --nodelist="$head" --overlap \
  env ROLLOUTD_ADDRESS="$ROLLOUTD_ROUTER" bash -c "exec $TRAINER_CMD"
