"""The cuda_ipc engine's driver layer (``transport/cuda/ipc.py`` through ``cuda.bindings.driver``), on CPU.

Real imports of cuda-python, no mocks of it: on a machine without the NVIDIA driver the engine says so
with a clear reason; a CUresult error code (the bindings' own enum values) becomes the same
PlaneUnavailableError as before, now with the error's name; the handle bytes round-trip through a real
``CUipcMemHandle``. The driver calls themselves run in tests/gpu/test_ipc_gpu.py on a GPU machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from transport.cuda import ipc
from transport.errors import PlaneUnavailableError

cu = pytest.importorskip("cuda.bindings.driver")
ROOT = Path(__file__).resolve().parent.parent


def _driver_library_loads() -> bool:
    try:
        cu.cuDriverGetVersion()
    except Exception:  # noqa: BLE001 - cuda.pathfinder's DynamicLibNotFoundError on a machine without a driver
        return False
    return True


def test_without_the_driver_the_reason_says_so():
    """Verified here: cuda-bindings 13.4.4, no libcuda.so.1 (cuda.pathfinder's DynamicLibNotFoundError)."""
    if _driver_library_loads():
        drv = ipc._Driver()
        assert drv.version > 0
        assert drv.describe().startswith("CUDA IPC handles through the driver (cuda.bindings ")
        pytest.skip("the NVIDIA driver library is present here: the no-driver reason cannot be seen")
    with pytest.raises(PlaneUnavailableError) as info:
        ipc._Driver()
    text = str(info.value)
    assert text.startswith("cuda_ipc: the NVIDIA driver library was not found (cuda.bindings: "), text
    assert "DynamicLibNotFoundError" in text or "RuntimeError" in text, text
    with pytest.raises(PlaneUnavailableError, match="NVIDIA driver library was not found"):
        ipc._driver()  # (a failure is not cached: functools.cache keeps only results)


def test_without_cuda_python_the_module_imports_and_says_why():
    """cuda.bindings made unimportable (a real ImportError from the import system) in a fresh process:
    transport.cuda.ipc still imports, and the engine's reason names the missing bindings."""
    code = textwrap.dedent("""
        import json, sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "cuda.bindings" or name.startswith("cuda.bindings."):
                    raise ImportError(f"blocked for the test: {name}")
                return None
        sys.meta_path.insert(0, Block())
        try:
            import torch  # noqa: F401 - some torch builds import cuda.bindings themselves
        except ImportError as exc:
            print(json.dumps({"skip": f"torch needs cuda.bindings here: {exc}"}))
            raise SystemExit(0)
        from transport.cuda import ipc
        from transport.errors import PlaneUnavailableError
        try:
            ipc._Driver()
            out = {"error": None}
        except PlaneUnavailableError as exc:
            out = {"error": str(exc)}
        print(json.dumps(out))
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(out["skip"])
    assert out["error"].startswith("cuda_ipc: cuda-python's driver bindings (cuda.bindings.driver) cannot be "
                                   "imported: ImportError: blocked for the test"), out


@pytest.mark.parametrize("err", [cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY, cu.CUresult.CUDA_ERROR_INVALID_VALUE,
                                 cu.CUresult.CUDA_ERROR_INVALID_HANDLE, cu.CUresult.CUDA_ERROR_MAP_FAILED])
def test_check_maps_a_cuda_error_to_plane_unavailable(err):
    with pytest.raises(PlaneUnavailableError) as info:
        ipc.check((err, None), "cuIpcOpenMemHandle")
    text = str(info.value)
    # the message callers saw before ("cuda_ipc: <call> failed: CUDA error <code> (<text>)"), plus the name
    assert text.startswith(f"cuda_ipc: cuIpcOpenMemHandle failed: CUDA error {int(err)} {err.name} ("), text
    if not _driver_library_loads():
        assert text.endswith("(unknown error)"), text  # (the description comes from the driver)
    with pytest.raises(PlaneUnavailableError, match=err.name):
        ipc.check(err, "cuMemFree")  # a bare CUresult, not a tuple


def test_check_returns_the_values():
    ok = cu.CUresult.CUDA_SUCCESS
    assert ipc.check((ok,), "cuIpcCloseMemHandle") is None
    assert ipc.check((ok, 7), "cuMemAlloc") == 7
    assert ipc.check((ok, 1, 2), "cuMemGetAddressRange") == (1, 2)


def test_ipc_handle_bytes_round_trip():
    raw = bytes(range(64))
    handle = ipc._handle_from_bytes(cu, raw)
    assert isinstance(handle, cu.CUipcMemHandle)
    assert ipc._handle_bytes(handle) == raw
    with pytest.raises(PlaneUnavailableError, match="malformed IPC handle"):
        ipc._handle_from_bytes(cu, raw[:63])


def test_every_driver_entry_point_is_bound():
    missing = [name for name in ipc._FUNCTIONS if not hasattr(cu, name)]
    assert not missing


def test_doctor_reports_the_cuda_ipc_plane_with_a_reason():
    import torch

    r = subprocess.run([sys.executable, "-m", "transport", "doctor", "--json"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)["cuda"]["ipc"]
    assert got["available"] is (torch.cuda.is_available() and _driver_library_loads()), got
    if not torch.cuda.is_available():
        assert got["reason"] == "CUDA is not available in this process", got
    elif got["available"]:
        assert got["reason"].startswith("CUDA IPC handles through the driver (cuda.bindings "), got
    else:
        assert got["reason"].startswith("cuda_ipc: "), got
