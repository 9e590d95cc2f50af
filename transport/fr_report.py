"""The report of ``python -m transport fr`` (:mod:`transport.fr_analyze`) and its text form.

:class:`Report` holds what :func:`~transport.fr_analyze.analyze` found: a
:class:`DumpSummary` per dump it used, a :class:`ChannelSummary` per channel
direction, a :class:`Finding` per op that did not complete (each with its
:class:`OpInfo`) and notes. :func:`format_report` prints it for people, times
in UTC; ``Report.to_json`` is the ``--json`` form.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

# _clock is also used by transport.fr_explain
__all__ = ["ChannelSummary", "DumpSummary", "Finding", "OpInfo", "Report", "_clock", "format_report"]


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
        if self.kind in ("put", "get", "notify", "post"):
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
