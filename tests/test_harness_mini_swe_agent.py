"""mini-swe-agent solves a bundled task through the proxy: its own ``mini`` command line (its
default agent loop, its LiteLLM model class, its local environment running each bash action)
is the ``blackbox`` agent's harness in a sandbox, the scripted reference policy writes the fix,
the task's evaluation rewards it, and every model call mini-swe-agent made is in the trajectory
token for token (one history, no rewrite; its text a fresh render of the messages mini-swe-agent
saved in its own trajectory file)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest
from minisweagent.models.utils.actions_toolcall import BASH_TOOL as MINI_BASH_TOOL

from agent_support import BUNDLED, call
from openai_proxy_support import (
    check_segment_fidelity,
    decode,
    harness_env,
    render_as_harness_sees_it,
    run_blackbox,
)
from rolloutd.client.history_segments import split_history_segments
from rolloutd.native_io.wire import TaskRef

TASK = "casing-017"
FIXED = "casing/convert.py"
SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
OUT_INSIDE = "/opt/rolloutd-mini-out"


def plan() -> list[str]:
    """A bash-only solve: read the splitter, write the fixed module, run the tests, submit the way
    mini-swe-agent expects (the command's first output line)."""
    fixed = (BUNDLED / TASK / "solution" / FIXED).read_text()
    return [call("bash", "Let me read the word splitter.", command=f"sed -n 1,14p {FIXED}"),
            call("bash", "Split an acronym from a following capitalised word.",
                 command=f"cat > {FIXED} <<'EOF'\n{fixed}EOF"),
            call("bash", "Run the tests.", command="python3 -m pytest -q"),
            call("bash", "The tests pass; submitting.", command=f"echo {SUBMIT}")]


def mini_command(python: str, traj: str) -> str:
    """``mini`` with its packaged config, no confirmations, the proxy as an OpenAI-compatible
    endpoint (LiteLLM's ``openai/`` provider), its trajectory saved to ``traj``. The task message
    goes on a line of its own: mini's template puts "Please solve this issue: " before it, and the
    scripted policy keys on its ``Task id:`` line."""
    argv = [python, "-m", "minisweagent.run.mini", "-y", "--exit-immediately", "--agent-class", "default",
            "-c", "mini.yaml", "-c", "agent.step_limit=8", "-o", traj]
    return " ".join([shlex.join(argv), '-m "openai/$ROLLOUTD_MODEL"', '-t "$(echo; cat "$ROLLOUTD_TASK_PROMPT_FILE")"',
                     '-c "model.model_kwargs.api_base=$OPENAI_BASE_URL"',
                     '-c "model.model_kwargs.api_key=$OPENAI_API_KEY"'])


@pytest.mark.parametrize("backend", ["local", pytest.param("apptainer", marks=pytest.mark.apptainer)])
async def test_mini_swe_agent_solves_a_bundled_task_through_the_proxy(short_tmp: Path, backend: str) -> None:
    # mini-swe-agent's own files (its config folder, its trajectory) go to a folder the test reads.
    out = short_tmp / "out"
    out.mkdir()
    out.chmod(0o777)
    inside = OUT_INSIDE if backend == "apptainer" else str(out)
    python = "python3" if backend == "apptainer" else sys.executable
    env = {**harness_env(backend), "MSWEA_CONFIGURED": "true", "MSWEA_SILENT_STARTUP": "1",
           "MSWEA_COST_TRACKING": "ignore_errors", "MSWEA_GLOBAL_CONFIG_DIR": f"{inside}/mswea",
           "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    binds = ((str(out), OUT_INSIDE, "rw"),) if backend == "apptainer" else ()
    (t,) = await run_blackbox(short_tmp, backend, TaskRef(TASK), {TASK: plan()},
                              {"command": mini_command(python, f"{inside}/traj.json"), "env": env, "timeout_s": 300},
                              max_tokens=1024, sdk="mini-swe-agent", binds=binds)
    assert (t.finish_reason, t.error_message) == ("completed", None), t.metrics.get("harness_output_tail")
    assert t.reward == 1.0  # the task's own tests pass on what mini-swe-agent's actions wrote
    saved = json.loads((out / "traj.json").read_text())
    assert saved["info"]["exit_status"] == "Submitted"
    assert t.num_turns == 4 and t.metrics["tool_calls"] == {"bash": 4}
    assert not t.metrics["history_rewritten"], t.metrics["history_rewrites"]
    (segment,) = split_history_segments(t)
    check_segment_fidelity(segment)
    # Token-exact: the trajectory is a fresh render of the conversation mini-swe-agent kept.
    sent = [{k: v for k, v in m.items() if k in ("role", "content", "tool_calls", "tool_call_id")}
            for m in saved["messages"] if m["role"] != "exit"]
    assert [m["role"] for m in sent] == ["system", "user"] + ["assistant", "tool"] * 3 + ["assistant"]
    whole = decode(np.concatenate([t.prompt_ids, t.response_ids]))
    assert whole == render_as_harness_sees_it(sent, [MINI_BASH_TOOL], ends_with_eot=True)
