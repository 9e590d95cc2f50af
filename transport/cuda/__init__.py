"""GPU plumbing for :mod:`transport`; CPU-only installs never need it.

``import transport`` does not import this package. Importing it loads no shared library and does
not import torch or ``cuda.pathfinder``: :func:`load_nccl` loads NCCL on its first call, and
explains every place it looked if it cannot.

* :mod:`transport.cuda.nccl_lib`: the ctypes binding for NCCL, re-exporting its three parts:
  :mod:`~transport.cuda.nccl_table` (constants, result codes, data types, structs, function
  tables), :mod:`~transport.cuda.nccl_loader` (library search, :class:`NcclLibrary`,
  :class:`NcclError`) and :mod:`~transport.cuda.nccl_comm` (:class:`Communicator`).
* :mod:`transport.cuda.staging`: the CUDA copy engine of the staged path (dedicated streams per
  device, pinned bounce buffers, events polled with a bound). It imports torch, so it is not
  imported here; :class:`transport.staging.Staging` imports it when a CUDA tensor is staged.
"""

from __future__ import annotations

from .nccl_comm import Communicator
from .nccl_loader import (
    ENV_VAR,
    LoadAttempt,
    NcclError,
    NcclLibrary,
    NcclSource,
    NcclUnavailableError,
    check,
    load_nccl,
)
from .nccl_table import BYTES, NcclDataType, NcclResult, nccl_dtype

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
