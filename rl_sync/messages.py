"""Control messages between a publisher and its subscribers, carried as transport notifications.

Messages to a subscriber start with :data:`TO_SUBSCRIBER`, replies to a
publisher with :data:`TO_PUBLISHER`, so an endpoint routes them to rl_sync
(``ep.on_notification(..., prefix=...)``) while the application keeps
reading its own notifications (one process may even be both). One push, seen from the publisher::

    Begin ──────────────▶  subscriber checks version and plan hash
          ◀──────────────  Reply(stage="begin")
    Pull(bucket k) ─────▶  subscriber gets bucket k from its source into its staging arena (from a
                           send slot, a relay's arena, or, served live, the trainer's own tensors);
                           from a relay, it then reads the relay's stamp of that bank: unless it is
                           still the one the relay's Begin answer gave, the bytes are refused
          ◀──────────────  Reply(stage="pull", bucket=k)        (repeated for every bucket)
    Pull(bucket k, attempt a+1) ─▶  supersedes attempt a of bucket k: the subscriber cancels that
                           pull (its get leaves nothing behind), then pulls again; only the newest
                           attempt is answered
    Commit ─────────────▶  subscriber applies staging -> live weights under the writer lock
                           (mode="shared": no Pulls; it re-points its weights into the bank named;
                           the bank is packed and sealed first, then the Commit travels inside
                           the Begin: the subscriber serves it once it has served the Begin, and
                           answers the Commit only: one message each way per push)
          ◀──────────────  Reply(stage="commit")
    Abort ──────────────▶  (instead of Commit, on failure or cancellation) nothing is applied
          ◀──────────────  Reply(stage="dropped")   (at any point: another push's Begin, most often another
                           publisher's, superseded this one there; it fails that subscriber's entry at once)

A reply with ``error`` set fails that subscriber's push only.
"""

from __future__ import annotations

import msgspec

__all__ = ["PREFIX", "TO_PUBLISHER", "TO_SUBSCRIBER", "Abort", "Begin", "Commit", "Message", "Pull", "Reply", "decode", "encode"]

PREFIX = b"rl_sync/1:"
TO_SUBSCRIBER = PREFIX + b"s:"
TO_PUBLISHER = PREFIX + b"p:"


class Pull(msgspec.Struct, tag="pull", array_like=True):
    """Get bucket ``bucket`` from ``source``'s buffer ``buffer`` at byte ``offset`` into the staging arena."""

    push_id: int
    bucket: int
    source: str
    buffer: str
    offset: int
    attempt: int = 0  # echoed in the Reply; a newer Pull of the same bucket supersedes an older one
    # served live (the publisher's ``live``): no buffer/offset, but one buffer of the source per piece of
    # the bucket, in the bucket's piece order, each holding that piece's entry (read at the piece's offset)
    live: tuple[str, ...] = ()
    # from a relay (``source`` is a subscriber): the stamp its Begin answer gave for the bank it fills
    # (``stamp_at``); the bytes count only if the relay's stamp of that bank still says so after the read
    stamp: int = 0
    stamp_at: int = 0


class Commit(msgspec.Struct, tag="commit", array_like=True):
    """Apply the push. For a ``mode="shared"`` subscriber it names the publisher's bank that holds
    the version: its arenas' buffer names and its lock file (see :mod:`rl_sync.banks`)."""

    push_id: int
    version: int
    bank: int = -1
    buffers: tuple[str, ...] = ()
    lock: str = ""


class Begin(msgspec.Struct, tag="begin", array_like=True):
    push_id: int
    version: int
    plan_hash: str
    bucket_bytes: int
    # mode="shared": the push's Commit, carried in its Begin (the bank is sealed before either is sent): the
    # subscriber serves it once it has served the Begin and answers the Commit only (one message each way)
    commit: Commit | None = None


class Abort(msgspec.Struct, tag="abort", array_like=True):
    push_id: int
    reason: str


class Reply(msgspec.Struct, tag="reply", array_like=True):
    push_id: int
    stage: str  # "begin" | "pull" | "commit" | "dropped"
    bucket: int = -1
    error: str | None = None
    error_kind: str | None = None  # "stale" | "plan" | "timeout" | "relay" (a relay no longer holds the push) | "other"
    version: int = 0  # the subscriber's committed version after this step
    bank: int = 0  # begin: the arena bank this push fills (relays read it from there)
    attempt: int = 0  # pull: the attempt of the Pull it answers (replies to superseded attempts are ignored)
    plane: str = ""  # pull: the transport plane the bucket's bytes took (transport.Endpoint.route)
    route: str = ""  # ... and why
    stamp: int = 0  # begin: the stamp this push wrote for that bank (rl_sync.relay_stamp; relays' dependents check it)


Message = Begin | Pull | Commit | Abort | Reply

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return (TO_PUBLISHER if isinstance(msg, Reply) else TO_SUBSCRIBER) + _enc.encode(msg)


def decode(payload: bytes) -> Message:
    """Raises ``msgspec.DecodeError`` (or ``ValueError`` without a prefix) on a malformed message,
    whatever went wrong while decoding it (hostile nesting included)."""
    if not (payload.startswith(TO_SUBSCRIBER) or payload.startswith(TO_PUBLISHER)):
        raise ValueError("not an rl_sync message")
    try:
        return _dec.decode(memoryview(payload)[len(TO_SUBSCRIBER):])
    except msgspec.DecodeError:
        raise
    except Exception as exc:  # RecursionError, MemoryError, ...: a peer's bytes, never a crash
        raise msgspec.DecodeError(f"malformed rl_sync message: {type(exc).__name__}: {exc}") from exc
