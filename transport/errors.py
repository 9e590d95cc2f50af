"""Exceptions raised by :mod:`transport`.

Every error derives from :class:`TransportError`. The subclass tells the
caller what to do next:

* :class:`UnknownBufferError`, :class:`BufferMismatchError`,
  :class:`InvalidTensorError`: fix the call; nothing moved and the endpoint
  is still usable.
* :class:`PeerNotFoundError`: the peer never appeared in the rendezvous store
  before the deadline; start it or check its name.
* :class:`PeerLostError`: the peer died or its connection broke; pending ops
  to it failed. The next call reconnects (a restarted peer has a new
  incarnation).
* :class:`TransportTimeoutError`: a deadline passed. It is also a
  :class:`TimeoutError`. ``phase`` names what was being waited for.
* :class:`EndpointClosedError`: the endpoint was closed; open a new one.
* :class:`ProtocolError`: a peer sent something malformed; its channel was
  closed.
* :class:`AuthenticationError` (a :class:`ProtocolError`): the peer did not
  prove it belongs to the job, or refused our proof (different secrets: see
  :mod:`transport.auth`); nothing was exchanged beyond the handshake.
* :class:`PlaneUnavailableError`: no allowed data plane can reach the buffer.
* :class:`StagingError`: a copy between a GPU buffer and a host bounce buffer
  failed or stalled (the staged path for CUDA tensors); the op failed. If the
  peer may have seen part of the payload, the channel was closed too.
"""

from __future__ import annotations

import enum

__all__ = [
    "AuthenticationError",
    "BufferMismatchError",
    "EndpointClosedError",
    "InvalidTensorError",
    "Phase",
    "PeerLostError",
    "PeerNotFoundError",
    "PlaneUnavailableError",
    "ProtocolError",
    "RemoteError",
    "StaleBufferError",
    "StagingError",
    "TransportError",
    "TransportTimeoutError",
    "UnknownBufferError",
]


class Phase(str, enum.Enum):
    """The phase of an operation an error happened in."""

    CONNECT = "connect"
    HANDSHAKE = "handshake"
    TRANSFER = "transfer"
    NOTIFY = "notify"


class TransportError(Exception):
    """Root of every error raised by this library."""


class UnknownBufferError(TransportError, KeyError):
    """A buffer name is not registered (locally or on the peer)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class BufferMismatchError(TransportError, ValueError):
    """A tensor does not match the registered buffer (dtype, shape, size, range)."""


class StaleBufferError(BufferMismatchError):
    """The peer replaced the buffer between our look-up and the op (it re-registered it).

    ``put``/``get`` refresh the peer's registry and retry once before raising it, unless
    ``retry_safe`` is False: a put whose copy ran while the peer took the buffer back without
    waiting for it (a frozen or very slow initiator) may have written memory the peer reused,
    and is not retried."""

    retry_safe = True


class InvalidTensorError(TransportError, ValueError):
    """A tensor cannot be used at all (non-contiguous, wrong device, ...)."""


class PeerNotFoundError(TransportError, LookupError):
    """No endpoint of that name showed up in the rendezvous store in time."""


class PeerLostError(TransportError, ConnectionError):
    """The channel to the peer broke (process died, link cut, heartbeats missed)."""


class EndpointClosedError(TransportError, RuntimeError):
    """The endpoint is closed (or not yet opened)."""


class ProtocolError(TransportError):
    """A peer sent a malformed or out-of-range frame; the channel was closed."""


class AuthenticationError(ProtocolError):
    """The peer did not prove that it belongs to the job, or it refused our proof (the two
    ends use different secrets); the connection was closed during the handshake."""


class PlaneUnavailableError(TransportError, RuntimeError):
    """No allowed data plane can reach the buffer."""


class StagingError(TransportError, RuntimeError):
    """A device<->host copy of the staged path failed, or did not complete within its bound."""


class RemoteError(TransportError):
    """The peer reported a failure that has no more specific class."""


class TransportTimeoutError(TransportError, TimeoutError):
    """A deadline passed. ``phase`` says what was being waited for: a :class:`Phase`, or the phase
    of a library built on this one (``rl_sync.SyncPhase.COMMIT``); either compares equal to its
    string."""

    def __init__(self, message: str, phase: Phase | str = Phase.TRANSFER) -> None:
        super().__init__(message)
        self.phase = phase


# Names used on the wire when a target reports an error back to the initiator.
ERROR_KINDS: dict[str, type[TransportError]] = {
    "unknown_buffer": UnknownBufferError,
    "buffer_mismatch": BufferMismatchError,
    "stale": StaleBufferError,
    "protocol": ProtocolError,
    "remote": RemoteError,
    "staging": StagingError,
}


def error_kind(exc: BaseException) -> str:
    """The wire name of ``exc``'s class (``"remote"`` if it has none)."""
    for kind, cls in ERROR_KINDS.items():
        if type(exc) is cls:
            return kind
    return "remote"
