"""The NCCL binding (transport/cuda/nccl_lib.py: nccl_table, nccl_loader, nccl_comm) on a machine without a GPU.

What runs here: finding and loading libnccl (order, reasons, explicit choices that fail loudly),
the version, unique ids, error strings and NcclError, the function tables checked against the
nccl.h that ships in the wheel, the 2.14 ncclConfig_t prefix, and a real ncclCommInitRankConfig
that must fail with a typed error (no GPU) rather than crash or hang. The Communicator's
polling, deadlines, groups and teardown run against a scripted stand-in for the library. Real
communicators (send/recv on a GPU) are exercised by the GPU tests.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import importlib.util
import json
import os
import pickle
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from transport.cuda import nccl_lib as m
from transport.cuda import nccl_loader as loader
from transport.cuda.nccl_lib import (
    Communicator,
    NcclConfig,
    NcclDataType,
    NcclError,
    NcclResult,
    NcclSource,
    NcclUnavailableError,
    NcclUniqueId,
    NcclWaitSignalDesc,
)
from transport.errors import (
    BufferMismatchError,
    InvalidTensorError,
    Phase,
    PlaneUnavailableError,
    TransportError,
    TransportTimeoutError,
)

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the NCCL binding is Linux-only")


@pytest.fixture(scope="module")
def lib() -> m.NcclLibrary:
    return m.load_nccl()


def _run_python(code: str, env: dict[str, str] | None = None, timeout: float = 120) -> dict:
    """Run ``code`` in a fresh interpreter (clean process-global state); return its last JSON line."""
    full_env = {k: v for k, v in os.environ.items() if k != m.ENV_VAR}
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"exit status {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _nccl_header_path() -> Path:
    spec = importlib.util.find_spec("nvidia.nccl")
    for base in (spec.submodule_search_locations or []) if spec else []:
        header = Path(base) / "include" / "nccl.h"
        if header.is_file():
            return header
    pytest.skip("no nccl.h in an installed nvidia-nccl wheel")


def _nccl_header() -> str:
    return _nccl_header_path().read_text()


def _header_version(header: str) -> tuple[int, int, int]:
    return m.parse_version(int(re.search(r"#define NCCL_VERSION_CODE (\d+)", header).group(1)))


# ---------------------------------------------------------------------------------------------
# Import and load
# ---------------------------------------------------------------------------------------------


def test_importing_the_package_loads_nothing():
    out = _run_python(
        "import json, sys\n"
        "import transport\n"
        "before = set(sys.modules)\n"
        "maps_before = open('/proc/self/maps').read().count('libnccl')\n"
        "import transport.cuda\n"
        "new = sorted(set(sys.modules) - before)\n"
        "maps_after = open('/proc/self/maps').read().count('libnccl')\n"
        "print(json.dumps({'new': new, 'nccl_maps': [maps_before, maps_after]}))\n"
    )
    assert out["nccl_maps"][0] == out["nccl_maps"][1]  # torch may have mapped one already; we add none
    assert all(name.startswith("transport.cuda") for name in out["new"]), out["new"]


def test_load_order_and_reasons_in_a_fresh_process():
    out = _run_python(
        "import json, torch\n"
        "from transport.cuda import load_nccl\n"
        "first = load_nccl()\n"
        "again = load_nccl()\n"
        "fresh = load_nccl(cached=False)\n"
        "print(json.dumps({'cuda_torch': torch.version.cuda is not None,\n"
        "  'first': [first.source.value, first.path, [list(a) for a in first.attempts]],\n"
        "  'same_object': again is first,\n"
        "  'fresh': [fresh.source.value, fresh.path, [list(a) for a in fresh.attempts]]}))\n"
    )
    source, path, attempts = out["first"]
    assert out["same_object"]
    assert [a[0] for a in attempts][0] == "explicit"
    assert "TRANSPORT_NCCL_LIBRARY is not set" in attempts[0][1]
    assert attempts[-1][0] == source and attempts[-1][1].startswith(f"loaded {path}")
    if not out["cuda_torch"]:  # a CPU build of torch maps no NCCL: the wheel is found by pathfinder
        assert source == "pathfinder"
        assert [a[0] for a in attempts] == ["explicit", "torch", "pathfinder"]
        assert "no libnccl.so* is mapped" in attempts[1][1]
    # Once loaded, NCCL is mapped into the process, and the "torch" step reuses that copy.
    fresh_source, fresh_path, fresh_attempts = out["fresh"]
    assert fresh_source == "torch"
    assert os.path.realpath(fresh_path) == os.path.realpath(path)
    assert "already mapped in this process" in fresh_attempts[-1][1]


def test_system_step_when_pathfinder_finds_nothing(lib):
    lib_dir = os.path.dirname(lib.path)
    out = _run_python(
        "import json\n"
        "from transport.cuda import nccl_loader as loader\n"
        "def no_pathfinder():\n"
        "    raise loader._CandidateError('disabled by the test')\n"
        "loader._locate_with_pathfinder = no_pathfinder  # replaced where _search looks it up\n"
        "lib = loader.load_nccl()\n"
        "print(json.dumps([lib.source.value, lib.path, [list(a) for a in lib.attempts]]))\n",
        env={"LD_LIBRARY_PATH": lib_dir + os.pathsep + os.environ.get("LD_LIBRARY_PATH", "")},
    )
    source, path, attempts = out
    if attempts[1][0] == "torch" and attempts[1][1].startswith("loaded"):
        pytest.skip("torch of this machine maps its own NCCL, so the system step is never reached")
    assert source == "system"
    assert [a[0] for a in attempts] == ["explicit", "torch", "pathfinder", "system"]
    assert "disabled by the test" in attempts[2][1]
    assert path.startswith(lib_dir)  # dladdr reports the file, not just the soname asked for


def test_every_step_failing_names_every_step(monkeypatch):
    def fail(reason):
        def step():
            raise loader._CandidateError(reason)

        return step

    # Patched in nccl_loader, where _search looks the steps up (the nccl_lib facade only re-exports).
    monkeypatch.setattr(loader, "_locate_in_process", fail("nothing mapped (test)"))
    monkeypatch.setattr(loader, "_locate_with_pathfinder", fail("pathfinder off (test)"))
    monkeypatch.setattr(loader, "_locate_system", lambda: ("libnccl-that-does-not-exist.so.2", "test"))
    monkeypatch.delenv(m.ENV_VAR, raising=False)
    with pytest.raises(NcclUnavailableError) as ei:
        m.load_nccl(cached=False)
    err = ei.value
    assert isinstance(err, PlaneUnavailableError) and isinstance(err, TransportError)
    assert [a.source for a in err.attempts] == list(NcclSource)
    text = str(err)
    for needle in ("explicit:", "nothing mapped (test)", "pathfinder off (test)", "libnccl-that-does-not-exist.so.2"):
        assert needle in text
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == text and again.attempts == err.attempts


def test_explicit_bad_path_raises_without_fallback(tmp_path):
    missing = tmp_path / "nowhere" / "libnccl.so.2"
    with pytest.raises(NcclUnavailableError) as ei:
        m.load_nccl(missing)
    assert str(missing) in str(ei.value)
    assert "path argument" in str(ei.value)
    assert [a.source for a in ei.value.attempts] == [NcclSource.EXPLICIT]  # nothing else was tried


def test_explicit_library_that_is_not_nccl():
    libm = ctypes.util.find_library("m")
    if libm is None:
        pytest.skip("no libm to stand in for a wrong library")
    with pytest.raises(NcclUnavailableError, match="missing required functions ncclGetVersion"):
        m.load_nccl(libm, cached=False)


def test_explicit_good_path(lib):
    explicit = m.load_nccl(lib.path, cached=False)
    assert explicit.source is NcclSource.EXPLICIT
    assert explicit.version == lib.version
    assert explicit.attempts[-1].reason.startswith("loaded") and "path argument" in explicit.attempts[-1].reason


def test_env_var_choices_in_a_fresh_process(lib, tmp_path):
    code = (
        "import json\n"
        "from transport.cuda import load_nccl, NcclUnavailableError\n"
        "try:\n"
        "    got = load_nccl()\n"
        "    print(json.dumps({'source': got.source.value, 'path': got.path}))\n"
        "except NcclUnavailableError as exc:\n"
        "    print(json.dumps({'error': str(exc), 'sources': [a.source.value for a in exc.attempts]}))\n"
    )
    missing = str(tmp_path / "libnccl.so.2")
    bad = _run_python(code, env={m.ENV_VAR: missing})
    assert bad["sources"] == ["explicit"]
    assert missing in bad["error"] and m.ENV_VAR in bad["error"]

    good = _run_python(code, env={m.ENV_VAR: lib.path})
    assert good["source"] == "explicit"
    assert os.path.realpath(good["path"]) == os.path.realpath(lib.path)

    # The argument wins over the variable.
    arg = _run_python(
        f"import json\nfrom transport.cuda import load_nccl\nprint(json.dumps(load_nccl({lib.path!r}).source.value))\n",
        env={m.ENV_VAR: missing},
    )
    assert arg == "explicit"


# ---------------------------------------------------------------------------------------------
# Version, unique id, errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "version"),
    [(23203, (2, 32, 3)), (22809, (2, 28, 9)), (21400, (2, 14, 0)), (20900, (2, 9, 0)), (2708, (2, 7, 8))],
)
def test_version_codes(code, version):
    assert m.parse_version(code) == version
    assert m.version_code(*version) == code


def test_version_code_rejects_garbage():
    with pytest.raises(ValueError):
        m.parse_version(7)


def test_loaded_version(lib):
    assert lib.version == m.parse_version(lib.version_code)
    assert lib.version_string == ".".join(map(str, lib.version))
    assert lib.version >= (2, 13, 0)
    header = _nccl_header_path()
    if Path(lib.path).resolve().parent.parent == header.parent.parent.resolve():  # loaded from that wheel
        assert lib.version == _header_version(header.read_text())
    assert "NCCL " + lib.version_string in lib.describe()


def test_unique_id(lib):
    a, b = lib.get_unique_id(), lib.get_unique_id()
    assert isinstance(a, bytes) and len(a) == m.UNIQUE_ID_BYTES == 128
    assert a != b
    assert NcclUniqueId.from_bytes(a).to_bytes() == a
    assert NcclUniqueId.from_bytes(bytearray(b)).to_bytes() == b
    assert ctypes.sizeof(NcclUniqueId) == 128
    with pytest.raises(BufferMismatchError, match="128 bytes, got 127"):
        NcclUniqueId.from_bytes(a[:-1])


@pytest.mark.parametrize("code", list(NcclResult))
def test_error_string_for_every_result(lib, code):
    text = lib.error_string(code)
    assert isinstance(text, str) and text
    if code is NcclResult.SUCCESS:
        assert text == "no error"
    assert code.c_name.startswith("ncclSuccess" if code == 0 else "nccl")


def test_error_string_for_an_unknown_code(lib):
    assert lib.error_string(99)


def test_nccl_error_format(lib):
    err = NcclError.from_result(NcclResult.INVALID_USAGE, lib, "ncclSend")
    assert isinstance(err, TransportError)
    assert err.code is NcclResult.INVALID_USAGE and err.code_name == "ncclInvalidUsage"
    assert str(err).startswith("ncclSend: ncclInvalidUsage (5): ")
    assert lib.error_string(NcclResult.INVALID_USAGE) in err.message
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == str(err) and again.code is NcclResult.INVALID_USAGE

    odd = NcclError(42, "ncclFoo", "strange")
    assert odd.code == 42 and odd.code_name == "ncclResult(42)"
    assert str(odd) == "ncclFoo: ncclResult(42) (42): strange"


def test_check(lib):
    m.check(NcclResult.SUCCESS, lib, "ncclGroupStart")
    with pytest.raises(NcclError) as ei:
        m.check(NcclResult.INTERNAL_ERROR, lib, "ncclGroupEnd")
    assert ei.value.code is NcclResult.INTERNAL_ERROR
    assert str(ei.value).startswith("ncclGroupEnd: ncclInternalError (3): ")


def test_last_error_is_text(lib):
    assert isinstance(lib.last_error(), str)


# ---------------------------------------------------------------------------------------------
# Tables against the header
# ---------------------------------------------------------------------------------------------

_C_TYPES = {
    "int": ctypes.c_int,
    "int*": ctypes.POINTER(ctypes.c_int),
    "unsignedint": ctypes.c_uint,
    "size_t": ctypes.c_size_t,
    "void*": ctypes.c_void_p,
    "cudaStream_t": ctypes.c_void_p,
    "ncclComm_t": ctypes.c_void_p,
    "ncclComm_t*": ctypes.POINTER(ctypes.c_void_p),
    "ncclWindow_t": ctypes.c_void_p,
    "ncclWindow_t*": ctypes.POINTER(ctypes.c_void_p),
    "ncclDataType_t": ctypes.c_int,
    "ncclResult_t": ctypes.c_int,
    "ncclResult_t*": ctypes.POINTER(ctypes.c_int),
    "ncclUniqueId": NcclUniqueId,
    "ncclUniqueId*": ctypes.POINTER(NcclUniqueId),
    "ncclConfig_t*": ctypes.POINTER(NcclConfig),
    "ncclWaitSignalDesc_t*": ctypes.POINTER(NcclWaitSignalDesc),
}


def _header_prototypes(header: str) -> dict[str, tuple[str, list[str]]]:
    protos = {}
    for ret, name, args in re.findall(r"(ncclResult_t|const char\s*\*)\s+(nccl\w+)\s*\(([^)]*)\);", header):
        types = []
        for arg in args.split(","):
            arg = " ".join(arg.split())
            if not arg or arg == "void":
                continue
            ctype = re.match(r"(.*?)\s*\w+$", arg).group(1)
            types.append(ctype.replace("const ", "").replace(" ", ""))
        protos[name] = (ret.replace(" ", ""), types)
    return protos


def test_tables_match_the_header():
    header = _nccl_header()
    protos = _header_prototypes(header)
    rows = list(m.REQUIRED_FUNCTIONS) + list(m.OPTIONAL_FUNCTIONS)
    assert len({r.name for r in rows}) == len(rows)
    version = _header_version(header)
    for row in rows:
        if getattr(row, "since", (0, 0, 0)) > version:
            continue  # an older header than the row
        assert row.name in protos, f"{row.name} is not declared in nccl.h"
        ret, args = protos[row.name]
        assert row.restype is (ctypes.c_char_p if ret == "constchar*" else ctypes.c_int), row.name
        assert len(row.argtypes) == len(args), f"{row.name}: {len(row.argtypes)} argtypes, nccl.h has {args}"
        for ours, c_type in zip(row.argtypes, args, strict=True):
            assert ours is _C_TYPES[c_type], f"{row.name}: {c_type} bound as {ours}"


def test_enums_match_the_header():
    header = _nccl_header()
    results = dict(re.findall(r"(nccl[A-Z]\w+)\s*=\s*(\d+)\s*[,}]", header))
    for code in NcclResult:
        if code.c_name in results or code <= NcclResult.IN_PROGRESS:  # ncclTimeout: 2.29+
            assert int(results[code.c_name]) == code
    types = {
        NcclDataType.INT8: "ncclInt8",
        NcclDataType.UINT8: "ncclUint8",
        NcclDataType.INT32: "ncclInt32",
        NcclDataType.UINT32: "ncclUint32",
        NcclDataType.INT64: "ncclInt64",
        NcclDataType.UINT64: "ncclUint64",
        NcclDataType.FLOAT16: "ncclFloat16",
        NcclDataType.FLOAT32: "ncclFloat32",
        NcclDataType.FLOAT64: "ncclFloat64",
        NcclDataType.BFLOAT16: "ncclBfloat16",
        NcclDataType.FLOAT8_E4M3: "ncclFloat8e4m3",
        NcclDataType.FLOAT8_E5M2: "ncclFloat8e5m2",
    }
    for dtype, c_name in types.items():
        if c_name in results or dtype <= NcclDataType.BFLOAT16:  # fp8: newer NCCLs only
            assert int(results[c_name]) == dtype, c_name
    assert int(re.search(r"#define NCCL_UNIQUE_ID_BYTES (\d+)", header).group(1)) == m.UNIQUE_ID_BYTES
    assert _header_magic(header) == m.API_MAGIC


def _header_magic(header: str) -> int:
    """``ncclConfig_t``'s magic as a header states it: ``NCCL_API_MAGIC`` (NCCL 2.29+), or the literal
    that older headers (2.28 and before, the GPU machine's) write in ``NCCL_CONFIG_INITIALIZER``."""
    define = re.search(r"#define NCCL_API_MAGIC\s+(0x[0-9a-fA-F]+)", header)
    if define is not None:
        return int(define.group(1), 16)
    literal = re.search(r"#define NCCL_CONFIG_INITIALIZER.*?(0x[0-9a-fA-F]+)\s*,\s*/\*\s*magic", header, re.S)
    if literal is None:
        raise AssertionError("the header states no ncclConfig_t magic (no NCCL_API_MAGIC, no literal in the initializer)")
    return int(literal.group(1), 16)


def test_the_magic_is_read_from_headers_with_and_without_nccl_api_magic():
    header = _nccl_header()
    assert _header_magic(header) == m.API_MAGIC
    # a 2.28-style header: no NCCL_API_MAGIC define, the initializer writes the literal
    old_style = re.sub(r"#define NCCL_API_MAGIC\s+0x[0-9a-fA-F]+\n", "", header)
    old_style = old_style.replace("NCCL_API_MAGIC,", f"{hex(m.API_MAGIC)},")
    assert "NCCL_API_MAGIC" not in old_style
    assert _header_magic(old_style) == m.API_MAGIC
    with pytest.raises(AssertionError):
        _header_magic(re.sub(r"0x[0-9a-fA-F]+,\s*/\*\s*magic", "0,", old_style))


def test_config_is_the_2_14_prefix_of_the_header_struct():
    body = re.search(r"typedef struct ncclConfig_v\d+ \{(.*?)\} ncclConfig_t;", _nccl_header(), re.S).group(1)
    header_fields = re.findall(r"^\s*(?:const\s+)?(\w+(?:\s+int)?)\s*(\*?)\s*(\w+);", body, re.M)
    ours = NcclConfig._fields_
    assert [f[2] for f in header_fields[: len(ours)]] == [name for name, _ in ours]
    c_types = {"size_t": ctypes.c_size_t, "unsigned int": ctypes.c_uint, "int": ctypes.c_int, "char*": ctypes.c_char_p}
    for (c_type, star, _), (_, ctype) in zip(header_fields, ours, strict=False):
        assert c_types[c_type + star] is ctype
    assert ctypes.sizeof(NcclConfig) == 40
    assert NcclConfig.blocking.offset == 16 and NcclConfig.netName.offset == 32


def test_config_defaults():
    for blocking in (False, True):
        cfg = NcclConfig.make(blocking=blocking)
        assert cfg.size == ctypes.sizeof(NcclConfig)
        assert cfg.magic == 0xCAFEBEEF
        assert cfg.version == 21400 == m.CONFIG_VERSION
        assert cfg.blocking == int(blocking)
        assert cfg.cgaClusterSize == cfg.minCTAs == cfg.maxCTAs == -(2**31)
        assert cfg.netName is None


def test_optional_functions_follow_the_version(lib):
    for row in m.REQUIRED_FUNCTIONS:
        assert lib.has(row.name)
    for row in m.OPTIONAL_FUNCTIONS:
        if lib.has(row.name):
            assert lib.version >= row.since
        else:
            assert row.name in lib.unavailable
    if lib.version >= (2, 29, 0):  # the wheel installed here is 2.32
        assert all(lib.has(row.name) for row in m.OPTIONAL_FUNCTIONS)
    assert lib.has("ncclCommInitRankConfig") == (lib.version >= (2, 14, 0))
    with pytest.raises(ValueError, match="neither table"):
        lib.has("ncclCommInitRankk")


def test_missing_optional_function_is_a_clear_error(monkeypatch, lib):
    rows = (
        m.OptionalFunction("ncclCommAbort", ctypes.c_int, (ctypes.c_void_p,), (99, 0, 0)),
        m.OptionalFunction("ncclNotInAnyNccl", ctypes.c_int, (), (2, 0, 0)),
    )
    # NcclLibrary reads both names from nccl_loader's globals (OPTIONAL_FUNCTIONS is nccl_table's, imported there).
    monkeypatch.setattr(loader, "OPTIONAL_FUNCTIONS", rows)
    monkeypatch.setattr(loader, "_ALL_NAMES", loader._ALL_NAMES | {"ncclNotInAnyNccl"})
    odd = m.load_nccl(lib.path, cached=False)
    assert not odd.has("ncclCommAbort") and not odd.has("ncclNotInAnyNccl")
    with pytest.raises(NcclUnavailableError) as ei:
        odd._fn("ncclCommAbort")
    assert "ncclCommAbort" in str(ei.value) and odd.version_string in str(ei.value) and "99.0.0" in str(ei.value)
    with pytest.raises(NcclUnavailableError, match="ncclNotInAnyNccl.*not exported"):
        odd._fn("ncclNotInAnyNccl")


def test_torch_dtypes():
    torch = pytest.importorskip("torch")
    assert m.nccl_dtype(torch.float32) is NcclDataType.FLOAT32
    assert m.nccl_dtype(torch.bfloat16) is NcclDataType.BFLOAT16 == 9
    assert m.nccl_dtype(torch.bool) is NcclDataType.UINT8
    assert m.nccl_dtype(torch.float8_e4m3fn) is NcclDataType.FLOAT8_E4M3 == 10
    assert m.nccl_dtype(torch.float8_e5m2) is NcclDataType.FLOAT8_E5M2 == 11
    assert m.nccl_dtype("torch.int64") is NcclDataType.INT64
    assert m.BYTES is NcclDataType.UINT8
    with pytest.raises(InvalidTensorError, match="torch.int16"):
        m.nccl_dtype(torch.int16)


# ---------------------------------------------------------------------------------------------
# A real communicator init without a GPU
# ---------------------------------------------------------------------------------------------


def _has_cuda_driver() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.parametrize("blocking", [False, True])
def test_init_rank_without_gpu_fails_typed_and_bounded(blocking):
    """Verified: on this machine ncclCommInitRankConfig returns ncclUnhandledCudaError at once
    ("CUDA driver version is insufficient"), with no crash. Run apart in case a driver differs."""
    if blocking and _has_cuda_driver():
        pytest.skip("with a CUDA driver a blocking init would wait for the missing rank forever")
    code = (
        "import json, time, warnings\n"
        "warnings.simplefilter('error')\n"
        "from transport.cuda import Communicator, load_nccl\n"
        "lib = load_nccl()\n"
        "t0 = time.monotonic()\n"
        "try:\n"
        f"    Communicator.init_rank(lib, 2, lib.get_unique_id(), 0, blocking={blocking}, timeout=5)\n"
        "    out = {'error': None}\n"
        "except Exception as exc:\n"
        "    out = {'error': type(exc).__name__, 'code': getattr(exc, 'code', None), 'text': str(exc)}\n"
        "out['elapsed'] = time.monotonic() - t0\n"
        "print(json.dumps(out))\n"
    )
    t0 = time.monotonic()
    out = _run_python(code, timeout=120)
    assert time.monotonic() - t0 < 110
    assert out["error"] in ("NcclError", "TransportTimeoutError"), out
    assert out["elapsed"] < 30
    if not _has_cuda_driver():
        assert out["error"] == "NcclError"
        assert out["code"] == NcclResult.UNHANDLED_CUDA_ERROR
        assert out["text"].startswith(
            ("ncclCommInitRankConfig: ncclUnhandledCudaError (1): ", "ncclCommInitRank: ncclUnhandledCudaError (1): ")
        )


def test_init_rank_checks_arguments_before_calling_nccl(lib):
    uid = lib.get_unique_id()
    with pytest.raises(NcclError) as ei:
        Communicator.init_rank(lib, 2, uid, 2)
    assert ei.value.code is NcclResult.INVALID_ARGUMENT and "rank 2" in str(ei.value)
    with pytest.raises(BufferMismatchError):
        Communicator.init_rank(lib, 2, uid[:64], 0)


# ---------------------------------------------------------------------------------------------
# Communicator logic against a scripted library
# ---------------------------------------------------------------------------------------------

HANDLE = 0xC0FFEE


class FakeNccl:
    """Stands in for NcclLibrary: scripted results, every call recorded.

    ``states`` feeds ncclCommGetAsyncError: one value per call, the last one repeating.
    """

    version_string = "2.99.0"
    path = "<fake libnccl>"

    def __init__(self, *, init_rc=NcclResult.IN_PROGRESS, states=(7, 0), missing=(), set_handle=True):
        self.init_rc = init_rc
        self.states = list(states)
        self.missing = set(missing)
        self.set_handle = set_handle
        self.p2p_rc = NcclResult.SUCCESS
        self.group_end_rc = NcclResult.SUCCESS
        self.finalize_rc = NcclResult.SUCCESS
        self.calls: list[tuple] = []
        self.lock = threading.Lock()

    def names(self) -> list[str]:
        with self.lock:
            return [c[0] for c in self.calls]

    def count(self, name: str) -> int:
        return self.names().count(name)

    # NcclLibrary's surface used by Communicator and NcclError
    def has(self, name):
        return name not in self.missing

    @property
    def unavailable(self):
        return {n: "missing in the fake" for n in self.missing}

    def error_string(self, code):
        return f"fake explanation of {int(code)}"

    def _last_error(self, handle):
        return "fake last error"

    def _fn(self, name):
        if name in self.missing:
            raise NcclUnavailableError(f"{name} missing in the fake")
        impl = getattr(self, name)

        def call(*args):
            with self.lock:
                self.calls.append((name, *args))
            return impl(*args)

        return call

    def ncclCommInitRankConfig(self, out, nranks, uid, rank, config):
        self.config = (config._obj.magic, config._obj.version, config._obj.blocking)
        if self.set_handle:
            out._obj.value = HANDLE
        return self.init_rc

    def ncclCommInitRank(self, out, nranks, uid, rank):
        if self.set_handle:
            out._obj.value = HANDLE
        return self.init_rc

    def ncclCommGetAsyncError(self, handle, state):
        with self.lock:
            state._obj.value = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        return NcclResult.SUCCESS

    def ncclCommCount(self, handle, out):
        out._obj.value = 1
        return NcclResult.SUCCESS

    def ncclCommUserRank(self, handle, out):
        out._obj.value = 0
        return NcclResult.SUCCESS

    def ncclCommCuDevice(self, handle, out):
        out._obj.value = 3
        return NcclResult.SUCCESS

    def ncclSend(self, ptr, count, dtype, peer, handle, stream):
        return self.p2p_rc

    ncclRecv = ncclSend

    def ncclGroupStart(self):
        return NcclResult.SUCCESS

    def ncclGroupEnd(self):
        return self.group_end_rc

    def ncclCommAbort(self, handle):
        return NcclResult.SUCCESS

    def ncclCommFinalize(self, handle):
        return self.finalize_rc

    def ncclCommDestroy(self, handle):
        return NcclResult.SUCCESS


UID = bytes(range(128))


def test_nccl_calls_on_different_communicators_never_overlap():
    """NCCL's "Thread Safety": calls on communicators of one device from several threads at once are
    unsafe. Two communicators driven from four threads: no two NCCL calls are ever inside NCCL at once."""

    class Overlap(FakeNccl):
        def __init__(self):
            super().__init__(states=(0,))
            self.inside = 0
            self.most = 0

        def _fn(self, name):
            inner = super()._fn(name)

            def call(*args):
                with self.lock:
                    self.inside += 1
                    self.most = max(self.most, self.inside)
                try:
                    time.sleep(0.002)  # a call that takes a moment inside NCCL
                    return inner(*args)
                finally:
                    with self.lock:
                        self.inside -= 1
            return call

    fake = Overlap()
    comms = [Communicator.init_rank(fake, 1, UID, 0) for _ in range(2)]
    errors = []

    def drive(comm):
        try:
            for _ in range(25):
                with comm.group():
                    comm.send(0x1000, 64, 0)
                    comm.recv(0x2000, 64, 0)
                comm.async_error()
        except Exception as exc:  # (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=drive, args=(c,)) for c in comms for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for c in comms:
        c.abort()
    assert not errors and not any(t.is_alive() for t in threads)
    assert fake.count("ncclSend") == 100
    assert fake.most == 1, f"{fake.most} NCCL calls ran at once"


def _ready(fake: FakeNccl, **kwargs) -> Communicator:
    comm = Communicator.init_rank(fake, 1, UID, 0, **kwargs)
    fake.calls.clear()
    return comm


def test_nonblocking_init_polls_until_ready():
    fake = FakeNccl(states=(7, 7, 7, 0))
    comm = Communicator.init_rank(fake, 1, UID, 0)
    assert fake.config == (0xCAFEBEEF, 21400, 0)
    assert fake.count("ncclCommGetAsyncError") == 4
    assert (comm.nranks, comm.rank, comm.device, comm.blocking, comm.closed) == (1, 0, 3, False, False)
    assert (fake.calls[0][2], fake.calls[0][4]) == (1, 0)  # nranks, rank
    comm.close()
    assert fake.names()[-2:] == ["ncclCommFinalize", "ncclCommDestroy"]
    assert comm.closed


def test_init_deadline_aborts_and_raises_timeout():
    fake = FakeNccl(states=(7,))
    t0 = time.monotonic()
    with pytest.raises(TransportTimeoutError) as ei:
        Communicator.init_rank(fake, 1, UID, 0, timeout=0.2)
    assert 0.2 <= time.monotonic() - t0 < 2
    assert ei.value.phase is Phase.CONNECT and isinstance(ei.value, TimeoutError)
    assert "aborted" in str(ei.value)
    assert fake.count("ncclCommAbort") == 1 and fake.count("ncclCommDestroy") == 0


def test_init_async_error_aborts_and_raises_typed():
    fake = FakeNccl(states=(7, NcclResult.REMOTE_ERROR))
    with pytest.raises(NcclError) as ei:
        Communicator.init_rank(fake, 1, UID, 0)
    assert ei.value.code is NcclResult.REMOTE_ERROR
    assert str(ei.value) == "ncclCommInitRankConfig: ncclRemoteError (6): fake last error; fake explanation of 6"
    assert fake.count("ncclCommAbort") == 1


def test_init_failure_without_a_handle_aborts_nothing():
    fake = FakeNccl(init_rc=NcclResult.UNHANDLED_CUDA_ERROR, set_handle=False)
    with pytest.raises(NcclError) as ei:
        Communicator.init_rank(fake, 1, UID, 0)
    assert ei.value.code is NcclResult.UNHANDLED_CUDA_ERROR
    assert fake.names() == ["ncclCommInitRankConfig"]


def test_init_failure_with_a_handle_aborts_it():
    fake = FakeNccl(init_rc=NcclResult.INVALID_ARGUMENT)
    with pytest.raises(NcclError):
        Communicator.init_rank(fake, 1, UID, 0)
    assert fake.names() == ["ncclCommInitRankConfig", "ncclCommAbort"]


def test_nonblocking_needs_init_rank_config():
    fake = FakeNccl(missing={"ncclCommInitRankConfig"})
    with pytest.raises(NcclUnavailableError, match="blocking=True"):
        Communicator.init_rank(fake, 1, UID, 0)
    assert fake.calls == []
    fake.init_rc = NcclResult.SUCCESS
    comm = Communicator.init_rank(fake, 1, UID, 0, blocking=True)  # an explicit choice, not a fallback
    assert fake.names()[0] == "ncclCommInitRank" and "ncclCommGetAsyncError" not in fake.names()
    assert comm.blocking
    comm.abort()


def test_blocking_request_overridden_by_the_environment_is_treated_as_non_blocking():
    fake = FakeNccl(init_rc=NcclResult.IN_PROGRESS, states=(7, 0))  # as with NCCL_COMM_BLOCKING=0
    comm = Communicator.init_rank(fake, 1, UID, 0, blocking=True)
    assert not comm.blocking and fake.count("ncclCommGetAsyncError") == 2
    comm.close()


def test_group_waits_for_group_end_in_progress():
    fake = FakeNccl()
    comm = _ready(fake)
    fake.group_end_rc = NcclResult.IN_PROGRESS
    fake.p2p_rc = NcclResult.IN_PROGRESS  # inside a group, left to ncclGroupEnd
    fake.states = [7, 7, 0]
    with comm.group():
        comm.send(0x1000, 64, 0, 5)
        comm.recv(0x2000, 64, 0, 5)
    assert fake.names() == [
        "ncclGroupStart",
        "ncclSend",
        "ncclRecv",
        "ncclGroupEnd",
        "ncclCommGetAsyncError",
        "ncclCommGetAsyncError",
        "ncclCommGetAsyncError",
    ]
    assert fake.calls[1][1:] == (0x1000, 64, NcclDataType.UINT8, 0, HANDLE, 5)
    comm.close()


def test_group_end_timeout_aborts():
    fake = FakeNccl()
    comm = _ready(fake)
    fake.group_end_rc = NcclResult.IN_PROGRESS
    fake.states = [7]
    with pytest.raises(TransportTimeoutError) as ei:
        with comm.group(timeout=0.1):
            comm.send(0x1000, 8, 0)
    assert ei.value.phase is Phase.TRANSFER and comm.closed
    assert fake.count("ncclCommAbort") == 1


def test_group_ends_even_when_the_body_raises():
    fake = FakeNccl()
    comm = _ready(fake)
    with pytest.raises(RuntimeError, match="body"):
        with comm.group():
            comm.send(0x1000, 8, 0)
            raise RuntimeError("body")
    assert fake.names() == ["ncclGroupStart", "ncclSend", "ncclGroupEnd"]
    # The group depth was restored: outside a group, an in-progress send is waited for.
    fake.p2p_rc = NcclResult.IN_PROGRESS
    fake.states = [0]
    comm.send(0x1000, 8, 0)
    assert fake.names()[-1] == "ncclCommGetAsyncError"
    comm.close()


def test_send_checks_arguments_before_calling_nccl():
    fake = FakeNccl()
    comm = _ready(fake)
    for args in [(0x1000, 8, 1), (0, 8, 0), (-1, 8, 0), (0x1000, -1, 0)]:
        with pytest.raises(NcclError) as ei:
            comm.send(*args)
        assert ei.value.code is NcclResult.INVALID_ARGUMENT
    comm.recv(0, 0, 0)  # an empty transfer is allowed
    assert fake.names() == ["ncclRecv"]
    comm.close()


def test_send_error_is_typed_and_keeps_the_communicator():
    fake = FakeNccl()
    comm = _ready(fake)
    fake.p2p_rc = NcclResult.INVALID_USAGE
    with pytest.raises(NcclError) as ei:
        comm.send(0x1000, 8, 0)
    assert str(ei.value).startswith("ncclSend: ncclInvalidUsage (5): fake last error")
    assert not comm.closed and fake.count("ncclCommAbort") == 0
    comm.close()


def test_abort_is_idempotent_and_closes_every_call():
    fake = FakeNccl()
    comm = _ready(fake)
    comm.abort()
    comm.abort()
    comm.close()
    assert fake.names() == ["ncclCommAbort"]
    with pytest.raises(NcclError, match="closed") as ei:
        comm.send(0x1000, 8, 0)
    assert ei.value.code is NcclResult.INVALID_USAGE
    with pytest.raises(NcclError, match="closed"):
        comm.async_error()
    assert fake.names() == ["ncclCommAbort"]


def test_abort_from_another_thread_ends_a_wait():
    fake = FakeNccl()
    comm = _ready(fake)
    fake.states = [7]
    errors: list[BaseException] = []

    def wait():
        try:
            comm.wait_ready(timeout=10)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    comm.abort()
    t.join(timeout=5)
    assert not t.is_alive()
    assert time.monotonic() - t0 < 3
    assert len(errors) == 1 and isinstance(errors[0], NcclError) and "closed" in str(errors[0])
    assert fake.count("ncclCommAbort") == 1


def test_close_deadline_aborts():
    fake = FakeNccl()
    comm = _ready(fake)
    fake.finalize_rc = NcclResult.IN_PROGRESS
    fake.states = [7]
    with pytest.raises(TransportTimeoutError):
        comm.close(timeout=0.1)
    assert comm.closed
    assert "ncclCommAbort" in fake.names() and "ncclCommDestroy" not in fake.names()


def test_context_manager_closes_or_aborts():
    fake = FakeNccl()
    with _ready(fake):
        pass
    assert fake.names()[-1] == "ncclCommDestroy"
    fake = FakeNccl()
    with pytest.raises(KeyError):
        with _ready(fake):
            raise KeyError("x")
    assert fake.names() == ["ncclCommAbort"]


def test_a_dropped_communicator_warns_and_tears_nothing_down():
    fake = FakeNccl()
    comm = _ready(fake)
    with pytest.warns(ResourceWarning, match="without close"):
        del comm
        gc.collect()
    assert fake.calls == []


def test_abort_from_another_thread_during_close_leaves_it_closed():
    fake = FakeNccl()
    comm = _ready(fake)
    fake.finalize_rc = NcclResult.IN_PROGRESS
    fake.states = [7]
    timer = threading.Timer(0.1, comm.abort)
    timer.start()
    t0 = time.monotonic()
    comm.close(timeout=10)  # returns once the abort lands, without raising
    timer.join(timeout=5)
    assert time.monotonic() - t0 < 3 and comm.closed
    assert fake.count("ncclCommAbort") == 1 and fake.count("ncclCommDestroy") == 0
