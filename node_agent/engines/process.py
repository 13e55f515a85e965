"""An engine server process: launch, wait until healthy, watch, stop.

The process gets its own process group (vLLM and SGLang spawn workers), so stopping it
signals the whole group: SIGTERM, then SIGKILL after a grace period. It is killed when
the agent dies, however the agent dies. Its output goes to a
log file; when it fails to start, the error carries the end of that log.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import aiohttp

from orchestrrl import errors
from orchestrrl.logs import get_logger

log = get_logger("node_agent.engines")

LOG_TAIL_BYTES = 2000
SETPRIV = shutil.which("setpriv")  # util-linux


def with_parent_death_signal(argv: Sequence[str]) -> list[str]:
    """``argv`` run so that it gets SIGKILL when the agent dies (even by SIGKILL), and no
    engine server outlives it holding GPUs and ports: util-linux's ``setpriv
    --pdeathsig`` sets it and execs the server. (Not a preexec_fn: Python code between
    fork and exec in a threaded process can crash the child. Under systemd the unit's
    cgroup is killed as well.)"""
    if SETPRIV is None:
        return list(argv)
    return [SETPRIV, "--pdeathsig", "KILL", "--", *argv]


def tail(path: Path, size: int = LOG_TAIL_BYTES) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - size))
            return f.read().decode(errors="replace").strip()
    except OSError:
        return ""


class EngineProcess:
    """One server process; ``health_url`` answers 200 once it serves."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        health_url: str,
        *,
        start_timeout_s: float,
        stop_grace_s: float = 10.0,
    ) -> None:
        self.name = name
        self.argv = tuple(argv)
        self.env = dict(env)
        self.log_path = log_path
        self.health_url = health_url
        self.start_timeout_s = start_timeout_s
        self.stop_grace_s = stop_grace_s
        self._proc: asyncio.subprocess.Process | None = None
        self.started_s = 0.0  # seconds the last start took

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def start(self, session: aiohttp.ClientSession) -> None:
        if self.alive:
            return
        t0 = time.perf_counter()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as out:
            out.write(f"\n=== {time.strftime('%F %T')} starting: {' '.join(self.argv)}\n".encode())
            out.flush()
            try:
                self._proc = await asyncio.create_subprocess_exec(
                    *with_parent_death_signal(self.argv),
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=out,
                    stderr=asyncio.subprocess.STDOUT,
                    env=self.env,
                    start_new_session=True,
                )
            except OSError as exc:
                raise errors.Unavailable(
                    f"{self.name}: cannot run {self.argv[0]!r}: {exc.strerror or exc}"
                ) from exc
        log.info("engine_starting", instance=self.name, pid=self._proc.pid, log=str(self.log_path))
        try:
            await self._wait_healthy(session)
        except BaseException:
            await self.stop()
            raise
        self.started_s = time.perf_counter() - t0
        log.info("engine_healthy", instance=self.name, seconds=round(self.started_s, 2))

    async def _wait_healthy(self, session: aiohttp.ClientSession) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self._proc.returncode is not None:
                raise errors.Unavailable(
                    f"{self.name} exited with status {self._proc.returncode} while starting; "
                    f"the end of its log ({self.log_path}):\n{tail(self.log_path)}"
                )
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with session.get(
                    self.health_url, timeout=aiohttp.ClientTimeout(total=2)
                ) as r:
                    if r.status == 200:
                        return
            if time.monotonic() > deadline:
                raise errors.Unavailable(
                    f"{self.name} was not healthy within {self.start_timeout_s:g} s "
                    f"({self.health_url}); the end of its log ({self.log_path}):\n"
                    f"{tail(self.log_path)}"
                )
            await asyncio.sleep(0.25)

    async def wait_exit(self) -> int:
        if self._proc is None:
            raise errors.FailedPrecondition(f"{self.name} was never started")
        return await self._proc.wait()

    async def stop(self) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        self._signal(proc, signal.SIGTERM)
        try:
            async with asyncio.timeout(self.stop_grace_s):
                await proc.wait()
        except TimeoutError:
            log.warning("engine_kill", instance=self.name, after_s=self.stop_grace_s)
            self._signal(proc, signal.SIGKILL)
            await proc.wait()
        # workers the server left behind in its group
        self._signal(proc, signal.SIGKILL)

    @staticmethod
    def _signal(proc: asyncio.subprocess.Process, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
