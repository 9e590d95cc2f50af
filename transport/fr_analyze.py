"""Analyse flight-recorder dumps: ``python -m transport fr DUMP...``.

Every endpoint keeps a ring of its most recent ops (:mod:`transport.flight_recorder`)
and dumps it as JSON on a timeout, a lost peer, a signal or on request. Both
sides of a channel record each op under the same key ``(channel, initiator,
seq)``: the initiator when it posts the op, the target when the op's header
arrives. This module pairs the two views and, for each direction of each
channel, names the first op that did not complete, the peer it was waiting
for, and what that peer saw:

* no target record at all: the header never reached the target, or the
  target's dump does not cover the op (dumped before it, or its ring had
  already overwritten it);
* target ``received`` but not ``done``: the header arrived but the op never
  finished there (for a ``tcp`` put: the bytes never landed; the initiator's
  state tells whether it stalled mid-send or the target stalled);
* target ``done`` but initiator not: the target acknowledged and the ack was
  lost, or the initiator stopped processing its channel;
* target ``rejected``: the target refused the op.

Later ops of the same channel direction that did not complete either are
listed as *blocked behind it*. With only one side's dump the analysis says so
and reasons from the records it has.

Exit codes of :func:`main`: 0 when every op in the dumps completed, 1 when an
op did not complete (a stall, a timeout, a failure), 2 for bad input files.

Times are printed in UTC. Comparing times taken on different hosts assumes
their clocks agree; the report notes when dumps come from several hosts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .flight_recorder import OpState, Record

__all__ = [
    "FORMAT",
    "ChannelSummary",
    "Dump",
    "DumpSummary",
    "Finding",
    "OpInfo",
    "Report",
    "analyze",
    "format_report",
    "load_dump",
    "main",
]

FORMAT = "transport-flight-recorder/1"

_ROLES = ("initiator", "target")
_STATES = frozenset(s.value for s in OpState)
# Initiator states that mean the op completed, for this analysis.
_INITIATOR_OK = frozenset({"done", "rejected", "cancelled"})
# Target states that mean the target finished handling the op.
_TARGET_FINISHED = frozenset({"done", "rejected"})

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


# --------------------------------------------------------------------------- report model


@dataclass
class DumpSummary:
    path: str
    endpoint: str
    incarnation: int | None
    host: str | None
    pid: int | None
    reason: str | None
    dumped_at: float
    capacity: int
    records: int
    first_record_id: int | None
    last_record_id: int | None
    oldest: float | None
    overwritten: bool


@dataclass
class OpInfo:
    """One op as both sides saw it (None where a side has no record)."""

    op_id: int
    channel: str
    seq: int
    initiator: str
    target: str
    kind: str
    names: list[str]
    nbytes: int
    plane: str
    initiator_state: str | None
    target_state: str | None
    t_posted: float
    initiator_error: str | None = None
    target_error: str | None = None

    def describe(self) -> str:
        """``put #17 (seq 4) trainer -> gen-0 ['w'] 4.0 MiB over tcp``."""
        s = f"{self.kind} #{self.op_id} (seq {self.seq}) {self.initiator} -> {self.target}"
        if self.names:
            shown = self.names[:4]
            s += " " + repr(shown) if len(self.names) <= 4 else f" {shown!r}[+{len(self.names) - 4} more]"
        if self.kind in ("put", "get", "notify"):
            s += f" {_size(self.nbytes)}"
        if self.kind in ("put", "get"):
            s += f" over {self.plane}"
        return s


@dataclass
class Finding:
    """An op that did not complete, with what the other side saw.

    ``blocking`` is true for the first op of a channel direction after which
    nothing completed (the stall); later ops that did not complete are in
    ``blocked_behind``. A non-blocking finding is an op that did not complete
    although later ops on the same channel direction did.
    """

    label: str  # STALLED, FAILED, TIMED OUT, INCOMPLETE
    verdict: str  # machine-readable, see _explain
    blocking: bool
    op: OpInfo
    explanation: str
    message: str
    blocked_behind: list[OpInfo] = field(default_factory=list)


@dataclass
class ChannelSummary:
    """One direction of one channel: the ops ``initiator`` started towards ``target``."""

    channel: str
    initiator: str
    target: str
    ops: int
    completed: int
    not_completed: int
    first_seq: int
    last_seq: int
    initiator_dump: str | None
    target_dump: str | None


@dataclass
class Report:
    stalled: bool
    dumps: list[DumpSummary]
    channels: list[ChannelSummary]
    findings: list[Finding]
    notes: list[str]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- formatting helpers


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    v = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        v /= 1024
        if v < 1024 or unit == "TiB":
            return f"{v:.1f} {unit}"
    raise AssertionError("unreachable")


def _clock(t: float | None) -> str:
    if t is None:
        return "?"
    return datetime.fromtimestamp(t, tz=UTC).strftime("%H:%M:%S.%f")[:-3]


def _stamp(t: float | None) -> str:
    if t is None:
        return "?"
    return datetime.fromtimestamp(t, tz=UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


def _when(rec: Record, state: str) -> float | None:
    """When ``rec`` entered ``state`` (first time), from its history."""
    for s, t in rec.history:
        if s == state:
            return t
    return rec.t_updated if rec.state == state else None


# --------------------------------------------------------------------------- analysis


@dataclass
class _Side:
    rec: Record
    dump: Dump


@dataclass
class _Stream:
    channel: str
    initiator: str
    target: str
    init: dict[int, _Side] = field(default_factory=dict)
    targ: dict[int, _Side] = field(default_factory=dict)


def _dedupe(dumps: Iterable[Dump], notes: list[str]) -> list[Dump]:
    """Keep the latest dump per (endpoint, incarnation)."""
    best: dict[tuple[str, int | None], Dump] = {}
    for d in dumps:
        key = (d.endpoint, d.incarnation)
        old = best.get(key)
        if old is None:
            best[key] = d
            continue
        keep, drop = (d, old) if d.dumped_at >= old.dumped_at else (old, d)
        best[key] = keep
        notes.append(f"{drop.path} and {keep.path} are both dumps of {d.endpoint!r} (same incarnation); "
                     f"using the later one, {keep.path}")
    return sorted(best.values(), key=lambda d: (d.endpoint, d.dumped_at))


def _pick_dump(cands: list[Dump], channel: str, t: float) -> Dump | None:
    """The dump of an endpoint most likely to cover ``channel`` around time ``t``."""
    if not cands:
        return None
    with_channel = [d for d in cands if any(r.channel == channel for r in d.records)]
    if with_channel:
        return max(with_channel, key=lambda d: d.dumped_at)
    covering = [d for d in cands if (d.oldest is None or d.oldest <= t) and t <= d.dumped_at]
    if covering:
        return max(covering, key=lambda d: d.dumped_at)
    return max(cands, key=lambda d: d.dumped_at)


def _stream_dump(st: _Stream, endpoint: str, dumps_of: dict[str, list[Dump]]) -> str | None:
    """Path of the dump that shows ``endpoint``'s side of ``st`` (None: no dump of it)."""
    side = st.init if endpoint == st.initiator else st.targ
    if side:
        return next(iter(side.values())).dump.path
    other = st.targ if side is st.init else st.init
    t = min(x.rec.t_posted for x in other.values())
    d = _pick_dump(dumps_of.get(endpoint, []), st.channel, t)
    return d.path if d is not None else None


def _op_info(st: _Stream, seq: int) -> OpInfo:
    i = st.init.get(seq)
    t = st.targ.get(seq)
    base = (i or t).rec  # type: ignore[union-attr]
    return OpInfo(
        op_id=base.op_id,
        channel=st.channel,
        seq=seq,
        initiator=st.initiator,
        target=st.target,
        kind=base.kind,
        names=list(base.names),
        nbytes=base.nbytes,
        plane=i.rec.plane if i is not None else base.plane,
        initiator_state=i.rec.state if i is not None else None,
        target_state=t.rec.state if t is not None else None,
        t_posted=i.rec.t_posted if i is not None else base.t_posted,
        initiator_error=i.rec.error if i is not None else None,
        target_error=t.rec.error if t is not None else None,
    )


# planes whose bytes follow the header in the channel's stream (a staged op is a tcp op on the wire)
_INLINE = ("tcp", "staged")


def _no_target_record_expected(rec: Record) -> bool:
    """Sync ops and shm gets never leave a record on the target."""
    return rec.kind == "sync" or (rec.kind == "get" and rec.plane == "shm")


def _stuck_reader(dump: Dump | None, channel: str, from_peer: str) -> Record | None:
    """A target-role record of ``dump`` on ``channel`` from ``from_peer`` left in ``received``:
    the endpoint's reader thread for that channel is stuck on it."""
    if dump is None:
        return None
    stuck = [r for r in dump.records
             if r.role == "target" and r.channel == channel and r.initiator == from_peer and r.state == "received"]
    return min(stuck, key=lambda r: r.seq) if stuck else None


def _short(rec: Record) -> str:
    s = f"{rec.kind} #{rec.op_id} (seq {rec.seq})"
    if rec.names:
        s += f" {rec.names[:4]!r}"
    return s


def _initiator_story(i: _Side, target: str) -> str:
    """What the initiator's own record says."""
    rec, name = i.rec, i.rec.initiator
    t_sent = _when(rec, "sent")
    if rec.state == "posted":
        if rec.kind == "put" and rec.plane == "shm":
            how = f"the copy into {target}'s shared memory or the header send never finished"
        elif rec.kind == "get" and rec.plane == "shm":
            how = f"the copy out of {target}'s shared memory never finished"
        elif rec.kind == "put" and rec.plane in _INLINE:
            how = "its send of the header and bytes never completed"
        else:
            how = "it stayed queued behind earlier sends in its writer"
        age = i.dump.dumped_at - rec.t_posted
        return f"{name} never got it onto the wire ({how}): posted at {_clock(rec.t_posted)}, {age:.2f} s before {name}'s dump"
    if rec.state == "sent":
        age = i.dump.dumped_at - (t_sent or rec.t_updated)
        return f"{name} finished sending it at {_clock(t_sent)} and had no reply {age:.2f} s later, when it dumped"
    if rec.state == "timed_out":
        t_to = _when(rec, "timed_out")
        if t_sent is not None:
            return f"{name} finished sending it at {_clock(t_sent)} and gave up at {_clock(t_to)} (timed out) with no reply"
        return f"{name} never finished sending it and gave up at {_clock(t_to)} (timed out)"
    if rec.state == "failed":
        return f"{name} failed it at {_clock(_when(rec, 'failed'))}: {rec.error or 'no error recorded'}"
    if rec.state == "cancelled":
        return f"{name}'s caller cancelled it at {_clock(_when(rec, 'cancelled'))} (bytes already handed over still go out)"
    return f"{name} recorded it as {rec.state}"


def _coverage(d: Dump) -> str:
    s = f"its dump covers {_clock(d.oldest)} to {_clock(d.dumped_at)}"
    if not d.overwritten:
        s += " and its ring never overwrote a record"
    return s


def _explain(st: _Stream, seq: int, dumps_of: dict[str, list[Dump]]) -> tuple[str, str]:
    """``(verdict, explanation)`` for an op that did not complete."""
    i = st.init.get(seq)
    t = st.targ.get(seq)
    ini, tgt = st.initiator, st.target
    if t is None:
        assert i is not None
        rec = i.rec
        story = _initiator_story(i, tgt)
        if _no_target_record_expected(rec):
            what = "sync ops" if rec.kind == "sync" else "shm gets (they read the peer's memory directly)"
            return "no_target_record_expected", f"{what} leave no record on the target; {story}"
        tdump = _pick_dump(dumps_of.get(tgt, []), st.channel, rec.t_posted)
        if tdump is None:
            return ("target_dump_missing",
                    f"no dump of {tgt} was given, so what {tgt} saw is unknown; {story}")
        if tdump.dumped_at < rec.t_posted:
            return ("target_dump_predates_op",
                    f"{tgt}'s dump was taken at {_clock(tdump.dumped_at)}, before the op was posted at "
                    f"{_clock(rec.t_posted)}, so it cannot show it; {story}")
        later_seen = any(s > seq for s in st.targ) and rec.plane != "shm"
        if tdump.overwritten and ((tdump.oldest is not None and rec.t_posted < tdump.oldest) or later_seen):
            return ("target_record_overwritten",
                    f"{tgt}'s dump does not cover it: its ring (capacity {tdump.capacity}) was full and its oldest "
                    f"record (#{tdump.first_record_id}) is from {_clock(tdump.oldest)}, after the op was posted at "
                    f"{_clock(rec.t_posted)}; {story}")
        text = f"the header never reached {tgt} ({_coverage(tdump)}); {story}"
        stuck = _stuck_reader(tdump, st.channel, ini)
        if stuck is not None and stuck.seq != seq:
            text += (f"; {tgt}'s reader is stuck on {_short(stuck)} from {ini}, received at {_clock(stuck.t_posted)} "
                     f"and never finished")
        elif rec.state in ("sent", "timed_out") and _when(rec, "sent") is not None:
            text += f", so it is in flight, {tgt}'s reader stopped, or the connection died silently"
        return "target_never_received", text

    trec = t.rec
    if trec.state == "received":
        when = f"{_clock(trec.t_posted)} ({t.dump.dumped_at - trec.t_posted:.2f} s before {tgt}'s dump)"
        if trec.kind == "put" and trec.plane in _INLINE:
            text = f"{tgt} received the header at {when} but the bytes never landed"
            if i is not None:
                r = i.rec
                t_sent = _when(r, "sent")
                if r.state == "failed":
                    text += f"; {_initiator_story(i, tgt)}"
                elif t_sent is not None:
                    text += (f"; {ini} had handed all the bytes to its socket at {_clock(t_sent)}, so {tgt}'s reader "
                             f"stalled receiving them (or the connection died)")
                else:
                    text += (f"; {ini} never finished sending them (its send stalled: a slow link, or {tgt} stopped "
                             f"reading)")
                if r.state in ("timed_out", "cancelled"):
                    text += f"; {ini} gave up at {_clock(r.t_updated)} ({r.state})"
        elif trec.kind == "put":
            text = (f"{tgt} received the header at {when} (the bytes were already copied into its memory) but never "
                    f"acknowledged it: its reader is blocked, most likely waiting for room in its notification queue "
                    f"(the application is not consuming notifications)")
        elif trec.kind == "notify":
            text = (f"{tgt} received the notification at {when} but never queued it: its notification queue is full "
                    f"(the application is not consuming notifications) or its reader stalled")
        elif trec.kind == "get":
            text = f"{tgt} received the request at {when} but never sent the reply"
        else:
            text = f"{tgt} received it at {when} but never finished it"
        if i is None:
            text += "; " + _initiator_missing(st, seq, dumps_of)
        elif trec.kind != "put" or trec.plane not in _INLINE:
            text += f"; {_initiator_story(i, tgt)}"
        return "target_received_not_done", text

    if trec.state == "done":
        assert i is not None
        r = i.rec
        t_done = trec.t_updated
        if r.state == "timed_out" and t_done > r.t_updated:
            return ("target_done_late",
                    f"{tgt} completed it at {_clock(t_done)}, {t_done - r.t_updated:.2f} s after {ini} had given up at "
                    f"{_clock(r.t_updated)}: the op outlasted its deadline")
        if r.state == "failed":
            return ("target_done_initiator_failed",
                    f"{tgt} completed it at {_clock(t_done)}, but {_initiator_story(i, tgt)}")
        if trec.kind == "get":
            text = (f"{tgt} queued the reply at {_clock(t_done)} but {ini} never finished receiving it: the reply bytes "
                    f"are still in flight, {tgt}'s writer stalled, or {ini}'s reader stopped")
        else:
            text = (f"{tgt} completed it at {_clock(t_done)} and acknowledged it, but {ini} never processed the ack: the "
                    f"ack was lost or {ini} stopped processing the channel")
        stuck = _stuck_reader(i.dump, st.channel, tgt)
        if stuck is not None:
            text += (f"; {ini}'s reader is stuck on {_short(stuck)} from {tgt}, received at {_clock(stuck.t_posted)}, "
                     f"so it cannot read the ack")
        return "target_done_initiator_not", text + f"; {_initiator_story(i, tgt)}"

    if trec.state == "rejected":
        text = f"{tgt} rejected it at {_clock(trec.t_updated)}: {trec.error or 'no error recorded'}"
        if i is not None and i.rec.state != "failed":
            text += f"; {ini} never processed the rejection: {_initiator_story(i, tgt)}"
        return "target_rejected", text

    text = f"{tgt} recorded it as {trec.state} at {_clock(trec.t_updated)}"
    if trec.error:
        text += f": {trec.error}"
    if i is None:
        text += "; " + _initiator_missing(st, seq, dumps_of)
    else:
        text += f"; {_initiator_story(i, tgt)}"
    return f"target_{trec.state}", text


def _initiator_missing(st: _Stream, seq: int, dumps_of: dict[str, list[Dump]]) -> str:
    t = st.targ[seq].rec
    idump = _pick_dump(dumps_of.get(st.initiator, []), st.channel, t.t_posted)
    if idump is None:
        return f"no dump of {st.initiator} was given, so its side is unknown"
    if idump.dumped_at < t.t_posted:
        return (f"{st.initiator}'s dump was taken at {_clock(idump.dumped_at)}, before {st.target} received the op, "
                f"so it cannot show it")
    if idump.overwritten and idump.oldest is not None and t.t_posted <= idump.oldest:
        return (f"{st.initiator}'s dump does not cover it (its ring of {idump.capacity} records starts at "
                f"{_clock(idump.oldest)})")
    return f"{st.initiator}'s dump has no record of it"


def _is_problem(st: _Stream, seq: int) -> bool:
    i = st.init.get(seq)
    t = st.targ.get(seq)
    if i is not None:
        if i.rec.state in _INITIATOR_OK:
            # a cancelled op whose bytes never landed still holds up the target
            return i.rec.state == "cancelled" and t is not None and t.rec.state == "received"
        return True
    assert t is not None
    return t.rec.state not in _TARGET_FINISHED


def _progressed(st: _Stream, seq: int) -> bool:
    """Whether ``seq`` proves the channel direction moved past it (a full round trip
    when the initiator's records are known, else the target finishing it)."""
    i = st.init.get(seq)
    t = st.targ.get(seq)
    if st.init:
        if i is None:
            return False
        return i.rec.state == "done" or (i.rec.state == "failed" and t is not None and t.rec.state == "rejected")
    return t is not None and t.rec.state in _TARGET_FINISHED


def _age(st: _Stream, seq: int) -> float:
    i = st.init.get(seq)
    if i is not None:
        return i.dump.dumped_at - i.rec.t_posted
    t = st.targ[seq]
    return t.dump.dumped_at - t.rec.t_posted


def _label(op: OpInfo, blocking: bool) -> str:
    if op.initiator_state == "failed":
        return "FAILED"
    if blocking:
        return "STALLED"
    if op.initiator_state == "timed_out":
        return "TIMED OUT"
    return "INCOMPLETE"


def analyze(dumps: Sequence[Dump], *, min_age: float = 0.0) -> Report:
    """Pair the records of ``dumps`` and find the ops that did not complete.

    ``min_age``: ignore ops still in flight (posted/sent/received) that were
    younger than this many seconds when their dump was taken.
    """
    notes: list[str] = []
    kept = _dedupe(dumps, notes)
    dumps_of: dict[str, list[Dump]] = {}
    for d in kept:
        dumps_of.setdefault(d.endpoint, []).append(d)
    hosts = sorted({d.host for d in kept if d.host})
    if len(hosts) > 1:
        notes.append(f"dumps come from several hosts ({', '.join(hosts)}); comparing their times assumes "
                     f"synchronised clocks")

    streams: dict[tuple[str, str], _Stream] = {}
    for d in kept:
        for r in d.records:
            if r.role == "initiator":
                if r.initiator != d.endpoint:
                    notes.append(f"{d.path}: record #{r.record_id} is an initiator record of {r.initiator!r}, "
                                 f"not of the dump's endpoint {d.endpoint!r}")
                target = r.peer
            else:
                target = d.endpoint
            st = streams.get((r.channel, r.initiator))
            if st is None:
                st = streams[(r.channel, r.initiator)] = _Stream(r.channel, r.initiator, target)
            side = st.init if r.role == "initiator" else st.targ
            old = side.get(r.seq)
            if old is not None:
                notes.append(f"{r.role} records #{old.rec.record_id} ({old.dump.path}) and #{r.record_id} "
                             f"({d.path}) share channel {r.channel!r}, initiator {r.initiator!r}, seq {r.seq}; "
                             f"keeping the newer one")
                if (old.dump.dumped_at, old.rec.record_id) > (d.dumped_at, r.record_id):
                    continue
            side[r.seq] = _Side(r, d)

    named = {st.target for st in streams.values()} | {st.initiator for st in streams.values()}
    for peer in sorted(named - set(dumps_of)):
        by = sorted({d.endpoint for d in kept
                     for st in streams.values() if d.endpoint in (st.initiator, st.target)
                     and peer in (st.initiator, st.target)})
        notes.append(f"no dump of {peer!r} was given (it appears in the dump(s) of {', '.join(by)}); "
                     f"its side of the ops is reasoned from the other side only")

    findings: list[Finding] = []
    channels: list[ChannelSummary] = []
    for key in sorted(streams, key=lambda k: (k[1], streams[k].target, k[0])):
        st = streams[key]
        seqs = sorted(set(st.init) | set(st.targ))
        problems = []
        for s in seqs:
            if not _is_problem(st, s):
                continue
            i = st.init.get(s)
            settled = i is not None and i.rec.state in ("timed_out", "failed")
            if min_age > 0 and not settled and _age(st, s) < min_age:
                continue
            problems.append(s)
        progress = max((s for s in seqs if _progressed(st, s)), default=0)
        channels.append(ChannelSummary(
            channel=st.channel,
            initiator=st.initiator,
            target=st.target,
            ops=len(seqs),
            completed=len(seqs) - len(problems),
            not_completed=len(problems),
            first_seq=seqs[0],
            last_seq=seqs[-1],
            initiator_dump=_stream_dump(st, st.initiator, dumps_of),
            target_dump=_stream_dump(st, st.target, dumps_of),
        ))
        trailing = [s for s in problems if s > progress]
        for s in problems:
            if s in trailing and s != trailing[0]:
                continue
            blocking = bool(trailing) and s == trailing[0]
            op = _op_info(st, s)
            verdict, text = _explain(st, s, dumps_of)
            if not blocking:
                text += "; later ops on this channel completed, so it did not block it"
            label = _label(op, blocking)
            findings.append(Finding(
                label=label,
                verdict=verdict,
                blocking=blocking,
                op=op,
                explanation=text,
                message=f"{label}: {op.describe()}: {text}",
                blocked_behind=[_op_info(st, b) for b in trailing[1:]] if blocking else [],
            ))
    return Report(
        stalled=bool(findings),
        dumps=[_summary(d) for d in kept],
        channels=channels,
        findings=findings,
        notes=notes,
    )


def _summary(d: Dump) -> DumpSummary:
    return DumpSummary(
        path=d.path,
        endpoint=d.endpoint,
        incarnation=d.incarnation,
        host=d.host,
        pid=d.pid,
        reason=d.reason,
        dumped_at=d.dumped_at,
        capacity=d.capacity,
        records=len(d.records),
        first_record_id=d.first_record_id,
        last_record_id=d.last_record_id,
        oldest=d.oldest,
        overwritten=d.overwritten,
    )


# --------------------------------------------------------------------------- text report


def format_report(report: Report) -> str:
    """The human-readable form of ``report``."""
    out: list[str] = ["flight recorder dumps (times in UTC):"]
    for d in report.dumps:
        inc = f"incarnation {d.incarnation:#x}" if d.incarnation is not None else "incarnation ?"
        where = f"pid {d.pid if d.pid is not None else '?'} on {d.host or '?'}"
        span = (f"records #{d.first_record_id}-#{d.last_record_id} from {_clock(d.oldest)}"
                if d.records else "no records")
        wrap = "; older records were overwritten" if d.overwritten else ""
        out.append(f"  {d.endpoint} ({inc}, {where}): dumped {_stamp(d.dumped_at)} ({d.reason or 'no reason'}), "
                   f"{d.records} of capacity {d.capacity}, {span}{wrap}  [{d.path}]")
    out.append("channels:")
    if not report.channels:
        out.append("  (no ops recorded)")
    for c in report.channels:
        out.append(f"  {c.initiator} -> {c.target} on {c.channel}: {c.ops} op(s), seq {c.first_seq}-{c.last_seq}, "
                   f"{c.completed} completed, {c.not_completed} did not")
    if report.notes:
        out.append("notes:")
        out.extend(f"  - {n}" for n in report.notes)
    out.append("")
    dumped = {(c.channel, c.initiator): (c.initiator_dump is not None, c.target_dump is not None)
              for c in report.channels}
    for f in report.findings:
        out.append(f.message)
        if f.blocked_behind:
            has_i, has_t = dumped.get((f.op.channel, f.op.initiator), (True, True))
            out.append(f"  blocked behind it ({len(f.blocked_behind)}):")
            for b in f.blocked_behind:
                out.append(f"    {b.describe()}: {b.initiator} {_side_state(b.initiator_state, has_i)}, "
                           f"{b.target} {_side_state(b.target_state, has_t)}")
    stalls = sum(1 for f in report.findings if f.blocking)
    others = len(report.findings) - stalls
    if report.stalled:
        out.append(f"result: {stalls} stalled channel direction(s), {others} other op(s) that did not complete")
    else:
        out.append("result: OK, every op in the dumps completed")
    return "\n".join(out)


def _side_state(state: str | None, has_dump: bool) -> str:
    if state is not None:
        return state
    return "has no record" if has_dump else "(no dump)"


# --------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m transport fr",
        description="Pair flight-recorder dumps of several endpoints and name the op (and peer) that stalled.",
        epilog="Exit status: 0 every op completed, 1 an op did not complete, 2 bad input.",
    )
    p.add_argument("dumps", nargs="+", metavar="DUMP", help="flight-recorder JSON dumps (one per endpoint)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--min-age", type=float, default=0.0, metavar="SECONDS",
                   help="ignore ops still in flight that were younger than this when dumped (default 0)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: analyse the dumps named in ``argv``; returns the exit status."""
    try:
        args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:  # --help or a usage error
        return exc.code if isinstance(exc.code, int) else 2
    if args.min_age < 0:
        print("error: --min-age must be >= 0", file=sys.stderr)
        return 2
    dumps: list[Dump] = []
    bad = False
    for path in args.dumps:
        try:
            dumps.append(load_dump(path))
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            bad = True
    if bad:
        return 2
    report = analyze(dumps, min_age=args.min_age)
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        print(format_report(report))
    return 1 if report.stalled else 0


if __name__ == "__main__":
    sys.exit(main())
