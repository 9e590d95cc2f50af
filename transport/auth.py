"""Membership of the job: the secret a peer proves it holds before anything else it sends is read.

Where the secret comes from (the first that applies; 1. and 2. are read when the ``Endpoint`` is made,
3. at ``Endpoint.open()``):

1. ``Endpoint(..., secret=...)`` (str or bytes);
2. the ``TRANSPORT_SECRET`` environment variable (an empty one counts as unset);
3. the rendezvous store: the key ``transport/v1/secret``, drawn (32 random bytes, hex) by the
   first endpoint that opens on the store, normally the one that serves it
   (``host_store=True``), with an atomic ``compare_set``, and read by every other one. It is
   never written when the secret comes from 1. or 2.

Every process of a job must take its secret from the same place: a secret passed to some
endpoints only shuts them off from the others.

The proof (per connection, see :mod:`transport.wire` for the frames): the acceptor sends a
fresh 32-byte nonce; the dialer answers with its own nonce and
``HMAC-SHA256(secret, ("dialer", nonce_a, nonce_d, acceptor's host, port))``, where host and
port are the address the dialer took from the acceptor's store record (an acceptor checks it
against the address it published: a proof made for one endpoint is worth nothing to another,
so an endpoint that redirects a record to itself cannot relay the proof it receives); the
acceptor checks it (``hmac.compare_digest``) before it reads anything else from the
connection, and answers with ``HMAC(secret, ("acceptor", nonce_a, nonce_d, host, port))``,
which the dialer checks before it sends its ``Hello``. The secret itself never travels.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

import msgspec

from .wire import PROTOCOL_VERSION

__all__ = ["NONCE_BYTES", "SECRET_ENV", "STORE_KEY", "explicit_secret", "new_nonce", "new_secret", "prove", "verify"]

SECRET_ENV = "TRANSPORT_SECRET"
STORE_KEY = "transport/v1/secret"
NONCE_BYTES = 32
_LABEL = b"transport-rl membership proof"


def explicit_secret(arg: str | bytes | None) -> tuple[bytes | None, str]:
    """The secret given by the caller or the environment, and where it came from
    (``(None, "store")`` when neither gives one). ``ValueError`` for an empty or non-string one."""
    if arg is not None:
        if isinstance(arg, str):
            arg = arg.encode()
        if not isinstance(arg, (bytes, bytearray)) or not arg:
            raise ValueError("secret must be a non-empty str or bytes")
        return bytes(arg), "argument"
    env = os.environ.get(SECRET_ENV)
    if env:
        return env.encode(), SECRET_ENV
    return None, "store"


def new_secret() -> bytes:
    """A fresh job secret, as stored (64 hex characters)."""
    return secrets.token_hex(32).encode()


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def prove(secret: bytes, role: str, acceptor_nonce: bytes, dialer_nonce: bytes, host: str, port: int) -> bytes:
    """The MAC ``role`` (``"dialer"`` or ``"acceptor"``) sends on a connection to the acceptor
    published at ``host:port``."""
    transcript = msgspec.msgpack.encode([_LABEL, PROTOCOL_VERSION, role, acceptor_nonce, dialer_nonce, host, port])
    return hmac.new(secret, transcript, hashlib.sha256).digest()


def verify(secret: bytes, mac: bytes, role: str, acceptor_nonce: bytes, dialer_nonce: bytes, host: str,
           port: int) -> bool:
    """Whether ``mac`` is ``role``'s proof for these nonces and address (constant-time compare)."""
    return hmac.compare_digest(prove(secret, role, acceptor_nonce, dialer_nonce, host, port), mac)
