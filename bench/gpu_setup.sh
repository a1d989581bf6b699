#!/usr/bin/env bash
# Source on the GPU machine (repo root as cwd), with .whl and .gpu carried:
#   . bench/gpu_setup.sh
# Installs the carried wheels (ComfyUI's server deps the image lacks, comfy-kitchen, comfy-aimdo)
# and the xz-packed files of .gpu/site
# into /tmp/site, unpacks the two trimmed ComfyUI trees to /tmp/trees, prints the stack.
set -e
if [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  # files too large for a carried wheel travel xz-packed as .gpu/site/<path in site-packages>.xz
  # (comfy-kitchen's CUDA library: 48 MB in its wheel, 21 MB so)
  (cd .gpu/site 2>/dev/null && find . -name '*.xz' | while read -r f; do
     mkdir -p "/tmp/site/$(dirname "$f")"; xz -dc "$f" > "/tmp/site/${f%.xz}"; chmod +x "/tmp/site/${f%.xz}"; done)
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
rm -rf /tmp/trees; if true; then
  mkdir -p /tmp/trees && tar -xJf .gpu/comfy_trees.tar.xz -C /tmp/trees
fi
export COMFY080=/tmp/trees/ComfyUI-0.8.0 COMFY033=/tmp/trees/ComfyUI-0.33.0
python3 -c "import numpy, numba, torch; from importlib.metadata import version as v; print('numpy', numpy.__version__, 'numba', numba.__version__, 'numba-cuda', v('numba-cuda'), 'torch', torch.__version__, 'comfy-kitchen', v('comfy-kitchen'), 'comfy-aimdo', v('comfy-aimdo'))"
set +e
