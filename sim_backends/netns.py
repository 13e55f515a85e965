"""Network namespaces for the local testbed: create and delete namespaces, veth pairs,
addresses, and run commands inside a namespace (needs root; uses iproute2's ``ip``).

``Testbed`` remembers everything it created and deletes it on exit, also when the body
failed, so a crashed test leaves nothing behind. Names carry a per-process prefix
(``orlt-<pid>-``) so concurrent runs never collide and leftovers of dead runs can be
recognised (:func:`remove_stale`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from pyroute2.netns import setns

from orchestrrl import errors

PREFIX = "orlt"
NETNS_DIR = Path("/run/netns")
COMMAND_TIMEOUT_S = 20.0
_counter = itertools.count()


@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


async def run(
    argv: Sequence[str], *, netns: str | None = None, check: bool = True, stdin: str | None = None
) -> CommandResult:
    """Run a command (inside ``netns`` when given); ``check`` raises on a non-zero exit."""
    full = ("ip", "netns", "exec", netns, *argv) if netns else tuple(argv)
    proc = await asyncio.create_subprocess_exec(
        *full,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            out, err = await proc.communicate(stdin.encode() if stdin is not None else None)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise errors.Unavailable(
            f"{' '.join(full)}: no answer within {COMMAND_TIMEOUT_S:g}s"
        ) from None
    result = CommandResult(full, proc.returncode or 0, out.decode(), err.decode())
    if check and result.returncode:
        raise errors.FailedPrecondition(
            f"{' '.join(full)} exited {result.returncode}: {result.stderr.strip()}"
        )
    return result


def unique_name(kind: str = "ns") -> str:
    """``orlt-<pid>-<kind><n>``: unique within this process, recognisable across runs."""
    return f"{PREFIX}-{os.getpid()}-{kind}{next(_counter)}"


async def add_netns(name: str) -> None:
    await run(["ip", "netns", "add", name])
    await run(["ip", "-n", name, "link", "set", "lo", "up"])


async def delete_netns(name: str) -> None:
    """Delete a namespace (its veth ends go with it); a missing one is not an error."""
    await run(["ip", "netns", "delete", name], check=False)


async def add_veth(
    a: str, b: str, *, netns_a: str | None = None, netns_b: str | None = None
) -> None:
    """A veth pair ``a`` <-> ``b``, each end in its namespace (None: the root one), up."""
    argv = ["ip", "link", "add", a]
    if netns_a:
        argv += ["netns", netns_a]
    argv += ["type", "veth", "peer", "name", b]
    if netns_b:
        argv += ["netns", netns_b]
    await run(argv)
    await set_up(a, netns_a)
    await set_up(b, netns_b)


async def delete_link(name: str, netns: str | None = None) -> None:
    await run([*_ip(netns), "link", "del", name], check=False)


async def set_up(dev: str, netns: str | None = None) -> None:
    await run([*_ip(netns), "link", "set", dev, "up"])


async def add_address(dev: str, cidr: str, netns: str | None = None) -> None:
    """An address on ``dev``; IPv6 addresses skip duplicate detection (usable at once)."""
    extra = ["nodad"] if ":" in cidr else []
    await run([*_ip(netns), "addr", "add", cidr, "dev", dev, *extra])


def _ip(netns: str | None) -> list[str]:
    return ["ip", "-n", netns] if netns else ["ip"]


def namespaces_with_prefix(prefix: str) -> list[str]:
    """Named namespaces (``ip netns list``) whose name starts with ``prefix``."""
    if not NETNS_DIR.is_dir():
        return []
    return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(prefix))


async def links_with_prefix(prefix: str, netns: str | None = None) -> list[str]:
    """Interfaces whose name starts with ``prefix`` (in ``netns``; None: the host's)."""
    out = await run([*_ip(netns), "-j", "link", "show"])
    names = [str(link.get("ifname", "")) for link in json.loads(out.stdout or "[]")]
    return sorted(n for n in names if n.startswith(prefix))


async def netns_pids(name: str) -> list[int]:
    """Processes running inside namespace ``name`` (``ip netns pids``)."""
    out = await run(["ip", "netns", "pids", name], check=False)
    return sorted(int(p) for p in out.stdout.split() if p.isdigit())


async def batch(
    text: str, *, netns: str | None = None, tool: str = "ip", force: bool = False
) -> CommandResult | None:
    """Run ``ip -batch -`` (or ``tc -batch -``) with ``text``, inside ``netns`` when given.
    The first failing line stops it and is named in the error; with ``force`` every line
    runs and failures are only reported in the result (for deletions that may race)."""
    if not text:
        return None
    argv = [tool, *(["-n", netns] if netns else []), *(["-force"] if force else []), "-batch", "-"]
    return await run(argv, stdin=text, check=not force)


async def wait_links_up(ns: str, timeout_s: float = 5.0) -> None:
    """Wait until the kernel reports every link of ``ns`` (but lo) as up: after a veth
    is created or set up, its operational state follows a moment later."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        out = await run(["ip", "-n", ns, "-j", "link", "show"])
        down = [
            str(link.get("ifname"))
            for link in json.loads(out.stdout or "[]")
            if link.get("ifname") != "lo" and link.get("operstate") not in ("UP", "UNKNOWN")
        ]
        if not down:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise errors.FailedPrecondition(
                f"links of namespace {ns} not up after {timeout_s:g} s: {', '.join(down)}"
            )
        await asyncio.sleep(0.05)


async def set_sysctls(netns: str, settings: Sequence[str]) -> None:
    """Write ``key=value`` sysctls (``net.ipv4.ip_forward=1``) of namespace ``netns``.

    /proc/sys/net shows the namespace of the task that opens it, so a fresh thread
    enters the namespace, writes and ends (no process per namespace, no pool thread
    left behind in another namespace)."""
    failure: list[BaseException] = []

    def enter_and_write() -> None:
        try:
            setns(netns, flags=0, fork=False)
            for setting in settings:
                key, _, value = setting.partition("=")
                Path("/proc/sys", *key.split(".")).write_text(value)
        except BaseException as exc:  # handed to the caller below
            failure.append(exc)

    thread = threading.Thread(target=enter_and_write, name=f"sysctl-{netns}", daemon=True)
    thread.start()
    await asyncio.to_thread(thread.join)
    if failure:
        exc = failure[0]
        raise errors.FailedPrecondition(
            f"sysctl in netns {netns!r} ({', '.join(settings)}): {exc}"
        ) from exc


def stale_namespaces() -> list[str]:
    """``orlt-<pid>-*`` namespaces whose process is gone (left by a killed run)."""
    pattern = re.compile(rf"^{PREFIX}-(\d+)-")
    names = sorted(p.name for p in NETNS_DIR.iterdir()) if NETNS_DIR.is_dir() else []
    return [
        name
        for name in names
        if (match := pattern.match(name)) and not Path(f"/proc/{match.group(1)}").exists()
    ]


async def remove_stale() -> list[str]:
    """Delete the namespaces of :func:`stale_namespaces`; returns their names."""
    names = await asyncio.to_thread(stale_namespaces)
    for name in names:
        await delete_netns(name)
    return names


@dataclass
class Testbed:
    """Namespaces and root-namespace links created through it, deleted on exit."""

    namespaces: list[str] = field(default_factory=list)
    root_links: list[str] = field(default_factory=list)

    async def netns(self, kind: str = "ns") -> str:
        name = unique_name(kind)
        self.namespaces.append(name)  # before creating: a half-made one is deleted too
        await add_netns(name)
        return name

    async def veth(
        self, a: str, b: str, *, netns_a: str | None = None, netns_b: str | None = None
    ) -> None:
        if netns_a is None:
            self.root_links.append(a)
        elif netns_b is None:
            self.root_links.append(b)
        await add_veth(a, b, netns_a=netns_a, netns_b=netns_b)

    async def cleanup(self) -> None:
        for link in reversed(self.root_links):
            await delete_link(link)
        for name in reversed(self.namespaces):
            await delete_netns(name)
        self.root_links.clear()
        self.namespaces.clear()

    async def __aenter__(self) -> Testbed:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.cleanup()
