"""The live weights a subscriber receives into: which tensors they are, and re-pointing them.

Shared by :mod:`rl_sync.subscriber` and the commit modes (:mod:`rl_sync.modes`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .plan import dtype_from_name

__all__ = ["contiguous_strides", "live_tensors", "repoint", "shared_memory", "uncancellable"]


def live_tensors(model_or_state_dict: Any, *, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """The tensors a push writes: an ``nn.Module``'s state dict, or a mapping of name -> tensor.

    ``keep_vars=True`` returns the module's own parameter and buffer objects (not detached
    aliases), so that they can be re-pointed in place.
    """
    if isinstance(model_or_state_dict, torch.nn.Module):  # (its objects, detached once below)
        state = model_or_state_dict.state_dict(keep_vars=True)
    elif isinstance(model_or_state_dict, Mapping):
        state = dict(model_or_state_dict)
    else:
        raise TypeError(f"expected an nn.Module or a mapping of name -> tensor, got {type(model_or_state_dict).__name__}")
    for name, t in state.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError(f"state entries are str -> tensor, got {name!r} -> {type(t).__name__}")
    return state if keep_vars else {name: t.detach() for name, t in state.items()}


def shared_memory(live: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """Names whose tensors cannot be re-pointed one by one: each group shares memory between tensor
    objects that are not one object (views of one tensor, a view and its base), or is one view of a
    tensor not in ``live``. Re-pointing one of them (``Tensor.set_``) would leave the others behind.
    One tensor object under several names (a tied weight in a state dict) is fine: it moves once
    for all its names; so are several objects that cover exactly the same memory (parameters tied
    through ``.data``): each is re-pointed whole."""
    by_memory: dict[tuple[str, int], dict[int, list[str]]] = {}
    groups: list[list[str]] = []
    for name, t in live.items():
        if t.numel() == 0:  # (empty tensors may all report the same null storage)
            continue
        by_memory.setdefault((str(t.device), t.untyped_storage().data_ptr()), {}).setdefault(id(t), []).append(name)
    for objects in by_memory.values():
        if len(objects) > 1:
            ts = [live[names[0]] for names in objects.values()]
            first = ts[0]
            if all((t.storage_offset(), t.shape, t.stride(), t.dtype) ==
                   (first.storage_offset(), first.shape, first.stride(), first.dtype) for t in ts):
                continue  # several objects over exactly the same memory (tied through .data): each moves whole
            groups.append(sorted(n for names in objects.values() for n in names))
        else:
            (names,) = objects.values()
            if live[names[0]]._base is not None:
                groups.append(sorted(names))
    return sorted(groups)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


@functools.lru_cache(maxsize=65536)
def _geometry(dtype: str, shape: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """An entry's element size and contiguous strides (the same few for every push: computed once)."""
    return dtype_from_name(dtype).itemsize, contiguous_strides(shape)


Places = list[tuple[torch.Tensor, Any, int, tuple[int, ...], tuple[int, ...]]]


def repoint(live: Mapping[str, torch.Tensor], entries: Sequence[Any],
            arenas: Sequence[torch.Tensor] | Mapping[int, torch.Tensor],
            memo: dict[tuple[Any, ...], tuple[Sequence[Any], Places]] | None = None) -> None:
    """Point the live tensor of each of ``entries`` (manifest entries) into its place in ``arenas``
    (every arena an entry names: by index in a sequence, by key in a mapping).

    ``memo`` (a dict the caller keeps with ``live`` and ``entries``, which it must not change):
    where each tensor goes is worked out once per geometry of the arenas (their dtypes, offsets
    and sizes: the same for every bank of a layout), and a later call only re-points.
    """
    keys = range(len(arenas)) if isinstance(arenas, Sequence) else sorted(arenas)
    geometry = tuple((i, arenas[i].dtype, int(arenas[i].storage_offset()), arenas[i].numel()) for i in keys)
    key = (id(entries), geometry)
    hit = memo.get(key) if memo is not None else None
    if hit is not None and hit[0] is entries:  # (the entries object is held: its id is not reused meanwhile)
        places = hit[1]
    else:
        places = _places(live, entries, {g[0]: g[1:] for g in geometry})
        if memo is not None:
            if len(memo) >= 8:  # (geometries seen: a handful at most)
                memo.clear()
            memo[key] = (entries, places)
    storages = {i: arenas[i].untyped_storage() for i in keys}
    with torch.no_grad():
        for t, arena, offset, shape, strides in places:
            t.set_(storages[arena], offset, shape, strides)


def _places(live: Mapping[str, torch.Tensor], entries: Sequence[Any],
            arenas: Mapping[int, tuple[torch.dtype, int, int]]) -> Places:
    """Each entry's live tensor, arena, offset (in its elements) and geometry; every place is
    checked before any tensor moves: a bad layout leaves them all as they were."""
    places: Places = []
    for e in entries:
        dtype, base, n = arenas[e.arena]
        if dtype != torch.uint8:
            raise RuntimeError(f"arena {e.arena} is {dtype}, not a flat uint8 tensor")
        size, strides = _geometry(e.dtype, e.shape)
        start = base + e.offset
        if start % size or e.offset + e.nbytes > n:
            raise RuntimeError(f"{e.name!r}: arena offset {start} is not a multiple of {size}, or the entry "
                               f"overruns its arena of {n} bytes")
        places.append((live[e.name], e.arena, start // size, e.shape, strides))
    return places


async def uncancellable(coro: Any) -> Any:
    """Await ``coro`` to its end even if the caller is cancelled meanwhile (then re-raise the
    cancellation): copies into the live weights must be over before the lock that guards them is
    let go."""
    task = asyncio.ensure_future(coro)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result
