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
    "PeerLostError",
    "PeerNotFoundError",
    "PlaneUnavailableError",
    "ProtocolError",
    "RemoteError",
    "Route",
    "StagingConfig",
    "StagingError",
    "StaleBufferError",
    "TransportError",
    "TransportTimeoutError",
    "UnknownBufferError",
]

__version__ = "0.1.0"
