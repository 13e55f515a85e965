"""A TCP proxy that cuts its connections on cue: a broken network path for tests.

``TcpProxy(target)`` listens on a free loopback port and forwards every connection to
``target``; :meth:`TcpProxy.cut_after` makes it reset every open connection once the
bytes it has forwarded towards the clients pass a mark (mid-stream, wherever that falls),
and :meth:`TcpProxy.cut_now` resets them at once. New connections are forwarded as before,
so a client that reconnects goes on: what a fetch must survive when a link flaps; with
``refuse=True`` it resets every new connection from then on too (the path is down) until
:meth:`TcpProxy.accept`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct


class TcpProxy:
    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self._server: asyncio.Server | None = None
        self._conns: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._mark: int | None = None
        self._refuse_at_cut = False
        self.refusing = False
        self.downstream_bytes = 0  # forwarded towards the clients, all connections
        self.cuts = 0  # times the connections were reset
        self.connections = 0  # accepted

    @property
    def address(self) -> str:
        assert self._server is not None
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def stop(self) -> None:
        self.cut_now()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def cut_after(self, nbytes: int, *, refuse: bool = False) -> None:
        """Reset every open connection once ``nbytes`` more bytes went to the clients
        (``refuse``: and every new one from then on)."""
        self._mark = self.downstream_bytes + nbytes
        self._refuse_at_cut = refuse

    def accept(self) -> None:
        """Forward new connections again."""
        self.refusing = False

    def cut_now(self) -> None:
        self.cuts += 1
        if self._refuse_at_cut:
            self.refusing = True
        for a, b in list(self._conns):
            for w in (a, b):
                _reset(w)
        self._conns.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.refusing:
            _reset(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            _reset(writer)
            return
        pair = (writer, up_writer)
        self._conns.add(pair)
        try:
            await asyncio.gather(
                self._pump(reader, up_writer, down=False),
                self._pump(up_reader, writer, down=True),
            )
        finally:
            self._conns.discard(pair)
            for w in pair:
                _reset(w)

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, down: bool
    ) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(65536):
                if down and self._mark is not None:
                    room = self._mark - self.downstream_bytes
                    if len(data) >= room:
                        writer.write(data[: max(0, room)])
                        self.downstream_bytes += max(0, room)
                        self._mark = None
                        self.cut_now()
                        return
                writer.write(data)
                await writer.drain()
                if down:
                    self.downstream_bytes += len(data)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0): the peer sees the connection broken."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
