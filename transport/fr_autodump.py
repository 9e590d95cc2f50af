"""When and where an endpoint writes its flight recorder: on a lost peer or a timeout (at most
one automatic dump per :data:`DUMP_INTERVAL` s, so a burst of failures writes one file, not
hundreds), on a signal, and on request. Automatic dumps are written on a worker thread, so the
event loop never waits for the disk; a failed write is logged.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from pathlib import Path

from .flight_recorder import FlightRecorder

__all__ = ["DUMP_INTERVAL", "Dumps"]

log = logging.getLogger("transport.endpoint")

DUMP_INTERVAL = 5.0  # at most one automatic flight-recorder dump per this many seconds


class Dumps:
    """Dumps of ``recorder`` (its endpoint is ``name``) into ``dump_dir`` (None: the recorder's
    default, ``$TRANSPORT_FR_DIR`` or ``<tmp>/transport-fr``)."""

    def __init__(self, recorder: FlightRecorder, name: str, dump_dir: str | Path | None) -> None:
        self._recorder = recorder
        self._name = name
        self._dir = Path(dump_dir) if dump_dir is not None else None
        self._last = -DUMP_INTERVAL

    def _path(self) -> Path | None:
        if self._dir is None:
            return None
        return self._dir / f"fr-{self._name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}.json"

    def auto(self, reason: str, *, force: bool = False) -> None:
        """Dump on a worker thread (non-blocking); at most once per :data:`DUMP_INTERVAL` s unless
        ``force``."""
        now = time.monotonic()
        if not force and now - self._last < DUMP_INTERVAL:
            log.debug("flight recorder dump skipped (one was written %.1f s ago): %s", now - self._last, reason)
            return
        self._last = now
        path = self._path()

        def write() -> None:
            try:
                if path is not None:
                    path.parent.mkdir(parents=True, exist_ok=True)
                self._recorder.dump(path, reason=reason)
            except OSError as exc:
                log.error("could not dump the flight recorder: %s", exc)

        threading.Thread(target=write, name="transport-fr-dump", daemon=True).start()

    def now(self, path: str | Path | None = None) -> Path:
        """Write a dump to ``path`` (None: a new file in the dump directory), blocking; its path."""
        if path is None and self._dir is not None:
            self._dir.mkdir(parents=True, exist_ok=True)
            path = self._path()
        return self._recorder.dump(path, reason="request")
