"""This library as a backend of PyTorch's one-sided ``torch.distributed._transport``.

Registered under the ``torch.distributed.transports`` entry point as ``"transport_rl"``::

    from torch.distributed._transport import new_transport

    with new_transport("transport_rl", "cpu") as a, new_transport("transport_rl", "cpu") as b:
        a.connect(b.bind())
        b.connect(a.bind())
        ...

Needs a torch that ships ``torch.distributed._transport`` (2.15 and later). Nothing else in
:mod:`transport` imports this package, so the library itself works with older torch; importing
it there raises ``ImportError`` saying so. It is a client of the library like any other: it uses
only the names in ``transport.__all__`` (:mod:`transport.remote` holds what it needed). See :class:`TransportRL` for the options and the
blocking, timeout and cancellation behaviour.
"""

from __future__ import annotations

try:
    import torch.distributed._transport  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the installed torch
    import torch

    raise ImportError(
        f"transport.torch_backend needs torch.distributed._transport (PyTorch 2.15 or later); this is torch "
        f"{torch.__version__}"
    ) from exc

from ._memory import TransportRLMemory, TransportRLMemoryView, TransportRLMutableMemoryView, TransportRLRemoteBuffer
from ._transport import PLANES, TransportRL
from ._work import TransportRLWork

__all__ = [
    "PLANES",
    "TransportRL",
    "TransportRLMemory",
    "TransportRLMemoryView",
    "TransportRLMutableMemoryView",
    "TransportRLRemoteBuffer",
    "TransportRLWork",
]
