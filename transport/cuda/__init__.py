"""GPU plumbing for :mod:`transport`; CPU-only installs never need it.

``import transport`` does not import this package. Importing it loads no shared library and does
not import torch or ``cuda.pathfinder``: :func:`load_nccl` loads NCCL on its first call, and
explains every place it looked if it cannot.

* :mod:`transport.cuda.nccl_lib`: the ctypes binding for NCCL (library search, function tables,
  result codes, :class:`NcclError`, :class:`Communicator`).
* :mod:`transport.cuda.staging`: the CUDA copy engine of the staged path (dedicated streams per
  device, pinned bounce buffers, events polled with a bound). It imports torch, so it is not
  imported here; :class:`transport.staging.Staging` imports it when a CUDA tensor is staged.
"""

from __future__ import annotations

from .nccl_lib import (
    BYTES,
    ENV_VAR,
    Communicator,
    LoadAttempt,
    NcclDataType,
    NcclError,
    NcclLibrary,
    NcclResult,
    NcclSource,
    NcclUnavailableError,
    check,
    load_nccl,
    nccl_dtype,
)

__all__ = [
    "BYTES",
    "ENV_VAR",
    "Communicator",
    "LoadAttempt",
    "NcclDataType",
    "NcclError",
    "NcclLibrary",
    "NcclResult",
    "NcclSource",
    "NcclUnavailableError",
    "check",
    "load_nccl",
    "nccl_dtype",
]
