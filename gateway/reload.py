"""Safe hot reload of the pool file: validate the whole new config first; on any error keep serving the old one.

Triggers: the file changing on disk (watchfiles, debounced; editors that replace the file are handled by watching
its folder), SIGHUP, and `POST /admin/reload`. Kept endpoints keep their state (health, load, prefix index); removed
ones drain: requests already on them finish, new ones go elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from gateway.runtime import Gateway
from policies.config import ConfigError, load_config


log = logging.getLogger("m3gate.reload")


@dataclass
class ReloadStatus:
    ok: bool = True
    message: str = "initial config"
    at: float = field(default_factory=time.time)
    successes: int = 0
    failures: int = 0
    problems: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, object]:
        return {"ok": self.ok, "message": self.message, "at": self.at, "successes": self.successes,
                "failures": self.failures, "problems": self.problems}


class ConfigReloader:
    def __init__(self, gateway: Gateway, path: str | Path | None) -> None:
        self.gateway = gateway
        self.path = Path(path) if path else None
        self.status = ReloadStatus()
        self._lock = asyncio.Lock()
        self._watch_task: asyncio.Task[None] | None = None

    async def reload(self, trigger: str) -> ReloadStatus:
        """Load, validate and apply the file; never raises, never leaves a half-applied config."""
        if self.path is None:
            self.status.message = "no config file to reload (config given in memory)"
            return self.status
        async with self._lock:
            try:
                config = await asyncio.to_thread(load_config, self.path)
            except ConfigError as exc:
                self.status.ok = False
                self.status.failures += 1
                self.status.problems = exc.problems
                self.status.message = f"{trigger}: rejected, still serving the previous config"
                self.status.at = time.time()
                log.error("config reload (%s) rejected; the previous config keeps serving:\n%s", trigger, exc)
                self.gateway.telemetry_reload(ok=False)
                return self.status
            if config == self.gateway.config:
                self.status.message = f"{trigger}: unchanged"
                if not self.status.ok:  # the file is back to the config in force: nothing is rejected any more
                    self.status.ok, self.status.problems, self.status.at = True, [], time.time()
                return self.status
            notes = self.gateway.apply_config(config)
            await self.gateway.discovery.sync()
            self.status.ok = True
            self.status.successes += 1
            self.status.problems = notes
            self.status.message = f"{trigger}: applied"
            self.status.at = time.time()
            log.warning("config reloaded (%s): %s", trigger,
                        ", ".join(f"{p.name}={len(p.endpoints)} endpoints" for p in config.pools))
            for note in notes:
                log.warning("config reload: %s", note)
            self.gateway.telemetry_reload(ok=True)
            return self.status

    def start_watching(self) -> None:
        if self.path is not None and self._watch_task is None:
            self._watch_task = asyncio.create_task(self._watch(), name="m3gate-config-watch")

    async def stop(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
            try:
                await self._watch_task
            except (asyncio.CancelledError, Exception):
                pass
            self._watch_task = None

    async def _watch(self) -> None:
        from watchfiles import awatch

        assert self.path is not None
        # watchfiles logs each batch at INFO; a log file beside the config would then re-trigger the watch forever.
        logging.getLogger("watchfiles").setLevel(logging.WARNING)
        target = self.path.resolve()
        # Only the config file wakes the watcher: other files in its folder (a log file, say) must not, or each
        # write would be logged as a change, which is a write, which is a change...
        only_config = lambda _change, path: Path(path).resolve() == target  # noqa: E731
        async for changes in awatch(target.parent, debounce=100, step=20, recursive=False,
                                    watch_filter=only_config):
            if any(Path(p).resolve() == target for _, p in changes):
                await self.reload("file changed")
