#!/bin/bash
# One node: the trainer, its inference server and the rollouts (sandboxes) on the same machine.
#
# The cluster's Prolog has already started a rolloutd node daemon for this job; the TaskProlog
# exported its address as ROLLOUTD_ADDRESS (ipc://..., so token arrays reach the trainer through
# shared memory). This script starts the inference server, waits until it answers, then runs the
# trainer, which finds the daemon through ROLLOUTD_ADDRESS. The daemon was started by the Prolog,
# before this script, so it learns of the server here: the script adds it to the daemon
# (add_inference_server, with the server's key when it needs one) and also exports
# ROLLOUTD_INFERENCE_SERVERS for the trainer. The server runs inside the job, so Slurm stops it
# with the job; the Epilog stops the node daemon.
#
#   sbatch slurm_templates/sbatch-single-node.sh          # after editing the settings below, or:
#   MODEL=/models/qwen TRAINER_CMD="python train.py" sbatch slurm_templates/sbatch-single-node.sh
#
#SBATCH --job-name=rolloutd-1node
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=32
#SBATCH --gres=gpu:8
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

# ---- settings (environment variables override them) ----------------------------------------
MODEL=${MODEL:-/path/to/model}
INFERENCE_PORT=${INFERENCE_PORT:-8000}
INFERENCE_GPUS=${INFERENCE_GPUS:-0,1,2,3}       # the server's GPUs; the trainer gets the others
TRAINER_GPUS=${TRAINER_GPUS:-4,5,6,7}
# The inference server: vLLM's OpenAI-compatible server (token ids in and out, see the README's
# Inference section). Any server rolloutd speaks works, e.g. SGLang's launch_server.
INFERENCE_CMD=${INFERENCE_CMD:-vllm serve $MODEL --port $INFERENCE_PORT --tensor-parallel-size 4}
INFERENCE_READY_TIMEOUT_S=${INFERENCE_READY_TIMEOUT_S:-900}
# The server's bearer token, when it asks for one (e.g. vllm serve --api-key); the daemon sends it.
INFERENCE_API_KEY=${INFERENCE_API_KEY:-}
TRAINER_CMD=${TRAINER_CMD:?set TRAINER_CMD to the command that runs your trainer}
# A Python with rolloutd installed (the trainer's), for the checks below.
ROLLOUTD_PYTHON=${ROLLOUTD_PYTHON:-python3}
# ---------------------------------------------------------------------------------------------

: "${ROLLOUTD_ADDRESS:?no rolloutd node daemon for this job: the Slurm hooks of rolloutd are not installed on this cluster (README, section Slurm)}"
"$ROLLOUTD_PYTHON" - <<'EOF'
from rolloutd.client.sync_client import RolloutClient
with RolloutClient() as c:
    s = c.status()
print(f"rolloutd node daemon at {s['address']}: pid {s['pid']}, {len(s['workers'])} workers")
EOF

CUDA_VISIBLE_DEVICES=$INFERENCE_GPUS bash -c "exec $INFERENCE_CMD" >"inference-$SLURM_JOB_ID.log" 2>&1 &
inference_pid=$!
trap 'kill $inference_pid 2>/dev/null; wait $inference_pid 2>/dev/null' EXIT

export ROLLOUTD_INFERENCE_SERVERS=http://127.0.0.1:$INFERENCE_PORT
"$ROLLOUTD_PYTHON" - "$ROLLOUTD_INFERENCE_SERVERS/health" "$INFERENCE_READY_TIMEOUT_S" "$inference_pid" <<'EOF'
import os, sys, time, urllib.request
url, deadline, pid = sys.argv[1], time.monotonic() + float(sys.argv[2]), int(sys.argv[3])
while True:
    try:
        urllib.request.urlopen(url, timeout=5).close()
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit(f"the inference server did not answer {url} within {sys.argv[2]} s")
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            sys.exit(f"the inference server exited; see inference-{os.environ['SLURM_JOB_ID']}.log")
        time.sleep(2)
print(f"inference server up at {url}")
EOF

# The key travels in the environment of one short process of this job, never on a command line.
INFERENCE_API_KEY=$INFERENCE_API_KEY "$ROLLOUTD_PYTHON" - "$ROLLOUTD_INFERENCE_SERVERS" <<'EOF'
import os, sys
from rolloutd.client.sync_client import RolloutClient
with RolloutClient() as c:
    c.add_inference_server(sys.argv[1], os.environ.get("INFERENCE_API_KEY") or None)
print(f"the node daemon sends model turns to {sys.argv[1]}")
EOF

CUDA_VISIBLE_DEVICES=$TRAINER_GPUS bash -c "exec $TRAINER_CMD"
