"""Finding and loading ``libnccl``: :func:`load_nccl`, :class:`NcclLibrary` and the binding's errors.

The first step that yields a working NCCL wins, and every step tried is recorded with its reason
in :attr:`NcclLibrary.attempts`:

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

The tables come from :mod:`transport.cuda.nccl_table`. Importing the module loads no shared
library; :func:`load_nccl` does, on its first call.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

from ..errors import PlaneUnavailableError, TransportError
from .nccl_table import (
    OPTIONAL_FUNCTIONS,
    REQUIRED_FUNCTIONS,
    NcclResult,
    NcclUniqueId,
    _as_result,
    _result_name,
    parse_version,
)

__all__ = [
    "ENV_VAR",
    "SONAME",
    "LoadAttempt",
    "NcclError",
    "NcclLibrary",
    "NcclSource",
    "NcclUnavailableError",
    "check",
    "load_nccl",
]

log = logging.getLogger(__name__)

#: Environment variable naming the NCCL shared library to load (a path, or a name for dlopen).
ENV_VAR = "TRANSPORT_NCCL_LIBRARY"
#: The name the ``system`` step asks the dynamic loader for.
SONAME = "libnccl.so.2"


def _dotted(version: tuple[int, int, int]) -> str:
    return ".".join(map(str, version))


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
    # (found_via: cuda-pathfinder >= 1.3 only)
    return loaded.abs_path, f"cuda.pathfinder, found via {getattr(loaded, 'found_via', 'a search it did not name')}"


def _locate_system() -> tuple[str, str]:
    return SONAME, "dynamic loader search"

