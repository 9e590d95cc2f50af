"""The endpoints of one process share one client per store address (transport.rendezvous):
opening endpoints again and again does not connect to the store again and again (each connect
of a TCPStore client may stall 5 s on a reverse DNS look-up; see the module's docstring).

The store is reached through a counting TCP proxy (real sockets), which tells how many
connections the process opened to it."""

from __future__ import annotations

import asyncio
import socket
import threading

import torch

import transport
from transport.rendezvous import parse_store_url


class CountingProxy:
    """Forwards every connection to ``upstream``; counts them; :meth:`cut` drops those open."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.accepted = 0
        self._lsock = socket.create_server(("127.0.0.1", 0))
        self._live: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self._lsock.getsockname()[1]}"

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self._lsock.accept()
            except OSError:
                return
            b = socket.create_connection(self.upstream, timeout=10)
            b.settimeout(None)
            with self._lock:
                self.accepted += 1
                self._live += [a, b]
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        with self._lock:
            live, self._live = self._live, []
        for s in live:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self._lsock.close()
        self.cut()


async def test_endpoints_of_a_process_share_one_store_connection(store_url, uname):
    proxy = CountingProxy(parse_store_url(store_url))
    try:
        async with transport.Endpoint(uname("peer"), store=store_url, timeout=10) as target:
            target.register("w", torch.zeros(8))
            for i in range(6):  # a generator restarting: open, connect, put, close
                async with transport.Endpoint(uname("gen"), store=proxy.url, timeout=10) as ep:
                    await ep.put(target.name, {"w": torch.full((8,), float(i))})
            eps = [transport.Endpoint(uname("many"), store=proxy.url, timeout=10) for _ in range(3)]
            await asyncio.gather(*(ep.open() for ep in eps))  # opened at once
            try:
                for ep in eps:
                    await ep.connect(target.name)
            finally:
                await asyncio.gather(*(ep.close() for ep in eps))
        assert proxy.accepted == 1
    finally:
        proxy.close()


async def test_a_client_whose_store_connection_broke_is_replaced(store_url, uname):
    proxy = CountingProxy(parse_store_url(store_url))
    try:
        async with transport.Endpoint(uname("a"), store=proxy.url, timeout=10) as a:
            a.register("w", torch.zeros(8))
        assert proxy.accepted == 1
        proxy.cut()  # the store went away for the client kept from the first open
        async with transport.Endpoint(uname("b"), store=proxy.url, timeout=10) as b:
            b.register("w", torch.zeros(8))
            async with transport.Endpoint(uname("c"), store=proxy.url, timeout=10) as c:
                await c.put(b.name, {"w": torch.ones(8)})
        assert proxy.accepted == 2
    finally:
        proxy.close()
