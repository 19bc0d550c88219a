"""Run one Harbor trial (Harbor's own Trial, agent and verifier) on a rolloutd environment; print
its result as JSON. Runs in the Harbor environment (.venv-harbor: Python 3.12, harbor pinned).
    run_trial.py TASK_DIR AGENT TRIALS_DIR ADDRESS"""

import asyncio
import json
import sys
from pathlib import Path

from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig, TrialConfig
from harbor.trial.trial import Trial


async def main(task_dir: str, agent: str, trials_dir: str, address: str) -> None:
    config = TrialConfig(
        task=TaskConfig(path=Path(task_dir)), trials_dir=Path(trials_dir), agent=AgentConfig(name=agent),
        environment=EnvironmentConfig(import_path="rolloutd.client.providers.harbor_env:RolloutdEnvironment",
                                      kwargs={"address": address}))
    result = await (await Trial.create(config)).run()
    print(json.dumps({
        "rewards": result.verifier_result.rewards if result.verifier_result else None,
        "exception": result.exception_info.model_dump(mode="json") if result.exception_info else None}))


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
