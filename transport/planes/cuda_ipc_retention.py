"""Target side of ``cuda_ipc``: the memory of unregistered exports, held while a peer may still use it.

See :class:`Retention`; :mod:`transport.planes.cuda_ipc_engine` explains why (a peer maps a whole allocator segment,
so the owner's allocator must not reuse a block a peer might still copy into).
"""

from __future__ import annotations

import os
import select
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["NEVER", "Retention"]

NEVER = sys.maxsize  # the retirement epoch of exports dropped at close: no confirmation covers it


@dataclass
class _Holder:
    acked: int  # newest registry epoch it confirmed (or the epoch of the Hello we sent it)
    pid: int | None  # its process, if on this host
    cap: int | None = None  # closed: the newest export id there was then (it cannot have mapped later ones)
    fd: int | None = None  # closed: pidfd of its process, watched until it exits


class Retention:
    """Target side: the memory of unregistered ``cuda_ipc`` exports, held for peers that may map it.

    Peers are tracked by *holder* keys (a channel, or a handshake still in progress), each with the
    newest registry epoch it has confirmed: ``Unmapped(epoch)`` says "nothing absent from your
    registry at that epoch is mapped or used by a copy of mine"; a holder starts at the epoch of
    the Hello we sent it (what it may have mapped from). An export that left the registry at epoch
    ``E`` is released (``release(keep)``) once every holder has confirmed an epoch >= ``E``.

    A holder whose channel closed without the peer's promise (a Bye, sent only once its copies
    were over) may still have copies in flight: if its process lives on this host it keeps
    holding (a *zombie*) the exports that existed when it closed, until that process exits
    (watched through a pidfd); exports made later are not its concern. :meth:`shutdown` (the
    endpoint closes) turns every holder into such a zombie: memory that a live peer process may
    still write into outlives the endpoint. Only same-host peers that offer ``cuda_ipc`` are
    holders. Thread-safe; the watcher thread runs only while there are zombies.
    """

    def __init__(self, release: Callable[[Any], None]) -> None:
        self._release = release
        self._lock = threading.Lock()
        self._held: dict[int, tuple[Any, int]] = {}  # export id -> (keep, epoch it left the registry)
        self._holders: dict[str, _Holder] = {}
        self._watcher: threading.Thread | None = None
        self._shut = False

    def watch(self, holder: str, epoch: int, pid: int | None) -> None:
        """``holder`` (process ``pid`` if on this host) may map exports of registries up to ``epoch``."""
        with self._lock:
            if self._shut:
                return
            h = self._holders.get(holder)
            if h is None:
                self._holders[holder] = _Holder(epoch, pid)
            else:
                h.acked = min(h.acked, epoch)

    def forget(self, holder: str) -> None:
        """``holder`` maps nothing of ours (a failed handshake, a peer that promised so)."""
        with self._lock:
            h = self._holders.pop(holder, None)
        if h is not None and h.fd is not None:
            os.close(h.fd)
        self._sweep()

    def acked(self, holder: str, epoch: int) -> None:
        """``Unmapped(epoch)`` from ``holder``."""
        with self._lock:
            h = self._holders.get(holder)
            if h is None:
                return
            h.acked = max(h.acked, epoch)
        self._sweep()

    def closed(self, holder: str, newest_export: int | None) -> None:
        """``holder``'s channel closed. ``newest_export``: the newest export id so far, or None if
        nothing needs waiting for (the peer promised it is done, or we never exported anything)."""
        with self._lock:
            h = self._holders.get(holder)
            if h is None:
                return
            self._zombify(holder, h, newest_export)
        self._sweep()

    def _zombify(self, holder: str, h: _Holder, newest_export: int | None) -> None:
        if h.fd is not None:
            return
        fd = None
        if newest_export is not None and h.pid is not None:
            try:
                fd = os.pidfd_open(h.pid)
            except (OSError, AttributeError):  # gone already (or no pidfd: assume gone)
                fd = None
        if fd is None:
            del self._holders[holder]
            return
        h.fd, h.cap = fd, newest_export
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch_zombies, name="transport-ipc-zombies", daemon=True)
            self._watcher.start()

    def retire(self, export_id: int, keep: Any, epoch: int) -> None:
        """An export left the registry at ``epoch`` (:data:`NEVER`: dropped at close): hold ``keep``
        until no holder may use it any more."""
        with self._lock:
            self._held[export_id] = (keep, epoch)
        self._sweep()

    def shutdown(self, newest_export: int | None) -> None:
        """The endpoint closes: no new holders; each one left becomes a zombie (see the class)."""
        with self._lock:
            self._shut = True
            for holder, h in list(self._holders.items()):
                self._zombify(holder, h, newest_export)
        self._sweep()

    def _sweep(self) -> None:
        done = []
        with self._lock:
            holders = list(self._holders.values())
            for eid, (keep, epoch) in list(self._held.items()):
                if all(h.acked >= epoch or (h.cap is not None and eid > h.cap) for h in holders):
                    del self._held[eid]
                    done.append(keep)
        for keep in done:
            self._release(keep)

    def _watch_zombies(self) -> None:
        while True:
            with self._lock:
                fds = {holder: h.fd for holder, h in self._holders.items() if h.fd is not None}
                if not fds:
                    self._watcher = None
                    return
            try:
                ready, _, _ = select.select(list(fds.values()), [], [], 1.0)
            except (OSError, ValueError):  # one was closed meanwhile (forgotten): look again
                continue
            for holder, fd in fds.items():
                if fd in ready:
                    self.forget(holder)

    @property
    def held(self) -> dict[int, int]:
        """Export id -> the epoch it left the registry (a copy; for tests and the doctor)."""
        with self._lock:
            return {eid: epoch for eid, (_, epoch) in self._held.items()}

    @property
    def holders(self) -> dict[str, int]:
        """Holder -> the newest epoch it confirmed (zombies included)."""
        with self._lock:
            return {k: h.acked for k, h in self._holders.items()}
