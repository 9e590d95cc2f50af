"""Why an op did not complete, in words (for :mod:`transport.fr_analyze`).

:func:`_explain` takes an op of a paired channel direction
(:class:`~transport.fr_pairing._Stream`) that did not complete and returns a
machine-readable verdict and an explanation of what each side saw: from the
records of both sides, or from one side's record and what the other side's
dump covers (taken before the op, ring overwritten, its reader stuck on an
earlier op).
"""

from __future__ import annotations

from .flight_recorder import Record
from .fr_dump import Dump
from .fr_pairing import _pick_dump, _Side, _Stream
from .fr_report import _clock

# internal to the fr_* modules: what transport.fr_analyze uses
__all__ = ["_explain"]


def _when(rec: Record, state: str) -> float | None:
    """When ``rec`` entered ``state`` (first time), from its history."""
    for s, t in rec.history:
        if s == state:
            return t
    return rec.t_updated if rec.state == state else None


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
    t_credit = _when(rec, "awaiting_credit")
    if (t_credit is not None and t_sent is None and _when(rec, "credited") is None
            and rec.state in ("posted", "timed_out", "cancelled", "failed")):
        text = (f"{name} never sent it: from {_clock(t_credit)} it waited for a notification credit of {target}, "
                f"which held as many of {name}'s notifications as it allows (its max_pending_notifications), not "
                f"taken by its application")
        return text + ("" if rec.state == "posted" else f"; {name} gave up at {_clock(rec.t_updated)} ({rec.state})")
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
                    f"acknowledged it: its reader stalled (a frozen process, or its event loop never ran the answer)")
        elif trec.kind in ("notify", "post"):
            text = (f"{tgt} received the notification at {when} but never queued it: its reader stalled (a frozen "
                    f"process)")
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
