"""Flight recorder: a ring buffer of the most recent ops, dumped as JSON.

Both sides of a channel record every op they take part in: the initiator
when it posts the op (an op it does synchronously, a one-sided shm put or get
done on the event loop, once it is over, with its start time: no dump can be
taken while it runs), the target when the op's header arrives. A record is
keyed by ``(channel, initiator, seq)``, the same on both sides, so that
``python -m transport fr A.json B.json`` can pair the two views and name the
op (and the peer) that stalled. Records are updated in place as the op moves
through its states; the ring keeps the newest ``capacity`` records.

Thread safety: records are created and updated from the event loop and from
channel reader threads; one lock guards the ring.
"""

from __future__ import annotations

import collections
import enum
import itertools
import json
import logging
import os
import socket
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["FlightRecorder", "OpKind", "OpState", "Record", "default_dump_dir"]

log = logging.getLogger(__name__)


class OpKind(str, enum.Enum):
    PUT = "put"
    GET = "get"
    NOTIFY = "notify"
    POST = "post"  # a notification nothing answers (Endpoint.post): the initiator's record is done once sent
    SYNC = "sync"


class OpState(str, enum.Enum):
    """Where an op is. Initiator: posted -> sent -> done | failed | timed_out | cancelled.
    Target: received -> done | rejected | failed."""

    POSTED = "posted"
    SENT = "sent"
    RECEIVED = "received"
    DONE = "done"
    REJECTED = "rejected"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"


FINAL_STATES = frozenset({OpState.DONE, OpState.REJECTED, OpState.FAILED, OpState.CANCELLED})
_STICKY = frozenset(s.value for s in FINAL_STATES | {OpState.TIMED_OUT})


@dataclass(slots=True)  # (slots: a record is made on both sides of every op)
class Record:
    record_id: int
    op_id: int
    channel: str
    seq: int
    role: str  # "initiator" or "target"
    initiator: str
    peer: str
    kind: str
    names: list[str]
    nbytes: int
    plane: str
    state: str
    t_posted: float
    t_updated: float
    history: list[tuple[str, float]] = field(default_factory=list)
    error: str | None = None


def default_dump_dir() -> Path:
    """``$TRANSPORT_FR_DIR`` or ``<tmp>/transport-fr``."""
    return Path(os.environ.get("TRANSPORT_FR_DIR") or Path(tempfile.gettempdir()) / "transport-fr")


class FlightRecorder:
    """Keeps the last ``capacity`` op records of one endpoint."""

    def __init__(self, endpoint: str, incarnation: int, capacity: int = 2000) -> None:
        if capacity < 1:
            raise ValueError(f"flight recorder capacity must be >= 1, got {capacity}")
        self.endpoint = endpoint
        self.incarnation = incarnation
        self.capacity = capacity
        self._ring: collections.deque[Record] = collections.deque(maxlen=capacity)
        self._ids = itertools.count(1)
        self._dumps = itertools.count(1)
        self._lock = threading.Lock()

    def record(
        self,
        *,
        op_id: int,
        channel: str,
        seq: int,
        role: str,
        initiator: str,
        peer: str,
        kind: OpKind,
        names: list[str],
        nbytes: int,
        plane: str,
        state: OpState,
    ) -> Record:
        now = time.time()
        with self._lock:
            rec = Record(
                record_id=next(self._ids),
                op_id=op_id,
                channel=channel,
                seq=seq,
                role=role,
                initiator=initiator,
                peer=peer,
                kind=kind._value_,  # (_value_: the enum's .value property costs more than the record)
                names=names,
                nbytes=nbytes,
                plane=plane,
                state=state._value_,
                t_posted=now,
                t_updated=now,
                history=[(state._value_, now)],
            )
            self._ring.append(rec)
        return rec

    def record_done(self, op_id: int, channel: str, seq: int, role: str, initiator: str, peer: str, kind: OpKind,
                    names: list[str], nbytes: int, plane: str, t_posted: float,
                    error: BaseException | None = None) -> Record:
        """Record an op that began at ``t_posted`` (``time.time()``) and is over now: done, or failed
        with ``error``; the other arguments as for :meth:`record`. For an op done synchronously (a
        one-sided shm put or get on the event loop), which no dump can catch halfway."""
        now = time.time()
        state = "done" if error is None else "failed"
        with self._lock:  # (made whole here, once, from positional arguments: every one-sided op comes here)
            rec = Record(next(self._ids), op_id, channel, seq, role, initiator, peer, kind._value_, names, nbytes,
                         plane, state, t_posted, now, [("posted", t_posted), (state, now)],
                         None if error is None else f"{type(error).__name__}: {error}")
            self._ring.append(rec)
        return rec

    def update(self, rec: Record, state: OpState, error: BaseException | str | None = None) -> None:
        now = time.time()
        with self._lock:
            if rec.state in _STICKY:  # final for the caller; a late event is kept in the history
                if state._value_ != rec.state:
                    rec.history.append((f"late:{state._value_}", now))
                return
            rec.state = state._value_
            rec.t_updated = now
            rec.history.append((state._value_, now))
            if error is not None:
                rec.error = error if isinstance(error, str) else f"{type(error).__name__}: {error}"

    def mark(self, rec: Record, event: str) -> None:
        """Note ``event`` in ``rec``'s history, its state unchanged (e.g. ``awaiting_credit``: an
        op that carries a notification waits for a credit of its peer: :mod:`transport.credits`)."""
        with self._lock:
            rec.history.append((event, time.time()))

    def snapshot(self) -> list[dict]:
        with self._lock:
            return [asdict(r) for r in self._ring]

    def dump(self, path: str | os.PathLike[str] | None = None, *, reason: str = "request") -> Path:
        """Write the ring as JSON to ``path`` (default: a new file in :func:`default_dump_dir`)."""
        if path is None:
            d = default_dump_dir()
            d.mkdir(parents=True, exist_ok=True)
            stamp = time.strftime("%Y%m%d-%H%M%S")
            path = d / f"fr-{self.endpoint}-{os.getpid()}-{stamp}-{next(self._dumps)}.json"
        path = Path(path)
        doc = {
            "format": "transport-flight-recorder/1",
            "endpoint": self.endpoint,
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "reason": reason,
            "dumped_at": time.time(),
            "capacity": self.capacity,
            "records": self.snapshot(),
        }
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, path)
        log.warning("flight recorder of %r dumped to %s (%s)", self.endpoint, path, reason)
        return path
