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
import json
import sys
from collections.abc import Sequence

from .fr_dump import FORMAT, Dump, load_dump
from .fr_explain import _explain
from .fr_pairing import _age, _dedupe, _is_problem, _op_info, _progressed, _Side, _Stream, _stream_dump
from .fr_report import ChannelSummary, DumpSummary, Finding, OpInfo, Report, format_report

# loading is in transport.fr_dump, the report and its text form in transport.fr_report, the pairing
# in transport.fr_pairing, the explanations in transport.fr_explain; their public names are here too
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


# --------------------------------------------------------------------------- analysis


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
