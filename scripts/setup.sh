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
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip setuptools wheel 2>&1 | grep -v "is ignored: it is neither" || true
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "installing ${TORCH_SPEC:-torch==2.13.0} into $VENV"
  "${PIP[@]}" install "${TORCH_SPEC:-torch==2.13.0}" 2>&1 | grep -v "is ignored: it is neither" || true
fi
echo "installing transport (editable) with its test tools, transformers and Ray into $VENV"
"${PIP[@]}" install -e ".[test,dev,hf,ray]" 2>&1 | grep -v "is ignored: it is neither" || true
"$VENV/bin/python" -c "import torch, msgspec, pytest, hypothesis, ray, transformers, transport; print('environment ready: torch', torch.__version__, 'ray', ray.__version__, 'transformers', transformers.__version__)"
touch "$VENV/.installed"
