#!/usr/bin/env bash
# Build one venv that runs every ComfyUI tree given (CPU), for tests/test_comfyui_matrix.py:
#   bash tests/comfy_venv.sh VENV TREE [TREE...]      e.g. /work/venv-comfy .carry/ComfyUI-*
# torch/torchvision pinned (TORCH, TORCHVISION), torchaudio from the newest release that accepts
# them (TORCHAUDIO: ComfyUI v0.33's comfy.sd imports it), then the union of the trees'
# requirements.txt (a package named in several: the last tree's line), comfy-aimdo, blake3,
# simpleeval, the pack's requirements.txt and pytest; each tree's pinned frontend where it differs
# from the installed one, in VENV/frontends/<version>.  Then COMFYUI_PYTHON=VENV/bin/python.
set -euo pipefail
usage="usage: bash tests/comfy_venv.sh VENV TREE [TREE...]  (e.g. /work/venv-comfy .carry/ComfyUI-*)"
[ $# -ge 2 ] || { echo "comfy_venv.sh: error: need a venv folder and at least one ComfyUI tree; $usage" >&2; exit 2; }
venv=$1; shift
for tree in "$@"; do
  [ -f "$tree/main.py" ] && [ -f "$tree/requirements.txt" ] \
    || { echo "comfy_venv.sh: error: $tree is not a ComfyUI tree (no main.py / requirements.txt); $usage" >&2; exit 2; }
done
[ ! -e "$venv" ] || [ -d "$venv" ] || { echo "comfy_venv.sh: error: $venv exists and is not a folder" >&2; exit 2; }
root="$(cd "$(dirname "$0")/.." && pwd)"
TORCH=${TORCH:-2.14.1}; TORCHVISION=${TORCHVISION:-0.29.1}; TORCHAUDIO=${TORCHAUDIO:-2.11.1}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pin=$(mktemp); req=$(mktemp); trap 'rm -f "$pin" "$req"' EXIT
printf 'torch==%s\ntorchvision==%s\n' "$TORCH" "$TORCHVISION" > "$pin"
"$venv/bin/pip" install -c "$pin" "torch==$TORCH" "torchvision==$TORCHVISION"
"$venv/bin/pip" install -c "$pin" "torchaudio==$TORCHAUDIO"
"$venv/bin/python" - "$@" > "$req" <<'PYEOF'
import re, sys
lines = {}
for tree in sys.argv[1:]:
    for ln in open(f"{tree}/requirements.txt"):
        ln = ln.split("#")[0].strip()
        if not ln:
            continue
        name = re.split(r"[<>=~!\[ ;]", ln, 1)[0].lower().replace("_", "-")
        if name not in ("torch", "torchvision", "torchaudio"):
            lines[name] = ln
for extra in ("comfy-aimdo", "blake3", "simpleeval>=1.0.0"):
    lines.setdefault(re.split(r"[<>=]", extra, 1)[0], extra)
print("\n".join(lines.values()))
PYEOF
"$venv/bin/pip" install -c "$pin" -r "$req" -r "$root/requirements.txt" pytest
# each tree's own frontend: the pins other than the installed one go to VENV/frontends/<version>,
# where the tests start main.py with --front-end-root (tests/_comfy_trees.py: frontend_args)
have=$("$venv/bin/python" -c "from importlib.metadata import version; print(version('comfyui-frontend-package'))")
for tree in "$@"; do
  fe=$(sed -n 's/^comfyui-frontend-package==\([0-9.]*\).*/\1/p' "$tree/requirements.txt")
  if [ -n "$fe" ] && [ "$fe" != "$have" ] && [ ! -f "$venv/frontends/$fe/comfyui_frontend_package/static/index.html" ]; then
    "$venv/bin/pip" install --no-deps --target "$venv/frontends/$fe" "comfyui-frontend-package==$fe"
  fi
done
for tree in "$@"; do
  (cd "$tree" && "$venv/bin/python" -c "import sys; sys.argv=['x','--cpu']; sys.path.insert(0,'.'); import comfy.options; comfy.options.enable_args_parsing(); import comfy.model_management, comfy.sd" >/dev/null 2>&1) \
    && echo "ok: $tree imports with $venv/bin/python" || { echo "FAILED: $tree does not import with $venv/bin/python" >&2; exit 1; }
done
