"""The offline Harbor task folders and SWE-bench instances under tests/fixtures, as records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent / "fixtures"
HARBOR_TASKS = sorted(p for p in (FIXTURES / "harbor").iterdir() if (p / "task.toml").is_file())


def harbor_record(folder: Path) -> dict[str, Any]:
    return {"type": "harbor", "instance_id": folder.name, "task_dir": str(folder)}


def swebench_records() -> list[dict[str, Any]]:
    """The fixture instances, their ``repo_dir`` made absolute (a dataset holds node paths)."""
    folder = FIXTURES / "swebench"
    instances = json.loads((folder / "instances.json").read_text())
    return [{**i, "type": "swebench", "repo_dir": str(folder / i["repo_dir"])} for i in instances]
