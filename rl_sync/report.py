"""What a push returns: one result per subscriber, and the totals."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["PushEvent", "PushReport", "SubscriberResult"]


@dataclass
class SubscriberResult:
    """How the push went for one subscriber.

    ``ok`` is true once the subscriber committed the version; otherwise
    ``error`` holds the exception (:class:`transport.PeerLostError`,
    :class:`transport.TransportTimeoutError`, :class:`rl_sync.StaleVersionError`, ...).
    ``bytes`` counts the bytes delivered to it, ``seconds`` the time from the
    push's start to its commit (or failure); ``source`` is where it pulled
    its buckets from (the publisher, or a relaying subscriber; the publisher
    when a relay was given up during the push). ``stage`` is where it was
    when the push ended for it: ``"plan"`` (connect, manifest), ``"begin"``
    (no answer to Begin yet), ``"transfer"``, ``"commit"`` (told to commit,
    no answer yet) or ``"committed"``; the error's message says what it was
    doing (buckets held, pulls outstanding and for how long, when it was
    last heard from). ``plane`` is the transport plane its bytes took
    (``shm``, ``tcp``, ``cuda_ipc``, ``nccl``, ``staged``; several joined by
    ``+``; ``shared`` for a ``mode="shared"`` subscriber, whose weights point
    into the publisher's bank) and ``plane_reason`` why, as
    :meth:`transport.Endpoint.route` says (empty if no bucket arrived).
    """

    ok: bool = False
    error: BaseException | None = None
    bytes: int = 0
    seconds: float = 0.0
    source: str = ""
    stage: str = ""
    plane: str = ""
    plane_reason: str = ""


@dataclass
class PushReport:
    """The outcome of :meth:`rl_sync.WeightPublisher.push`."""

    version: int
    results: dict[str, SubscriberResult] = field(default_factory=dict)
    seconds: float = 0.0
    packed_bytes: int = 0  # bytes the publisher packed (its own cost: once per bucket, not per subscriber)

    @property
    def ok(self) -> bool:
        """True when every subscriber committed."""
        return bool(self.results) and all(r.ok for r in self.results.values())

    @property
    def bytes(self) -> int:
        """Bytes delivered to the subscribers that committed."""
        return sum(r.bytes for r in self.results.values() if r.ok)

    @property
    def gbps(self) -> float:
        """Delivered GB/s: bytes that reached committing subscribers over the push's wall time."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def planes(self) -> dict[str, int]:
        """How many subscribers' bytes took each plane (see :attr:`SubscriberResult.plane`)."""
        counts: dict[str, int] = {}
        for r in self.results.values():
            if r.plane:
                counts[r.plane] = counts.get(r.plane, 0) + 1
        return counts

    @property
    def failed(self) -> dict[str, BaseException | None]:
        return {name: r.error for name, r in self.results.items() if not r.ok}

    def summary(self) -> str:
        ok = sum(r.ok for r in self.results.values())
        line = (f"version {self.version}: {ok}/{len(self.results)} subscribers committed, "
                f"{self.bytes / 2**20:.1f} MiB in {self.seconds * 1e3:.1f} ms ({self.gbps:.2f} GB/s)")
        if self.planes:
            line += " over " + ", ".join(f"{p} x{n}" for p, n in sorted(self.planes.items()))
        for name, err in self.failed.items():
            line += f"; {name} failed: {type(err).__name__}: {err}"
        return line


@dataclass(frozen=True)
class PushEvent:
    """One step of a push for one subscriber, as handed to a publisher's ``observer``.

    ``kind`` is one of ``"begin_sent"``, ``"begun"``, ``"pull_sent"``, ``"pulled"``
    (a bucket arrived: ``bucket``, ``source``), ``"stalled"`` (a pull went
    unanswered past the stall bound: its slot was taken back), ``"resourced"``
    (it pulls from the publisher from now on: its relay stalled or failed),
    ``"commit_sent"``, ``"committed"`` and ``"failed"`` (``detail`` says why). A
    ``mode="shared"`` subscriber gets its Commit inside its Begin once the bank is
    sealed and answers the Commit only: ``"begin_sent"`` and ``"commit_sent"``
    come together, then ``"begun"`` and ``"committed"``.
    ``have`` and ``buckets``: the buckets it holds, of how many; ``seconds``:
    since the push started.
    """

    push_id: int
    version: int
    subscriber: str
    kind: str
    bucket: int = -1
    source: str = ""
    have: int = 0
    buckets: int = 0
    seconds: float = 0.0
    detail: str = ""
