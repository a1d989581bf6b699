#!/usr/bin/env bash
# The README's test command: set up (torch if none, requirements.txt line by line as
# ComfyUI-Manager installs it, pytest) and run the tests.  Without a GPU the kernels run in
# Numba's CUDA simulator; ComfyUI tests run per tree in COMFYUI_PATHS / COMFYUI_PATH (or
# .carry/ComfyUI-*) and skip with the reason when none is found (a path given in COMFYUI_PATHS /
# COMFYUI_PATH that is not a ComfyUI tree fails).  pytest's output ends with what did not run and
# why: the skips counted per kind and reason (tests/conftest.py).  .ci/run runs this file.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null 2>&1 || { echo "tests/run.sh: error: $PY not found (set PYTHON=/path/to/python)" >&2; exit 2; }
"$PY" install.py --standalone --tests
"$PY" - <<'PYEOF'
import numpy, numba, torch
print(f"numpy {numpy.__version__}, numba {numba.__version__}, torch {torch.__version__}")
PYEOF
exec "$PY" -m pytest -q tests "$@"
