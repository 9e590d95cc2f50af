"""NCCL's C surface as Python data: constants, result codes, data types, structs, function tables.

Each row of :data:`REQUIRED_FUNCTIONS` and :data:`OPTIONAL_FUNCTIONS` sits under the C prototype
it was copied from (``nccl.h`` of NCCL 2.32.3), and ``tests/test_nccl_binding.py`` checks the
argument counts against the header that ships in the wheel. Nothing here loads a library or
imports torch: :mod:`transport.cuda.nccl_loader` binds these rows to a loaded ``libnccl``, and
:mod:`transport.cuda.nccl_comm` drives a communicator through them.
"""

from __future__ import annotations

import ctypes
import enum
from typing import Any, NamedTuple

from ..errors import BufferMismatchError, InvalidTensorError

__all__ = [
    "API_MAGIC",
    "BYTES",
    "CONFIG_UNDEF_INT",
    "CONFIG_VERSION",
    "OPTIONAL_FUNCTIONS",
    "REQUIRED_FUNCTIONS",
    "UNIQUE_ID_BYTES",
    "Function",
    "NcclConfig",
    "NcclDataType",
    "NcclResult",
    "NcclUniqueId",
    "NcclWaitSignalDesc",
    "OptionalFunction",
    "nccl_dtype",
    "parse_version",
    "version_code",
]

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
