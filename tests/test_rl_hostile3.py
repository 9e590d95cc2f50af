"""rl_sync's publisher against a third hostile pass: relays frozen or killed with several subscribers
depending on them, a raw endpoint posing as a subscriber with hostile and out-of-order replies, a
generator that makes a new model on its endpoint, pushes cancelled at random times back to back, odd
timeouts, bucket sizes and versions, two publishers on one endpoint, tied / empty / strided / view
trainer tensors, and dtype casts.

Most cases run their subscribers in this process (their own endpoints, on this loop): cheap, and
the publisher does not know. The relay cases use real processes (SIGSTOP, SIGKILL). Every wait is
bounded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import random
import signal
import time

import pytest
import torch

import rl_sync
import transport
from rl_sync import messages as m
from rl_sync.plan import MANIFEST_BUFFER, arena_name, build_manifest, encode_manifest, host_key
from tests._remote import RemoteEndpoint, until
from tests._rl_remote import seeded

SPEC = {"a": ("float32", (64, 64)), "b": ("float32", (4096,)), "c": ("float32", (3, 5))}


def stamped(version: int, spec=SPEC) -> dict[str, torch.Tensor]:
    return {n: torch.full(sh, float(version), dtype=getattr(torch, dt)) for n, (dt, sh) in spec.items()}


def holds(model: dict[str, torch.Tensor], version: int) -> bool:
    return all(bool((t == version).all()) for t in model.values() if t.numel())


@contextlib.asynccontextmanager
async def endpoints(store_url, uname, n, **kw):
    """``n`` open endpoints in this process: the trainer's first, then the generators'."""
    async with contextlib.AsyncExitStack() as stack:
        eps = [await stack.enter_async_context(transport.Endpoint(uname("trainer" if i == 0 else f"gen{i}"),
                                                                  store=store_url, timeout=20, **kw))
               for i in range(n)]
        yield eps


def subscribe(eps, spec=SPEC, **kw):
    """A WeightSubscriber on each endpoint, over a zeroed model; returns [(sub, model)]."""
    out = []
    for ep in eps:
        model = {n: torch.zeros(sh, dtype=getattr(torch, dt)) for n, (dt, sh) in spec.items()}
        out.append((rl_sync.WeightSubscriber(ep, model, **kw), model))
    return out


class Fake:
    """A raw endpoint posing as a subscriber: it registers a real manifest (and its arenas, so that it
    can be a relay), and answers each message with what ``script(msg)`` returns (replies to post)."""

    def __init__(self, ep: transport.Endpoint, spec=SPEC, script=None) -> None:
        self.ep = ep
        model = {n: torch.zeros(sh, dtype=getattr(torch, dt)) for n, (dt, sh) in spec.items()}
        self.manifest = build_manifest(model, 1 << 30, host_key())
        for bank in (0, 1):
            for i, size in enumerate(self.manifest.arenas):
                ep.new_buffer(arena_name(bank, i), (size,))
        ep.register(MANIFEST_BUFFER, torch.frombuffer(bytearray(encode_manifest(self.manifest)), dtype=torch.uint8))
        self.got: list[m.Message] = []
        self.script = script or (lambda msg: [])
        ep.on_notification(self._on, prefix=m.TO_SUBSCRIBER)

    def _on(self, note: transport.Notification) -> None:
        msg = m.decode(note.payload)
        self.got.append(msg)
        for reply in self.script(msg):
            payload = reply if isinstance(reply, bytes) else m.encode(reply)
            asyncio.ensure_future(self.ep.post(note.peer, payload))


# ---------------------------------------------------------------------------- a generator's new model
async def _new_manifests_seen(ep, pub, gens) -> None:
    """Wait (bounded) until the trainer's copy of each generator's registry names a manifest other
    than the one ``pub`` planned from: the registry update travels on its own (the trainer's reader
    thread applies it), and a push before it would still find the old plan (PlanMismatchError)."""
    def seen() -> bool:
        return all((peer := ep.peer(g.name)) is not None
                   and peer.buffers.get(MANIFEST_BUFFER) is not pub._layouts[g.name].spec for g in gens)
    await until(seen, 10, "the new manifests reach the trainer")


async def test_a_generator_that_makes_a_new_model_on_its_endpoint_is_planned_again(store_url, uname):
    """A generator that drops its WeightSubscriber and makes another, over another model, on the same
    endpoint (same incarnation: a model reload without a process restart) registers a new manifest. The
    publisher must read it, not push the old plan forever (every push raised PlanMismatchError)."""
    async with endpoints(store_url, uname, 3) as (ep, g0, g1):
        (s0, _), (s1, m1) = subscribe([g0, g1])
        pub = rl_sync.WeightPublisher(ep, [g0.name, g1.name])
        assert (await pub.push(stamped(1), 1, timeout=10)).ok
        s1.close()
        bigger = {**SPEC, "a": ("float32", (128, 64)), "d": ("float32", (7,))}
        (s1b, m1b), = subscribe([g1], spec=bigger)
        s0.close()  # g0 too, with the same tensors and another arena size: same names and shapes, new plan hash
        (s0b, m0b), = subscribe([g0], spec=bigger, arena_bytes=4096)
        await _new_manifests_seen(ep, pub, [g0, g1])
        for v in (2, 3):
            report = await pub.push(stamped(v, bigger), v, timeout=10)
            assert report.ok, report.summary()
            assert holds(m1b, v) and holds(m0b, v) and s1b.version == v and s0b.version == v
        assert holds(m1, 1), "the dropped subscriber's model must be left alone"


async def test_a_generator_that_switches_to_shared_mode_on_its_endpoint_is_planned_again(store_url, uname):
    """Same tensors, same arenas, so the same plan hash: only the manifest's ``shared`` flag differs.
    The publisher must map the bank for it, not send it slot pulls it cannot serve."""
    async with endpoints(store_url, uname, 2) as (ep, g0):
        (s0, _), = subscribe([g0])
        pub = rl_sync.WeightPublisher(ep, [g0.name])
        assert (await pub.push(stamped(1), 1, timeout=10)).ok
        s0.close()
        (s0b, m0b), = subscribe([g0], mode="shared")
        await _new_manifests_seen(ep, pub, [g0])
        for v in (2, 3):
            report = await pub.push(stamped(v), v, timeout=10)
            assert report.ok, report.summary()
            assert report.results[g0.name].plane == "shared"
            async with s0b.hold() as held:
                assert held == v and holds(m0b, v)
        s0b.close()


# ---------------------------------------------------------------------------- timeouts, versions, sizes, names
async def test_a_push_timeout_that_is_nan_zero_or_negative_is_refused_and_a_tiny_one_ends_at_once(store_url, uname):
    """A NaN deadline is never reached: a subscriber that stays connected but never answers held the push
    for ever (``push(timeout=nan)`` never returned). Refused like transport's ``timeout=``; so are 0,
    negative and versions no message can carry (2**64); a tiny timeout ends the push at once."""
    async with endpoints(store_url, uname, 3) as (ep, g0, fake_ep):
        (s0, m0), = subscribe([g0])
        Fake(fake_ep)  # answers nothing, ever (its endpoint's heartbeats keep its channel up)
        pub = rl_sync.WeightPublisher(ep, [g0.name, fake_ep.name])
        report = await asyncio.wait_for(pub.push(stamped(1), 1, timeout=1.0), 10)
        assert report.results[g0.name].ok and not report.results[fake_ep.name].ok
        for bad in (float("nan"), 0, 0.0, -1.0, float("-inf")):
            with pytest.raises(ValueError, match="timeout"):
                await asyncio.wait_for(pub.push(stamped(2), 2, timeout=bad), 5)
        with pytest.raises(ValueError, match="version"):
            await asyncio.wait_for(pub.push(stamped(2), 1 << 64, timeout=1.0), 5)
        t0 = time.monotonic()
        report = await asyncio.wait_for(pub.push(stamped(2), 2, timeout=1e-9), 5)
        assert time.monotonic() - t0 < 1.0 and not report.ok
        assert s0.version in (1, 2) and holds(m0, s0.version)
        report = await asyncio.wait_for(pub.push(stamped(3), (1 << 64) - 1, timeout=2.0), 10)
        assert report.results[g0.name].ok and s0.version == (1 << 64) - 1 and holds(m0, 3)
        with pytest.raises(rl_sync.StaleVersionError):
            await pub.push(stamped(4), (1 << 64) - 2, timeout=2.0)


async def test_subscriber_lists_with_the_publisher_itself_or_duplicates(store_url, uname):
    async with endpoints(store_url, uname, 2) as (ep, g0):
        (s0, m0), = subscribe([g0])
        with pytest.raises(ValueError):
            rl_sync.WeightPublisher(ep, [g0.name, ep.name])
        for bad in ("", None, 3):
            with pytest.raises(ValueError):
                rl_sync.WeightPublisher(ep, [bad])
        pub = rl_sync.WeightPublisher(ep, [g0.name, g0.name])
        pub.add_subscriber(g0.name)
        assert pub.subscribers == [g0.name]
        report = await pub.push(stamped(1), 1, timeout=10)
        assert report.ok and list(report.results) == [g0.name] and holds(m0, 1)


@pytest.mark.parametrize("bucket_bytes", [64, 100, 4096 + 64, 1 << 62])
async def test_bucket_bytes_extremes_deliver_every_byte(store_url, uname, bucket_bytes):
    """64-byte buckets (a tensor split across hundreds), a size that is no multiple of 64, and one
    larger than any memory: exact bytes in every mode, the send slots no larger than the largest bucket."""
    spec = {"a": ("float32", (40, 33)), "e": ("float32", (0,)), "s": ("float64", ()), "i": ("int16", (17,))}
    async with endpoints(store_url, uname, 4) as (ep, *gens):
        subs = [subscribe([g], spec=spec, mode=mode)[0] for g, mode in zip(gens, ("staged", "swap", "direct"),
                                                                             strict=True)]
        pub = rl_sync.WeightPublisher(ep, [g.name for g in gens], bucket_bytes=bucket_bytes, fanout="chain")
        for v in (1, 2):
            want = seeded(spec, v)
            report = await asyncio.wait_for(pub.push(want, v, timeout=20), 30)
            assert report.ok, report.summary()
            for _, model in subs:
                for n, t in want.items():
                    assert torch.equal(model[n], t), n
        for _, tensors in pub._slots.values():
            assert tensors[0].numel() <= max(bucket_bytes // 64 * 64, 64 * -(-40 * 33 * 4 // 64))


# ---------------------------------------------------------------------------- hostile and out-of-order replies
async def test_hostile_and_out_of_order_replies_never_count_as_progress(store_url, uname):
    """A raw endpoint posing as a subscriber answers the Begin, then sends what no subscriber should:
    a commit reply it was never asked for, replies of another push, pulls of buckets it was never told
    to pull (of attempts never sent, of a bucket out of range), a second Begin answer, an unknown stage
    and bytes that do not decode. None of it is progress: its entry fails at the deadline with stage
    'transfer', the publisher's version stays, the real subscriber commits at once, and the next push
    reaches it."""
    sent: list[m.Reply] = []

    def script(msg):
        if isinstance(msg, m.Begin):
            out = [m.Reply(msg.push_id, "begin", version=0),
                   m.Reply(msg.push_id, "commit", version=msg.version),  # never told to commit
                   m.Reply(msg.push_id + 1, "commit", version=msg.version),  # another push's
                   m.Reply(msg.push_id, "pull", bucket=5, attempt=1),  # a bucket out of range
                   m.Reply(msg.push_id, "begin", error="late refusal", error_kind="plan"),
                   m.Reply(msg.push_id, "done"),
                   m.TO_PUBLISHER + b"\xc1garbage"]
            sent.extend(r for r in out if isinstance(r, m.Reply))
            return out
        if isinstance(msg, m.Pull):  # answered with the wrong attempt, twice
            return [m.Reply(msg.push_id, "pull", bucket=msg.bucket, attempt=msg.attempt + 7)] * 2
        return []

    async with endpoints(store_url, uname, 3) as (ep, g0, fake_ep):
        (s0, m0), = subscribe([g0])
        fake = Fake(fake_ep, script=script)
        pub = rl_sync.WeightPublisher(ep, [g0.name, fake_ep.name], bucket_bytes=1 << 20)
        t0 = time.monotonic()
        report = await asyncio.wait_for(pub.push(stamped(1), 1, timeout=2.0), 10)
        took = time.monotonic() - t0
        assert report.results[g0.name].ok and holds(m0, 1)
        r = report.results[fake_ep.name]
        assert not r.ok and r.stage == "transfer" and isinstance(r.error, transport.TransportTimeoutError), r
        assert r.bytes == 0 and took < 4.0
        assert pub.version == 1  # (g0 committed; the fake's claim of a commit it was never told of counts for nothing)
        end = time.monotonic() + 3  # (the Abort is posted as the push ends, not waited for)
        while not any(isinstance(x, m.Abort) for x in fake.got):
            assert time.monotonic() < end, "the fake is owed an Abort"
            await asyncio.sleep(0.02)
        assert not any(isinstance(x, m.Commit) for x in fake.got)
        # the fake alone this time: a claimed commit must not move the publisher's version
        pub.remove_subscriber(g0.name)
        report = await asyncio.wait_for(pub.push(stamped(2), 2, timeout=1.0), 10)
        assert not report.ok and pub.version == 1, report.summary()
        pub.add_subscriber(g0.name)
        pub.remove_subscriber(fake_ep.name)
        report = await asyncio.wait_for(pub.push(stamped(2), 2, timeout=10), 15)
        assert report.ok and holds(m0, 2)


# ---------------------------------------------------------------------------- cancellations, two publishers
async def test_pushes_cancelled_at_random_times_back_to_back(store_url, uname):
    """40 pushes through a relay chain of a staged, a swap and a direct subscriber, each cancelled at a
    random moment (or not at all), the next one started at once: no subscriber ever holds a mix of two
    versions or goes back, a version told to commit is never pushed again, and the last push reaches all."""
    rng = random.Random(3)
    big = {"a": ("float32", (256, 256)), "b": ("float32", (4096,))}
    async with endpoints(store_url, uname, 4) as (ep, *gens):
        subs = [subscribe([g], spec=big, mode=mode)[0] for g, mode in zip(gens, ("staged", "swap", "direct"),
                                                                          strict=True)]
        pub = rl_sync.WeightPublisher(ep, [g.name for g in gens], bucket_bytes=64 << 10, fanout="chain")
        seen = [0] * len(subs)
        v = 0
        cancelled = 0
        for _ in range(40):
            v = pub.version + 1 if rng.random() < 0.5 else max(v, pub.version) + 1
            push = asyncio.ensure_future(pub.push(stamped(v, big), v, timeout=10))
            await asyncio.sleep(rng.choice([0, 0, 0.0005, 0.002, 0.005, 0.01, 0.03, 1.0]))
            if not push.done():
                push.cancel()
                cancelled += 1
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(push, 15)
            for i, (sub, model) in enumerate(subs):
                if sub.mode == "direct" and sub.torn:
                    continue  # (direct mode's weights are torn until the next push: its documented cost)
                async with sub.hold(timeout=10) as held:
                    assert held >= seen[i], f"{sub.mode} went back from {seen[i]} to {held}"
                    assert holds(model, held), f"{sub.mode} holds version {held} but not exactly its bytes"
                    seen[i] = held
            assert pub.version >= max(seen)
        v = pub.version + 1
        report = await asyncio.wait_for(pub.push(stamped(v, big), v, timeout=10), 15)
        assert report.ok, report.summary()
        assert all(holds(model, v) and sub.version == v for sub, model in subs)
        assert cancelled >= 10


async def test_two_publishers_on_one_endpoint_pushing_to_one_subscriber_at_once(store_url, uname):
    """Two publishers of one trainer endpoint push different weights to the same generator at the same
    time: replies reach the right push (the other subscriber of one of them commits at once), the
    generator never goes back, holds exactly the bytes of the version it reports, and each push ends
    by its timeout."""
    async with endpoints(store_url, uname, 3) as (ep, g0, g1):
        (s0, m0), (s1, m1) = subscribe([g0, g1])
        pa = rl_sync.WeightPublisher(ep, [g0.name, g1.name], bucket_bytes=4096)
        pb = rl_sync.WeightPublisher(ep, [g1.name], bucket_bytes=8192)
        last = 0
        for k in range(1, 4):
            va, vb = 2 * k, 2 * k + 1
            t0 = time.monotonic()
            ra, rb = await asyncio.wait_for(asyncio.gather(pa.push(stamped(va), va, timeout=2.0),
                                                           pb.push(stamped(vb), vb, timeout=2.0)), 10)
            assert time.monotonic() - t0 < 4.5
            # (g0 is not held up by the contention at g1, which can last to the 2 s deadline)
            assert ra.results[g0.name].ok and holds(m0, va) and ra.results[g0.name].seconds < 1.0
            async with s1.hold() as held:
                assert held >= last and holds(m1, held), (held, last)
                last = held
            assert ra.results[g1.name].ok or rb.results[g1.name].ok, (ra.summary(), rb.summary())
        pa.close()
        report = await pb.push(stamped(99), 99, timeout=5)
        assert report.ok and holds(m1, 99)


async def test_a_push_superseded_by_another_publisher_s_fails_its_entry_promptly(store_url, uname):
    """Two publishers push to one generator at once: the later Begin supersedes the earlier push
    there, and the subscriber tells that push's publisher (a "dropped" reply), whose entry fails at
    once instead of at its 3 s deadline (it waited for the deadline before). If the later push commits
    before the earlier one's Begin arrives, that Begin is refused as stale instead: also prompt."""
    async with endpoints(store_url, uname, 2) as (ep, g1):
        (s1, m1), = subscribe([g1])
        pa = rl_sync.WeightPublisher(ep, [g1.name], bucket_bytes=4096)
        pb = rl_sync.WeightPublisher(ep, [g1.name], bucket_bytes=8192)
        ra, rb = await asyncio.wait_for(asyncio.gather(pa.push(stamped(2), 2, timeout=3.0),
                                                       pb.push(stamped(3), 3, timeout=3.0)), 10)
        results = [*ra.results.values(), *rb.results.values()]
        assert max(r.seconds for r in results) < 2.0, (ra.summary(), rb.summary())
        assert any(r.ok for r in results), (ra.summary(), rb.summary())
        for r in results:
            assert (r.ok or "dropped the push: superseded" in str(r.error)
                    or isinstance(r.error, rl_sync.StaleVersionError)), (ra.summary(), rb.summary())


# ---------------------------------------------------------------------------- the trainer's tensors
def odd_trainer_tensors(v: int) -> dict[str, torch.Tensor]:
    """Tied, empty, 0-d, transposed, expanded (stride 0), sliced and conjugate-free views, one larger
    than a bucket and strided; each filled so that its bytes say ``v`` and its position."""
    base = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48) + 1000 * v
    tied = torch.arange(300, dtype=torch.float32) * v
    return {
        "emb": tied, "head": tied,  # tied: one tensor under two names
        "empty": torch.zeros(0, 5), "zero_d": torch.tensor(float(v)),
        "t": base.t(),  # non-contiguous (48, 64)
        "rows": base[3:9],  # a contiguous view at an offset
        "cols": base[:, 5:7],  # a strided view
        "every_other": base.reshape(-1)[::2],  # strided, larger than a bucket: split across buckets
        "bcast": torch.tensor([float(v)]).expand(33),  # stride 0
        "ints": torch.arange(10, dtype=torch.int64) * v,
    }


@pytest.mark.parametrize("live", [False, True])
@pytest.mark.parametrize("mode", ["staged", "swap", "direct", "shared"])
async def test_tied_empty_strided_and_view_tensors_of_the_trainer_arrive_exactly(store_url, uname, mode, live):
    spec = {n: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in odd_trainer_tensors(1).items()}
    async with endpoints(store_url, uname, 3) as (ep, *gens):
        subs = [subscribe([g], spec=spec, mode=mode)[0] for g in gens]
        pub = rl_sync.WeightPublisher(ep, [g.name for g in gens], bucket_bytes=4096, fanout="chain", live=live)
        for v in (1, 2, 3):
            want = odd_trainer_tensors(v)
            before = {n: t.clone() for n, t in want.items()}
            report = await asyncio.wait_for(pub.push(want, v, timeout=20), 30)
            assert report.ok, report.summary()
            for sub, model in subs:
                async with sub.hold() as held:
                    assert held == v
                    for n, t in want.items():
                        assert torch.equal(model[n], t), (mode, n)
            for n, t in want.items():  # the trainer's tensors are read, never written
                assert torch.equal(t, before[n]), n
        pub.close()
        for sub, _ in subs:
            sub.close()


# ---------------------------------------------------------------------------- dtype casts
FLOATS = ["float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2"]


async def test_every_floating_point_cast_arrives_as_torch_casts_it_and_the_rest_is_refused(store_url, uname):
    """dtype='auto': each of 36 trainer/generator floating-point pairs arrives as ``src.to(dst)``, bit for
    bit; integers and bools go as they are. Casts that would change what a value is (int <-> float, bool,
    complex) are refused before any byte moves, listing every one, and the generator keeps its version."""
    pairs = [(a, b) for a in FLOATS for b in FLOATS]
    gen_spec = {f"{a}->{b}": (b, (5, 7)) for a, b in pairs} | {"i": ("int32", (4,)), "flag": ("bool", (3,))}

    def train(v):
        out = {f"{a}->{b}": (torch.randn(5, 7, generator=torch.Generator().manual_seed(v + i)) * 30).to(
            getattr(torch, a)) for i, (a, b) in enumerate(pairs)}
        return out | {"i": torch.arange(4, dtype=torch.int32) * v, "flag": torch.tensor([True, False, v % 2 == 0])}

    async with endpoints(store_url, uname, 2) as (ep, g0):
        (s0, m0), = subscribe([g0], spec=gen_spec)
        pub = rl_sync.WeightPublisher(ep, [g0.name], dtype="auto", bucket_bytes=1024)
        for v in (1, 2):
            want = train(v)
            assert (await pub.push(want, v, timeout=10)).ok
            for n, t in want.items():
                expect = t.to(m0[n].dtype)
                assert m0[n].dtype == getattr(torch, gen_spec[n][0])
                assert torch.equal(m0[n].view(torch.uint8), expect.view(torch.uint8)), n
        bad = train(3) | {"i": torch.zeros(4, dtype=torch.float32), "flag": torch.zeros(3, dtype=torch.int8),
                          "float32->float16": torch.zeros(5, 7, dtype=torch.complex64)}
        for dtype in ("auto", torch.float16, None):
            p = rl_sync.WeightPublisher(ep, [g0.name], dtype=dtype)
            with pytest.raises(rl_sync.PlanMismatchError) as err:
                await p.push(bad, 3, timeout=10)
            text = str(err.value)
            assert "'i'" in text and "'flag'" in text and "'float32->float16'" in text, text
            p.close()
        assert s0.version == 2 and torch.equal(m0["i"], torch.arange(4, dtype=torch.int32) * 2)
    for dtype in (torch.int32, torch.complex64, torch.bool, "bfloat16", "float32"):
        with pytest.raises(TypeError):
            rl_sync.WeightPublisher(ep, ["x"], dtype=dtype)


# ---------------------------------------------------------------------------- a relay with dependents, frozen or killed
RELAYED = {f"w{i}": ("float32", (256, 1024)) for i in range(8)}  # 8 MiB in 8 buckets of 1 MiB


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["staged", "direct"])
async def test_a_relay_frozen_then_killed_mid_transfer_holds_up_none_of_its_three_dependents(store_url, uname, mode):
    """fanout='auto' over tcp (as between hosts): one leader pulls from the trainer and three generators
    relay from it. The leader frozen after its first bucket: the three pull from the trainer and commit
    within a second (the push's timeout is 4 s), the leader fails 'transfer' at the deadline and keeps
    its version; let go, the next push reaches all four. Then the leader killed mid-transfer: the three
    commit at once, the leader's entry is PeerLostError, and its restart gets the next push."""
    kw = {"store": store_url, "timeout": 20, "heartbeat_timeout": 10.0, "planes": ("tcp",)}

    def spawn(name):
        g = RemoteEndpoint(name, **kw)
        g.call("sub_create", RELAYED, {"mode": mode})
        return g

    names = sorted(uname(f"gen{i}") for i in range(4))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        gens = list(pool.map(spawn, names))
    armed: list = []

    def observer(ev):
        if armed and ev.subscriber == names[0] and ev.kind == "pulled" and ev.have >= 1:
            pid, sig = armed.pop()
            import os
            os.kill(pid, sig)

    try:
        async with transport.Endpoint(uname("trainer"), store=store_url, timeout=20, planes=("tcp",)) as ep:
            pub = rl_sync.WeightPublisher(ep, names, bucket_bytes=1 << 20, observer=observer)
            report = await pub.push(seeded(RELAYED, 1), 1, timeout=30)
            assert report.ok, report.summary()
            sources = [report.results[n].source for n in names]
            # the relay plan: the leader pulls from the trainer, the three from it; on a loaded machine a first
            # push may send them to the trainer instead when the leader's Begin answer comes late (by design)
            assert sources[0] == ep.name and sources[1:] in ([names[0]] * 3, [ep.name] * 3), sources
            normal = max(r.seconds for r in report.results.values())
            for v, sig in ((2, signal.SIGSTOP), (4, signal.SIGKILL)):
                armed.append((gens[0].proc.pid, sig))
                weights = seeded(RELAYED, v)
                t0 = time.monotonic()
                report = await asyncio.wait_for(pub.push(weights, v, timeout=4.0), 20)
                took = time.monotonic() - t0
                assert not armed, "the trap did not fire"
                lead = report.results[names[0]]
                assert not lead.ok and lead.stage == "transfer", report.summary()
                want = transport.TransportTimeoutError if sig == signal.SIGSTOP else transport.PeerLostError
                assert isinstance(lead.error, want), report.summary()
                for n in names[1:]:
                    r = report.results[n]
                    assert r.ok and r.seconds < 2 * normal + 1.0, (n, normal, report.summary())
                assert took < (5.0 if sig == signal.SIGSTOP else 3.0), took
                for g in gens[1:]:
                    assert all(g.call("sub_check", RELAYED, v).values())
                if sig == signal.SIGSTOP:
                    gens[0].signal(signal.SIGCONT)
                    await asyncio.sleep(0.2)
                    assert gens[0].call("sub_version") == 1 or mode == "direct"
                    report = await pub.push(seeded(RELAYED, 3), 3, timeout=30)
                    assert report.ok, report.summary()
                    for g in gens:
                        assert all(g.call("sub_check", RELAYED, 3).values())
                else:
                    gens[0].kill()
                    gens[0] = spawn(names[0])
                    report = await pub.push(seeded(RELAYED, 5), 5, timeout=30)
                    assert report.ok, report.summary()
                    for g in gens:
                        assert all(g.call("sub_check", RELAYED, 5).values())
    finally:
        for g in gens:
            g.kill()
