#!/usr/bin/env bash
# The first prompt of a real ComfyUI server, stock vs the pack, with numba's on-disk cache empty
# (first start after an install / update) and filled (a restart).  On the GPU machine, repo root as
# cwd, after `. bench/gpu_setup.sh`:   bash bench/e2e/gpu_first_prompt.sh TREE OUTDIR [TAG]
# Servers, one after another (each a fresh main.py with ComfyUI's default flags; the pack's cache is
# its in-tree cuda_kernels/__pycache__, as in a user's custom_nodes):
#   cold_patched  cache emptied -> first prompt FluxNumbaPatch (exact) + FluxNumbaVAEPatch, then one more
#   warm_stock    cache full    -> first prompt stock, then one more
#   warm_patched  cache full    -> first prompt patched (a restart)
#   cold_stock    cache emptied -> first prompt stock while the pack builds its kernels in the background
# (STEPS="cold_patched warm_stock" runs those alone, in that order)
# Seconds are ComfyUI's own execution_start -> execution_success; "first" = the server's first prompt.
set -uo pipefail
tree=$1; out=$2; tag=${3:-$(basename "$tree")}
mkdir -p "$out"
G="python3 bench/e2e/gpu_server.py --comfy $tree --steps 28 --res 1024 --prompt-timeout 150 --flags="
clear_cache() { find cuda_kernels -name '*.nbi' -delete; find cuda_kernels -name '*.nbc' -delete; }
for step in ${STEPS:-cold_patched warm_stock warm_patched cold_stock}; do
  case $step in
    cold_patched) clear_cache; cases=patched; rep=2;;
    warm_stock) cases=stock; rep=2;;
    warm_patched) cases=patched; rep=1;;
    cold_stock) clear_cache; cases=stock; rep=1;;
  esac
  $G --cases $cases --repeat $rep --json "$out/${tag}_$step.json" --logs "$out/logs_${tag}_$step" > "$out/${tag}_$step.txt" 2>&1
  echo "== $tag $step: $(grep -E "^[0-9.]+ +\(default\)" "$out/${tag}_$step.txt" | head -1)"
  grep -h -E "kernel build|building [0-9]+ kernels" "$out/logs_${tag}_$step"/*.log 2>/dev/null | sed 's/^/   /' | head -3
done
