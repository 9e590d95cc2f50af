"""Hostile review of notification credits (transport.credits, protocol 8): the cases a reviewer
tried to break it with. Those whose docstrings say "failed before" found a defect (fixed with the
test); "held" ones checked what worked. Each test is bounded; real endpoints over real sockets
(or a hand-made wire peer)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

import transport
from tests import _wire_peer as peer
from transport import wire


async def _payloads(ep: transport.Endpoint, n: int, timeout: float = 10) -> list[bytes]:
    return [(await ep.next_notification(timeout=timeout)).payload for _ in range(n)]


async def test_a_post_behind_a_held_back_op_never_waits_for_a_credit_in_the_caller(store_url, uname):
    """Window 1, nothing taken. A put to a buffer our cached registry lacks holds its place while it
    syncs the registry (one round trip); two posts are called meanwhile. Both return at once and
    arrive in order. Failed before: finding a credit available, they took the op path behind the
    put; the first spent the one credit and the second waited for one in the caller's
    ``await post(...)`` until TransportTimeoutError. Now a post that cannot go out at once parks."""
    async with transport.Endpoint(uname("tgt"), store=store_url, planes=("tcp",), max_pending_notifications=1) as tgt:
        async with transport.Endpoint(uname("ini"), store=store_url, planes=("tcp",), timeout=10) as ini:
            await ini.connect(tgt.name)
            put = asyncio.ensure_future(ini.put(tgt.name, {"nope": torch.ones(4)}))  # (a registry sync first)
            p1 = asyncio.ensure_future(ini.post(tgt.name, b"p1", timeout=1.0))
            p2 = asyncio.ensure_future(ini.post(tgt.name, b"p2", timeout=1.0))
            with pytest.raises(transport.UnknownBufferError):
                await asyncio.wait_for(put, 5)
            done, _ = await asyncio.wait((p1, p2), timeout=3)
            errors = [t.exception() for t in (p1, p2) if t in done and t.exception() is not None]
            assert not errors, f"a post waited in its caller for a notification credit: {errors!r}"
            assert await _payloads(tgt, 2) == [b"p1", b"p2"]



def _plane_kw(plane: str) -> dict:
    from transport.planes import SocketLinkEngine
    from transport.staging import StagingConfig, ThreadCopyEngine
    return {
        "tcp": {"planes": ("tcp",)},
        "shm": {"planes": ("shm",)},
        "staged": {"planes": ("tcp",), "staging": StagingConfig(chunk_bytes=64 * 1024, buffers=3,
                                                               cpu_engine=ThreadCopyEngine)},
        "nccl": {"planes": ("tcp", "nccl"), "engines": {"nccl": SocketLinkEngine}},
    }[plane]


@pytest.mark.parametrize("plane", ["tcp", "shm", "staged", "nccl"])
async def test_every_plane_keeps_order_and_gives_every_credit_back(store_url, uname, plane):
    """Held (a check of what works). Window 4 on each plane (CPU stand-ins): puts with a
    notification, notifies and posts, more than the window, while the target takes them slowly;
    then puts with a notification refused by the target (an unregistered buffer). Every
    notification arrives once, in call order (nccl: a put's notification is delivered from the
    link's completion, which a later notify may overtake, as before credits: only the others'
    order is checked there), and afterwards the whole window is free again (4 notifies complete
    while the target takes nothing): no credit leaked."""
    kw = _plane_kw(plane)
    async with asyncio.timeout(90):
        async with transport.Endpoint(uname("tgt"), store=store_url, max_pending_notifications=4, timeout=20,
                                      **kw) as tgt:
            for i in range(6):
                tgt.register(f"w{i}", torch.zeros(1024))
            tgt.register("gone", torch.zeros(16))
            async with transport.Endpoint(uname("ini"), store=store_url, timeout=20, **kw) as ini:
                await ini.connect(tgt.name)
                want: list[bytes] = []
                calls = []
                for i in range(18):
                    t = torch.full((1024,), float(i))
                    if i % 3 == 0:
                        calls.append(ini.put(tgt.name, {f"w{i % 6}": t}, notify=b"put%02d" % i))
                    elif i % 3 == 1:
                        calls.append(ini.notify(tgt.name, b"ntf%02d" % i))
                    else:
                        calls.append(ini.post(tgt.name, b"pst%02d" % i))
                    want.append((b"put%02d" if i % 3 == 0 else b"ntf%02d" if i % 3 == 1 else b"pst%02d") % i)
                tasks = [asyncio.ensure_future(c) for c in calls]

                async def take(n: int) -> list[bytes]:
                    got = []
                    for _ in range(n):
                        got.append((await tgt.next_notification(timeout=20)).payload)
                        await asyncio.sleep(0.01)
                    return got

                got = await take(18)
                if plane == "nccl":
                    assert sorted(got) == sorted(want)
                    got, want = [g for g in got if not g.startswith(b"put")], [w for w in want if not w.startswith(b"put")]
                assert got == want
                await asyncio.gather(*tasks)
                planes = {r["plane"] for r in ini.recorder.snapshot() if r["role"] == "initiator" and r["kind"] == "put"}
                assert planes == {plane}, planes
                tgt.unregister("gone")
                for _ in range(6):
                    with pytest.raises(transport.TransportError):
                        await ini.put(tgt.name, {"gone": torch.ones(16)}, notify=b"refused", timeout=10)
                for i in range(4):  # (the whole window: nothing held, nothing leaked)
                    await asyncio.wait_for(ini.notify(tgt.name, b"free%d" % i), 5)
                assert await take(4) == [b"free%d" % i for i in range(4)]


async def test_cuda_ipc_memfd_puts_with_notifications_wait_for_credits_and_give_them_back(store_url, uname):
    """Held. cuda_ipc (MemfdIpcEngine) between processes, window 2 at the target: 10 puts with a
    notification (the gated path: each waits for a credit in its turn) complete as the target
    takes them, in order; 4 refused ones (an unregistered buffer) give their credits back: two
    notifies then complete while the target takes nothing."""
    from tests._remote import RemoteEndpoint
    from transport.planes.cuda_ipc_memfd import MemfdIpcEngine

    kw = {"engines": {"cuda_ipc": MemfdIpcEngine}}
    tgt = RemoteEndpoint(uname("ipc-tgt"), store=store_url, max_pending_notifications=2, **kw)
    try:
        await asyncio.to_thread(tgt.call, "register", "w", "float32", (256,))
        await asyncio.to_thread(tgt.call, "register", "gone", "float32", (16,))
        async with asyncio.timeout(90):
            async with transport.Endpoint(uname("ipc-ini"), store=store_url, timeout=20, **kw) as ini:
                await ini.connect(tgt.name)
                puts = [asyncio.ensure_future(ini.put(tgt.name, {"w": torch.full((256,), float(i))},
                                                      notify=b"p%d" % i)) for i in range(10)]
                await asyncio.sleep(0.5)
                assert sum(p.done() for p in puts) <= 2, "puts went past the target's window"
                got = await asyncio.to_thread(tgt.call, "notifications", 10, 20.0)
                assert [p for _, p in got] == [b"p%d" % i for i in range(10)]
                await asyncio.gather(*puts)
                planes = {r["plane"] for r in ini.recorder.snapshot() if r["role"] == "initiator" and r["kind"] == "put"}
                assert planes == {"cuda_ipc"}, planes
                await asyncio.to_thread(tgt.call, "unregister", "gone")
                for _ in range(4):
                    with pytest.raises(transport.TransportError):
                        await ini.put(tgt.name, {"gone": torch.ones(16)}, notify=b"refused", timeout=10)
                for i in range(2):
                    await asyncio.wait_for(ini.notify(tgt.name, b"free%d" % i), 5)
    finally:
        tgt.stop()


async def test_the_flight_recorder_explains_a_notify_stuck_behind_posts_parked_for_credits(tmp_path, capsys):
    """b holds one of a's notifications (window 1) and takes none. a posts three: one goes out, two
    park. a's notify behind them times out; its error says it waited for a credit, and the analysis
    of both dumps names the wait for b's credits. Failed before: parked posts had no record and the
    notify, stuck behind them, no ``awaiting_credit`` mark: the analysis said only that it was never
    sent."""
    from transport.fr_analyze import main

    async with asyncio.timeout(30):
        a = transport.Endpoint("a", store="tcp://127.0.0.1:0", host_store=True, timeout=10, planes=("tcp",),
                               dump_dir=tmp_path / "auto")
        await a.open()
        try:
            b = transport.Endpoint("b", store=a.store_url, timeout=10, planes=("tcp",), max_pending_notifications=1,
                                   dump_dir=tmp_path / "auto")
            await b.open()
            try:
                for i in range(3):
                    await asyncio.wait_for(a.post("b", b"p%d" % i), 2)
                with pytest.raises(transport.TransportTimeoutError, match="notification credit"):
                    await a.notify("b", b"n", timeout=0.5)
                apath = a.dump_flight_recorder(tmp_path / "a.json")
                bpath = b.dump_flight_recorder(tmp_path / "b.json")
            finally:
                await b.close()
        finally:
            await a.close()
    capsys.readouterr()
    code = main([str(apath), str(bpath)])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "credit" in out, out


def _serve_mallory(s, window_log: list, stop: threading.Event) -> None:
    """Acks every Notify that asks for one; records what arrives."""
    s.settimeout(0.2)
    while not stop.is_set():
        try:
            msg = peer.read_msg(s)
        except (TimeoutError, OSError, EOFError):
            continue
        window_log.append(msg)
        if isinstance(msg, wire.Notify) and msg.answer:
            s.sendall(wire.encode_frame(wire.Ack(msg.op_id)))


async def test_hostile_credit_frames_never_widen_the_window_past_what_was_sent(store_url, uname):
    """Held. A hand-made peer granting 2: Credit frames with negative, zero and absurd totals (on
    the thread and on the loop's reads) change nothing but clamp to what was sent: the channel stays
    up and never more than 2 notifications beyond the credits really covered go out."""
    hostile = peer.hello()
    hostile.notify_window = 2
    async with transport.Endpoint(uname("tgt"), store=store_url, planes=("tcp",), timeout=10) as ep:
        s = await asyncio.to_thread(peer.handshaken, ep.address, ep._secret, hostile)
        log: list = []
        stop = threading.Event()
        t = threading.Thread(target=_serve_mallory, args=(s, log, stop), daemon=True)
        t.start()
        try:
            async with asyncio.timeout(30):
                while "mallory" not in ep.peers:
                    await asyncio.sleep(0.01)
                for i in range(2):
                    await ep.notify("mallory", b"n%d" % i, timeout=5)
                with pytest.raises(transport.TransportTimeoutError, match="notification credit"):
                    await ep.notify("mallory", b"x", timeout=0.3)
                for total in (-(2**63), -1, 0):
                    s.sendall(wire.encode_frame(wire.Credit(total)))
                with pytest.raises(transport.TransportTimeoutError, match="notification credit"):
                    await ep.notify("mallory", b"y", timeout=0.3)
                s.sendall(wire.encode_frame(wire.Credit(2**64 - 1)))  # (clamped to the 2 sent)
                for i in range(2, 4):
                    await ep.notify("mallory", b"n%d" % i, timeout=5)
                with pytest.raises(transport.TransportTimeoutError, match="notification credit"):
                    await ep.notify("mallory", b"z", timeout=0.3)
                assert "mallory" in ep.peers
                notes = [m.payload for m in log if isinstance(m, wire.Notify)]
                assert notes == [b"n0", b"n1", b"n2", b"n3"], notes
        finally:
            stop.set()
            t.join(5)
            s.close()


@pytest.mark.parametrize("how", ["peer_closes", "peer_lost", "we_close"])
async def test_a_notify_waiting_for_a_credit_fails_at_once_when_the_channel_ends(store_url, uname, how):
    """Held. Window 1 held: a notify (and a put with a notification) waiting for a credit with a
    30 s deadline fail within a couple of seconds when the target closes, when the channel breaks,
    or when our own endpoint closes (and that close returns promptly)."""
    tgt = transport.Endpoint(uname("tgt"), store=store_url, planes=("tcp",), max_pending_notifications=1)
    await tgt.open()
    tgt.register("w", torch.zeros(4))
    ini = transport.Endpoint(uname("ini"), store=store_url, planes=("tcp",), timeout=30)
    await ini.open()
    try:
        async with asyncio.timeout(30):
            await ini.notify(tgt.name, b"held")
            waiting = [asyncio.ensure_future(ini.notify(tgt.name, b"w")),
                       asyncio.ensure_future(ini.put(tgt.name, {"w": torch.ones(4)}, notify=b"p"))]
            await asyncio.sleep(0.3)
            assert not any(w.done() for w in waiting)
            t0 = time.monotonic()
            if how == "peer_closes":
                await tgt.close()
            elif how == "peer_lost":
                ini._connector.channels[tgt.name].lose(transport.PeerLostError("cut by the test"))
            else:
                await asyncio.wait_for(ini.close(), 5)
            done, _ = await asyncio.wait(waiting, timeout=5)
            assert len(done) == 2 and time.monotonic() - t0 < 3.0
            for w in waiting:
                assert isinstance(w.exception(), transport.TransportError), w.exception()
                assert not isinstance(w.exception(), transport.TransportTimeoutError), w.exception()
    finally:
        await ini.close()
        await tgt.close()


async def test_the_flight_recorder_does_not_blame_credits_for_a_put_that_had_its_credit(store_url, uname, tmp_path,
                                                                                        capsys):
    """Window 1 at the target (a process, cuda_ipc with MemfdIpcEngine): a put with a notification
    waits for a credit (its record is marked ``awaiting_credit``), gets it 0.3 s later when the
    target takes the one it held, then its copy (3 s, copy_delay) outlives its 2 s deadline. The
    analysis must not say it "never sent it ... waited for a notification credit": the credit came
    (``credited``); the copy stalled. Failed before: fr_explain checked only the mark and no "sent"."""
    import functools

    from tests._remote import RemoteEndpoint
    from transport.fr_analyze import main
    from transport.planes.cuda_ipc_memfd import MemfdIpcEngine

    tgt = RemoteEndpoint(uname("ipc-tgt"), store=store_url, max_pending_notifications=1,
                         engines={"cuda_ipc": MemfdIpcEngine})
    try:
        await asyncio.to_thread(tgt.call, "register", "w", "float32", (256,))
        slow = functools.partial(MemfdIpcEngine, copy_delay=3.0)
        async with asyncio.timeout(60):
            async with transport.Endpoint(uname("ipc-ini"), store=store_url, timeout=30,
                                          engines={"cuda_ipc": slow}) as ini:
                await ini.connect(tgt.name)
                await ini.notify(tgt.name, b"held")
                put = asyncio.ensure_future(ini.put(tgt.name, {"w": torch.ones(256)}, notify=b"p", timeout=2.0))
                await asyncio.sleep(0.3)
                assert [p for _, p in await asyncio.to_thread(tgt.call, "notifications", 1, 5.0)] == [b"held"]
                with pytest.raises(transport.TransportTimeoutError) as err:
                    await put
                assert "waited for a notification credit" not in str(err.value)  # (the error gets it right)
                apath = ini.dump_flight_recorder(tmp_path / "a.json")
                bpath = await asyncio.to_thread(tgt.call, "dump", str(tmp_path / "b.json"))
    finally:
        tgt.stop()
    capsys.readouterr()
    main([str(apath), str(bpath)])
    out = capsys.readouterr().out
    assert "STALLED: put" in out, out
    assert "waited for a notification credit" not in out, out


async def test_nothing_overtakes_a_parked_post_on_shm(store_url, uname):
    """Held. shm, window 1, nothing taken: p0 goes out, p1 parks. put_now (one-sided, no message),
    post_nowait, a one-sided put and a get all stay behind p1: put_now and post_nowait refuse, the
    put and the get wait; once the target takes p0, p1 goes out, then the put lands."""
    async with asyncio.timeout(30):
        async with transport.Endpoint(uname("tgt"), store=store_url, planes=("shm",), max_pending_notifications=1) as tgt:
            w = torch.zeros(1024)
            tgt.register("w", w)
            async with transport.Endpoint(uname("ini"), store=store_url, planes=("shm",), timeout=10) as ini:
                await ini.put(tgt.name, {"w": torch.zeros(1024)})  # (maps the segment: later puts are one-sided)
                await ini.post(tgt.name, b"p0")
                await ini.post(tgt.name, b"p1")
                assert not ini.put_now(tgt.name, {"w": torch.ones(1024)}), "put_now overtook a parked post"
                assert not ini.post_nowait(tgt.name, b"x")
                put = asyncio.ensure_future(ini.put(tgt.name, {"w": torch.full((1024,), 2.0)}))
                get = asyncio.ensure_future(ini.get(tgt.name, {"w": torch.empty(1024)}))
                await asyncio.sleep(0.3)
                assert not put.done() and not get.done() and float(w[0]) == 0.0, "an op overtook a parked post"
                assert await _payloads(tgt, 2) == [b"p0", b"p1"]
                await asyncio.wait_for(asyncio.gather(put, get), 5)
                assert float(w[0]) == 2.0


async def test_a_window_too_large_for_the_wire_is_refused_at_construction_not_at_every_handshake(store_url, uname):
    """max_pending_notifications=2**64 is refused (ValueError) when the endpoint is made. Failed
    before: it passed the constructor's check, but the Hello carrying it cannot be encoded (msgpack
    ints stop at 2**64 - 1), so every connect to or from that endpoint failed in the handshake."""
    try:
        ep = transport.Endpoint(uname("big"), store=store_url, planes=("tcp",), timeout=3,
                                max_pending_notifications=2**64)
    except ValueError:
        return
    async with asyncio.timeout(30):
        async with ep:
            async with transport.Endpoint(uname("other"), store=store_url, planes=("tcp",), timeout=3) as other:
                await other.notify(ep.name, b"hi")
                assert (await ep.next_notification(timeout=5)).payload == b"hi"


async def test_a_put_retried_after_a_stale_export_spends_one_credit(store_url, uname):
    """Held. shm, window 1: the target re-registers the buffer while our registry copy still names
    the old export; each put with a notification is refused (stale, its credit refunded), retried
    after a registry sync and delivered once; 5 rounds in a row with a window of 1 (a leak of one
    credit would stall the next round)."""
    async with asyncio.timeout(60):
        async with transport.Endpoint(uname("tgt"), store=store_url, planes=("shm",), max_pending_notifications=1) as tgt:
            tgt.register("w", torch.zeros(256))
            async with transport.Endpoint(uname("ini"), store=store_url, planes=("shm",), timeout=10) as ini:
                await ini.put(tgt.name, {"w": torch.zeros(256)})
                ch = ini._connector.channels[tgt.name]
                for r in range(5):
                    real = ch.take_registry
                    missed = threading.Event()

                    def miss(msg, missed=missed) -> None:  # (our reader misses the update once)
                        missed.set()

                    ch.take_registry = miss
                    tgt.unregister("w")
                    fresh = torch.zeros(256)
                    tgt.register("w", fresh)
                    assert await asyncio.to_thread(missed.wait, 10), "the registry update never came"
                    ch.take_registry = real
                    await asyncio.wait_for(ini.put(tgt.name, {"w": torch.full((256,), float(r + 1))},
                                                   notify=b"r%d" % r), 5)
                    assert await _payloads(tgt, 1, 5) == [b"r%d" % r]
                    assert float(fresh[0]) == r + 1
                stale = [x for x in ini.recorder.snapshot() if x["kind"] == "put" and x["state"] == "failed"]
                assert len(stale) == 5, [x["error"] for x in stale]
