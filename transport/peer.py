"""What a user sees of a connected peer: :class:`Peer` (``await ep.connect(name)``), :class:`Route`, and
the :class:`Notification` objects its notifications arrive as."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from .hostinfo import local_host, same_host
from .registry import BufferSpec
from .wire import HostInfo

__all__ = ["Notification", "Peer", "Route"]


@dataclass(frozen=True)
class Notification:
    """A message from a peer: sent alone (``ep.notify``) or carried by a put,
    in which case it is delivered only after the put's bytes have landed."""

    peer: str
    payload: bytes
    op_id: int = 0


class Route(NamedTuple):
    """The plane an op takes and why, as :meth:`transport.Endpoint.route` says."""

    plane: str
    reason: str


class _Channel(Protocol):
    """What a :class:`Peer` reads of its channel (:class:`transport.channel.Channel`)."""

    peer_name: str
    incarnation: int
    peer_specs: dict[str, BufferSpec]
    plane: Any  # its DataPlane (.name, .maps_peer_memory)
    plane_reason: str
    planes: Any  # its PlaneChoice (.maps_gpu_memory())
    host: HostInfo
    @property
    def gpu_plane(self) -> str | None: ...

    @property
    def gpu_plane_reason(self) -> str | None: ...
    id: str
    state: Any  # its ChannelState (.value)
    socket_kind: str
    credits: Any  # its NoteCredits (transport.credits)

    @property
    def is_open(self) -> bool: ...

    def gpu_plane_choice(self) -> tuple[str, str]: ...


class Peer:
    """A connected peer, as ``await ep.connect(name)`` returns it.

    ``buffers`` is the peer's registry as last announced (name ->
    :class:`BufferSpec`); it follows the peer's ``register``/``unregister``.
    """

    def __init__(self, channel: _Channel) -> None:
        self._channel = channel

    @property
    def name(self) -> str:
        return self._channel.peer_name

    @property
    def incarnation(self) -> int:
        return self._channel.incarnation

    @property
    def buffers(self) -> dict[str, BufferSpec]:
        return dict(self._channel.peer_specs)

    @property
    def plane(self) -> str:
        """The data plane used for this peer's CPU buffers."""
        return self._channel.plane.name

    @property
    def plane_reason(self) -> str:
        return self._channel.plane_reason

    @property
    def socket(self) -> str:
        """What the channel's socket is: ``"unix"`` (a peer on this host, in the same network
        namespace) or ``"tcp"`` (:mod:`transport.local_socket`). Frames, the ``tcp`` plane's bytes
        included, go over it either way."""
        return self._channel.socket_kind

    @property
    def same_host(self) -> bool:
        """Whether the peer runs on this host (same kernel boot and pid namespace, from the host identity its
        ``Hello`` carried: :func:`transport.hostinfo.same_host`), whatever plane its channel runs."""
        return same_host(local_host(), self._channel.host)[0]

    def maps_memory(self, gpu: bool = False) -> bool:
        """Whether this peer's CPU buffers (``gpu=True``: its GPU buffers) are mapped into this
        process for ops: puts and gets copy straight between our tensors and its memory, with no
        bytes on the channel, and :meth:`transport.Endpoint.map` can alias them (``shm`` for CPU
        buffers, ``cuda_ipc`` for GPU ones). Non-blocking."""
        ch = self._channel
        return ch.planes.maps_gpu_memory() if gpu else ch.plane.maps_peer_memory

    @property
    def gpu_plane(self) -> str:
        """The data plane for ops touching GPU memory with this peer: ``cuda_ipc``, ``nccl`` or ``staged``."""
        return self.gpu_plane_choice[0]

    @property
    def gpu_plane_reason(self) -> str:
        return self.gpu_plane_choice[1]

    @property
    def gpu_plane_choice(self) -> tuple[str, str]:
        ch = self._channel
        if ch.gpu_plane is not None and ch.gpu_plane_reason is not None:
            return ch.gpu_plane, ch.gpu_plane_reason
        return ch.gpu_plane_choice()

    @property
    def channel_id(self) -> str:
        """The channel's id, as the flight recorder and ``python -m transport fr`` name it."""
        return self._channel.id

    @property
    def connected(self) -> bool:
        return self._channel.is_open

    @property
    def notify_credits(self) -> tuple[int, int, int]:
        """``(available, window, parked)``: how many more notifications (notify, post, put with
        ``notify=``) this endpoint may send the peer now, of the ``window`` it granted (its
        ``max_pending_notifications``), and how many posts wait here for a credit or their turn
        (see :meth:`transport.Endpoint.post`). Event loop (a snapshot)."""
        c = self._channel.credits
        return c.free(), c.window, c.parked

    def __repr__(self) -> str:
        state = "open" if self.connected else self._channel.state.value
        return f"<Peer {self.name!r} incarnation={self.incarnation:#x} plane={self.plane} socket={self.socket} {state} buffers={len(self._channel.peer_specs)}>"
