"""SIGHUP: re-read the config file, apply what can change at run time, keep the last good.

The telemetry interval, the log level and the NIC list are applied to the running agent;
a change to any other setting is logged as needing a restart (and the running value
stays). An invalid file is rejected as a whole and the running configuration stays.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable

from node_agent.config import AgentConfig, ConfigChange, ConfigProblems, diff
from orchestrrl import errors
from orchestrrl.logs import get_logger

log = get_logger("node_agent.reload")

Apply = Callable[[AgentConfig, ConfigChange], Awaitable[None]]


class Reloader:
    def __init__(
        self, running: AgentConfig, load: Callable[[], AgentConfig] | None, apply: Apply
    ) -> None:
        """``load`` re-reads the configuration (None: no --config file); ``apply`` makes the
        running agent follow the runtime fields listed in the change."""
        self.running = running
        self._load = load
        self._apply = apply

    async def reload(self) -> ConfigChange | None:
        """One reload; the change applied, or None when nothing was (no file, bad file)."""
        if self._load is None:
            log.warning("config_reload_ignored", reason="no --config file was given")
            return None
        try:
            new = await asyncio.to_thread(self._load)
        except errors.InvalidArgument as exc:
            problems = exc.problems if isinstance(exc, ConfigProblems) else (str(exc),)
            log.error(
                "config_reload_rejected",
                problems=list(problems),
                effect="the running configuration stays; fix the file and send SIGHUP again",
            )
            return None
        change = diff(self.running, new)
        if change.applied:
            await self._apply(new, change)
            self.running = dataclasses.replace(
                self.running, **{name: getattr(new, name) for name in change.applied}
            )
        if change.needs_restart:
            log.warning(
                "config_change_needs_restart",
                fields=list(change.needs_restart),
                effect="running with the old values until the agent restarts",
            )
        log.info(
            "config_reloaded",
            applied={name: _show(getattr(new, name)) for name in change.applied},
            needs_restart=list(change.needs_restart),
        )
        return change

    async def serve(self, hangup: Callable[[], Awaitable[object]]) -> None:
        """Reload every time ``hangup()`` returns; runs until cancelled."""
        while True:
            await hangup()
            await self.reload()


def _show(value: object) -> object:
    return [_show(v) for v in value] if isinstance(value, tuple) else value
