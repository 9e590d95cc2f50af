"""ctypes binding for NCCL (``libnccl.so.2``): locate it, type it, check every result.

Why ctypes and not a compiled extension, ``cuda.bindings.nccl`` or nccl4py (docs/cuda.md): one pure-Python wheel works with
whichever NCCL the process already has (the one torch loaded, the ``nvidia-nccl-cu12``/``-cu13``
wheel, the system's), nothing is built per CUDA/NCCL/Python combination, and a missing NCCL is an
ordinary, explained error at run time instead of an import failure. The price is that every
signature is written by hand, so each row of the function tables sits under the C prototype it was
copied from (``nccl.h`` of NCCL 2.32.3), and ``tests/test_nccl_binding.py`` checks the argument
counts against the header that ships in the wheel.

This module is the binding's public face: it re-exports the names of three modules, each with one
job, which import each other only in this order (table <- loader <- comm):

* :mod:`transport.cuda.nccl_table`: constants, :class:`NcclResult` / :class:`NcclDataType`, the
  ctypes structs, :data:`REQUIRED_FUNCTIONS` and :data:`OPTIONAL_FUNCTIONS`.
* :mod:`transport.cuda.nccl_loader`: :func:`load_nccl` (its docstring gives the search order:
  explicit path or ``$TRANSPORT_NCCL_LIBRARY``, the NCCL torch loaded, ``cuda.pathfinder``, the
  system), :class:`NcclLibrary`, :class:`NcclError`, :class:`NcclUnavailableError`, :func:`check`.
* :mod:`transport.cuda.nccl_comm`: :class:`Communicator` and :data:`NCCL_LOCK`.

Nothing here fails silently: no step, no call and no communicator turns into a no-op.

No raw pointer leaves these modules: a communicator handle lives inside :class:`Communicator`, the
unique id travels as ``bytes``. Buffer addresses and CUDA streams go in as plain ``int``.
Importing them loads no shared library; :func:`load_nccl` does, on its first call.
"""

from __future__ import annotations

from .nccl_comm import NCCL_LOCK, Communicator
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
from .nccl_loader import SONAME as SONAME
from .nccl_table import API_MAGIC as API_MAGIC
from .nccl_table import (
    BYTES,
    CONFIG_VERSION,
    OPTIONAL_FUNCTIONS,
    REQUIRED_FUNCTIONS,
    UNIQUE_ID_BYTES,
    Function,
    NcclConfig,
    NcclDataType,
    NcclResult,
    NcclUniqueId,
    NcclWaitSignalDesc,
    OptionalFunction,
    nccl_dtype,
    parse_version,
    version_code,
)
from .nccl_table import CONFIG_UNDEF_INT as CONFIG_UNDEF_INT

# SONAME, API_MAGIC and CONFIG_UNDEF_INT were never in __all__ but were importable from here; they still are.
__all__ = [
    "BYTES",
    "CONFIG_VERSION",
    "ENV_VAR",
    "NCCL_LOCK",
    "OPTIONAL_FUNCTIONS",
    "REQUIRED_FUNCTIONS",
    "UNIQUE_ID_BYTES",
    "Communicator",
    "Function",
    "LoadAttempt",
    "NcclConfig",
    "NcclDataType",
    "NcclError",
    "NcclLibrary",
    "NcclResult",
    "NcclSource",
    "NcclUnavailableError",
    "NcclUniqueId",
    "NcclWaitSignalDesc",
    "OptionalFunction",
    "check",
    "load_nccl",
    "nccl_dtype",
    "parse_version",
    "version_code",
]
