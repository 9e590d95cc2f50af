"""Tests of ``transport.fr_analyze`` (``python -m transport fr``).

Dumps are made by the real :class:`FlightRecorder` (record/update/dump), in
the order the channel code drives them, plus one pair made by two real
endpoints.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import torch

import transport
from transport.flight_recorder import FlightRecorder, OpKind, OpState, Record
from transport.fr_analyze import FORMAT, Report, analyze, format_report, load_dump, main

pytestmark = pytest.mark.timeout(60)

CH = "trainer#1->gen-0#2/abc123"
MiB = 1 << 20


class Pair:
    """Two flight recorders, driven the way ``Channel`` drives them."""

    def __init__(self, init: str = "trainer", target: str = "gen-0", *, channel: str = CH,
                 init_capacity: int = 2000, target_capacity: int = 2000) -> None:
        self.i = FlightRecorder(init, 1, init_capacity)
        self.t = FlightRecorder(target, 2, target_capacity)
        self.channel = channel
        self.seq = 0
        self.op_id = 100

    def op(
        self,
        *,
        names: list[str] | None = None,
        nbytes: int = 4 * MiB,
        kind: OpKind = OpKind.PUT,
        plane: str = "tcp",
        sent: bool = True,
        target: str | None = "done",
        init: str | None = "done",
        channel: str | None = None,
        error: str | None = None,
    ) -> tuple[Record, Record | None]:
        """One op: the initiator posts (and sends) it; the target records ``target``
        (None: no record); then the initiator ends in ``init`` (None: stays put)."""
        self.seq += 1
        self.op_id += 1
        ch = channel or self.channel
        names = ["layer0.weight"] if names is None else names
        ir = self.i.record(op_id=self.op_id, channel=ch, seq=self.seq, role="initiator", initiator=self.i.endpoint,
                           peer=self.t.endpoint, kind=kind, names=names, nbytes=nbytes, plane=plane,
                           state=OpState.POSTED)
        if sent:
            self.i.update(ir, OpState.SENT)
        tr = None
        if target is not None:
            tr = self.t.record(op_id=self.op_id, channel=ch, seq=self.seq, role="target", initiator=self.i.endpoint,
                               peer=self.i.endpoint, kind=kind, names=list(names), nbytes=nbytes, plane=plane,
                               state=OpState.RECEIVED)
            if target != "received":
                self.t.update(tr, OpState(target), error)
        if init is not None:
            self.i.update(ir, OpState(init), error if init == "failed" else None)
        return ir, tr

    def dump(self, tmp: Path) -> tuple[Path, Path]:
        return (self.i.dump(tmp / f"{self.i.endpoint}.json", reason="test"),
                self.t.dump(tmp / f"{self.t.endpoint}.json", reason="test"))


def run_main(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def report_of(*paths: Path) -> Report:
    return analyze([load_dump(p) for p in paths])


# --------------------------------------------------------------------------- all done


def test_all_done_is_clean(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = Pair()
    p.op()
    p.op(names=["a", "b"], nbytes=10)
    p.op(kind=OpKind.NOTIFY, names=[], nbytes=12)
    p.op(kind=OpKind.GET, nbytes=1024)
    p.op(kind=OpKind.SYNC, names=[], nbytes=0, target=None)  # syncs leave no target record
    p.op(kind=OpKind.GET, plane="shm", sent=False, target=None)  # nor do shm gets
    paths = p.dump(tmp_path)

    code, out, err = run_main(capsys, *paths)
    assert code == 0, out + err
    assert "result: OK" in out
    assert "trainer -> gen-0 on " + CH + ": 6 op(s), seq 1-6, 6 completed, 0 did not" in out

    code, out, _ = run_main(capsys, "--json", *paths)
    assert code == 0
    doc = json.loads(out)
    assert doc["stalled"] is False and doc["findings"] == []
    assert {d["endpoint"] for d in doc["dumps"]} == {"trainer", "gen-0"}
    assert doc["channels"][0]["ops"] == 6


def test_a_post_is_done_once_sent_so_the_target_says_whether_it_is_stuck_or_lost(tmp_path: Path) -> None:
    """A posted notification's initiator record is done when it is sent (nothing answers it), so
    only the target's records can show it stuck (received, never queued) or lost (later ops of the
    same direction arrived, it did not); one the target finished, or the last one sent with no
    later op to prove it lost, is no finding."""
    p = Pair()
    p.op(kind=OpKind.POST, names=[], nbytes=8)  # delivered
    p.op(kind=OpKind.POST, names=[], nbytes=8, target="received")  # stuck in the target's reader
    p.op(kind=OpKind.POST, names=[], nbytes=8, target=None)  # lost: seq 4 arrived, it did not
    p.op(kind=OpKind.POST, names=[], nbytes=8)
    p.op(kind=OpKind.POST, names=[], nbytes=8, target=None)  # still on its way, maybe: nothing proves it lost
    rep = report_of(*p.dump(tmp_path))
    by_seq = {f.op.seq: f for f in rep.findings}
    assert set(by_seq) == {2, 3}, [(f.op.seq, f.verdict, f.message) for f in rep.findings]
    assert by_seq[2].op.kind == "post" and by_seq[2].op.target_state == "received"
    assert "never queued it" in by_seq[2].message
    assert by_seq[3].op.target_state is None and "never reached gen-0" in by_seq[3].message
    assert "post #" in by_seq[2].op.describe() and "8 B" in by_seq[2].op.describe()


def test_posts_whose_target_records_left_its_ring_are_no_finding(tmp_path: Path) -> None:
    """Delivered posts whose target records were overwritten (the target's ring holds only its
    newest records) are not taken for lost; one missing between two the ring still holds is."""
    p = Pair(target_capacity=4)
    for _ in range(10):
        p.op(kind=OpKind.POST, names=[], nbytes=8)
    rep = report_of(*p.dump(tmp_path))
    assert not rep.stalled and rep.findings == [], [(f.op.seq, f.message) for f in rep.findings]
    p = Pair(target_capacity=4)
    for target in ("done",) * 7 + (None, "done", "done"):  # seq 8 never reached the target
        p.op(kind=OpKind.POST, names=[], nbytes=8, target=target)
    rep = report_of(*p.dump(tmp_path))
    assert [f.op.seq for f in rep.findings] == [8], [(f.op.seq, f.message) for f in rep.findings]


def test_cancelled_and_rejected_ops_are_not_stalls(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = Pair()
    p.op(init="cancelled")  # the caller stopped waiting; the target still got it
    p.op(target="rejected", init="failed", error="UnknownBufferError: no buffer 'x'")
    p.op()
    code, out, _ = run_main(capsys, *p.dump(tmp_path))
    # the rejected op did not complete: it is reported, but it blocked nothing
    assert code == 1
    rep = report_of(tmp_path / "trainer.json", tmp_path / "gen-0.json")
    [f] = rep.findings
    assert f.verdict == "target_rejected" and not f.blocking and f.op.seq == 2
    assert f.label == "FAILED"
    assert "gen-0 rejected it at" in f.message and "UnknownBufferError" in f.message


# --------------------------------------------------------------------------- stalls with both dumps


def test_header_never_reached_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = Pair()
    p.op()
    p.op()
    ir, _ = p.op(names=["layer3.weight"], target=None, init=None)  # sent, target never saw it
    p.op(names=["layer4.weight"], sent=False, target=None, init=None)  # queued behind it
    p.op(names=["layer5.weight"], sent=False, target=None, init="timed_out")
    paths = p.dump(tmp_path)

    code, out, _ = run_main(capsys, *paths)
    assert code == 1
    expected = f"STALLED: put #{ir.op_id} (seq 3) trainer -> gen-0 ['layer3.weight'] 4.0 MiB over tcp: " \
               f"the header never reached gen-0"
    assert expected in out, out
    assert "blocked behind it (2):" in out
    assert "(seq 4) trainer -> gen-0 ['layer4.weight']" in out
    assert "its ring never overwrote a record" in out

    rep = report_of(*paths)
    [f] = rep.findings
    assert f.blocking and f.verdict == "target_never_received"
    assert f.op.initiator_state == "sent" and f.op.target_state is None
    assert [b.seq for b in f.blocked_behind] == [4, 5]
    assert [b.initiator_state for b in f.blocked_behind] == ["posted", "timed_out"]


def test_target_received_but_bytes_never_landed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = Pair()
    p.op()
    ir, tr = p.op(target="received", init=None)  # initiator finished sending; target stuck receiving
    p.op(target=None, init=None)
    paths = p.dump(tmp_path)

    code, out, _ = run_main(capsys, *paths)
    assert code == 1
    line = next(x for x in out.splitlines() if x.startswith("STALLED"))
    assert line.startswith(f"STALLED: put #{ir.op_id} (seq 2) trainer -> gen-0 ['layer0.weight'] 4.0 MiB over tcp: "
                           f"gen-0 received the header at ")
    assert "but the bytes never landed" in line
    assert "trainer had handed all the bytes to its socket" in line
    assert "gen-0's reader stalled" in line

    rep = report_of(*paths)
    [f] = rep.findings
    assert f.verdict == "target_received_not_done" and f.op.target_state == "received"
    assert [b.seq for b in f.blocked_behind] == [3]

    code, out, _ = run_main(capsys, "--json", *paths)
    doc = json.loads(out)
    assert code == 1 and doc["stalled"] is True
    assert doc["findings"][0]["verdict"] == "target_received_not_done"
    assert doc["findings"][0]["blocked_behind"][0]["seq"] == 3


def test_initiator_stalled_mid_send(tmp_path: Path) -> None:
    p = Pair()
    p.op(sent=False, target="received", init=None)  # header arrived, the initiator's send never finished
    rep = report_of(*p.dump(tmp_path))
    [f] = rep.findings
    assert f.verdict == "target_received_not_done"
    assert "trainer never finished sending them" in f.message


def test_target_done_but_ack_lost(tmp_path: Path) -> None:
    p = Pair()
    p.op()
    p.op(init=None)  # target done, initiator still "sent"
    rep = report_of(*p.dump(tmp_path))
    [f] = rep.findings
    assert f.blocking and f.verdict == "target_done_initiator_not"
    assert "never processed the ack" in f.message


def test_ack_lost_because_initiator_reader_is_stuck(tmp_path: Path) -> None:
    """Both directions share one reader: gen-0 stuck receiving trainer's put... and
    vice versa: trainer is stuck receiving gen-0's put, so it never reads gen-0's ack."""
    fwd = Pair()
    back = Pair("gen-0", "trainer")
    back.i, back.t = fwd.t, fwd.i  # the same two recorders, other direction
    back.op(target="received", init=None)  # trainer's reader is stuck in gen-0's put
    fwd.op(init=None)  # gen-0 acked trainer's put; trainer never read it
    rep = report_of(*fwd.dump(tmp_path))
    by_init = {f.op.initiator: f for f in rep.findings}
    assert by_init["gen-0"].verdict == "target_received_not_done"
    assert by_init["trainer"].verdict == "target_done_initiator_not"
    assert "trainer's reader is stuck on put" in by_init["trainer"].message


def test_timed_out_op_completed_late(tmp_path: Path) -> None:
    p = Pair()
    ir, tr = p.op(target=None, init="timed_out")
    tr = p.t.record(op_id=ir.op_id, channel=CH, seq=ir.seq, role="target", initiator="trainer", peer="trainer",
                    kind=OpKind.PUT, names=list(ir.names), nbytes=ir.nbytes, plane="tcp", state=OpState.RECEIVED)
    time.sleep(0.002)
    p.t.update(tr, OpState.DONE)
    p.op()  # the channel works again
    rep = report_of(*p.dump(tmp_path))
    [f] = rep.findings
    assert f.verdict == "target_done_late" and f.label == "TIMED OUT" and not f.blocking
    assert "after trainer had given up" in f.message


def test_target_dump_predates_op(tmp_path: Path) -> None:
    p = Pair()
    p.op()
    tpath = p.t.dump(tmp_path / "gen-0.json")
    time.sleep(0.002)
    p.op(target=None, init=None)
    ipath = p.i.dump(tmp_path / "trainer.json")
    [f] = report_of(ipath, tpath).findings
    assert f.verdict == "target_dump_predates_op"
    assert "gen-0's dump was taken at" in f.message


def test_stuck_sync_needs_no_target_record(tmp_path: Path) -> None:
    p = Pair()
    p.op()
    p.op(kind=OpKind.SYNC, names=[], nbytes=0, target=None, init="timed_out")
    [f] = report_of(*p.dump(tmp_path)).findings
    assert f.verdict == "no_target_record_expected" and f.blocking
    assert f.message.startswith("STALLED: sync #")
    assert "sync ops leave no record on the target" in f.message and "timed out" in f.message


def test_min_age_skips_young_in_flight_ops(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = Pair()
    p.op()
    p.op(target="received", init=None)  # in flight at dump time, a few microseconds old
    paths = p.dump(tmp_path)
    assert run_main(capsys, *paths)[0] == 1
    code, out, _ = run_main(capsys, "--min-age", "60", *paths)
    assert code == 0, out
    q = Pair()
    q.op(target=None, init="timed_out")  # a timeout is final whatever its age
    assert run_main(capsys, "--min-age", "60", *q.dump(tmp_path))[0] == 1
    assert run_main(capsys, "--min-age", "-1", *paths)[0] == 2


def test_duplicate_dumps_of_one_endpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = Pair()
    p.op(init=None)
    early = p.i.dump(tmp_path / "trainer-early.json")
    time.sleep(0.002)
    p.op()
    late, tpath = p.dump(tmp_path)
    code, out, _ = run_main(capsys, early, late, tpath)
    # seq 1 is "sent" in both initiator dumps (its ack never came); the later dump is the one used
    assert "using the later one, " + str(late) in out
    rep = report_of(early, late, tpath)
    assert [d.path for d in rep.dumps if d.endpoint == "trainer"] == [str(late)]
    assert code == 1 and [f.op.seq for f in rep.findings] == [1]


# --------------------------------------------------------------------------- one-sided dumps


def test_only_initiator_dump(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = Pair()
    p.op()
    ir, _ = p.op(target=None, init=None)  # sent, no reply
    p.op(target=None, init="timed_out")
    ipath, _ = p.dump(tmp_path)

    code, out, _ = run_main(capsys, ipath)
    assert code == 1
    assert "no dump of 'gen-0' was given" in out
    line = next(x for x in out.splitlines() if x.startswith("STALLED"))
    assert line.startswith(f"STALLED: put #{ir.op_id} (seq 2) trainer -> gen-0")
    assert "no dump of gen-0 was given" in line and "had no reply" in line
    rep = report_of(ipath)
    [f] = rep.findings
    assert f.verdict == "target_dump_missing"
    assert [b.initiator_state for b in f.blocked_behind] == ["timed_out"]


def test_only_initiator_dump_all_done(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = Pair()
    p.op()
    p.op()
    ipath, _ = p.dump(tmp_path)
    code, out, _ = run_main(capsys, ipath)
    assert code == 0
    assert "no dump of 'gen-0' was given" in out and "result: OK" in out


def test_only_target_dump(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = Pair()
    p.op()
    _, tr = p.op(target="received", init=None)
    _, tpath = p.dump(tmp_path)

    code, out, _ = run_main(capsys, tpath)
    assert code == 1
    assert tr is not None
    line = next(x for x in out.splitlines() if x.startswith("STALLED"))
    assert line.startswith(f"STALLED: put #{tr.op_id} (seq 2) trainer -> gen-0 ['layer0.weight'] 4.0 MiB over tcp: "
                           "gen-0 received the header at")
    assert "no dump of trainer was given" in line
    [f] = report_of(tpath).findings
    assert f.op.initiator_state is None and f.op.target_state == "received"


def test_only_target_dump_all_done(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = Pair()
    p.op()
    p.op(kind=OpKind.NOTIFY, names=[], nbytes=3)
    _, tpath = p.dump(tmp_path)
    code, out, _ = run_main(capsys, tpath)
    assert code == 0, out
    assert "no dump of 'trainer' was given" in out


# --------------------------------------------------------------------------- ring wrap-around


def test_ring_wraparound(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = Pair(target_capacity=5)
    recs = [p.op(names=[f"w{k}"]) for k in range(12)]
    ipath, tpath = p.dump(tmp_path)

    t = load_dump(tpath)
    assert t.capacity == 5 and len(t.records) == 5
    assert [r.record_id for r in t.records] == [8, 9, 10, 11, 12]
    assert [r.seq for r in t.records] == [8, 9, 10, 11, 12]
    assert t.overwritten
    assert t.oldest == recs[7][1].t_posted  # type: ignore[union-attr]
    i = load_dump(ipath)
    assert len(i.records) == 12 and not i.overwritten
    assert [r.record_id for r in i.records] == list(range(1, 13))

    # seqs 1-7 have only the initiator's view; they completed, so all is well
    code, out, _ = run_main(capsys, ipath, tpath)
    assert code == 0, out
    assert "older records were overwritten" in out


def test_ring_wraparound_hides_the_target_record(tmp_path: Path) -> None:
    p = Pair(target_capacity=5)
    ir, _ = p.op(channel="trainer#1->gen-0#2/old", target="done", init="timed_out")  # its target record is evicted
    time.sleep(0.002)
    for k in range(12):
        p.op(names=[f"w{k}"])
    rep = report_of(*p.dump(tmp_path))
    [f] = rep.findings
    assert f.op.seq == ir.seq and f.op.channel == "trainer#1->gen-0#2/old"
    assert f.verdict == "target_record_overwritten"
    assert "gen-0's dump does not cover it: its ring (capacity 5) was full" in f.message


# --------------------------------------------------------------------------- bad input


def _write(path: Path, doc: object) -> Path:
    path.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return path


def test_malformed_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = Pair()
    p.op()
    good, _ = p.dump(tmp_path)
    base = json.loads(good.read_text())

    bad_record = json.loads(good.read_text())
    bad_record["records"][0]["seq"] = "one"
    cases = {
        "not-json": ("{nope", "not a JSON file"),
        "list": ([1, 2], "top level is a list"),
        "wrong-format": ({**base, "format": "something/2"}, "format is 'something/2'"),
        "no-format": ({k: v for k, v in base.items() if k != "format"}, "format is None"),
        "no-records": ({k: v for k, v in base.items() if k != "records"}, "records must be a list"),
        "bad-capacity": ({**base, "capacity": 0}, "capacity must be a positive integer"),
        "bad-record": (bad_record, "record 0: seq must be an integer"),
        "missing-field": ({**base, "records": [{"record_id": 1}]}, "lacks field(s)"),
    }
    for name, (doc, msg) in cases.items():
        path = _write(tmp_path / f"{name}.json", doc)
        with pytest.raises(ValueError) as info:
            load_dump(path)
        assert msg in str(info.value) and str(path) in str(info.value), (name, str(info.value))
        code, out, err = run_main(capsys, good, path)
        assert code == 2, name
        assert msg in err and out == ""

    missing = tmp_path / "missing.json"
    with pytest.raises(ValueError, match="cannot read"):
        load_dump(missing)
    code, _, err = run_main(capsys, missing)
    assert code == 2 and "cannot read" in err
    assert load_dump(good).endpoint == "trainer" and base["format"] == FORMAT


def test_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["--help"]) == 0
    capsys.readouterr()


# --------------------------------------------------------------------------- real endpoints


@pytest.mark.parametrize("planes", [("tcp",), None], ids=["tcp", "default"])
async def test_real_endpoints_dumps_are_clean(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              planes: tuple[str, ...] | None) -> None:
    async with asyncio.timeout(30):
        a = transport.Endpoint("a", store="tcp://127.0.0.1:0", host_store=True, timeout=10, planes=planes)
        await a.open()
        try:
            b = transport.Endpoint("b", store=a.store_url, timeout=10, planes=planes)
            await b.open()
            try:
                w = torch.zeros(1024)
                b.register("w", w)
                await a.put("b", {"w": torch.ones(1024)})  # (shm: one-sided, no record on b)
                await a.put("b", {"w": torch.full((1024,), 2.0)}, notify=b"put")
                await a.notify("b", b"hello")
                assert (await b.next_notification(timeout=10)).payload == b"put"
                note = await b.next_notification(timeout=10)
                assert note.payload == b"hello"
                got = torch.empty(1024)
                await a.get("b", {"w": got})
                assert torch.equal(got, torch.full((1024,), 2.0)) and torch.equal(w, got)
                apath = a.dump_flight_recorder(tmp_path / "a.json")
                bpath = b.dump_flight_recorder(tmp_path / "b.json")
            finally:
                await b.close()
        finally:
            await a.close()

    code, out, err = run_main(capsys, apath, bpath)
    assert code == 0, out + err
    assert "result: OK" in out
    rep = report_of(apath, bpath)
    assert not rep.stalled and rep.findings == []
    [ch] = [c for c in rep.channels if c.initiator == "a"]
    assert ch.target == "b" and ch.not_completed == 0 and ch.ops >= 4
    assert ch.initiator_dump == str(apath) and ch.target_dump == str(bpath)
    a_recs = load_dump(apath).records
    assert [r.state for r in a_recs if r.role == "initiator"] == ["done"] * len(
        [r for r in a_recs if r.role == "initiator"])
    assert {r.kind for r in a_recs} >= {"put", "notify", "get"}
    # the puts that messaged b were paired with its records of the same (channel, initiator, seq); over shm
    # the plain put is one-sided and leaves none there (the analysis is clean all the same)
    b_keys = {(r.channel, r.initiator, r.seq) for r in load_dump(bpath).records if r.role == "target"}
    a_puts = [r for r in a_recs if r.kind == "put"]
    paired = [(r.channel, r.initiator, r.seq) in b_keys for r in a_puts]
    assert paired == ([False, True] if a_puts[0].plane == "shm" else [True, True]), (a_puts, paired)
    assert "\n" in format_report(rep)


async def test_real_endpoints_notification_queue_full(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """b never consumes notifications and holds at most one of a's, so a's second notify waits
    for a notification credit and times out, never sent; the analysis names the wait."""
    async with asyncio.timeout(30):
        a = transport.Endpoint("a", store="tcp://127.0.0.1:0", host_store=True, timeout=10, planes=("tcp",),
                               dump_dir=tmp_path / "auto")
        await a.open()
        try:
            b = transport.Endpoint("b", store=a.store_url, timeout=10, planes=("tcp",), max_pending_notifications=1,
                                   dump_dir=tmp_path / "auto")
            await b.open()
            try:
                await a.notify("b", b"one")
                with pytest.raises(transport.TransportTimeoutError):
                    await a.notify("b", b"two", timeout=0.5)
                apath = a.dump_flight_recorder(tmp_path / "a.json")
                bpath = b.dump_flight_recorder(tmp_path / "b.json")
            finally:
                await b.close()
        finally:
            await a.close()

    code, out, err = run_main(capsys, apath, bpath)
    assert code == 1, out + err
    rep = report_of(apath, bpath)
    [f] = rep.findings
    assert f.blocking and f.op.kind == "notify" and f.op.seq == 2
    assert (f.op.initiator, f.op.target) == ("a", "b")
    assert (f.op.initiator_state, f.op.target_state) == ("timed_out", None)
    assert f"STALLED: notify #{f.op.op_id} (seq 2) a -> b 3 B: the header never reached b" in out
    assert "a never sent it: from " in out and "it waited for a notification credit of b" in out, out
    assert "(its max_pending_notifications)" in out and "gave up at" in out, out
