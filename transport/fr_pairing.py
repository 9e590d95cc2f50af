"""Both sides of each channel direction, paired (for :mod:`transport.fr_analyze`).

A :class:`_Stream` is one direction of one channel: the ops one initiator
started towards one target, with each side's record of every op by ``seq``
and the dump it came from (a :class:`_Side`). The helpers here keep the
latest dump per endpoint incarnation, pick the dump that shows an endpoint's
side of a stream, turn a paired op into an :class:`~transport.fr_report.OpInfo`,
and say whether an op did not complete or proves that its channel direction
moved past it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .flight_recorder import Record
from .fr_dump import Dump
from .fr_report import OpInfo

# internal to the fr_* modules: what transport.fr_analyze and transport.fr_explain use
__all__ = ["_Side", "_Stream", "_age", "_dedupe", "_is_problem", "_op_info", "_pick_dump", "_progressed",
           "_stream_dump"]

# Initiator states that mean the op completed, for this analysis.
_INITIATOR_OK = frozenset({"done", "rejected", "cancelled"})
# Target states that mean the target finished handling the op.
_TARGET_FINISHED = frozenset({"done", "rejected"})


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


def _is_problem(st: _Stream, seq: int) -> bool:
    i = st.init.get(seq)
    t = st.targ.get(seq)
    if i is not None:
        if i.rec.kind == "post" and i.rec.state == "done":
            # done once sent, nothing answers it: it is stuck if the target holds it unfinished, or lost if
            # the target's records show ops of this direction on both sides of it but not it (with none
            # before it, its record may have left the target's ring: the ring drops its oldest first)
            if t is not None:
                return t.rec.state not in _TARGET_FINISHED
            return any(s < seq for s in st.targ) and any(s > seq for s in st.targ)
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
        if i.rec.kind == "post":  # (done once sent: only the target finishing it proves the direction moved)
            return t is not None and t.rec.state in _TARGET_FINISHED
        return i.rec.state == "done" or (i.rec.state == "failed" and t is not None and t.rec.state == "rejected")
    return t is not None and t.rec.state in _TARGET_FINISHED


def _age(st: _Stream, seq: int) -> float:
    i = st.init.get(seq)
    if i is not None:
        return i.dump.dumped_at - i.rec.t_posted
    t = st.targ[seq]
    return t.dump.dumped_at - t.rec.t_posted
