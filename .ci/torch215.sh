#!/usr/bin/env bash
# CI for the torch.distributed._transport backend ("transport_rl"): from a fresh clone, make a venv
# with torch 2.15 (the first torch that ships torch.distributed._transport), install this project
# into it (so that the torch.distributed.transports entry point is installed) and run
# tests/test_torch_transport.py (and tests/test_torch_transport_bench.py: bench/_nixl_peer.py --backend
# transport_rl) there. Fails loudly if the module skips (a torch without
# _transport, or a missing entry point), so a green run means the tests ran.
#   bash .ci/torch215.sh            (venv: .venv-torch215; VENV=... picks another, PYTHON=... the interpreter)
# .ci/run calls it after the main suite (which runs on the default venv's torch, without _transport).
#   bash .ci/torch215.sh --full     also installs the project's extras (transformers, Ray, the test
#                                   tools) into that venv and runs the WHOLE test suite (all but the soak)
#                                   there: users on the newest torch, a CUDA build with no GPU visible
set -euo pipefail
FULL=0
if [ "${1:-}" = "--full" ]; then FULL=1; fi
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-torch215}
PYTHON=${PYTHON:-python3}
echo "torch215: $(date -u +%FT%TZ) on $(nproc) cores, venv $VENV"
"$PYTHON" --version
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=(bash scripts/pip_install.sh "$VENV")  # tried again if a download breaks off
# PIP_CONFIG_FILE=/dev/null: the public index as pip resolves it (a CPU or CUDA wheel, either is fine)
if [ "$FULL" = 1 ]; then
  # everything the whole suite needs, as scripts/setup.sh installs it for the default venv (torch stays 2.15)
  PIP_CONFIG_FILE=/dev/null TORCH_SPEC=torch==2.15.0 PYTHON="$PYTHON" bash scripts/setup.sh "$VENV"
else
  PIP_CONFIG_FILE=/dev/null "${PIP[@]}" torch==2.15.0 msgspec numpy tqdm pytest pytest-asyncio \
    pytest-timeout hypothesis
  # the project itself, for its entry point; its other dependencies (cuda-python, NCCL) are not needed here
  PIP_CONFIG_FILE=/dev/null "${PIP[@]}" --no-deps -e .
fi
"$VENV/bin/python" - <<'EOF'
import torch
import torch.distributed._transport as tdt  # ImportError here: this torch has no _transport
assert torch.__version__.startswith("2.15"), torch.__version__
assert "transport_rl" in tdt.available_transports(), f"entry point missing: {tdt.available_transports()}"
print("torch215: torch", torch.__version__, "transports", tdt.available_transports())
EOF
log=$(mktemp)
trap 'rm -f "$log"' EXIT
set +e
if [ "$FULL" = 1 ]; then  # (GPU tests skip here, saying why; the backend's must not)
  # (in WORKERS processes, 3 by default, as make test runs it)
  "$VENV/bin/python" -m pytest -m "not soak" -n "${WORKERS:-3}" --dist loadgroup -q -rs -p no:cacheprovider 2>&1 | tee "$log"
else
  "$VENV/bin/python" -m pytest tests/test_torch_transport.py tests/test_torch_transport_bench.py -q -rs -p no:cacheprovider 2>&1 | tee "$log"
fi
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" -ne 0 ]; then
  echo "torch215: FAILED (pytest exit $rc)" >&2
  exit "$rc"
fi
if grep -qE 'SKIPPED .*tests/test_torch_transport' "$log"; then
  echo "torch215: FAILED: the backend's tests were skipped (see the SKIPPED lines above); they must run under torch 2.15" >&2
  exit 1
fi
echo "torch215: ok"
