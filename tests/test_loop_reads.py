"""The event loop reading its ops' answers itself (transport.loop_reads), with real processes and sockets.

What must hold:
- while the loop waits for its ops, their answers are read and settled on the loop (one wake-up
  per op instead of two), and the reads are handed over rarely, not per op;
- the peer's ops to us never depend on our loop: with our loop blocked (synchronous code in a
  coroutine) while it owns the reads, the peer's puts into us are served by the reader thread,
  which takes the reads back, and our heartbeat does not see the peer as silent;
- ops both ways at once (each side's loop and thread trading the reads) lose and corrupt nothing;
- a get's reply (its Data and payload) is read and written into the caller's tensor on the loop
  when it fits the read-ahead, handed to the thread when it does not: exact bytes at every size
  around that limit, and a get cancelled at any point writes nothing once its cancellation returned;
- the peer's posts, once we posted to it with ``reply_expected`` (a request answered by a post),
  are read and delivered on the loop too, on tcp and same-host channels, in order, none lost;
- closing an endpoint while its loop owns the reads leaves no descriptor behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import threading
import time

import pytest
import torch

import transport
from tests._remote import RemoteEndpoint, make_tensor, open_fds
from transport import loop_reads
from transport.loop_reads import Owner
from transport.receiver import READ_AHEAD

SIZE = 4096


def _reads(ep: transport.Endpoint, peer: str):
    reads = ep._channels[peer].reads
    assert reads is not None, "TRANSPORT_LOOP_READS is off in this environment"
    return reads


@pytest.mark.timeout(120)
async def test_answers_are_read_on_the_loop_with_few_handovers(store_url, uname, monkeypatch):
    # (a loop delayed 20 ms by this busy 2-core machine hands its reads over by design: the margins here
    # are wider so that what is counted is the steady state, not the machine's hiccups)
    monkeypatch.setattr(loop_reads, "STALL_S", 0.5)
    monkeypatch.setattr(loop_reads, "WATCH_S", 0.5)
    b = RemoteEndpoint(uname("b"), store=store_url, planes=("tcp",), timeout=10)
    try:
        b.call("register", "x", "uint8", (SIZE,))
        async with transport.Endpoint(uname("a"), store=store_url, planes=("tcp",), timeout=10) as ep:
            src = make_tensor("uint8", (SIZE,), 7)
            await ep.put(b.name, {"x": src})
            reads = _reads(ep, b.name)
            before_frames, before_handovers = reads.loop_frames, reads.handovers
            for _ in range(300):
                await ep.put(b.name, {"x": src})
            frames = reads.loop_frames - before_frames
            handovers = reads.handovers - before_handovers
            assert frames >= 290, (frames, handovers)  # (a Ping may be among them; an answer or two to the thread)
            assert handovers <= 5, handovers
            assert b.call("check", "x", 7)
    finally:
        b.kill()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("planes", [("tcp",), None], ids=["tcp", "same-host-default"])
@pytest.mark.parametrize("expected", [True, False], ids=["reply-expected", "plain"])
async def test_posts_answered_by_posts_are_read_on_the_loop(store_url, uname, monkeypatch, planes, expected):
    """Requests and answers as posts (rl_sync's pattern): once we posted to B with
    ``reply_expected``, our loop reads B's posts itself and delivers them without the reader
    thread; so do same-host channels with the default planes (shm, and cuda_ipc's unmap acks).
    A plain post leaves B's frames to the thread. Every post arrives once and in order, whoever
    read it, and a notification B asks us to acknowledge (notify) is answered from the loop."""
    monkeypatch.setattr(loop_reads, "STALL_S", 0.5)
    monkeypatch.setattr(loop_reads, "WATCH_S", 0.5)
    b = RemoteEndpoint(uname("b"), store=store_url, planes=planes, timeout=10)
    try:
        async with transport.Endpoint(uname("a"), store=store_url, planes=planes, timeout=10) as ep:
            await ep.connect(b.name)
            await asyncio.to_thread(b.call, "connect", ep.name)

            def loop_frames() -> int:
                return sum(ch.reads.loop_frames for ch in ep._connector.all
                           if ch.peer_name == b.name and ch.reads is not None)

            assert _reads(ep, b.name) is not None
            before = loop_frames()
            rounds = 60
            for i in range(rounds):
                await ep.post(b.name, b"q%d" % i, reply_expected=expected)  # (B answers by itself: b.call below)
                await asyncio.to_thread(b.call, "post", ep.name, [b"a%d.0" % i, b"a%d.1" % i])
                for k in range(2):
                    note = await ep.next_notification(timeout=10)
                    assert (note.peer, note.payload) == (b.name, b"a%d.%d" % (i, k))
            taken = loop_frames() - before
            if expected:
                assert taken >= rounds, (taken, rounds)  # (most of the 120: a hand-over at the start, a Ping or two)
            else:
                assert taken == 0, taken
            await asyncio.to_thread(b.call, "notify", ep.name, b"answered")  # returns once our Ack came
            assert (await ep.next_notification(timeout=10)).payload == b"answered"
            got = await asyncio.to_thread(b.call, "notifications", rounds, 10)
            assert [p for _, p in got] == [b"q%d" % i for i in range(rounds)]
    finally:
        b.kill()


@pytest.mark.timeout(120)
async def test_posts_beyond_a_full_queue_wait_in_order_without_a_hand_over_each(store_url, uname, monkeypatch):
    """We grant B 8 notifications; B posts 200 while we read none (after we posted to B: our loop
    wants the reads). B's posts past its credits wait in B (protocol 8; before, the ones the loop
    could not queue went to our reader thread, which waited for room): all 200 then arrive in
    order, and the reads do not change hands per notification meanwhile."""
    monkeypatch.setattr(loop_reads, "STALL_S", 0.5)
    monkeypatch.setattr(loop_reads, "WATCH_S", 0.5)
    b = RemoteEndpoint(uname("b"), store=store_url, planes=("tcp",), timeout=10)
    try:
        async with transport.Endpoint(uname("a"), store=store_url, planes=("tcp",), timeout=10,
                                      max_pending_notifications=8) as ep:
            await ep.connect(b.name)
            await asyncio.to_thread(b.call, "connect", ep.name)
            await ep.post(b.name, b"go", reply_expected=True)
            reads = _reads(ep, b.name)
            before = reads.handovers
            n = 200
            sender = asyncio.ensure_future(asyncio.to_thread(b.call, "post", ep.name, [b"p%d" % i for i in range(n)]))
            await asyncio.sleep(1.0)  # (reading nothing: the queue fills, the rest waits in the socket)
            for i in range(n):
                note = await ep.next_notification(timeout=10)
                assert note.payload == b"p%d" % i, (i, note.payload)
                if i % 50 == 0:
                    await ep.post(b.name, b"more", reply_expected=True)  # (we keep wanting the reads)
            await asyncio.wait_for(sender, 20)
            assert reads.handovers - before <= 20, reads.handovers - before
    finally:
        b.kill()


class _FailingSends:
    """A channel socket whose sends fail with ETIMEDOUT once ``fail`` is set (what a keepalive or
    TCP user timeout raises): the rest is the real socket."""

    def __init__(self, sock) -> None:
        self._sock, self.fail = sock, False

    def sendmsg(self, *args, **kwargs):
        if self.fail:
            raise OSError(errno.ETIMEDOUT, "ETIMEDOUT (injected)")
        return self._sock.sendmsg(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._sock, name)


@pytest.mark.timeout(60)
async def test_an_ack_the_loop_cannot_send_breaks_the_channel_without_a_hang(store_url, uname, monkeypatch):
    """The loop reads B's notify (we posted to B with reply_expected) and answers it; the answer's
    send fails (ETIMEDOUT): the channel breaks (B's notify fails typed) and our loop goes on. The
    send must not run under the reads' lock, which breaking the channel takes (a deadlock that
    froze the loop and the reader thread, found by a review)."""
    monkeypatch.setattr(loop_reads, "STALL_S", 5.0)
    monkeypatch.setattr(loop_reads, "WATCH_S", 5.0)
    async with transport.Endpoint(uname("a"), store=store_url, planes=("tcp",), timeout=5) as a, \
            transport.Endpoint(uname("b"), store=store_url, planes=("tcp",), timeout=5) as b:
        await a.connect(b.name)
        await b.connect(a.name)
        ch = a._channels[b.name]
        assert b._channels[a.name].id == ch.id  # (one channel both ways)
        await a.post(b.name, b"hello", reply_expected=True)
        deadline = time.monotonic() + 5
        while not (ch.reads.owner is Owner.LOOP and ch.reads._armed == ch.reads._gen):
            assert time.monotonic() < deadline, "the loop never took the reads"
            await asyncio.sleep(0.01)
        failing = _FailingSends(ch._tx._sock)
        ch._tx._sock = failing
        failing.fail = True
        t0 = time.monotonic()
        with pytest.raises((transport.PeerLostError, transport.TransportTimeoutError)):
            await b.notify(a.name, b"x", timeout=3)
        assert (await a.next_notification(timeout=5)).payload == b"x"  # (delivered before its answer failed)
        assert not ch.is_open
        assert time.monotonic() - t0 < 8.0, "the loop was frozen"


@pytest.mark.timeout(120)
async def test_a_blocked_loop_never_holds_up_the_peers_ops(store_url, uname):
    """Our put to B is held up by B (its reader sleeps 0.6 s before serving it), so our loop owns
    the reads; then our loop blocks for 2.5 s. B's puts into us meanwhile are served by our reader
    thread (it takes the reads back): each returns long before our loop runs again."""
    b = RemoteEndpoint(uname("b"), store=store_url, planes=("tcp",), timeout=10, heartbeat_timeout=2.0)
    try:
        b.call("register", "x", "uint8", (SIZE,))
        async with transport.Endpoint(uname("a"), store=store_url, planes=("tcp",), timeout=10,
                                      heartbeat_timeout=2.0) as ep:
            mine = torch.zeros(SIZE, dtype=torch.uint8)
            ep.register("in", mine)
            await ep.put(b.name, {"x": make_tensor("uint8", (SIZE,), 1)})
            b.call("connect", ep.name)
            b.call("lag", ep.name, "_target.serve_put", 0.6)
            reads = _reads(ep, b.name)
            incarnation = ep.peers[b.name].incarnation
            task = asyncio.ensure_future(ep.put(b.name, {"x": make_tensor("uint8", (SIZE,), 2)}))
            ops = ep._channels[b.name].ops
            deadline = time.monotonic() + 2.0
            while not (reads.owner is Owner.LOOP and ops.pending) and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            assert reads.owner is Owner.LOOP and ops.pending, "the loop never took the reads while its put waited"
            took: list[float] = []
            errors: list[BaseException] = []

            def peer_puts() -> None:
                try:
                    for seed in (11, 12, 13):
                        t0 = time.monotonic()
                        b.call("put", ep.name, {"in": ("uint8", (SIZE,), seed)}, 5.0, timeout=10)
                        took.append(time.monotonic() - t0)
                except BaseException as exc:  # noqa: BLE001 (reported below)
                    errors.append(exc)

            th = threading.Thread(target=peer_puts, daemon=True)
            blocked_at = time.monotonic()
            th.start()
            time.sleep(2.5)  # noqa: ASYNC251 (the point: the application blocks the event loop)
            blocked = time.monotonic() - blocked_at
            th.join(10)
            assert not errors, errors
            assert len(took) == 3 and sum(took) < blocked - 0.5, (took, blocked)
            assert torch.equal(mine, make_tensor("uint8", (SIZE,), 13))
            await asyncio.wait_for(task, 10)  # our own put completes too, once the loop runs
            assert ep.peers[b.name].incarnation == incarnation and ep._channels[b.name].is_open
            await ep.put(b.name, {"x": make_tensor("uint8", (SIZE,), 3)})
            assert b.call("check", "x", 3)
    finally:
        b.kill()


@pytest.mark.timeout(180)
async def test_ops_both_ways_at_once_lose_nothing(store_url, uname):
    """We put and get 4 KiB to and from B while B puts into us from its own loop: every op
    completes with exact bytes, and the reads changed hands (both sides' loops and threads)."""
    b = RemoteEndpoint(uname("b"), store=store_url, planes=("tcp",), timeout=10)
    try:
        b.call("register_data", "x", "uint8", (SIZE,), 5)
        async with transport.Endpoint(uname("a"), store=store_url, planes=("tcp",), timeout=10) as ep:
            mine = torch.zeros(SIZE, dtype=torch.uint8)
            ep.register("in", mine)
            await ep.connect(b.name)
            b.call("connect", ep.name)
            # B's reader sleeps 10 ms (twice HOLD_S) before it serves each of our puts: while one
            # waits, our reader thread hears nothing for HOLD_S and hands the reads to our loop,
            # however fast or slow this machine is; the peer's puts into us take them back.
            b.call("lag", ep.name, "_target.serve_put", 0.01)
            reads = _reads(ep, b.name)
            handovers = reads.handovers
            stop = threading.Event()
            errors: list[BaseException] = []
            count = [0]

            def peer_puts() -> None:
                try:
                    while not stop.is_set():
                        b.call("put", ep.name, {"in": ("uint8", (SIZE,), 100 + count[0] % 7)}, 5.0, timeout=10)
                        count[0] += 1
                except BaseException as exc:  # noqa: BLE001 (reported below)
                    errors.append(exc)

            th = threading.Thread(target=peer_puts, daemon=True)
            th.start()
            try:
                want = make_tensor("uint8", (SIZE,), 5)
                got = torch.empty(SIZE, dtype=torch.uint8)
                deadline = time.monotonic() + 60
                i = 0
                while i < 400 or (reads.handovers <= handovers and time.monotonic() < deadline):
                    i += 1
                    if i % 2:
                        got.zero_()
                        await ep.get(b.name, {"x": got})
                        assert torch.equal(got, want), i
                    else:
                        await ep.put(b.name, {"x": want})
            finally:
                stop.set()
                th.join(15)
            assert not errors, errors
            assert count[0] >= 5, count[0]
            assert reads.handovers > handovers, (reads.handovers, handovers, i)
            assert b.call("check", "x", 5)
            assert any(torch.equal(mine, make_tensor("uint8", (SIZE,), 100 + k)) for k in range(7))
    finally:
        b.kill()


@contextlib.asynccontextmanager
async def _data_peer(store_url: str, uname, n: int):
    """A spawned peer B with ``x``: ``n`` uint8 bytes of seed 5 (tcp), and an endpoint of ours
    connected to it: (B, ours, what ``x`` holds)."""
    b = RemoteEndpoint(uname("b"), store=store_url, planes=("tcp",), timeout=10)
    try:
        b.call("register_data", "x", "uint8", (n,), 5)
        async with transport.Endpoint(uname("a"), store=store_url, planes=("tcp",), timeout=10) as ep:
            await ep.connect(b.name)
            yield b, ep, make_tensor("uint8", (n,), 5)
    finally:
        b.kill()


@pytest.mark.timeout(180)
async def test_gets_are_read_on_the_loop_exact_at_every_size(store_url, uname, monkeypatch):
    """Gets of sub-ranges from 1 byte to past the read-ahead: each exact; the small ones' replies
    are taken on the loop (its frame count grows by one per get), the ones too large for the
    read-ahead go to the thread and still arrive whole."""
    monkeypatch.setattr(loop_reads, "STALL_S", 0.5)
    monkeypatch.setattr(loop_reads, "WATCH_S", 0.5)
    n = READ_AHEAD + 16384
    async with _data_peer(store_url, uname, n) as (b, ep, want):
        reads = _reads(ep, b.name)
        small = [1, 7, SIZE, 60000, loop_reads.LOOP_DATA_MAX]
        large = [loop_reads.LOOP_DATA_MAX + 1, READ_AHEAD - 8, READ_AHEAD, n - 3]
        for rnd in range(40):
            for size in small + large:
                off = (rnd * 131) % (n - size + 1)
                got = torch.full((size,), 0xEE, dtype=torch.uint8)
                await ep.get(b.name, {"x": transport.At(got, off)})
                assert torch.equal(got, want[off : off + size]), (rnd, size, off)
        got = torch.empty(SIZE, dtype=torch.uint8)
        # settle into the loop's reads: after the large gets' replies (the thread's) the thread keeps the
        # reads until none of those came for HOLD_S, however many small gets fit in that time
        settle = time.monotonic() + 3 * loop_reads.HOLD_S
        bound = time.monotonic() + 10
        while (time.monotonic() < settle or reads.owner is not Owner.LOOP) and time.monotonic() < bound:
            await ep.get(b.name, {"x": transport.At(got, 0)})
        before = reads.loop_frames
        for i in range(200):
            got.fill_(0xEE)
            await ep.get(b.name, {"x": transport.At(got, i)})
            assert torch.equal(got, want[i : i + SIZE]), i
        # (the previous code took none on the loop; on a loaded 2-core VM a Ping, a stall take-back or a hand-over
        # leaves some to the thread; 200 of 200 here once settled by time, 169-171 when it settled by a count of
        # gets that the thread's hold could outlast)
        assert reads.loop_frames - before >= 170, (reads.loop_frames - before, reads.owner, reads.want, reads.handovers,
                                                   reads._must_read, reads._gen, reads._seen_gen, reads._armed)


@pytest.mark.timeout(180)
async def test_a_cancelled_get_writes_nothing_once_its_cancellation_returned(store_url, uname):
    """Gets cancelled after 0-5 passes of the loop (before sending, while the reply is on its way,
    as it is read): once the cancellation returned, the caller's tensor never changes again (a get
    of the same channel that follows, and so is answered after it, is awaited before checking);
    one that completed holds exact bytes."""
    async with _data_peer(store_url, uname, SIZE) as (b, ep, want):
        reads = _reads(ep, b.name)
        after = torch.empty(SIZE, dtype=torch.uint8)
        outcomes = {"cancelled": 0, "done": 0}
        before = reads.loop_frames
        for i in range(400):
            dest = torch.full((SIZE,), 0xEE, dtype=torch.uint8)
            task = asyncio.ensure_future(ep.get(b.name, {"x": dest}))
            for _ in range(i % 6):
                await asyncio.sleep(0)
            task.cancel()
            try:
                await task
                outcomes["done"] += 1
                assert torch.equal(dest, want), i
                continue
            except asyncio.CancelledError:
                outcomes["cancelled"] += 1
            snapshot = dest.clone()
            await ep.get(b.name, {"x": after})
            assert torch.equal(after, want), i
            assert torch.equal(dest, snapshot), f"get {i} wrote into the caller's tensor after its cancellation returned"
        assert outcomes["cancelled"] >= 100, outcomes
        assert reads.loop_frames > before, "no reply was read on the loop"
        assert ep._channels[b.name].is_open


@pytest.mark.timeout(120)
async def test_closing_while_the_loop_owns_the_reads_leaves_no_descriptor(store_url, uname):
    b = RemoteEndpoint(uname("b"), store=store_url, planes=("tcp",), timeout=10)
    try:
        b.call("register", "x", "uint8", (SIZE,))
        src = make_tensor("uint8", (SIZE,), 9)
        async with transport.Endpoint(uname("a0"), store=store_url, planes=("tcp",), timeout=10) as warm:
            await warm.put(b.name, {"x": src})  # (imports, executor threads: made once)
        start = len(open_fds())
        for i in range(3):
            ep = transport.Endpoint(uname(f"a{i + 1}"), store=store_url, planes=("tcp",), timeout=10)
            async with ep:
                await ep.put(b.name, {"x": src})
                reads = _reads(ep, b.name)
                b.call("lag", ep.name, "_target.serve_put", 0.5)
                pending = asyncio.ensure_future(ep.put(b.name, {"x": src}))
                ops = ep._channels[b.name].ops
                deadline = time.monotonic() + 2.0
                while not (reads.owner is Owner.LOOP and ops.pending) and time.monotonic() < deadline:
                    await asyncio.sleep(0.005)
                assert reads.owner is Owner.LOOP and ops.pending
            with pytest.raises(transport.TransportError):
                await asyncio.wait_for(pending, 10)
            await asyncio.sleep(0.2)
        assert len(open_fds()) <= start + 1, (start, open_fds())
    finally:
        b.kill()


@pytest.mark.timeout(60)
async def test_a_notify_our_loop_read_is_answered_before_the_loop_runs_anything_else(store_url, uname, monkeypatch):
    """We post to B with ``reply_expected`` (B answers with a ``notify``): our loop owns the reads
    and reads B's notify itself. Synchronous code then runs for 2 s in that same turn of our loop
    (injected right after the read, as a coroutine woken in that turn would). B's notify (timeout
    1 s) must still return at once: its notification was queued here (its answer waited for the
    loop's next turn before: found by a review)."""
    from transport import serving
    from transport.loop_reads import LoopReads

    monkeypatch.setattr(loop_reads, "WATCH_S", 0.5)  # (the loop keeps the reads while it waits for B's answer)
    monkeypatch.setattr(loop_reads, "STALL_S", 0.5)
    read_here: list[bytes] = []
    orig_serve = serving.Serving.serve_notify_here

    def serve_notify_here(self, msg, *a, **k):
        ok = orig_serve(self, msg, *a, **k)
        if ok:
            read_here.append(bytes(msg.payload))
        return ok

    orig_readable = LoopReads._on_readable
    blocked: list[float] = []

    def on_readable(self):
        n = len(read_here)
        orig_readable(self)
        if len(read_here) > n and not blocked:  # the application's synchronous code, in this same turn
            blocked.append(time.monotonic())
            time.sleep(2.0)  # noqa: ASYNC251 (the point: the loop is busy right after it read the notify)

    monkeypatch.setattr(serving.Serving, "serve_notify_here", serve_notify_here)
    monkeypatch.setattr(LoopReads, "_on_readable", on_readable)
    b = RemoteEndpoint(uname("b"), store=store_url, planes=("tcp",), timeout=10)
    try:
        async with transport.Endpoint(uname("a"), store=store_url, planes=("tcp",), timeout=10) as ep:
            await ep.connect(b.name)
            b.call("connect", ep.name)
            b.start("notify_after", ep.name, b"answer", 0.1, 1.0)
            await ep.post(b.name, b"request", reply_expected=True)
            took = await asyncio.to_thread(b.result, 20)
            note = await ep.next_notification(timeout=5)
            assert note.payload == b"answer"
            assert read_here == [b"answer"] and blocked, "our loop did not read B's notify (the race was not hit)"
            assert isinstance(took, float) and took < 0.5, f"B's notify took: {took!r} (its answer waited for our loop)"
    finally:
        b.kill()
