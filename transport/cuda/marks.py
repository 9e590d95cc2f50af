"""The caller's queued GPU work, as events: what the GPU planes' copies and posts wait for."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["caller_marks", "caller_marks_by_device"]


def caller_marks_by_device(tensors: Sequence[torch.Tensor], *,
                           blocking: bool = True) -> dict[torch.device, torch.cuda.Event]:
    """In the caller's thread: one event per CUDA device of ``tensors``, recorded on that
    device's current stream (a stream waits on it with ``wait_event``; with ``blocking``, a
    completion bridge thread can sleep on it without spinning)."""
    events: dict[torch.device, torch.cuda.Event] = {}
    for t in tensors:
        if t.is_cuda and t.device not in events:
            event = torch.cuda.Event(blocking=blocking)
            event.record(torch.cuda.current_stream(t.device))
            events[t.device] = event
    return events


def caller_marks(tensors: Sequence[torch.Tensor]) -> list[torch.cuda.Event]:
    """:func:`caller_marks_by_device`'s events (blocking-sync), as a list."""
    return list(caller_marks_by_device(tensors).values())
