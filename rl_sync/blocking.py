"""``BlockingWeightSubscriber``: a subscriber for programs without asyncio (inference engine workers)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import transport

from .subscriber import WeightSubscriber

__all__ = ["BlockingWeightSubscriber"]


class BlockingWeightSubscriber:
    """A :class:`WeightSubscriber` on a :class:`transport.BlockingEndpoint`.

    Pushes are served on the endpoint's background loop thread; the methods
    here block the calling thread (any thread but that loop's)::

        with transport.BlockingEndpoint("gen-0", store=url) as ep:
            sub = BlockingWeightSubscriber(ep, model)
            sub.wait_for_version(1, timeout=60)
            with sub.hold():
                out = model(batch)

    Takes the same keyword arguments as :class:`WeightSubscriber`.
    """

    def __init__(self, endpoint: transport.BlockingEndpoint, model_or_state_dict: Any, **kwargs: Any) -> None:
        self._bep = endpoint
        self._sub: WeightSubscriber = endpoint.call_in_loop(
            lambda: WeightSubscriber(endpoint.endpoint, model_or_state_dict, **kwargs))

    @property
    def version(self) -> int:
        """The committed version (0 before the first commit)."""
        return self._sub.version

    @property
    def torn(self) -> bool:
        """Direct mode: a push wrote the live weights and never committed (see :attr:`WeightSubscriber.torn`)."""
        return self._sub.torn

    @property
    def subscriber(self) -> WeightSubscriber:
        return self._sub

    def wait_for_version(self, version: int, timeout: float | None = None) -> int:
        """Block until a version >= ``version`` is committed; :class:`transport.TransportTimeoutError` at the deadline.
        ``RuntimeError`` on the endpoint's loop thread (the commit it waits for runs there)."""
        self._off_loop("wait_for_version")
        return self._sub.wait_for_version_blocking(version, timeout)

    @contextlib.contextmanager
    def hold(self, timeout: float | None = None, *, streams: Sequence[Any] = ()) -> Iterator[int]:
        """Keep the weights from changing inside the block; yields the version held. GPU work
        queued inside it on this thread's current stream and on ``streams`` is part of the read
        (see :meth:`WeightSubscriber.hold`). ``RuntimeError`` on the endpoint's loop thread (a
        commit waiting there for the readers to leave would block it; use the async
        :meth:`WeightSubscriber.hold` there)."""
        self._off_loop("hold")
        with self._sub.hold_blocking(timeout, streams=streams) as v:
            yield v

    def _off_loop(self, what: str) -> None:
        if self._bep.on_loop_thread:
            raise RuntimeError(f"BlockingWeightSubscriber.{what}() cannot run on the endpoint's event loop thread "
                               "(e.g. a notification callback): it would block the loop that serves the pushes")

    def close(self) -> None:
        """Stop serving pushes (idempotent). Shared mode: the weights leave the publisher's bank
        (see :meth:`WeightSubscriber.close`), even once the endpoint is closed."""
        if self._bep.endpoint.is_open:
            self._bep.call_in_loop(self._sub.close)
        else:  # (the rest of close() needs the endpoint's loop): no commit applies from here on
            self._sub._closed = True
            self._sub._strategy.close()  # (shared: the weights leave the publisher's bank)
