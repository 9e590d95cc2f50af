"""Whether the model's tensors are still the ones a subscriber writes: :class:`GivenTensors`.

A subscriber writes (or re-points) the tensor objects it was given. An application that later gives
one of them other memory in place (``t.data = ...``, ``model.to()``, ``.half()``, ``share_memory()``)
or another dtype or shape would have ``staged`` and ``direct`` write memory the model no longer
reads (every push "succeeds" and the model never changes again), and ``swap`` and ``shared``
re-point bytes of one dtype into a tensor of another. A commit checks first and refuses, naming
the tensors (``direct``: at Begin, before any byte lands).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

__all__ = ["GivenTensors"]

_Print = tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...]]


def _print(t: torch.Tensor) -> _Print:
    """Where a tensor is: its memory (0 when empty), dtype, shape and strides."""
    return (t.data_ptr() if t.numel() else 0, t.dtype, tuple(t.shape), t.stride())


class GivenTensors:
    """The model's own tensor objects (``given``) and where each is expected to be, from the
    tensors the subscriber writes (``written``: the same objects, or detached aliases of them)."""

    def __init__(self, given: Mapping[str, torch.Tensor], written: Mapping[str, torch.Tensor],
                 dtype_only: bool) -> None:
        """``dtype_only``: a mode that re-points every tensor at each commit (``swap``, ``shared``)
        moves one given new memory back, so only its dtype counts."""
        self._given = given
        self._dtype_only = dtype_only
        self._prints = {n: _print(t) for n, t in written.items()}

    def moved(self, written: Mapping[str, torch.Tensor], names: Iterable[str]) -> None:
        """The subscriber re-pointed ``names`` (their place in ``written`` is the expected one now;
        nothing to do where only dtypes count: a re-point keeps them)."""
        if not self._dtype_only:
            for n in names:
                self._prints[n] = _print(written[n])

    def changed(self) -> str | None:
        """Why the model's tensors are no longer what the subscriber writes (None: they are)."""
        prints = self._prints
        if self._dtype_only:
            bad = [n for n, t in self._given.items() if t.dtype != prints[n][1]]
        else:
            bad = [n for n, t in self._given.items() if _print(t) != prints[n]]
        if not bad:
            return None
        return (f"the model's tensors {', '.join(repr(n) for n in bad[:5])}{' ...' if len(bad) > 5 else ''} were given "
                f"other memory, dtype or shape after the WeightSubscriber was made (t.data = ..., model.to(), "
                f".half()): it would not write what the model reads; make the subscriber after such changes")
