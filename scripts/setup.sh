#!/usr/bin/env bash
# Create the virtual environment and install the project with its test tools (and transformers, for the
# tests and the demo option that use a Hugging Face model).
#   bash scripts/setup.sh [VENV]       (default .venv)
# TORCH_SPEC chooses the torch to install when the venv has none
# (default torch==2.13.0, the CPU build; e.g. TORCH_SPEC='torch==2.11.0' on a GPU box).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
# each install is tried again if the download breaks off, and fails the setup if it still fails
PIP=(bash scripts/pip_install.sh "$VENV")
"${PIP[@]}" --upgrade pip setuptools wheel
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "installing ${TORCH_SPEC:-torch==2.13.0} into $VENV"
  "${PIP[@]}" "${TORCH_SPEC:-torch==2.13.0}"
fi
echo "installing transport (editable) with its test tools, transformers and Ray into $VENV"
"${PIP[@]}" -e ".[test,dev,hf,ray]"
"$VENV/bin/python" -c "import torch, msgspec, pytest, hypothesis, ray, transformers, transport; print('environment ready: torch', torch.__version__, 'ray', ray.__version__, 'transformers', transformers.__version__)"
touch "$VENV/.installed"
