"""ctypes binding for NCCL (``libnccl.so.2``): locate it, type it, check every result.

Why ctypes and not a compiled extension or ``cuda.bindings.nccl``: one pure-Python wheel works with
whichever NCCL the process already has (the one torch loaded, the ``nvidia-nccl-cu12``/``-cu13``
wheel, the system's), nothing is built per CUDA/NCCL/Python combination, and a missing NCCL is an
ordinary, explained error at run time instead of an import failure. The price is that every
signature is written by hand, so each row of the tables below sits under the C prototype it was
copied from (``nccl.h`` of NCCL 2.32.3), and ``tests/test_nccl_binding.py`` checks the argument
counts against the header that ships in the wheel.

Locating the library (:func:`load_nccl`); the first step that yields a working NCCL wins, and
every step tried is recorded with its reason in :attr:`NcclLibrary.attempts`:

1. ``explicit``: the ``path=`` argument, else ``$TRANSPORT_NCCL_LIBRARY``. If one is given and it
   does not load, :class:`NcclUnavailableError` is raised at once: no fallback past an explicit
   choice.
2. ``torch``: a ``libnccl.so*`` already mapped into this process (CUDA builds of torch load one),
   so the process keeps a single NCCL. A CPU build of torch maps none and the step is skipped.
3. ``pathfinder``: ``cuda.pathfinder.load_nvidia_dynamic_lib("nccl")`` (the NVIDIA wheels, conda,
   ``NCCL_HOME``, ...).
4. ``system``: ``dlopen("libnccl.so.2")`` (``LD_LIBRARY_PATH``, ``ld.so.cache``).

A candidate counts only if it exports every function of :data:`REQUIRED_FUNCTIONS` and answers
``ncclGetVersion``. Functions of :data:`OPTIONAL_FUNCTIONS` are resolved at load time against the
version they appeared in; :meth:`NcclLibrary.has` says whether one can be called, and calling one
that is missing raises :class:`NcclUnavailableError` naming it and the loaded version.

Nothing here fails silently: no step, no call and no communicator turns into a no-op.

No raw pointer leaves this module: a communicator handle lives inside :class:`Communicator`, the
unique id travels as ``bytes``. Buffer addresses and CUDA streams go in as plain ``int``.
Importing the module loads no shared library; :func:`load_nccl` does, on its first call.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import logging
import os
import threading
import time
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from ..errors import (
    BufferMismatchError,
    InvalidTensorError,
    Phase,
    PlaneUnavailableError,
    TransportError,
    TransportTimeoutError,
)

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

log = logging.getLogger(__name__)

#: Environment variable naming the NCCL shared library to load (a path, or a name for dlopen).
ENV_VAR = "TRANSPORT_NCCL_LIBRARY"
#: The name the ``system`` step asks the dynamic loader for.
SONAME = "libnccl.so.2"
#: ``NCCL_UNIQUE_ID_BYTES``.
UNIQUE_ID_BYTES = 128
#: ``NCCL_API_MAGIC``: the first check NCCL makes on an ``ncclConfig_t``.
API_MAGIC = 0xCAFEBEEF
#: ``NCCL_CONFIG_UNDEF_INT`` (``INT_MIN``): "not set, NCCL picks".
CONFIG_UNDEF_INT = -(2**31)


def version_code(major: int, minor: int, patch: int) -> int:
    """``NCCL_VERSION(X, Y, Z)``: the integer NCCL uses for versions (2.14.0 -> 21400, 2.8.4 -> 2804)."""
    if major <= 2 and minor <= 8:
        return major * 1000 + minor * 100 + patch
    return major * 10000 + minor * 100 + patch


def parse_version(code: int) -> tuple[int, int, int]:
    """The ``(major, minor, patch)`` of an ``ncclGetVersion`` result (23203 -> (2, 32, 3)).

    Up to 2.8 NCCL encoded ``X*1000 + Y*100 + Z`` (2.8.4 -> 2804); from 2.9 on ``X*10000 + Y*100
    + Z``. Raises ``ValueError`` for a code no NCCL release produces.
    """
    if code < 1000:
        raise ValueError(f"{code} is not an NCCL version code")
    if code < 10000:
        return code // 1000, (code % 1000) // 100, code % 100
    return code // 10000, (code % 10000) // 100, code % 100


#: The ``version`` written into :class:`NcclConfig`: ``NCCL_VERSION(2, 14, 0)``. NCCL copies
#: ``size`` bytes of the struct and resets every field newer than ``version`` to its default.
CONFIG_VERSION = version_code(2, 14, 0)


def _dotted(version: tuple[int, int, int]) -> str:
    return ".".join(map(str, version))


# ---------------------------------------------------------------------------------------------
# Result codes, data types
# ---------------------------------------------------------------------------------------------


class NcclResult(enum.IntEnum):
    """``ncclResult_t``."""

    SUCCESS = 0
    UNHANDLED_CUDA_ERROR = 1
    SYSTEM_ERROR = 2
    INTERNAL_ERROR = 3
    INVALID_ARGUMENT = 4
    INVALID_USAGE = 5
    REMOTE_ERROR = 6
    IN_PROGRESS = 7
    TIMEOUT = 8  # NCCL 2.29+

    @property
    def c_name(self) -> str:
        """The C enumerator: ``ncclInvalidUsage``."""
        return _RESULT_C_NAMES[self]


_RESULT_C_NAMES = {
    NcclResult.SUCCESS: "ncclSuccess",
    NcclResult.UNHANDLED_CUDA_ERROR: "ncclUnhandledCudaError",
    NcclResult.SYSTEM_ERROR: "ncclSystemError",
    NcclResult.INTERNAL_ERROR: "ncclInternalError",
    NcclResult.INVALID_ARGUMENT: "ncclInvalidArgument",
    NcclResult.INVALID_USAGE: "ncclInvalidUsage",
    NcclResult.REMOTE_ERROR: "ncclRemoteError",
    NcclResult.IN_PROGRESS: "ncclInProgress",
    NcclResult.TIMEOUT: "ncclTimeout",
}


def _as_result(code: int) -> NcclResult | int:
    try:
        return NcclResult(code)
    except ValueError:
        return int(code)


def _result_name(code: int) -> str:
    result = _as_result(code)
    return result.c_name if isinstance(result, NcclResult) else f"ncclResult({int(code)})"


class NcclDataType(enum.IntEnum):
    """``ncclDataType_t``. The fp8 types exist only in NCCL versions whose header lists them."""

    INT8 = 0
    UINT8 = 1
    INT32 = 2
    UINT32 = 3
    INT64 = 4
    UINT64 = 5
    FLOAT16 = 6
    FLOAT32 = 7
    FLOAT64 = 8
    BFLOAT16 = 9
    FLOAT8_E4M3 = 10  # ncclFloat8e4m3: CUDA's __nv_fp8_e4m3, i.e. torch.float8_e4m3fn
    FLOAT8_E5M2 = 11  # ncclFloat8e5m2


#: What :class:`Communicator` sends: send/recv only move bytes, so ``uint8`` with ``count = nbytes``
#: is right for every tensor dtype (and for dtypes NCCL has no name for).
BYTES = NcclDataType.UINT8

# Keyed by str(torch.dtype) so that this module never imports torch.
_TORCH_DTYPES: dict[str, NcclDataType] = {
    "torch.bool": NcclDataType.UINT8,
    "torch.int8": NcclDataType.INT8,
    "torch.uint8": NcclDataType.UINT8,
    "torch.int32": NcclDataType.INT32,
    "torch.uint32": NcclDataType.UINT32,
    "torch.int64": NcclDataType.INT64,
    "torch.uint64": NcclDataType.UINT64,
    "torch.float16": NcclDataType.FLOAT16,
    "torch.float32": NcclDataType.FLOAT32,
    "torch.float64": NcclDataType.FLOAT64,
    "torch.bfloat16": NcclDataType.BFLOAT16,
    "torch.float8_e4m3fn": NcclDataType.FLOAT8_E4M3,
    "torch.float8_e5m2": NcclDataType.FLOAT8_E5M2,
}


def nccl_dtype(dtype: object) -> NcclDataType:
    """The ``ncclDataType_t`` of a ``torch.dtype`` (or its ``str``, ``"torch.float32"``).

    ``torch.bool`` maps to ``uint8`` (one byte each). A dtype NCCL has no name for (``int16``,
    complex, ...) raises :class:`InvalidTensorError`; send such tensors as :data:`BYTES`, which is
    what :class:`Communicator` does for everything anyway.
    """
    name = dtype if isinstance(dtype, str) else str(dtype)
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise InvalidTensorError(
            f"NCCL has no data type for {name}; send it as bytes (NcclDataType.UINT8, count = nbytes)"
        ) from None


# ---------------------------------------------------------------------------------------------
# Structures
# ---------------------------------------------------------------------------------------------


class NcclUniqueId(ctypes.Structure):
    """``typedef struct { char internal[NCCL_UNIQUE_ID_BYTES]; } ncclUniqueId;`` (passed by value).

    It travels between processes as 128 plain bytes (:meth:`to_bytes`/:meth:`from_bytes`).
    """

    _fields_ = [("internal", ctypes.c_ubyte * UNIQUE_ID_BYTES)]

    def to_bytes(self) -> bytes:
        return bytes(self.internal)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> NcclUniqueId:
        """Raises :class:`BufferMismatchError` unless ``data`` is exactly 128 bytes."""
        raw = bytes(data)
        if len(raw) != UNIQUE_ID_BYTES:
            raise BufferMismatchError(f"an NCCL unique id is {UNIQUE_ID_BYTES} bytes, got {len(raw)}")
        return cls.from_buffer_copy(raw)


class NcclConfig(ctypes.Structure):
    """The NCCL 2.14 prefix of ``ncclConfig_t`` (the struct only ever grows at its end).

    NCCL copies ``min(size, sizeof(its own ncclConfig_t))`` bytes, checks ``magic``, and resets
    every field newer than ``version`` to its default; with ``version`` = 2.14.0 that leaves
    ``blocking`` as the one field it honours (2.17+ also resets ``cgaClusterSize``, ``minCTAs``,
    ``maxCTAs`` and ``netName``, which 2.14-2.16 read: they are left unset here). A non-blocking
    communicator built this way was seen working with NCCL 2.28.9 on an H200 (the team's
    design notes; this binding itself has not run on a GPU yet). ``NCCL_COMM_BLOCKING`` in the environment overrides
    ``blocking``; :class:`Communicator` copes with either mode.
    """

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
        ("cgaClusterSize", ctypes.c_int),
        ("minCTAs", ctypes.c_int),
        ("maxCTAs", ctypes.c_int),
        ("netName", ctypes.c_char_p),
    ]

    @classmethod
    def make(cls, *, blocking: bool) -> NcclConfig:
        """``NCCL_CONFIG_INITIALIZER`` for version 2.14.0, with ``blocking`` set (0 or 1)."""
        return cls(
            ctypes.sizeof(cls),
            API_MAGIC,
            CONFIG_VERSION,
            1 if blocking else 0,
            CONFIG_UNDEF_INT,
            CONFIG_UNDEF_INT,
            CONFIG_UNDEF_INT,
            None,
        )


class NcclWaitSignalDesc(ctypes.Structure):
    """``ncclWaitSignalDesc_t`` (NCCL 2.29+): wait for ``opCnt`` signals from ``peer``."""

    _fields_ = [
        ("opCnt", ctypes.c_int),
        ("peer", ctypes.c_int),
        ("sigIdx", ctypes.c_int),
        ("ctx", ctypes.c_int),
    ]


# ---------------------------------------------------------------------------------------------
# Function tables
# ---------------------------------------------------------------------------------------------


class Function(NamedTuple):
    """One row of :data:`REQUIRED_FUNCTIONS`."""

    name: str
    restype: Any
    argtypes: tuple[Any, ...]


class OptionalFunction(NamedTuple):
    """One row of :data:`OPTIONAL_FUNCTIONS`: usable when exported and NCCL >= ``since``."""

    name: str
    restype: Any
    argtypes: tuple[Any, ...]
    since: tuple[int, int, int]


_result_t = ctypes.c_int  # ncclResult_t
_comm_t = ctypes.c_void_p  # ncclComm_t (struct ncclComm*)
_stream_t = ctypes.c_void_p  # cudaStream_t
_dtype_t = ctypes.c_int  # ncclDataType_t
_window_t = ctypes.c_void_p  # ncclWindow_t (struct ncclWindow_vidmem*)
_int_p = ctypes.POINTER(ctypes.c_int)

#: Present in every NCCL this binding accepts (ncclGetLastError makes that 2.13 or later).
REQUIRED_FUNCTIONS: tuple[Function, ...] = (
    # ncclResult_t ncclGetVersion(int *version);
    Function("ncclGetVersion", _result_t, (_int_p,)),
    # ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId);
    Function("ncclGetUniqueId", _result_t, (ctypes.POINTER(NcclUniqueId),)),
    # const char* ncclGetErrorString(ncclResult_t result);
    Function("ncclGetErrorString", ctypes.c_char_p, (_result_t,)),
    # const char* ncclGetLastError(ncclComm_t comm);
    Function("ncclGetLastError", ctypes.c_char_p, (_comm_t,)),
    # ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank);
    Function("ncclCommInitRank", _result_t, (ctypes.POINTER(_comm_t), ctypes.c_int, NcclUniqueId, ctypes.c_int)),
    # ncclResult_t ncclCommDestroy(ncclComm_t comm);
    Function("ncclCommDestroy", _result_t, (_comm_t,)),
    # ncclResult_t ncclCommCount(const ncclComm_t comm, int* count);
    Function("ncclCommCount", _result_t, (_comm_t, _int_p)),
    # ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank);
    Function("ncclCommUserRank", _result_t, (_comm_t, _int_p)),
    # ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device);
    Function("ncclCommCuDevice", _result_t, (_comm_t, _int_p)),
    # ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
    #     ncclComm_t comm, cudaStream_t stream);
    Function("ncclSend", _result_t, (ctypes.c_void_p, ctypes.c_size_t, _dtype_t, ctypes.c_int, _comm_t, _stream_t)),
    # ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
    #     ncclComm_t comm, cudaStream_t stream);
    Function("ncclRecv", _result_t, (ctypes.c_void_p, ctypes.c_size_t, _dtype_t, ctypes.c_int, _comm_t, _stream_t)),
    # ncclResult_t ncclGroupStart();
    Function("ncclGroupStart", _result_t, ()),
    # ncclResult_t ncclGroupEnd();
    Function("ncclGroupEnd", _result_t, ()),
)

#: Resolved at load time; :meth:`NcclLibrary.has` tells whether one can be called.
OPTIONAL_FUNCTIONS: tuple[OptionalFunction, ...] = (
    # ncclResult_t ncclCommAbort(ncclComm_t comm);
    OptionalFunction("ncclCommAbort", _result_t, (_comm_t,), (2, 4, 0)),
    # ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError);
    OptionalFunction("ncclCommGetAsyncError", _result_t, (_comm_t, ctypes.POINTER(_result_t)), (2, 4, 0)),
    # ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
    #     ncclConfig_t* config);
    OptionalFunction(
        "ncclCommInitRankConfig",
        _result_t,
        (ctypes.POINTER(_comm_t), ctypes.c_int, NcclUniqueId, ctypes.c_int, ctypes.POINTER(NcclConfig)),
        (2, 14, 0),
    ),
    # ncclResult_t ncclCommFinalize(ncclComm_t comm);
    OptionalFunction("ncclCommFinalize", _result_t, (_comm_t,), (2, 14, 0)),
    # ncclResult_t ncclCommWindowRegister(ncclComm_t comm, void* buff, size_t size, ncclWindow_t* win,
    #     int winFlags);
    OptionalFunction(
        "ncclCommWindowRegister",
        _result_t,
        (_comm_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(_window_t), ctypes.c_int),
        (2, 27, 0),
    ),
    # ncclResult_t ncclCommWindowDeregister(ncclComm_t comm, ncclWindow_t win);
    OptionalFunction("ncclCommWindowDeregister", _result_t, (_comm_t, _window_t), (2, 27, 0)),
    # ncclResult_t ncclPutSignal(const void* localbuff, size_t count, ncclDataType_t datatype, int peer,
    #     ncclWindow_t peerWin, size_t peerWinOffset, int sigIdx, int ctx, unsigned int flags,
    #     ncclComm_t comm, cudaStream_t stream);
    # (Upstream NCCL's signature; other libraries exporting the same name, e.g. NCCLX, differ.)
    OptionalFunction(
        "ncclPutSignal",
        _result_t,
        (
            ctypes.c_void_p,
            ctypes.c_size_t,
            _dtype_t,
            ctypes.c_int,
            _window_t,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_uint,
            _comm_t,
            _stream_t,
        ),
        (2, 29, 0),
    ),
    # ncclResult_t ncclSignal(int peer, int sigIdx, int ctx, unsigned int flags, ncclComm_t comm,
    #     cudaStream_t stream);
    OptionalFunction(
        "ncclSignal",
        _result_t,
        (ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_uint, _comm_t, _stream_t),
        (2, 29, 0),
    ),
    # ncclResult_t ncclWaitSignal(int nDesc, ncclWaitSignalDesc_t* signalDescs, ncclComm_t comm,
    #     cudaStream_t stream);
    OptionalFunction(
        "ncclWaitSignal",
        _result_t,
        (ctypes.c_int, ctypes.POINTER(NcclWaitSignalDesc), _comm_t, _stream_t),
        (2, 29, 0),
    ),
)


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


class NcclError(TransportError):
    """An NCCL call failed.

    ``code`` is the :class:`NcclResult` (a plain ``int`` for a code this binding does not know),
    ``code_name`` its C name, ``what`` the function that failed, ``message`` NCCL's last-error text
    followed by ``ncclGetErrorString``. ``str()``: ``"ncclSend: ncclInvalidUsage (5): <message>"``.

    NCCL keeps one last-error text per process (per communicator in some versions) and never
    clears it, so on a busy process it may describe an earlier failure.
    """

    def __init__(self, code: int, what: str, message: str = "") -> None:
        super().__init__(int(code), what, message)
        self.code: NcclResult | int = _as_result(code)
        self.code_name = _result_name(code)
        self.what = what
        self.message = message

    def __str__(self) -> str:
        head = f"{self.what}: {self.code_name} ({int(self.code)})"
        return f"{head}: {self.message}" if self.message else head

    @classmethod
    def from_result(cls, code: int, lib: NcclLibrary, what: str, handle: int | None = None) -> NcclError:
        """The error for ``code`` returned by ``what``, with NCCL's explanation attached."""
        last = lib._last_error(handle)
        explanation = lib.error_string(code)
        message = f"{last}; {explanation}" if last else explanation
        return cls(code, what, message)


class LoadAttempt(NamedTuple):
    """One step of the search for NCCL: which, and what happened (``"loaded ..."`` for the winner)."""

    source: NcclSource
    reason: str


class NcclUnavailableError(PlaneUnavailableError):
    """NCCL (or one of its functions) cannot be used here; ``attempts`` lists what was tried."""

    def __init__(self, message: str, attempts: Sequence[LoadAttempt] = ()) -> None:
        super().__init__(message)
        self.attempts: list[LoadAttempt] = list(attempts)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0], self.attempts))


class _ClosedError(NcclError):
    """A call on a communicator that was already closed or aborted."""


class _CandidateError(Exception):
    """A search step failed; its text becomes the step's reason."""


def check(result: int, lib: NcclLibrary, what: str) -> None:
    """Raise :class:`NcclError` unless ``result`` is ``ncclSuccess``.

    ``ncclInProgress`` is an error here too: code that drives a non-blocking communicator goes
    through :class:`Communicator`, which waits for it.
    """
    if result != NcclResult.SUCCESS:
        raise NcclError.from_result(result, lib, what)


# ---------------------------------------------------------------------------------------------
# The loaded library
# ---------------------------------------------------------------------------------------------


class NcclSource(str, enum.Enum):
    """Where the loaded NCCL came from (the steps of :func:`load_nccl`, in order)."""

    EXPLICIT = "explicit"
    TORCH = "torch"
    PATHFINDER = "pathfinder"
    SYSTEM = "system"


_ALL_NAMES = frozenset(f.name for f in REQUIRED_FUNCTIONS) | frozenset(f.name for f in OPTIONAL_FUNCTIONS)


class NcclLibrary:
    """A loaded ``libnccl`` with its functions typed. Build it with :func:`load_nccl`.

    Attributes: ``path`` (the file the dynamic loader mapped), ``source`` (:class:`NcclSource`),
    ``attempts`` (every search step with its reason, the winner last), ``version`` (a tuple),
    ``version_code`` (as ``ncclGetVersion`` returns it), ``version_string``.
    """

    def __init__(self, cdll: ctypes.CDLL, *, path: str, source: NcclSource) -> None:
        self.path = path
        self.source = source
        self.attempts: tuple[LoadAttempt, ...] = ()
        self._cdll = cdll
        self._fns: dict[str, Any] = {}
        self._unavailable: dict[str, str] = {}

        missing = []
        for f in REQUIRED_FUNCTIONS:
            fn = self._symbol(f.name)
            if fn is None:
                missing.append(f.name)
                continue
            fn.restype, fn.argtypes = f.restype, list(f.argtypes)
            self._fns[f.name] = fn
        if missing:
            raise _CandidateError(f"{path} is not a usable NCCL: missing required functions {', '.join(missing)}")

        code = ctypes.c_int(0)
        rc = self._fns["ncclGetVersion"](ctypes.byref(code))
        if rc != NcclResult.SUCCESS:
            raise _CandidateError(f"{path}: ncclGetVersion returned {_result_name(rc)} ({rc})")
        try:
            self.version = parse_version(code.value)
        except ValueError as exc:
            raise _CandidateError(f"{path}: {exc}") from None
        self.version_code = code.value
        self.version_string = _dotted(self.version)

        for opt in OPTIONAL_FUNCTIONS:
            if self.version < opt.since:
                self._unavailable[opt.name] = f"needs NCCL >= {_dotted(opt.since)}"
                continue
            fn = self._symbol(opt.name)
            if fn is None:
                self._unavailable[opt.name] = "not exported by the library"
                continue
            fn.restype, fn.argtypes = opt.restype, list(opt.argtypes)
            self._fns[opt.name] = fn

    def _symbol(self, name: str) -> Any:
        try:
            return self._cdll[name]  # a fresh function object each time: types set here stay ours
        except AttributeError:
            return None

    def __repr__(self) -> str:
        return f"<NcclLibrary NCCL {self.version_string} from {self.path} ({self.source.value})>"

    # -- functions ---------------------------------------------------------------------------

    def has(self, name: str) -> bool:
        """Whether ``name`` (from either table) can be called with this library.

        ``ValueError`` for a name in neither table (a typo, not a missing feature).
        """
        if name not in _ALL_NAMES:
            raise ValueError(f"{name} is in neither table of {__name__}")
        return name in self._fns

    @property
    def unavailable(self) -> dict[str, str]:
        """Optional functions that cannot be called, each with the reason."""
        return dict(self._unavailable)

    def _fn(self, name: str) -> Any:
        fn = self._fns.get(name)
        if fn is None:
            if name not in _ALL_NAMES:
                raise ValueError(f"{name} is in neither table of {__name__}")
            raise NcclUnavailableError(
                f"{name} is not available in NCCL {self.version_string} loaded from {self.path}: "
                f"{self._unavailable.get(name, 'unknown')}"
            )
        return fn

    # -- calls that need no communicator -----------------------------------------------------

    def get_unique_id(self) -> bytes:
        """``ncclGetUniqueId``: 128 bytes for rank 0 to hand to every rank (over the control stream).

        Opens NCCL's bootstrap listening socket on the first call in the process; needs no GPU.
        """
        uid = NcclUniqueId()
        check(self._fn("ncclGetUniqueId")(ctypes.byref(uid)), self, "ncclGetUniqueId")
        return uid.to_bytes()

    def error_string(self, code: int) -> str:
        """``ncclGetErrorString``: NCCL's generic text for a result code."""
        raw = self._fn("ncclGetErrorString")(int(code))
        return raw.decode("utf-8", "replace") if raw else ""

    def last_error(self) -> str:
        """``ncclGetLastError(NULL)``: the text of the last NCCL error in this process (``""`` if none)."""
        return self._last_error(None)

    def _last_error(self, handle: int | None) -> str:
        raw = self._fn("ncclGetLastError")(handle)
        return raw.decode("utf-8", "replace").strip() if raw else ""

    def describe(self) -> str:
        """Several lines for ``python -m transport doctor``: where NCCL came from, why, what it offers."""
        lines = [f"NCCL {self.version_string} from {self.path} (via {self.source.value})"]
        lines += [f"  {a.source.value}: {a.reason}" for a in self.attempts]
        for opt in OPTIONAL_FUNCTIONS:
            state = "yes" if opt.name in self._fns else f"no ({self._unavailable[opt.name]})"
            lines.append(f"  {opt.name} (NCCL >= {_dotted(opt.since)}): {state}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Locating and loading
# ---------------------------------------------------------------------------------------------

_cache: dict[str | None, NcclLibrary] = {}
_cache_lock = threading.Lock()


def load_nccl(path: str | os.PathLike[str] | None = None, *, cached: bool = True) -> NcclLibrary:
    """Find, load and check NCCL; see the module docstring for the search order.

    ``path`` (or ``$TRANSPORT_NCCL_LIBRARY`` when ``path`` is None) names the library explicitly:
    a file path or a name for the dynamic loader. An explicit choice that fails raises at once.

    Successful loads are cached per explicit path (a shared library stays loaded anyway);
    ``cached=False`` searches again. Failures are never cached. Raises
    :class:`NcclUnavailableError` naming every step tried and why it failed. Never returns a
    stand-in: without NCCL there is no :class:`NcclLibrary`.
    """
    if path is not None:
        explicit: str | None = os.fspath(path)
        origin = "path argument"
    else:
        explicit = os.environ.get(ENV_VAR) or None
        origin = f"${ENV_VAR}"
    with _cache_lock:
        if cached and explicit in _cache:
            return _cache[explicit]
        lib = _search(explicit, origin)
        if cached:
            _cache[explicit] = lib
    log.info("NCCL %s loaded from %s (%s)", lib.version_string, lib.path, lib.source.value)
    return lib


def _search(explicit: str | None, origin: str) -> NcclLibrary:
    attempts: list[LoadAttempt] = []
    if explicit is not None:
        try:
            return _open(NcclSource.EXPLICIT, explicit, f"named by {origin}", attempts)
        except _CandidateError as exc:
            attempts.append(LoadAttempt(NcclSource.EXPLICIT, f"{origin} = {explicit!r}: {exc}"))
            raise NcclUnavailableError(
                f"NCCL named by {origin} ({explicit!r}) cannot be used: {exc}. "
                f"Nothing else was tried: fix or unset the explicit choice.",
                attempts,
            ) from None
    attempts.append(LoadAttempt(NcclSource.EXPLICIT, f"no path argument and ${ENV_VAR} is not set"))
    # Looked up at call time, so that tests can replace a step.
    steps = (
        (NcclSource.TORCH, _locate_in_process),
        (NcclSource.PATHFINDER, _locate_with_pathfinder),
        (NcclSource.SYSTEM, _locate_system),
    )
    for source, locate in steps:
        try:
            candidate, how = locate()
            return _open(source, candidate, how, attempts)
        except _CandidateError as exc:
            attempts.append(LoadAttempt(source, str(exc)))
    detail = "\n".join(f"  {a.source.value}: {a.reason}" for a in attempts)
    raise NcclUnavailableError(
        "NCCL could not be loaded; tried, in order:\n"
        f"{detail}\n"
        f"Install nvidia-nccl-cu12 (or -cu13), or set ${ENV_VAR} to the path of libnccl.so.2.",
        attempts,
    )


def _open(source: NcclSource, candidate: str, how: str, attempts: list[LoadAttempt]) -> NcclLibrary:
    try:
        cdll = ctypes.CDLL(candidate)
    except OSError as exc:
        raise _CandidateError(f"cannot load {candidate} ({how}): {exc}") from None
    real = _mapped_file(cdll) or candidate
    lib = NcclLibrary(cdll, path=real, source=source)
    attempts.append(LoadAttempt(source, f"loaded {real} ({how}), NCCL {lib.version_string}"))
    lib.attempts = tuple(attempts)
    try:
        others = {os.path.realpath(f) for f in _mapped_nccl_files()} - {os.path.realpath(real)}
    except OSError:
        others = set()
    if others:
        # Legal (each copy has its own state) but a likely surprise: torch's communicators and ours
        # then run on different NCCL builds.
        log.warning("NCCL %s loaded from %s while other NCCL copies are mapped: %s", lib.version_string, real, others)
    return lib


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _mapped_file(cdll: ctypes.CDLL) -> str | None:
    """The file the loader actually mapped for ``cdll`` (``dladdr`` of ``ncclGetVersion``)."""
    try:
        dladdr = ctypes.CDLL(None).dladdr
        fn = cdll["ncclGetVersion"]
    except (OSError, AttributeError):
        return None
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    dladdr.restype = ctypes.c_int
    info = _DlInfo()
    if not dladdr(ctypes.cast(fn, ctypes.c_void_p), ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.fsdecode(info.dli_fname)


def _mapped_nccl_files() -> list[str]:
    """Files named libnccl.so* mapped into this process, in map order (raises OSError off Linux)."""
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
        maps = f.read()
    found: list[str] = []
    for line in maps.splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6 and os.path.basename(fields[5]).startswith("libnccl.so") and fields[5] not in found:
            found.append(fields[5])
    return found


def _locate_in_process() -> tuple[str, str]:
    try:
        found = _mapped_nccl_files()
    except OSError as exc:
        raise _CandidateError(f"cannot read /proc/self/maps ({exc.strerror}); step skipped") from None
    if not found:
        raise _CandidateError(
            "no libnccl.so* is mapped in this process (torch is a CPU build, links NCCL statically, "
            "or has not loaded it)"
        )
    if len(found) > 1:
        log.warning("several NCCL libraries are mapped in this process: %s; using the first", found)
    return found[0], "already mapped in this process"


def _locate_with_pathfinder() -> tuple[str, str]:
    try:
        from cuda import pathfinder
    except ImportError as exc:
        raise _CandidateError(f"cuda.pathfinder is not installed ({exc})") from None
    try:
        loaded = pathfinder.load_nvidia_dynamic_lib("nccl")
    except Exception as exc:  # DynamicLibNotFoundError and friends; all mean "not this way"
        text = " ".join(str(exc).split())
        raise _CandidateError(f"cuda.pathfinder: {type(exc).__name__}: {text[:500]}") from None
    if not loaded.abs_path:
        raise _CandidateError("cuda.pathfinder loaded NCCL but did not report its path")
    return loaded.abs_path, f"cuda.pathfinder, found via {loaded.found_via}"


def _locate_system() -> tuple[str, str]:
    return SONAME, "dynamic loader search"


# ---------------------------------------------------------------------------------------------
# Communicator
# ---------------------------------------------------------------------------------------------

_POLL_FIRST_S = 1e-5
_POLL_MAX_S = 2e-3
_ABORT_LOCK_WAIT_S = 2.0


def _warn_unclosed(handle: int, version: str) -> None:
    warnings.warn(
        f"NCCL {version} communicator 0x{handle:x} was garbage-collected without close() or abort(); "
        "its GPU and network resources stay allocated until the process exits",
        ResourceWarning,
        stacklevel=2,
    )


@contextlib.contextmanager
def _current_device(device: int | None) -> Iterator[None]:
    """Make ``device`` the current CUDA device for the block (torch imported only if one is given)."""
    if device is None:
        yield
        return
    import torch

    if not torch.cuda.is_available():
        raise NcclUnavailableError(f"device={device} was requested but torch sees no CUDA device")
    with torch.cuda.device(device):
        yield


#: Held around every NCCL call a :class:`Communicator` makes (init, send/recv, group start/end,
#: queries, finalize/destroy/abort), across all communicators of the process: NCCL's "Thread
#: Safety" section makes concurrent calls on communicators of one device unsafe, and a channel's
#: calls come from several threads (the event loop, reader threads, link set-up threads). One lock
#: for the process rather than one per device: a process drives one device in practice, and every
#: call it guards returns at once on a non-blocking communicator (the waits for ``ncclInProgress``
#: poll outside it). A *blocking* communicator's calls may wait without bound while holding it.
NCCL_LOCK = threading.RLock()


class Communicator:
    """One NCCL communicator (``ncclComm_t``), owned; build it with :meth:`init_rank`.

    Blocking behaviour. With ``blocking=False`` (the default, what channels use) NCCL never blocks
    the calling thread: calls that return ``ncclInProgress`` are finished here by polling
    ``ncclCommGetAsyncError`` until a deadline (the call's ``timeout``, else the communicator's).
    On a deadline the communicator is aborted and :class:`~transport.errors.TransportTimeoutError`
    is raised; when NCCL reports an asynchronous error (``ncclRemoteError`` when the peer died...)
    it is aborted and :class:`NcclError` is raised. An error returned directly by a call (bad
    arguments) raises :class:`NcclError` and leaves the communicator usable. With
    ``blocking=True`` NCCL itself may wait without bound (init until every rank joins,
    ``ncclGroupEnd`` until connections are set up, close until the node's ranks finalize);
    timeouts cannot be enforced in that mode.

    Threads: use a communicator from one thread at a time (NCCL's rule). :meth:`abort` is the
    exception: any thread may call it, and it waits at most 2 s for a call in progress to return
    before aborting anyway (which is how NCCL unblocks a stuck blocking call).

    Lifetime: :meth:`close` (finalize, then destroy) and :meth:`abort` are idempotent; after either,
    every call raises :class:`NcclError` (``ncclInvalidUsage``). A communicator dropped without
    either is not torn down (teardown may need the peers); a ``ResourceWarning`` says so.
    """

    def __init__(self, lib: NcclLibrary, handle: int, *, blocking: bool, timeout: float) -> None:
        # Private: use init_rank(). Takes ownership of ``handle``.
        self._lib = lib
        self._handle: int | None = handle
        self._blocking = blocking
        self._timeout = timeout
        self._lock = NCCL_LOCK  # (process-wide: see NCCL_LOCK)
        self._tls = threading.local()
        self._nranks = -1
        self._rank = -1
        self._device = -1
        self._finalizer = weakref.finalize(self, _warn_unclosed, handle, lib.version_string)

    @classmethod
    def init_rank(
        cls,
        lib: NcclLibrary,
        nranks: int,
        unique_id: bytes | bytearray | memoryview,
        rank: int,
        *,
        blocking: bool = False,
        device: int | None = None,
        timeout: float = 60.0,
    ) -> Communicator:
        """Join communicator ``unique_id`` as ``rank`` of ``nranks`` on ``device`` (default: current).

        Uses ``ncclCommInitRankConfig`` when the library has it (required for ``blocking=False``:
        :class:`NcclUnavailableError` otherwise, never a silent switch to blocking mode), else
        ``ncclCommInitRank``. Non-blocking: returns once NCCL reports the communicator ready, or
        aborts it and raises :class:`TransportTimeoutError` (phase ``connect``) after ``timeout``
        seconds, or :class:`NcclError` if NCCL fails. ``timeout`` is also the default deadline of
        every later call. Blocking: returns when every rank has joined, however long that takes.
        """
        init_name = "ncclCommInitRankConfig" if lib.has("ncclCommInitRankConfig") else "ncclCommInitRank"
        if nranks < 1 or not 0 <= rank < nranks:
            raise NcclError(NcclResult.INVALID_ARGUMENT, init_name, f"rank {rank} is not in 0..{nranks - 1}")
        if timeout <= 0:
            raise NcclError(NcclResult.INVALID_ARGUMENT, init_name, f"timeout must be positive, got {timeout}")
        uid = NcclUniqueId.from_bytes(unique_id)
        if not blocking:
            for name in ("ncclCommInitRankConfig", "ncclCommGetAsyncError", "ncclCommAbort"):
                if not lib.has(name):
                    raise NcclUnavailableError(
                        f"a non-blocking NCCL communicator needs {name}, which NCCL {lib.version_string} "
                        f"from {lib.path} lacks ({lib.unavailable.get(name)}); pass blocking=True to "
                        "accept unbounded waits"
                    )
        if not blocking and os.environ.get("NCCL_COMM_BLOCKING") == "1":
            log.warning("NCCL_COMM_BLOCKING=1 overrides blocking=False: NCCL calls may now wait without a deadline")
        deadline = time.monotonic() + timeout
        out = _comm_t()
        with _current_device(device), NCCL_LOCK:
            if init_name == "ncclCommInitRankConfig":
                config = NcclConfig.make(blocking=blocking)
                rc = lib._fn(init_name)(ctypes.byref(out), nranks, uid, rank, ctypes.byref(config))
            else:
                rc = lib._fn(init_name)(ctypes.byref(out), nranks, uid, rank)
        handle = out.value
        if rc not in (NcclResult.SUCCESS, NcclResult.IN_PROGRESS):
            error = NcclError.from_result(rc, lib, init_name, handle)
            if handle:  # a non-blocking init can fail after creating the communicator
                cls(lib, handle, blocking=blocking, timeout=timeout).abort()
            raise error
        if not handle:
            raise NcclError(NcclResult.INTERNAL_ERROR, init_name, "NCCL reported success but returned no communicator")
        # NCCL_COMM_BLOCKING in the environment overrides the config: an in-progress answer means
        # the communicator is non-blocking whatever was asked for.
        comm = cls(lib, handle, blocking=blocking and rc != NcclResult.IN_PROGRESS, timeout=timeout)
        try:
            if not comm._blocking:
                comm._wait_ready(deadline, init_name, Phase.CONNECT)
            comm._nranks = comm._query_int("ncclCommCount")
            comm._rank = comm._query_int("ncclCommUserRank")
            comm._device = comm._query_int("ncclCommCuDevice")
        except BaseException:
            comm.abort()
            raise
        return comm

    # -- state -------------------------------------------------------------------------------

    @property
    def lib(self) -> NcclLibrary:
        return self._lib

    @property
    def nranks(self) -> int:
        return self._nranks

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def device(self) -> int:
        """The CUDA device ordinal NCCL bound this communicator to."""
        return self._device

    @property
    def blocking(self) -> bool:
        return self._blocking

    @property
    def closed(self) -> bool:
        return self._handle is None

    def __repr__(self) -> str:
        state = "closed" if self._handle is None else ("blocking" if self._blocking else "non-blocking")
        return f"<Communicator rank {self._rank}/{self._nranks} device {self._device} {state} NCCL {self._lib.version_string}>"

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _live(self, what: str) -> int:
        handle = self._handle
        if handle is None:
            raise _ClosedError(NcclResult.INVALID_USAGE, what, "the communicator is closed (aborted or destroyed)")
        return handle

    def _error(self, rc: int, what: str) -> NcclError:
        # Only a live handle goes to ncclGetLastError; after abort/destroy it is freed memory.
        return NcclError.from_result(rc, self._lib, what, self._handle)

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (self._timeout if timeout is None else timeout)

    def _query_int(self, name: str) -> int:
        value = ctypes.c_int(-1)
        with self._lock:
            handle = self._live(name)
            rc = self._lib._fn(name)(handle, ctypes.byref(value))
        if rc != NcclResult.SUCCESS:
            raise self._error(rc, name)
        return value.value

    # -- asynchronous state ------------------------------------------------------------------

    def async_error(self) -> NcclResult | int:
        """``ncclCommGetAsyncError``: ``SUCCESS``, ``IN_PROGRESS`` (an operation is still being
        set up) or the error that broke the communicator. Does not block, does not raise for the
        state it reports (only if the query itself fails)."""
        state = _result_t(0)
        with self._lock:
            handle = self._live("ncclCommGetAsyncError")
            rc = self._lib._fn("ncclCommGetAsyncError")(handle, ctypes.byref(state))
        if rc != NcclResult.SUCCESS:
            raise self._error(rc, "ncclCommGetAsyncError")
        return _as_result(state.value)

    def wait_ready(self, timeout: float | None = None) -> None:
        """Poll until NCCL leaves ``ncclInProgress``; abort and raise on a deadline or an error."""
        self._wait_ready(self._deadline(timeout), "ncclCommGetAsyncError", Phase.TRANSFER)

    def _wait_ready(self, deadline: float, what: str, phase: Phase) -> None:
        delay = _POLL_FIRST_S
        while True:
            state = self.async_error()
            if state == NcclResult.SUCCESS:
                return
            if state != NcclResult.IN_PROGRESS:
                error = self._error(state, what)
                self.abort()
                raise error
            now = time.monotonic()
            if now >= deadline:
                self.abort()
                raise TransportTimeoutError(
                    f"{what}: NCCL still in progress at the deadline (rank {self._rank} of {self._nranks}); "
                    "the communicator was aborted",
                    phase,
                )
            time.sleep(min(delay, deadline - now))
            delay = min(delay * 2, _POLL_MAX_S)

    def _group_depth(self) -> int:
        return int(getattr(self._tls, "depth", 0))

    def _settle(self, rc: int, what: str, timeout: float | None) -> None:
        if rc == NcclResult.SUCCESS:
            return
        if rc == NcclResult.IN_PROGRESS and not self._blocking:
            if self._group_depth() == 0:  # inside a group, the outermost ncclGroupEnd waits
                self._wait_ready(self._deadline(timeout), what, Phase.TRANSFER)
            return
        raise self._error(rc, what)

    # -- point to point ----------------------------------------------------------------------

    def send(self, ptr: int, nbytes: int, peer: int, stream: int = 0, *, timeout: float | None = None) -> None:
        """``ncclSend`` of ``nbytes`` bytes at device address ``ptr`` to rank ``peer`` on ``stream``.

        Returns once NCCL has queued the transfer on ``stream`` (inside :meth:`group`: once it has
        recorded it); completion is observed on the stream, not here. Waits as described in the
        class docstring, bounded by ``timeout``.
        """
        self._p2p("ncclSend", ptr, nbytes, peer, stream, timeout)

    def recv(self, ptr: int, nbytes: int, peer: int, stream: int = 0, *, timeout: float | None = None) -> None:
        """``ncclRecv`` of ``nbytes`` bytes into device address ``ptr`` from ``peer``; as :meth:`send`."""
        self._p2p("ncclRecv", ptr, nbytes, peer, stream, timeout)

    def _p2p(self, what: str, ptr: int, nbytes: int, peer: int, stream: int, timeout: float | None) -> None:
        if ptr < 0 or nbytes < 0 or (nbytes and not ptr):
            raise NcclError(NcclResult.INVALID_ARGUMENT, what, f"bad buffer: ptr=0x{ptr:x}, nbytes={nbytes}")
        if not 0 <= peer < self._nranks:
            raise NcclError(NcclResult.INVALID_ARGUMENT, what, f"peer {peer} is not in 0..{self._nranks - 1}")
        if stream < 0:
            raise NcclError(NcclResult.INVALID_ARGUMENT, what, f"bad stream handle {stream}")
        with self._lock:
            handle = self._live(what)
            rc = self._lib._fn(what)(ptr, nbytes, BYTES, peer, handle, stream)
        self._settle(rc, what, timeout)

    @contextlib.contextmanager
    def group(self, *, timeout: float | None = None) -> Iterator[Communicator]:
        """``ncclGroupStart`` ... ``ncclGroupEnd`` around the block (sends and receives that must
        progress together, a send to oneself with its receive).

        The outermost ``ncclGroupEnd`` launches the group; in non-blocking mode its
        ``ncclInProgress`` is waited for, bounded by ``timeout``. If the block raises,
        ``ncclGroupEnd`` still runs (NCCL cannot cancel a group), launching whatever was queued,
        and the block's exception propagates: abort the communicator unless the peer is known to
        post the matching operations.
        """
        self._live("ncclGroupStart")
        with self._lock:
            rc = self._lib._fn("ncclGroupStart")()
        check(rc, self._lib, "ncclGroupStart")
        depth = self._group_depth()
        self._tls.depth = depth + 1
        body_ok = False
        try:
            yield self
            body_ok = True
        finally:
            self._tls.depth = depth
            with self._lock:
                rc = self._lib._fn("ncclGroupEnd")()
            if body_ok:
                self._settle(rc, "ncclGroupEnd", timeout)
            elif rc not in (NcclResult.SUCCESS, NcclResult.IN_PROGRESS):
                log.warning("ncclGroupEnd after a failed group body: %s", self._error(rc, "ncclGroupEnd"))

    # -- teardown ----------------------------------------------------------------------------

    def abort(self) -> None:
        """``ncclCommAbort``: stop everything in flight and free the communicator. Idempotent.

        Local: needs no peer. Bounded: NCCL's abort flag makes its internal waits give up. The
        communicator is freed before ``ncclCommAbort`` returns (NCCL reclaims it inline outside a
        group), so its handle is never touched again, not even to poll an error. A failure is
        logged, not raised, since abort runs on paths that are already handling an error.
        """
        acquired = self._lock.acquire(timeout=_ABORT_LOCK_WAIT_S)
        try:
            handle = self._handle
            if handle is None:
                return
            fn = self._lib._fn("ncclCommAbort")  # raises, communicator kept, if NCCL has no abort
            self._handle = None
            self._finalizer.detach()
            rc = fn(handle)
            if rc not in (NcclResult.SUCCESS, NcclResult.IN_PROGRESS):  # (older NCCL: in progress, finishing alone)
                log.warning("%s", NcclError.from_result(rc, self._lib, "ncclCommAbort"))
        finally:
            if acquired:
                self._lock.release()

    def close(self, *, timeout: float | None = None) -> None:
        """``ncclCommFinalize`` (when available) then ``ncclCommDestroy``. Idempotent.

        Finalize waits for this rank's operations to finish and may wait for the other ranks on
        this node. Non-blocking: bounded by ``timeout``; at the deadline, or if NCCL fails, the
        communicator is aborted and the error raised. Blocking: may wait without bound; call
        :meth:`abort` instead when a peer may be gone.
        """
        deadline = self._deadline(timeout)
        try:
            if self._lib.has("ncclCommFinalize"):
                with self._lock:
                    if self._handle is None:
                        return
                    rc = self._lib._fn("ncclCommFinalize")(self._handle)
                if rc == NcclResult.IN_PROGRESS and not self._blocking:
                    # Polls take the lock one at a time, so abort() from another thread gets in.
                    self._wait_ready(deadline, "ncclCommFinalize", Phase.TRANSFER)
                elif rc != NcclResult.SUCCESS:
                    raise self._error(rc, "ncclCommFinalize")
            with self._lock:
                handle = self._handle
                if handle is None:
                    return
                self._handle = None
                self._finalizer.detach()
                rc = self._lib._fn("ncclCommDestroy")(handle)
            if rc != NcclResult.SUCCESS:
                raise NcclError.from_result(rc, self._lib, "ncclCommDestroy")
        except _ClosedError:
            return  # aborted by another thread meanwhile: closed all the same
        except NcclError:
            self.abort()  # no-op if already aborted or destroyed
            raise

    destroy = close
