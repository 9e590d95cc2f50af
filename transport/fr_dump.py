"""Reading flight-recorder dumps for ``python -m transport fr`` (:mod:`transport.fr_analyze`).

:func:`load_dump` reads one JSON file written by ``FlightRecorder.dump``
(format ``transport-flight-recorder/1``), checks every field and returns a
:class:`Dump` holding its records in record-id order; a file that is not such
a dump raises ValueError naming the file and what is wrong.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .flight_recorder import OpState, Record

__all__ = ["FORMAT", "Dump", "load_dump"]

FORMAT = "transport-flight-recorder/1"

_ROLES = ("initiator", "target")
_STATES = frozenset(s.value for s in OpState)

_INT_FIELDS = ("record_id", "op_id", "seq", "nbytes")
_STR_FIELDS = ("channel", "role", "initiator", "peer", "kind", "plane", "state")
_FLOAT_FIELDS = ("t_posted", "t_updated")
_RECORD_FIELDS = {f.name: f for f in dataclasses.fields(Record)}


# --------------------------------------------------------------------------- loading


@dataclass
class Dump:
    """One flight-recorder dump file, validated."""

    path: str
    endpoint: str
    incarnation: int | None
    pid: int | None
    host: str | None
    reason: str | None
    dumped_at: float
    capacity: int
    records: list[Record]

    @property
    def first_record_id(self) -> int | None:
        return self.records[0].record_id if self.records else None

    @property
    def last_record_id(self) -> int | None:
        return self.records[-1].record_id if self.records else None

    @property
    def oldest(self) -> float | None:
        """When the oldest record still in the ring was created."""
        return min((r.t_posted for r in self.records), default=None)

    @property
    def overwritten(self) -> bool:
        """Whether the ring was full and had dropped older records (record ids start at 1)."""
        return len(self.records) >= self.capacity and (self.first_record_id or 0) > 1


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _record_from_json(path: str, i: int, raw: object) -> Record:
    where = f"{path}: record {i}"
    if not isinstance(raw, dict):
        raise ValueError(f"{where} is a {type(raw).__name__}, not an object")
    missing = [
        name
        for name, f in _RECORD_FIELDS.items()
        if name not in raw and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ValueError(f"{where} lacks field(s) {', '.join(missing)}")
    for name in _INT_FIELDS:
        if not _is_int(raw[name]):
            raise ValueError(f"{where}: {name} must be an integer, got {raw[name]!r}")
    for name in _STR_FIELDS:
        if not isinstance(raw[name], str):
            raise ValueError(f"{where}: {name} must be a string, got {raw[name]!r}")
    for name in _FLOAT_FIELDS:
        if not _is_num(raw[name]):
            raise ValueError(f"{where}: {name} must be a number, got {raw[name]!r}")
    if raw["role"] not in _ROLES:
        raise ValueError(f"{where}: role must be one of {_ROLES}, got {raw['role']!r}")
    if raw["state"] not in _STATES:
        raise ValueError(f"{where}: state {raw['state']!r} is not one of {sorted(_STATES)}")
    names = raw["names"]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{where}: names must be a list of strings, got {names!r}")
    history_raw = raw.get("history", [])
    history: list[tuple[str, float]] = []
    if not isinstance(history_raw, list):
        raise ValueError(f"{where}: history must be a list, got {history_raw!r}")
    for h in history_raw:
        if not (isinstance(h, list) and len(h) == 2 and isinstance(h[0], str) and _is_num(h[1])):
            raise ValueError(f"{where}: history entries are [state, time] pairs, got {h!r}")
        history.append((h[0], float(h[1])))
    error = raw.get("error")
    if error is not None and not isinstance(error, str):
        raise ValueError(f"{where}: error must be a string or null, got {error!r}")
    kwargs: dict[str, Any] = {k: v for k, v in raw.items() if k in _RECORD_FIELDS}
    kwargs.update(names=list(names), history=history, error=error,
                  t_posted=float(raw["t_posted"]), t_updated=float(raw["t_updated"]))
    return Record(**kwargs)


def load_dump(path: str | Path) -> Dump:
    """Read and validate one dump written by ``FlightRecorder.dump``.

    Raises ValueError, naming the file and what is wrong, for a file that
    cannot be read, is not JSON, is not a ``transport-flight-recorder/1`` dump
    or holds malformed records.
    """
    p = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{p}: cannot read the file: {exc}") from exc
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p}: not a JSON file ({exc})") from exc
    if not isinstance(doc, dict):
        raise ValueError(f"{p}: not a flight-recorder dump (top level is a {type(doc).__name__}, not an object)")
    fmt = doc.get("format")
    if fmt != FORMAT:
        raise ValueError(f"{p}: not a flight-recorder dump: format is {fmt!r}, expected {FORMAT!r}")
    endpoint = doc.get("endpoint")
    if not isinstance(endpoint, str) or not endpoint:
        raise ValueError(f"{p}: endpoint must be a non-empty string, got {endpoint!r}")
    capacity: Any = doc.get("capacity")
    if not _is_int(capacity) or capacity < 1:
        raise ValueError(f"{p}: capacity must be a positive integer, got {capacity!r}")
    dumped_at: Any = doc.get("dumped_at")
    if not _is_num(dumped_at):
        raise ValueError(f"{p}: dumped_at must be a number, got {dumped_at!r}")
    for key, ok in (("incarnation", _is_int), ("pid", _is_int), ("host", lambda v: isinstance(v, str)),
                    ("reason", lambda v: isinstance(v, str))):
        if doc.get(key) is not None and not ok(doc[key]):
            raise ValueError(f"{p}: {key} has the wrong type: {doc[key]!r}")
    raw_records = doc.get("records")
    if not isinstance(raw_records, list):
        raise ValueError(f"{p}: records must be a list, got {type(raw_records).__name__}")
    records = [_record_from_json(p, i, r) for i, r in enumerate(raw_records)]
    if len(records) > capacity:
        raise ValueError(f"{p}: holds {len(records)} records, more than its capacity {capacity}")
    ids = [r.record_id for r in records]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{p}: duplicate record ids")
    records.sort(key=lambda r: r.record_id)
    return Dump(
        path=p,
        endpoint=endpoint,
        incarnation=doc.get("incarnation"),
        pid=doc.get("pid"),
        host=doc.get("host"),
        reason=doc.get("reason"),
        dumped_at=float(dumped_at),
        capacity=capacity,
        records=records,
    )
