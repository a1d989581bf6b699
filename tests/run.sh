#!/usr/bin/env bash
# The README's test command: set up (torch if none, requirements.txt line by line as
# ComfyUI-Manager installs it, pytest) and run the tests.  Without a GPU the kernels run in
# Numba's CUDA simulator; ComfyUI tests run per tree in COMFYUI_PATHS / COMFYUI_PATH (or
# .carry/ComfyUI-*) and skip with the reason when none is found (a path given in COMFYUI_PATHS /
# COMFYUI_PATH that is not a ComfyUI tree fails).
#   bash tests/run.sh [--full] [pytest arguments]
# Default: the fast set (every test not marked slow: the simulator's bigger kernel cases);
# --full: every test (what CI runs, .ci/run).  Progress: one line as each test file starts
# (elapsed time, share of the tests done) and one as it ends (its counts, time and skips with the
# reason); the end lists what did not run and why, counted per kind and reason (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null 2>&1 || { echo "tests/run.sh: error: $PY not found (set PYTHON=/path/to/python)" >&2; exit 2; }
full=0
if [ "${1:-}" = "--full" ]; then full=1; shift; fi
"$PY" install.py --standalone --tests
"$PY" - <<'PYEOF'
import numpy, numba, torch
print(f"numpy {numpy.__version__}, numba {numba.__version__}, torch {torch.__version__}")
PYEOF
if [ "$full" = 1 ]; then
  echo "tests/run.sh: every test (--full; on 2 CPU cores without a GPU about 15 minutes, README: Tests)"
  exec "$PY" -m pytest -q --file-progress tests "$@"
fi
echo "tests/run.sh: the fast set (on 2 CPU cores without a GPU about 10 minutes, README: Tests); --full runs every test, as CI does"
exec "$PY" -m pytest -q --file-progress -m "not slow" tests "$@"
