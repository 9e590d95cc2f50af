"""transport: one-sided, asyncio-native put/get of named PyTorch tensors between processes.

::

    async with transport.Endpoint("trainer", store="tcp://127.0.0.1:29500", host_store=True) as ep:
        await ep.put("gen-0", {"layer0.weight": w})
"""

from .blocking import BlockingEndpoint
from .endpoint import Endpoint
from .errors import (
    AuthenticationError,
    BufferMismatchError,
    EndpointClosedError,
    InvalidTensorError,
    PeerLostError,
    PeerNotFoundError,
    PlaneUnavailableError,
    ProtocolError,
    RemoteError,
    StagingError,
    StaleBufferError,
    TransportError,
    TransportTimeoutError,
    UnknownBufferError,
)
from .peer import Notification, Peer, Route
from .ranges import At
from .registry import BufferSpec
from .remote import PeerAddress, RemoteBuffer, byte_view, describe_buffer, peer_address
from .staging import StagingConfig

__all__ = [
    "At",
    "AuthenticationError",
    "BlockingEndpoint",
    "BufferMismatchError",
    "BufferSpec",
    "Endpoint",
    "EndpointClosedError",
    "InvalidTensorError",
    "Notification",
    "Peer",
    "PeerAddress",
    "PeerLostError",
    "PeerNotFoundError",
    "PlaneUnavailableError",
    "ProtocolError",
    "RemoteBuffer",
    "RemoteError",
    "Route",
    "StagingConfig",
    "StagingError",
    "StaleBufferError",
    "TransportError",
    "TransportTimeoutError",
    "UnknownBufferError",
    "byte_view",
    "describe_buffer",
    "peer_address",
]

__version__ = "0.1.0"
