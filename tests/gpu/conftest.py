"""Tests that need CUDA. Every test under ``tests/gpu`` gets the ``gpu`` marker, and is skipped,
with the reason, when ``torch.cuda.is_available()`` is False: the same files run unchanged on a
CPU machine (all skipped) and on a GPU machine (``bash tests/gpu/run_device_checks.sh``).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def _why_no_cuda() -> str | None:
    """None when CUDA can be used, else the reason the GPU tests are skipped."""
    try:
        import torch
    except ImportError as exc:
        return f"GPU tests need torch, which cannot be imported ({exc})"
    with warnings.catch_warnings():  # a CUDA build without a driver warns here; that is the answer, not an error
        warnings.simplefilter("ignore")
        available = torch.cuda.is_available()
    if available:
        return None
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    return f"torch.cuda.is_available() is False (torch {torch.__version__}, {build}): GPU tests need an NVIDIA GPU"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # This hook sees every collected item of the session, not only this folder's: filter by path.
    mine = [item for item in items if _HERE in Path(item.path).resolve().parents]
    if not mine:
        return
    reason = _why_no_cuda()
    for item in mine:
        item.add_marker(pytest.mark.gpu)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
