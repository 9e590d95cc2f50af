"""The caller's queued GPU work, as events: what the GPU planes' copies and posts wait for."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["caller_marks"]


def caller_marks(tensors: Sequence[torch.Tensor]) -> list[torch.cuda.Event]:
    """In the caller's thread: one blocking-sync event per CUDA device of ``tensors``, recorded on
    that device's current stream (a stream waits on it with ``wait_event``; a completion bridge
    thread can sleep on it without spinning)."""
    events = []
    for device in {t.device for t in tensors if t.is_cuda}:
        event = torch.cuda.Event(blocking=True)
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return events
