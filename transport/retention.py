"""Target side of ``cuda_ipc``: the memory of unregistered exports, held while a peer may still use it.

See :class:`Retention`; :mod:`transport.ipc` explains why (a peer maps a whole allocator segment,
so the owner's allocator must not reuse a block a peer might still copy into).
"""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Retention"]


class Retention:
    """Target side: the memory of unregistered ``cuda_ipc`` exports, held for peers that may map it.

    Peers are tracked by *holder* keys (a channel id, or a handshake still in progress), each with
    the newest registry epoch it has confirmed: ``Unmapped(epoch)`` says "nothing absent from your
    registry at that epoch is mapped or used by a copy of mine"; a holder starts at the epoch of
    the Hello we sent it (what it may have mapped from). An export unregistered at epoch ``E`` is
    released (``release(keep)``) once every holder has confirmed an epoch >= ``E``. A holder whose
    channel closed while its process lives on the same host may still have copies in flight: it
    keeps holding (a *zombie*) until that process exits (watched through a pidfd). Only same-host
    peers that offer ``cuda_ipc`` are holders. Thread-safe.
    """

    def __init__(self, release: Callable[[Any], None]) -> None:
        self._release = release
        self._lock = threading.Lock()
        self._held: dict[int, tuple[Any, int]] = {}  # export id -> (keep, epoch it left the registry)
        self._acked: dict[str, int] = {}  # holder -> newest epoch it confirmed
        self._zombies: dict[str, int] = {}  # holder whose channel closed -> pidfd of its process
        self._watcher: threading.Thread | None = None
        self._closed = False

    def watch(self, holder: str, epoch: int) -> None:
        """``holder`` may map exports of registries up to ``epoch`` (its Hello)."""
        with self._lock:
            self._acked[holder] = min(epoch, self._acked.get(holder, epoch))

    def forget(self, holder: str) -> None:
        """``holder`` maps nothing of ours (a failed handshake, a channel that needs no tracking)."""
        with self._lock:
            self._acked.pop(holder, None)
            fd = self._zombies.pop(holder, None)
        if fd is not None:
            os.close(fd)
        self._sweep()

    def acked(self, holder: str, epoch: int) -> None:
        """``Unmapped(epoch)`` from ``holder``."""
        with self._lock:
            if holder not in self._acked:
                return
            self._acked[holder] = max(self._acked[holder], epoch)
        self._sweep()

    def closed(self, holder: str, pid: int | None) -> None:
        """``holder``'s channel closed; ``pid`` is its process if on this host (None: nothing to wait for)."""
        with self._lock:
            if holder not in self._acked:
                return
            if pid is None or self._closed:
                fd = None
            else:
                try:
                    fd = os.pidfd_open(pid)
                except (OSError, AttributeError):  # gone already (or no pidfd: assume gone)
                    fd = None
            if fd is None:
                del self._acked[holder]
            else:
                self._zombies[holder] = fd
                if self._watcher is None:
                    self._watcher = threading.Thread(target=self._watch_zombies, name="transport-ipc-zombies",
                                                     daemon=True)
                    self._watcher.start()
        self._sweep()

    def retire(self, export_id: int, keep: Any, epoch: int) -> None:
        """An export left the registry at ``epoch``: hold ``keep`` until every holder confirmed it."""
        with self._lock:
            self._held[export_id] = (keep, epoch)
        self._sweep()

    def _sweep(self) -> None:
        done = []
        with self._lock:
            floor = min(self._acked.values(), default=None)
            for eid, (keep, epoch) in list(self._held.items()):
                if floor is None or floor >= epoch:
                    del self._held[eid]
                    done.append(keep)
        for keep in done:
            self._release(keep)

    def _watch_zombies(self) -> None:
        while True:
            with self._lock:
                if self._closed or not self._zombies:
                    self._watcher = None
                    return
                fds = dict(self._zombies)
            try:
                ready, _, _ = select.select(list(fds.values()), [], [], 1.0)
            except (OSError, ValueError):  # one was closed meanwhile (forgotten): look again
                continue
            for holder, fd in fds.items():
                if fd in ready:
                    self.forget(holder)

    def release_all(self) -> None:
        """The endpoint is closing: release everything (its process's mappings of ours end with it)."""
        with self._lock:
            self._closed = True
            held, self._held = [k for k, _ in self._held.values()], {}
            fds, self._zombies = list(self._zombies.values()), {}
            self._acked.clear()
        for fd in fds:
            os.close(fd)
        for keep in held:
            self._release(keep)

    @property
    def held(self) -> dict[int, int]:
        """Export id -> the epoch it left the registry (a copy; for tests and the doctor)."""
        with self._lock:
            return {eid: epoch for eid, (_, epoch) in self._held.items()}

    @property
    def holders(self) -> dict[str, int]:
        """Holder -> the newest epoch it confirmed (zombies included)."""
        with self._lock:
            return dict(self._acked)
