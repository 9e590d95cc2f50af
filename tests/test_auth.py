"""Only the job's peers get in: a peer proves it holds the job's secret in the handshake, before
anything else it sends is read (transport.auth). Real endpoints, real sockets, a real spawned
process for the cross-process cases; the hostile side is a raw socket (tests/_wire_peer.py)."""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from datetime import timedelta

import msgspec
import pytest
import torch
from torch.distributed import TCPStore

import transport
from tests import _wire_peer as peer
from tests._remote import RemoteEndpoint
from transport import auth, wire
from transport.hostinfo import local_host
from transport.rendezvous import EndpointRecord, parse_store_url


def _store_get(url: str, key: str) -> bytes | None:
    host, port = parse_store_url(url)
    st = TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))
    return st.get(key) if st.check([key]) else None


def _publish(url: str, name: str, address: tuple[str, int]) -> None:
    """Put a record for ``name`` pointing at ``address`` in the store (what anyone who can reach
    the store can do)."""
    host, port = parse_store_url(url)
    st = TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))
    rec = EndpointRecord(name, address[0], address[1], 4321, local_host())
    st.set("transport/v1/endpoint/" + name, msgspec.json.encode(rec))


@pytest.fixture
def target(store_url, tmp_path):
    with transport.BlockingEndpoint(f"auth-tgt-{uuid.uuid4().hex[:6]}", store=store_url, timeout=5,
                                    dump_dir=tmp_path) as ep:
        ep.register("w", torch.zeros(16))
        yield ep


def _untouched(ep: transport.BlockingEndpoint) -> bool:
    return bool((ep._ep._registry.get("w").tensor == 0).all())


def _put_frames(value: float = 7.0) -> bytes:
    """A Hello then a tcp put of 16 floats into 'w', then a Ping: what an intruder would like processed."""
    return (wire.encode_frame(peer.hello()) + wire.encode_frame(wire.Put(1, 1, "tcp", [wire.Item("w", "float32", 0, 16)]))
            + torch.full((16,), value).numpy().tobytes() + wire.encode_frame(wire.Ping()))


async def test_the_default_secret_is_drawn_once_in_the_store_and_shared(uname, monkeypatch):
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    async with transport.Endpoint(uname("host"), store="tcp://127.0.0.1:0", host_store=True, timeout=10) as host:
        async with transport.Endpoint(uname("b"), store=host.store_url, timeout=10) as b:
            stored = _store_get(host.store_url, auth.STORE_KEY)
            assert stored and len(stored) == 64
            assert host._secret == b._secret == stored
            assert host.secret_source == b.secret_source == "store"
            b.register("w", torch.zeros(4))
            await host.put(b.name, {"w": torch.ones(4)})
            assert b.buffers["w"].nbytes == 16


async def test_an_explicit_or_env_secret_is_never_written_to_the_store(uname, monkeypatch):
    monkeypatch.setenv(auth.SECRET_ENV, "from-the-environment")
    async with transport.Endpoint(uname("host"), store="tcp://127.0.0.1:0", host_store=True, timeout=10) as host:
        async with transport.Endpoint(uname("b"), store=host.store_url, timeout=10, secret=b"from-the-environment") as b:
            assert host.secret_source == auth.SECRET_ENV and b.secret_source == "argument"
            b.register("w", torch.zeros(4))
            await host.put(b.name, {"w": torch.ones(4)})
            assert _store_get(host.store_url, auth.STORE_KEY) is None


def test_bad_secret_arguments():
    for bad in ("", b"", 123):
        with pytest.raises(ValueError):
            transport.Endpoint("x", secret=bad)


def test_a_peer_with_another_secret_is_refused_both_ways(store_url, uname, caplog, monkeypatch):
    """A spawned process holding another secret cannot put into our buffer, nor we into its;
    both sides see a clear error, the acceptor logs the refusal. The right secret works."""
    caplog.set_level(logging.ERROR)
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    other = RemoteEndpoint(uname("other"), store=store_url, timeout=5, secret="the-other-jobs-secret")
    try:
        other.call("register", "w", "float32", [16])
        with transport.BlockingEndpoint(uname("us"), store=store_url, timeout=5) as us:  # the store's secret
            us.register("w", torch.zeros(16))
            with pytest.raises(transport.AuthenticationError, match="refused us"):
                us.put(other.name, {"w": torch.ones(16)})
            assert other.call("is_poisoned", "w")
            with pytest.raises(Exception, match="AuthenticationError"):
                other.call("put", us.name, {"w": ("float32", [16], 1)}, 5.0)
            assert bool((us._ep._registry.get("w").tensor == 0).all())
            # the acceptor logs once its handshake gives up, just after the refusal reaches the peer
            end = time.monotonic() + 5.0
            while not any("refused a connection" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < end, "the acceptor never logged the refusal"
                time.sleep(0.01)
            assert not us._ep._all  # no channel was adopted
        with transport.BlockingEndpoint(uname("friend"), store=store_url, timeout=5,
                                        secret="the-other-jobs-secret") as friend:
            friend.register("w", torch.zeros(16))
            other.call("put", friend.name, {"w": ("float32", [16], 1)}, 5.0)
            assert not bool((friend._ep._registry.get("w").tensor == 0).all())
    finally:
        other.stop()


def test_the_environment_secret_reaches_spawned_processes(store_url, uname, monkeypatch):
    monkeypatch.setenv(auth.SECRET_ENV, "shared-by-env-" + uuid.uuid4().hex)
    other = RemoteEndpoint(uname("env-other"), store=store_url, timeout=5)
    try:
        with transport.BlockingEndpoint(uname("env-us"), store=store_url, timeout=5) as us:
            assert us._ep.secret_source == auth.SECRET_ENV
            us.register("w", torch.zeros(16))
            other.call("put", us.name, {"w": ("float32", [16], 1)}, 5.0)
            assert not bool((us._ep._registry.get("w").tensor == 0).all())
    finally:
        other.stop()


def test_a_raw_socket_that_skips_the_proof_gets_nothing_processed(target, caplog):
    caplog.set_level(logging.ERROR)
    s = peer.dial(target.address)
    try:
        assert isinstance(peer.read_msg(s), wire.Challenge)
        try:
            s.sendall(_put_frames())
        except OSError:
            pass
        assert peer.closed_by_peer(s)
    finally:
        s.close()
    assert _untouched(target)
    assert any("refused a connection" in r.getMessage() and "without proving" in r.getMessage()
               for r in caplog.records)
    assert not target._ep._all


@pytest.mark.parametrize("how", ["wrong-secret", "random-mac", "no-nonce", "replayed"])
def test_a_wrong_proof_is_refused_with_a_bye(target, caplog, how):
    caplog.set_level(logging.ERROR)
    s = peer.dial(target.address)
    try:
        ch = peer.read_msg(s)
        assert isinstance(ch, wire.Challenge) and len(ch.nonce) == auth.NONCE_BYTES
        nonce = auth.new_nonce()
        if how == "wrong-secret":
            proof = wire.Proof(auth.prove(b"guess", "dialer", ch.nonce, nonce, *target.address), nonce)
        elif how == "random-mac":
            proof = wire.Proof(auth.new_nonce(), nonce)
        elif how == "no-nonce":
            proof = wire.Proof(auth.prove(target._ep._secret, "dialer", ch.nonce, b"", *target.address))
        else:  # a valid proof, for another connection's challenge
            proof = wire.Proof(auth.prove(target._ep._secret, "dialer", auth.new_nonce(), nonce, *target.address), nonce)
        s.sendall(wire.encode_frame(proof))
        bye = peer.read_msg(s)
        assert isinstance(bye, wire.Bye) and "not authenticated" in bye.reason
        try:
            s.sendall(_put_frames())
        except OSError:
            pass
        assert peer.closed_by_peer(s)
    finally:
        s.close()
    assert _untouched(target)
    assert any("refused a connection" in r.getMessage() and "did not prove" in r.getMessage() for r in caplog.records)


def test_the_right_proof_by_hand_gets_a_channel(target):
    """The control: the same raw peer with the right proof does write into the buffer."""
    s = peer.dial(target.address)
    try:
        remote = peer.authenticate(s, target._ep._secret, target.address)
        assert remote.name == target.name
        s.sendall(_put_frames(7.0))
        while not isinstance(msg := peer.read_msg(s), wire.Ack):
            assert isinstance(msg, (wire.Ping, wire.Registry)), msg
        assert bool((target._ep._registry.get("w").tensor == 7.0).all())
    finally:
        s.close()


class _Impostor:
    """A listening socket that answers a dialer like an endpoint without the secret would: a
    challenge, then a made-up proof, its Hello and a put into the dialer's 'w'."""

    def __init__(self) -> None:
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.lsock.settimeout(10)
        self.after_proof = b""
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return self.lsock.getsockname()[:2]

    def _run(self) -> None:
        try:
            s, _ = self.lsock.accept()
            with s:
                s.settimeout(10)
                s.sendall(wire.encode_frame(wire.Challenge(wire.PROTOCOL_VERSION, auth.new_nonce())))
                assert isinstance(peer.read_msg(s), wire.Proof)
                try:
                    s.sendall(wire.encode_frame(wire.Proof(auth.new_nonce())) + _put_frames(9.0))
                except OSError:
                    pass
                chunks = []
                try:
                    while data := s.recv(65536):
                        chunks.append(data)
                except OSError:
                    pass
                self.after_proof = b"".join(chunks)
        except BaseException as exc:  # reported by the test
            self.error = exc


def test_the_dialer_refuses_an_acceptor_without_the_secret(store_url, uname, caplog):
    """Someone who can write the store redirects a name to itself: the dialer checks the
    acceptor's proof before it sends its Hello, so the impostor learns nothing of our registry
    and its put is never read."""
    caplog.set_level(logging.ERROR)
    imp = _Impostor()
    name = uname("impostor")
    _publish(store_url, name, imp.address)
    with transport.BlockingEndpoint(uname("dialer"), store=store_url, timeout=5) as ep:
        ep.register("w", torch.zeros(16))
        with pytest.raises(transport.AuthenticationError, match="did not prove"):
            ep.connect(name)
        imp.thread.join(10)
        assert imp.error is None, imp.error
        assert imp.after_proof == b""  # no Hello (no registry), nothing at all after our proof
        assert bool((ep._ep._registry.get("w").tensor == 0).all())
        assert not ep._ep._all
    imp.lsock.close()


def test_a_relayed_proof_is_refused(store_url, uname, target, caplog):
    """A dialer's proof is bound to the address it dialled: a store writer that points a name at
    itself and relays the handshake to the real endpoint gets refused there."""
    caplog.set_level(logging.ERROR)
    lsock = socket.create_server(("127.0.0.1", 0))
    lsock.settimeout(10)
    name = uname("relay")
    _publish(store_url, name, lsock.getsockname()[:2])
    seen: list[object] = []

    def relay() -> None:
        a, _ = lsock.accept()
        b = peer.dial(target.address)
        with a, b:
            a.settimeout(10)
            a.sendall(wire.encode_frame(peer.read_msg(b)))  # the real challenge
            b.sendall(wire.encode_frame(peer.read_msg(a)))  # the dialer's proof, made for our address
            answer = peer.read_msg(b)
            seen.append(answer)
            a.sendall(wire.encode_frame(answer))
            if not isinstance(answer, wire.Bye):
                seen.append(peer.read_msg(b))

    t = threading.Thread(target=relay, daemon=True)
    t.start()
    with transport.BlockingEndpoint(uname("victim"), store=store_url, timeout=5) as ep:
        with pytest.raises(transport.AuthenticationError, match="refused us"):
            ep.connect(name)
    t.join(10)
    lsock.close()
    assert seen and isinstance(seen[0], wire.Bye), seen
    assert _untouched(target) and not any(ch.peer_name == ep.name for ch in target._ep._all)
    end = time.monotonic() + 5.0  # (the acceptor logs just after its refusal went out: wait for the record)
    while not any("refused a connection" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < end, "the acceptor never logged the refusal"
        time.sleep(0.01)
