"""The reader thread of a channel: each frame the peer sends, read off the socket and handed on.

:meth:`Dispatcher.read_loop` is the body of the channel's reader thread (``transport-rx-<peer>``):
it reads frames through the channel's :class:`~transport.receiver.Receiver` while the channel is
open and hands each one on (:meth:`Dispatcher.dispatch`): the peer's ops to the target's half
(:class:`~transport.serving.Serving`), answers to our ops to the op table
(:class:`~transport.op_table.OpTable`), a registry update to the channel, the NCCL link's set-up
to the link, credits to the channel's :class:`~transport.credits.NoteCredits`. A frame that cannot be parsed, or a socket that fails, breaks the channel (the op the
target's half was serving is recorded as failed). Everything here runs on the reader thread and
may block it (a payload received into a tensor); nothing blocks the event loop. It sees the channel through :class:`ReadChannel`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import msgspec

from . import fence
from .errors import PeerLostError, ProtocolError
from .flight_recorder import OpState
from .loop_reads import loop_takes, rejected
from .planes import SendingChannel, link_refusal
from .wire import (
    MAX_LOST,
    Ack,
    Bye,
    Credit,
    Data,
    Fail,
    Get,
    Go,
    LinkFrame,
    Lost,
    Message,
    Notify,
    Ping,
    Put,
    Registry,
    Sync,
    Unmapped,
    decode,
)

if TYPE_CHECKING:
    from .credits import NoteCredits
    from .loop_reads import LoopReads
    from .op_table import OpTable
    from .receiver import Receiver
    from .serving import Serving

__all__ = ["Dispatcher", "ReadChannel"]

log = logging.getLogger("transport.channel")  # what is logged here is the channel's (as before it moved here)


class ReadChannel(SendingChannel, Protocol):
    """What the reader uses of its channel (:class:`transport.channel.Channel`) besides
    :class:`~transport.planes.SendingChannel` (its ``core``: ``wire_registry()``, ``unmapped()``)."""

    id: str
    orderly: bool  # set when the peer closed with a Bye
    fence: list[threading.Thread]  # readers of the peer's old channels, waited for before the first frame
    fence_lost: Callable[[list[str]], list[threading.Thread]]  # a Lost frame's: the readers to wait for

    def lose(self, exc: BaseException) -> None: ...

    def take_registry(self, msg: Registry) -> None: ...

    @property
    def credits(self) -> NoteCredits: ...


class Dispatcher:
    """The reader of one channel (reader thread): ``rx`` is the channel's socket's receiving half,
    ``target`` its target's half, ``ops`` its table of pending ops."""

    def __init__(self, channel: ReadChannel, rx: Receiver, target: Serving, ops: OpTable,
                 reads: LoopReads | None = None) -> None:
        self.ch = channel
        self.rx = rx
        self.target = target
        self.ops = ops
        self.reads = reads  # who reads the socket between frames (None: always this thread)
        self.last_data_loops = False  # whether the loop would have taken the last get reply received itself

    def read_loop(self) -> None:
        """The reader thread's body: frames until the channel is no longer open or its socket fails."""
        try:
            ch, rx, reads = self.ch, self.rx, self.reads
            fence.wait(ch.fence, lambda: ch.is_open, ch.peer_name, rx.seen)  # (the peer's old channels' readers first)
            ch.fence = []
            rx.start()
            if reads is None:
                while ch.is_open:
                    msg = decode(rx.read_frame())
                    self._unless_paused()
                    self.dispatch(msg)
            else:  # the event loop may read replies itself meanwhile: the thread reads only on its turn
                while reads.wait_turn():
                    msg = decode(rx.read_frame())
                    self._unless_paused()
                    self.dispatch(msg)
                    # (a get reply the loop could not have taken whole does not hand the reads back at once:
                    # back-to-back large gets keep them on the thread, which receives their payloads)
                    reads.thread_read(isinstance(msg, (Ack, Fail, Notify, Credit))
                                      or (isinstance(msg, Data) and self.last_data_loops))
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, ProtocolError) as exc:
            self._fail_serving(exc)
            if self.ch.is_open:
                log.error("protocol error on channel %s from %r: %s; closing the channel", self.ch.id,
                          self.ch.peer_name, exc)
            self.ch.lose(exc if isinstance(exc, ProtocolError) else ProtocolError(str(exc)))
        except (EOFError, OSError) as exc:
            self._fail_serving(exc)
            self.ch.lose(PeerLostError(f"connection to {self.ch.peer_name!r} lost: {exc}"))
        except PeerLostError as exc:  # an answer could not be sent: the channel is already lost
            self._fail_serving(exc)
            self.ch.lose(exc)
        except BaseException as exc:  # a bug: never leave the peer hanging
            self._fail_serving(exc)
            log.exception("channel %s reader crashed", self.ch.id)
            self.ch.lose(PeerLostError(f"channel reader crashed: {exc!r}"))
        finally:
            if self.reads is not None:  # (its wake pipe: nothing waits on it any more)
                self.reads.release()

    def _unless_paused(self) -> None:
        """Reader thread, before each frame: if this process was paused, wait until the store was
        asked whether the endpoint was replaced meanwhile (:mod:`transport.pauses`); if it was,
        serve nothing: the channel breaks (its peer was told why)."""
        watch = self.ch.core.pauses
        if watch is not None and watch.paused() and (why := watch.settle()) is not None:
            raise PeerLostError(f"channel {self.ch.id}: {why}")

    def _fail_serving(self, exc: BaseException) -> None:
        rec, self.target.current = self.target.current, None
        if rec is not None:
            self.ch.recorder.update(rec, OpState.FAILED, exc)

    def dispatch(self, msg: Message) -> None:
        """Hand one frame of the peer's to whoever handles it (reader thread)."""
        if isinstance(msg, Put):
            self.target.serve_put(msg)
        elif isinstance(msg, Get):
            self.target.serve_get(msg)
        elif isinstance(msg, Ack):
            op = self.ops.pop(msg.op_id)
            if op is not None:
                self.ops.settle_from_thread(op, None)
        elif isinstance(msg, Fail):
            if self.ch.link is not None:
                self.ch.link.not_posted(msg.op_id)  # a listener's nccl op the dialer rejected before its Go
            op = self.ops.pop(msg.op_id)
            if op is not None:
                self.ops.settle_from_thread(op, rejected(self.ch, op, msg))
        elif isinstance(msg, Data):
            self._take_data(msg)
        elif isinstance(msg, Notify):
            self.target.serve_notify(msg)
        elif isinstance(msg, Credit):
            self.ch.credits.returned(msg.total)
        elif isinstance(msg, Registry):
            self.ch.take_registry(msg)
        elif isinstance(msg, Sync):
            epoch, bufs = self.ch.core.wire_registry()
            self.ch.send(Registry(epoch, bufs))
            self.ch.send(Ack(msg.op_id))
        elif isinstance(msg, Unmapped):
            self.ch.core.unmapped(self.ch, msg.epoch)
        elif isinstance(msg, Go):
            self.target.take_go(msg)
        elif isinstance(msg, LinkFrame):  # (the link's own protocol: its plane decodes it)
            if self.ch.link is not None:
                self.ch.link.on_frame(msg.body)
            elif (answer := link_refusal(msg.body)) is not None:
                self.ch.send(answer)
        elif isinstance(msg, Ping):
            pass
        elif isinstance(msg, Lost):  # the peer's ops come here now: its ended channels' readers first
            if len(msg.channel_ids) > MAX_LOST:
                raise ProtocolError(f"a Lost frame naming {len(msg.channel_ids)} channels (at most {MAX_LOST})")
            fence.wait(self.ch.fence_lost(msg.channel_ids), lambda: self.ch.is_open, self.ch.peer_name, self.rx.seen)
        elif isinstance(msg, Bye):
            self.ch.orderly = True
            self.ch.lose(PeerLostError(f"{self.ch.peer_name!r} closed the channel: {msg.reason or 'bye'}"))
        else:
            raise ProtocolError(f"unexpected {type(msg).__name__} frame after the handshake")

    def _take_data(self, msg: Data) -> None:
        with self.ops.lock:
            op = self.ops.pending.get(msg.op_id)
        if op is None or op.dests is None:
            raise ProtocolError(f"data for unknown get #{msg.op_id}")
        self.last_data_loops = loop_takes(op.dests)
        error = self.target.receive(op.dests, op)
        self.ops.pop(msg.op_id)
        self.ops.settle_from_thread(op, error)
