"""Packing a bucket: the trainer's tensors copied (and cast) into a send slot or a shared bank.

A bucket's pieces land at fixed places of a long-lived destination (a slot, a bank's arena), so
the destination views of each bucket are made once per destination and kept: per piece, a view of
the destination shaped like its source (the whole tensor, or a flat range of it). A pack is then
one ``torch._foreach_copy_`` over the bucket (one dispatch, casts included) instead of slicing,
viewing and copying piece by piece: the demo's 30-tensor bucket packs in ~50 us instead of
~500 us here, nearly all of it the views. The bucket's whole-entry pieces (most of them) are
listed once too (names, views, shapes): a pack of them takes the sources by name, compares their
shapes with one list comparison and, when they share a dtype, copies them in one call, with no
Python loop over the pieces (a source shaped otherwise goes piece by piece, as a partial piece,
where ``copy_`` refuses what does not fit: a push's sources were checked against the layout, but
one reshaped during the push, against its contract, must raise, never broadcast).

The kept views are keyed on the destination tensor object (weakly: they go with it) and the
bucket object (held, so its id is never reused while kept); a view holds its memory alive, so
a destination address seen again is the same memory. At most :data:`MAX_KEPT` buckets are kept
per destination; past that the destination's views start afresh.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .device import foreach_copy
from .plan import Bucket

__all__ = ["MAX_KEPT", "pack"]

MAX_KEPT = 1024  # buckets whose views are kept per destination tensor

_lock = threading.Lock()  # (packs run on worker threads, several at once for several groups)
# destination tensor -> (id(bucket), start, dest address) -> (the bucket, its pieces' destination views)
_kept: WeakIdKeyDictionary = WeakIdKeyDictionary()


class _Kept:
    """A bucket's destination views in one destination, and its whole-entry pieces split out:
    their names, views, shapes and (when they share one) dtype, so that a pack of them is a few
    list comprehensions and one ``_foreach_copy_``."""

    __slots__ = ("bucket", "views", "names", "dests", "shapes", "dtype", "partial")

    def __init__(self, bucket: Bucket, base: torch.Tensor, start: int) -> None:
        self.bucket = bucket  # (held: its id is part of the key)
        self.views = _views(bucket, base, start)
        whole = [(p, d) for p, d in zip(bucket.pieces, self.views, strict=True)
                 if p.start == 0 and p.stop == p.entry.nbytes]
        self.names = [p.entry.name for p, _ in whole]
        self.dests = [d for _, d in whole]
        self.shapes = [d.shape for d in self.dests]
        dtypes = {d.dtype for d in self.dests}
        self.dtype = dtypes.pop() if len(dtypes) == 1 else None
        self.partial = [(p, d) for p, d in zip(bucket.pieces, self.views, strict=True)
                        if not (p.start == 0 and p.stop == p.entry.nbytes)]


def _views(bucket: Bucket, base: torch.Tensor, start: int) -> list[torch.Tensor]:
    """Each piece's destination in ``base[start:start + bucket.nbytes]`` (uint8), shaped like its
    source: the entry's shape for a whole entry, else flat."""
    return [p.entry.view_in(base, p.start, p.stop, origin=bucket.offset - start) for p in bucket.pieces]


def pack(bucket: Bucket, sources: Mapping[str, torch.Tensor], base: torch.Tensor, start: int = 0) -> None:
    """Copy (and cast) the pieces of ``bucket`` from ``sources`` (entry name -> the trainer's
    tensor) into ``base[start:start + bucket.nbytes]`` (a flat uint8 tensor). Blocks until the
    copies are queued (CPU: done); any thread (CUDA: inside the copier's stream). Raises what
    ``copy_`` raises for a source that does not fit its piece."""
    key = (id(bucket), start, base.data_ptr())
    with _lock:
        per = _kept.get(base)
        hit = per.get(key) if per is not None else None
    with torch.no_grad():
        if hit is None:
            hit = _Kept(bucket, base, start)
            with _lock:
                per = _kept.get(base)
                if per is None or len(per) >= MAX_KEPT:
                    per = _kept[base] = {}
                per[key] = hit
        # one _foreach_copy_ per (destination dtype, source dtype): its CUDA fast path takes the kernel's
        # types from the first pair only in some torch versions (pytorch#173383), so each call is uniform
        batches: dict[tuple[torch.dtype, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        srcs = [sources[n] for n in hit.names]
        pairs = hit.partial
        if [t.shape for t in srcs] != hit.shapes:  # (a source shaped otherwise: piece by piece, flat)
            pairs = list(zip(bucket.pieces, hit.views, strict=True))
        elif srcs:
            dtypes = {t.dtype for t in srcs}
            if hit.dtype is not None and len(dtypes) == 1:  # (the common case: no loop over the pieces)
                batches[(hit.dtype, dtypes.pop())] = (list(hit.dests), srcs)
            else:
                for d, src in zip(hit.dests, srcs, strict=True):
                    batches.setdefault((d.dtype, src.dtype), ([], []))
                    batches[(d.dtype, src.dtype)][0].append(d)
                    batches[(d.dtype, src.dtype)][1].append(src)
        for p, d in pairs:
            src = sources[p.entry.name]
            if src.shape != d.shape:  # a range of a large entry (or a source shaped otherwise): flat
                size = d.element_size()
                src = src.reshape(-1)[p.start // size:p.stop // size]
                if d.dim() != 1:
                    d = d.view(-1)
                if src.shape != d.shape:
                    raise ValueError(f"{p.entry.name}: {src.numel()} elements for a piece of {d.numel()}")
            batch = batches.get((d.dtype, src.dtype))
            if batch is None:
                batch = batches[(d.dtype, src.dtype)] = ([], [])
            batch[0].append(d)
            batch[1].append(src)
        for into, out_of in batches.values():
            foreach_copy(into, out_of)
