"""Who pulls each bucket from where, so that the trainer does not send N copies.

* Subscribers on the publisher's host read every bucket straight from the
  publisher's shared-memory send slot: the trainer packs each bucket once
  and each subscriber copies it with its own core.
* Subscribers on other hosts form a two-level tree: per host, one leader
  pulls from the publisher (one copy per host over the network) and the
  others on that host pull from the leader's staging arena (shared memory).
* ``"chain"`` makes every subscriber pull from the one before it (a relay
  chain; used for tests and for links where the trainer's uplink is the
  bottleneck); ``"direct"`` makes everyone pull from the publisher.

A subscriber whose source fails during a push is not failed with it: the
buckets it is missing are packed again and it pulls them from the publisher.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["FANOUTS", "assign_sources"]

FANOUTS = ("auto", "direct", "chain")


def assign_sources(subscribers: list[str], same_host: Mapping[str, bool], hosts: Mapping[str, str],
                   fanout: str = "auto") -> dict[str, str | None]:
    """Map each subscriber to its source: None for the publisher, else another subscriber's name.

    ``same_host[s]``: whether ``s`` shares the publisher's host; ``hosts[s]``:
    the host key ``s`` reported. The result has no cycles: every chain of
    sources ends at the publisher.
    """
    if fanout not in FANOUTS:
        raise ValueError(f"fanout must be one of {FANOUTS}, got {fanout!r}")
    subs = sorted(subscribers)
    if fanout == "direct":
        return dict.fromkeys(subs)
    if fanout == "chain":
        return {s: (subs[i - 1] if i else None) for i, s in enumerate(subs)}
    out: dict[str, str | None] = {}
    leaders: dict[str, str] = {}
    for s in subs:
        if same_host.get(s, False):
            out[s] = None
            continue
        host = hosts.get(s) or f"?{s}"
        leader = leaders.setdefault(host, s)
        out[s] = None if leader == s else leader
    return out
