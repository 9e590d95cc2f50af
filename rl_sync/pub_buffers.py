"""The buffers a :class:`rl_sync.WeightPublisher` registers per layout (:class:`PublisherBuffers`, a
base of it): its send slots, the trainer's tensors served live, and the shared banks of
``mode="shared"`` subscribers; made, reused and dropped here."""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

import transport

from .banks import BankSet, make_lock_dir, remove_lock_dir
from .plan import dtype_name
from .push_state import SLOTS, Layout

__all__ = ["PublisherBuffers"]

log = logging.getLogger("rl_sync.publisher")


class PublisherBuffers:
    """The publisher's slots, live buffers and banks; the attributes are set by
    :class:`rl_sync.WeightPublisher`'s ``__init__``."""

    endpoint: transport.Endpoint
    live: bool | str
    shared_banks: int
    _prefix: str
    _layouts: dict[str, Layout]
    _slots: dict[str, tuple[list[str], list[torch.Tensor]]]
    _live: dict[str, torch.Tensor]
    _bank_sets: dict[str, BankSet]
    _lock_dir: str | None
    _lock_dir_gone: Callable[[], Any]

    def _slot(self, layout: Layout, device: torch.device) -> tuple[list[str], list[torch.Tensor]]:
        """The layout's send slots, on ``device`` (where the trainer's weights are: a GPU's are packed there)."""
        size = max((b.nbytes for b in layout.buckets), default=64)
        have = self._slots.get(layout.digest)
        if have is not None and have[1][0].numel() >= size and have[1][0].device == device:
            return have
        names = [f"{self._prefix}{layout.digest[:16]}/slot{i}" for i in range(SLOTS)]
        tensors = []
        for n in names:
            if n in self.endpoint.buffers:  # ours, too small: made again
                self.endpoint.unregister(n, discard=True)
            tensors.append(self.endpoint.new_buffer(n, (size,), device=device))  # (CPU: in shared memory, no copy)
        self._slots[layout.digest] = (names, tensors)
        return names, tensors

    def _live_buffers(self, layout: Layout, sources: dict[str, torch.Tensor]) -> dict[str, str] | None:
        """Register the trainer's tensors to be pulled from directly (see ``live``), or None."""
        if self.live is False or layout.shared:
            return None
        entries = layout.manifest.entries
        if self.live == "auto" and not all(sources[e.name].is_cuda for e in entries):
            return None
        for e in entries:
            t = sources[e.name]
            if dtype_name(t.dtype) != e.dtype or not t.is_contiguous() or t.nbytes != e.nbytes:
                return None  # a cast (or a strided tensor): packed into slots
        names = {}
        for e in entries:
            t, name = sources[e.name], f"{self._prefix}live/{e.name}"
            have = self._live.get(name)
            # (the same memory is the same buffer, whichever tensor object holds it now)
            if (have is None or name not in self.endpoint.buffers or have.data_ptr() != t.data_ptr()
                    or have.device != t.device or have.dtype != t.dtype or have.shape != t.shape):
                if name in self.endpoint.buffers:
                    self.endpoint.unregister(name, discard=True)
                alias = t.detach()  # (the memory as of now: a Parameter's .data may be replaced later)
                self.endpoint.register(name, alias)
                self._live[name] = alias
            names[e.name] = name
        return names

    def _bank_set(self, layout: Layout, device: torch.device) -> BankSet:
        """The layout's shared banks, on ``device`` (where the trainer's weights are packed)."""
        bs = self._bank_sets.get(layout.digest)
        if bs is not None and bs.device != device:  # the trainer's weights moved: banks where they are now
            self._bank_sets.pop(layout.digest).close()
            bs = None
        if bs is None:
            if self._lock_dir is None:
                self._lock_dir = make_lock_dir(self.endpoint.name)
                # a publisher dropped without close() (or at exit) still removes its lock folder
                self._lock_dir_gone = weakref.finalize(self, remove_lock_dir, self._lock_dir)
            bs = self._bank_sets[layout.digest] = BankSet(self.endpoint, self._prefix, layout.digest[:16],
                                                          layout.manifest.arenas, self.shared_banks, self._lock_dir,
                                                          device)
            log.info("publisher %s: %d shared banks of %.1f MiB on %s for layout %s", self.endpoint.name,
                     self.shared_banks, sum(layout.manifest.arenas) / 2**20, device, layout.digest[:16])
        return bs

    def _drop_unused_banks(self) -> None:
        keep = {lay.digest for lay in self._layouts.values() if lay.shared}
        for digest in [d for d in self._bank_sets if d not in keep]:
            self._bank_sets.pop(digest).close()

    def _drop_unused_slots(self, keep: set[str]) -> None:
        for digest in list(self._slots):
            if digest not in keep:
                for n in self._slots.pop(digest)[0]:
                    with contextlib.suppress(transport.TransportError):
                        self.endpoint.unregister(n, discard=True)
