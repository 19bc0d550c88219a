"""rolloutd sandboxes as a Harbor environment: Harbor (0.26, Python 3.12+) runs its trials, its
agents and verifier included, in a sandbox leased from a node daemon.

Select it in a trial or job config with ``environment.import_path =
"rolloutd.client.providers.harbor_env:RolloutdEnvironment"`` and ``environment.kwargs =
{"address": ...}`` (default ``$ROLLOUTD_ADDRESS``, else this node's daemon). The image is the
task's ``environment/Dockerfile``, built by the daemon offline (``dockerfile:`` images), or its
``[environment].docker_image``; ``kwargs.image`` overrides both. Commands run in the sandbox's
shell as ``bash -c`` in a subshell (cwd and env stay there); the sandbox runs as one unprivileged
user, so ``user=`` is not switched (files an image's build made belong to that user). Files move
through the shell (:mod:`shell_channel`); nothing is mounted, so Harbor downloads the logs.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities

from rolloutd.native_io.errors import CommandTimeout

from .shell_channel import ShellChannel

LOG_FOLDERS = ("/logs/agent", "/logs/verifier", "/logs/artifacts")
"""Where Harbor's agents and verifier write (``EnvironmentPaths``), made at start."""


class RolloutdEnvironment(BaseEnvironment):
    def __init__(self, *args: Any, address: str | None = None, image: str | None = None, **kwargs: Any) -> None:
        self._address = address or os.environ.get("ROLLOUTD_ADDRESS")
        self._image = image
        self._channel: ShellChannel | None = None
        super().__init__(*args, **kwargs)

    @staticmethod
    def type() -> str:
        return "rolloutd"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        # Sandboxes start with no network at all: what Harbor's no-network mode asks for.
        return EnvironmentCapabilities(disable_internet=True)

    def _dockerfile(self) -> Path:
        return self.environment_dir / "Dockerfile"

    def _validate_definition(self) -> None:
        if self._image is None and not self._dockerfile().is_file() and not self.task_env_config.docker_image:
            raise FileNotFoundError(f"{self._dockerfile()} not found and no [environment].docker_image: rolloutd "
                                    "needs one of them (or environment kwargs image=...)")

    def _image_reference(self) -> str:
        if self._image is not None:
            return self._image
        if self._dockerfile().is_file():
            return f"dockerfile:{self._dockerfile().resolve()}"
        return f"docker://{self.task_env_config.docker_image}"

    @property
    def _shell(self) -> ShellChannel:
        if self._channel is None:
            raise RuntimeError("the rolloutd environment is not started")
        return self._channel

    async def start(self, force_build: bool) -> None:
        # force_build has nothing to do: images are cached by their content, an edit builds anew.
        self._channel = await ShellChannel.open(self._address, image=self._image_reference(), network=False,
                                                ipython=False, timeout_s=self.task_env_config.build_timeout_sec)
        folders = " ".join(LOG_FOLDERS)
        r = await self._shell.run(f"mkdir -p {folders}", 60.0)
        if r.exit_code != 0:
            raise RuntimeError(f"cannot make {folders} in the rolloutd sandbox: {r.output[-500:]}")

    async def stop(self, delete: bool) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()

    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None) -> ExecResult:
        line = f"bash -c {shlex.quote(command)}"
        merged = self._merge_env(env)  # Harbor's own precedence: persistent < per-exec < scoped (oracle env)
        if merged:
            line = f"env {' '.join(shlex.quote(f'{k}={v}') for k, v in merged.items())} {line}"
        if cwd:
            line = f"cd {shlex.quote(cwd)} && {line}"
        try:
            r, stderr = await self._shell.run_split(line, float(timeout_sec) if timeout_sec else None)
        except CommandTimeout as e:
            # Harbor's own environments say a timeout this way (docker.py).
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds") from e
        return ExecResult(stdout=r.output, stderr=stderr, return_code=r.exit_code)

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        await self._shell.write_bytes(target_path, Path(source_path).read_bytes())

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        await self._shell.upload_tree(Path(source_dir), target_dir)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        target = Path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(await self._shell.read_bytes(source_path))

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        await self._shell.download_tree(source_dir, Path(target_dir))
