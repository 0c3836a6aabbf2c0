"""A fault-injecting TCP proxy: forwards one listening port to a target and, on command,
adds latency, stalls every byte, resets the connections it carries, or partitions (refuses
and cuts everything) until healed. It runs its own asyncio loop in a thread."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading

from tests.services import free_port

CHUNK = 65536


class FaultProxy:
    """127.0.0.1:``port`` → ``target``; the fault knobs may be turned from any thread."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self.latency_s = 0.0
        self._flowing = asyncio.Event()  # cleared: a stall, every byte held back
        self._partitioned = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self._thread.start()
        self._call(self._start())

    def close(self) -> None:
        """Stop listening, cut every connection, end the loop's thread."""
        if self._thread.is_alive():
            self._call(self._close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    def stall(self, stalled: bool) -> None:
        """Hold back every byte in both directions (connections stay open) or let go."""
        self._loop.call_soon_threadsafe(self._flowing.clear if stalled else self._flowing.set)

    def reset(self) -> None:
        """Cut every connection now with a TCP reset, as a crashed middlebox would."""
        self._call(self._reset())

    def partition(self, partitioned: bool) -> None:
        """While partitioned, every carried connection is reset and new ones are refused."""
        self._partitioned = partitioned
        if partitioned:
            self.reset()

    def _call(self, coroutine) -> None:
        asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=10)

    async def _start(self) -> None:
        self._flowing.set()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _close(self) -> None:
        self._server.close()
        await self._reset()

    async def _reset(self) -> None:
        for writer in list(self._writers):
            abort(writer)
        self._writers.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._partitioned:
            abort(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            abort(writer)
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        for w in (writer, up_writer):
            self._writers.discard(w)
            abort(w)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy one direction, each chunk held back by the latency and any stall."""
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(CHUNK):
                if self.latency_s:
                    await asyncio.sleep(self.latency_s)
                await self._flowing.wait()
                if writer.is_closing():
                    return
                writer.write(data)
                await writer.drain()
        abort(writer)


def abort(writer: asyncio.StreamWriter) -> None:
    """Close with RST rather than FIN: linger on, timeout 0."""
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.fileno() != -1:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
